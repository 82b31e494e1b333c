use burn::tensor::DType;
use burn::tensor::ops::FloatTensor;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::mma::{self, BackwardTensors};
use super::{
    FlashKernel, MaskParams, TileShape, check_inputs, empty_like, first_visible_key, flash_kernel,
    group_shift, is_visible, last_visible_query, load_rows, rows_words, tile_dot,
};
use crate::attention::AttentionOptions;

/// `delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d]`, one thread per query row.
#[cube(launch)]
fn attention_delta_kernel<F: Float>(
    out: &Tensor<F>,
    grad_out: &Tensor<F>,
    delta: &mut Tensor<f32>,
    #[define(F)] _dtype: StorageType,
) {
    let rows = out.shape(0) * out.shape(1) * out.shape(2);
    if ABSOLUTE_POS >= rows {
        terminate!();
    }
    let query = ABSOLUTE_POS % out.shape(2);
    let head = (ABSOLUTE_POS / out.shape(2)) % out.shape(1);
    let batch = ABSOLUTE_POS / (out.shape(2) * out.shape(1));
    let out_offset = batch * out.stride(0) + head * out.stride(1) + query * out.stride(2);
    let grad_offset =
        batch * grad_out.stride(0) + head * grad_out.stride(1) + query * grad_out.stride(2);
    let mut sum = 0.0f32;
    for dim in 0..out.shape(3) {
        sum += f32::cast_from(out[out_offset + dim * out.stride(3)])
            * f32::cast_from(grad_out[grad_offset + dim * grad_out.stride(3)]);
    }
    delta[batch * delta.stride(0) + head * delta.stride(1) + query * delta.stride(2)] = sum;
}

/// dK and dV of one key tile: one cube per (key tile, kv head, batch), `block` key rows x
/// `lanes` threads. It loops over the query heads sharing this K/V head (GQA without atomics)
/// and over the query tiles that see the key tile, recomputing `P^T = exp(K Q^T * scale - lse)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_backward_kv_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    grad_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    grad_k: &mut Tensor<F>,
    grad_v: &mut Tensor<F>,
    window: u32,
    group: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] block: usize,
    #[comptime] lanes: usize,
    #[define(F)] _dtype: StorageType,
) {
    let threads = comptime!(block * lanes);
    let pitch = comptime!(head_dim + 1);
    let lane = UNIT_POS_X as usize;
    let row = UNIT_POS_Y as usize;
    let thread = row * lanes + lane;
    let batch = CUBE_POS_Z as usize;
    let kv_head = CUBE_POS_Y as usize;
    let q_heads = q.shape(1);
    let heads_per_kv = q_heads / k.shape(1);
    let q_len = q.shape(2);
    let kv_len = k.shape(2);
    let offset = kv_len - q_len;

    let key_start = CUBE_POS_X as usize * block;
    let key = key_start + row;
    let key_in_range = key < kv_len;
    let last_key_pos = (min(key_start + block, kv_len) - 1) as u32;

    let mut k_tile = SharedMemory::<f32>::new(comptime!(rows_words(block, head_dim)));
    let mut v_tile = SharedMemory::<f32>::new(comptime!(rows_words(block, head_dim)));
    let mut q_tile = SharedMemory::<f32>::new(comptime!(rows_words(block, head_dim)));
    let mut do_tile = SharedMemory::<f32>::new(comptime!(rows_words(block, head_dim)));
    // `P^T` and `dS^T` of the current tile pair, key-major.
    let mut p_tile = SharedMemory::<f32>::new(comptime!(block * block));
    let mut ds_tile = SharedMemory::<f32>::new(comptime!(block * block));
    // `lse` then `delta` of the current query tile.
    let mut stats = SharedMemory::<f32>::new(comptime!(2 * block));

    let k_offset = batch * k.stride(0) + kv_head * k.stride(1);
    let v_offset = batch * v.stride(0) + kv_head * v.stride(1);
    load_rows::<F>(
        k,
        k_offset,
        key_start,
        kv_len,
        &mut k_tile,
        thread,
        block,
        head_dim,
        threads,
    );
    load_rows::<F>(
        v,
        v_offset,
        key_start,
        kv_len,
        &mut v_tile,
        thread,
        block,
        head_dim,
        threads,
    );

    let mut acc_k = Array::<f32>::new(comptime!(head_dim / lanes));
    let mut acc_v = Array::<f32>::new(comptime!(head_dim / lanes));
    for i in 0..comptime!(head_dim / lanes) {
        acc_k[i] = 0.0;
        acc_v[i] = 0.0;
    }

    for head_in_group in 0..heads_per_kv {
        let head = kv_head * heads_per_kv + head_in_group;
        let shift = group_shift(head as u32, q_heads as u32, group);
        let q_offset = batch * q.stride(0) + head * q.stride(1);
        let do_offset = batch * grad_out.stride(0) + head * grad_out.stride(1);
        let lse_offset = batch * lse.stride(0) + head * lse.stride(1);
        let delta_offset = batch * delta.stride(0) + head * delta.stride(1);

        // Queries from the first key of the tile (or the first query) up to the last query
        // that sees the last key of the tile.
        let first_query = (max(key_start, offset) - offset) as usize;
        let last_query_pos =
            last_visible_query(last_key_pos, (kv_len - 1) as u32, window, group, shift) as usize;
        let mut end_query_tile = 0usize;
        if last_query_pos >= offset + first_query {
            end_query_tile = (last_query_pos - offset) / block + 1;
        }

        for query_tile in first_query / block..end_query_tile {
            let query_start = query_tile * block;
            load_rows::<F>(
                q,
                q_offset,
                query_start,
                q_len,
                &mut q_tile,
                thread,
                block,
                head_dim,
                threads,
            );
            load_rows::<F>(
                grad_out,
                do_offset,
                query_start,
                q_len,
                &mut do_tile,
                thread,
                block,
                head_dim,
                threads,
            );
            if thread < block {
                let query = query_start + thread;
                let mut row_lse = 0.0f32;
                let mut row_delta = 0.0f32;
                if query < q_len {
                    row_lse = lse[lse_offset + query * lse.stride(2)];
                    row_delta = delta[delta_offset + query * delta.stride(2)];
                }
                stats[thread] = row_lse;
                stats[block + thread] = row_delta;
            }
            sync_cube();

            for c in 0..comptime!(block / lanes) {
                let col = lane + c * lanes;
                let query = query_start + col;
                let mut p = 0.0f32;
                let mut ds = 0.0f32;
                if key_in_range
                    && query < q_len
                    && is_visible((offset + query) as u32, key as u32, window, group, shift)
                {
                    let score = tile_dot(&k_tile, row, &q_tile, col, head_dim) * scale;
                    p = (score - stats[col]).exp();
                    let dp = tile_dot(&v_tile, row, &do_tile, col, head_dim);
                    ds = p * (dp - stats[block + col]);
                }
                p_tile[row * block + col] = p;
                ds_tile[row * block + col] = ds;
            }
            sync_cube();

            for i in 0..comptime!(head_dim / lanes) {
                let dim = lane + i * lanes;
                let mut sum_v = acc_v[i];
                let mut sum_k = acc_k[i];
                for col in 0..block {
                    sum_v += p_tile[row * block + col] * do_tile[col * pitch + dim];
                    sum_k += ds_tile[row * block + col] * q_tile[col * pitch + dim];
                }
                acc_v[i] = sum_v;
                acc_k[i] = sum_k;
            }
            sync_cube();
        }
    }

    if key_in_range {
        let k_out = batch * grad_k.stride(0) + kv_head * grad_k.stride(1) + key * grad_k.stride(2);
        let v_out = batch * grad_v.stride(0) + kv_head * grad_v.stride(1) + key * grad_v.stride(2);
        for i in 0..comptime!(head_dim / lanes) {
            let dim = lane + i * lanes;
            grad_k[k_out + dim * grad_k.stride(3)] = F::cast_from(acc_k[i] * scale);
            grad_v[v_out + dim * grad_v.stride(3)] = F::cast_from(acc_v[i]);
        }
    }
}

/// dQ of one query tile: one cube per (query tile, query head, batch), streaming the visible
/// key tiles like the forward and recomputing `dS = P * (dO V^T - delta)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_backward_q_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    grad_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    grad_q: &mut Tensor<F>,
    window: u32,
    group: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] block: usize,
    #[comptime] lanes: usize,
    #[define(F)] _dtype: StorageType,
) {
    let threads = comptime!(block * lanes);
    let pitch = comptime!(head_dim + 1);
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
    let mut do_tile = SharedMemory::<f32>::new(comptime!(rows_words(block, head_dim)));
    let mut k_tile = SharedMemory::<f32>::new(comptime!(rows_words(block, head_dim)));
    let mut v_tile = SharedMemory::<f32>::new(comptime!(rows_words(block, head_dim)));
    let mut ds_tile = SharedMemory::<f32>::new(comptime!(block * block));

    let q_offset = batch * q.stride(0) + head * q.stride(1);
    let do_offset = batch * grad_out.stride(0) + head * grad_out.stride(1);
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
    load_rows::<F>(
        grad_out,
        do_offset,
        q_start,
        q_len,
        &mut do_tile,
        thread,
        block,
        head_dim,
        threads,
    );

    let mut row_lse = 0.0f32;
    let mut row_delta = 0.0f32;
    if in_range {
        row_lse = lse[batch * lse.stride(0) + head * lse.stride(1) + query * lse.stride(2)];
        row_delta =
            delta[batch * delta.stride(0) + head * delta.stride(1) + query * delta.stride(2)];
    }

    let first_query_pos = (offset + q_start) as u32;
    let last_query_pos = (offset + min(q_start + block, q_len) - 1) as u32;
    let first_key_tile = first_visible_key(first_query_pos, window, group, shift) as usize / block;
    let end_key_tile = last_query_pos as usize / block + 1;

    let mut acc = Array::<f32>::new(comptime!(head_dim / lanes));
    for i in 0..comptime!(head_dim / lanes) {
        acc[i] = 0.0;
    }

    for key_tile in first_key_tile..end_key_tile {
        let key_start = key_tile * block;
        load_rows::<F>(
            k,
            k_offset,
            key_start,
            kv_len,
            &mut k_tile,
            thread,
            block,
            head_dim,
            threads,
        );
        load_rows::<F>(
            v,
            v_offset,
            key_start,
            kv_len,
            &mut v_tile,
            thread,
            block,
            head_dim,
            threads,
        );
        sync_cube();

        for c in 0..comptime!(block / lanes) {
            let col = lane + c * lanes;
            let key = key_start + col;
            let mut ds = 0.0f32;
            if in_range && key < kv_len && is_visible(query_pos, key as u32, window, group, shift) {
                let score = tile_dot(&q_tile, row, &k_tile, col, head_dim) * scale;
                let p = (score - row_lse).exp();
                let dp = tile_dot(&do_tile, row, &v_tile, col, head_dim);
                ds = p * (dp - row_delta);
            }
            ds_tile[row * block + col] = ds;
        }
        sync_cube();

        for i in 0..comptime!(head_dim / lanes) {
            let dim = lane + i * lanes;
            let mut sum = acc[i];
            for col in 0..block {
                sum += ds_tile[row * block + col] * k_tile[col * pitch + dim];
            }
            acc[i] = sum;
        }
        sync_cube();
    }

    if in_range {
        let q_out = batch * grad_q.stride(0) + head * grad_q.stride(1) + query * grad_q.stride(2);
        for i in 0..comptime!(head_dim / lanes) {
            let dim = lane + i * lanes;
            grad_q[q_out + dim * grad_q.stride(3)] = F::cast_from(acc[i] * scale);
        }
    }
}

/// Attention backward from the saved `logsumexp`, FlashAttention-2 style, in three launches
/// (the last two on the tensor cores unless [`FlashKernel::Plain`] is chosen, where they apply):
/// `delta = rowsum(dO * O)`; dK/dV per key tile (looping over the query tiles and the GQA query
/// heads that see it, so no atomics); dQ per query tile (looping over its visible key tiles).
/// Scores are recomputed in both of the last two, 7 instead of 5 tile matmuls, in exchange for
/// no atomics and no `S x S` buffer. Work O(batch * q_heads * q_len * visible_keys * head_dim);
/// memory O(inputs).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<R, F, I, BT>(
    q: FloatTensor<CubeBackend<R, F, I, BT>>,
    k: FloatTensor<CubeBackend<R, F, I, BT>>,
    v: FloatTensor<CubeBackend<R, F, I, BT>>,
    out: FloatTensor<CubeBackend<R, F, I, BT>>,
    lse: FloatTensor<CubeBackend<R, F, I, BT>>,
    grad_out: FloatTensor<CubeBackend<R, F, I, BT>>,
    options: AttentionOptions,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [batch, q_heads, kv_heads, q_len, kv_len, head_dim] = check_inputs(&q, &k, &v);
    assert_eq!(lse.dtype, DType::F32, "the kernels' lse is f32");
    let dtype = q.dtype;
    let grad_q = empty_like(&q, [batch, q_heads, q_len, head_dim], dtype);
    let grad_k = empty_like(&q, [batch, kv_heads, kv_len, head_dim], dtype);
    let grad_v = empty_like(&q, [batch, kv_heads, kv_len, head_dim], dtype);
    if grad_q.meta.num_elements() == 0 {
        return (grad_q, grad_k, grad_v);
    }
    let client = q.client.clone();
    let mask = MaskParams::new(&options);
    let grad_out = if grad_out.dtype == dtype {
        grad_out
    } else {
        burn_cubecl::kernel::cast(grad_out, dtype)
    };

    let delta = empty_like(&q, [batch, q_heads, q_len], DType::F32);
    let rows = batch * q_heads * q_len;
    let delta_cube = CubeDim::new_1d(256);
    attention_delta_kernel::launch::<R>(
        &client,
        CubeCount::Static(rows.div_ceil(256) as u32, 1, 1),
        delta_cube,
        out.into_tensor_arg(),
        grad_out.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        dtype.into(),
    );

    if flash_kernel() != FlashKernel::Plain && mma::supports(&client, dtype, head_dim) {
        let tensors = BackwardTensors {
            q,
            k,
            v,
            grad_out,
            lse,
            delta,
            grad_q: grad_q.clone(),
            grad_k: grad_k.clone(),
            grad_v: grad_v.clone(),
        };
        let dims = [batch, q_heads, kv_heads, q_len, kv_len, head_dim];
        mma::launch_backward(tensors, &options, dims);
        return (grad_q, grad_k, grad_v);
    }

    let kv_tile = TileShape::choose(&client, head_dim, |block| {
        4 * rows_words(block, head_dim) + 2 * block * block + 2 * block
    });
    flash_backward_kv_kernel::launch::<R>(
        &client,
        CubeCount::Static(
            kv_len.div_ceil(kv_tile.block) as u32,
            kv_heads as u32,
            batch as u32,
        ),
        kv_tile.cube_dim(),
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        grad_out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        grad_k.clone().into_tensor_arg(),
        grad_v.clone().into_tensor_arg(),
        mask.window,
        mask.group,
        options.scale,
        head_dim,
        kv_tile.block,
        kv_tile.lanes,
        dtype.into(),
    );

    let q_tile = TileShape::choose(&client, head_dim, |block| {
        4 * rows_words(block, head_dim) + block * block
    });
    flash_backward_q_kernel::launch::<R>(
        &client,
        CubeCount::Static(
            q_len.div_ceil(q_tile.block) as u32,
            q_heads as u32,
            batch as u32,
        ),
        q_tile.cube_dim(),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        grad_out.into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.into_tensor_arg(),
        grad_q.clone().into_tensor_arg(),
        mask.window,
        mask.group,
        options.scale,
        head_dim,
        q_tile.block,
        q_tile.lanes,
        dtype.into(),
    );
    (grad_q, grad_k, grad_v)
}
