//! Data-parallel and context-parallel training with simulated ranks on the CPU (`--gpus 2
//! --device cpu`: two ranks share the device and sum their gradients in process memory): two
//! ranks of batch 1 log the losses and train the adapter of one rank of batch 2 (with lora,
//! longlora and lemo), a resumed two-rank run continues exactly, and resuming with another rank
//! count is a one-line error that leaves the run intact. Sequence groups of 2 and 4 ranks (each
//! rank training its share of every sequence) log the losses and gradient norms and train the
//! adapter of one rank, alone and as two data-parallel groups.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn lemo() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lemo-train"))
}

/// `train --preset tiny` for 6 steps into `out`, checkpoints every 2 steps (2 micro-batches a
/// step unless `extra` says `--grad-accum`).
fn train(out: &Path, extra: &[&str]) -> Output {
    let accumulation: &[&str] = match extra.contains(&"--grad-accum") {
        true => &[],
        false => &["--grad-accum", "2"],
    };
    lemo()
        .args(["train", "--preset", "tiny", "--steps", "6"])
        .args(accumulation)
        .args(["--checkpoint-every", "2", "--val-every", "3"])
        .args(["--cache-dir", "none", "--out"])
        .arg(out)
        .args(extra)
        .output()
        .expect("lemo-train runs")
}

fn succeed(output: Output) -> Output {
    assert!(
        output.status.success(),
        "train failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// `(kind, step, loss)` of every record of `metrics.jsonl`.
fn losses(out: &Path) -> Vec<(String, u64, f64)> {
    records(out)
        .iter()
        .map(|v| {
            let loss = v.get("loss").or(v.get("val_loss")).unwrap();
            (
                v["kind"].as_str().unwrap().to_string(),
                v["step"].as_u64().unwrap(),
                loss.as_f64().unwrap(),
            )
        })
        .collect()
}

/// Every record of `metrics.jsonl`.
fn records(out: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON line"))
        .collect()
}

/// The gradient norm of every step of the run in `out`.
fn grad_norms(out: &Path) -> Vec<f64> {
    records(out)
        .iter()
        .filter_map(|v| v.get("grad_norm").and_then(|n| n.as_f64()))
        .collect()
}

/// Runs `a` and `b` log the same losses (within 1e-5) and end with the same adapter (within
/// `adapter_tolerance` of each tensor's largest value).
fn assert_same_training(a: &Path, b: &Path, adapter_tolerance: f32) {
    let (x, y) = (losses(a), losses(b));
    assert_eq!(x.len(), y.len(), "{x:?}\n{y:?}");
    for (p, q) in x.iter().zip(&y) {
        assert_eq!((&p.0, p.1), (&q.0, q.1));
        assert!((p.2 - q.2).abs() <= 1e-5 * p.2.abs(), "{x:?}\n{y:?}");
    }
    let (x, y) = (adapter(a), adapter(b));
    assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>());
    for (name, p) in &x {
        let q = &y[name];
        let scale = p.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
        let error = p.iter().zip(q).fold(0f32, |m, (u, v)| m.max((u - v).abs()));
        assert!(
            error <= adapter_tolerance * scale,
            "{name}: relative error {}",
            error / scale
        );
    }
}

/// `train FLAGS --resume CUT` ends with one line `error: ...` holding each of `expected`, and
/// leaves the checkpoints as they were.
fn assert_resume_refused(cut: &Path, flags: &[&str], expected: &[&str]) {
    let checkpoints = std::fs::read_dir(cut.join("checkpoints")).unwrap().count();
    let output = lemo()
        .arg("train")
        .args(flags)
        .arg("--resume")
        .arg(cut)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    for part in expected {
        assert!(stderr.contains(part), "{part:?} in {stderr}");
    }
    assert_eq!(
        std::fs::read_dir(cut.join("checkpoints")).unwrap().count(),
        checkpoints,
        "a refused resume leaves the checkpoints as they were"
    );
}

fn adapter(out: &Path) -> BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(out.join("adapter/adapter_model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, values)
        })
        .collect()
}

/// Two ranks of batch 1 against one rank run with `one_rank` (the same sequences in each step),
/// both with `method` (`--method` and its flags): the same losses, the same adapter, the same
/// kept fractions; returns the two-rank run's first metrics record.
fn check_two_ranks_train_as_one(method: &[&str], one_rank: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one");
    let two = dir.path().join("two");
    succeed(train(&one, &[method, one_rank].concat()));
    let output = succeed(train(
        &two,
        &[method, &["--batch-size", "1", "--gpus", "2"]].concat(),
    ));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("x 2 rank(s)"), "{stderr}");

    // The baseline before the first step, and the two the run's --val-every asks for.
    assert_eq!(losses(&one).iter().filter(|r| r.0 == "val").count(), 3);
    assert_same_training(&one, &two, 1e-4);

    let first_step = |path: PathBuf| -> serde_json::Value {
        let metrics = std::fs::read_to_string(path).unwrap();
        metrics
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
            .find(|record| record["kind"] != "val")
            .expect("a step record")
    };
    let first = first_step(two.join("metrics.jsonl"));
    assert_eq!(first["ranks"], 2);
    assert_eq!(first["mem_peak_gib_by_rank"].as_array().unwrap().len(), 2);
    assert!(first["allreduce_share"].as_f64().unwrap() >= 0.0);
    let single = first_step(one.join("metrics.jsonl"));
    for kept in ["keep_attention", "keep_mlp"] {
        let (a, b) = (first[kept].as_f64(), single[kept].as_f64());
        let same = match (a, b) {
            (Some(a), Some(b)) => (a - b).abs() < 1e-9,
            _ => a == b,
        };
        assert!(
            same,
            "{kept} (averaged over the ranks): {a:?} against {b:?}"
        );
    }
    first
}

#[test]
fn two_ranks_of_batch_one_train_as_one_rank_of_batch_two() {
    let first = check_two_ranks_train_as_one(&["--method", "lora"], &["--batch-size", "2"]);
    assert!(first["keep_attention"].is_null());
}

#[test]
fn two_ranks_train_as_one_with_longlora_and_lemo() {
    check_two_ranks_train_as_one(&["--method", "longlora"], &["--batch-size", "2"]);
    // lemo keeps as many rows in every sequence of a micro-batch, so a batch of 2 chooses
    // differently from 2 batches of 1: the one rank runs micro-batches of one sequence. Kept
    // rows come in multiples of 128 (what the fused attention needs), so of the tiny preset's
    // 256 tokens a sparse block keeps half: the default 0.7 of the attention blocks rounds up
    // to every row (dense), 0.5 keeps half.
    let lemo = ["--method", "lemo", "--attention-keep", "0.5"];
    let one_rank = ["--batch-size", "1", "--grad-accum", "4"];
    let first = check_two_ranks_train_as_one(&lemo, &one_rank);
    for kept in ["keep_attention", "keep_mlp"] {
        let fraction = first[kept].as_f64().unwrap();
        assert!(
            fraction > 0.0 && fraction < 1.0,
            "lemo's {kept} is a part of the blocks: {fraction}"
        );
    }
}

#[test]
fn two_ranks_resume_exactly_and_refuse_another_rank_count() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full");
    let cut = dir.path().join("cut");
    succeed(train(&full, &["--batch-size", "1", "--gpus", "2"]));
    succeed(train(
        &cut,
        &["--batch-size", "1", "--gpus", "2", "--stop-after", "3"],
    ));
    assert_resume_refused(&cut, &["--gpus", "1"], &["2 rank(s)", "--gpus 2"]);

    succeed(
        lemo()
            .args(["train", "--resume"])
            .arg(&cut)
            .output()
            .unwrap(),
    );
    assert_eq!(losses(&cut), losses(&full));

    let output = train(&dir.path().join("none"), &["--gpus", "0"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert_eq!(stderr, "error: --gpus must be at least 1\n");
}

/// Sequence groups of 2, 3 and 4 ranks, each rank training its share of every sequence, against one
/// rank on the same sequences: the same losses and gradient norms (within 1e-4) at every step,
/// and the same adapter after six steps within 1e-3 (AdamW's normalized steps magnify the
/// rounding of gradient entries near zero, which the sums over ranks add up in another order;
/// `lemo-models`' gradients test checks a split sequence's gradients against PyTorch's, 1e-4);
/// and two groups of two (data-parallel over sequence groups) against one rank of batch 2.
#[test]
fn sequence_groups_train_as_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let output = succeed(train(&out, &[&["--method", "lora"], extra].concat()));
        (out, String::from_utf8_lossy(&output.stderr).into_owned())
    };
    let (one, _) = run("one", &["--batch-size", "1"]);
    let (pair, _) = run("one-of-2", &["--batch-size", "2"]);
    // Three ranks divide neither the 4 query heads nor the 2 K/V heads: the keys and values are
    // gathered whole, so any group size splits a length that is a multiple of twice its ranks.
    let (one_192, _) = run("one-192", &["--batch-size", "1", "--seq-len", "192"]);
    let cases: [(&str, &[&str], &PathBuf); 4] = [
        ("cp2", &["--gpus", "2", "--context-parallel", "2"], &one),
        ("cp4", &["--gpus", "4", "--context-parallel", "4"], &one),
        (
            "cp3",
            &["--gpus", "3", "--context-parallel", "3", "--seq-len", "192"],
            &one_192,
        ),
        (
            "dp2-cp2",
            &["--gpus", "4", "--context-parallel", "2"],
            &pair,
        ),
    ];
    for (name, flags, reference) in cases {
        let (split, stderr) = run(name, &[flags, &["--batch-size", "1"]].concat());
        assert!(
            stderr.contains(&format!("x {} rank(s)", flags[1])),
            "{stderr}"
        );
        assert_same_training(reference, &split, 1e-3);
        let (a, b) = (grad_norms(reference), grad_norms(&split));
        assert_eq!(a.len(), 6, "{a:?}");
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-4 * x, "{name}: {a:?}\n{b:?}");
        }
        let first = records(&split)
            .into_iter()
            .find(|r| r["kind"] == "train")
            .unwrap();
        assert_eq!(first["context_parallel"], flags[3].parse::<u64>().unwrap());
        let waited = first["sequence_exchange_s"].as_f64();
        assert!(waited.is_some_and(|s| s >= 0.0), "{name}: {first}");
        let tokens = records(reference)
            .into_iter()
            .find(|r| r["kind"] == "train")
            .unwrap();
        assert_eq!(first["tokens"], tokens["tokens"], "{name}: tokens per step");
    }
}

/// `lemo` over sequence groups of two: the forward pass is exact, so the validation before the
/// first step and the first step's loss are one rank's (the kept rows, balanced between the
/// ranks, and so the gradients differ); the kept fractions are logged.
#[test]
fn token_elimination_trains_over_sequence_groups() {
    let dir = tempfile::tempdir().unwrap();
    let lemo = [
        "--method",
        "lemo",
        "--attention-keep",
        "0.5",
        "--block-size",
        "16",
        "--batch-size",
        "1",
    ];
    let (one, split) = (dir.path().join("one"), dir.path().join("split"));
    succeed(train(&one, &lemo));
    let ranks = ["--gpus", "2", "--context-parallel", "2"];
    succeed(train(&split, &[&lemo[..], &ranks].concat()));
    let (a, b) = (losses(&one), losses(&split));
    assert_eq!(a.len(), b.len(), "{a:?}\n{b:?}");
    for (x, y) in a.iter().zip(&b).take(2) {
        assert_eq!((&x.0, x.1), (&y.0, y.1));
        assert!((x.2 - y.2).abs() <= 1e-5 * x.2.abs(), "{a:?}\n{b:?}");
    }
    let first = records(&split)
        .into_iter()
        .find(|r| r["kind"] == "train")
        .unwrap();
    for kept in ["keep_attention", "keep_mlp"] {
        let fraction = first[kept].as_f64().unwrap();
        assert!(fraction > 0.0 && fraction < 1.0, "{kept}: {fraction}");
    }
}

/// What context parallelism refuses, each with one line: a split that leaves ranks over, a
/// sequence that does not split into equal chunks, `lemo` with batches of several sequences or
/// with chunks that are not whole token blocks, `longlora`, and a resume with another group size
/// (which leaves the run as it was).
#[test]
fn sequence_groups_refuse_what_they_cannot_split() {
    let dir = tempfile::tempdir().unwrap();
    let refused = |extra: &[&str], expected: &str| {
        let output = train(&dir.path().join("refused"), extra);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success());
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.starts_with("error: ") && stderr.contains(expected),
            "{stderr}"
        );
    };
    refused(
        &["--gpus", "3", "--context-parallel", "2"],
        "does not divide the 3 rank(s)",
    );
    refused(&["--gpus", "3", "--context-parallel", "3"], "multiple of 6");
    refused(
        &["--method", "lemo", "--gpus", "2", "--context-parallel", "2"],
        "--batch-size 1",
    );
    refused(
        &[
            "--method",
            "longlora",
            "--gpus",
            "2",
            "--context-parallel",
            "2",
        ],
        "longlora",
    );
    refused(
        &[
            "--method",
            "lemo",
            "--batch-size",
            "1",
            "--gpus",
            "2",
            "--context-parallel",
            "2",
            "--block-size",
            "48",
        ],
        "whole 48-token blocks",
    );

    let cut = dir.path().join("cut");
    let split = [
        "--batch-size",
        "1",
        "--gpus",
        "2",
        "--context-parallel",
        "2",
    ];
    succeed(train(&cut, &[&split[..], &["--stop-after", "2"]].concat()));
    let another = ["--gpus", "2", "--context-parallel", "1"];
    assert_resume_refused(&cut, &another, &["resume with --context-parallel 2"]);
}
