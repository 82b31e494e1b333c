//! Writing Hugging Face checkpoints: `model.safetensors`, or shards
//! `model-0000i-of-0000n.safetensors` listed in `model.safetensors.index.json` past a size, as
//! transformers writes them. Tensors are produced and written one at a time, so a checkpoint is
//! never held in memory; every file is written atomically.

use std::io::Write;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::Dtype;
use serde_json::{Map, Value, json};

use crate::adapter::write_atomically_with;
use crate::config::{LlamaConfig, RopeConfig};
use crate::weights::StoredTensor;
use crate::{Error, Result};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Bytes per value of the dtypes lemo writes.
fn dtype_bytes(dtype: Dtype) -> Result<usize> {
    match dtype {
        Dtype::F32 => Ok(4),
        Dtype::BF16 | Dtype::F16 => Ok(2),
        other => Err(Error::Config(format!(
            "cannot write {other:?} tensors (lemo writes F32, BF16 and F16)"
        ))),
    }
}

fn tensor_bytes(tensor: &StoredTensor) -> Result<u64> {
    let count: usize = tensor.shape.iter().product();
    Ok((count * dtype_bytes(tensor.dtype)?) as u64)
}

/// `values` encoded little-endian as `dtype` (rounded to nearest even).
pub fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::BF16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        Dtype::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        other => unreachable!("dtype {other:?} was refused by dtype_bytes"),
    }
}

/// Splits `tensors` into consecutive shards of at most `max_shard_bytes` (a larger tensor gets a
/// shard of its own).
fn shards(tensors: &[StoredTensor], max_shard_bytes: u64) -> Result<Vec<&[StoredTensor]>> {
    let mut shards = Vec::new();
    let (mut start, mut size) = (0, 0);
    for (index, tensor) in tensors.iter().enumerate() {
        let bytes = tensor_bytes(tensor)?;
        if index > start && size + bytes > max_shard_bytes {
            shards.push(&tensors[start..index]);
            (start, size) = (index, 0);
        }
        size += bytes;
    }
    shards.push(&tensors[start..]);
    Ok(shards)
}

/// Writes `tensors` into `dir` as one safetensors file, or as shards of at most
/// `max_shard_bytes` with an index. `values` produces each tensor's f32 values (row-major);
/// `on_file` hears of each file written. Returns the files written.
pub fn write_safetensors(
    dir: &Path,
    tensors: &[StoredTensor],
    max_shard_bytes: u64,
    mut values: impl FnMut(&StoredTensor) -> Result<Vec<f32>>,
    mut on_file: impl FnMut(&Path),
) -> Result<Vec<PathBuf>> {
    let shards = shards(tensors, max_shard_bytes)?;
    let count = shards.len();
    let name = |index: usize| {
        if count == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{count:05}.safetensors", index + 1)
        }
    };
    let mut written = Vec::new();
    let mut weight_map = Map::new();
    for (index, shard) in shards.iter().enumerate() {
        let path = dir.join(name(index));
        write_safetensors_file(&path, shard, &mut values)?;
        for tensor in *shard {
            weight_map.insert(tensor.name.clone(), json!(name(index)));
        }
        on_file(&path);
        written.push(path);
    }
    if count > 1 {
        let total: u64 = tensors.iter().map(tensor_bytes).sum::<Result<u64>>()?;
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let path = dir.join(INDEX_FILE);
        let text = serde_json::to_string_pretty(&index).expect("valid JSON");
        crate::adapter::write_atomically(&path, text.as_bytes())?;
        on_file(&path);
        written.push(path);
    }
    Ok(written)
}

/// One safetensors file: a u64 header length, the JSON header (padded with spaces to a multiple
/// of 8 bytes, so the data is aligned), then the tensors' bytes back to back in header order.
fn write_safetensors_file(
    path: &Path,
    tensors: &[StoredTensor],
    values: &mut impl FnMut(&StoredTensor) -> Result<Vec<f32>>,
) -> Result<()> {
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0u64;
    for tensor in tensors {
        let end = offset + tensor_bytes(tensor)?;
        header.insert(
            tensor.name.clone(),
            json!({"dtype": tensor.dtype.to_string(), "shape": tensor.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut header = Value::Object(header).to_string().into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    write_atomically_with(path, |out| {
        let io = |e| Error::write(path, e);
        out.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(io)?;
        out.write_all(&header).map_err(io)?;
        for tensor in tensors {
            let data = values(tensor)?;
            let expected: usize = tensor.shape.iter().product();
            assert_eq!(
                data.len(),
                expected,
                "{} has the values of its shape",
                tensor.name
            );
            out.write_all(&encode(&data, tensor.dtype)).map_err(io)?;
        }
        Ok(())
    })
}

/// The `torch_dtype` transformers records for the dtype most of the weights are stored in.
pub fn torch_dtype(tensors: &[StoredTensor]) -> &'static str {
    let bytes = |dtype| {
        tensors
            .iter()
            .filter(|t| t.dtype == dtype)
            .map(|t| t.shape.iter().product::<usize>())
            .sum::<usize>()
    };
    let (name, _) = [
        ("float32", bytes(Dtype::F32)),
        ("bfloat16", bytes(Dtype::BF16)),
        ("float16", bytes(Dtype::F16)),
    ]
    .into_iter()
    .max_by_key(|&(_, count)| count)
    .expect("three candidates");
    name
}

/// Sets `config` (a transformers `config.json`) to run with `rope` over
/// `max_position_embeddings` positions, in the spelling the file already uses: transformers 5's
/// `rope_parameters` (theta and scaling together) where it has that key, else `rope_theta` and
/// `rope_scaling`, which every transformers version reads.
pub fn set_rope(
    config: &mut Value,
    rope: &RopeConfig,
    max_position_embeddings: usize,
) -> Result<()> {
    let Some(object) = config.as_object_mut() else {
        return Err(Error::Config("config.json is not a JSON object".into()));
    };
    object.insert(
        "max_position_embeddings".into(),
        json!(max_position_embeddings),
    );
    if object.contains_key("rope_parameters") {
        object.insert("rope_parameters".into(), rope.parameters_json()?);
        object.remove("rope_scaling");
        object.remove("rope_theta");
    } else {
        object.insert("rope_theta".into(), json!(rope.theta));
        object.insert(
            "rope_scaling".into(),
            rope.scaling_json()?.unwrap_or(Value::Null),
        );
    }
    Ok(())
}

/// A transformers `config.json` (`LlamaForCausalLM`) for `config`, weights stored as
/// `torch_dtype`.
pub fn llama_config_json(config: &LlamaConfig, torch_dtype: &str) -> Result<Value> {
    let mut json = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope.theta,
        "rope_scaling": config.rope.scaling_json()?,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "bos_token_id": config.bos_token_id,
        "torch_dtype": torch_dtype,
    });
    json["eos_token_id"] = match config.eos_token_id.as_slice() {
        [] => Value::Null,
        [one] => json!(one),
        many => json!(many),
    };
    Ok(json)
}
