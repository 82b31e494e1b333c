//! Block informativeness of the attention score matrix (LeMo, section "exact scores"):
//! for blocks `B_mn` of `block_size` queries x `block_size` keys,
//! `I(B_mn) = max over (i, j) in B_mn of sum over heads h of relu(q^h_i . k^h_j * scale) / H`,
//! with the heads summed before the max and hidden (future) pairs counting as 0; blocks above
//! the diagonal (`n > m`) are 0. Token-block informativeness is reduced from these by
//! `lemo-sparsity`.

pub mod chunked;
pub(crate) mod kernel;
pub(crate) mod mma;
pub mod reference;

use burn::tensor::{Tensor, TensorPrimitive};

use crate::LemoBackend;

/// Block scores `[batch, q_blocks, k_blocks]` of `q: [batch, q_heads, seq, head_dim]` and
/// `k: [batch, kv_heads, seq, head_dim]` (GQA: query head `h` reads key head
/// `h / (q_heads / kv_heads)`), with the `1 / sqrt(head_dim)` scale. A last partial block holds
/// the remaining tokens. Computed tile by tile on the kernel backends: O(S) memory.
pub fn block_scores<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    block_size: usize,
) -> Tensor<B, 3> {
    let scale = (q.dims()[3] as f32).powf(-0.5);
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_block_scores(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        block_size,
        scale,
    )))
}
