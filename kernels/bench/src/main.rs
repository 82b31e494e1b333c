//! bf16 parity and throughput of lemo-kernels' flash attention on CUDA.
//!
//! Parity: reads the cases `kernels/reference/attention_sdpa.py --parity-dir` wrote (bf16
//! inputs, float32 reference outputs and gradients, and SDPA's own bf16 error), runs our
//! forward and backward on the same inputs and reports both errors.
//! Throughput: causal bf16 attention, q `[1, heads, S, head_dim]` and k/v
//! `[1, kv_heads, S, head_dim]`, for each S and each kv_heads (GQA below `heads`), device-timed
//! (CubeCL profiling), warm-up then median, FLOPs counted like the SDPA script
//! (forward `4 * B * H * S^2 * D / 2` with H the query heads, backward 2.5x the forward; with
//! `--s2-group G`, S2 attention in groups of G, its FLOPs counted over the groups: on cuDNN it
//! runs as causal attention over the groups, folded into the batch by strides).
//!
//! Usage: `attention_bench [--parity-dir DIR] [--seqs 4096,16384,65536] [--heads 32]
//!         [--kv-heads 32,8] [--head-dim 128] [--iterations 5] [--variants plain,tensor-core]
//!         [--s2-group G] [--dq-accumulator-limit BYTES] [--out FILE] [--wgpu]` (`--seqs ''`:
//!         parity alone; `--dq-accumulator-limit 1` runs cuDNN's backward one key/value head and
//!         one sequence at a time, reported as the variant `cudnn-pieces`)

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::tensor::{DType, Distribution, Tensor, TensorData};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime};
use cubecl::prelude::{ComputeClient, Runtime};
use lemo_kernels::attention::{
    self, AttentionOptions, FlashKernel, set_flash_kernel, tensor_core_supported,
};
use lemo_kernels::{CudaBackend, WgpuBackend};
use serde_json::{Value, json};

struct Args {
    parity_dir: Option<PathBuf>,
    seqs: Vec<usize>,
    heads: usize,
    /// Key/value head counts, one timed shape each; `heads` alone unless given.
    kv_heads: Vec<usize>,
    head_dim: usize,
    iterations: usize,
    out: Option<PathBuf>,
    /// Smoke-test the harness on wgpu in f32 (CPU-only machines have no bf16 there).
    wgpu: bool,
    /// Kernel variants to check and time (a separate process per variant keeps a crash of one
    /// from losing the other's results).
    variants: Vec<FlashKernel>,
    /// Time S2 attention with groups of this many tokens instead of plain causal attention.
    s2_group: Option<usize>,
    /// cuDNN's backward in pieces whose dQ accumulator stays under this many bytes.
    dq_accumulator_limit: Option<u64>,
}

fn parse_args() -> Args {
    let mut args = Args {
        parity_dir: None,
        seqs: vec![4096, 16384, 65536],
        heads: 32,
        kv_heads: Vec::new(),
        head_dim: 128,
        iterations: 5,
        out: None,
        wgpu: false,
        variants: vec![FlashKernel::Plain, FlashKernel::TensorCore],
        s2_group: None,
        dq_accumulator_limit: None,
    };
    let mut raw = std::env::args().skip(1);
    while let Some(flag) = raw.next() {
        let mut value = || raw.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--parity-dir" => args.parity_dir = Some(value().into()),
            "--seqs" => {
                // An empty list times nothing (parity alone).
                args.seqs = value()
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse().expect("--seqs: comma-separated integers"))
                    .collect()
            }
            "--heads" => args.heads = value().parse().expect("--heads: integer"),
            "--kv-heads" => {
                args.kv_heads = value()
                    .split(',')
                    .map(|s| s.parse().expect("--kv-heads: comma-separated integers"))
                    .collect()
            }
            "--head-dim" => args.head_dim = value().parse().expect("--head-dim: integer"),
            "--iterations" => args.iterations = value().parse().expect("--iterations: integer"),
            "--out" => args.out = Some(value().into()),
            "--wgpu" => args.wgpu = true,
            "--s2-group" => args.s2_group = Some(value().parse().expect("--s2-group: integer")),
            "--dq-accumulator-limit" => {
                let bytes = value().parse().expect("--dq-accumulator-limit: integer");
                args.dq_accumulator_limit = Some(bytes);
                attention::set_cudnn_dq_accumulator_limit(Some(bytes));
            }
            "--variants" => {
                args.variants = value()
                    .split(',')
                    .map(|name| match name {
                        "plain" => FlashKernel::Plain,
                        "tensor-core" => FlashKernel::TensorCore,
                        "cudnn" => FlashKernel::Cudnn,
                        other => panic!("--variants: unknown variant {other}"),
                    })
                    .collect()
            }
            other => panic!("unknown argument {other}"),
        }
    }
    if args.kv_heads.is_empty() {
        args.kv_heads = vec![args.heads];
    }
    for &kv_heads in &args.kv_heads {
        assert!(
            kv_heads > 0 && args.heads.is_multiple_of(kv_heads),
            "--kv-heads: {kv_heads} does not divide --heads {}",
            args.heads
        );
    }
    args
}

/// The variant that actually runs: the tensor-core one falls back to plain where unsupported.
fn variant_name<R: CubeRuntime>(
    variant: FlashKernel,
    args: &Args,
    client: &ComputeClient<R>,
    dtype: DType,
    head_dim: usize,
) -> &'static str {
    match variant {
        FlashKernel::Cudnn if args.dq_accumulator_limit.is_some() => "cudnn-pieces",
        FlashKernel::Cudnn => "cudnn",
        FlashKernel::TensorCore if tensor_core_supported(client, dtype, head_dim) => "tensor-core",
        _ => "plain",
    }
}

fn read_values(path: &Path, bf16: bool) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if bf16 {
        bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()
    } else {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }
}

/// A device tensor of `dtype` from a raw little-endian bf16 file (exact: staged through f32).
fn load_bf16<R: CubeRuntime, BT: BoolElement>(
    path: &Path,
    shape: [usize; 4],
    dtype: DType,
) -> Tensor<CubeBackend<R, f32, i32, BT>, 4> {
    let data = TensorData::new(read_values(path, true), shape);
    Tensor::<CubeBackend<R, f32, i32, BT>, 4>::from_data(data, &Default::default()).cast(dtype)
}

fn to_f32<R: CubeRuntime, BT: BoolElement, const D: usize>(
    tensor: Tensor<CubeBackend<R, f32, i32, BT>, D>,
) -> Vec<f32> {
    tensor.cast(DType::F32).into_data().to_vec::<f32>().unwrap()
}

/// `max |actual - expected| / max |expected|`.
fn relative_error(actual: &[f32], expected: &[f32]) -> f64 {
    assert_eq!(actual.len(), expected.len());
    let scale = expected.iter().fold(0f32, |m, x| m.max(x.abs()));
    let error = actual
        .iter()
        .zip(expected)
        .fold(0f32, |m, (a, e)| m.max((a - e).abs()));
    (error / scale.max(1e-12)) as f64
}

/// `[batch, heads, rows, head_dim]` of a manifest case's queries (`q_heads`, its `q_len` last
/// positions where given) or keys (`kv_heads`, every position).
fn dims(case: &Value, heads_key: &str) -> [usize; 4] {
    let get = |key: &str| case[key].as_u64().expect("manifest field") as usize;
    let rows = match heads_key {
        "q_heads" => case["q_len"]
            .as_u64()
            .map_or(get("seq"), |q_len| q_len as usize),
        _ => get("seq"),
    };
    [get("batch"), get(heads_key), rows, get("head_dim")]
}

/// Our bf16 errors against the float32 reference, next to SDPA's, for every manifest case.
fn parity<R: CubeRuntime, BT: BoolElement>(dir: &Path, dtype: DType, args: &Args) -> Vec<Value> {
    let manifest: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("manifest.json")).expect("parity manifest"),
    )
    .expect("manifest JSON");
    let mut results = Vec::new();
    for case in manifest["cases"].as_array().expect("cases") {
        let name = case["name"].as_str().expect("case name");
        let file = |tensor: &str, ext: &str| dir.join(format!("{name}_{tensor}.{ext}"));
        let q_shape = dims(case, "q_heads");
        let kv_shape = dims(case, "kv_heads");
        let mut options = AttentionOptions::causal(q_shape[3]);
        if let Some(window) = case["window"].as_u64() {
            options = options.with_sliding_window(window as usize);
        }
        if let Some(group) = case["group"].as_u64() {
            options = options.with_shifted_groups(group as usize);
        }
        let q = load_bf16::<R, BT>(&file("q", "bf16"), q_shape, dtype);
        let k = load_bf16::<R, BT>(&file("k", "bf16"), kv_shape, dtype);
        let v = load_bf16::<R, BT>(&file("v", "bf16"), kv_shape, dtype);
        let grad_out = load_bf16::<R, BT>(&file("do", "bf16"), q_shape, dtype);

        let client = q.clone().into_primitive().tensor().client.clone();
        for &variant in &args.variants {
            set_flash_kernel(variant);
            let (out, lse) =
                attention::attention_with_lse(q.clone(), k.clone(), v.clone(), options);
            let (dq, dk, dv) = attention::attention_backward(
                q.clone(),
                k.clone(),
                v.clone(),
                out.clone(),
                lse,
                grad_out.clone(),
                options,
            );
            let mut errors = serde_json::Map::new();
            let mut passed = true;
            for (tensor, ours) in [("out", out), ("dq", dq), ("dk", dk), ("dv", dv)] {
                let expected = read_values(&file(tensor, "f32"), false);
                let error = relative_error(&to_f32(ours), &expected);
                let sdpa_error = case["sdpa_error"][tensor].as_f64().unwrap_or(f64::NAN);
                // bf16 rounding of the inputs/outputs dominates; allow twice SDPA's own error.
                let ok = error <= (2.0 * sdpa_error).max(1e-2);
                passed &= ok;
                errors.insert(
                    tensor.into(),
                    json!({ "ours": error, "sdpa": sdpa_error, "ok": ok }),
                );
            }
            let variant = variant_name(variant, args, &client, dtype, q_shape[3]);
            println!(
                "parity {name} ({variant}): {}",
                Value::Object(errors.clone())
            );
            results.push(json!({
                "case": name,
                "variant": variant,
                "passed": passed,
                "relative_error": errors,
            }));
        }
    }
    results
}

/// Device time of `run`: median of up to `iterations` runs after one warm-up, stopping early
/// once the timed runs add up to `TIME_BUDGET` (the slow variants at 64K).
fn device_time<R: Runtime, O: Send + 'static>(
    client: &ComputeClient<R>,
    iterations: usize,
    run: impl Fn() -> O + Send + Sync,
) -> Duration {
    const TIME_BUDGET: Duration = Duration::from_secs(20);
    drop(run());
    let mut times = Vec::new();
    while times.len() < iterations.max(1) && times.iter().sum::<Duration>() < TIME_BUDGET {
        let (output, duration) = client.profile(&run, "attention").expect("profiling");
        drop(output);
        times.push(cubecl::future::block_on(duration.resolve()).duration());
    }
    times.sort();
    times[times.len() / 2]
}

fn throughput<R: CubeRuntime, BT: BoolElement>(args: &Args, dtype: DType) -> Vec<Value> {
    let device = Default::default();
    let mut results = Vec::new();
    for &seq in &args.seqs {
        for &kv_heads in &args.kv_heads {
            let random = |heads: usize| {
                Tensor::<CubeBackend<R, f32, i32, BT>, 4>::random(
                    [1, heads, seq, args.head_dim],
                    Distribution::Normal(0.0, 1.0),
                    &device,
                )
                .cast(dtype)
            };
            let (q, k, v, grad_out) = (
                random(args.heads),
                random(kv_heads),
                random(kv_heads),
                random(args.heads),
            );
            let client = q.clone().into_primitive().tensor().client.clone();
            let causal = AttentionOptions::causal(args.head_dim);
            let (options, forward_flops) = match args.s2_group {
                None => (
                    causal,
                    4.0 * (args.heads * args.head_dim) as f64 * (seq as f64).powi(2) / 2.0,
                ),
                // Each half of the heads over its own groups.
                Some(group) => {
                    let pairs: f64 = [0, group / 2]
                        .into_iter()
                        .flat_map(|shift| AttentionOptions::shifted_groups(seq, group, shift))
                        .map(|groups| (groups.len() as f64).powi(2) / 2.0)
                        .sum();
                    let flops = 4.0 * args.head_dim as f64 * args.heads as f64 / 2.0 * pairs;
                    (causal.with_shifted_groups(group), flops)
                }
            };

            let mut timings = Vec::new();
            for &variant in &args.variants {
                set_flash_kernel(variant);
                let forward = device_time(&client, args.iterations, || {
                    attention::attention_with_lse(q.clone(), k.clone(), v.clone(), options)
                        .0
                        .into_primitive()
                        .tensor()
                });
                let (out, lse) =
                    attention::attention_with_lse(q.clone(), k.clone(), v.clone(), options);
                let backward = device_time(&client, args.iterations, || {
                    let (dq, dk, dv) = attention::attention_backward(
                        q.clone(),
                        k.clone(),
                        v.clone(),
                        out.clone(),
                        lse.clone(),
                        grad_out.clone(),
                        options,
                    );
                    [dq, dk, dv].map(|t| t.into_primitive().tensor())
                });
                timings.push(("forward", variant, forward, forward_flops));
                timings.push(("backward", variant, backward, 2.5 * forward_flops));
            }
            let bytes_in_use = client.memory_usage().map(|m| m.bytes_in_use).unwrap_or(0);
            for (pass, variant, time, flops) in timings {
                let tflops = flops / time.as_secs_f64() / 1e12;
                println!(
                    "{pass} ({variant:?}) S={seq} kv={kv_heads}: {:.3} ms, {tflops:.1} TFLOP/s",
                    time.as_secs_f64() * 1e3
                );
                results.push(json!({
                    "kernel": format!("attention_{pass}"),
                    "variant": variant_name(variant, args, &client, dtype, args.head_dim),
                    "batch": 1, "heads": args.heads, "kv_heads": kv_heads, "seq": seq,
                    "head_dim": args.head_dim,
                    "dtype": format!("{dtype:?}").to_lowercase(), "causal": true,
                    "s2_group": args.s2_group,
                    "median_ms": time.as_secs_f64() * 1e3,
                    "tflops": tflops,
                    "device_bytes_in_use": bytes_in_use,
                }));
            }
        }
    }
    results
}

fn run<R: CubeRuntime, BT: BoolElement>(args: &Args, dtype: DType) -> (Vec<Value>, Vec<Value>) {
    let parity = args
        .parity_dir
        .as_deref()
        .map(|dir| parity::<R, BT>(dir, dtype, args))
        .unwrap_or_default();
    (parity, throughput::<R, BT>(args, dtype))
}

/// The runtime and bool type of a `CubeBackend` alias.
trait CubeAlias {
    type Runtime: CubeRuntime;
    type Bool: BoolElement;
}

impl<R: CubeRuntime, BT: BoolElement> CubeAlias for CubeBackend<R, f32, i32, BT> {
    type Runtime = R;
    type Bool = BT;
}

fn main() {
    let args = parse_args();
    let (parity, timings) = if args.wgpu {
        run::<<WgpuBackend as CubeAlias>::Runtime, <WgpuBackend as CubeAlias>::Bool>(
            &args,
            DType::F32,
        )
    } else {
        run::<<CudaBackend as CubeAlias>::Runtime, <CudaBackend as CubeAlias>::Bool>(
            &args,
            DType::BF16,
        )
    };
    let report = json!({
        "implementation": "lemo-kernels flash attention (plain tiled CubeCL kernels)",
        "parity": parity,
        "timings": timings,
    });
    let text = serde_json::to_string_pretty(&report).unwrap();
    match &args.out {
        Some(path) => std::fs::write(path, text).expect("writing the report"),
        None => println!("{text}"),
    }
}
