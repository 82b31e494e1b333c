use burn::tensor::DType;
use burn::tensor::ops::FloatTensor;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::{
    FlashKernel, HIDDEN, MaskParams, TileShape, check_inputs, empty_like, first_visible_key,
    flash_kernel, group_shift, is_visible, load_rows, mma, rows_words, tile_dot,
};
use crate::attention::AttentionOptions;

/// One cube per (query tile, query head, batch); `block` query rows x `lanes` threads per row.
/// Each thread scores `block / lanes` keys of every key tile and accumulates `head_dim / lanes`
/// output dimensions of its row.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    window: u32,
    group: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] block: usize,
    #[comptime] lanes: usize,
    #[define(F)] _dtype: StorageType,
) {
    let threads = comptime!(block * lanes);
    let lane = UNIT_POS_X as usize;
    let row = UNIT_POS_Y as usize;
    let thread = row * lanes + lane;
    let batch = CUBE_POS_Z as usize;
    let head = CUBE_POS_Y as usize;
    let q_heads = q.shape(1);
    let kv_head = head / (q_heads / k.shape(1));
    let q_len = q.shape(2);
    let kv_len = k.shape(2);
    let offset = kv_len - q_len;
    let shift = group_shift(head as u32, q_heads as u32, group);

    let q_start = CUBE_POS_X as usize * block;
    let query = q_start + row;
    let in_range = query < q_len;
    let query_pos = (offset + query) as u32;

    let mut q_tile = SharedMemory::<f32>::new(comptime!(rows_words(block, head_dim)));
    let mut kv_tile = SharedMemory::<f32>::new(comptime!(rows_words(block, head_dim)));
    // Scores, then the lane maxima, then the probabilities of the current key tile.
    let mut p_tile = SharedMemory::<f32>::new(comptime!(block * block));

    let q_offset = batch * q.stride(0) + head * q.stride(1);
    let k_offset = batch * k.stride(0) + kv_head * k.stride(1);
    let v_offset = batch * v.stride(0) + kv_head * v.stride(1);
    load_rows::<F>(
        q,
        q_offset,
        q_start,
        q_len,
        &mut q_tile,
        thread,
        block,
        head_dim,
        threads,
    );

    let first_query_pos = (offset + q_start) as u32;
    let last_query_pos = (offset + min(q_start + block, q_len) - 1) as u32;
    let first_key_tile = first_visible_key(first_query_pos, window, group, shift) as usize / block;
    let end_key_tile = last_query_pos as usize / block + 1;

    let mut row_max = f32::new(HIDDEN);
    let mut row_sum = 0.0f32;
    let mut acc = Array::<f32>::new(comptime!(head_dim / lanes));
    for i in 0..comptime!(head_dim / lanes) {
        acc[i] = 0.0;
    }
    let mut scores = Array::<f32>::new(comptime!(block / lanes));
    sync_cube();

    for key_tile in first_key_tile..end_key_tile {
        let key_start = key_tile * block;
        load_rows::<F>(
            k,
            k_offset,
            key_start,
            kv_len,
            &mut kv_tile,
            thread,
            block,
            head_dim,
            threads,
        );
        sync_cube();

        let mut lane_max = f32::new(HIDDEN);
        for c in 0..comptime!(block / lanes) {
            let col = lane + c * lanes;
            let key = key_start + col;
            let mut score = f32::new(HIDDEN);
            if in_range && key < kv_len && is_visible(query_pos, key as u32, window, group, shift) {
                score = tile_dot(&q_tile, row, &kv_tile, col, head_dim) * scale;
            }
            scores[c] = score;
            lane_max = max(lane_max, score);
        }
        p_tile[row * block + lane] = lane_max;
        sync_cube();

        let mut new_max = row_max;
        for l in 0..lanes {
            new_max = max(new_max, p_tile[row * block + l]);
        }
        let correction = (row_max - new_max).exp();
        row_max = new_max;
        sync_cube();

        for c in 0..comptime!(block / lanes) {
            let mut p = 0.0f32;
            if scores[c] > HIDDEN {
                p = (scores[c] - new_max).exp();
            }
            p_tile[row * block + lane + c * lanes] = p;
        }
        load_rows::<F>(
            v,
            v_offset,
            key_start,
            kv_len,
            &mut kv_tile,
            thread,
            block,
            head_dim,
            threads,
        );
        sync_cube();

        let mut tile_sum = 0.0f32;
        for col in 0..block {
            tile_sum += p_tile[row * block + col];
        }
        row_sum = row_sum * correction + tile_sum;
        for i in 0..comptime!(head_dim / lanes) {
            let dim = lane + i * lanes;
            let mut value = acc[i] * correction;
            for col in 0..block {
                value += p_tile[row * block + col] * kv_tile[col * comptime!(head_dim + 1) + dim];
            }
            acc[i] = value;
        }
        sync_cube();
    }

    if in_range {
        let inv_sum = 1.0f32 / row_sum;
        let out_offset = batch * out.stride(0) + head * out.stride(1) + query * out.stride(2);
        for i in 0..comptime!(head_dim / lanes) {
            let dim = lane + i * lanes;
            out[out_offset + dim * out.stride(3)] = F::cast_from(acc[i] * inv_sum);
        }
        if lane == 0 {
            lse[batch * lse.stride(0) + head * lse.stride(1) + query * lse.stride(2)] =
                row_max + row_sum.ln();
        }
    }
}

/// Causal attention forward, FlashAttention-2 style: for each query tile, stream the visible key
/// tiles (causal, window and S2 bounds skip the rest) keeping a running max and sum of the
/// softmax (online softmax). Returns the output `[batch, q_heads, q_len, head_dim]` in the input
/// dtype and the f32 `logsumexp` `[batch, q_heads, q_len]`.
/// Work O(batch * q_heads * q_len * visible_keys * head_dim); memory O(output): no score matrix.
pub(crate) fn forward<R, F, I, BT>(
    q: FloatTensor<CubeBackend<R, F, I, BT>>,
    k: FloatTensor<CubeBackend<R, F, I, BT>>,
    v: FloatTensor<CubeBackend<R, F, I, BT>>,
    options: AttentionOptions,
) -> (CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [batch, q_heads, _, q_len, _, head_dim] = check_inputs(&q, &k, &v);
    let out = empty_like(&q, [batch, q_heads, q_len, head_dim], q.dtype);
    let lse = empty_like(&q, [batch, q_heads, q_len], DType::F32);
    if out.meta.num_elements() == 0 {
        return (out, lse);
    }

    if flash_kernel() != FlashKernel::Plain && mma::supports(&q.client, q.dtype, head_dim) {
        mma::launch_forward(
            q,
            k,
            v,
            &out,
            &lse,
            &options,
            [batch, q_heads, q_len, head_dim],
        );
        return (out, lse);
    }

    let tile = TileShape::choose(&q.client, head_dim, |block| {
        2 * rows_words(block, head_dim) + block * block
    });
    let mask = MaskParams::new(&options);
    let cube_count = CubeCount::Static(
        q_len.div_ceil(tile.block) as u32,
        q_heads as u32,
        batch as u32,
    );
    let client = q.client.clone();
    let dtype = q.dtype;
    flash_forward_kernel::launch::<R>(
        &client,
        cube_count,
        tile.cube_dim(),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        mask.window,
        mask.group,
        options.scale,
        head_dim,
        tile.block,
        tile.lanes,
        dtype.into(),
    );
    (out, lse)
}
