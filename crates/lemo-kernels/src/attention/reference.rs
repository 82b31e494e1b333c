//! Materialized attention in plain Burn tensor ops: the definition every kernel is tested against,
//! and the implementation backends without kernels use. Memory is O(q_len * kv_len) per head.
//!
//! GQA is computed by folding the query heads of one K/V group into the row dimension
//! (`[batch, kv_heads, group * q_len, head_dim]`), so K and V are never repeated per head.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{
    Bool, Int, Tensor, TensorData, TensorPrimitive, activation::softmax, backend::Backend,
};

use super::AttentionOptions;

/// Attention mask `[q_heads, q_len, kv_len]`, true where the query may NOT see the key.
/// Queries are the last `q_len` of the `kv_len` positions.
pub fn hidden_mask<B: Backend>(
    q_heads: usize,
    q_len: usize,
    kv_len: usize,
    options: &AttentionOptions,
    device: &B::Device,
) -> Tensor<B, 3, Bool> {
    let shape = [q_heads, q_len, kv_len];
    let offset = (kv_len - q_len) as i64;
    let query_pos = Tensor::<B, 1, Int>::arange(offset..offset + q_len as i64, device)
        .reshape([1, q_len, 1])
        .expand(shape);
    let key_pos = Tensor::<B, 1, Int>::arange(0..kv_len as i64, device)
        .reshape([1, 1, kv_len])
        .expand(shape);
    let distance = query_pos.clone() - key_pos.clone();
    let mut hidden = distance.clone().lower_elem(0);
    if let Some(window) = options.sliding_window {
        hidden = hidden.bool_or(distance.greater_equal_elem(window as i64));
    }
    if let Some(group) = options.shifted_group {
        let shifts: Vec<i64> = (0..q_heads)
            .map(|head| options.group_shift(head, q_heads) as i64)
            .collect();
        let shift = Tensor::<B, 1, Int>::from_data(TensorData::new(shifts, [q_heads]), device)
            .reshape([q_heads, 1, 1])
            .expand(shape);
        let query_group = (query_pos + shift.clone()).div_scalar(group as i64);
        let key_group = (key_pos + shift).div_scalar(group as i64);
        hidden = hidden.bool_or(query_group.not_equal(key_group));
    }
    hidden
}

/// Scaled scores with hidden entries at `-inf`, folded: `[batch, kv_heads, group * q_len, kv_len]`.
fn folded_scores<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    options: &AttentionOptions,
) -> Tensor<B, 4> {
    let [batch, q_heads, q_len, head_dim] = q.dims();
    let [_, kv_heads, kv_len, _] = k.dims();
    let group = q_heads / kv_heads;
    let q = q.reshape([batch, kv_heads, group * q_len, head_dim]);
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(options.scale);
    let mask = hidden_mask::<B>(q_heads, q_len, kv_len, options, &scores.device())
        .reshape([1, kv_heads, group * q_len, kv_len])
        .expand([batch, kv_heads, group * q_len, kv_len]);
    scores.mask_fill(mask, f32::NEG_INFINITY)
}

/// See [`super::attention`].
pub fn attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: AttentionOptions,
) -> Tensor<B, 4> {
    let q_dims = q.dims();
    let probs = softmax(folded_scores(q, k, &options), 3);
    probs.matmul(v).reshape(q_dims)
}

/// Output and natural-log `logsumexp` of each query's scores, `[batch, q_heads, q_len]`.
pub fn attention_with_lse<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: AttentionOptions,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let [batch, q_heads, q_len, head_dim] = q.dims();
    let scores = folded_scores(q, k, &options);
    let row_max = scores.clone().max_dim(3);
    let lse = (scores.clone() - row_max.clone()).exp().sum_dim(3).log() + row_max;
    let probs = (scores - lse.clone()).exp();
    let out = probs.matmul(v).reshape([batch, q_heads, q_len, head_dim]);
    (out, lse.reshape([batch, q_heads, q_len]))
}

/// Gradients `(dq, dk, dv)` from the saved `out` and `lse`, by the FlashAttention-2 identities
/// `dS = P * (dP - rowsum(dO * O))`, with `P` and `dP` materialized.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    out: Tensor<B, 4>,
    lse: Tensor<B, 3>,
    grad_out: Tensor<B, 4>,
    options: AttentionOptions,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    let q_dims = q.dims();
    let [batch, q_heads, q_len, head_dim] = q_dims;
    let kv_heads = k.dims()[1];
    let folded = [batch, kv_heads, q_heads / kv_heads * q_len, head_dim];
    let rows = [folded[0], folded[1], folded[2], 1];

    let probs = (folded_scores(q.clone(), k.clone(), &options) - lse.reshape(rows)).exp();
    let grad_out = grad_out.reshape(folded);
    let delta = (grad_out.clone() * out.reshape(folded)).sum_dim(3);
    let grad_v = probs.clone().swap_dims(2, 3).matmul(grad_out.clone());
    let grad_probs = grad_out.matmul(v.swap_dims(2, 3));
    let grad_scores = (probs * (grad_probs - delta)).mul_scalar(options.scale);
    let grad_q = grad_scores.clone().matmul(k).reshape(q_dims);
    let grad_k = grad_scores.swap_dims(2, 3).matmul(q.reshape(folded));
    (grad_q, grad_k, grad_v)
}

type Primitive<B> = FloatTensor<B>;

fn wrap<B: Backend, const D: usize>(tensor: Primitive<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(tensor))
}

fn unwrap<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Primitive<B> {
    tensor.into_primitive().tensor()
}

pub(crate) fn attention_primitive<B: Backend>(
    q: Primitive<B>,
    k: Primitive<B>,
    v: Primitive<B>,
    options: AttentionOptions,
) -> Primitive<B> {
    unwrap(attention::<B>(wrap(q), wrap(k), wrap(v), options))
}

pub(crate) fn attention_with_lse_primitive<B: Backend>(
    q: Primitive<B>,
    k: Primitive<B>,
    v: Primitive<B>,
    options: AttentionOptions,
) -> (Primitive<B>, Primitive<B>) {
    let (out, lse) = attention_with_lse::<B>(wrap(q), wrap(k), wrap(v), options);
    (unwrap(out), unwrap(lse))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward_primitive<B: Backend>(
    q: Primitive<B>,
    k: Primitive<B>,
    v: Primitive<B>,
    out: Primitive<B>,
    lse: Primitive<B>,
    grad_out: Primitive<B>,
    options: AttentionOptions,
) -> (Primitive<B>, Primitive<B>, Primitive<B>) {
    let (dq, dk, dv) = attention_backward::<B>(
        wrap(q),
        wrap(k),
        wrap(v),
        wrap(out),
        wrap(lse),
        wrap(grad_out),
        options,
    );
    (unwrap(dq), unwrap(dk), unwrap(dv))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;

    /// Keys visible to each query of `head`, from the mask.
    fn visible_keys(mask: &Tensor<CpuBackend, 3, Bool>, head: usize) -> Vec<Vec<usize>> {
        let [_, q_len, kv_len] = mask.dims();
        let hidden = mask.clone().into_data().to_vec::<bool>().unwrap();
        (0..q_len)
            .map(|i| {
                (0..kv_len)
                    .filter(|&j| !hidden[(head * q_len + i) * kv_len + j])
                    .collect()
            })
            .collect()
    }

    #[test]
    fn shifted_groups_follow_longlora_without_wrapping() {
        let options = AttentionOptions::causal(8).with_shifted_groups(4);
        let mask = hidden_mask::<CpuBackend>(2, 8, 8, &options, &Default::default());
        // Head 0: groups {0..3}, {4..7}.
        let plain = visible_keys(&mask, 0);
        assert_eq!(plain[3], vec![0, 1, 2, 3]);
        assert_eq!(plain[5], vec![4, 5]);
        // Head 1 (second half): groups shifted by 2: {0, 1}, {2..5}, {6, 7}.
        let shifted = visible_keys(&mask, 1);
        assert_eq!(shifted[1], vec![0, 1]);
        assert_eq!(shifted[5], vec![2, 3, 4, 5]);
        assert_eq!(shifted[7], vec![6, 7]);
    }

    #[test]
    fn sliding_window_and_decode_offset() {
        let options = AttentionOptions::causal(8).with_sliding_window(3);
        // Two queries at positions 4 and 5 of 6 keys.
        let mask = hidden_mask::<CpuBackend>(1, 2, 6, &options, &Default::default());
        assert_eq!(visible_keys(&mask, 0), vec![vec![2, 3, 4], vec![3, 4, 5]]);
    }
}
