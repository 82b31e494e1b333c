//! The KV cache of incremental decoding.

use burn::tensor::{Tensor, backend::Backend};

/// Keys and values of one layer, `[batch, kv_heads, cached_len, head_dim]` each.
pub type LayerCache<B> = Option<(Tensor<B, 4>, Tensor<B, 4>)>;

/// Keys and values of every layer for incremental decoding.
pub struct KvCache<B: Backend> {
    pub layers: Vec<LayerCache<B>>,
    /// Tokens already processed.
    pub len: usize,
}

impl<B: Backend> KvCache<B> {
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            len: 0,
        }
    }
}

/// Appends this step's keys and values to the layer's cache (if any) and returns the full ones.
pub(crate) fn append_to_cache<B: Backend>(
    cache: Option<&mut LayerCache<B>>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let Some(slot) = cache else { return (k, v) };
    let (k, v) = match slot.take() {
        Some((past_k, past_v)) => (
            Tensor::cat(vec![past_k, k], 2),
            Tensor::cat(vec![past_v, v], 2),
        ),
        None => (k, v),
    };
    *slot = Some((k.clone(), v.clone()));
    (k, v)
}
