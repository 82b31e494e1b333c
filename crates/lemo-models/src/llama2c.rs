//! llama2.c v0 checkpoints (`run.c`'s format): a header of seven i32 (dim, hidden_dim,
//! n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means the classifier
//! is not shared with the embedding), then f32 arrays in a fixed order. Served under Hugging Face
//! Llama names, with q/k rows permuted from llama2.c's interleaved RoPE pairs to rotate-half.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::config::{LlamaConfig, RopeConfig, RopeScaling};
use safetensors::Dtype;

use crate::weights::{Checkpoint, StoredTensor, WeightSource, sort_tensors};
use crate::{Error, Result};

const HEADER_BYTES: usize = 7 * 4;
/// run.c's precomputed RoPE tables: read past, never used (frequencies are recomputed).
const FREQ_CIS: &str = "freq_cis";

pub struct Llama2cCheckpoint {
    path: PathBuf,
    map: Mmap,
    config: LlamaConfig,
    /// Hugging Face name -> (offset in f32 elements after the header, shape, permute for RoPE).
    tensors: HashMap<String, (usize, Vec<usize>, bool)>,
}

impl Llama2cCheckpoint {
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: read-only mapping of a file lemo never writes.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        if map.len() < HEADER_BYTES {
            return Err(Error::format(
                path,
                "too short for a llama2.c checkpoint header",
            ));
        }
        let header: Vec<i32> = map[..HEADER_BYTES]
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let [dim, hidden, layers, heads, kv_heads, vocab, seq_len] = header[..] else {
            unreachable!()
        };
        let shared_classifier = vocab > 0;
        let vocab = vocab.unsigned_abs() as usize;
        let positive = [dim, hidden, layers, heads, kv_heads, seq_len]
            .iter()
            .all(|&v| v > 0);
        if !positive || heads % kv_heads != 0 || dim % heads != 0 || vocab == 0 {
            return Err(Error::format(
                path,
                format!("not a llama2.c v0 checkpoint (header {header:?})"),
            ));
        }
        let [dim, hidden, layers, heads, kv_heads, seq_len] =
            [dim, hidden, layers, heads, kv_heads, seq_len].map(|v| v as usize);
        let head_dim = dim / heads;
        let kv_dim = kv_heads * head_dim;
        // The sizes the header implies are checked against the file before anything is built
        // from them: a corrupt header (4 KB of spaces reads as dimensions of 538976288) must fail
        // here rather than size a table of billions of layers. In u128, nothing overflows.
        let [
            dim_,
            hidden_,
            layers_,
            kv_dim_,
            vocab_,
            positions_,
            head_dim_,
        ] = [dim, hidden, layers, kv_dim, vocab, seq_len, head_dim].map(|v| v as u128);
        let per_layer_elements =
            2 * dim_ + 2 * dim_ * dim_ + 2 * kv_dim_ * dim_ + 3 * hidden_ * dim_;
        let classifier = if shared_classifier { 0 } else { vocab_ * dim_ };
        let elements = vocab_ * dim_
            + layers_ * per_layer_elements
            + dim_
            + positions_ * head_dim_
            + classifier;
        let implied_bytes = HEADER_BYTES as u128 + 4 * elements;
        if (map.len() as u128) < implied_bytes {
            return Err(Error::format(
                path,
                format!(
                    "truncated or not a llama2.c checkpoint: {} bytes, but the header {header:?} \
                     implies {implied_bytes}",
                    map.len()
                ),
            ));
        }

        let mut tensors = HashMap::new();
        let mut offset = 0;
        let mut add = |name: String, shape: Vec<usize>, permute: bool| {
            let count: usize = shape.iter().product();
            tensors.insert(name, (offset, shape, permute));
            offset += count;
        };
        let per_layer = |add: &mut dyn FnMut(String, Vec<usize>, bool),
                         suffix: &str,
                         shape: Vec<usize>,
                         permute: bool| {
            for l in 0..layers {
                add(format!("model.layers.{l}.{suffix}"), shape.clone(), permute);
            }
        };
        add("model.embed_tokens.weight".into(), vec![vocab, dim], false);
        per_layer(&mut add, "input_layernorm.weight", vec![dim], false);
        per_layer(&mut add, "self_attn.q_proj.weight", vec![dim, dim], true);
        per_layer(&mut add, "self_attn.k_proj.weight", vec![kv_dim, dim], true);
        per_layer(
            &mut add,
            "self_attn.v_proj.weight",
            vec![kv_dim, dim],
            false,
        );
        per_layer(&mut add, "self_attn.o_proj.weight", vec![dim, dim], false);
        per_layer(
            &mut add,
            "post_attention_layernorm.weight",
            vec![dim],
            false,
        );
        per_layer(&mut add, "mlp.gate_proj.weight", vec![hidden, dim], false);
        per_layer(&mut add, "mlp.down_proj.weight", vec![dim, hidden], false);
        per_layer(&mut add, "mlp.up_proj.weight", vec![hidden, dim], false);
        add("model.norm.weight".into(), vec![dim], false);
        add(FREQ_CIS.into(), vec![seq_len, head_dim], false);
        if !shared_classifier {
            add("lm_head.weight".into(), vec![vocab, dim], false);
        }
        debug_assert_eq!((HEADER_BYTES + offset * 4) as u128, implied_bytes);
        let config = LlamaConfig {
            vocab_size: vocab,
            hidden_size: dim,
            intermediate_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: 1e-5,
            max_position_embeddings: seq_len,
            rope: RopeConfig {
                theta: 10000.0,
                scaling: RopeScaling::Default,
            },
            tie_word_embeddings: shared_classifier,
            attention_bias: false,
            mlp_bias: false,
            sliding_window: None,
            bos_token_id: Some(1),
            eos_token_id: vec![2],
        };
        Ok(Self {
            path: path.to_path_buf(),
            map,
            config,
            tensors,
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }
}

/// The row of a head in interleaved RoPE order (pairs `(2i, 2i + 1)`) that holds row `within`
/// of the rotate-half order (pairs `(i, i + head_dim / 2)`).
fn interleaved_row(within: usize, head_dim: usize) -> usize {
    let half = head_dim / 2;
    if within < half {
        2 * within
    } else {
        2 * (within - half) + 1
    }
}

/// Reorders the rows of a `[heads * head_dim, cols]` projection (or bias, `cols` 1) so that each
/// head's interleaved pairs `(2i, 2i + 1)` become the rotate-half pairs `(i, i + head_dim / 2)`.
pub(crate) fn interleaved_to_rotate_half(
    values: &[f32],
    rows: usize,
    cols: usize,
    head_dim: usize,
) -> Vec<f32> {
    reorder_head_rows(values, rows, cols, head_dim, true)
}

/// The inverse of [`interleaved_to_rotate_half`]: the row order llama.cpp and llama2.c store.
pub(crate) fn rotate_half_to_interleaved(
    values: &[f32],
    rows: usize,
    cols: usize,
    head_dim: usize,
) -> Vec<f32> {
    reorder_head_rows(values, rows, cols, head_dim, false)
}

fn reorder_head_rows(
    values: &[f32],
    rows: usize,
    cols: usize,
    head_dim: usize,
    to_rotate_half: bool,
) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for row in 0..rows {
        let head = row / head_dim;
        let interleaved = head * head_dim + interleaved_row(row % head_dim, head_dim);
        let (to, from) = if to_rotate_half {
            (row, interleaved)
        } else {
            (interleaved, row)
        };
        out[to * cols..(to + 1) * cols].copy_from_slice(&values[from * cols..(from + 1) * cols]);
    }
    out
}

impl Checkpoint for Llama2cCheckpoint {
    fn tensors(&self) -> Vec<StoredTensor> {
        let mut tensors: Vec<StoredTensor> = self
            .tensors
            .iter()
            .filter(|(name, _)| name.as_str() != FREQ_CIS)
            .map(|(name, (_, shape, _))| StoredTensor {
                name: name.clone(),
                shape: shape.clone(),
                dtype: Dtype::F32,
            })
            .collect();
        sort_tensors(&mut tensors);
        tensors
    }
}

impl WeightSource for Llama2cCheckpoint {
    fn fetch(&mut self, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>> {
        let Some((offset, found, permute)) = self.tensors.get(name) else {
            return Ok(None);
        };
        if found != shape {
            return Err(Error::format(
                &self.path,
                format!("{name} has shape {found:?}, expected {shape:?}"),
            ));
        }
        let count: usize = shape.iter().product();
        let start = HEADER_BYTES + offset * 4;
        let values: Vec<f32> = self.map[start..start + count * 4]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok(Some(if *permute {
            interleaved_to_rotate_half(&values, shape[0], shape[1], self.config.head_dim)
        } else {
            values
        }))
    }
}
