//! Materialized attention in plain Burn tensor ops: the definition kernels are tested against.
//! Memory is O(q_len * kv_len) per head. GQA folds the query heads of one K/V group into the
//! row dimension, so K and V are never repeated per head.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, Tensor, TensorData, TensorPrimitive, activation::softmax, backend::Backend};

use super::AttentionOptions;

/// `[q_heads, q_len, kv_len]`, true where the query may NOT see the key (queries are the last
/// `q_len` of the `kv_len` positions). Built on the host: the reference is O(S^2) anyway.
pub fn attention_mask<B: Backend>(
    q_heads: usize,
    q_len: usize,
    kv_len: usize,
    options: &AttentionOptions,
    device: &B::Device,
) -> Tensor<B, 3, Bool> {
    let offset = kv_len - q_len;
    let hidden: Vec<bool> = (0..q_heads)
        .flat_map(|h| (0..q_len).flat_map(move |i| (0..kv_len).map(move |j| (h, i + offset, j))))
        .map(|(h, i, j)| !options.visible(i, j, h, q_heads))
        .collect();
    Tensor::from_data(TensorData::new(hidden, [q_heads, q_len, kv_len]), device)
}

pub fn attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: AttentionOptions,
) -> Tensor<B, 4> {
    let [batch, q_heads, q_len, head_dim] = q.dims();
    let [_, kv_heads, kv_len, _] = k.dims();
    let group = q_heads / kv_heads;
    let q = q.reshape([batch, kv_heads, group * q_len, head_dim]);
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(options.scale);
    let mask = attention_mask::<B>(q_heads, q_len, kv_len, &options, &scores.device())
        .reshape([1, kv_heads, group * q_len, kv_len])
        .expand([batch, kv_heads, group * q_len, kv_len]);
    let probs = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3);
    probs.matmul(v).reshape([batch, q_heads, q_len, head_dim])
}

pub(crate) fn attention_primitive<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    options: AttentionOptions,
) -> FloatTensor<B> {
    let wrap = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    attention(wrap(q), wrap(k), wrap(v), options).into_primitive().tensor()
}
