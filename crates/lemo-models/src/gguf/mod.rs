//! GGUF files (llama.cpp's format) as frozen bases: the header and tensor table are read from a
//! memory map, each tensor is dequantized to f32 when the model asks for it under its Hugging
//! Face name, and the configuration and tokenizer come from the file's metadata.
//!
//! llama.cpp's converter reorders the rows of each head of `q_proj` and `k_proj` so that RoPE
//! rotates interleaved pairs `(2i, 2i + 1)`; our Llama rotates halves `(i, i + head_dim / 2)`, as
//! Hugging Face checkpoints do, so those rows are put back on load. Adapters trained on a GGUF
//! base therefore use the Hugging Face row order and load into PEFT on the original checkpoint.

pub(crate) mod quant;
mod reader;
pub mod tokenizer;
mod writer;

use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::Dtype;

pub use quant::GgmlType;
pub use reader::{Header, TensorInfo, Value};
pub use writer::{GgufPrecision, write_llama};

use crate::config::{LlamaConfig, RopeConfig, RopeScaling, YarnScaling};
use crate::llama2c::interleaved_to_rotate_half;
use crate::quantized::packed::QuantFormat;
use crate::weights::{Checkpoint, StoredTensor, WeightSource, sort_tensors};
use crate::{Error, Result};

/// The architectures whose tensors lemo maps onto its Llama model.
const LLAMA_ARCHITECTURES: [&str; 1] = ["llama"];

/// An open GGUF file: memory-mapped, its header parsed and checked.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    pub header: Header,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        // Opening a pipe for reading waits for a writer: refuse it rather than hang.
        if path.exists() && !path.is_file() {
            return Err(Error::format(
                path,
                "not a regular file (a pipe or device cannot be read as a GGUF model)",
            ));
        }
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: read-only mapping of a file lemo never writes.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let header = Header::parse(&map).map_err(|message| Error::format(path, message))?;
        Ok(Self {
            path: path.to_path_buf(),
            map,
            header,
        })
    }

    pub fn metadata(&self, key: &str) -> Option<&Value> {
        self.header.metadata.get(key)
    }

    fn error(&self, message: impl Into<String>) -> Error {
        Error::format(&self.path, message)
    }

    /// A tensor's f32 values in row-major order.
    pub fn dequantize(&self, info: &TensorInfo) -> Vec<f32> {
        info.ggml_type
            .dequantize(&self.map[info.start..info.start + info.len])
    }

    /// `general.architecture`, which names the prefix of the model's metadata keys.
    pub fn architecture(&self) -> Result<&str> {
        self.metadata("general.architecture")
            .and_then(Value::as_str)
            .ok_or_else(|| self.error("no general.architecture in the metadata"))
    }

    /// The Llama configuration the metadata describes.
    pub fn llama_config(&self) -> Result<LlamaConfig> {
        let arch = self.architecture()?;
        if !LLAMA_ARCHITECTURES.contains(&arch) {
            return Err(self.error(format!(
                "unsupported architecture {arch:?}: lemo runs GGUF models of architecture {}",
                LLAMA_ARCHITECTURES.join(", ")
            )));
        }
        let key = |name: &str| format!("{arch}.{name}");
        let optional = |name: &str| -> Result<Option<usize>> {
            match self.metadata(&key(name)) {
                None => Ok(None),
                Some(value) => value
                    .as_u64()
                    .and_then(|v| usize::try_from(v).ok())
                    .map(Some)
                    .ok_or_else(|| self.error(format!("{} is not a count: {value:?}", key(name)))),
            }
        };
        let required = |name: &str| {
            optional(name)?.ok_or_else(|| self.error(format!("no {} in the metadata", key(name))))
        };
        let hidden_size = required("embedding_length")?;
        let heads = required("attention.head_count")?;
        let kv_heads = optional("attention.head_count_kv")?.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(self.error(format!(
                "attention.head_count ({heads}) must be a positive multiple of attention.head_count_kv ({kv_heads})"
            )));
        }
        let head_dim = optional("attention.key_length")?.unwrap_or(hidden_size / heads);
        let rotary_dims = optional("rope.dimension_count")?.unwrap_or(head_dim);
        if rotary_dims != head_dim || !head_dim.is_multiple_of(2) || head_dim == 0 {
            return Err(self.error(format!(
                "RoPE over {rotary_dims} of {head_dim} head dimensions: lemo rotates whole heads of even size"
            )));
        }
        let float = |name: &str| self.metadata(&key(name)).and_then(Value::as_f64);
        let max_position_embeddings = required("context_length")?;
        if max_position_embeddings < 2 {
            return Err(self.error(format!(
                "{} is {max_position_embeddings}: a model addresses at least 2 positions",
                key("context_length")
            )));
        }
        let layers = required("block_count")?;
        if layers > self.header.tensors.len() {
            return Err(self.error(format!(
                "{} is {layers} but the file holds {} tensors (corrupt metadata?)",
                key("block_count"),
                self.header.tensors.len()
            )));
        }
        let rms_norm_eps = float("attention.layer_norm_rms_epsilon").unwrap_or(1e-5);
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(self.error(format!(
                "{} is {rms_norm_eps}: it must be a positive number",
                key("attention.layer_norm_rms_epsilon")
            )));
        }
        let embed = self
            .header
            .tensors
            .get("token_embd.weight")
            .ok_or_else(|| self.error("no token_embd.weight tensor"))?;
        let vocab_size = match optional("vocab_size")? {
            Some(v) => v,
            None => *embed
                .dims
                .last()
                .expect("tensors have at least one dimension"),
        };
        Ok(LlamaConfig {
            vocab_size,
            hidden_size,
            intermediate_size: required("feed_forward_length")?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps,
            max_position_embeddings,
            rope: RopeConfig {
                theta: float("rope.freq_base").unwrap_or(10000.0),
                scaling: self.rope_scaling(arch, head_dim)?,
            },
            tie_word_embeddings: !self.header.tensors.contains_key("output.weight"),
            attention_bias: self.header.tensors.contains_key("blk.0.attn_q.bias"),
            mlp_bias: self.header.tensors.contains_key("blk.0.ffn_up.bias"),
            sliding_window: None,
            bos_token_id: self.token_id("tokenizer.ggml.bos_token_id"),
            eos_token_id: self
                .token_id("tokenizer.ggml.eos_token_id")
                .into_iter()
                .collect(),
        })
    }

    /// The scaling llama.cpp applies: per-pair divisors from `rope_freqs.weight` (how
    /// Llama 3.1's scaling is stored), else `rope.scaling.type` with its keys.
    fn rope_scaling(&self, arch: &str, head_dim: usize) -> Result<RopeScaling> {
        let key = |name: &str| format!("{arch}.rope.scaling.{name}");
        let scaling_type = self
            .metadata(&key("type"))
            .and_then(Value::as_str)
            .unwrap_or("none");
        let factor = self.metadata(&key("factor")).and_then(Value::as_f64);
        if let Some(info) = self.header.tensors.get("rope_freqs.weight") {
            if scaling_type != "none" {
                return Err(self.error(format!(
                    "both rope_freqs.weight and rope.scaling.type {scaling_type:?}: lemo applies one RoPE scaling"
                )));
            }
            if info.shape() != [head_dim / 2] {
                return Err(self.error(format!(
                    "rope_freqs.weight has shape {:?}, expected [{}] (one factor per frequency pair)",
                    info.shape(),
                    head_dim / 2
                )));
            }
            let factors = self.dequantize(info);
            if factors.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
                return Err(
                    self.error("rope_freqs.weight holds a factor that is not a positive number")
                );
            }
            return Ok(RopeScaling::FrequencyFactors(factors));
        }
        let Some(factor) = factor.filter(|f| f.is_finite() && *f > 0.0) else {
            return match scaling_type {
                "none" => Ok(RopeScaling::Default),
                other => Err(self.error(format!(
                    "RoPE scaling {other:?} without a positive {}",
                    key("factor")
                ))),
            };
        };
        match scaling_type {
            "none" => Ok(RopeScaling::Default),
            "linear" => Ok(RopeScaling::Linear { factor }),
            "yarn" => {
                let original = self
                    .metadata(&key("original_context_length"))
                    .and_then(Value::as_u64)
                    .filter(|&n| n > 0)
                    .ok_or_else(|| {
                        self.error(format!(
                            "YaRN scaling without {} (the context the model was pretrained with)",
                            key("original_context_length")
                        ))
                    })?;
                let mut yarn = YarnScaling::new(factor, original as usize);
                // llama.cpp multiplies its own 0.1 ln(factor) + 1 by attn_factor.
                let multiplier = self.metadata(&key("attn_factor")).and_then(Value::as_f64);
                if let Some(multiplier) = multiplier.filter(|&m| m != 1.0) {
                    yarn.attention_factor = Some(multiplier * yarn.attention_factor());
                }
                Ok(RopeScaling::Yarn(yarn))
            }
            other => Err(self.error(format!(
                "RoPE scaling {other:?} is not supported: lemo reads none, linear, yarn and rope_freqs.weight"
            ))),
        }
    }

    pub fn token_id(&self, key: &str) -> Option<u32> {
        self.metadata(key)
            .and_then(Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
    }
}

/// Tensors outside the layers: Hugging Face name, llama.cpp name.
const GLOBAL_TENSORS: [(&str, &str); 3] = [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// Modules of layer `i` (`model.layers.{i}.` / `blk.{i}.`): Hugging Face name, llama.cpp name,
/// and whether its rows (and bias) are in llama.cpp's interleaved RoPE order within each head.
const LAYER_MODULES: [(&str, &str, bool); 9] = [
    ("input_layernorm", "attn_norm", false),
    ("post_attention_layernorm", "ffn_norm", false),
    ("self_attn.q_proj", "attn_q", true),
    ("self_attn.k_proj", "attn_k", true),
    ("self_attn.v_proj", "attn_v", false),
    ("self_attn.o_proj", "attn_output", false),
    ("mlp.gate_proj", "ffn_gate", false),
    ("mlp.up_proj", "ffn_up", false),
    ("mlp.down_proj", "ffn_down", false),
];

/// How a Hugging Face tensor name is stored in a llama-architecture GGUF file.
pub(crate) struct GgufName {
    pub name: String,
    /// `q_proj`/`k_proj` rows (and biases) are in llama.cpp's interleaved RoPE order within
    /// each head.
    pub interleaved_heads: bool,
}

/// A layer tensor's name split as `{prefix}{layer}.{module}.{suffix}`.
fn split_layer_name<'a>(name: &'a str, prefix: &str) -> Option<(usize, &'a str, &'a str)> {
    let (layer, rest) = name.strip_prefix(prefix)?.split_once('.')?;
    let (module, suffix) = rest.rsplit_once('.')?;
    Some((layer.parse().ok()?, module, suffix))
}

pub(crate) fn gguf_name(hf_name: &str) -> Option<GgufName> {
    if let Some(&(_, gguf)) = GLOBAL_TENSORS.iter().find(|(hf, _)| *hf == hf_name) {
        return Some(GgufName {
            name: gguf.into(),
            interleaved_heads: false,
        });
    }
    let (layer, module, suffix) = split_layer_name(hf_name, "model.layers.")?;
    let &(_, gguf_module, interleaved_heads) = LAYER_MODULES.iter().find(|m| m.0 == module)?;
    Some(GgufName {
        name: format!("blk.{layer}.{gguf_module}.{suffix}"),
        interleaved_heads,
    })
}

/// The Hugging Face name of a llama.cpp tensor name ([`gguf_name`] backwards).
fn hf_name(gguf_name: &str) -> Option<String> {
    if let Some(&(hf, _)) = GLOBAL_TENSORS.iter().find(|(_, gguf)| *gguf == gguf_name) {
        return Some(hf.into());
    }
    let (layer, module, suffix) = split_layer_name(gguf_name, "blk.")?;
    let &(hf_module, ..) = LAYER_MODULES.iter().find(|m| m.1 == module)?;
    Some(format!("model.layers.{layer}.{hf_module}.{suffix}"))
}

/// The weights of a llama-architecture GGUF file under Hugging Face names.
pub struct GgufWeights {
    file: GgufFile,
    head_dim: usize,
}

impl GgufWeights {
    pub fn new(file: GgufFile, config: &LlamaConfig) -> Self {
        Self {
            file,
            head_dim: config.head_dim,
        }
    }
}

impl Checkpoint for GgufWeights {
    /// The tensors lemo maps onto its Llama model; quantized ones are listed as f32, the type
    /// they are dequantized to.
    fn tensors(&self) -> Vec<StoredTensor> {
        let mut tensors: Vec<StoredTensor> = self
            .file
            .header
            .tensors
            .iter()
            .filter_map(|(name, info)| {
                Some(StoredTensor {
                    name: hf_name(name)?,
                    shape: info.shape(),
                    dtype: match info.ggml_type {
                        GgmlType::F16 => Dtype::F16,
                        GgmlType::BF16 => Dtype::BF16,
                        _ => Dtype::F32,
                    },
                })
            })
            .collect();
        sort_tensors(&mut tensors);
        tensors
    }
}

impl GgufWeights {
    /// The tensor stored for Hugging Face name `name`, checked against `shape`.
    fn locate(&self, name: &str, shape: &[usize]) -> Result<Option<(GgufName, &TensorInfo)>> {
        let Some(mapped) = gguf_name(name) else {
            return Ok(None);
        };
        let Some(info) = self.file.header.tensors.get(&mapped.name) else {
            return Ok(None);
        };
        let found = info.shape();
        if found != shape {
            return Err(self.file.error(format!(
                "tensor {} ({name}) has shape {found:?} but the metadata implies {shape:?}",
                mapped.name
            )));
        }
        Ok(Some((mapped, info)))
    }
}

impl WeightSource for GgufWeights {
    fn fetch(&mut self, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>> {
        let Some((mapped, info)) = self.locate(name, shape)? else {
            return Ok(None);
        };
        let values = self.file.dequantize(info);
        Ok(Some(if mapped.interleaved_heads {
            let rows = shape[0];
            let cols = shape.get(1).copied().unwrap_or(1);
            interleaved_to_rotate_half(&values, rows, cols, self.head_dim)
        } else {
            values
        }))
    }

    fn fetch_blocks(&mut self, name: &str, shape: &[usize]) -> Result<Option<(GgmlType, Vec<u8>)>> {
        let Some((mapped, info)) = self.locate(name, shape)? else {
            return Ok(None);
        };
        if !QuantFormat::keeps(info.ggml_type) || shape.len() != 2 {
            return Ok(None);
        }
        let bytes = &self.file.map[info.start..info.start + info.len];
        if !mapped.interleaved_heads {
            return Ok(Some((info.ggml_type, bytes.to_vec())));
        }
        // A row is a whole number of blocks, so rows move as byte runs; the row order is the
        // one interleaved_to_rotate_half gives a column of row indices (exact in f32).
        let rows = shape[0];
        let row_bytes = info.len / rows;
        let indices: Vec<f32> = (0..rows).map(|r| r as f32).collect();
        let order = interleaved_to_rotate_half(&indices, rows, 1, self.head_dim);
        let reordered = order
            .iter()
            .flat_map(|&from| {
                let from = from as usize;
                &bytes[from * row_bytes..(from + 1) * row_bytes]
            })
            .copied()
            .collect();
        Ok(Some((info.ggml_type, reordered)))
    }

    fn quantized_type(&self, name: &str) -> Option<GgmlType> {
        let info = self.file.header.tensors.get(&gguf_name(name)?.name)?;
        QuantFormat::keeps(info.ggml_type).then_some(info.ggml_type)
    }
}
