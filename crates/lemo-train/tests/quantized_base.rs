//! `--quantize-base` and quantized GGUF bases from the command line: NF4 at load scores close to
//! the dense model; SmolLM2's Q4_1 GGUF (when the model cache has it) trains with its
//! projections kept quantized, merges (saying what it dequantized and the precision it wrote)
//! and the merged model scores as the base with the adapter; an unknown quantization is refused
//! by name.

use std::path::{Path, PathBuf};
use std::process::Output;

use lemo_test_support::{
    SHORT_TRAINING, assert_close_scalar, hf_fixture, path, smollm2_gguf, stdout_json,
};

fn lemo(args: &[&str]) -> Output {
    lemo_test_support::run(env!("CARGO_BIN_EXE_lemo-train"), args)
}

fn succeed(args: &[&str]) -> Output {
    lemo_test_support::run_ok(env!("CARGO_BIN_EXE_lemo-train"), args)
}

/// `eval --json` on the fixture's tokens: the loss and what the run said on stderr.
fn eval(model: &Path, extra: &[&str]) -> (f64, String) {
    let data = hf_fixture("llama_gqa_tied").join("tokens.jsonl");
    let args = [
        &["eval", "--model", path(model), "--data", path(&data)][..],
        &[
            "--seq-len",
            "64",
            "--stride",
            "64",
            "--device",
            "cpu",
            "--json",
        ],
        extra,
    ]
    .concat();
    let output = lemo(&args);
    let loss = stdout_json(&output)["loss"].as_f64().unwrap();
    (loss, String::from_utf8_lossy(&output.stderr).into_owned())
}

/// Trains a LoRA adapter on `model` for 3 steps; returns the adapter folder and the run's stderr.
fn train(model: &Path, run: &Path) -> (PathBuf, String) {
    let data = hf_fixture("llama_gqa_tied").join("tokens.jsonl");
    let head = [
        "train",
        "--model",
        path(model),
        "--data",
        path(&data),
        "--seq-len",
        "32",
    ];
    let tail = ["--device", "cpu", "--out", path(run)];
    let output = succeed(&[&head[..], &SHORT_TRAINING, &tail].concat());
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (run.join("adapter"), stderr)
}

#[test]
fn nf4_base_scores_close_to_the_dense_one() {
    let fixture = hf_fixture("llama_gqa_tied");
    let (dense, _) = eval(&fixture, &[]);
    let (nf4, stderr) = eval(&fixture, &["--quantize-base", "nf4"]);
    println!("dense {dense}, nf4 {nf4}");
    assert!(stderr.contains("14 kept as NF4"), "{stderr}");
    assert!(nf4 != dense, "NF4 changes the weights");
    assert_close_scalar("nf4", nf4, dense, 0.02);
}

#[test]
fn an_unknown_quantization_is_refused_by_name() {
    let fixture = hf_fixture("llama_gqa_tied");
    let output = lemo(&["eval", "--model", path(&fixture), "--quantize-base", "q5_k"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let first = stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("error: ")
            && first.contains("q5_k")
            && first.contains("nf4, q4_k, q8_0 or none"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// SmolLM2's Q4_1 GGUF trains with its projections kept quantized, merges (saying what it
/// dequantized and the precision it wrote), and the merged model scores as the base with the
/// adapter, kept quantized or dequantized at load.
#[test]
fn a_quantized_gguf_base_trains_and_merges() {
    let Some(base) = smollm2_gguf() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (adapter, stderr) = train(&base, &dir.path().join("run"));
    assert!(stderr.contains("210 kept as Q4_1"), "{stderr}");
    let merged = dir.path().join("merged");
    let output = succeed(&[
        "merge",
        "--model",
        path(&base),
        "--adapter",
        path(&adapter),
        "--out",
        path(&merged),
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("Q4_1, Q8_0 blocks were dequantized")
            && stderr.contains("written in float32"),
        "{stderr}"
    );
    let (with_adapter, _) = eval(&base, &["--adapter", path(&adapter)]);
    let (dequantized, _) = eval(
        &base,
        &["--adapter", path(&adapter), "--quantize-base", "none"],
    );
    let (merged, _) = eval(&merged, &[]);
    println!("kept quantized {with_adapter}, dequantized {dequantized}, merged {merged}");
    assert_close_scalar("dequantized at load", dequantized, with_adapter, 1e-5);
    assert_close_scalar("merged", merged, with_adapter, 1e-5);
}
