//! `cargo xtask gpu-test`: the GPU paths CI cannot run (bf16, cuBLASLt, cuDNN attention, the
//! tensor-core flash kernels, NCCL) against their references, on a machine with an NVIDIA GPU.
//!
//! Two steps, so that nothing is compiled on the GPU machine:
//! - `cargo xtask gpu-test bundle` (where the code is built): release builds of the parity
//!   harnesses (`compute_bench`, `attention_bench`), `lemo-train` and this xtask, stripped and
//!   packed with the commit they were built from into `.device/gpu-test.tar.xz`;
//! - `xtask gpu-test run --bundle DIR` (on the GPU machine, from the repository root, with the
//!   bundle unpacked in DIR): runs every check and writes one results file (commit, device, each
//!   check's error, tolerance and verdict) to commit under `kernels/results/`. It exits non-zero
//!   when a check fails.
//!
//! The checks, each against a reference nobody here wrote or a plain f32 computation:
//! - `kernels`: `compute_bench --quick` (its parity checks): cuBLASLt GEMMs (bf16 and f32, every
//!   training form, batched and shared weights) against f32 CPU products, the stream ordering of
//!   GEMMs between CubeCL kernels and of copies to page-locked host memory and back, the fused
//!   bf16 kernels (RMSNorm, RoPE, SwiGLU, LoRA linear, AdamW) against their Burn references, the
//!   dequantize kernel (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K and NF4 weights written in bf16 and f32)
//!   against its Burn reference, the segment-based loss against the full-logits loss;
//! - `attention`: `attention_bench` on the bf16 cases PyTorch writes
//!   (`kernels/reference/attention_sdpa.py --parity-dir`), forward and backward, for the plain
//!   and tensor-core flash kernels and cuDNN, against float32 materialized attention;
//! - `models`: `lemo-train eval --device cuda` in bf16 and f32 on every transformers fixture
//!   against the loss transformers computed;
//! - `nccl`: two ranks of batch one against one rank of batch two (`train --gpus 2`), and one
//!   sequence split over two ranks against one rank (`--context-parallel 2`, its keys and values
//!   gathered by NCCL on the devices), dense and with token elimination, where the machine has
//!   two GPUs or more; otherwise reported as skipped.
//!
//! `--groups` runs some of them (a full run takes most of a device call).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::run;

/// Where `bundle` writes, relative to the repository root (ignored by git).
pub const BUNDLE_DIR: &str = ".device/gpu-test";
/// The binaries a bundle carries, with the packages that build them.
const BINARIES: [(&str, &str); 4] = [
    ("compute_bench", "lemo-kernel-bench"),
    ("attention_bench", "lemo-kernel-bench"),
    ("lemo-train", "lemo-train"),
    ("xtask", "xtask"),
];
/// The groups of checks, in the order they run.
pub const GROUPS: [&str; 4] = ["kernels", "attention", "models", "nccl"];
/// Relative tolerance of a model's loss against transformers', by precision.
const LOSS_TOLERANCES: [(&str, f64); 2] = [("bf16", 1e-2), ("f32", 1e-3)];

/// Builds, strips and packs the binaries and the commit into `root/BUNDLE_DIR`.
pub fn bundle(root: &Path) -> Result<PathBuf> {
    let mut build = Command::new("cargo");
    build.args(["build", "--release"]).current_dir(root);
    for (binary, package) in BINARIES {
        build.args(["-p", package, "--bin", binary]);
    }
    run(&mut build)?;
    let built = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("release");
    let out = root.join(BUNDLE_DIR);
    std::fs::create_dir_all(out.join("bin"))?;
    for (binary, _) in BINARIES {
        let target = out.join("bin").join(binary);
        std::fs::copy(built.join(binary), &target)
            .with_context(|| format!("copying {binary} from {}", built.display()))?;
        run(Command::new("strip").arg(&target))?;
    }
    std::fs::write(out.join("COMMIT"), commit(root)?)?;
    let archive = out.with_extension("tar.xz");
    run(Command::new("tar")
        .env("XZ_OPT", "-T2 -6")
        .arg("-cJf")
        .arg(&archive)
        .arg("-C")
        .arg(&out)
        .args(["bin", "COMMIT"]))?;
    Ok(archive)
}

/// `git describe`-like stamp of the checkout: the commit, marked when the tree has changes.
fn commit(root: &Path) -> Result<String> {
    let git = |args: &[&str]| -> Result<String> {
        let output = Command::new("git").args(args).current_dir(root).output()?;
        if !output.status.success() {
            bail!("git {args:?} failed");
        }
        Ok(String::from_utf8(output.stdout)?.trim().to_string())
    };
    let head = git(&["rev-parse", "--short=12", "HEAD"])?;
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"])?.is_empty();
    Ok(if dirty { format!("{head}-dirty") } else { head })
}

/// One check's outcome, as the results file records it.
fn outcome(group: &str, check: &str, error: Option<f64>, tolerance: f64) -> Value {
    let ok = error.is_some_and(|e| e.is_finite() && e <= tolerance);
    json!({"group": group, "check": check, "relative_error": error, "tolerance": tolerance,
           "ok": ok})
}

/// `command`'s exit status, or `None` when it does not start or runs past `limit` (then it is
/// killed: one check that hangs must not take the rest of the run with it).
fn status_within(command: &mut Command, limit: Duration) -> Option<std::process::ExitStatus> {
    let mut child = command.spawn().ok()?;
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().ok()? {
            return Some(status);
        }
        if started.elapsed() >= limit {
            eprintln!("gpu-test: killed after {} s", limit.as_secs());
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn skipped(group: &str, check: &str, reason: &str) -> Value {
    json!({"group": group, "check": check, "ok": null, "skipped": reason})
}

/// Runs every check with the binaries of `bundle/bin`, writes the results to `out` and fails
/// when a check failed.
pub fn run_checks(root: &Path, bundle: &Path, out: &Path, groups: &[String]) -> Result<()> {
    for group in groups {
        if !GROUPS.contains(&group.as_str()) {
            bail!(
                "--groups: unknown group {group:?} (the groups: {})",
                GROUPS.join(", ")
            );
        }
    }
    let chosen = |group: &str| groups.iter().any(|g| g == group);
    let started = Instant::now();
    let bin = |name: &str| bundle.join("bin").join(name);
    let work = tempfile_dir()?;
    let env = Environment::detect(&work)?;
    eprintln!(
        "gpu-test: {} GPU(s): {}",
        env.gpus.len(),
        env.gpus.join(", ")
    );
    let commit = std::fs::read_to_string(bundle.join("COMMIT"))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let command = format!(
        "xtask gpu-test run --bundle {} --out {}",
        bundle.display(),
        out.display()
    );
    // Written after every group, so that a run cut short keeps what it checked.
    let write = |checks: &[Value], finished: bool| -> Result<(usize, usize, usize)> {
        let count = |verdict: Value| checks.iter().filter(|c| c["ok"] == verdict).count();
        let (passed, failed, skips) = (count(json!(true)), count(json!(false)), count(Value::Null));
        let report = json!({
            "description": "cargo xtask gpu-test: the GPU paths (bf16, cuBLASLt, cuDNN, tensor-core flash attention, NCCL) against their references",
            "commit": commit,
            "device": env.gpus,
            "command": command,
            "finished": finished,
            "seconds": started.elapsed().as_secs_f64().round(),
            "summary": {"passed": passed, "failed": failed, "skipped": skips},
            "checks": checks,
        });
        if let Some(parent) = out.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(out, serde_json::to_string_pretty(&report)? + "\n")?;
        Ok((passed, failed, skips))
    };
    let mut checks = Vec::new();
    if chosen("kernels") {
        checks.extend(kernel_checks(&env, &bin("compute_bench"), &work));
        write(&checks, false)?;
    }
    if chosen("attention") {
        checks.extend(attention_checks(root, &env, &bin("attention_bench"), &work));
        write(&checks, false)?;
    }
    if chosen("models") {
        checks.extend(model_checks(root, &env, &bin("lemo-train")));
        write(&checks, false)?;
    }
    if chosen("nccl") {
        checks.extend(nccl_checks(root, &env, &bin("lemo-train"), &work));
    }
    let (passed, failed, skips) = write(&checks, true)?;
    println!(
        "{passed} passed, {failed} failed, {skips} skipped ({})",
        out.display()
    );
    let _ = std::fs::remove_dir_all(&work);
    if failed > 0 {
        bail!("{failed} GPU check(s) failed: see {}", out.display());
    }
    Ok(())
}

fn tempfile_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("lemo-gpu-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// The GPUs, and the library path under which the binaries find cuBLASLt, cuDNN and NCCL (the
/// toolkit's, else the NVIDIA wheels PyTorch installed; NCCL linked under the name lemo loads).
struct Environment {
    gpus: Vec<String>,
    library_path: String,
}

impl Environment {
    fn detect(work: &Path) -> Result<Self> {
        let output = Command::new("nvidia-smi")
            .args(["--query-gpu=name", "--format=csv,noheader"])
            .output()
            .context("nvidia-smi: gpu-test needs an NVIDIA GPU")?;
        let gpus: Vec<String> = String::from_utf8(output.stdout)?
            .lines()
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty())
            .collect();
        if gpus.is_empty() {
            bail!("nvidia-smi lists no GPU");
        }
        let script = "import glob, os, site\n\
            for pattern in ('libcublasLt.so*', 'libcudnn.so.9*'):\n\
            \x20   hits = [p for d in site.getsitepackages() for p in glob.glob(os.path.join(d, 'nvidia', '**', pattern), recursive=True)]\n\
            \x20   print(os.path.dirname(hits[0]) if hits else '')\n\
            hits = [p for d in site.getsitepackages() for p in glob.glob(os.path.join(d, 'nvidia', '**', 'libnccl.so.2*'), recursive=True)]\n\
            print(hits[0] if hits else '')";
        let found = Command::new("python3").args(["-c", script]).output();
        let lines: Vec<String> = found
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default();
        let nccl_dir = work.join("nccl");
        std::fs::create_dir_all(&nccl_dir)?;
        if let Some(nccl) = lines.get(2).filter(|l| !l.is_empty()) {
            let _ = std::os::unix::fs::symlink(nccl, nccl_dir.join("libnccl.so"));
        }
        let mut dirs = vec![
            nccl_dir.display().to_string(),
            "/usr/local/cuda/lib64".to_string(),
        ];
        dirs.extend(lines.into_iter().take(2).filter(|l| !l.is_empty()));
        dirs.extend(std::env::var("LD_LIBRARY_PATH").ok());
        Ok(Self {
            gpus,
            library_path: dirs.join(":"),
        })
    }

    fn command(&self, program: &Path) -> Command {
        let mut command = Command::new(program);
        command
            .env("LD_LIBRARY_PATH", &self.library_path)
            .env("NCCL_NVLS_ENABLE", "0");
        command
    }
}

/// Runs `command`, echoing its output, and reads the JSON report it wrote to `report`; a
/// failure is one failed check of `group` rather than an abort of the whole run.
fn report_of(group: &str, mut command: Command, report: &Path) -> Result<Value, Value> {
    eprintln!("gpu-test: {command:?}");
    let program = Path::new(command.get_program());
    // A bundle may leave a harness out (python3 is looked up on PATH instead).
    if program.components().count() > 1 && !program.exists() {
        let reason = format!("{} is not in the bundle", program.display());
        return Err(skipped(group, &format!("{group} harness"), &reason));
    }
    let status = command.status();
    let failed = |why: String| outcome(group, &format!("{group} harness: {why}"), None, 0.0);
    match status {
        Ok(s) if s.success() || report.exists() => {}
        Ok(s) => return Err(failed(format!("exited with {s}"))),
        Err(e) => return Err(failed(format!("cannot start: {e}"))),
    }
    let text = std::fs::read_to_string(report).map_err(|e| failed(format!("no report: {e}")))?;
    serde_json::from_str(&text).map_err(|e| failed(format!("bad report: {e}")))
}

fn kernel_checks(env: &Environment, bench: &Path, work: &Path) -> Vec<Value> {
    let report = work.join("compute.json");
    let mut command = env.command(bench);
    command.args(["--quick", "--out"]).arg(&report);
    let report = match report_of("kernels", command, &report) {
        Ok(report) => report,
        Err(failure) => return vec![failure],
    };
    let mut checks: Vec<Value> = parity_rows(&report)
        .map(|row| {
            let error = row["relative_error"].as_f64();
            let tolerance = row["tolerance"].as_f64().unwrap_or(0.0);
            outcome(
                "kernels",
                row["check"].as_str().unwrap_or("?"),
                error,
                tolerance,
            )
        })
        .collect();
    for error in report["errors"].as_array().into_iter().flatten() {
        let section = error["section"].as_str().unwrap_or("?");
        checks.push(outcome(
            "kernels",
            &format!("{section} (panicked)"),
            None,
            0.0,
        ));
    }
    checks
}

fn parity_rows(report: &Value) -> impl Iterator<Item = &Value> {
    report["parity"].as_array().into_iter().flatten()
}

fn attention_checks(root: &Path, env: &Environment, bench: &Path, work: &Path) -> Vec<Value> {
    let cases = work.join("attention_cases");
    let mut reference = Command::new("python3");
    reference
        .arg(root.join("kernels/reference/attention_sdpa.py"))
        .args(["--seqs", "", "--parity-dir"])
        .arg(&cases)
        .arg("--out")
        .arg(work.join("sdpa.json"));
    if let Err(failure) = report_of("attention", reference, &work.join("sdpa.json")) {
        return vec![failure];
    }
    let mut checks = Vec::new();
    // One process per variant: a crash of one keeps the others' results. `cudnn-pieces` runs
    // cuDNN's backward one sequence and one key/value head group at a time, as long sequences do.
    let variants: [(&str, &[&str]); 4] = [
        ("plain", &["--variants", "plain"]),
        ("tensor-core", &["--variants", "tensor-core"]),
        ("cudnn", &["--variants", "cudnn"]),
        (
            "cudnn-pieces",
            &["--variants", "cudnn", "--dq-accumulator-limit", "1"],
        ),
    ];
    for (variant, flags) in variants {
        let report = work.join(format!("attention_{variant}.json"));
        let mut command = env.command(bench);
        command
            .args(flags)
            .args(["--seqs", "", "--parity-dir"])
            .arg(&cases)
            .arg("--out")
            .arg(&report);
        match report_of("attention", command, &report) {
            Ok(report) => checks.extend(parity_rows(&report).flat_map(attention_rows)),
            Err(failure) => checks.push(failure),
        }
    }
    checks
}

/// The forward and gradient errors of one attention case, each held to SDPA's own bf16 error
/// against the same float32 reference (twice it, and at least 1e-2, as `attention_bench`
/// judges them). The variant is the one that ran (cuDNN falls back where it does not apply).
fn attention_rows(row: &Value) -> Vec<Value> {
    let name = format!(
        "{} ({})",
        row["case"].as_str().unwrap_or("?"),
        row["variant"].as_str().unwrap_or("?")
    );
    ["out", "dq", "dk", "dv"]
        .iter()
        .map(|part| {
            let errors = &row["relative_error"][part];
            let tolerance = (2.0 * errors["sdpa"].as_f64().unwrap_or(0.0)).max(1e-2);
            let check = format!("{name} {part}");
            outcome("attention", &check, errors["ours"].as_f64(), tolerance)
        })
        .collect()
}

/// `eval --device cuda` of every transformers fixture against transformers' loss.
fn model_checks(root: &Path, env: &Environment, lemo: &Path) -> Vec<Value> {
    let fixtures = root.join("crates/lemo-models/tests/fixtures/hf");
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&fixtures)
        .map(|dir| {
            dir.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default();
    cases.sort();
    let mut checks = Vec::new();
    for case in cases {
        let name = case.file_name().unwrap().to_string_lossy().into_owned();
        let expected = std::fs::read_to_string(case.join("expected.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| v["loss"].as_f64());
        for (precision, tolerance) in LOSS_TOLERANCES {
            let mut command = env.command(lemo);
            command
                .args(["eval", "--model"])
                .arg(&case)
                .arg("--data")
                .arg(case.join("tokens.jsonl"))
                .args(["--seq-len", "64", "--json", "--device", "cuda"])
                .args(["--precision", precision]);
            let loss = json_output(command).and_then(|v| v["loss"].as_f64());
            let error = loss.zip(expected).map(|(l, e)| (l - e).abs() / e.abs());
            checks.push(outcome(
                "models",
                &format!("{name} eval {precision}"),
                error,
                tolerance,
            ));
        }
    }
    checks
}

/// The JSON value a command printed on stdout, if it succeeded.
fn json_output(mut command: Command) -> Option<Value> {
    eprintln!("gpu-test: {command:?}");
    let output = command.output().ok()?;
    if !output.status.success() {
        eprintln!("{}", String::from_utf8_lossy(&output.stderr));
        return None;
    }
    serde_json::from_slice(&output.stdout).ok()
}

/// Two ranks on two GPUs train as one: two NCCL ranks of batch one as one rank of batch two
/// (data parallelism), and one sequence split over two ranks as one rank of batch one (context
/// parallelism); the logged losses agree. With token elimination the ranks keep rows of their
/// own, so only the first step's loss (an exact forward pass) is one rank's.
fn nccl_checks(root: &Path, env: &Environment, lemo: &Path, work: &Path) -> Vec<Value> {
    const DATA: &str = "data parallel over NCCL: 2 ranks x batch 1 vs 1 rank x batch 2";
    const CONTEXT: &str =
        "context parallel: 1 sequence over 2 ranks (--context-parallel 2) vs 1 rank x batch 1";
    const CONTEXT_LEMO: &str =
        "context parallel with token elimination (--method lemo): first step's loss vs 1 rank";
    if env.gpus.len() < 2 {
        let reason = "one GPU on this machine (run on two or more)";
        return [DATA, CONTEXT, CONTEXT_LEMO]
            .map(|check| skipped("nccl", check, reason))
            .to_vec();
    }
    let fixture = root.join("crates/lemo-models/tests/fixtures/hf/llama_gqa_tied");
    let train = |name: &str, ranks: &[&str], batch: &str| -> Option<Vec<f64>> {
        let out = work.join(name);
        let mut command = env.command(lemo);
        command
            .args(["train", "--model"])
            .arg(&fixture)
            .arg("--data")
            .arg(fixture.join("tokens.jsonl"))
            .args([
                "--seq-len",
                "64",
                "--steps",
                "3",
                "--warmup-steps",
                "0",
                "--lr",
                "1e-2",
            ])
            .args([
                "--val-every",
                "0",
                "--checkpoint-every",
                "0",
                "--cache-dir",
                "none",
                "--collective-timeout",
                "60s",
            ])
            .args(["--device", "cuda", "--precision", "f32"])
            .args(ranks)
            .args(["--batch-size", batch, "--out"])
            .arg(&out);
        eprintln!("gpu-test: {command:?}");
        let status = status_within(&mut command, Duration::from_secs(120))?;
        if !status.success() {
            return None;
        }
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).ok()?;
        Some(
            metrics
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .filter(|row| row["kind"] == "train")
                .filter_map(|row| row["loss"].as_f64())
                .collect(),
        )
    };
    let error = |a: Option<Vec<f64>>, b: Option<Vec<f64>>| {
        a.zip(b).and_then(|(a, b)| {
            (a.len() == b.len() && !a.is_empty()).then(|| {
                a.iter()
                    .zip(&b)
                    .map(|(x, y)| (x - y).abs() / y.abs())
                    .fold(0.0, f64::max)
            })
        })
    };
    let two_ranks = train("two_ranks", &["--gpus", "2"], "1");
    let one_rank = train("one_rank", &["--gpus", "1"], "2");
    let split = train("split", &["--gpus", "2", "--context-parallel", "2"], "1");
    let whole = train("whole", &["--gpus", "1"], "1");
    // Chunks of 64 / 4 tokens: one token block each.
    let lemo_args = [
        "--method",
        "lemo",
        "--attention-keep",
        "0.5",
        "--block-size",
        "16",
    ];
    let lemo_split = train(
        "lemo_split",
        &[&lemo_args[..], &["--gpus", "2", "--context-parallel", "2"]].concat(),
        "1",
    );
    let lemo_whole = train(
        "lemo_whole",
        &[&lemo_args[..], &["--gpus", "1"]].concat(),
        "1",
    );
    let first = |losses: Option<Vec<f64>>| losses.map(|l| l.into_iter().take(1).collect());
    vec![
        outcome("nccl", DATA, error(two_ranks, one_rank), 1e-4),
        outcome("nccl", CONTEXT, error(split, whole), 1e-4),
        outcome(
            "nccl",
            CONTEXT_LEMO,
            error(first(lemo_split), first(lemo_whole)),
            1e-4,
        ),
    ]
}
