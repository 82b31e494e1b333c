//! Writing llama-architecture GGUF v3 files that llama.cpp loads: the container [`super::reader`]
//! reads (metadata, tensor table, data aligned to 32 bytes), llama.cpp's metadata keys and tensor
//! names, and q/k rows in its interleaved RoPE order. Tensors are produced and written one at a
//! time, and the file is written atomically.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use super::{GgmlType, Value, gguf_name};
use crate::adapter::write_atomically_with;
use crate::config::{LlamaConfig, RopeScaling, YarnScaling};
use crate::llama2c::rotate_half_to_interleaved;
use crate::weights::StoredTensor;
use crate::{Error, Result};

const VERSION: u32 = 3;
/// ggml's default `general.alignment`, which the file therefore does not state.
const ALIGNMENT: usize = 32;

/// The precision of an exported file's matrices (vectors stay F32, as llama.cpp's converter
/// keeps them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufPrecision {
    /// Every tensor F32: the exact weights, twice F16's size.
    F32,
    F16,
    /// Q8_0 where a row is a whole number of 32-value blocks, F16 elsewhere.
    Q8_0,
}

impl GgufPrecision {
    /// llama.cpp's `general.file_type` (`LLAMA_FTYPE_MOSTLY_*`).
    fn file_type(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q8_0 => 7,
        }
    }

    fn tensor_type(self, shape: &[usize]) -> GgmlType {
        match (shape, self) {
            ([_], _) | (_, Self::F32) => GgmlType::F32,
            ([.., cols], Self::Q8_0) if cols.is_multiple_of(32) => GgmlType::Q8_0,
            _ => GgmlType::F16,
        }
    }
}

/// A tensor of the file: llama.cpp name, ggml dimensions (innermost first), type; and where its
/// values come from.
struct Planned<'a> {
    name: String,
    dims: Vec<usize>,
    ggml_type: GgmlType,
    interleaved_heads: bool,
    source: Source<'a>,
}

enum Source<'a> {
    Model(&'a StoredTensor),
    /// Values the configuration gives (`rope_freqs.weight`).
    Fixed(Vec<f32>),
}

/// Writes a Llama model as GGUF: `config`'s hyperparameters, `tokenizer` (`tokenizer.*` keys),
/// and `tensors` (Hugging Face names and row order) whose f32 values `values` produces.
pub fn write_llama(
    path: &Path,
    name: &str,
    config: &LlamaConfig,
    tokenizer: &HashMap<String, Value>,
    tensors: &[StoredTensor],
    precision: GgufPrecision,
    mut values: impl FnMut(&StoredTensor) -> Result<Vec<f32>>,
) -> Result<()> {
    let mut plan = tensors
        .iter()
        .map(|tensor| {
            let mapped = gguf_name(&tensor.name).ok_or_else(|| {
                Error::Config(format!(
                    "{} has no llama.cpp name: GGUF export covers Llama models",
                    tensor.name
                ))
            })?;
            Ok(Planned {
                name: mapped.name,
                dims: tensor.shape.iter().rev().copied().collect(),
                ggml_type: precision.tensor_type(&tensor.shape),
                interleaved_heads: mapped.interleaved_heads,
                source: Source::Model(tensor),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    // llama.cpp keeps Llama 3.1 style scaling as one divisor per frequency pair.
    if let Some(factors) = config.rope.frequency_factors(config.head_dim)? {
        plan.push(Planned {
            name: "rope_freqs.weight".into(),
            dims: vec![factors.len()],
            ggml_type: GgmlType::F32,
            interleaved_heads: false,
            source: Source::Fixed(factors),
        });
    }

    let mut header = b"GGUF".to_vec();
    header.extend(VERSION.to_le_bytes());
    header.extend((plan.len() as u64).to_le_bytes());
    let metadata = llama_metadata(name, config, precision)?;
    let mut tokenizer: Vec<_> = tokenizer.iter().collect();
    tokenizer.sort_by(|a, b| a.0.cmp(b.0));
    header.extend(((metadata.len() + tokenizer.len()) as u64).to_le_bytes());
    for (key, value) in metadata.iter().map(|(k, v)| (k, v)).chain(tokenizer) {
        put_string(&mut header, key);
        header.extend(type_id(value).to_le_bytes());
        put_value(&mut header, value);
    }
    let mut offset = 0usize;
    for tensor in &plan {
        put_string(&mut header, &tensor.name);
        header.extend((tensor.dims.len() as u32).to_le_bytes());
        for &dim in &tensor.dims {
            header.extend((dim as u64).to_le_bytes());
        }
        header.extend(tensor.ggml_type.id().to_le_bytes());
        header.extend((offset as u64).to_le_bytes());
        let count = tensor.dims.iter().product();
        let bytes = tensor
            .ggml_type
            .byte_size(tensor.dims[0], count)
            .map_err(Error::Config)?;
        offset += bytes.next_multiple_of(ALIGNMENT);
    }
    header.resize(header.len().next_multiple_of(ALIGNMENT), 0);

    write_atomically_with(path, |out| {
        let io = |e| Error::write(path, e);
        out.write_all(&header).map_err(io)?;
        for tensor in &plan {
            let data = match &tensor.source {
                Source::Fixed(data) => data.clone(),
                Source::Model(source) if tensor.interleaved_heads => {
                    let rows = source.shape[0];
                    let cols = source.shape.get(1).copied().unwrap_or(1);
                    rotate_half_to_interleaved(&values(source)?, rows, cols, config.head_dim)
                }
                Source::Model(source) => values(source)?,
            };
            let mut bytes = tensor
                .ggml_type
                .quantize(&data)
                .expect("the planned types are ones lemo writes");
            bytes.resize(bytes.len().next_multiple_of(ALIGNMENT), 0);
            out.write_all(&bytes).map_err(io)?;
        }
        Ok(())
    })
}

/// `general.*` and `llama.*` keys for `config`, as llama.cpp's converter writes them.
fn llama_metadata(
    name: &str,
    config: &LlamaConfig,
    precision: GgufPrecision,
) -> Result<Vec<(String, Value)>> {
    let count = |v: usize| Value::U32(v as u32);
    let mut keys: Vec<(String, Value)> = [
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String(name.into())),
        ("general.file_type", Value::U32(precision.file_type())),
        ("general.quantization_version", Value::U32(2)),
        ("llama.vocab_size", count(config.vocab_size)),
        (
            "llama.context_length",
            count(config.max_position_embeddings),
        ),
        ("llama.embedding_length", count(config.hidden_size)),
        ("llama.block_count", count(config.num_hidden_layers)),
        ("llama.feed_forward_length", count(config.intermediate_size)),
        (
            "llama.attention.head_count",
            count(config.num_attention_heads),
        ),
        (
            "llama.attention.head_count_kv",
            count(config.num_key_value_heads),
        ),
        ("llama.attention.key_length", count(config.head_dim)),
        ("llama.attention.value_length", count(config.head_dim)),
        ("llama.rope.dimension_count", count(config.head_dim)),
        ("llama.rope.freq_base", Value::F32(config.rope.theta as f32)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(config.rms_norm_eps as f32),
        ),
    ]
    .into_iter()
    .map(|(key, value)| (key.to_string(), value))
    .collect();
    let scaling = |name: &str| format!("llama.rope.scaling.{name}");
    match &config.rope.scaling {
        // Carried by the rope_freqs.weight tensor.
        RopeScaling::Default | RopeScaling::Llama3 { .. } | RopeScaling::FrequencyFactors(_) => {}
        RopeScaling::Linear { factor } => {
            keys.push((scaling("type"), Value::String("linear".into())));
            keys.push((scaling("factor"), Value::F32(*factor as f32)));
        }
        RopeScaling::Yarn(yarn) => {
            if yarn.beta_fast.is_some_and(|b| b != 32.0) || yarn.beta_slow.is_some_and(|b| b != 1.0)
            {
                return Err(Error::Config(
                    "GGUF export of YaRN with beta_fast / beta_slow other than 32 / 1 is not supported (llama.cpp's defaults)".into(),
                ));
            }
            let plain = YarnScaling::new(yarn.factor, yarn.original_max_position_embeddings);
            keys.push((scaling("type"), Value::String("yarn".into())));
            keys.push((scaling("factor"), Value::F32(yarn.factor as f32)));
            keys.push((
                scaling("original_context_length"),
                Value::U32(yarn.original_max_position_embeddings as u32),
            ));
            // llama.cpp multiplies its own 0.1 ln(factor) + 1 by attn_factor.
            let multiplier = yarn.attention_factor() / plain.attention_factor();
            if multiplier != 1.0 {
                keys.push((scaling("attn_factor"), Value::F32(multiplier as f32)));
            }
        }
        RopeScaling::Dynamic { .. } => {
            return Err(Error::Config(
                "GGUF export of dynamic NTK RoPE scaling is not supported: llama.cpp has no such scaling (train with --rope-scaling yarn for a GGUF)".into(),
            ));
        }
    }
    if config.sliding_window.is_some() {
        return Err(Error::Config(
            "GGUF export of a sliding-window (Mistral) model is not supported".into(),
        ));
    }
    Ok(keys)
}

fn put_string(out: &mut Vec<u8>, text: &str) {
    out.extend((text.len() as u64).to_le_bytes());
    out.extend(text.as_bytes());
}

/// GGUF's metadata value type ids, as [`super::reader`] reads them.
fn type_id(value: &Value) -> u32 {
    match value {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend(v.to_le_bytes()),
        Value::U16(v) => out.extend(v.to_le_bytes()),
        Value::I16(v) => out.extend(v.to_le_bytes()),
        Value::U32(v) => out.extend(v.to_le_bytes()),
        Value::I32(v) => out.extend(v.to_le_bytes()),
        Value::F32(v) => out.extend(v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(v) => put_string(out, v),
        Value::U64(v) => out.extend(v.to_le_bytes()),
        Value::I64(v) => out.extend(v.to_le_bytes()),
        Value::F64(v) => out.extend(v.to_le_bytes()),
        Value::Array(values) => {
            // An empty array's element type is not recorded anywhere: any type reads back empty.
            let element = values.first().map_or(type_id(&Value::U8(0)), type_id);
            out.extend(element.to_le_bytes());
            out.extend((values.len() as u64).to_le_bytes());
            values.iter().for_each(|v| put_value(out, v));
        }
    }
}
