//! Where tests find their inputs: the repository's fixtures, the shared data beside the
//! repository, the model cache `cargo xtask fetch-model` fills; and readers of the fixtures'
//! JSON and safetensors files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use crate::skip;

/// The repository's root folder.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The shared data (real models and corpora, never in the repository) beside the repository,
/// `../shared/data`, or `$LEMO_SHARED_DATA`; `None`, after reporting the test as skipped, when
/// absent.
pub fn shared_data() -> Option<PathBuf> {
    let path = std::env::var_os("LEMO_SHARED_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("../shared/data"));
    if path.is_dir() {
        Some(path)
    } else {
        skip(&format!("{} not found", path.display()));
        None
    }
}

/// A tiny random-init Hugging Face model saved by transformers, with its losses
/// (`crates/lemo-models/tests/fixtures/hf/{case}`).
pub fn hf_fixture(case: &str) -> PathBuf {
    repo_root()
        .join("crates/lemo-models/tests/fixtures/hf")
        .join(case)
}

/// A PEFT adapter on an [`hf_fixture`] model with the loss and gradients PyTorch autograd gave
/// (`crates/lemo-models/tests/fixtures/gradients/{case}`).
pub fn gradient_fixture(case: &str) -> PathBuf {
    repo_root()
        .join("crates/lemo-models/tests/fixtures/gradients")
        .join(case)
}

/// The file SmolLM2-135M-Instruct ships as (Q4_1 GGUF).
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// SmolLM2-135M in the model cache that `cargo xtask fetch-model smollm2-135m` fills
/// (`$LEMO_MODEL_CACHE`, else `~/.cache/lemo/models`); `None`, after reporting the test as
/// skipped, when it is not there.
pub fn smollm2_gguf() -> Option<PathBuf> {
    let cache = std::env::var_os("LEMO_MODEL_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/lemo/models")));
    match cache.map(|c| c.join(SMOLLM2_FILE)) {
        Some(path) if path.exists() => Some(path),
        _ => {
            skip(&format!(
                "{SMOLLM2_FILE} is not in the model cache (run `cargo xtask fetch-model smollm2-135m`)"
            ));
            None
        }
    }
}

pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A tensor of a fixture file: its shape and values (integers are exact in f64).
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
}

impl HostTensor {
    pub fn to_f32(&self) -> Vec<f32> {
        self.values.iter().map(|&v| v as f32).collect()
    }

    pub fn to_i64(&self) -> Vec<i64> {
        self.values.iter().map(|&v| v as i64).collect()
    }
}

/// Every tensor of a safetensors file (F32, F64, I32, I64), by name.
pub fn read_safetensors(path: &Path) -> BTreeMap<String, HostTensor> {
    let bytes =
        std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let file = SafeTensors::deserialize(&bytes)
        .unwrap_or_else(|e| panic!("{}: not safetensors ({e})", path.display()));
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = view.data();
            let values: Vec<f64> = match view.dtype() {
                Dtype::F32 => words::<4>(data)
                    .map(|b| f32::from_le_bytes(b) as f64)
                    .collect(),
                Dtype::F64 => words::<8>(data).map(f64::from_le_bytes).collect(),
                Dtype::I32 => words::<4>(data)
                    .map(|b| i32::from_le_bytes(b) as f64)
                    .collect(),
                Dtype::I64 => words::<8>(data)
                    .map(|b| i64::from_le_bytes(b) as f64)
                    .collect(),
                other => panic!("{}: {name} is {other:?}", path.display()),
            };
            let shape = view.shape().to_vec();
            (name, HostTensor { shape, values })
        })
        .collect()
}

fn words<const N: usize>(data: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
    data.chunks_exact(N).map(|c| c.try_into().unwrap())
}

/// Every file under `dir` (recursively) with its bytes, by path relative to `dir`: compare two
/// snapshots to show that a command changed nothing there.
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(folder) = pending.pop() {
        let entries = std::fs::read_dir(&folder)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", folder.display()));
        for entry in entries {
            let path = entry.expect("a folder entry").path();
            let kind = std::fs::symlink_metadata(&path)
                .expect("metadata")
                .file_type();
            if kind.is_dir() {
                pending.push(path);
            } else if kind.is_file() {
                let bytes = std::fs::read(&path).expect("a readable file");
                files.insert(path.strip_prefix(dir).unwrap().to_path_buf(), bytes);
            } else {
                // FIFOs and other special files: present, no content to compare.
                files.insert(path.strip_prefix(dir).unwrap().to_path_buf(), Vec::new());
            }
        }
    }
    files
}
