//! Block scores from tensor-core GEMMs, a strip of query rows at a time: for each strip, the
//! scores of its queries against every key up to the strip's last position (one batched GEMM, cuBLASLt on
//! CUDA), `relu`, the sum over heads, the causal mask and the max over each block pair. Memory is
//! one strip of scores, about `STRIP_BYTES`, never `S x S`; work is the causal half of `Q K^T`
//! at GEMM speed plus a few passes over each strip.

use burn::tensor::{DType, Int, Tensor};

use crate::ComputeBackend;
use crate::gemm::matmul;

/// Bytes of f32 head-summed scores one strip may hold before its reduction.
const STRIP_BYTES: usize = 1 << 30;

/// See [`super::block_scores`]; `scale` multiplies `q . k`. Output f32
/// `[batch, query blocks, key blocks]`.
pub fn block_scores<B: ComputeBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    block_size: usize,
    scale: f32,
) -> Tensor<B, 3> {
    block_scores_in_strips(q, k, block_size, scale, STRIP_BYTES)
}

/// [`block_scores`] with strips of at most `strip_bytes` of scores (at least one block high).
pub fn block_scores_in_strips<B: ComputeBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    block_size: usize,
    scale: f32,
    strip_bytes: usize,
) -> Tensor<B, 3> {
    let [batch, q_heads, queries, head_dim] = q.dims();
    let [_, kv_heads, keys, _] = k.dims();
    let offset = super::query_offset(queries, keys, block_size);
    let group = q_heads / kv_heads;
    let device = q.device();
    let blocks = keys.div_ceil(block_size);
    // Strip height: whole blocks, as many as keep the widest strip's scores within STRIP_BYTES.
    let rows_per_strip = (strip_bytes / (batch * q_heads * keys * 4).max(1))
        .max(block_size)
        .div_ceil(block_size)
        * block_size;
    let key_t = k.swap_dims(2, 3);
    let mut strips = Vec::new();
    let mut start = 0;
    while start < queries {
        let end = (start + rows_per_strip).min(queries);
        let rows = end - start;
        let strip = q
            .clone()
            .slice([0..batch, 0..q_heads, start..end])
            .reshape([batch, kv_heads, group * rows, head_dim]);
        // The keys up to the strip's last position.
        let seen = offset + end;
        let seen_keys = key_t
            .clone()
            .slice([0..batch, 0..kv_heads, 0..head_dim, 0..seen]);
        // relu(scale * s) = scale * relu(s) for scale > 0: scale once after the head sum.
        let summed = matmul(strip, seen_keys)
            .reshape([batch, q_heads, rows, seen])
            .clamp_min(0.0)
            .cast(DType::F32)
            .sum_dim(1)
            .reshape([batch, rows, seen])
            .mul_scalar(scale / q_heads as f32);
        let query = Tensor::<B, 1, Int>::arange((offset + start) as i64..seen as i64, &device)
            .reshape([1, rows, 1]);
        let key = Tensor::<B, 1, Int>::arange(0..seen as i64, &device).reshape([1, 1, seen]);
        let visible = summed.mask_fill(key.greater(query), 0.0);
        // Zero padding to whole blocks is neutral: every score is >= 0.
        let (padded_rows, padded_keys) = (
            rows.div_ceil(block_size) * block_size,
            seen.div_ceil(block_size) * block_size,
        );
        let visible = visible.pad((0, padded_keys - seen, 0, padded_rows - rows), 0.0);
        let (row_blocks, key_blocks) = (padded_rows / block_size, padded_keys / block_size);
        let maxima = visible
            .reshape([batch, row_blocks, block_size, key_blocks, block_size])
            .max_dim(4)
            .max_dim(2)
            .reshape([batch, row_blocks, key_blocks])
            .pad((0, blocks - key_blocks, 0, 0), 0.0);
        strips.push(maxima);
        start = end;
    }
    Tensor::cat(strips, 1)
}
