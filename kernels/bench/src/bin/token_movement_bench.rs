//! Permutation-free token movement against the naive path, on one block of a token-sparse
//! layer: `x [1, S, hidden]` is the residual stream, half of its 64-token blocks are kept (the
//! first and last always), and the block's output is its normalized input (the projections in
//! between are the same on every path and left out).
//!
//! - `fused`: gather-RMSNorm (saving the kept rows for the backward pass), then the in-place
//!   scatter-add; backward: gather `d y` from `d out`, then the RMSNorm backward added into
//!   `d out` in place.
//! - `naive_burn`: select the kept rows, RMSNorm (lemo's kernel), zero-pad to `[S, hidden]`, add
//!   to the residual; backward the mirror (select `d y`, RMSNorm backward, zero-pad, add), with
//!   Burn's `select` / `select_assign` (the plain reference in `lemo_kernels::token_movement`).
//! - `naive_kernels`: the same steps with lemo's gather and scatter kernels: only the fusion and
//!   the in-place updates differ from `fused`.
//!
//! Each step updates the residual stream (and, backward, the gradient) that the next step reads,
//! like a stack of layers. Forward is the training forward (what the backward pass needs is
//! saved); forward+backward is one step of each. Timed with cubecl's profiler: loops of
//! back-to-back steps between two device synchronizations, median of repeats (on CUDA that is
//! the host clock between the synchronizations, so host work inside a step counts; on wgpu it
//! sums kernel timestamps and misses it). With `--torch FILE`
//! (from `kernels/reference/token_movement_torch.py`), PyTorch's eager naive path on the same
//! shapes is merged into the report. Parity of the three operations (and of the fused backward
//! against the naive one) comes first, in the benchmark's dtype.
//!
//! Usage: `token_movement_bench [--seqs 4096,8192,16384,32768,65536] [--hidden 4096]
//!         [--keep 0.5] [--repeats 5] [--torch FILE] [--commit C] [--command CMD] [--out FILE]
//!         [--wgpu]` (`--wgpu`: smoke test in f32 on wgpu).

use std::sync::Mutex;
use std::time::Duration;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{
    DType, Distribution, ElementConversion, Int, Tensor, TensorData, TensorPrimitive,
};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime};
use lemo_kernel_bench::time_calls;
use lemo_kernels::ComputeBackend;
use lemo_kernels::fused::NormSaves;
use lemo_kernels::token_movement::{self, reference};
use serde_json::{Value, json};

type Cube<R, BT> = CubeBackend<R, f32, i32, BT>;

/// Rows per token block, as lemo-sparsity keeps them.
const BLOCK: usize = 64;
const EPS: f32 = 1e-5;

struct Args {
    seqs: Vec<usize>,
    hidden: usize,
    keep: f64,
    repeats: usize,
    torch: Option<String>,
    commit: String,
    command: String,
    out: Option<String>,
    wgpu: bool,
}

fn parse_args() -> Args {
    let mut args = Args {
        seqs: vec![4096, 8192, 16384, 32768, 65536],
        hidden: 4096,
        keep: 0.5,
        repeats: 5,
        torch: None,
        commit: "uncommitted".into(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        out: None,
        wgpu: false,
    };
    let mut raw = std::env::args().skip(1);
    while let Some(flag) = raw.next() {
        let mut value = || raw.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--seqs" => {
                args.seqs = value()
                    .split(',')
                    .map(|s| s.parse().expect("--seqs"))
                    .collect()
            }
            "--hidden" => args.hidden = value().parse().expect("--hidden"),
            "--keep" => args.keep = value().parse().expect("--keep"),
            "--repeats" => args.repeats = value().parse().expect("--repeats"),
            "--torch" => args.torch = Some(value()),
            "--commit" => args.commit = value(),
            "--command" => args.command = value(),
            "--out" => args.out = Some(value()),
            "--wgpu" => args.wgpu = true,
            other => panic!("unknown argument {other}"),
        }
    }
    args
}

/// Kept rows `[batch, kept]`: for each sequence, `keep` of its 64-row blocks (the first and
/// the last always), chosen by a fixed-seed generator.
fn kept_rows<B: Backend>(
    batch: usize,
    seq: usize,
    keep: f64,
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    let blocks = seq.div_ceil(BLOCK);
    let kept_blocks = ((blocks as f64 * keep).round() as usize).clamp(2.min(blocks), blocks);
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut rows = Vec::new();
    let mut kept = None;
    for _ in 0..batch {
        let mut order: Vec<usize> = (1..blocks.saturating_sub(1)).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, (next() % (i as u64 + 1)) as usize);
        }
        let mut chosen: Vec<usize> = order[..kept_blocks.saturating_sub(2)].to_vec();
        chosen.extend([0, blocks - 1]);
        chosen.sort_unstable();
        chosen.dedup();
        let sequence: Vec<i32> = chosen
            .iter()
            .flat_map(|block| block * BLOCK..((block + 1) * BLOCK).min(seq))
            .map(|row| row as i32)
            .collect();
        assert_eq!(*kept.get_or_insert(sequence.len()), sequence.len());
        rows.extend(sequence);
    }
    let kept = kept.unwrap_or(0);
    Tensor::from_data(TensorData::new(rows, [batch, kept]), device)
}

/// The residual stream, its weight and a gradient, in `dtype`.
fn inputs<B: Backend>(
    batch: usize,
    seq: usize,
    hidden: usize,
    dtype: DType,
    device: &B::Device,
) -> (Tensor<B, 3>, Tensor<B, 1>, Tensor<B, 3>) {
    let normal = Distribution::Normal(0.0, 1.0);
    let x = Tensor::<B, 3>::random([batch, seq, hidden], normal, device).cast(dtype);
    let weight = (Tensor::<B, 1>::random([hidden], normal, device) * 0.1 + 1.0).cast(dtype);
    let grad = Tensor::<B, 3>::random([batch, seq, hidden], normal, device).cast(dtype);
    (x, weight, grad)
}

#[derive(Clone, Copy, Debug)]
enum Path {
    Fused,
    NaiveBurn,
    NaiveKernels,
}

impl Path {
    const ALL: [Path; 3] = [Path::Fused, Path::NaiveBurn, Path::NaiveKernels];

    fn name(self) -> &'static str {
        match self {
            Path::Fused => "fused",
            Path::NaiveBurn => "naive_burn",
            Path::NaiveKernels => "naive_kernels",
        }
    }

    fn gather<B: ComputeBackend>(self, x: Tensor<B, 3>, rows: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        match self {
            Path::NaiveBurn => reference::gather_rows(x, rows),
            _ => token_movement::gather_rows(x, rows),
        }
    }

    /// `values` zero-padded to `like`'s shape.
    fn pad<B: ComputeBackend>(
        self,
        like: &Tensor<B, 3>,
        rows: Tensor<B, 2, Int>,
        values: Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        match self {
            Path::NaiveBurn => reference::scatter_add_rows(like.zeros_like(), rows, values),
            _ => token_movement::scatter_add_rows(like.zeros_like(), rows, values),
        }
    }
}

/// What the backward pass of a block needs from its forward: the kept input rows and `rstd`.
struct Saved<B: Backend> {
    kept: FloatTensor<B>,
    rstd: FloatTensor<B>,
}

fn float<B: Backend, const D: usize>(tensor: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(tensor))
}

fn prim<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> FloatTensor<B> {
    tensor.into_primitive().tensor()
}

/// The residual stream after the block, and what its backward pass needs.
fn forward<B: ComputeBackend>(
    path: Path,
    x: Tensor<B, 3>,
    rows: &Tensor<B, 2, Int>,
    weight: &Tensor<B, 1>,
) -> (Tensor<B, 3>, Saved<B>) {
    match path {
        Path::Fused => {
            // The gather's handle of `x` is gone once it returns: the scatter-add writes in place.
            let (y, rstd, kept) = B::lemo_gather_rms_norm_forward(
                prim(x.clone()),
                rows.clone().into_primitive(),
                prim(weight.clone()),
                EPS,
                true,
            );
            let out = token_movement::scatter_add_rows(x, rows.clone(), float(y));
            let kept = kept.expect("the kept rows, asked for");
            (out, Saved { kept, rstd })
        }
        naive => {
            let kept = prim(naive.gather(x.clone(), rows.clone()));
            let (y, rstd) = B::lemo_rms_norm_forward(kept.clone(), prim(weight.clone()), EPS);
            let padded = naive.pad(&x, rows.clone(), float(y));
            (x + padded, Saved { kept, rstd })
        }
    }
}

/// `d x` of the block from `d out` (the residual's pass-through plus the kept rows' RMSNorm
/// gradient); the weight is frozen, as in LoRA training.
fn backward<B: ComputeBackend>(
    path: Path,
    grad: Tensor<B, 3>,
    rows: &Tensor<B, 2, Int>,
    weight: &Tensor<B, 1>,
    saved: Saved<B>,
) -> Tensor<B, 3> {
    let grad_y = path.gather(grad.clone(), rows.clone());
    match path {
        Path::Fused => {
            let seq = grad.dims()[1];
            let (grad_x, _) = B::lemo_gather_rms_norm_backward(
                saved.kept,
                rows.clone().into_primitive(),
                prim(weight.clone()),
                saved.rstd,
                prim(grad_y),
                Some(prim(grad)),
                seq,
                false,
                NormSaves::Input,
            );
            float(grad_x)
        }
        naive => {
            let (grad_kept, _) = B::lemo_rms_norm_backward(
                saved.kept,
                prim(weight.clone()),
                saved.rstd,
                prim(grad_y),
                false,
                NormSaves::Input,
            );
            let padded = naive.pad(&grad, rows.clone(), float(grad_kept));
            grad + padded
        }
    }
}

/// `||actual - expected|| / ||expected||` in f32 on the device.
fn relative<B: Backend, const D: usize>(actual: Tensor<B, D>, expected: Tensor<B, D>) -> f64 {
    let actual = actual.cast(DType::F32);
    let expected = expected.cast(DType::F32);
    let diff: f32 = (actual - expected.clone())
        .powi_scalar(2)
        .sum()
        .sqrt()
        .into_scalar()
        .elem();
    let norm: f32 = expected.powi_scalar(2).sum().sqrt().into_scalar().elem();
    let error = (diff / norm.max(1e-30)) as f64;
    if error.is_nan() { f64::INFINITY } else { error }
}

/// The three operations against their references, and the fused block (forward and backward)
/// against the naive one, on two sequences with their own kept rows.
fn parity<B: ComputeBackend>(hidden: usize, dtype: DType, tolerance: f64) -> Vec<Value> {
    let device = Default::default();
    let (batch, seq) = (2, 1000);
    let rows = kept_rows::<B>(batch, seq, 0.5, &device);
    let (x, weight, grad) = inputs::<B>(batch, seq, hidden, dtype, &device);
    let kept = rows.dims()[1];
    let values = Tensor::<B, 3>::random(
        [batch, kept, hidden],
        Distribution::Normal(0.0, 1.0),
        &device,
    );
    let mut checks = vec![
        (
            "gather_rms_norm",
            relative(
                token_movement::gather_rms_norm(
                    x.clone(),
                    rows.clone(),
                    weight.clone(),
                    EPS,
                    NormSaves::Input,
                ),
                reference::gather_rms_norm(x.clone(), rows.clone(), weight.clone(), EPS),
            ),
        ),
        (
            "gather_rows",
            relative(
                token_movement::gather_rows(x.clone(), rows.clone()),
                reference::gather_rows(x.clone(), rows.clone()),
            ),
        ),
        (
            "scatter_add_rows_f32_values",
            relative(
                token_movement::scatter_add_rows(x.clone(), rows.clone(), values.clone()),
                reference::scatter_add_rows(x.clone(), rows.clone(), values.clone()),
            ),
        ),
        (
            "scatter_add_rows",
            relative(
                token_movement::scatter_add_rows(
                    x.clone(),
                    rows.clone(),
                    values.clone().cast(dtype),
                ),
                reference::scatter_add_rows(x.clone(), rows.clone(), values.cast(dtype)),
            ),
        ),
    ];
    let (fused_out, fused_saved) = forward(Path::Fused, x.clone(), &rows, &weight);
    let (naive_out, naive_saved) = forward(Path::NaiveBurn, x, &rows, &weight);
    checks.push(("block_forward", relative(fused_out, naive_out)));
    checks.push((
        "block_backward",
        relative(
            backward(Path::Fused, grad.clone(), &rows, &weight, fused_saved),
            backward(Path::NaiveBurn, grad, &rows, &weight, naive_saved),
        ),
    ));
    checks
        .into_iter()
        .map(|(check, error)| {
            let ok = error <= tolerance;
            println!(
                "parity {check}: {error:.2e} {}",
                if ok { "ok" } else { "FAIL" }
            );
            json!({"check": check, "relative_error": error, "tolerance": tolerance, "ok": ok})
        })
        .collect()
}

/// Device time of one step of `path` (forward, or forward and backward) at `seq` tokens.
#[allow(clippy::too_many_arguments)]
fn time_path<R: CubeRuntime, BT: BoolElement>(
    path: Path,
    with_backward: bool,
    seq: usize,
    hidden: usize,
    keep: f64,
    dtype: DType,
    repeats: usize,
) -> (Duration, usize) {
    type B<R, BT> = Cube<R, BT>;
    let device = Default::default();
    let client = R::client(&device);
    let rows = kept_rows::<B<R, BT>>(1, seq, keep, &device);
    let kept = rows.dims()[1];
    let (x, weight, grad) = inputs::<B<R, BT>>(1, seq, hidden, dtype, &device);
    let state = Mutex::new(Some((x, grad)));
    let step = || {
        let mut state = state.lock().unwrap();
        let (x, grad) = state.take().expect("state");
        let (x, saved) = forward(path, x, &rows, &weight);
        let grad = match with_backward {
            true => backward(path, grad, &rows, &weight, saved),
            false => grad,
        };
        *state = Some((x, grad));
    };
    // One step to compile and to size the loops (about 20 ms each).
    let first = time_calls(&client, 1, 1, step);
    let calls = (0.02 / first.as_secs_f64().max(1e-6))
        .ceil()
        .clamp(2.0, 50.0) as usize;
    (time_calls(&client, repeats, calls, step), kept)
}

/// PyTorch's time (ms) for `pass` at `seq` under `key` in its report.
fn torch_ms(torch: &Value, seq: usize, pass: &str, key: &str) -> Value {
    torch["timings"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["seq"] == seq && t["pass"] == pass)
        .map(|t| t[key].clone())
        .unwrap_or(Value::Null)
}

fn run<R: CubeRuntime, BT: BoolElement>(args: &Args, dtype: DType, tolerance: f64) -> Value {
    let parity = parity::<Cube<R, BT>>(args.hidden, dtype, tolerance);
    let torch: Value = args
        .torch
        .as_ref()
        .map(|path| serde_json::from_str(&std::fs::read_to_string(path).expect("torch report")))
        .transpose()
        .expect("torch report JSON")
        .unwrap_or(Value::Null);
    let element = dtype.size() as f64;
    let mut timings = Vec::new();
    for &seq in &args.seqs {
        for (pass, with_backward) in [("forward", false), ("forward_backward", true)] {
            let mut entry = json!({"seq": seq, "pass": pass});
            for path in Path::ALL {
                let (time, kept) = time_path::<R, BT>(
                    path,
                    with_backward,
                    seq,
                    args.hidden,
                    args.keep,
                    dtype,
                    args.repeats,
                );
                let ms = time.as_secs_f64() * 1e3;
                entry["kept"] = json!(kept);
                entry[format!("{}_ms", path.name())] = json!(ms);
                if let Path::Fused = path {
                    // Fewest bytes: forward reads the kept rows, writes y and the saved copy,
                    // then reads y and the kept rows and writes them (6 kept-row passes); the
                    // backward gathers d y (2) and reads saved rows, d y and d out rows and
                    // writes them (4).
                    let passes = if with_backward { 12.0 } else { 6.0 };
                    let bytes = passes * (kept * args.hidden) as f64 * element;
                    entry["fused_min_bytes"] = json!(bytes);
                    entry["fused_gbps"] = json!(bytes / time.as_secs_f64() / 1e9);
                }
                println!("{pass} S={seq} {}: {ms:.3} ms", path.name());
            }
            for key in ["torch_naive_ms", "torch_index_add_ms"] {
                entry[key] = torch_ms(&torch, seq, pass, key);
            }
            let fused = entry["fused_ms"].as_f64().unwrap();
            for key in [
                "naive_burn_ms",
                "naive_kernels_ms",
                "torch_naive_ms",
                "torch_index_add_ms",
            ] {
                if let Some(other) = entry[key].as_f64() {
                    let name = format!("speedup_vs_{}", key.trim_end_matches("_ms"));
                    entry[name] = json!(other / fused);
                }
            }
            timings.push(entry);
        }
    }
    json!({
        "benchmark": "token_movement",
        "description": "one block of a token-sparse layer on x [1, S, hidden]: fused gather-RMSNorm + in-place scatter-add vs naive select + RMSNorm + zero-pad + add; forward = training forward, forward_backward = one step of each; time per step between device synchronizations (cubecl profiler), median",
        "dtype": format!("{dtype:?}").to_lowercase(),
        "hidden": args.hidden,
        "keep": args.keep,
        "block_rows": BLOCK,
        "commit": args.commit,
        "command": args.command,
        "device": torch["device"].clone(),
        "torch_version": torch["torch_version"].clone(),
        "parity": parity,
        "timings": timings,
    })
}

fn main() {
    let args = parse_args();
    let report = if args.wgpu {
        run::<cubecl::wgpu::WgpuRuntime, u32>(&args, DType::F32, 1e-5)
    } else {
        if let Some(dir) = lemo_kernels::cache::default_cache_dir() {
            lemo_kernels::cache::enable_persistent_caches(&dir);
        }
        run::<cubecl::cuda::CudaRuntime, u8>(&args, DType::BF16, 1e-2)
    };
    let text = serde_json::to_string_pretty(&report).unwrap();
    match &args.out {
        Some(path) => std::fs::write(path, text).expect("writing the report"),
        None => println!("{text}"),
    }
    let table: Vec<String> = report["timings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            format!(
                "{:>6} {:<17} fused {:>8.3} ms  naive_burn {:>8.3}  naive_kernels {:>8.3}  torch_naive {:>8}  torch_index_add {:>8}",
                t["seq"], t["pass"].as_str().unwrap(), t["fused_ms"].as_f64().unwrap(),
                t["naive_burn_ms"].as_f64().unwrap(), t["naive_kernels_ms"].as_f64().unwrap(),
                t["torch_naive_ms"].as_f64().map_or("-".into(), |v| format!("{v:.3}")),
                t["torch_index_add_ms"].as_f64().map_or("-".into(), |v| format!("{v:.3}")),
            )
        })
        .collect();
    println!("{}", table.join("\n"));
}
