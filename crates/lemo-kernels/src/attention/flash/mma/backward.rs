//! The tensor-core backward kernels: dK/dV per key tile (GQA without atomics) and dQ per query
//! tile, each recomputing the probabilities from `lse`.

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::FastMath;
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use crate::attention::AttentionOptions;
use crate::attention::flash::{MaskParams, group_shift, is_visible, last_visible_query};

use super::fragments::*;
use super::tiles::*;
use super::*;

/// Probabilities `exp(scores * scale - lse)` in place, `lse` per row (the strip's rows are
/// queries: dQ kernel).
#[cube]
pub(crate) fn row_probabilities(
    scores: &mut Array<Pair<f32>>,
    lse_lo: f32,
    lse_hi: f32,
    scale: f32,
) {
    #[unroll]
    for n in 0..comptime!(STREAM / 8) {
        scores[2 * n] = (scores[2 * n] * Pair::<f32>::new(scale) - Pair::<f32>::new(lse_lo)).exp();
        scores[2 * n + 1] =
            (scores[2 * n + 1] * Pair::<f32>::new(scale) - Pair::<f32>::new(lse_hi)).exp();
    }
}

/// The two per-column values (`lse` or `delta`) of this lane's accumulator columns `8n + ..`,
/// from the stage's row statistics at `stats[stats_base..]`.
#[cube]
pub(crate) fn column_pair(
    stats: &SharedMemory<f32>,
    stats_base: usize,
    n: usize,
    lane: usize,
) -> Pair<f32> {
    let column = stats_base + 8 * n + 2 * (lane % 4);
    let mut pair = Pair::<f32>::new(0.0);
    pair[0] = stats[column];
    pair[1] = stats[column + 1];
    pair
}

/// Probabilities `exp(scores * scale - lse)` in place, `lse` per column (the strip's rows are
/// keys and its columns queries: dK/dV kernel).
#[cube]
pub(crate) fn column_probabilities(
    scores: &mut Array<Pair<f32>>,
    column_lse: &SharedMemory<f32>,
    stats_base: usize,
    scale: f32,
    lane: usize,
) {
    #[unroll]
    for n in 0..comptime!(STREAM / 8) {
        let lse = column_pair(column_lse, stats_base, n, lane);
        #[unroll]
        for half in 0..2usize {
            scores[2 * n + half] = (scores[2 * n + half] * Pair::<f32>::new(scale) - lse).exp();
        }
    }
}

/// Zeroes the probabilities of (query, key) pairs that are hidden or past the ends.
/// `row_is_query` says whether the strip's rows are queries (dQ kernel) or keys (dK/dV kernel).
/// Callers run it only on tiles that need it: as one branch around the whole loop it costs
/// nothing elsewhere.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn hide_invisible(
    p: &mut Array<Pair<f32>>,
    row_lo: usize,
    column_start: usize,
    offset: usize,
    q_len: usize,
    kv_len: usize,
    window: u32,
    group: u32,
    shift: u32,
    lane: usize,
    #[comptime] row_is_query: bool,
) {
    #[unroll]
    for n in 0..comptime!(STREAM / 8) {
        #[unroll]
        for half in 0..2usize {
            let row = row_lo + 8 * half;
            let mut value = p[2 * n + half];
            #[unroll]
            for j in 0..2usize {
                let column = column_start + 8 * n + 2 * (lane % 4) + j;
                let mut query = row;
                let mut key = column;
                if comptime!(!row_is_query) {
                    query = column;
                    key = row;
                }
                if !(query < q_len
                    && key < kv_len
                    && is_visible((offset + query) as u32, key as u32, window, group, shift))
                {
                    value[j] = 0.0;
                }
            }
            p[2 * n + half] = value;
        }
    }
}

/// `dS = P * (dP - delta)` in place in `dp`, `delta` per row (dQ kernel).
#[cube]
pub(crate) fn row_score_gradients(
    p: &Array<Pair<f32>>,
    dp: &mut Array<Pair<f32>>,
    delta_lo: f32,
    delta_hi: f32,
) {
    #[unroll]
    for n in 0..comptime!(STREAM / 8) {
        dp[2 * n] = p[2 * n] * (dp[2 * n] - Pair::<f32>::new(delta_lo));
        dp[2 * n + 1] = p[2 * n + 1] * (dp[2 * n + 1] - Pair::<f32>::new(delta_hi));
    }
}

/// `dS = P * (dP - delta)` in place in `dp`, `delta` per column (dK/dV kernel).
#[cube]
pub(crate) fn column_score_gradients(
    p: &Array<Pair<f32>>,
    dp: &mut Array<Pair<f32>>,
    column_delta: &SharedMemory<f32>,
    stats_base: usize,
    lane: usize,
) {
    #[unroll]
    for n in 0..comptime!(STREAM / 8) {
        let delta = column_pair(column_delta, stats_base, n, lane);
        #[unroll]
        for half in 0..2usize {
            dp[2 * n + half] = p[2 * n + half] * (dp[2 * n + half] - delta);
        }
    }
}

/// dK and dV: one cube per (key tile, kv head, batch). Loops over the query heads sharing this
/// K/V head (GQA without atomics) and the query tiles that see the key tile, recomputing
/// `P^T = exp(K Q^T * scale - lse)` per key strip.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_backward_kv_mma_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    grad_out: &Tensor<Vector<F, N>>,
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
    let chunks = comptime!(head_dim / CHUNK);
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let thread = warp * WARP + lane;
    let batch = CUBE_POS_Z as usize;
    let kv_head = CUBE_POS_Y as usize;
    let q_heads = q.shape(1);
    let group_heads = q_heads / k.shape(1);
    let q_len = q.shape(2);
    let kv_len = k.shape(2);
    let offset = kv_len - q_len;
    let key_start = CUBE_POS_X as usize * BLOCK;
    let key_lo = key_start + warp * STRIP + lane / 4;
    let warp_last_key = key_start + warp * STRIP + STRIP - 1;

    let stage_words = comptime!(STREAM * chunks);
    let mut k_tile = SharedMemory::<Vector<F, N>>::new(comptime!(BLOCK * chunks));
    let mut v_tile = SharedMemory::<Vector<F, N>>::new(comptime!(BLOCK * chunks));
    // Two stages of the streamed Q/dO tiles and their lse/delta rows.
    let mut q_tiles = SharedMemory::<Vector<F, N>>::new(comptime!(2 * STREAM * chunks));
    let mut grad_out_tiles = SharedMemory::<Vector<F, N>>::new(comptime!(2 * STREAM * chunks));
    let mut lse_tiles = SharedMemory::<f32>::new(comptime!(2 * STREAM));
    let mut delta_tiles = SharedMemory::<f32>::new(comptime!(2 * STREAM));
    let ready_0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let ready_1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

    let q_rows = rows_of(q, batch);
    let grad_out_rows = rows_of(grad_out, batch);
    let lse_rows = rows_of(lse, batch);
    let delta_rows = rows_of(delta, batch);
    load_tile::<F, N>(
        k,
        &rows_of(k, batch),
        kv_head,
        key_start,
        &mut k_tile,
        thread,
        BLOCK,
        head_dim,
    );
    load_tile::<F, N>(
        v,
        &rows_of(v, batch),
        kv_head,
        key_start,
        &mut v_tile,
        thread,
        BLOCK,
        head_dim,
    );

    let mut grad_k_acc = zeros(head_dim);
    let mut grad_v_acc = zeros(head_dim);
    // Query tiles that see some key of this tile, for both S2 shifts (masks handle the rest),
    // so every query head of the group walks the same steps.
    let last_key = (min(key_start + BLOCK, kv_len) - 1) as u32;
    let max_pos = (kv_len - 1) as u32;
    let last_pos = max(
        last_visible_query(last_key, max_pos, window, group, 0),
        last_visible_query(last_key, max_pos, window, group, group / 2),
    ) as usize;
    let mut first_query = 0usize;
    if key_start > offset {
        first_query = key_start - offset;
    }
    let mut end_query = 0usize;
    if last_pos + 1 > offset {
        end_query = min(last_pos + 1 - offset, q_len);
    }
    let first_query_tile = first_query / STREAM;
    let mut end_query_tile = first_query_tile;
    if end_query > first_query {
        end_query_tile = end_query.div_ceil(STREAM);
    }
    let steps = group_heads * (end_query_tile - first_query_tile);

    // Steps walk the query tiles of each query head of the group in turn.
    let mut head = kv_head * group_heads;
    let mut query_tile = first_query_tile;
    if steps > 0 {
        prefetch_query_step::<F, N>(
            q,
            grad_out,
            lse,
            delta,
            &q_rows,
            &grad_out_rows,
            &lse_rows,
            &delta_rows,
            head,
            query_tile * STREAM,
            &mut q_tiles,
            &mut grad_out_tiles,
            &mut lse_tiles,
            &mut delta_tiles,
            0,
            thread,
            head_dim,
        );
        commit_stage(0, &ready_0, &ready_1);
    }
    for step in 0..steps {
        let stage = step % 2;
        let mut next_head = head;
        let mut next_query_tile = query_tile + 1;
        if next_query_tile == end_query_tile {
            next_head += 1;
            next_query_tile = first_query_tile;
        }
        if step + 1 < steps {
            prefetch_query_step::<F, N>(
                q,
                grad_out,
                lse,
                delta,
                &q_rows,
                &grad_out_rows,
                &lse_rows,
                &delta_rows,
                next_head,
                next_query_tile * STREAM,
                &mut q_tiles,
                &mut grad_out_tiles,
                &mut lse_tiles,
                &mut delta_tiles,
                1 - stage,
                thread,
                head_dim,
            );
            commit_stage(1 - stage, &ready_0, &ready_1);
        }
        wait_stage(stage, &ready_0, &ready_1);
        let shift = group_shift(head as u32, q_heads as u32, group);
        let query_start = query_tile * STREAM;
        let base = stage * stage_words;
        let stats_base = stage * STREAM;

        let masked = offset + query_start < warp_last_key
            || query_start + STREAM > q_len
            || key_start + BLOCK > kv_len
            || window > 0
            || group > 0;
        let strip_start = warp * comptime!(STRIP * chunks);
        let mut p =
            strip_times_tile_t::<F, N>(&k_tile, strip_start, &q_tiles, base, lane, head_dim);
        column_probabilities(&mut p, &lse_tiles, stats_base, scale, lane);
        if masked {
            hide_invisible(
                &mut p,
                key_lo,
                query_start,
                offset,
                q_len,
                kv_len,
                window,
                group,
                shift,
                lane,
                false,
            );
        }
        accumulate_p_times_tile::<F, N>(
            &pack::<F>(&p),
            &grad_out_tiles,
            base,
            &mut grad_v_acc,
            lane,
            head_dim,
        );
        let mut ds =
            strip_times_tile_t::<F, N>(&v_tile, strip_start, &grad_out_tiles, base, lane, head_dim);
        column_score_gradients(&p, &mut ds, &delta_tiles, stats_base, lane);
        accumulate_p_times_tile::<F, N>(
            &pack::<F>(&ds),
            &q_tiles,
            base,
            &mut grad_k_acc,
            lane,
            head_dim,
        );
        // Every warp is done with this stage before the next step refills it.
        sync_cube();
        head = next_head;
        query_tile = next_query_tile;
    }

    let grad_k_offset = batch * grad_k.stride(0) + kv_head * grad_k.stride(1);
    let grad_v_offset = batch * grad_v.stride(0) + kv_head * grad_v.stride(1);
    store_strip::<F>(
        &grad_k_acc,
        scale,
        scale,
        grad_k,
        grad_k_offset,
        key_lo,
        kv_len,
        lane,
        head_dim,
    );
    store_strip::<F>(
        &grad_v_acc,
        1.0,
        1.0,
        grad_v,
        grad_v_offset,
        key_lo,
        kv_len,
        lane,
        head_dim,
    );
}

/// dQ: one cube per (query tile, query head, batch), the heaviest causal tiles first. Streams
/// the visible K/V tiles recomputing `P` and `dP = dO V^T`.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_backward_q_mma_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    grad_out: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    grad_q: &mut Tensor<F>,
    window: u32,
    group: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let chunks = comptime!(head_dim / CHUNK);
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let thread = warp * WARP + lane;
    let tile = query_tile_of(q, k, warp, lane, window, group);
    let (batch, head, kv_head) = (tile.batch, tile.head, tile.kv_head);
    let (q_len, kv_len, q_start, row_lo) = (tile.q_len, tile.kv_len, tile.start, tile.row_lo);

    let mut q_tile = SharedMemory::<Vector<F, N>>::new(comptime!(BLOCK * chunks));
    let mut grad_out_tile = SharedMemory::<Vector<F, N>>::new(comptime!(BLOCK * chunks));
    let mut k_tiles = SharedMemory::<Vector<F, N>>::new(comptime!(2 * STREAM * chunks));
    let mut v_tiles = SharedMemory::<Vector<F, N>>::new(comptime!(2 * STREAM * chunks));
    let ready_0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let ready_1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

    let k_rows = rows_of(k, batch);
    let v_rows = rows_of(v, batch);
    load_tile::<F, N>(
        q,
        &rows_of(q, batch),
        head,
        q_start,
        &mut q_tile,
        thread,
        BLOCK,
        head_dim,
    );
    load_tile::<F, N>(
        grad_out,
        &rows_of(grad_out, batch),
        head,
        q_start,
        &mut grad_out_tile,
        thread,
        BLOCK,
        head_dim,
    );

    let lse_offset = batch * lse.stride(0) + head * lse.stride(1);
    let delta_offset = batch * delta.stride(0) + head * delta.stride(1);
    let mut lse_lo = 0.0f32;
    let mut lse_hi = 0.0f32;
    let mut delta_lo = 0.0f32;
    let mut delta_hi = 0.0f32;
    if row_lo < q_len {
        lse_lo = lse[lse_offset + row_lo * lse.stride(2)];
        delta_lo = delta[delta_offset + row_lo * delta.stride(2)];
    }
    if row_lo + 8 < q_len {
        lse_hi = lse[lse_offset + (row_lo + 8) * lse.stride(2)];
        delta_hi = delta[delta_offset + (row_lo + 8) * delta.stride(2)];
    }
    let (first_key_tile, end_key_tile) = (tile.first_key_tile, tile.end_key_tile);

    let mut grad_q_acc = zeros(head_dim);
    prefetch_key_step::<F, N>(
        k,
        v,
        &k_rows,
        &v_rows,
        kv_head,
        first_key_tile * STREAM,
        &mut k_tiles,
        &mut v_tiles,
        0,
        thread,
        head_dim,
    );
    commit_stage(0, &ready_0, &ready_1);
    for key_tile in first_key_tile..end_key_tile {
        let key_start = key_tile * STREAM;
        let base = advance_key_stream::<F, N>(
            k,
            v,
            &k_rows,
            &v_rows,
            kv_head,
            key_tile,
            first_key_tile,
            end_key_tile,
            &mut k_tiles,
            &mut v_tiles,
            &ready_0,
            &ready_1,
            thread,
            head_dim,
        );

        let masked = needs_mask(&tile, key_start, window, group);
        let strip_start = warp * comptime!(STRIP * chunks);
        let mut p =
            strip_times_tile_t::<F, N>(&q_tile, strip_start, &k_tiles, base, lane, head_dim);
        row_probabilities(&mut p, lse_lo, lse_hi, scale);
        if masked {
            hide_invisible(
                &mut p,
                row_lo,
                key_start,
                tile.offset,
                q_len,
                kv_len,
                window,
                group,
                tile.shift,
                lane,
                true,
            );
        }
        let mut ds =
            strip_times_tile_t::<F, N>(&grad_out_tile, strip_start, &v_tiles, base, lane, head_dim);
        row_score_gradients(&p, &mut ds, delta_lo, delta_hi);
        accumulate_p_times_tile::<F, N>(
            &pack::<F>(&ds),
            &k_tiles,
            base,
            &mut grad_q_acc,
            lane,
            head_dim,
        );
        // Every warp is done with this stage before the next iteration refills it.
        sync_cube();
    }

    let grad_q_offset = batch * grad_q.stride(0) + head * grad_q.stride(1);
    store_strip::<F>(
        &grad_q_acc,
        scale,
        scale,
        grad_q,
        grad_q_offset,
        row_lo,
        q_len,
        lane,
        head_dim,
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
    let (q, k, v, grad_out) = (
        vector_ready(q),
        vector_ready(k),
        vector_ready(v),
        vector_ready(grad_out),
    );
    // SAFETY: as in `launch_forward`.
    unsafe {
        flash_backward_kv_mma_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(kv_len.div_ceil(BLOCK) as u32, kv_heads as u32, batch as u32),
            cube_dim(),
            CHUNK,
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
        flash_backward_q_mma_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(q_len.div_ceil(BLOCK) as u32, q_heads as u32, batch as u32),
            cube_dim(),
            CHUNK,
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
}
