//! Calibrated thresholds kept between runs: calibrating the same model on the same sequences with
//! the same settings gives the same thresholds, so a second run (another learning rate, more
//! steps, a run started over) reads them back instead of profiling again. An entry is named by a
//! hash of everything calibration reads: the model file(s) (path, size, modification time), the
//! RoPE frequencies training runs at, the precision, the LeMo settings (with the query rows the
//! attention scores read) and the calibration sequences' token ids. A corrupt or unreadable entry is calibrated again and rewritten.

use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use lemo_sparsity::Thresholds;

use super::LemoSettings;
use crate::data::corpus::fnv1a;

/// Path, size and modification time of `path`, or of each file of the folder `path`.
fn file_identity(path: &Path) -> String {
    let describe = |path: &Path| {
        let meta = std::fs::metadata(path).ok();
        let size = meta.as_ref().map_or(0, |m| m.len());
        let modified = meta
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        format!("{}:{size}:{modified};", path.display())
    };
    let path = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    if !path.is_dir() {
        return describe(&path);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&path)
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    files.sort();
    files.iter().map(|file| describe(file)).collect()
}

/// The entry in `cache_dir` (its `thresholds` folder) of a calibration of `model` on
/// `sequences` with `settings`; `context` holds whatever else the calibration depends on (RoPE
/// frequencies, precision).
pub fn entry(
    cache_dir: &Path,
    model: &Path,
    settings: &LemoSettings,
    context: &str,
    sequences: &[Vec<u32>],
) -> Option<PathBuf> {
    // The thresholds file of the run itself is not an input of calibration.
    let settings = LemoSettings {
        thresholds: None,
        ..settings.clone()
    };
    let mut hash = fnv1a(file_identity(model).as_bytes(), 0xcbf2_9ce4_8422_2325);
    hash = fnv1a(serde_json::to_string(&settings).ok()?.as_bytes(), hash);
    hash = fnv1a(context.as_bytes(), hash);
    // The scores calibration profiles, which the settings leave to a default.
    let query_stride = settings.scoring().query_stride;
    hash = fnv1a(format!("query stride {query_stride}").as_bytes(), hash);
    for sequence in sequences {
        let bytes: Vec<u8> = sequence.iter().flat_map(|t| t.to_le_bytes()).collect();
        hash = fnv1a(&bytes, hash);
    }
    Some(
        cache_dir
            .join("thresholds")
            .join(format!("{hash:016x}.json")),
    )
}

/// Stores `thresholds` at `entry`; a cache that cannot be written costs only a note.
pub fn store(entry: &Path, thresholds: &Thresholds) {
    let written = entry
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .map_err(anyhow::Error::from)
        .and_then(|()| super::write_thresholds(entry, thresholds));
    if let Err(error) = written {
        eprintln!("lemo: the thresholds were not cached ({error:#})");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_entry_follows_the_model_settings_and_sequences_but_not_the_thresholds_path() {
        let dir = std::env::temp_dir().join(format!("lemo-threshold-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("model.bin");
        std::fs::write(&model, b"weights").unwrap();
        let settings = LemoSettings::default();
        let sequences = vec![vec![1, 2, 3], vec![4, 5, 6]];
        let base = entry(&dir, &model, &settings, "bf16", &sequences).unwrap();
        let with_path = LemoSettings {
            thresholds: Some("elsewhere.json".into()),
            ..settings.clone()
        };
        assert_eq!(
            entry(&dir, &model, &with_path, "bf16", &sequences).unwrap(),
            base
        );
        let other_keep = LemoSettings {
            target_keep: 0.6,
            ..settings.clone()
        };
        assert_ne!(
            entry(&dir, &model, &other_keep, "bf16", &sequences).unwrap(),
            base
        );
        assert_ne!(
            entry(&dir, &model, &settings, "f32", &sequences).unwrap(),
            base
        );
        assert_ne!(
            entry(&dir, &model, &settings, "bf16", &sequences[..1]).unwrap(),
            base
        );
        std::fs::write(&model, b"other weights").unwrap();
        assert_ne!(
            entry(&dir, &model, &settings, "bf16", &sequences).unwrap(),
            base
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
