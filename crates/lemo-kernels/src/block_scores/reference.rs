//! Materialized block scores in plain Burn tensor ops: O(batch * S^2) memory.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::attention::{AttentionOptions, reference::hidden_mask};

/// See [`super::block_scores`]; `scale` multiplies `q . k`.
pub fn block_scores<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    block_size: usize,
    scale: f32,
) -> Tensor<B, 3> {
    let [batch, q_heads, rows, head_dim] = q.dims();
    let [_, kv_heads, keys, _] = k.dims();
    // The queries are the last rows of the keys, from a block boundary.
    super::query_offset(rows, keys, block_size);
    let group = q_heads / kv_heads;
    let folded = q.reshape([batch, kv_heads, group * rows, head_dim]);
    let scores = folded
        .matmul(k.swap_dims(2, 3))
        .mul_scalar(scale)
        .reshape([batch, q_heads, rows, keys]);
    let causal = AttentionOptions::causal(head_dim);
    let hidden = hidden_mask::<B>(1, rows, keys, &causal, &scores.device())
        .unsqueeze_dim::<4>(0)
        .expand([batch, q_heads, rows, keys]);
    let head_mean = scores
        .clamp_min(0.0)
        .mask_fill(hidden, 0.0)
        .sum_dim(1)
        .div_scalar(q_heads as f32)
        .reshape([batch, rows, keys]);

    // Zero padding to whole blocks is neutral: every real entry is >= 0.
    let (row_blocks, key_blocks) = (rows.div_ceil(block_size), keys.div_ceil(block_size));
    let head_mean = head_mean.pad(
        (
            0,
            key_blocks * block_size - keys,
            0,
            row_blocks * block_size - rows,
        ),
        0.0,
    );
    head_mean
        .reshape([batch, row_blocks, block_size, key_blocks, block_size])
        .max_dim(4)
        .max_dim(2)
        .reshape([batch, row_blocks, key_blocks])
}

pub(crate) fn block_scores_primitive<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    block_size: usize,
    scale: f32,
) -> FloatTensor<B> {
    block_scores::<B>(
        Tensor::from_primitive(TensorPrimitive::Float(q)),
        Tensor::from_primitive(TensorPrimitive::Float(k)),
        block_size,
        scale,
    )
    .into_primitive()
    .tensor()
}
