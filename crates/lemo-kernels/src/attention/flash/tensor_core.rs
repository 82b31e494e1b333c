//! Tensor-core (cmma 16x16x16) attention for 16-bit inputs: every tile matmul (`Q K^T`, `P V`
//! in the forward; `K Q^T`, `V dO^T`, `P^T dO`, `dS^T Q`, `Q K^T`, `dO V^T`, `dS K` in the
//! backward) runs on the matrix units with f32 accumulation, while the softmax and the
//! accumulators stay in f32. Same semantics and outputs as the plain kernels.
//!
//! Layout shared by the three kernels: a cube has 4 planes of 32 threads and works on 64-row
//! tiles; plane `p` owns rows `16p..16p + 16` of the cube's own tile (queries in the forward and
//! dQ kernels, keys in the dK/dV kernel). Two threads per row: `half` picks half of the 64 score
//! columns and half of the head dims of that row. Each plane's matmul results land in its own
//! f32 scratch region, from which the row's two threads read.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::features::MmaConfig;
use cubecl::prelude::*;

use super::{HIDDEN, MaskParams, first_visible_key, group_shift, is_visible, last_visible_query};
use crate::attention::AttentionOptions;

/// Rows per plane (the cmma tile height) and planes per cube.
const PLANE_ROWS: usize = 16;
const PLANES: usize = 4;
const PLANE_SIZE: usize = 32;
/// Rows of a query or key tile.
const BLOCK: usize = PLANE_ROWS * PLANES;
const MMA: usize = 16;
/// Byte alignment of the shared tiles cmma loads from and stores to (wmma needs 32).
const CMMA_ALIGN: usize = 128;

/// Whether the tensor-core kernels ([`super::FlashKernel::TensorCore`]) can run inputs of
/// `dtype` and `head_dim` on this device.
pub fn supports<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType, head_dim: usize) -> bool {
    let hardware = &client.properties().hardware;
    let mma = MmaConfig {
        a_type: dtype.into(),
        b_type: dtype.into(),
        cd_type: DType::F32.into(),
        m: MMA as u32,
        n: MMA as u32,
        k: MMA as u32,
    };
    matches!(dtype, DType::BF16 | DType::F16)
        && head_dim.is_multiple_of(MMA)
        && hardware.plane_size_min == PLANE_SIZE as u32
        && hardware.plane_size_max == PLANE_SIZE as u32
        && max_shared_bytes(head_dim, dtype.size()) <= hardware.max_shared_memory_size
        && client.features().matmul.cmma.contains(&mma)
}

/// f32 words of one plane's scratch: two `16 x 64` score tiles or one `16 x head_dim` result.
fn scratch_words(head_dim: usize) -> usize {
    PLANE_ROWS * (2 * BLOCK).max(head_dim)
}

/// Shared memory of the largest kernel (dK/dV: four input tiles, two probability tiles).
fn max_shared_bytes(head_dim: usize, elem_size: usize) -> usize {
    let elems = 4 * BLOCK * head_dim + 2 * PLANES * PLANE_ROWS * BLOCK;
    let words = PLANES * scratch_words(head_dim) + 2 * BLOCK;
    elems * elem_size + words * 4 + 8 * CMMA_ALIGN
}

/// Copies rows `first_row..first_row + BLOCK` (zeros past `total_rows`) of one head into a
/// dense `BLOCK x head_dim` shared tile, keeping the storage type.
#[cube]
fn load_block<F: Float>(
    source: &Tensor<F>,
    head_offset: usize,
    first_row: usize,
    total_rows: usize,
    tile: &mut SharedMemory<F>,
    thread: usize,
    #[comptime] head_dim: usize,
) {
    let threads = comptime!(PLANES * PLANE_SIZE);
    let row_stride = source.stride(2);
    let dim_stride = source.stride(3);
    for step in 0..comptime!(BLOCK * head_dim / threads) {
        let element = thread + step * threads;
        let row = element / head_dim;
        let dim = element % head_dim;
        let source_row = first_row + row;
        let mut value = F::new(0.0);
        if source_row < total_rows {
            value = source[head_offset + source_row * row_stride + dim * dim_stride];
        }
        tile[element] = value;
    }
}

/// `out[out_offset.., 16 x 64, pitch 64] = a[rows a_row..a_row + 16] . b^T`, where `a` and `b`
/// are `64 x head_dim` tiles (so `b` row-major is `b^T` column-major).
#[cube]
fn plane_scores<F: Float>(
    a: &SharedMemory<F>,
    a_row: usize,
    b: &SharedMemory<F>,
    out: &mut SharedMemory<f32>,
    out_offset: usize,
    #[comptime] head_dim: usize,
) {
    let span = comptime!((MMA - 1) * head_dim + MMA);
    #[unroll]
    for n in 0..comptime!(BLOCK / MMA) {
        let acc = cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            MMA,
            MMA,
            MMA,
            cmma::MatrixLayout::Undefined,
            0.0,
        );
        #[unroll]
        for kk in 0..comptime!(head_dim / MMA) {
            let a_start = a_row * head_dim + kk * MMA;
            let b_start = n * MMA * head_dim + kk * MMA;
            let a_frag = cmma::Matrix::<F>::from_slice(
                cmma::MatrixIdent::A,
                MMA,
                MMA,
                MMA,
                cmma::MatrixLayout::RowMajor,
                &a.slice(a_start, a_start + span),
                head_dim as u32,
            );
            let b_frag = cmma::Matrix::<F>::from_slice(
                cmma::MatrixIdent::B,
                MMA,
                MMA,
                MMA,
                cmma::MatrixLayout::ColMajor,
                &b.slice(b_start, b_start + span),
                head_dim as u32,
            );
            cmma::execute::<F, F, f32, f32>(&a_frag, &b_frag, &acc, &acc);
        }
        let start = out_offset + n * MMA;
        cmma::store(
            &mut out.slice_mut(start, start + comptime!((MMA - 1) * BLOCK + MMA)),
            &acc,
            BLOCK as u32,
            cmma::MatrixLayout::RowMajor,
        );
    }
}

/// `out[out_offset.., 16 x head_dim, pitch head_dim] = a[a_offset.., 16 x 64, pitch 64] . b`,
/// where `b` is a `64 x head_dim` tile.
#[cube]
fn plane_rows_times_tile<F: Float>(
    a: &SharedMemory<F>,
    a_offset: usize,
    b: &SharedMemory<F>,
    out: &mut SharedMemory<f32>,
    out_offset: usize,
    #[comptime] head_dim: usize,
) {
    #[unroll]
    for n in 0..comptime!(head_dim / MMA) {
        let acc = cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            MMA,
            MMA,
            MMA,
            cmma::MatrixLayout::Undefined,
            0.0,
        );
        #[unroll]
        for kk in 0..comptime!(BLOCK / MMA) {
            let a_start = a_offset + kk * MMA;
            let b_start = kk * MMA * head_dim + n * MMA;
            let a_frag = cmma::Matrix::<F>::from_slice(
                cmma::MatrixIdent::A,
                MMA,
                MMA,
                MMA,
                cmma::MatrixLayout::RowMajor,
                &a.slice(a_start, a_start + comptime!((MMA - 1) * BLOCK + MMA)),
                BLOCK as u32,
            );
            let b_frag = cmma::Matrix::<F>::from_slice(
                cmma::MatrixIdent::B,
                MMA,
                MMA,
                MMA,
                cmma::MatrixLayout::RowMajor,
                &b.slice(b_start, b_start + comptime!((MMA - 1) * head_dim + MMA)),
                head_dim as u32,
            );
            cmma::execute::<F, F, f32, f32>(&a_frag, &b_frag, &acc, &acc);
        }
        let start = out_offset + n * MMA;
        cmma::store(
            &mut out.slice_mut(start, start + comptime!((MMA - 1) * head_dim + MMA)),
            &acc,
            head_dim as u32,
            cmma::MatrixLayout::RowMajor,
        );
    }
}

/// `acc = acc * correction + scratch[start..start + half_dim]` (this thread's half row).
#[cube]
fn accumulate_half_row(
    acc: &mut Array<f32>,
    scratch: &SharedMemory<f32>,
    start: usize,
    correction: f32,
    #[comptime] half_dim: usize,
) {
    #[unroll]
    for i in 0..half_dim {
        acc[i] = acc[i] * correction + scratch[start + i];
    }
}

/// Writes this thread's half row `acc * factor` at `row_offset` of a `[.., rows, head_dim]`
/// tensor.
#[cube]
fn store_half_row<F: Float>(
    acc: &Array<f32>,
    factor: f32,
    output: &mut Tensor<F>,
    row_offset: usize,
    half: usize,
    #[comptime] half_dim: usize,
) {
    #[unroll]
    for i in 0..half_dim {
        let dim = half * half_dim + i;
        output[row_offset + dim * output.stride(3)] = F::cast_from(acc[i] * factor);
    }
}

#[cube]
fn zeroed(#[comptime] len: usize) -> Array<f32> {
    let mut array = Array::<f32>::new(len);
    #[unroll]
    for i in 0..len {
        array[i] = 0.0;
    }
    array
}

/// Forward: one cube per (query tile, query head, batch). Per key tile: scores by cmma, the
/// online softmax by the row's two threads (partial maxima and sums exchanged through shared
/// memory), `P V` by cmma, added into the f32 accumulators after the rescale.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_forward_cmma_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    window: u32,
    group: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let half_dim = comptime!(head_dim / 2);
    let half_block = comptime!(BLOCK / 2);
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let thread = plane * PLANE_SIZE + lane;
    let row = lane / 2;
    let half = lane % 2;
    let partner = thread + 1 - 2 * half;

    let batch = CUBE_POS_Z as usize;
    let head = CUBE_POS_Y as usize;
    let q_heads = q.shape(1);
    let kv_head = head / (q_heads / k.shape(1));
    let q_len = q.shape(2);
    let kv_len = k.shape(2);
    let offset = kv_len - q_len;
    let shift = group_shift(head as u32, q_heads as u32, group);

    let q_start = CUBE_POS_X as usize * BLOCK;
    let plane_row0 = plane * PLANE_ROWS;
    let query = q_start + plane_row0 + row;
    let in_range = query < q_len;
    let query_pos = (offset + query) as u32;

    let mut q_tile = SharedMemory::<F>::new_aligned(comptime!(BLOCK * head_dim), CMMA_ALIGN);
    let mut k_tile = SharedMemory::<F>::new_aligned(comptime!(BLOCK * head_dim), CMMA_ALIGN);
    let mut v_tile = SharedMemory::<F>::new_aligned(comptime!(BLOCK * head_dim), CMMA_ALIGN);
    // Per plane: scores then `P V` (f32), probabilities (storage type).
    let mut scratch =
        SharedMemory::<f32>::new_aligned(comptime!(PLANES * scratch_words(head_dim)), CMMA_ALIGN);
    let mut p_tile =
        SharedMemory::<F>::new_aligned(comptime!(PLANES * PLANE_ROWS * BLOCK), CMMA_ALIGN);
    // Each thread's partial row max, then partial row sum, read by its partner.
    let mut partial = SharedMemory::<f32>::new(comptime!(PLANES * PLANE_SIZE));
    let scratch_base = plane * comptime!(scratch_words(head_dim));
    let p_base = plane * comptime!(PLANE_ROWS * BLOCK);

    load_block::<F>(
        q,
        batch * q.stride(0) + head * q.stride(1),
        q_start,
        q_len,
        &mut q_tile,
        thread,
        head_dim,
    );
    let k_offset = batch * k.stride(0) + kv_head * k.stride(1);
    let v_offset = batch * v.stride(0) + kv_head * v.stride(1);

    let first_query_pos = (offset + q_start) as u32;
    let last_query_pos = (offset + min(q_start + BLOCK, q_len) - 1) as u32;
    let first_key_tile = first_visible_key(first_query_pos, window, group, shift) as usize / BLOCK;
    let end_key_tile = last_query_pos as usize / BLOCK + 1;

    let mut row_max = f32::new(HIDDEN);
    let mut row_sum = 0.0f32;
    let mut acc = zeroed(half_dim);

    for key_tile in first_key_tile..end_key_tile {
        let key_start = key_tile * BLOCK;
        load_block::<F>(
            k,
            k_offset,
            key_start,
            kv_len,
            &mut k_tile,
            thread,
            head_dim,
        );
        load_block::<F>(
            v,
            v_offset,
            key_start,
            kv_len,
            &mut v_tile,
            thread,
            head_dim,
        );
        sync_cube();
        plane_scores::<F>(
            &q_tile,
            plane_row0,
            &k_tile,
            &mut scratch,
            scratch_base,
            head_dim,
        );
        sync_cube();

        let mut local_max = f32::new(HIDDEN);
        for c in 0..half_block {
            let col = half * half_block + c;
            let key = key_start + col;
            let index = scratch_base + row * BLOCK + col;
            let mut score = f32::new(HIDDEN);
            if in_range && key < kv_len && is_visible(query_pos, key as u32, window, group, shift) {
                score = scratch[index] * scale;
            }
            scratch[index] = score;
            local_max = max(local_max, score);
        }
        partial[thread] = local_max;
        sync_cube();
        let new_max = max(row_max, max(local_max, partial[partner]));
        let correction = (row_max - new_max).exp();
        row_max = new_max;
        let mut local_sum = 0.0f32;
        for c in 0..half_block {
            let col = half * half_block + c;
            let score = scratch[scratch_base + row * BLOCK + col];
            let mut p = 0.0f32;
            if score > HIDDEN {
                p = (score - new_max).exp();
            }
            local_sum += p;
            p_tile[p_base + row * BLOCK + col] = F::cast_from(p);
        }
        sync_cube();
        partial[thread] = local_sum;
        plane_rows_times_tile::<F>(
            &p_tile,
            p_base,
            &v_tile,
            &mut scratch,
            scratch_base,
            head_dim,
        );
        sync_cube();

        row_sum = row_sum * correction + local_sum + partial[partner];
        let pv_start = scratch_base + row * head_dim + half * half_dim;
        accumulate_half_row(&mut acc, &scratch, pv_start, correction, half_dim);
        sync_cube();
    }

    if in_range {
        let out_offset = batch * out.stride(0) + head * out.stride(1) + query * out.stride(2);
        store_half_row::<F>(&acc, 1.0f32 / row_sum, out, out_offset, half, half_dim);
        if half == 0 {
            lse[batch * lse.stride(0) + head * lse.stride(1) + query * lse.stride(2)] =
                row_max + row_sum.ln();
        }
    }
}

/// dK and dV: one cube per (key tile, kv head, batch), looping over the GQA query heads and the
/// query tiles that see the key tile: `S^T = K Q^T`, `dP^T = V dO^T` by cmma, then
/// `P^T = exp(S^T * scale - lse)`, `dS^T = P^T * (dP^T - delta)`, then `dV += P^T dO` and
/// `dK += dS^T Q` by cmma.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_backward_kv_cmma_kernel<F: Float>(
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
    #[define(F)] _dtype: StorageType,
) {
    let half_dim = comptime!(head_dim / 2);
    let half_block = comptime!(BLOCK / 2);
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let thread = plane * PLANE_SIZE + lane;
    let row = lane / 2;
    let half = lane % 2;

    let batch = CUBE_POS_Z as usize;
    let kv_head = CUBE_POS_Y as usize;
    let q_heads = q.shape(1);
    let heads_per_kv = q_heads / k.shape(1);
    let q_len = q.shape(2);
    let kv_len = k.shape(2);
    let offset = kv_len - q_len;

    let key_start = CUBE_POS_X as usize * BLOCK;
    let plane_row0 = plane * PLANE_ROWS;
    let key = key_start + plane_row0 + row;
    let key_in_range = key < kv_len;
    let last_key_pos = (min(key_start + BLOCK, kv_len) - 1) as u32;

    let mut k_tile = SharedMemory::<F>::new_aligned(comptime!(BLOCK * head_dim), CMMA_ALIGN);
    let mut v_tile = SharedMemory::<F>::new_aligned(comptime!(BLOCK * head_dim), CMMA_ALIGN);
    let mut q_tile = SharedMemory::<F>::new_aligned(comptime!(BLOCK * head_dim), CMMA_ALIGN);
    let mut do_tile = SharedMemory::<F>::new_aligned(comptime!(BLOCK * head_dim), CMMA_ALIGN);
    // Per plane: `S^T` and `dP^T`, then the `dV` or `dK` increment (f32).
    let mut scratch =
        SharedMemory::<f32>::new_aligned(comptime!(PLANES * scratch_words(head_dim)), CMMA_ALIGN);
    let mut p_tile =
        SharedMemory::<F>::new_aligned(comptime!(PLANES * PLANE_ROWS * BLOCK), CMMA_ALIGN);
    let mut ds_tile =
        SharedMemory::<F>::new_aligned(comptime!(PLANES * PLANE_ROWS * BLOCK), CMMA_ALIGN);
    // `lse` then `delta` of the current query tile.
    let mut stats = SharedMemory::<f32>::new(comptime!(2 * BLOCK));
    let scratch_base = plane * comptime!(scratch_words(head_dim));
    let dp_base = scratch_base + comptime!(PLANE_ROWS * BLOCK);
    let p_base = plane * comptime!(PLANE_ROWS * BLOCK);
    let result_start = scratch_base + row * head_dim + half * half_dim;

    let k_offset = batch * k.stride(0) + kv_head * k.stride(1);
    let v_offset = batch * v.stride(0) + kv_head * v.stride(1);
    load_block::<F>(
        k,
        k_offset,
        key_start,
        kv_len,
        &mut k_tile,
        thread,
        head_dim,
    );
    load_block::<F>(
        v,
        v_offset,
        key_start,
        kv_len,
        &mut v_tile,
        thread,
        head_dim,
    );

    let mut acc_k = zeroed(half_dim);
    let mut acc_v = zeroed(half_dim);

    for head_in_group in 0..heads_per_kv {
        let head = kv_head * heads_per_kv + head_in_group;
        let shift = group_shift(head as u32, q_heads as u32, group);
        let q_offset = batch * q.stride(0) + head * q.stride(1);
        let do_offset = batch * grad_out.stride(0) + head * grad_out.stride(1);
        let lse_offset = batch * lse.stride(0) + head * lse.stride(1);
        let delta_offset = batch * delta.stride(0) + head * delta.stride(1);

        let first_query = max(key_start, offset) - offset;
        let last_query_pos =
            last_visible_query(last_key_pos, (kv_len - 1) as u32, window, group, shift) as usize;
        let mut end_query_tile = 0usize;
        if last_query_pos >= offset + first_query {
            end_query_tile = (last_query_pos - offset) / BLOCK + 1;
        }

        for query_tile in first_query / BLOCK..end_query_tile {
            let query_start = query_tile * BLOCK;
            load_block::<F>(
                q,
                q_offset,
                query_start,
                q_len,
                &mut q_tile,
                thread,
                head_dim,
            );
            load_block::<F>(
                grad_out,
                do_offset,
                query_start,
                q_len,
                &mut do_tile,
                thread,
                head_dim,
            );
            if thread < BLOCK {
                let query = query_start + thread;
                let mut row_lse = 0.0f32;
                let mut row_delta = 0.0f32;
                if query < q_len {
                    row_lse = lse[lse_offset + query * lse.stride(2)];
                    row_delta = delta[delta_offset + query * delta.stride(2)];
                }
                stats[thread] = row_lse;
                stats[BLOCK + thread] = row_delta;
            }
            sync_cube();
            plane_scores::<F>(
                &k_tile,
                plane_row0,
                &q_tile,
                &mut scratch,
                scratch_base,
                head_dim,
            );
            plane_scores::<F>(
                &v_tile,
                plane_row0,
                &do_tile,
                &mut scratch,
                dp_base,
                head_dim,
            );
            sync_cube();

            for c in 0..half_block {
                let col = half * half_block + c;
                let query = query_start + col;
                let mut p = 0.0f32;
                let mut ds = 0.0f32;
                if key_in_range
                    && query < q_len
                    && is_visible((offset + query) as u32, key as u32, window, group, shift)
                {
                    let score = scratch[scratch_base + row * BLOCK + col] * scale;
                    p = (score - stats[col]).exp();
                    ds = p * (scratch[dp_base + row * BLOCK + col] - stats[BLOCK + col]);
                }
                p_tile[p_base + row * BLOCK + col] = F::cast_from(p);
                ds_tile[p_base + row * BLOCK + col] = F::cast_from(ds);
            }
            sync_cube();
            plane_rows_times_tile::<F>(
                &p_tile,
                p_base,
                &do_tile,
                &mut scratch,
                scratch_base,
                head_dim,
            );
            sync_cube();
            accumulate_half_row(&mut acc_v, &scratch, result_start, 1.0f32, half_dim);
            sync_cube();
            plane_rows_times_tile::<F>(
                &ds_tile,
                p_base,
                &q_tile,
                &mut scratch,
                scratch_base,
                head_dim,
            );
            sync_cube();
            accumulate_half_row(&mut acc_k, &scratch, result_start, 1.0f32, half_dim);
            sync_cube();
        }
    }

    if key_in_range {
        let k_out = batch * grad_k.stride(0) + kv_head * grad_k.stride(1) + key * grad_k.stride(2);
        let v_out = batch * grad_v.stride(0) + kv_head * grad_v.stride(1) + key * grad_v.stride(2);
        store_half_row::<F>(&acc_k, scale, grad_k, k_out, half, half_dim);
        store_half_row::<F>(&acc_v, 1.0f32, grad_v, v_out, half, half_dim);
    }
}

/// dQ: one cube per (query tile, query head, batch), streaming its visible key tiles:
/// `S = Q K^T`, `dP = dO V^T` by cmma, `dS = P * (dP - delta)`, then `dQ += dS K` by cmma.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_backward_q_cmma_kernel<F: Float>(
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
    #[define(F)] _dtype: StorageType,
) {
    let half_dim = comptime!(head_dim / 2);
    let half_block = comptime!(BLOCK / 2);
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let thread = plane * PLANE_SIZE + lane;
    let row = lane / 2;
    let half = lane % 2;

    let batch = CUBE_POS_Z as usize;
    let head = CUBE_POS_Y as usize;
    let q_heads = q.shape(1);
    let kv_head = head / (q_heads / k.shape(1));
    let q_len = q.shape(2);
    let kv_len = k.shape(2);
    let offset = kv_len - q_len;
    let shift = group_shift(head as u32, q_heads as u32, group);

    let q_start = CUBE_POS_X as usize * BLOCK;
    let plane_row0 = plane * PLANE_ROWS;
    let query = q_start + plane_row0 + row;
    let in_range = query < q_len;
    let query_pos = (offset + query) as u32;

    let mut q_tile = SharedMemory::<F>::new_aligned(comptime!(BLOCK * head_dim), CMMA_ALIGN);
    let mut do_tile = SharedMemory::<F>::new_aligned(comptime!(BLOCK * head_dim), CMMA_ALIGN);
    let mut k_tile = SharedMemory::<F>::new_aligned(comptime!(BLOCK * head_dim), CMMA_ALIGN);
    let mut v_tile = SharedMemory::<F>::new_aligned(comptime!(BLOCK * head_dim), CMMA_ALIGN);
    // Per plane: `S` and `dP`, then the `dQ` increment (f32).
    let mut scratch =
        SharedMemory::<f32>::new_aligned(comptime!(PLANES * scratch_words(head_dim)), CMMA_ALIGN);
    let mut ds_tile =
        SharedMemory::<F>::new_aligned(comptime!(PLANES * PLANE_ROWS * BLOCK), CMMA_ALIGN);
    let scratch_base = plane * comptime!(scratch_words(head_dim));
    let dp_base = scratch_base + comptime!(PLANE_ROWS * BLOCK);
    let ds_base = plane * comptime!(PLANE_ROWS * BLOCK);

    let q_offset = batch * q.stride(0) + head * q.stride(1);
    let do_offset = batch * grad_out.stride(0) + head * grad_out.stride(1);
    load_block::<F>(q, q_offset, q_start, q_len, &mut q_tile, thread, head_dim);
    load_block::<F>(
        grad_out,
        do_offset,
        q_start,
        q_len,
        &mut do_tile,
        thread,
        head_dim,
    );
    let k_offset = batch * k.stride(0) + kv_head * k.stride(1);
    let v_offset = batch * v.stride(0) + kv_head * v.stride(1);

    let mut row_lse = 0.0f32;
    let mut row_delta = 0.0f32;
    if in_range {
        row_lse = lse[batch * lse.stride(0) + head * lse.stride(1) + query * lse.stride(2)];
        row_delta =
            delta[batch * delta.stride(0) + head * delta.stride(1) + query * delta.stride(2)];
    }

    let first_query_pos = (offset + q_start) as u32;
    let last_query_pos = (offset + min(q_start + BLOCK, q_len) - 1) as u32;
    let first_key_tile = first_visible_key(first_query_pos, window, group, shift) as usize / BLOCK;
    let end_key_tile = last_query_pos as usize / BLOCK + 1;

    let mut acc = zeroed(half_dim);
    for key_tile in first_key_tile..end_key_tile {
        let key_start = key_tile * BLOCK;
        load_block::<F>(
            k,
            k_offset,
            key_start,
            kv_len,
            &mut k_tile,
            thread,
            head_dim,
        );
        load_block::<F>(
            v,
            v_offset,
            key_start,
            kv_len,
            &mut v_tile,
            thread,
            head_dim,
        );
        sync_cube();
        plane_scores::<F>(
            &q_tile,
            plane_row0,
            &k_tile,
            &mut scratch,
            scratch_base,
            head_dim,
        );
        plane_scores::<F>(
            &do_tile,
            plane_row0,
            &v_tile,
            &mut scratch,
            dp_base,
            head_dim,
        );
        sync_cube();

        for c in 0..half_block {
            let col = half * half_block + c;
            let key = key_start + col;
            let mut ds = 0.0f32;
            if in_range && key < kv_len && is_visible(query_pos, key as u32, window, group, shift) {
                let p = (scratch[scratch_base + row * BLOCK + col] * scale - row_lse).exp();
                ds = p * (scratch[dp_base + row * BLOCK + col] - row_delta);
            }
            ds_tile[ds_base + row * BLOCK + col] = F::cast_from(ds);
        }
        sync_cube();
        plane_rows_times_tile::<F>(
            &ds_tile,
            ds_base,
            &k_tile,
            &mut scratch,
            scratch_base,
            head_dim,
        );
        sync_cube();
        let result_start = scratch_base + row * head_dim + half * half_dim;
        accumulate_half_row(&mut acc, &scratch, result_start, 1.0f32, half_dim);
        sync_cube();
    }

    if in_range {
        let q_out = batch * grad_q.stride(0) + head * grad_q.stride(1) + query * grad_q.stride(2);
        store_half_row::<F>(&acc, scale, grad_q, q_out, half, half_dim);
    }
}

fn cube_dim() -> CubeDim {
    CubeDim::new_2d(PLANE_SIZE as u32, PLANES as u32)
}

/// Tensor-core forward (see [`supports`]) into `out` and `lse`.
/// Work O(batch * q_heads * q_len * visible_keys * head_dim) on the matrix units; memory
/// O(output).
pub(crate) fn launch_forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: &CubeTensor<R>,
    lse: &CubeTensor<R>,
    options: &AttentionOptions,
    [batch, q_heads, q_len, head_dim]: [usize; 4],
) {
    let mask = MaskParams::new(options);
    let client = q.client.clone();
    let dtype = q.dtype;
    flash_forward_cmma_kernel::launch::<R>(
        &client,
        CubeCount::Static(q_len.div_ceil(BLOCK) as u32, q_heads as u32, batch as u32),
        cube_dim(),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        mask.window,
        mask.group,
        options.scale,
        head_dim,
        dtype.into(),
    );
}

/// The inputs and outputs of the backward kernels.
pub(crate) struct BackwardTensors<R: CubeRuntime> {
    pub q: CubeTensor<R>,
    pub k: CubeTensor<R>,
    pub v: CubeTensor<R>,
    pub grad_out: CubeTensor<R>,
    pub lse: CubeTensor<R>,
    pub delta: CubeTensor<R>,
    pub grad_q: CubeTensor<R>,
    pub grad_k: CubeTensor<R>,
    pub grad_v: CubeTensor<R>,
}

/// Tensor-core dK/dV and dQ (see [`supports`]), given `delta = rowsum(dO * O)`.
/// Work O(batch * q_heads * q_len * visible_keys * head_dim) on the matrix units; memory
/// O(inputs).
pub(crate) fn launch_backward<R: CubeRuntime>(
    tensors: BackwardTensors<R>,
    options: &AttentionOptions,
    [batch, q_heads, kv_heads, q_len, kv_len, head_dim]: [usize; 6],
) {
    let BackwardTensors {
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        grad_q,
        grad_k,
        grad_v,
    } = tensors;
    let mask = MaskParams::new(options);
    let client = q.client.clone();
    let dtype = q.dtype;
    flash_backward_kv_cmma_kernel::launch::<R>(
        &client,
        CubeCount::Static(kv_len.div_ceil(BLOCK) as u32, kv_heads as u32, batch as u32),
        cube_dim(),
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        grad_out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        grad_k.into_tensor_arg(),
        grad_v.into_tensor_arg(),
        mask.window,
        mask.group,
        options.scale,
        head_dim,
        dtype.into(),
    );
    flash_backward_q_cmma_kernel::launch::<R>(
        &client,
        CubeCount::Static(q_len.div_ceil(BLOCK) as u32, q_heads as u32, batch as u32),
        cube_dim(),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        grad_out.into_tensor_arg(),
        lse.into_tensor_arg(),
        delta.into_tensor_arg(),
        grad_q.into_tensor_arg(),
        mask.window,
        mask.group,
        options.scale,
        head_dim,
        dtype.into(),
    );
}
