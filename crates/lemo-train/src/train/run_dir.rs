//! The run folder (`--out`) belongs to one run. A new run refuses a folder that already holds
//! one unless `--resume` (continue it) or `--overwrite` (replace it) says otherwise, so that an
//! earlier run's adapter, metrics and checkpoints are never mixed with or lost to a new one. The
//! run's identity (`run.json`) is recorded in each checkpoint it writes: checkpoint rotation and
//! `--resume` consider only the run's own checkpoints.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

pub const RUN_FILE: &str = "run.json";

/// The files a run writes at the top of its folder: `--overwrite` removes these, and no others.
const RUN_FILES: &[&str] = &[
    RUN_FILE,
    "config.toml",
    "metrics.jsonl",
    "summary.json",
    "thresholds.json",
];

/// A folder a run writes into, and which of its entries are the run's: `--overwrite` removes
/// those, then the folder once nothing is left in it, so a file of the user's kept there
/// survives (as does the folder holding it).
struct RunFolder {
    name: &'static str,
    owns: fn(&str) -> bool,
}

const RUN_FOLDERS: &[RunFolder] = &[
    RunFolder {
        name: "adapter",
        owns: |entry| {
            [
                lemo_models::adapter::CONFIG_FILE,
                lemo_models::adapter::WEIGHTS_FILE,
                crate::lemo::THRESHOLDS_FILE,
                crate::modelio::TRAINING_INFO_FILE,
            ]
            .contains(&entry)
                || is_partial_write(entry)
        },
    },
    RunFolder {
        name: "checkpoints",
        owns: |entry| entry.starts_with("step-"),
    },
    RunFolder {
        name: "plots",
        owns: |entry| entry.ends_with(".svg") || is_partial_write(entry),
    },
];

/// A temporary file of an atomic write that an interrupted run left behind.
fn is_partial_write(entry: &str) -> bool {
    entry.starts_with('.') && entry.ends_with(".partial")
}

/// What `--preset` writes besides: its generated model and data, removed by `--overwrite` only
/// when the run there was a preset's (a user's own `data/` beside a run is theirs).
const PRESET_ENTRIES: &[&str] = &["base-model", "data"];

/// Held while a run writes its folder: a second run into it is refused.
const LOCK_FILE: &str = ".lock";

/// Entries whose presence means a run has started here (setup files such as a preset's
/// generated model do not: a run that failed before its first step can be retried).
const STARTED_MARKERS: &[&str] = &[
    RUN_FILE,
    "config.toml",
    "metrics.jsonl",
    "adapter",
    "checkpoints",
];

/// How a run treats its output folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// A new run: the folder must not hold one.
    Fresh,
    /// Replace the run in the folder.
    Overwrite,
    /// Continue the run in the folder.
    Resume,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunIdentity {
    pub id: String,
}

/// Checks (and for `Overwrite`, clears) `out` before anything is loaded, so that a refused or
/// failing run changes nothing of the run already there.
pub fn prepare(out: &Path, start: Start) -> Result<()> {
    let started = STARTED_MARKERS.iter().any(|m| out.join(m).exists());
    match start {
        Start::Fresh if started => bail!(
            "--out {} already holds a run: pass --resume {0} to continue it, --overwrite to \
             replace it, or another --out",
            out.display()
        ),
        Start::Overwrite if started => {
            let preset_run = std::fs::read_to_string(out.join("config.toml"))
                .ok()
                .and_then(|text| text.parse::<toml::Table>().ok())
                .is_some_and(|config| config.contains_key("preset"));
            let preset_entries = if preset_run { PRESET_ENTRIES } else { &[] };
            for entry in RUN_FILES.iter().chain(preset_entries) {
                remove(&out.join(entry))?;
            }
            for folder in RUN_FOLDERS {
                clear_folder(&out.join(folder.name), folder.owns)?;
            }
        }
        Start::Overwrite => {}
        Start::Fresh | Start::Resume => {}
    }
    Ok(())
}

/// The run folder, held by one process: dropped when the run ends (however it ends, short of
/// the process being killed; a lock whose process is gone is taken over).
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
}

impl RunLock {
    /// Takes the lock of `out` (creating the folder), or says which process holds it.
    pub fn acquire(out: &Path) -> Result<Self> {
        std::fs::create_dir_all(out)
            .with_context(|| format!("--out {}: cannot create the folder", out.display()))?;
        let path = out.join(LOCK_FILE);
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut file) => {
                    use std::io::Write;
                    write!(file, "{}", std::process::id())
                        .with_context(|| format!("cannot write {}", path.display()))?;
                    return Ok(Self { path });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let holder = std::fs::read_to_string(&path).unwrap_or_default();
                    let holder = holder.trim();
                    if process_alive(holder) {
                        bail!(
                            "--out {}: another run (process {holder}) is writing this folder; wait for it or choose another --out",
                            out.display()
                        );
                    }
                    // Its process is gone (killed): the lock is stale.
                    let _ = std::fs::remove_file(&path);
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("cannot create {}", path.display()));
                }
            }
        }
        bail!("--out {}: cannot take the run folder's lock", out.display())
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether the process of this id runs on this machine (`/proc`; elsewhere assumed alive).
fn process_alive(pid: &str) -> bool {
    match pid.parse::<u32>() {
        Ok(pid) if Path::new("/proc/self").exists() => Path::new(&format!("/proc/{pid}")).exists(),
        Ok(_) => true,
        Err(_) => false,
    }
}

fn remove(path: &Path) -> Result<()> {
    let result = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else if path.exists() {
        std::fs::remove_file(path)
    } else {
        return Ok(());
    };
    result.with_context(|| format!("--overwrite: cannot remove {}", path.display()))
}

/// Removes the entries of `folder` that `owns` names, then the folder if that emptied it.
fn clear_folder(folder: &Path, owns: fn(&str) -> bool) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return Ok(());
    };
    for entry in entries.filter_map(|e| e.ok()) {
        if entry.file_name().to_str().is_some_and(owns) {
            remove(&entry.path())?;
        }
    }
    // Fails, as it should, when a user's file is still there.
    let _ = std::fs::remove_dir(folder);
    Ok(())
}

/// The identity of the run in `out`: a new one for a new run (written to `run.json`), the
/// recorded one when resuming (`None` for a run folder from before identities were recorded).
pub fn identity(out: &Path, start: Start) -> Result<Option<RunIdentity>> {
    let path = out.join(RUN_FILE);
    if start == Start::Resume {
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let identity = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a run identity", path.display()))?;
        return Ok(Some(identity));
    }
    let identity = RunIdentity { id: new_id() };
    lemo_models::adapter::write_atomically(&path, serde_json::to_string(&identity)?.as_bytes())?;
    Ok(Some(identity))
}

/// Unique enough to tell runs in one folder apart: the start time and the process.
fn new_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{nanos:x}-{:x}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_started_run_is_refused_overwrite_clears_only_run_entries() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        prepare(out, Start::Fresh).unwrap();
        std::fs::write(out.join("notes.txt"), "mine").unwrap();
        std::fs::create_dir_all(out.join("base-model")).unwrap();
        prepare(out, Start::Fresh).expect("setup files alone are no run");
        identity(out, Start::Fresh).unwrap();
        std::fs::write(out.join("metrics.jsonl"), "{}").unwrap();
        let refused = prepare(out, Start::Fresh).unwrap_err().to_string();
        assert!(refused.contains("--resume"), "{refused}");
        prepare(out, Start::Resume).unwrap();
        assert!(out.join("metrics.jsonl").exists());
        prepare(out, Start::Overwrite).unwrap();
        assert!(!out.join("metrics.jsonl").exists() && !out.join(RUN_FILE).exists());
        assert!(
            out.join("base-model").exists(),
            "not a preset's run: its base-model/ is the user's"
        );
        std::fs::write(out.join("config.toml"), "preset = \"tiny\"\n").unwrap();
        prepare(out, Start::Overwrite).unwrap();
        assert!(!out.join("base-model").exists(), "the preset's own model");
        assert_eq!(
            std::fs::read_to_string(out.join("notes.txt")).unwrap(),
            "mine"
        );
    }

    #[test]
    fn overwrite_keeps_a_users_file_inside_the_run_folders() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        let adapter = out.join("adapter");
        std::fs::create_dir_all(out.join("checkpoints/step-000004/adapter")).unwrap();
        std::fs::create_dir_all(out.join("plots")).unwrap();
        std::fs::create_dir_all(&adapter).unwrap();
        for file in [
            lemo_models::adapter::WEIGHTS_FILE,
            lemo_models::adapter::CONFIG_FILE,
            ".adapter_config.json.77.partial",
            "README.md",
        ] {
            std::fs::write(adapter.join(file), "x").unwrap();
        }
        std::fs::write(out.join("plots/loss.svg"), "x").unwrap();
        std::fs::write(out.join("metrics.jsonl"), "{}").unwrap();
        prepare(out, Start::Overwrite).unwrap();
        let left: Vec<_> = std::fs::read_dir(&adapter)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            left,
            ["README.md"],
            "only the user's file stays in adapter/"
        );
        assert!(!out.join("checkpoints").exists() && !out.join("plots").exists());
    }

    #[test]
    fn a_second_run_into_a_locked_folder_is_refused_and_a_dead_holder_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let held = RunLock::acquire(dir.path()).unwrap();
        let refused = RunLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(refused.contains("another run"), "{refused}");
        drop(held);
        assert!(!dir.path().join(LOCK_FILE).exists());
        // A process id that cannot be running.
        std::fs::write(dir.path().join(LOCK_FILE), "4294967295").unwrap();
        RunLock::acquire(dir.path()).expect("a stale lock is taken over");
    }

    #[test]
    fn resuming_reads_the_recorded_identity() {
        let dir = tempfile::tempdir().unwrap();
        let written = identity(dir.path(), Start::Fresh).unwrap();
        assert_eq!(identity(dir.path(), Start::Resume).unwrap(), written);
        let other = tempfile::tempdir().unwrap();
        assert_eq!(identity(other.path(), Start::Resume).unwrap(), None);
    }
}
