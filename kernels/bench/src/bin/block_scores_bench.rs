//! bf16 parity and throughput of lemo-kernels' exact block scores (LeMo's token-block
//! informativeness) on CUDA, against the attention forward they ride beside.
//!
//! Parity (fresh random inputs, seed printed, `--seed` overrides): the dispatched path (the
//! tensor-core tile kernel for blocks of a multiple of 64 tokens) and the GEMM strips it
//! replaced, each against the plain Burn reference in f32 of the same bf16 inputs (it
//! materializes `S x S`, so small lengths only), MHA and GQA; sampled scores (a query stride
//! over 1) against the reference on the query rows the stride reads, the others zeroed; queries
//! that are the last rows of more keys (a rank's chunk of a split sequence) against their rows of
//! the whole matrix's scores.
//! Throughput: for each S and kv-head count, the dispatched block scores at each query stride,
//! the GEMM strips and the attention forward (`lemo_kernels::attention::attention_with_lse`, cuDNN where it takes
//! the shape), each timed as a loop of back-to-back calls between two device synchronizations
//! after warm-up, median of repeats.
//!
//! Usage: `block_scores_bench [--out FILE] [--seqs 4096,16384,65536] [--kv-heads 32,8]
//!         [--query-strides 1,4] [--heads 32] [--head-dim 128] [--block 64] [--repeats 5]
//!         [--seed N]`

use std::time::Duration;

use burn::tensor::{DType, Distribution, Tensor};
use cubecl::prelude::Runtime;
use lemo_kernel_bench::time_calls;
use lemo_kernels::CudaBackend;
use lemo_kernels::attention::{AttentionOptions, attention_with_lse};
use lemo_kernels::block_scores::{block_scores, chunked, only_sampled_query_rows, reference};
use lemo_kernels::memory::memory_cleanup;
use serde_json::{Value, json};

type B = CudaBackend;

struct Args {
    out: Option<String>,
    seqs: Vec<usize>,
    kv_heads: Vec<usize>,
    query_strides: Vec<usize>,
    heads: usize,
    head_dim: usize,
    block: usize,
    repeats: usize,
    seed: u64,
}

fn parse_args() -> Args {
    let mut args = Args {
        out: None,
        seqs: vec![4096, 16384, 65536],
        kv_heads: vec![32, 8],
        query_strides: vec![1, 4],
        heads: 32,
        head_dim: 128,
        block: 64,
        repeats: 5,
        seed: 38,
    };
    let list = |v: String| -> Vec<usize> {
        v.split(',')
            .map(|x| x.parse().expect("a comma-separated list of numbers"))
            .collect()
    };
    let mut raw = std::env::args().skip(1);
    while let Some(flag) = raw.next() {
        let value = raw.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        let number = || value.parse::<usize>().expect("a number");
        match flag.as_str() {
            "--out" => args.out = Some(value.clone()),
            "--seqs" => args.seqs = list(value.clone()),
            "--kv-heads" => args.kv_heads = list(value.clone()),
            "--query-strides" => args.query_strides = list(value.clone()),
            "--heads" => args.heads = number(),
            "--head-dim" => args.head_dim = number(),
            "--block" => args.block = number(),
            "--repeats" => args.repeats = number(),
            "--seed" => args.seed = number() as u64,
            other => panic!("unknown argument {other}"),
        }
    }
    args
}

/// `q: [1, heads, seq, head_dim]` and `k: [1, kv_heads, seq, head_dim]` in bf16.
fn inputs(heads: usize, kv_heads: usize, seq: usize, head_dim: usize) -> [Tensor<B, 4>; 3] {
    let device = Default::default();
    let random = |h| {
        Tensor::<B, 4>::random(
            [1, h, seq, head_dim],
            Distribution::Normal(0.0, 1.0),
            &device,
        )
        .cast(DType::BF16)
    };
    [random(heads), random(kv_heads), random(kv_heads)]
}

/// Largest absolute difference over the largest reference value.
fn relative_max(actual: Tensor<B, 3>, expected: Tensor<B, 3>) -> f64 {
    let scale: f32 = expected.clone().abs().max().into_scalar();
    let error: f32 = (actual.cast(DType::F32) - expected)
        .abs()
        .max()
        .into_scalar();
    (error / scale.max(1e-30)) as f64
}

fn parity(args: &Args) -> Vec<Value> {
    let mut rows = Vec::new();
    for &kv_heads in &args.kv_heads {
        for seq in [256, 1000, 2048] {
            let [q, k, _] = inputs(args.heads, kv_heads, seq, args.head_dim);
            let scale = (args.head_dim as f32).powf(-0.5);
            let f32_of = |t: &Tensor<B, 4>| t.clone().cast(DType::F32);
            for &stride in &args.query_strides {
                let read = only_sampled_query_rows(f32_of(&q), stride);
                let expected = reference::block_scores(read, f32_of(&k), args.block, scale);
                let dispatched = block_scores(q.clone(), k.clone(), args.block, stride);
                let mut row = json!({
                    "heads": args.heads, "kv_heads": kv_heads, "seq": seq, "block": args.block,
                    "query_stride": stride,
                    "dispatched_rel_max_error": relative_max(dispatched, expected.clone()),
                });
                if stride == 1 {
                    let strips = chunked::block_scores(q.clone(), k.clone(), args.block, scale);
                    row["strips_rel_max_error"] = json!(relative_max(strips, expected));
                }
                eprintln!("parity: {row}");
                rows.push(row);
                // Queries that are the last rows of the keys from a block boundary (a rank's
                // chunk of a split sequence): their rows of the whole matrix's scores.
                if seq == 2048 {
                    for (from, to) in [(1024, 2048), (512, 1536)] {
                        let queries = q.clone().narrow(2, from, to - from);
                        let keys = k.clone().narrow(2, 0, to);
                        let whole = reference::block_scores(
                            only_sampled_query_rows(f32_of(&q).narrow(2, 0, to), stride),
                            f32_of(&keys),
                            args.block,
                            scale,
                        );
                        let expected = whole.slice([
                            0..1,
                            from / args.block..(to - from).div_ceil(args.block) + from / args.block,
                        ]);
                        let dispatched = block_scores(queries, keys, args.block, stride);
                        let row = json!({
                            "heads": args.heads, "kv_heads": kv_heads, "seq": seq, "block": args.block,
                            "query_stride": stride, "queries": [from, to],
                            "dispatched_rel_max_error": relative_max(dispatched, expected),
                        });
                        eprintln!("parity: {row}");
                        rows.push(row);
                    }
                }
            }
        }
    }
    rows
}

fn throughput(args: &Args) -> Vec<Value> {
    let device = Default::default();
    let client = cubecl::cuda::CudaRuntime::client(&device);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut rows = Vec::new();
    for &kv_heads in &args.kv_heads {
        for &seq in &args.seqs {
            let [q, k, v] = inputs(args.heads, kv_heads, seq, args.head_dim);
            let scale = (args.head_dim as f32).powf(-0.5);
            let options = AttentionOptions::causal(args.head_dim);
            let (repeats, calls) = (args.repeats, 3);
            let strided: Vec<(usize, f64)> = args
                .query_strides
                .iter()
                .map(|&stride| {
                    let time = ms(time_calls(&client, repeats, calls, || {
                        block_scores(q.clone(), k.clone(), args.block, stride)
                    }));
                    (stride, time)
                })
                .collect();
            let dispatched = strided
                .iter()
                .find(|(stride, _)| *stride == 1)
                .map_or(f64::NAN, |(_, ms)| *ms);
            let strips = ms(time_calls(&client, repeats, calls, || {
                chunked::block_scores(q.clone(), k.clone(), args.block, scale)
            }));
            let attention = ms(time_calls(&client, repeats, calls, || {
                attention_with_lse(q.clone(), k.clone(), v.clone(), options)
            }));
            // The causal half of Q K^T.
            let flops = 2.0 * args.heads as f64 * (seq * seq) as f64 / 2.0 * args.head_dim as f64;
            let row = json!({
                "heads": args.heads, "kv_heads": kv_heads, "seq": seq, "head_dim": args.head_dim,
                "block": args.block,
                "block_scores_ms": dispatched, "strips_ms": strips, "attention_forward_ms": attention,
                "block_scores_over_attention_forward": dispatched / attention,
                "strips_over_block_scores": strips / dispatched,
                "block_scores_tflops": flops / dispatched / 1e9,
                "by_query_stride": strided.iter().map(|(stride, ms)| json!({
                    "query_stride": stride, "ms": ms,
                    "over_attention_forward": ms / attention,
                })).collect::<Vec<_>>(),
            });
            eprintln!("timing: {row}");
            rows.push(row);
            drop((q, k, v));
            memory_cleanup::<B>(&device);
        }
    }
    rows
}

fn main() {
    let args = parse_args();
    eprintln!("block_scores_bench: seed {} (--seed overrides)", args.seed);
    <B as burn::tensor::backend::Backend>::seed(&Default::default(), args.seed);
    let report = json!({
        "implementation": "lemo-kernels block scores, exact and over sampled query rows: tensor-core tile kernel (blocks of a multiple of 64 tokens), GEMM strips for comparison",
        "seed": args.seed,
        "parity": parity(&args),
        "timings": throughput(&args),
    });
    let text = serde_json::to_string_pretty(&report).unwrap();
    match &args.out {
        Some(path) => std::fs::write(path, text).expect("writing the report"),
        None => println!("{text}"),
    }
}
