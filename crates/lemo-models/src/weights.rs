//! Where a model's tensors come from. Models are built tensor by tensor from a [`WeightSource`]
//! addressed by Hugging Face names, so a checkpoint is converted one tensor at a time and never
//! held twice in memory: safetensors files are memory-mapped, and each tensor is decoded only
//! when the model asks for it.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use burn::tensor::{DType, Distribution, Tensor, TensorData, backend::Backend};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors, tensor::Metadata};

use crate::gguf::quant::GgmlType;
use crate::lora::Linear;
use crate::quantized::{FrozenSummary, QuantizeBase};
use crate::random::seeded_random;
use crate::{Error, Result};

/// A source of f32 tensors by name. `shape` is what the model expects; a source must check it.
pub trait WeightSource {
    /// The named tensor's values in row-major order, or `None` if the source does not have it.
    fn fetch(&mut self, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>>;

    /// The named tensor's quantized blocks as stored (rows in the model's order), where the
    /// source holds it in a block type a frozen weight can keep
    /// (see [`crate::quantized::QuantFormat::keeps`]).
    fn fetch_blocks(
        &mut self,
        _name: &str,
        _shape: &[usize],
    ) -> Result<Option<(GgmlType, Vec<u8>)>> {
        Ok(None)
    }

    /// The block type the named tensor is stored in, if it is quantized.
    fn quantized_type(&self, _name: &str) -> Option<GgmlType> {
        None
    }
}

/// A tensor a checkpoint holds: its Hugging Face name and row-major shape, and the dtype that
/// holds its values exactly (f32 for tensors stored quantized).
#[derive(Debug, Clone, PartialEq)]
pub struct StoredTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
}

/// A checkpoint file that can list what it holds (what `merge` copies), in a stable order with
/// layers in numeric order.
pub trait Checkpoint: WeightSource {
    fn tensors(&self) -> Vec<StoredTensor>;
}

/// Sorts tensors by name with numbers compared as numbers (`layers.2` before `layers.10`).
pub fn sort_tensors(tensors: &mut [StoredTensor]) {
    fn key(name: &str) -> Vec<(String, u64)> {
        name.split('.')
            .map(|part| match part.parse::<u64>() {
                Ok(n) => (String::new(), n),
                Err(_) => (part.to_string(), 0),
            })
            .collect()
    }
    tensors.sort_by_cached_key(|t| key(&t.name));
}

/// Builds Burn tensors on `device` from a [`WeightSource`], stored as `dtype` (converted on the
/// host one tensor at a time, so a bf16 model never exists in f32 on the device); projections
/// are kept quantized as `quantize` says, and what was is counted in `summary`.
pub struct Loader<'a, B: Backend> {
    pub source: &'a mut dyn WeightSource,
    pub device: B::Device,
    pub dtype: DType,
    pub quantize: QuantizeBase,
    pub summary: FrozenSummary,
}

impl<B: Backend> Loader<'_, B> {
    pub fn optional<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
    ) -> Result<Option<Tensor<B, D>>> {
        if let Some(t) = self.source.quantized_type(name)
            && self.quantize != QuantizeBase::None
        {
            let kind = name.rsplit('.').nth(1).unwrap_or(name);
            self.summary.notes.insert(format!(
                "{kind} ({t:?}) dequantized to {:?}: only the layers' projections stay quantized",
                self.dtype
            ));
        }
        Ok(self
            .source
            .fetch(name, &shape)?
            .map(|values| self.upload(values, shape)))
    }

    /// `values` as a weight on the device.
    pub(crate) fn upload<const D: usize>(
        &self,
        values: Vec<f32>,
        shape: [usize; D],
    ) -> Tensor<B, D> {
        // Weights live as long as the model: in the pool's persistent part, one exact-size
        // allocation each, they neither pad pages nor fragment the ones activations reuse.
        let (device, dtype) = (&self.device, self.dtype);
        B::memory_persistent_allocations(device, TensorData::new(values, shape), |data| {
            Tensor::from_data(data, (device, dtype))
        })
    }

    /// The named tensor's values on the host; an error if the source lacks it.
    pub(crate) fn required_values(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.source
            .fetch(name, shape)?
            .ok_or_else(|| missing(name, shape))
    }

    /// A projection `{name}.weight: [out, inp]` with an optional `{name}.bias: [out]`.
    pub fn linear(&mut self, name: &str, out: usize, inp: usize, bias: bool) -> Result<Linear<B>> {
        let weight = self.frozen_weight(&format!("{name}.weight"), [out, inp])?;
        let bias = if bias {
            Some(self.required(&format!("{name}.bias"), [out])?)
        } else {
            None
        };
        Ok(Linear::new(weight, bias))
    }

    pub fn required<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
    ) -> Result<Tensor<B, D>> {
        self.optional(name, shape)?
            .ok_or_else(|| missing(name, &shape))
    }
}

fn missing(name: &str, shape: &[usize]) -> Error {
    Error::Shape(format!(
        "checkpoint has no tensor {name:?} (expected shape {shape:?})"
    ))
}

fn shape_mismatch(name: &str, found: &[usize], expected: &[usize]) -> Error {
    Error::Shape(format!(
        "config/weights mismatch: {name} has shape {found:?} in the checkpoint but the config implies {expected:?}"
    ))
}

/// Hugging Face `*.safetensors` weights: one file, or shards listed in
/// `model.safetensors.index.json`. Files are memory-mapped; nothing is read until fetched.
pub struct SafetensorsWeights {
    files: Vec<MappedFile>,
    /// Tensor name -> index into `files`.
    location: HashMap<String, usize>,
}

struct MappedFile {
    path: PathBuf,
    map: Mmap,
    header_len: usize,
    metadata: Metadata,
}

impl SafetensorsWeights {
    /// Opens the weights of a model folder (or a single `.safetensors` file).
    pub fn open(path: &Path) -> Result<Self> {
        let files = if path.is_file() {
            vec![path.to_path_buf()]
        } else {
            Self::shard_files(path)?
        };
        let mut weights = Self {
            files: Vec::new(),
            location: HashMap::new(),
        };
        for file in files {
            let mapped = MappedFile::open(&file)?;
            let index = weights.files.len();
            for name in mapped.metadata.tensors().keys() {
                weights.location.insert(name.clone(), index);
            }
            weights.files.push(mapped);
        }
        Ok(weights)
    }

    fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::format(&index, format!("invalid JSON: {e}")))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::format(&index, "no \"weight_map\" object"))?;
            let shards: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
            return Ok(shards.into_iter().map(|s| dir.join(s)).collect());
        }
        let single = dir.join("model.safetensors");
        if single.exists() {
            return Ok(vec![single]);
        }
        let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
        let mut found: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        found.sort();
        if found.is_empty() {
            return Err(Error::format(
                dir,
                "no *.safetensors weights in this folder",
            ));
        }
        Ok(found)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.location.keys().map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    /// The checkpoint's name for `name`: exact, or with/without a leading `model.` (OPT
    /// checkpoints exist in both spellings).
    fn resolve(&self, name: &str) -> Option<String> {
        let candidates = [
            name.to_string(),
            name.strip_prefix("model.").unwrap_or(name).to_string(),
            format!("model.{name}"),
        ];
        candidates
            .into_iter()
            .find(|c| self.location.contains_key(c))
    }
}

impl MappedFile {
    fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the file is opened read-only; lemo never writes checkpoints it has mapped.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let (header_len, metadata) = SafeTensors::read_metadata(&map).map_err(|e| {
            Error::format(path, format!("truncated or corrupt safetensors file ({e})"))
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            map,
            header_len,
            metadata,
        })
    }

    fn decode(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let info = self
            .metadata
            .info(name)
            .expect("name resolved from this file's metadata");
        let start = 8 + self.header_len + info.data_offsets.0;
        let end = 8 + self.header_len + info.data_offsets.1;
        let bytes = &self.map[start..end];
        let values = match info.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(Error::format(
                    &self.path,
                    format!("tensor {name} has unsupported dtype {other:?}"),
                ));
            }
        };
        Ok((info.shape.clone(), values))
    }
}

impl WeightSource for SafetensorsWeights {
    fn fetch(&mut self, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>> {
        let Some(resolved) = self.resolve(name) else {
            return Ok(None);
        };
        let (found, values) = self.files[self.location[&resolved]].decode(&resolved)?;
        if found != shape {
            return Err(shape_mismatch(name, &found, shape));
        }
        Ok(Some(values))
    }
}

impl Checkpoint for SafetensorsWeights {
    fn tensors(&self) -> Vec<StoredTensor> {
        let mut tensors: Vec<StoredTensor> = self
            .location
            .iter()
            .map(|(name, &file)| {
                let info = self.files[file]
                    .metadata
                    .info(name)
                    .expect("located names are in their file's metadata");
                StoredTensor {
                    name: name.clone(),
                    shape: info.shape.clone(),
                    dtype: info.dtype,
                }
            })
            .collect();
        sort_tensors(&mut tensors);
        tensors
    }
}

/// Random weights for benchmarks and from-scratch training: N(0, std) for matrices and
/// embeddings, ones for norm weights, zeros for biases (the Hugging Face initialization).
pub struct RandomWeights {
    pub std: f64,
    pub seed: u64,
}

impl WeightSource for RandomWeights {
    fn fetch(&mut self, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>> {
        let count: usize = shape.iter().product();
        let is_norm = name.contains("norm") && name.ends_with(".weight");
        let values = if name.ends_with(".bias") {
            vec![0.0; count]
        } else if is_norm {
            vec![1.0; count]
        } else {
            seeded_random(name, self.seed, shape, Distribution::Normal(0.0, self.std))
                .into_vec::<f32>()
                .expect("f32 data")
        };
        Ok(Some(values))
    }
}
