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
    let [batch, q_heads, seq, head_dim] = q.dims();
    let [_, kv_heads, k_seq, _] = k.dims();
    assert_eq!(seq, k_seq, "block scores need as many queries as keys");
    let group = q_heads / kv_heads;
    let folded = q.reshape([batch, kv_heads, group * seq, head_dim]);
    let scores = folded
        .matmul(k.swap_dims(2, 3))
        .mul_scalar(scale)
        .reshape([batch, q_heads, seq, seq]);
    let causal = AttentionOptions::causal(head_dim);
    let hidden = hidden_mask::<B>(1, seq, seq, &causal, &scores.device())
        .unsqueeze_dim::<4>(0)
        .expand([batch, q_heads, seq, seq]);
    let head_mean = scores
        .clamp_min(0.0)
        .mask_fill(hidden, 0.0)
        .sum_dim(1)
        .div_scalar(q_heads as f32)
        .reshape([batch, seq, seq]);

    let blocks = seq.div_ceil(block_size);
    let padded = blocks * block_size;
    // Zero padding is neutral: every real entry is >= 0.
    let head_mean = if padded > seq {
        head_mean.pad((0, padded - seq, 0, padded - seq), 0.0)
    } else {
        head_mean
    };
    head_mean
        .reshape([batch, blocks, block_size, blocks, block_size])
        .max_dim(4)
        .max_dim(2)
        .reshape([batch, blocks, blocks])
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
