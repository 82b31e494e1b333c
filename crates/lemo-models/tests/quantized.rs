//! Frozen weights kept quantized: the device's dequantization of every kept GGUF block type
//! against the host dequantizers that `gguf.rs` checks against llama.cpp; NF4 with double
//! quantization against `fixtures/quantized/nf4.json`, which `nf4_reference.py` computes from
//! bitsandbytes' published code book and algorithm; the Q4_K quantizer; products and gradients
//! through a quantized projection; loading with `--quantize-base`; and SmolLM2's Q4_1 GGUF kept
//! quantized against the same file dequantized at load.

use std::path::Path;

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, ElementConversion, Tensor, TensorData};
use half::f16;
use lemo_kernels::precision::Precision;
use lemo_kernels::{CpuBackend, LemoBackend, WgpuBackend};
use lemo_models::CausalLm;
use lemo_models::gguf::GgmlType;
use lemo_models::lora::{Linear, LoraConfig};
use lemo_models::quantized::nf4::{NF4_CODE, Nf4, dynamic_map};
use lemo_models::quantized::{FrozenWeight, PackedWeight, QuantizeBase, QuantizedWeight, q4_k};
use lemo_models::token_plan::TokenSparsity;
use lemo_test_support::{
    HostRng, assert_close, assert_close_values, hf_fixture, random, read_json, seed, smollm2_gguf,
};

type B = CpuBackend;

fn host<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

fn tensor<Bk: Backend>(values: Vec<f32>, shape: [usize; 2], device: &Bk::Device) -> Tensor<Bk, 2> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// A finite f16 scale of either sign, `2^-10` to 1 in magnitude.
fn scale(rng: &mut HostRng) -> [u8; 2] {
    let magnitude = 2f32.powf(-(rng.below(1000) as f32) / 100.0);
    let sign = if rng.below(2) == 0 { 1.0 } else { -1.0 };
    f16::from_f32(sign * magnitude).to_le_bytes()
}

/// Random blocks of `t` for `[rows, cols]`: random bytes, with finite f16 scales where the
/// block holds them.
fn random_blocks(t: GgmlType, [rows, cols]: [usize; 2], rng: &mut HostRng) -> Vec<u8> {
    let len = t.byte_size(cols, rows * cols).unwrap();
    let mut bytes: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
    let block_bytes = len / (rows * cols / t.block_values());
    let scales: &[usize] = match t {
        GgmlType::Q4_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q4_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => unreachable!(),
    };
    for block in bytes.chunks_exact_mut(block_bytes) {
        for &at in scales {
            block[at..at + 2].copy_from_slice(&scale(rng));
        }
    }
    bytes
}

const KEPT_TYPES: [GgmlType; 5] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
];

fn check_ggml_on<Bk: LemoBackend>(tolerance: f32) {
    let mut rng = HostRng::new(seed());
    let device = Default::default();
    for t in KEPT_TYPES {
        let shape = [3, 2 * 256];
        let bytes = random_blocks(t, shape, &mut rng);
        let packed = PackedWeight::from_ggml(t, shape, &bytes);
        // The device holds the file's bytes, give or take the words' padding (Q4_K: its 6-bit
        // scales and minimums take a byte each, 148 bytes a block instead of 144).
        assert!(
            packed.bytes() as f64 <= 1.03 * bytes.len() as f64 + 16.0,
            "{t:?}: {} bytes on the device for {} in the file",
            packed.bytes(),
            bytes.len()
        );
        let weight = QuantizedWeight::<Bk>::new(&packed, &device, DType::F32);
        let expected = tensor::<Bk>(t.dequantize(&bytes), shape, &device);
        assert_close(&format!("{t:?}"), weight.dequantize(), expected, tolerance);
    }
}

#[test]
fn ggml_blocks_dequantize_on_the_device_as_on_the_host() {
    check_ggml_on::<B>(0.0);
}

/// wgpu may contract `q * d + m` into one rounding: within an f32 rounding of the host's.
#[test]
fn ggml_blocks_dequantize_on_wgpu_as_on_the_host() {
    check_ggml_on::<WgpuBackend>(1e-6);
}

fn nf4_fixture() -> serde_json::Value {
    read_json(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quantized/nf4.json"))
}

fn f32s(value: &serde_json::Value) -> Vec<f32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn nf4_matches_bitsandbytes_code_book_and_algorithm() {
    let fixture = nf4_fixture();
    assert_eq!(NF4_CODE.to_vec(), f32s(&fixture["nf4_code"]));
    assert_eq!(dynamic_map().to_vec(), f32s(&fixture["dynamic_map"]));
    let values = f32s(&fixture["values"]);
    let nf4 = Nf4::quantize(&values);
    let codes: String = nf4.codes.iter().map(|c| format!("{c:x}")).collect();
    assert_eq!(codes, fixture["codes"].as_str().unwrap(), "4-bit codes");
    let absmax_codes: Vec<u8> = fixture["absmax_codes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_u64().unwrap() as u8)
        .collect();
    assert_eq!(
        nf4.absmax_codes, absmax_codes,
        "8-bit codes of the block maxima"
    );
    assert_eq!(nf4.absmax_scales, f32s(&fixture["absmax_scales"]));
    assert_eq!(
        nf4.absmax_mean,
        fixture["absmax_mean"].as_f64().unwrap() as f32
    );
    let expected = f32s(&fixture["dequantized"]);
    assert_eq!(
        nf4.dequantize(values.len()),
        expected,
        "dequantized on the host"
    );

    let shape = [1, values.len()];
    let packed = PackedWeight::from_nf4(shape, nf4);
    let device = Default::default();
    let weight = QuantizedWeight::<B>::new(&packed, &device, DType::F32);
    assert_close(
        "NF4 on the device",
        weight.dequantize(),
        tensor::<B>(expected, shape, &device),
        0.0,
    );
}

/// Several blocks of block maxima, and the size QLoRA quotes: about 4.127 bits a value.
#[test]
fn nf4_dequantizes_on_the_device_as_on_the_host() {
    let device = Default::default();
    lemo_test_support::seed_backend::<B>(&device);
    let shape = [300, 130];
    let values = host(random::<B, 2>(shape, &device));
    let nf4 = Nf4::quantize(&values);
    let on_host = nf4.dequantize(values.len());
    // Within half the code book's widest gap (-1 to -0.696) of each block's maximum, plus the
    // error of the maximum's 8-bit code.
    for (block, (x, y)) in values.chunks(64).zip(on_host.chunks(64)).enumerate() {
        let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let error = x.iter().zip(y).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            error <= 0.16 * max,
            "block {block}: error {error}, maximum {max}"
        );
    }
    let packed = PackedWeight::from_nf4(shape, nf4);
    // QLoRA's layout: 4-bit codes of whole 64-value blocks, the blocks' 8-bit maxima in whole
    // groups of 256, an f32 scale per group and the maxima's mean: 4.127 bits a value on large
    // weights, more here where the last group is mostly padding.
    let blocks = values.len().div_ceil(64);
    let groups = blocks.div_ceil(256);
    let expected = blocks * 64 / 2 + groups * 256 + 4 * groups + 4;
    assert_eq!(packed.bytes(), expected, "bytes of the packed NF4 weight");
    for (name, dequantized) in [
        (
            "cpu",
            host(QuantizedWeight::<B>::new(&packed, &device, DType::F32).dequantize()),
        ),
        (
            "wgpu",
            host(
                QuantizedWeight::<WgpuBackend>::new(&packed, &Default::default(), DType::F32)
                    .dequantize(),
            ),
        ),
    ] {
        assert_close_values(&format!("NF4 on {name}"), &dequantized, &on_host, 1e-6);
    }
}

/// Each value within one step of its sub-block's 16 levels, through ggml's Q4_K decoder.
#[test]
fn q4_k_quantizer_writes_blocks_ggml_decodes() {
    let device = Default::default();
    lemo_test_support::seed_backend::<B>(&device);
    let values = host(random::<B, 2>([4, 512], &device));
    let decoded = GgmlType::Q4_K.dequantize(&q4_k::quantize(&values));
    for (sub, (x, y)) in values.chunks(32).zip(decoded.chunks(32)).enumerate() {
        let low = x.iter().fold(0f32, |m, &v| m.min(v));
        let high = x.iter().fold(f32::MIN, |m, &v| m.max(v));
        let step = (high - low) / 15.0;
        let error = x.iter().zip(y).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            error <= step,
            "sub-block {sub}: error {error} over a step {step}"
        );
    }
}

/// A projection with a quantized weight and an adapter gives the outputs and gradients of the
/// same projection with the dequantized weight stored dense.
#[test]
fn quantized_projection_has_the_dense_products_and_gradients() {
    type A = Autodiff<B>;
    let device = Default::default();
    lemo_test_support::seed_backend::<A>(&device);
    let mut rng = HostRng::new(seed());
    let shape = [96, 64];
    let bytes = random_blocks(GgmlType::Q4_0, shape, &mut rng);
    let packed = PackedWeight::from_ggml(GgmlType::Q4_0, shape, &bytes);
    let config = LoraConfig {
        rank: 4,
        ..LoraConfig::default()
    };
    let (a, b) = (
        random::<A, 2>([4, 64], &device),
        random::<A, 2>([96, 4], &device),
    );
    let x = random::<A, 3>([2, 5, 64], &device);
    let run = |weight: FrozenWeight<A>| {
        let linear = Linear::new(weight, None).with_lora(a.clone(), b.clone(), &config);
        let x = x.clone().detach().require_grad();
        let y = linear.forward(x.clone());
        let grads = y.clone().sum().backward();
        let lora = linear.lora.as_ref().unwrap();
        (
            y.inner(),
            x.grad(&grads).unwrap(),
            lora.a.grad(&grads).unwrap(),
            lora.b.grad(&grads).unwrap(),
        )
    };
    let quantized = run(FrozenWeight::Quantized(QuantizedWeight::new(
        &packed,
        &device,
        DType::F32,
    )));
    let dense = run(tensor::<A>(GgmlType::Q4_0.dequantize(&bytes), shape, &device).into());
    assert_close("output", quantized.0, dense.0, 0.0);
    assert_close("d x", quantized.1, dense.1, 0.0);
    assert_close("d A", quantized.2, dense.2, 0.0);
    assert_close("d B", quantized.3, dense.3, 0.0);
}

#[test]
fn quantize_base_names() {
    assert_eq!("nf4".parse(), Ok(QuantizeBase::Nf4));
    assert_eq!("q4_k".parse(), Ok(QuantizeBase::Q4K));
    let error = "q5_k".parse::<QuantizeBase>().unwrap_err();
    assert!(
        error.contains("q5_k") && error.contains("nf4, q4_k, q8_0 or none"),
        "{error}"
    );
}

fn mean_loss<Bk: LemoBackend>(model: &CausalLm<Bk>, ids: &[u32]) -> f64 {
    let device = Default::default();
    let ids: Vec<i32> = ids.iter().map(|&id| id as i32).collect();
    let tokens = Tensor::from_data(TensorData::new(ids.clone(), [1, ids.len()]), &device);
    let (sum, count) = model.next_token_loss_sum(tokens, None, 1024, &mut TokenSparsity::Dense);
    f64::from(sum.into_scalar().elem::<f32>()) / count as f64
}

/// `--quantize-base` on a Hugging Face model: NF4 takes every projection; Q8_0 only those whose
/// rows are whole blocks of 32 (`down_proj`, rows of 128), and says why it kept the others
/// (rows of 48) dense; `none` keeps everything dense.
#[test]
fn quantize_base_at_load() {
    let path = hf_fixture("llama_gqa_tied");
    let device = Default::default();
    let load = |quantize| {
        CausalLm::<B>::from_path_quantized(&path, &device, Precision::F32, quantize).unwrap()
    };
    let (dense, config, summary) = load(QuantizeBase::None);
    let vocab = config.vocab_size() as u32;
    let ids: Vec<u32> = (0..48).map(|i| (i * 37 + 5) % vocab).collect();
    assert!(summary.kept.is_empty() && summary.notes.is_empty());
    let dense_loss = mean_loss(&dense, &ids);

    let (nf4, _, summary) = load(QuantizeBase::Nf4);
    println!("{:#?}", summary.lines());
    assert_eq!(summary.kept["NF4"].0, 14);
    let nf4_loss = mean_loss(&nf4, &ids);
    let relative = (nf4_loss - dense_loss).abs() / dense_loss;
    println!("loss dense {dense_loss:.5}, NF4 {nf4_loss:.5} (relative {relative:.1e})");
    assert!(
        relative > 0.0 && relative < 0.02,
        "NF4 loss {nf4_loss} vs dense {dense_loss}"
    );

    let (_, _, summary) = load(QuantizeBase::Q8_0);
    println!("{:#?}", summary.lines());
    assert_eq!(summary.kept["Q8_0"].0, 2);
    assert!(
        summary
            .notes
            .iter()
            .any(|n| n.contains("rows of 48") && n.contains("kept dense")),
        "{:?}",
        summary.notes
    );
}

/// SmolLM2-135M's Q4_1 GGUF kept quantized evaluates to the loss of the same file dequantized
/// at load (the same values: only where they are dequantized differs).
#[test]
fn smollm2_q4_1_kept_quantized_has_the_dequantized_loss() {
    let Some(path) = smollm2_gguf() else { return };
    let device = Default::default();
    let expected =
        read_json(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/smollm2.json"));
    let load = |quantize| {
        CausalLm::<B>::from_path_quantized(&path, &device, Precision::F32, quantize).unwrap()
    };
    let (kept, _, summary) = load(QuantizeBase::Keep);
    println!("{}", summary.lines().join("\n"));
    let projections: usize = summary.kept.values().map(|k| k.0).sum();
    assert_eq!(projections, 30 * 7, "every projection kept quantized");
    let (dequantized, _, summary) = load(QuantizeBase::None);
    assert!(summary.kept.is_empty());
    for (name, case) in expected["eval"].as_object().unwrap() {
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let (a, b) = (mean_loss(&kept, &ids), mean_loss(&dequantized, &ids));
        let relative = (a - b).abs() / b;
        println!("{name}: kept quantized {a:.7}, dequantized {b:.7} (relative {relative:.1e})");
        assert!(relative <= 1e-4, "{name}: {a} vs {b}");
    }
}
