//! GGUF export: a Llama written by `gguf::write_llama` reads back through lemo's own reader with
//! the same configuration and the same tensors (F32 vectors exactly, F16 matrices to f16 rounding,
//! Q8_0 matrices within half a quantization step).

use std::collections::HashMap;

use half::f16;
use lemo_models::ModelConfig;
use lemo_models::config::LlamaConfig;
use lemo_models::config::RopeScaling;
use lemo_models::gguf::{GgmlType, GgufFile, GgufPrecision, GgufWeights, Value, write_llama};
use lemo_models::weights::{Checkpoint, SafetensorsWeights, StoredTensor, WeightSource};

/// Writes the Llama fixture as GGUF with linear RoPE scaling x2, reads it back, and checks each
/// tensor with `check(type, original, read back)`.
fn round_trip(precision: GgufPrecision, mut check: impl FnMut(&str, GgmlType, &[f32], &[f32])) {
    let fixture = lemo_test_support::hf_fixture("llama_gqa_tied");
    let ModelConfig::Llama(mut config) = ModelConfig::from_file(&fixture).unwrap() else {
        panic!("a Llama fixture");
    };
    config.rope.scaling = RopeScaling::Linear { factor: 2.0 };
    let mut weights = SafetensorsWeights::open(&fixture).unwrap();
    let tensors = weights.tensors();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    let tokenizer = HashMap::from([(
        "tokenizer.ggml.model".to_string(),
        Value::String("none".into()),
    )]);
    write_llama(
        &path,
        "fixture",
        &config,
        &tokenizer,
        &tensors,
        precision,
        |t| Ok(weights.fetch(&t.name, &t.shape)?.unwrap()),
    )
    .unwrap();

    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.header.version, 3);
    // GGUF stores floats as f32, and the special token ids with the tokenizer (none here).
    let mut expected = config.clone();
    expected.rms_norm_eps = config.rms_norm_eps as f32 as f64;
    expected.bos_token_id = None;
    expected.eos_token_id = Vec::new();
    assert_eq!(file.llama_config().unwrap(), expected);
    // The type of a tensor follows from its shape alone.
    let types: HashMap<Vec<usize>, GgmlType> = file
        .header
        .tensors
        .values()
        .map(|info| (info.shape(), info.ggml_type))
        .collect();
    let mut read = GgufWeights::new(file, &config);
    let listed = |list: Vec<StoredTensor>| -> Vec<(String, Vec<usize>)> {
        list.into_iter().map(|t| (t.name, t.shape)).collect()
    };
    assert_eq!(listed(read.tensors()), listed(tensors.clone()));
    for tensor in &tensors {
        let original = weights.fetch(&tensor.name, &tensor.shape).unwrap().unwrap();
        let back = read.fetch(&tensor.name, &tensor.shape).unwrap().unwrap();
        check(&tensor.name, types[&tensor.shape], &original, &back);
    }
}

fn assert_f16_rounded(name: &str, original: &[f32], back: &[f32]) {
    for (index, (o, b)) in original.iter().zip(back).enumerate() {
        assert_eq!(f16::from_f32(*o).to_f32(), *b, "{name}[{index}]");
    }
}

#[test]
fn f16_export_reads_back_rounded_to_f16() {
    round_trip(
        GgufPrecision::F16,
        |name, ggml_type, original, back| match ggml_type {
            GgmlType::F32 => assert_eq!(original, back, "{name}"),
            GgmlType::F16 => assert_f16_rounded(name, original, back),
            other => panic!("{name}: {other:?} in an F16 export"),
        },
    );
}

#[test]
fn q8_0_export_reads_back_within_half_a_step() {
    let mut quantized = 0;
    round_trip(GgufPrecision::Q8_0, |name, ggml_type, original, back| {
        match ggml_type {
            GgmlType::F32 => assert_eq!(original, back, "{name}"),
            // Rows of 48 values are not whole Q8_0 blocks of 32.
            GgmlType::F16 => assert_f16_rounded(name, original, back),
            GgmlType::Q8_0 => {
                for (block, (o, b)) in original.chunks(32).zip(back.chunks(32)).enumerate() {
                    let step = o.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
                    let error = o
                        .iter()
                        .zip(b)
                        .fold(0.0f32, |m, (o, b)| m.max((o - b).abs()));
                    // Half a step, and the f16 rounding of the scale over 127 steps.
                    assert!(
                        error <= step * (0.5 + 127.0 / 2048.0),
                        "{name} block {block}: {error} over a step of {step}"
                    );
                }
                quantized += 1;
            }
            other => panic!("{name}: {other:?} in a Q8_0 export"),
        }
    });
    assert!(quantized > 0, "some matrices are Q8_0");
}

/// `fixture` written as an F32 GGUF with its own configuration, and the path.
fn export_fixture(fixture: &str, dir: &std::path::Path) -> (std::path::PathBuf, LlamaConfig) {
    let fixture = lemo_test_support::hf_fixture(fixture);
    let ModelConfig::Llama(config) = ModelConfig::from_file(&fixture).unwrap() else {
        panic!("a Llama fixture");
    };
    let mut weights = SafetensorsWeights::open(&fixture).unwrap();
    let tensors = weights.tensors();
    let path = dir.join("model.gguf");
    let tokenizer = HashMap::from([(
        "tokenizer.ggml.model".to_string(),
        Value::String("none".into()),
    )]);
    write_llama(
        &path,
        "fixture",
        &config,
        &tokenizer,
        &tensors,
        GgufPrecision::F32,
        |t| Ok(weights.fetch(&t.name, &t.shape)?.unwrap()),
    )
    .unwrap();
    (path, config)
}

/// Llama 3.1 scaling goes to GGUF as llama.cpp's converter writes it, one divisor per frequency
/// pair in `rope_freqs.weight` (for this fixture `[1, 2.4423, 8, ...]`, see the fixture README),
/// and a model read from that file scores like transformers with the `llama3` config.
#[test]
fn llama3_scaling_travels_as_rope_freqs() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = export_fixture("llama_rope_llama3_old_config", dir.path());
    let file = GgufFile::open(&path).unwrap();
    let RopeScaling::FrequencyFactors(factors) = file.llama_config().unwrap().rope.scaling else {
        panic!("rope_freqs.weight read as per-pair factors");
    };
    let expected = [1.0, 2.4423, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0];
    for (i, (ours, want)) in factors.iter().zip(expected).enumerate() {
        assert!((ours - want).abs() < 1e-4, "factor {i}: {ours} vs {want}");
    }
    crate::common::transformers::assert_nll_matches_transformers(
        &path,
        "llama_rope_llama3_old_config",
    );
}

#[test]
fn yarn_scaling_travels_as_llama_cpp_keys() {
    let dir = tempfile::tempdir().unwrap();
    let (path, config) = export_fixture("llama_rope_yarn", dir.path());
    let file = GgufFile::open(&path).unwrap();
    let key = |name: &str| {
        file.metadata(&format!("llama.rope.scaling.{name}"))
            .cloned()
    };
    assert_eq!(key("type"), Some(Value::String("yarn".into())));
    assert_eq!(key("original_context_length"), Some(Value::U32(2048)));
    assert_eq!(file.llama_config().unwrap().rope, config.rope);
    crate::common::transformers::assert_nll_matches_transformers(&path, "llama_rope_yarn");
}

#[test]
fn dynamic_ntk_has_no_gguf_form() {
    let fixture = lemo_test_support::hf_fixture("llama_rope_dynamic_old_config");
    let ModelConfig::Llama(config) = ModelConfig::from_file(&fixture).unwrap() else {
        panic!("a Llama fixture");
    };
    let dir = tempfile::tempdir().unwrap();
    let error = write_llama(
        &dir.path().join("model.gguf"),
        "fixture",
        &config,
        &HashMap::new(),
        &[],
        GgufPrecision::F32,
        |_| unreachable!(),
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("dynamic NTK"), "{error}");
    assert!(!error.contains('\n'));
}
