//! A small Llama GGUF file written byte by byte (GGUF v3, F32 tensors, no tokenizer), with any
//! metadata value overridden: a well-formed model to break one field at a time.

use std::path::Path;

pub enum Meta {
    U32(u32),
    F32(f32),
    Str(&'static str),
}

/// Hidden size 8, two heads of 4, one layer, a vocabulary of 128 (the fixtures' ids fit).
const HIDDEN: u64 = 8;
const FFN: u64 = 16;
const VOCAB: u64 = 128;

/// Metadata of the model with `overrides` replacing the values of their keys.
pub fn metadata(overrides: &[(&'static str, Meta)]) -> Vec<(&'static str, Meta)> {
    let mut entries = vec![
        ("general.architecture", Meta::Str("llama")),
        ("llama.context_length", Meta::U32(64)),
        ("llama.embedding_length", Meta::U32(HIDDEN as u32)),
        ("llama.block_count", Meta::U32(1)),
        ("llama.feed_forward_length", Meta::U32(FFN as u32)),
        ("llama.attention.head_count", Meta::U32(2)),
        ("llama.attention.head_count_kv", Meta::U32(2)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
    ];
    for (key, value) in overrides {
        let value = match value {
            Meta::U32(v) => Meta::U32(*v),
            Meta::F32(v) => Meta::F32(*v),
            Meta::Str(v) => Meta::Str(v),
        };
        match entries.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => entries.push((key, value)),
        }
    }
    entries
}

/// Writes the model with `metadata` to `path`.
pub fn write_model(path: &Path, metadata: &[(&'static str, Meta)]) {
    // ggml dimensions, innermost first.
    let tensors: Vec<(&str, Vec<u64>)> = vec![
        ("token_embd.weight", vec![HIDDEN, VOCAB]),
        ("output_norm.weight", vec![HIDDEN]),
        ("blk.0.attn_norm.weight", vec![HIDDEN]),
        ("blk.0.attn_q.weight", vec![HIDDEN, HIDDEN]),
        ("blk.0.attn_k.weight", vec![HIDDEN, HIDDEN]),
        ("blk.0.attn_v.weight", vec![HIDDEN, HIDDEN]),
        ("blk.0.attn_output.weight", vec![HIDDEN, HIDDEN]),
        ("blk.0.ffn_norm.weight", vec![HIDDEN]),
        ("blk.0.ffn_gate.weight", vec![HIDDEN, FFN]),
        ("blk.0.ffn_up.weight", vec![HIDDEN, FFN]),
        ("blk.0.ffn_down.weight", vec![FFN, HIDDEN]),
    ];
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend((tensors.len() as u64).to_le_bytes());
    bytes.extend((metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        string(&mut bytes, key);
        match value {
            Meta::U32(v) => {
                bytes.extend(4u32.to_le_bytes());
                bytes.extend(v.to_le_bytes());
            }
            Meta::F32(v) => {
                bytes.extend(6u32.to_le_bytes());
                bytes.extend(v.to_le_bytes());
            }
            Meta::Str(v) => {
                bytes.extend(8u32.to_le_bytes());
                string(&mut bytes, v);
            }
        }
    }
    let mut offset = 0u64;
    for (name, dims) in &tensors {
        string(&mut bytes, name);
        bytes.extend((dims.len() as u32).to_le_bytes());
        for dim in dims {
            bytes.extend(dim.to_le_bytes());
        }
        bytes.extend(0u32.to_le_bytes()); // F32
        bytes.extend(offset.to_le_bytes());
        offset += dims.iter().product::<u64>() * 4;
        offset = offset.next_multiple_of(32);
    }
    bytes.resize(bytes.len().next_multiple_of(32), 0);
    let data_start = bytes.len();
    let mut at = 0u64;
    for (index, (_, dims)) in tensors.iter().enumerate() {
        let count = dims.iter().product::<u64>();
        for i in 0..count {
            // Small deterministic weights; norms at 1.
            let value = if dims.len() == 1 {
                1.0f32
            } else {
                ((i * 37 + index as u64 * 11) % 17) as f32 / 17.0 - 0.5
            };
            bytes.extend(value.to_le_bytes());
        }
        at += count * 4;
        at = at.next_multiple_of(32);
        bytes.resize(data_start + at as usize, 0);
    }
    std::fs::write(path, bytes).unwrap();
}

fn string(bytes: &mut Vec<u8>, text: &str) {
    bytes.extend((text.len() as u64).to_le_bytes());
    bytes.extend(text.as_bytes());
}

/// A GGUF header claiming `tensors` tensors and `entries` metadata entries, then nothing.
pub fn header_only(tensors: u64, entries: u64) -> Vec<u8> {
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend(tensors.to_le_bytes());
    bytes.extend(entries.to_le_bytes());
    bytes
}
