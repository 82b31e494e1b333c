//! bf16 parity and throughput of lemo-kernels' GEMM path, fused kernels and segment-based loss
//! on CUDA (the flash-attention kernels have their own harness, `attention_bench`).
//!
//! Parity (on the GPU, fresh random inputs): each GEMM form against an f32 CPU product of the
//! same bf16 inputs; a chain of dependent cubecl kernels and GEMMs with buffer reuse against
//! the same chain through Burn's matmul (a missing stream join shows as a large error); a chain
//! of tensors copied to page-locked host memory and back against the same values read plainly; f32
//! GEMMs (ours and Burn's) against the CPU; fused kernels against their Burn references; the
//! dequantize kernel (every format, f32 and bf16 output) against its Burn reference;
//! the segment-based loss against the plain full-logits loss (loss and gradients); the
//! exchange's all-gather and reduce-scatter on the device against the same through the host.
//! Throughput: each kernel timed as a loop of back-to-back calls between two device
//! synchronizations (cubecl's profiler), after warm-up, median of repeats; the PyTorch script
//! `kernels/reference/compute_torch.py` times the same shapes the same way.
//!
//! Usage: `compute_bench [--out FILE] [--quick] [--parity-only] [--repeats 5]` (`--parity-only`:
//! the parity checks alone, as `cargo xtask gpu-test` runs them; they include tensors past 2^31
//! elements, about 35 GB of device memory)

use std::time::Duration;

use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Distribution, Int, Tensor, TensorData, TensorPrimitive};
use cubecl::prelude::{ComputeClient, Runtime};
use lemo_kernel_bench::time_calls;
use lemo_kernels::dequantize::PackedBlocks;
use lemo_kernels::memory::{memory_cleanup, memory_stats};
use lemo_kernels::{CpuBackend, CudaBackend, dequantize, fused, gemm, host_copy, loss, precision};
use lemo_test_support::HostRng;
use serde_json::{Value, json};

type B = CudaBackend;
type AD = Autodiff<CudaBackend>;
type Client = ComputeClient<cubecl::cuda::CudaRuntime>;

mod exchange;
mod past_2_31;

/// Measured device copy bandwidth the fused kernels are compared with comes from the PyTorch
/// script; this harness reports bytes moved and time.
struct Args {
    out: Option<String>,
    quick: bool,
    /// No timings, and not Burn's own f32 matmul (its autotune takes most of a quick run).
    parity_only: bool,
    repeats: usize,
}

fn parse_args() -> Args {
    let mut args = Args {
        out: None,
        quick: false,
        parity_only: false,
        repeats: 5,
    };
    let mut raw = std::env::args().skip(1);
    while let Some(flag) = raw.next() {
        match flag.as_str() {
            "--out" => args.out = raw.next(),
            "--quick" => args.quick = true,
            "--parity-only" => args.parity_only = true,
            "--repeats" => {
                args.repeats = raw
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--repeats N")
            }
            other => panic!("unknown argument {other}"),
        }
    }
    args
}

fn device() -> burn::tensor::Device<B> {
    Default::default()
}

fn client() -> Client {
    cubecl::cuda::CudaRuntime::client(&device())
}

fn random<const D: usize>(shape: [usize; D], dtype: DType) -> Tensor<B, D> {
    Tensor::<B, D>::random(shape, Distribution::Normal(0.0, 1.0), &device()).cast(dtype)
}

fn to_cpu<const D: usize>(tensor: Tensor<B, D>) -> Tensor<CpuBackend, D> {
    Tensor::from_data(tensor.cast(DType::F32).into_data(), &Default::default())
}

/// `||actual - expected|| / ||expected||` on the CPU in f32.
fn relative<const D: usize>(actual: Tensor<CpuBackend, D>, expected: Tensor<CpuBackend, D>) -> f64 {
    assert_eq!(actual.dims(), expected.dims());
    let diff: f32 = (actual - expected.clone())
        .powi_scalar(2)
        .sum()
        .sqrt()
        .into_scalar();
    let norm: f32 = expected.powi_scalar(2).sum().sqrt().into_scalar();
    let error = (diff / norm.max(1e-30)) as f64;
    if error.is_nan() { f64::INFINITY } else { error }
}

fn gpu_relative<const D: usize>(actual: Tensor<B, D>, expected: Tensor<B, D>) -> f64 {
    let actual = actual.cast(DType::F32);
    let expected = expected.cast(DType::F32);
    let diff: f32 = (actual - expected.clone())
        .powi_scalar(2)
        .sum()
        .sqrt()
        .into_scalar();
    let norm: f32 = expected.powi_scalar(2).sum().sqrt().into_scalar();
    let error = (diff / norm.max(1e-30)) as f64;
    if error.is_nan() { f64::INFINITY } else { error }
}

/// A tiny cubecl kernel reading `tensor`: placed after a GEMM it makes the profiler's final
/// synchronization of cubecl's stream wait for the GEMM too.
fn touch<const D: usize>(tensor: Tensor<B, D>) -> Tensor<B, 1> {
    tensor.flatten::<1>(0, D - 1).narrow(0, 0, 1) + 1.0
}

/// The three products of a linear layer `y = x W^T` with `W [N, K]`: forward, the input
/// gradient and the weight gradient, as `(lhs, rhs)` operands of `[M, K] x [K, N]` form.
fn gemm_forms(
    m: usize,
    k: usize,
    n: usize,
    dtype: DType,
) -> Vec<(&'static str, Tensor<B, 2>, Tensor<B, 2>)> {
    let x = random([m, k], dtype);
    let w = random([n, k], dtype) * 0.05;
    let dy = random([m, n], dtype);
    vec![
        ("fwd", x.clone(), w.clone().transpose()),
        ("dgrad", dy.clone(), w),
        ("wgrad", dy.transpose(), x),
    ]
}

fn gemm_parity() -> Vec<Value> {
    let mut results = Vec::new();
    for (dtype, tolerance) in [(DType::BF16, 1e-2), (DType::F32, 1e-5)] {
        for (form, lhs, rhs) in gemm_forms(1000, 520, 776, dtype) {
            let ours = to_cpu(gemm::matmul(lhs.clone(), rhs.clone()));
            let expected = to_cpu(lhs).matmul(to_cpu(rhs));
            let error = relative(ours, expected);
            let ok = error < tolerance;
            println!(
                "parity gemm {form} {dtype:?}: {error:.2e} {}",
                if ok { "ok" } else { "FAIL" }
            );
            results.push(json!({"check": format!("gemm_{form}_{dtype:?}").to_lowercase(), "relative_error": error, "tolerance": tolerance, "ok": ok}));
        }
    }
    // Batched, and a weight shared by a batch (one tall product).
    let x = random([3, 300, 256], DType::BF16);
    for (name, w) in [
        ("batched", random([3, 256, 128], DType::BF16)),
        ("shared_weight", random([1, 256, 128], DType::BF16)),
    ] {
        let ours = to_cpu(gemm::matmul(x.clone(), w.clone()));
        let expected = to_cpu(x.clone()).matmul(to_cpu(w));
        let error = relative(ours, expected);
        let ok = error < 1e-2;
        println!(
            "parity gemm {name}: {error:.2e} {}",
            if ok { "ok" } else { "FAIL" }
        );
        results.push(json!({"check": format!("gemm_{name}"), "relative_error": error, "tolerance": 1e-2, "ok": ok}));
    }
    results
}

/// Dependent chain `y <- (y * 0.5 + 0.1) W_i` (the element-wise ops on cubecl's stream, the
/// products on ours), with every intermediate dropped so its memory is reused at once, against
/// the same chain with a full device synchronization after every step (nothing can overlap
/// there). The kernels are deterministic, so any difference is a missing stream join.
fn ordering_check() -> Value {
    let weights: Vec<Tensor<B, 2>> = (0..6)
        .map(|_| random([2048, 2048], DType::BF16) * (1.0 / 45.0))
        .collect();
    let start = random([8192, 2048], DType::BF16);
    let chain = |serialize: bool| {
        let mut y = start.clone();
        for w in &weights {
            y = gemm::matmul(y * 0.5 + 0.1, w.clone());
            let _scratch = random([4096, 4096], DType::BF16);
            if serialize {
                lemo_kernels::memory::synchronize::<B>(&device());
            }
        }
        y
    };
    let error = gpu_relative(chain(false), chain(true));
    let ok = error == 0.0;
    println!(
        "parity gemm ordering chain: {error:.2e} {}",
        if ok { "ok" } else { "FAIL" }
    );
    json!({"check": "gemm_stream_ordering_chain", "relative_error": error, "tolerance": 0.0, "ok": ok})
}

/// Tensors through page-locked host memory and back (`lemo_kernels::host_copy`), as an offloaded
/// activation plan moves layer inputs: each link of a dependent chain is copied to the host and
/// dropped at once (its memory goes to the next links and to scratch buffers as soon as its copy
/// is done), then the links come back in reverse, each fetched while the one above is used by a
/// kernel. Against the same links read after a full synchronization each; the copies are exact,
/// so any difference is a missing join.
fn host_copy_check() -> Value {
    let weights: Vec<Tensor<B, 2>> = (0..6)
        .map(|_| random([2048, 2048], DType::BF16) * (1.0 / 45.0))
        .collect();
    let start = random([8192, 2048], DType::BF16);
    let link = |y: Tensor<B, 2>, w: &Tensor<B, 2>| gemm::matmul(y * 0.5 + 0.1, w.clone());
    let mut expected = Vec::new();
    let mut y = start.clone();
    for w in &weights {
        y = link(y, w);
        lemo_kernels::memory::synchronize::<B>(&device());
        expected.push(to_cpu(y.clone()));
    }
    let mut copies = Vec::new();
    let mut y = start;
    for w in &weights {
        y = link(y, w);
        copies.push(host_copy::to_host(y.clone()));
        let _scratch = random([4096, 4096], DType::BF16);
    }
    drop(y);
    let fetch = |copies: &mut Vec<host_copy::HostTensor>| {
        copies.pop().map(|host| {
            let upload = host_copy::upload::<B>(&host, &device());
            (host, upload)
        })
    };
    let mut error = 0f64;
    let mut next = fetch(&mut copies);
    while let Some((_host, upload)) = next.take() {
        next = fetch(&mut copies);
        let used = upload.arrived::<2>() * 1.0;
        let _scratch = random([4096, 4096], DType::BF16);
        let expected = expected.pop().expect("one expected value per link");
        error = error.max(relative(to_cpu(used), expected));
    }
    let ok = error == 0.0;
    println!(
        "parity host copy chain: {error:.2e} {}",
        if ok { "ok" } else { "FAIL" }
    );
    json!({"check": "host_copy_round_trip_chain", "relative_error": error, "tolerance": 0.0, "ok": ok})
}

/// Burn's own f32 matmul against the CPU: what precision it really computes in.
fn burn_f32_precision() -> Value {
    let x = random([512, 1024], DType::F32);
    let w = random([1024, 384], DType::F32);
    let expected = to_cpu(x.clone()).matmul(to_cpu(w.clone()));
    let burn = relative(to_cpu(x.clone().matmul(w.clone())), expected.clone());
    let ours = relative(to_cpu(gemm::matmul(x, w)), expected);
    println!("f32 matmul vs CPU: burn {burn:.2e}, ours (cuBLASLt COMPUTE_32F) {ours:.2e}");
    json!({"check": "f32_matmul_precision", "burn_relative_error": burn, "ours_relative_error": ours,
           "note": "~3e-4 means TF32 tensor cores (10-bit mantissa), ~1e-6 full f32"})
}

/// A float tensor's primitive, for the kernels' backend traits and references.
fn prim(t: Tensor<B, 3>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// The tensor of a float primitive.
fn back(t: FloatTensor<B>) -> Tensor<B, 3> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Records a parity check of relative `error` against the bf16 kernels' tolerance, 1e-2.
fn record(results: &mut Vec<Value>, name: &str, error: f64) {
    let ok = error < 1e-2;
    println!(
        "parity {name}: {error:.2e} {}",
        if ok { "ok" } else { "FAIL" }
    );
    results.push(json!({"check": name, "relative_error": error, "tolerance": 1e-2, "ok": ok}));
}

fn fused_parity() -> Vec<Value> {
    let mut results = Vec::new();
    let mut push = |name: &str, error: f64| record(&mut results, name, error);

    let x = random([2, 1000, 4096], DType::BF16);
    let w = (random([4096], DType::F32) * 0.1 + 1.0).cast(DType::BF16);
    let g = random([2, 1000, 4096], DType::BF16);
    let (out, rstd) = <B as lemo_kernels::FusedBackend>::lemo_rms_norm_forward(
        prim(x.clone()),
        w.clone().into_primitive().tensor(),
        1e-5,
    );
    let (expected, expected_rstd) = fused::rms_norm::reference::forward::<B>(
        prim(x.clone()),
        w.clone().into_primitive().tensor(),
        1e-5,
    );
    push("rms_norm_forward", gpu_relative(back(out), back(expected)));
    let rstd_error = gpu_relative(
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(rstd.clone())),
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(expected_rstd)),
    );
    push("rms_norm_rstd", rstd_error);
    let (dx, _) = <B as lemo_kernels::FusedBackend>::lemo_rms_norm_backward(
        prim(x.clone()),
        w.clone().into_primitive().tensor(),
        rstd.clone(),
        prim(g.clone()),
        false,
        fused::NormSaves::Input,
    );
    let (edx, _) = fused::rms_norm::reference::backward::<B>(
        prim(x),
        w.into_primitive().tensor(),
        rstd,
        prim(g),
        false,
    );
    push("rms_norm_backward", gpu_relative(back(dx), back(edx)));

    let (batch, heads, seq, head_dim) = (2, 8, 700, 128);
    let inv_freq: Vec<f32> = (0..head_dim / 2)
        .map(|i| 500000f32.powf(-2.0 * i as f32 / head_dim as f32))
        .collect();
    let (cos, sin) = fused::rope_tables::<B>(&inv_freq, 1.0, 40000, &device());
    let positions: Vec<i32> = (0..batch * seq)
        .map(|i| ((i % seq) * 37 + i / seq) as i32)
        .collect();
    let positions =
        Tensor::<B, 2, Int>::from_data(TensorData::new(positions, [batch, seq]), &device());
    let q = random([batch, seq, heads, head_dim], DType::BF16).swap_dims(1, 2);
    let ours = fused::rope(q.clone(), cos.clone(), sin.clone(), positions.clone());
    let expected =
        Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(fused::rope::reference::rope::<B>(
            q.into_primitive().tensor(),
            cos.into_primitive().tensor(),
            sin.into_primitive().tensor(),
            positions.into_primitive(),
            false,
        )));
    push("rope_forward_strided", gpu_relative(ours, expected));

    let gate = random([2, 1000, 4096], DType::BF16) * 3.0;
    let up = random([2, 1000, 4096], DType::BF16);
    let g = random([2, 1000, 4096], DType::BF16);
    push(
        "swiglu_forward",
        gpu_relative(
            fused::swiglu(gate.clone(), up.clone()),
            back(fused::swiglu::reference::forward::<B>(
                prim(gate.clone()),
                prim(up.clone()),
            )),
        ),
    );
    let (dg, du) = <B as lemo_kernels::FusedBackend>::lemo_swiglu_backward(
        prim(gate.clone()),
        prim(up.clone()),
        prim(g.clone()),
    );
    let (edg, edu) = fused::swiglu::reference::backward::<B>(prim(gate), prim(up), prim(g));
    push("swiglu_backward_gate", gpu_relative(back(dg), back(edg)));
    push("swiglu_backward_up", gpu_relative(back(du), back(edu)));

    // A LoRA projection on bf16 activations (A, B and the rank-r intermediate rounded to bf16
    // inside the products, the frozen output added in the adapter product's epilogue, and
    // `d y W` taking the adapter's part of `d x` in its own) against the same projection
    // computed by Burn, forward and backward.
    let x = Tensor::<AD, 3>::from_inner(random([2, 1000, 4096], DType::BF16)).require_grad();
    let weight = Tensor::<AD, 2>::from_inner(random([4096, 4096], DType::BF16) * 0.02);
    let frozen =
        lemo_kernels::gemm::matmul(x.clone().detach(), weight.clone().transpose().unsqueeze());
    let a = Tensor::<AD, 2>::from_inner(random([8, 4096], DType::F32) * 0.02).require_grad();
    let b = Tensor::<AD, 2>::from_inner(random([4096, 8], DType::F32)).require_grad();
    let upstream = Tensor::<AD, 3>::from_inner(random([2, 1000, 4096], DType::F32));
    let run = |reference: bool| {
        let frozen = precision::Frozen::Value(frozen.clone(), weight.clone());
        let out = if reference {
            precision::lora_linear_reference(x.clone(), frozen, a.clone(), b.clone(), 2.0)
        } else {
            precision::lora_linear(x.clone(), frozen, a.clone(), b.clone(), 2.0)
        };
        let grads = (out.clone().cast(DType::F32) * upstream.clone())
            .sum()
            .backward();
        let grad_of = |grad: Option<Tensor<B, 3>>| grad.expect("gradient");
        (
            out.inner(),
            grad_of(x.grad(&grads)),
            a.grad(&grads).expect("gradient"),
            b.grad(&grads).expect("gradient"),
        )
    };
    let (out, dx, da, db) = run(false);
    let (expected, edx, eda, edb) = run(true);
    push("lora_linear_forward_bf16", gpu_relative(out, expected));
    push("lora_linear_backward_x_bf16", gpu_relative(dx, edx));
    push("lora_linear_backward_a_bf16", gpu_relative(da, eda));
    push("lora_linear_backward_b_bf16", gpu_relative(db, edb));

    let logits = random([300, 32000], DType::BF16) * 4.0;
    let targets: Vec<i32> = (0..300)
        .map(|i| if i % 9 == 4 { -100 } else { i * 101 % 32000 })
        .collect();
    let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(targets, [300]), &device());
    let (losses, grad) = loss::cross_entropy_rows(logits.clone(), targets.clone(), true);
    let (el, eg) = loss::reference::cross_entropy_rows::<B>(
        logits.into_primitive().tensor(),
        targets.into_primitive(),
        true,
    );
    push(
        "cross_entropy_rows_loss",
        gpu_relative(losses, Tensor::from_primitive(TensorPrimitive::Float(el))),
    );
    push(
        "cross_entropy_rows_grad",
        gpu_relative(
            grad.unwrap(),
            Tensor::from_primitive(TensorPrimitive::Float(eg.unwrap())),
        ),
    );
    results
}

fn gemm_timings(args: &Args, client: &Client) -> Vec<Value> {
    // (model, projection, K, N) of y = x W^T, W [N, K].
    let projections = [
        ("llama2_7b", "qkvo", 4096, 4096),
        ("llama2_7b", "gate_up", 4096, 11008),
        ("llama2_7b", "down", 11008, 4096),
        ("llama2_7b", "lm_head", 4096, 32000),
        ("llama3_8b", "kv", 4096, 1024),
        ("llama3_8b", "gate_up", 4096, 14336),
        ("llama3_8b", "down", 14336, 4096),
        ("llama3_8b", "lm_head", 4096, 128256),
    ];
    let tokens: &[usize] = if args.quick {
        &[4096]
    } else {
        &[4096, 16384, 65536]
    };
    let mut results = Vec::new();
    for &m in tokens {
        for &(model, projection, k, n) in &projections {
            // The loss runs the vocabulary projection in chunks, never on 64K rows at once.
            if projection == "lm_head" && m > 16384 {
                continue;
            }
            for (form, lhs, rhs) in gemm_forms(m, k, n, DType::BF16) {
                let flops = 2.0 * m as f64 * k as f64 * n as f64;
                let calls = ((2e12 / flops).ceil() as usize).clamp(2, 50);
                let time = time_calls(client, args.repeats, calls, || {
                    touch(gemm::matmul(lhs.clone(), rhs.clone()))
                        .into_primitive()
                        .tensor()
                });
                let tflops = flops / time.as_secs_f64() / 1e12;
                println!(
                    "gemm {model} {projection} {form} M={m}: {:.3} ms, {tflops:.1} TFLOP/s",
                    time.as_secs_f64() * 1e3
                );
                results.push(json!({
                    "kernel": format!("gemm_{form}"), "model": model, "projection": projection,
                    "m": m, "k": k, "n": n, "dtype": "bf16",
                    "median_ms": time.as_secs_f64() * 1e3, "tflops": tflops,
                }));
            }
        }
    }
    results
}

/// The dequantize kernel against its Burn reference on the GPU, every format, writing f32 and
/// bf16: a weight of whole blocks and one whose last block is partial.
fn dequantize_parity() -> Vec<Value> {
    let mut results = Vec::new();
    for (seed, shape) in [[512, 4096], [3, 100]].into_iter().enumerate() {
        for format in dequantize::BlockFormat::ALL {
            let mut words = HostRng::new(seed as u64);
            let blocks = PackedBlocks::<B>::random(format, shape, || words.next_u64(), &device());
            for dtype in [DType::F32, DType::BF16] {
                let ours = dequantize::dequantize(blocks.clone(), dtype);
                let expected = dequantize::reference::dequantize(&blocks, dtype);
                let error = gpu_relative(ours, expected);
                let name = format!("dequantize_{format:?}_{dtype:?}_{}x{}", shape[0], shape[1]);
                let ok = error < 1e-2;
                println!(
                    "parity {name}: {error:.2e} {}",
                    if ok { "ok" } else { "FAIL" }
                );
                results.push(
                    json!({"check": name, "relative_error": error, "tolerance": 1e-2, "ok": ok}),
                );
            }
        }
    }
    results
}

fn fused_timings(args: &Args, client: &Client) -> Vec<Value> {
    let (rows, hidden) = (16384, 4096);
    let numel = (rows * hidden) as f64;
    let mut results = Vec::new();
    let mut record = |kernel: &str, shape: Vec<usize>, bytes: f64, time: Duration| {
        let gbps = bytes / time.as_secs_f64() / 1e9;
        println!(
            "{kernel} {shape:?}: {:.3} ms, {gbps:.0} GB/s",
            time.as_secs_f64() * 1e3
        );
        results.push(
            json!({"kernel": kernel, "shape": shape, "dtype": "bf16", "bytes": bytes,
                            "median_ms": time.as_secs_f64() * 1e3, "gbps": gbps}),
        );
    };
    let prim = |t: &Tensor<B, 2>| t.clone().into_primitive().tensor();
    let x = random([rows, hidden], DType::BF16);
    let g = random([rows, hidden], DType::BF16);
    let w = (random([hidden], DType::F32) * 0.1 + 1.0).cast(DType::BF16);
    let wp = w.clone().into_primitive().tensor();
    let t = time_calls(client, args.repeats, 20, || {
        <B as lemo_kernels::FusedBackend>::lemo_rms_norm_forward(prim(&x), wp.clone(), 1e-5)
    });
    record("rms_norm_forward", vec![rows, hidden], 4.0 * numel, t);
    let (_, rstd) =
        <B as lemo_kernels::FusedBackend>::lemo_rms_norm_forward(prim(&x), wp.clone(), 1e-5);
    let t = time_calls(client, args.repeats, 20, || {
        <B as lemo_kernels::FusedBackend>::lemo_rms_norm_backward(
            prim(&x),
            wp.clone(),
            rstd.clone(),
            prim(&g),
            false,
            fused::NormSaves::Input,
        )
        .0
    });
    record("rms_norm_backward", vec![rows, hidden], 6.0 * numel, t);

    let (heads, head_dim) = (32, 128);
    let inv_freq: Vec<f32> = (0..head_dim / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / head_dim as f32))
        .collect();
    let (cos, sin) = fused::rope_tables::<B>(&inv_freq, 1.0, rows, &device());
    let positions = Tensor::<B, 1, Int>::arange(0..rows as i64, &device()).reshape([1, rows]);
    let q = random([1, rows, heads, head_dim], DType::BF16).swap_dims(1, 2);
    let t = time_calls(client, args.repeats, 20, || {
        fused::rope(q.clone(), cos.clone(), sin.clone(), positions.clone())
            .into_primitive()
            .tensor()
    });
    record(
        "rope_forward",
        vec![1, heads, rows, head_dim],
        4.0 * numel,
        t,
    );

    let t = time_calls(client, args.repeats, 20, || {
        fused::swiglu(x.clone(), g.clone())
            .into_primitive()
            .tensor()
    });
    record("swiglu_forward", vec![rows, hidden], 6.0 * numel, t);
    let t = time_calls(client, args.repeats, 20, || {
        <B as lemo_kernels::FusedBackend>::lemo_swiglu_backward(prim(&x), prim(&g), prim(&x))
    });
    record("swiglu_backward", vec![rows, hidden], 10.0 * numel, t);

    // A Llama-3-8B MLP weight dequantized to bf16: the packed words read, the weight written.
    for format in [dequantize::BlockFormat::Nf4, dequantize::BlockFormat::Q4_K] {
        let shape = [14336, 4096];
        let mut words = HostRng::new(7);
        let blocks = PackedBlocks::<B>::random(format, shape, || words.next_u64(), &device());
        let packed: usize = blocks.fields.iter().map(|f| 4 * f.words.dims()[0]).sum();
        let t = time_calls(client, args.repeats, 10, || {
            dequantize::dequantize(blocks.clone(), DType::BF16)
                .into_primitive()
                .tensor()
        });
        let bytes = packed as f64 + 2.0 * (shape[0] * shape[1]) as f64;
        record(&format!("dequantize_{format:?}"), shape.to_vec(), bytes, t);
    }

    let (chunk, vocab) = (2048, 128256);
    let logits = random([chunk, vocab], DType::BF16) * 3.0;
    let targets = Tensor::<B, 1, Int>::arange(0..chunk as i64, &device()) * 61;
    let t = time_calls(client, args.repeats, 10, || {
        loss::cross_entropy_rows(logits.clone(), targets.clone(), true)
            .1
            .unwrap()
            .into_primitive()
            .tensor()
    });
    record(
        "cross_entropy_rows",
        vec![chunk, vocab],
        4.0 * (chunk * vocab) as f64,
        t,
    );
    results
}

/// Loss and hidden gradient (and lm_head gradient when `train_head`) of the summed loss, with
/// the peak memory the loss adds (pool growth from a cleaned pool) and its time.
fn run_loss(
    hidden: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    targets: &Tensor<B, 1, Int>,
    chunk: Option<usize>,
    train_head: bool,
) -> (Tensor<B, 1>, Tensor<B, 2>, Option<Tensor<B, 2>>, u64, f64) {
    let dev = device();
    memory_cleanup::<B>(&dev);
    let before = memory_stats::<B>(&dev);
    let start = std::time::Instant::now();
    let h = Tensor::<AD, 2>::from_inner(hidden.clone()).require_grad();
    let mut w = Tensor::<AD, 2>::from_inner(weight.clone());
    if train_head {
        w = w.require_grad();
    }
    let t = Tensor::<AD, 1, Int>::from_inner(targets.clone());
    let loss = match chunk {
        Some(chunk) => loss::segment_cross_entropy(h.clone(), w.clone(), t, chunk),
        None => loss::reference::cross_entropy(h.clone(), w.clone(), t),
    };
    let grads = loss.backward();
    let grad_h = h.grad(&grads).unwrap();
    let grad_w = w.grad(&grads);
    let loss = loss.inner();
    let _ = loss.clone().into_scalar();
    let seconds = start.elapsed().as_secs_f64();
    let after = memory_stats::<B>(&dev);
    let peak = after.bytes_reserved.saturating_sub(before.bytes_reserved);
    (loss, grad_h, grad_w, peak, seconds)
}

fn segment_loss(args: &Args) -> (Vec<Value>, Vec<Value>) {
    let (rows, hidden, vocab, chunk) = if args.quick {
        (4096, 4096, 128256, 1024)
    } else {
        (16384, 4096, 128256, 1024)
    };
    let h = random([rows, hidden], DType::BF16);
    let w = random([vocab, hidden], DType::BF16) * 0.02;
    let targets: Vec<i32> = (0..rows)
        .map(|i| {
            if i % 50 == 7 {
                -100
            } else {
                (i * 7919 % vocab) as i32
            }
        })
        .collect();
    let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(targets, [rows]), &device());

    // Warm-up (kernel compilation), then the measured run.
    drop(run_loss(&h, &w, &targets, Some(chunk), false));
    let (loss_c, gh_c, _, peak_c, time_c) = run_loss(&h, &w, &targets, Some(chunk), false);
    let (loss_p, gh_p, _, peak_p, time_p) = run_loss(&h, &w, &targets, None, false);
    let (_, _, _, peak_1, time_1) = run_loss(&h, &w, &targets, Some(rows), false);
    let loss_error = gpu_relative(loss_c.clone(), loss_p.clone());
    let grad_error = gpu_relative(gh_c, gh_p);
    let mean_loss: f32 = loss_c.into_scalar();
    println!(
        "segment loss S={rows} V={vocab} chunk={chunk}: peak {:.2} GiB ({time_c:.3} s) vs plain {:.2} GiB ({time_p:.3} s), one chunk {:.2} GiB; ratio {:.1}x; loss err {loss_error:.2e}, d hidden err {grad_error:.2e}",
        peak_c as f64 / 2f64.powi(30),
        peak_p as f64 / 2f64.powi(30),
        peak_1 as f64 / 2f64.powi(30),
        peak_p as f64 / peak_c.max(1) as f64
    );

    // Trainable (tied) lm_head: its gradient too, on a shorter sequence.
    let short = 4096.min(rows);
    let hs = h.clone().narrow(0, 0, short);
    let ts = targets.clone().narrow(0, 0, short);
    let (l1, g1, w1, _, _) = run_loss(&hs, &w, &ts, Some(chunk), true);
    let (l2, g2, w2, _, _) = run_loss(&hs, &w, &ts, None, true);
    let head_errors = (
        gpu_relative(l1, l2),
        gpu_relative(g1, g2),
        gpu_relative(w1.unwrap(), w2.unwrap()),
    );
    println!(
        "segment loss with trainable lm_head (S={short}): loss {:.2e}, d hidden {:.2e}, d weight {:.2e}",
        head_errors.0, head_errors.1, head_errors.2
    );

    let parity = vec![
        json!({"check": "segment_loss_vs_plain_loss", "relative_error": loss_error, "tolerance": 1e-3, "ok": loss_error < 1e-3}),
        json!({"check": "segment_loss_vs_plain_d_hidden", "relative_error": grad_error, "tolerance": 1e-2, "ok": grad_error < 1e-2}),
        json!({"check": "segment_loss_trainable_head_d_weight", "relative_error": head_errors.2, "tolerance": 2e-2, "ok": head_errors.2 < 2e-2 && head_errors.1 < 1e-2}),
    ];
    let timing = vec![json!({
        "kernel": "segment_cross_entropy", "rows": rows, "hidden": hidden, "vocab": vocab, "chunk_rows": chunk,
        "dtype": "bf16", "loss_sum": mean_loss,
        "peak_bytes": peak_c, "plain_peak_bytes": peak_p, "one_chunk_peak_bytes": peak_1,
        "peak_ratio_plain_over_segment": peak_p as f64 / peak_c.max(1) as f64,
        "seconds_forward_backward": time_c, "plain_seconds_forward_backward": time_p, "one_chunk_seconds": time_1,
        "memory_method": "growth of cubecl's reserved pool bytes over the loss forward+backward, from a cleaned pool (hidden states and lm_head allocated before)",
    })];
    (parity, timing)
}

/// Runs one section; a panic is recorded instead of ending the run.
fn section<T>(name: &str, errors: &mut Vec<Value>, run: impl FnOnce() -> T) -> Option<T> {
    let start = std::time::Instant::now();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
    println!(
        "section {name}: {:.1} s wall",
        start.elapsed().as_secs_f64()
    );
    match result {
        Ok(value) => Some(value),
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            println!("section {name} FAILED: {message}");
            errors.push(json!({"section": name, "panic": message}));
            None
        }
    }
}

fn main() {
    let args = parse_args();
    // Compiled kernels and autotune results persist across runs (see `lemo_kernels::cache`).
    if let Some(dir) = lemo_kernels::cache::default_cache_dir() {
        let enabled = lemo_kernels::cache::enable_persistent_caches(&dir);
        println!("cubecl caches in {} (enabled: {enabled})", dir.display());
    }
    let process = std::time::Instant::now();
    let client = client();
    let mut errors = Vec::new();
    let mut parity = Vec::new();
    let mut timings = Vec::new();
    let write = |parity: &Vec<Value>, timings: &Vec<Value>, errors: &Vec<Value>, extra: Value| {
        let mut report = json!({
            "implementation": "lemo-kernels: cuBLASLt GEMM through cudarc on cubecl buffers, CubeCL fused kernels, segment-based loss",
            "parity": parity,
            "timings": timings,
            "errors": errors,
        });
        for (key, value) in extra.as_object().unwrap() {
            report[key] = value.clone();
        }
        let text = serde_json::to_string_pretty(&report).unwrap();
        match &args.out {
            Some(path) => std::fs::write(path, text).expect("writing the report"),
            None => println!("{text}"),
        }
    };
    // Most important first; the report is rewritten after every section. The first section
    // compiles the fused kernels: its wall time shows what the kernel cache saves.
    parity.extend(section("fused_parity", &mut errors, fused_parity).unwrap_or_default());
    parity.extend(section("dequantize_parity", &mut errors, dequantize_parity).unwrap_or_default());
    let first_section_seconds = process.elapsed().as_secs_f64();
    println!("start-up + first section: {first_section_seconds:.1} s");
    let startup = json!({"startup_and_fused_parity_seconds": first_section_seconds});
    parity.extend(section("gemm_parity", &mut errors, gemm_parity).unwrap_or_default());
    parity.extend(section("gemm_ordering", &mut errors, ordering_check));
    parity.extend(section("host_copy", &mut errors, host_copy_check));
    parity.extend(section("exchange", &mut errors, exchange::parity).unwrap_or_default());
    memory_cleanup::<B>(&device());
    parity.extend(section("past_2_31", &mut errors, past_2_31::parity).unwrap_or_default());
    memory_cleanup::<B>(&device());
    if !args.parity_only {
        timings.extend(
            section("gemm_timings", &mut errors, || gemm_timings(&args, &client))
                .unwrap_or_default(),
        );
    }
    write(&parity, &timings, &errors, startup.clone());
    if let Some((loss_parity, loss_timing)) =
        section("segment_loss", &mut errors, || segment_loss(&args))
    {
        parity.extend(loss_parity);
        if !args.parity_only {
            timings.extend(loss_timing);
        }
    }
    write(&parity, &timings, &errors, startup.clone());
    if args.parity_only {
        report_failures(&parity, &errors);
        return;
    }
    timings.extend(
        section("fused_timings", &mut errors, || {
            fused_timings(&args, &client)
        })
        .unwrap_or_default(),
    );
    write(&parity, &timings, &errors, startup.clone());
    // Last: Burn's own matmul autotunes (and has crashed on some candidates before).
    let extra = section("burn_f32_precision", &mut errors, burn_f32_precision);
    let mut extra_report = startup.clone();
    extra_report["burn_f32_matmul"] = extra.unwrap_or(Value::Null);
    write(&parity, &timings, &errors, extra_report);
    report_failures(&parity, &errors);
}

fn report_failures(parity: &[Value], errors: &[Value]) {
    let failed = parity.iter().filter(|p| p["ok"] == false).count();
    println!(
        "parity: {} checks, {failed} failed; {} sections failed",
        parity.len(),
        errors.len()
    );
}
