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

/// The checkpoint header's seven numbers, checked: every size positive, the heads dividing the
/// width, the key/value heads dividing the heads.
struct Header {
    dim: usize,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    vocab: usize,
    seq_len: usize,
    /// A positive vocabulary size in the file means the classifier is the embedding table.
    shared_classifier: bool,
}

impl Header {
    fn parse(path: &Path, map: &[u8]) -> Result<Self> {
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
            unreachable!("HEADER_BYTES holds seven i32")
        };
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
        Ok(Self {
            dim,
            hidden,
            layers,
            heads,
            kv_heads,
            vocab: vocab.unsigned_abs() as usize,
            seq_len,
            shared_classifier: vocab > 0,
        })
    }

    fn head_dim(&self) -> usize {
        self.dim / self.heads
    }

    fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim()
    }

    /// The file size the header implies, in u128 so that nothing overflows: a corrupt header
    /// (4 KB of spaces reads as dimensions of 538976288) must fail the size check rather than
    /// size a table of billions of layers.
    fn implied_bytes(&self) -> u128 {
        let [dim, hidden, layers, kv_dim, vocab, positions, head_dim] = [
            self.dim,
            self.hidden,
            self.layers,
            self.kv_dim(),
            self.vocab,
            self.seq_len,
            self.head_dim(),
        ]
        .map(|v| v as u128);
        let per_layer = 2 * dim + 2 * dim * dim + 2 * kv_dim * dim + 3 * hidden * dim;
        let classifier = if self.shared_classifier {
            0
        } else {
            vocab * dim
        };
        let elements = vocab * dim + layers * per_layer + dim + positions * head_dim + classifier;
        HEADER_BYTES as u128 + 4 * elements
    }

    /// Hugging Face name -> (offset in f32 elements after the header, shape, permute for
    /// RoPE), in the file's order.
    fn tensors(&self) -> HashMap<String, (usize, Vec<usize>, bool)> {
        let (dim, hidden, kv_dim) = (self.dim, self.hidden, self.kv_dim());
        let mut tensors = HashMap::new();
        let mut offset = 0;
        let mut add = |name: String, shape: Vec<usize>, permute: bool| {
            let count: usize = shape.iter().product();
            tensors.insert(name, (offset, shape, permute));
            offset += count;
        };
        add(
            "model.embed_tokens.weight".into(),
            vec![self.vocab, dim],
            false,
        );
        let per_layer: [(&str, Vec<usize>, bool); 9] = [
            ("input_layernorm.weight", vec![dim], false),
            ("self_attn.q_proj.weight", vec![dim, dim], true),
            ("self_attn.k_proj.weight", vec![kv_dim, dim], true),
            ("self_attn.v_proj.weight", vec![kv_dim, dim], false),
            ("self_attn.o_proj.weight", vec![dim, dim], false),
            ("post_attention_layernorm.weight", vec![dim], false),
            ("mlp.gate_proj.weight", vec![hidden, dim], false),
            ("mlp.down_proj.weight", vec![dim, hidden], false),
            ("mlp.up_proj.weight", vec![hidden, dim], false),
        ];
        for (suffix, shape, permute) in per_layer {
            for l in 0..self.layers {
                add(format!("model.layers.{l}.{suffix}"), shape.clone(), permute);
            }
        }
        add("model.norm.weight".into(), vec![dim], false);
        add(FREQ_CIS.into(), vec![self.seq_len, self.head_dim()], false);
        if !self.shared_classifier {
            add("lm_head.weight".into(), vec![self.vocab, dim], false);
        }
        debug_assert_eq!((HEADER_BYTES + offset * 4) as u128, self.implied_bytes());
        tensors
    }

    fn config(&self) -> LlamaConfig {
        LlamaConfig {
            vocab_size: self.vocab,
            hidden_size: self.dim,
            intermediate_size: self.hidden,
            num_hidden_layers: self.layers,
            num_attention_heads: self.heads,
            num_key_value_heads: self.kv_heads,
            head_dim: self.head_dim(),
            rms_norm_eps: 1e-5,
            max_position_embeddings: self.seq_len,
            rope: RopeConfig {
                theta: 10000.0,
                scaling: RopeScaling::Default,
            },
            tie_word_embeddings: self.shared_classifier,
            attention_bias: false,
            mlp_bias: false,
            sliding_window: None,
            bos_token_id: Some(1),
            eos_token_id: vec![2],
        }
    }
}

impl Llama2cCheckpoint {
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: read-only mapping of a file lemo never writes.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let header = Header::parse(path, &map)?;
        // The sizes the header implies are checked against the file before anything is built
        // from them.
        let implied_bytes = header.implied_bytes();
        if (map.len() as u128) < implied_bytes {
            return Err(Error::format(
                path,
                format!(
                    "truncated or not a llama2.c checkpoint: {} bytes, but its header implies \
                     {implied_bytes}",
                    map.len()
                ),
            ));
        }
        Ok(Self {
            path: path.to_path_buf(),
            config: header.config(),
            tensors: header.tensors(),
            map,
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
