//! Causal attention: options shared by the reference and the kernels.

pub mod reference;

use burn::tensor::{Tensor, TensorPrimitive};

use crate::LemoBackend;

/// Which keys each query may attend to, beyond plain causality.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOptions {
    /// Multiplier of `q . k` before the softmax (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Hugging Face's sliding window: query at position `i` sees keys `j` with `i - j < window`.
    pub sliding_window: Option<usize>,
    /// Shifted sparse attention (LongLoRA's S2) with groups of this many tokens: a query sees
    /// only keys of its own group; query heads in the second half use groups shifted by half a
    /// group (without wrap-around), so information flows between neighbouring groups.
    pub shifted_group: Option<usize>,
}

impl AttentionOptions {
    pub fn causal(head_dim: usize) -> Self {
        Self { scale: (head_dim as f32).powf(-0.5), sliding_window: None, shifted_group: None }
    }

    /// Whether query head `head` of `q_heads`, at position `query`, may attend to position `key`.
    pub fn visible(&self, query: usize, key: usize, head: usize, q_heads: usize) -> bool {
        let in_window = self.sliding_window.is_none_or(|window| query - key < window);
        let same_group = self.shifted_group.is_none_or(|group| {
            let shift = if head >= q_heads / 2 { group / 2 } else { 0 };
            let group_of = |position: usize| (position + (group - shift) % group) / group;
            group_of(query) == group_of(key)
        });
        key <= query && in_window && same_group
    }
}

/// `softmax(q k^T * scale + mask) v` for `q: [batch, q_heads, q_len, head_dim]` and
/// `k, v: [batch, kv_heads, kv_len, head_dim]`; query head `h` reads K/V head
/// `h / (q_heads / kv_heads)`, and the queries are the last `q_len` of the `kv_len` positions.
pub fn attention<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: AttentionOptions,
) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_attention(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        options,
    )))
}
