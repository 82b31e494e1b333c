//! Checkpoints: `<out>/checkpoints/step-NNNNNN/` holding the trainable weights by module path
//! (`trainable.safetensors`, exact f32), the AdamW moments (`optimizer.safetensors`), the step
//! (`trainer_state.json`) and a PEFT adapter (`adapter/`). A checkpoint is written into a
//! `.partial` folder that is renamed into place when complete, so an interrupted write never
//! leaves a checkpoint that looks whole. Each checkpoint records the identity of the run that
//! wrote it (see `run_dir`): rotation and `--resume` look only at the run's own checkpoints.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub step: usize,
    pub seed: u64,
    pub seq_len: usize,
    /// Training sequences in the packed corpus: a resume must see the same data.
    pub train_sequences: usize,
    /// Data-parallel ranks: a resume must have as many (one in checkpoints from before ranks).
    #[serde(default = "one_rank")]
    pub ranks: usize,
    /// Ranks per sequence group (context parallelism): a resume must have as many.
    #[serde(default = "one_rank")]
    pub context_parallel: usize,
    pub tokens_seen: u64,
    pub elapsed_s: f64,
    /// The run that wrote the checkpoint (absent in checkpoints from before it was recorded).
    #[serde(default)]
    pub run_id: Option<String>,
}

fn one_rank() -> usize {
    1
}

pub fn write_tensors(path: &Path, tensors: &[(String, Vec<f32>)]) -> Result<()> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, values)| {
            (
                name.clone(),
                vec![values.len()],
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).expect("consistent view"),
            )
        })
        .collect();
    let serialized = safetensors::serialize(views, None).context("serializing tensors")?;
    lemo_models::adapter::write_atomically(path, &serialized)?;
    Ok(())
}

pub fn read_tensors(path: &Path) -> Result<Vec<(String, Vec<f32>)>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file =
        SafeTensors::deserialize(&bytes).with_context(|| format!("{}: corrupt", path.display()))?;
    let mut out = Vec::new();
    for (name, view) in file.tensors() {
        if view.dtype() != Dtype::F32 {
            bail!("{}: {name} is not f32", path.display());
        }
        let values = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        out.push((name, values));
    }
    Ok(out)
}

const STATE_FILE: &str = "trainer_state.json";

pub fn checkpoints_dir(out: &Path) -> PathBuf {
    out.join("checkpoints")
}

fn step_of(dir: &Path) -> Option<usize> {
    dir.file_name()?
        .to_str()?
        .strip_prefix("step-")?
        .parse()
        .ok()
}

/// Complete checkpoints in a run folder written by the run `run_id` (by any run when `None`),
/// oldest first.
pub fn list(out: &Path, run_id: Option<&str>) -> Vec<(usize, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(checkpoints_dir(out)) else {
        return Vec::new();
    };
    let mut found: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir() && p.join(STATE_FILE).exists())
        .filter(|p| run_id.is_none_or(|id| written_by(p, id)))
        .filter_map(|p| step_of(&p).map(|s| (s, p)))
        .collect();
    found.sort();
    found
}

/// Whether `checkpoint` was written by the run `run_id` (checkpoints from before runs had
/// identities count as the run's own).
fn written_by(checkpoint: &Path, run_id: &str) -> bool {
    read_state(checkpoint)
        .is_ok_and(|(state, _)| state.run_id.as_deref().is_none_or(|id| id == run_id))
}

/// The checkpoint `--resume PATH` means: PATH itself, or the latest one of the run folder PATH
/// written by that folder's run.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join(STATE_FILE).exists() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        bail!("--resume {}: no such run folder", path.display());
    }
    let run = super::run_dir::identity(path, super::run_dir::Start::Resume)?;
    match list(path, run.as_ref().map(|r| r.id.as_str())).pop() {
        Some((_, dir)) => Ok(dir),
        None => {
            bail!(
                "--resume {}: no checkpoint there (expected a run folder with checkpoints/step-*)",
                path.display()
            )
        }
    }
}

/// The run folder a checkpoint belongs to.
pub fn run_dir_of(checkpoint: &Path) -> Option<PathBuf> {
    let parent = checkpoint.parent()?;
    (parent.file_name()? == "checkpoints")
        .then(|| parent.parent().map(Path::to_path_buf))
        .flatten()
}

pub struct CheckpointFiles {
    pub state: TrainerState,
    pub trainable: Vec<(String, Vec<f32>)>,
    pub optimizer: Vec<(String, Vec<f32>)>,
    pub optimizer_step: u64,
}

/// Writes a checkpoint; `write_adapter` fills the `adapter/` folder it is given.
pub fn save(
    out: &Path,
    files: &CheckpointFiles,
    keep: usize,
    write_adapter: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    let dir = checkpoints_dir(out);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let name = format!("step-{:06}", files.state.step);
    let partial = dir.join(format!("{name}.partial"));
    let done = dir.join(&name);
    if partial.exists() {
        std::fs::remove_dir_all(&partial)?;
    }
    std::fs::create_dir_all(&partial)?;
    write_tensors(&partial.join("trainable.safetensors"), &files.trainable)?;
    write_tensors(&partial.join("optimizer.safetensors"), &files.optimizer)?;
    let mut state = serde_json::to_value(&files.state)?;
    state["optimizer_step"] = files.optimizer_step.into();
    lemo_models::adapter::write_atomically(
        &partial.join(STATE_FILE),
        serde_json::to_string_pretty(&state)?.as_bytes(),
    )?;
    write_adapter(&partial.join("adapter"))?;
    if done.exists() {
        std::fs::remove_dir_all(&done)?;
    }
    std::fs::rename(&partial, &done)
        .with_context(|| format!("cannot move checkpoint into {}", done.display()))?;
    lemo_models::adapter::sync_folder(&dir);
    rotate(out, files, keep);
    Ok(done)
}

/// Deletes the run's own checkpoints older than the newest `keep` up to the one just written.
/// Checkpoints of other runs are never touched, and neither are the run's checkpoints past
/// the current step (left by an earlier attempt that a resume from an older one replaces).
fn rotate(out: &Path, files: &CheckpointFiles, keep: usize) {
    let Some(run_id) = files.state.run_id.as_deref() else {
        return;
    };
    let own: Vec<PathBuf> = list(out, Some(run_id))
        .into_iter()
        .filter(|(step, _)| *step <= files.state.step)
        .map(|(_, dir)| dir)
        .collect();
    if keep > 0 && own.len() > keep {
        for old in &own[..own.len() - keep] {
            let _ = std::fs::remove_dir_all(old);
        }
    }
}

/// The trainer state of a checkpoint and its optimizer step count.
fn read_state(checkpoint: &Path) -> Result<(TrainerState, u64)> {
    let path = checkpoint.join(STATE_FILE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a trainer state", path.display()))?;
    let optimizer_step = json
        .get("optimizer_step")
        .and_then(|v| v.as_u64())
        .unwrap_or(0);
    let state = serde_json::from_value(json)
        .with_context(|| format!("{}: not a trainer state", path.display()))?;
    Ok((state, optimizer_step))
}

pub fn load(checkpoint: &Path) -> Result<CheckpointFiles> {
    let (state, optimizer_step) = read_state(checkpoint)?;
    Ok(CheckpointFiles {
        state,
        trainable: read_tensors(&checkpoint.join("trainable.safetensors"))?,
        optimizer: read_tensors(&checkpoint.join("optimizer.safetensors"))?,
        optimizer_step,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved_checkpoint(out: &Path) -> PathBuf {
        let files = CheckpointFiles {
            state: TrainerState {
                step: 3,
                seed: 1,
                seq_len: 16,
                train_sequences: 4,
                ranks: 1,
                context_parallel: 1,
                tokens_seen: 48,
                elapsed_s: 1.0,
                run_id: Some("run".into()),
            },
            trainable: vec![("a".into(), vec![1.0, 2.0, 3.0])],
            optimizer: vec![("a.m".into(), vec![0.5; 3])],
            optimizer_step: 3,
        };
        save(out, &files, 2, |dir| Ok(std::fs::create_dir_all(dir)?)).unwrap()
    }

    #[test]
    fn an_empty_state_file_is_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = saved_checkpoint(dir.path());
        std::fs::write(checkpoint.join(STATE_FILE), "").unwrap();
        let message = format!("{:#}", load(&checkpoint).err().unwrap());
        assert!(message.contains("trainer_state.json"), "{message}");
    }

    /// Mutated state and tensor files load or fail with an error, never panic.
    #[test]
    fn mutated_checkpoints_never_panic() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = saved_checkpoint(dir.path());
        let mut rng = lemo_test_support::HostRng::new(lemo_test_support::seed());
        for file in [STATE_FILE, "trainable.safetensors", "optimizer.safetensors"] {
            let path = checkpoint.join(file);
            let valid = std::fs::read(&path).unwrap();
            for _ in 0..500 {
                let mut bytes = valid.clone();
                match rng.below(3) {
                    0 => bytes.truncate(rng.below(valid.len())),
                    1 => {
                        for _ in 0..1 + rng.below(4) {
                            bytes[rng.below(valid.len())] = rng.next_u64() as u8;
                        }
                    }
                    _ => {
                        let at = rng.below(valid.len().min(64) - 8);
                        bytes[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
                    }
                }
                std::fs::write(&path, &bytes).unwrap();
                let _ = load(&checkpoint);
            }
            std::fs::write(&path, &valid).unwrap();
        }
        assert!(load(&checkpoint).is_ok());
    }
}
