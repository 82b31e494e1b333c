//! End-to-end `train --preset tiny` runs on the CPU: the loss falls, the outputs exist, activation
//! checkpointing changes nothing but memory, and a run interrupted after a checkpoint and resumed
//! logs exactly the losses of an uninterrupted run; the same seed trains the same adapter on the
//! wgpu device as on the CPU.

use std::path::Path;
use std::process::Command;

fn lemo() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lemo-train"))
}

fn train(out: &Path, extra: &[&str]) {
    let output = train_command(out, extra).output().expect("lemo-train runs");
    assert!(
        output.status.success(),
        "train failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `train --preset tiny` for 12 steps into `out`, checkpoints every 4, validation every 6.
fn train_command(out: &Path, extra: &[&str]) -> Command {
    let mut cmd = lemo();
    cmd.args([
        "train",
        "--preset",
        "tiny",
        "--steps",
        "12",
        "--checkpoint-every",
        "4",
        "--val-every",
        "6",
    ]);
    cmd.args(["--cache-dir", "none", "--out"])
        .arg(out)
        .args(extra);
    cmd
}

fn losses(out: &Path) -> Vec<(String, u64, f64)> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON line"))
        .map(|v| {
            let kind = v["kind"].as_str().unwrap().to_string();
            let loss = v
                .get("loss")
                .or(v.get("val_loss"))
                .and_then(|l| l.as_f64())
                .unwrap();
            (kind, v["step"].as_u64().unwrap(), loss)
        })
        .collect()
}

#[test]
fn tiny_preset_trains_writes_outputs_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full");
    train(&full, &[]);
    for file in [
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "adapter/lemo_training.json",
        "metrics.jsonl",
        "plots/loss.svg",
        "plots/lr.svg",
        "plots/memory.svg",
        "config.toml",
        "checkpoints/step-000012/trainer_state.json",
    ] {
        assert!(full.join(file).exists(), "missing {file}");
    }
    let uninterrupted = losses(&full);
    let train_losses: Vec<f64> = uninterrupted
        .iter()
        .filter(|r| r.0 == "train")
        .map(|r| r.2)
        .collect();
    assert_eq!(train_losses.len(), 12);
    assert!(
        train_losses[11] < train_losses[0] - 0.2,
        "loss did not fall: {train_losses:?}"
    );

    // Activation checkpointing recomputes the same gradients, so the same losses follow.
    let recomputed = dir.path().join("recomputed");
    train(&recomputed, &["--stop-after", "4", "--checkpointing"]);
    let recomputed_losses: Vec<f64> = losses(&recomputed)
        .iter()
        .filter(|r| r.0 == "train")
        .map(|r| r.2)
        .collect();
    assert_eq!(recomputed_losses.len(), 4);
    // The activation plan is recorded with every step: all kept on the host's budget here,
    // all recomputed with --checkpointing.
    for (run, letter) in [(&full, 'k'), (&recomputed, 'r')] {
        let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        let first: serde_json::Value = metrics
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .find(|r| r["kind"] == "train")
            .unwrap();
        let plan = first["activation_plan"].as_str().unwrap();
        assert!(
            !plan.is_empty() && plan.chars().all(|c| c == letter),
            "{plan}"
        );
    }
    for (plain, recomputed) in train_losses.iter().zip(&recomputed_losses) {
        assert!(
            (plain - recomputed).abs() < 1e-4,
            "with --checkpointing: {recomputed_losses:?}, without: {train_losses:?}"
        );
    }

    // Stop after 6 steps (last checkpoint at 4), then resume from the run folder.
    let cut = dir.path().join("cut");
    train(&cut, &["--stop-after", "6"]);
    assert!(
        !cut.join("adapter").exists(),
        "a stopped run writes no final adapter"
    );
    resume(&cut);
    assert_eq!(
        losses(&cut),
        uninterrupted,
        "a resumed run must log the uninterrupted run's losses"
    );

    // A signal a few steps in: the step finishes, a checkpoint is written, the exit says how to
    // resume, and the resumed run logs the uninterrupted run's losses.
    let signalled = dir.path().join("signalled");
    let child = train_command(&signalled, &[])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_train_records(&signalled, 2);
    // SAFETY: signalling the child this test started.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("--resume"), "{stderr}");
    let stopped_at = losses(&signalled).iter().filter(|r| r.0 == "train").count();
    assert!(stopped_at < 12, "the signal did not stop the run");
    let checkpoint = signalled.join(format!("checkpoints/step-{stopped_at:06}"));
    assert!(checkpoint.exists(), "no checkpoint at step {stopped_at}");
    resume(&signalled);
    assert_eq!(losses(&signalled), uninterrupted);
}

/// `--keep-exactly`: every step keeps exactly the asked fractions (no calibration; calibrated
/// thresholds keep 0.58 of the rows at some steps of this run; 0.5 is a multiple of 128 of the
/// preset's 256 tokens, which kept rows are rounded up to), the file beside the adapter says so
/// for `eval`, and a thresholds file alongside is refused.
#[test]
fn lemo_keeps_exactly_its_fractions_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("exact");
    let args = [
        "--method",
        "lemo",
        "--keep-exactly",
        "--attention-keep",
        "0.5",
        "--mlp-keep",
        "0.5",
        "--block-size",
        "8",
    ];
    train(&out, &args);
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["kind"] == "train")
        .collect();
    assert_eq!(steps.len(), 12);
    for step in &steps {
        assert_eq!(step["keep_attention"].as_f64(), Some(0.5), "{step}");
        assert_eq!(step["keep_mlp"].as_f64(), Some(0.5), "{step}");
    }
    let saved = std::fs::read_to_string(out.join("adapter/thresholds.json")).unwrap();
    let saved: serde_json::Value = serde_json::from_str(&saved).unwrap();
    assert_eq!(saved["block_min_keep"], serde_json::json!([0.5, 0.5]));
    // No calibration: no measured kept fraction, and no threshold selects beyond the floor.
    assert!(saved["measured"].is_null(), "{saved}");
    for layer in saved["layers"].as_array().unwrap().iter().skip(1) {
        let threshold = layer["attention"].as_f64().unwrap() as f32;
        assert_eq!(threshold, f32::MAX, "{layer}");
    }

    let output = train_command(
        &dir.path().join("both"),
        &[&args[..], &["--thresholds", "thresholds.json"]].concat(),
    )
    .output()
    .unwrap();
    lemo_test_support::assert_clean_error(&output, "--keep-exactly and --thresholds");
}

/// `--method lemo --s2`: S2 attention acts (the first step's loss, taken
/// before any update, is not lemo's without it) and the run trains to finite losses.
#[test]
fn lemo_with_s2_attention_trains() {
    let dir = tempfile::tempdir().unwrap();
    let lemo = [
        "--method",
        "lemo",
        "--keep-exactly",
        "--attention-keep",
        "0.5",
        "--mlp-keep",
        "0.5",
        "--block-size",
        "8",
    ];
    let train_losses = |name: &str, extra: &[&str]| -> Vec<f64> {
        let out = dir.path().join(name);
        train(&out, &[&lemo[..], extra].concat());
        let losses: Vec<f64> = losses(&out)
            .into_iter()
            .filter(|r| r.0 == "train")
            .map(|r| r.2)
            .collect();
        assert!(losses.iter().all(|l| l.is_finite()), "{name}: {losses:?}");
        losses
    };
    let dense = train_losses("lemo", &[]);
    let s2 = train_losses("lemo-s2", &["--s2"]);
    assert_eq!(s2.len(), 12);
    assert!(
        (dense[0] - s2[0]).abs() > 1e-6 * dense[0].abs(),
        "S2 left the first loss as it was: {} vs {}",
        dense[0],
        s2[0]
    );
}

/// `train --resume out`, which must succeed.
fn resume(out: &Path) {
    let output = lemo()
        .args(["train", "--resume"])
        .arg(out)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "resume failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Polls the run's metrics until `count` training steps are logged.
fn wait_for_train_records(out: &Path, count: usize) {
    let started = std::time::Instant::now();
    while started.elapsed() < std::time::Duration::from_secs(300) {
        let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap_or_default();
        if text.matches("\"kind\":\"train\"").count() >= count {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("the run logged no {count} steps in 300 s");
}

/// A new run refuses a folder holding an earlier run and leaves its files as they were;
/// `--overwrite` replaces it.
#[test]
fn an_earlier_run_is_never_overwritten_without_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    train(&out, &["--stop-after", "1"]);
    let metrics = std::fs::read(out.join("metrics.jsonl")).unwrap();
    let config = std::fs::read(out.join("config.toml")).unwrap();
    let output = train_command(&out, &["--lr", "1e-3"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.starts_with("error: ") && stderr.contains("--overwrite"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(out.join("metrics.jsonl")).unwrap(), metrics);
    assert_eq!(std::fs::read(out.join("config.toml")).unwrap(), config);
    train(&out, &["--stop-after", "1", "--overwrite", "--lr", "1e-3"]);
    assert_ne!(std::fs::read(out.join("config.toml")).unwrap(), config);
}

#[test]
fn eval_applies_the_adapter_and_its_rope_scaling() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    train(&run, &[]);
    let data = run.join("data/stories.jsonl");
    let eval = |extra: &[&str]| -> f64 {
        let output = lemo()
            .args(["eval", "--model"])
            .arg(run.join("base-model"))
            .arg("--data")
            .arg(&data)
            .args([
                "--seq-len",
                "256",
                "--stride",
                "256",
                "--device",
                "cpu",
                "--json",
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        v["loss"].as_f64().unwrap()
    };
    let adapter = run.join("adapter");
    let tuned = eval(&["--adapter", adapter.to_str().unwrap()]);
    let base = eval(&["--target-context", "256"]);
    assert!(tuned < base - 0.2, "adapter loss {tuned} vs base {base}");
    let stderr = lemo()
        .args(["eval", "--model"])
        .arg(run.join("base-model"))
        .arg("--data")
        .arg(&data)
        .args([
            "--seq-len",
            "64",
            "--device",
            "cpu",
            "--adapter",
            adapter.to_str().unwrap(),
        ])
        .output()
        .unwrap()
        .stderr;
    assert!(
        String::from_utf8_lossy(&stderr).contains("factor 2"),
        "the recorded RoPE factor is applied"
    );
}

/// Three steps of `method` on the Llama fixture on `device`, f32: the logged training losses.
fn fixture_losses(out: &Path, method: &str, device: &str) -> Vec<f64> {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../lemo-models/tests/fixtures/hf/llama_gqa_tied");
    let output = lemo()
        .args(["train", "--model"])
        .arg(&fixture)
        .arg("--data")
        .arg(fixture.join("tokens.jsonl"))
        .args(["--method", method, "--device", device, "--precision", "f32"])
        .args(["--seq-len", "32"])
        .args(lemo_test_support::SHORT_TRAINING)
        .arg("--out")
        .arg(out)
        .output()
        .expect("lemo-train runs");
    assert!(
        output.status.success(),
        "train on {device} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    losses(out)
        .into_iter()
        .filter(|r| r.0 == "train")
        .map(|r| r.2)
        .collect()
}

/// The same seed trains the same adapter on every device: after two updates (the first from a
/// zero `lora_B`, so it depends on the initial `lora_A`) the wgpu losses are the CPU's.
#[test]
fn training_on_wgpu_follows_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    for method in ["lora", "longlora"] {
        let cpu = fixture_losses(&dir.path().join(format!("cpu-{method}")), method, "cpu");
        let wgpu = fixture_losses(&dir.path().join(format!("wgpu-{method}")), method, "wgpu");
        assert_eq!(cpu.len(), 3);
        for (a, b) in cpu.iter().zip(&wgpu) {
            assert!(
                (a - b).abs() < 1e-4 * a.abs(),
                "{method}: cpu {cpu:?}, wgpu {wgpu:?}"
            );
        }
    }
}

/// A second `--method lemo` run of the same model on the same data with the same settings reads
/// the thresholds the first one calibrated from the cache (another learning rate changes nothing
/// calibration reads), and `--cache-dir none` calibrates again.
#[test]
fn calibrated_thresholds_are_reused_from_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = lemo_test_support::hf_fixture("llama_gqa_tied");
    let run = |name: &str, lr: &str, cache: &Path| {
        let out = dir.path().join(name);
        let output = lemo()
            .args(["train", "--model"])
            .arg(&fixture)
            .arg("--data")
            .arg(fixture.join("tokens.jsonl"))
            .args(["--method", "lemo", "--block-size", "8", "--seq-len", "32"])
            .args([
                "--steps",
                "1",
                "--lr",
                lr,
                "--val-every",
                "0",
                "--precision",
                "f32",
            ])
            .arg("--cache-dir")
            .arg(cache)
            .arg("--out")
            .arg(&out)
            .output()
            .expect("lemo-train runs");
        let log = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(output.status.success(), "train failed: {log}");
        let thresholds = std::fs::read_to_string(out.join("adapter/thresholds.json")).unwrap();
        (log.contains("calibrated earlier"), thresholds)
    };
    let cache = dir.path().join("cache");
    let (first_cached, first) = run("first", "1e-3", &cache);
    assert!(!first_cached);
    let (second_cached, second) = run("second", "2e-3", &cache);
    assert!(second_cached, "the second run calibrated again");
    assert_eq!(first, second);
    let entries = std::fs::read_dir(cache.join("thresholds")).unwrap().count();
    assert_eq!(entries, 1);
    let (uncached, _) = run("third", "2e-3", Path::new("none"));
    assert!(!uncached);
}
