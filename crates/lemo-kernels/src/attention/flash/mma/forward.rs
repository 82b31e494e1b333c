//! The tensor-core forward kernel: one cube per (query tile, query head, batch), online softmax
//! in registers over the visible K/V tiles.

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::FastMath;
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use crate::attention::AttentionOptions;
use crate::attention::flash::{HIDDEN, MaskParams, is_visible};

use super::fragments::*;
use super::tiles::*;
use super::*;

/// Forward: one cube per (query tile, query head, batch), the heaviest causal tiles first.
/// Streams the visible K/V tiles; online softmax in registers.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
#[allow(
    clippy::manual_is_multiple_of,
    reason = "cube code has no is_multiple_of"
)]
pub(crate) fn flash_forward_mma_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
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
    // Two stages: the next K/V tiles are copied while the current ones are used.
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
    sync_cube();
    let strip_start = warp * comptime!(STRIP * chunks);

    let pos_lo = (tile.offset + row_lo) as u32;
    let pos_hi = pos_lo + 8;
    let shift = tile.shift;
    let (first_key_tile, end_key_tile) = (tile.first_key_tile, tile.end_key_tile);

    let mut max_lo = f32::new(HIDDEN);
    let mut max_hi = f32::new(HIDDEN);
    // Per-lane partial row sums; the four lanes of a row are added once at the end.
    let mut sum_lo = 0.0f32;
    let mut sum_hi = 0.0f32;
    let mut acc = zeros(head_dim);

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

        let mut scores =
            strip_times_tile_t::<F, N>(&q_tile, strip_start, &k_tiles, base, lane, head_dim);
        let masked = needs_mask(&tile, key_start, window, group);
        let mut tile_max_lo = f32::new(HIDDEN);
        let mut tile_max_hi = f32::new(HIDDEN);
        #[unroll]
        for n in 0..comptime!(STREAM / 8) {
            let mut lo = scores[2 * n] * Pair::<f32>::new(scale);
            let mut hi = scores[2 * n + 1] * Pair::<f32>::new(scale);
            if masked {
                #[unroll]
                for j in 0..2usize {
                    let key = key_start + 8 * n + 2 * (lane % 4) + j;
                    let in_range = key < kv_len;
                    if !(in_range && is_visible(pos_lo, key as u32, window, group, shift)) {
                        lo[j] = f32::new(HIDDEN);
                    }
                    if !(in_range && is_visible(pos_hi, key as u32, window, group, shift)) {
                        hi[j] = f32::new(HIDDEN);
                    }
                }
            }
            tile_max_lo = max(tile_max_lo, max(lo[0], lo[1]));
            tile_max_hi = max(tile_max_hi, max(hi[0], hi[1]));
            scores[2 * n] = lo;
            scores[2 * n + 1] = hi;
        }
        let new_max_lo = max(max_lo, quad_max(tile_max_lo));
        let new_max_hi = max(max_hi, quad_max(tile_max_hi));
        // A row with no visible key yet keeps probabilities 0 (exp of HIDDEN - 0).
        let mut base_lo = new_max_lo;
        if new_max_lo == f32::new(HIDDEN) {
            base_lo = 0.0;
        }
        let mut base_hi = new_max_hi;
        if new_max_hi == f32::new(HIDDEN) {
            base_hi = 0.0;
        }
        let correction_lo = (max_lo - base_lo).exp();
        let correction_hi = (max_hi - base_hi).exp();
        max_lo = new_max_lo;
        max_hi = new_max_hi;
        let mut tile_sum_lo = 0.0f32;
        let mut tile_sum_hi = 0.0f32;
        #[unroll]
        for n in 0..comptime!(STREAM / 8) {
            let lo = (scores[2 * n] - Pair::<f32>::new(base_lo)).exp();
            let hi = (scores[2 * n + 1] - Pair::<f32>::new(base_hi)).exp();
            tile_sum_lo += lo[0] + lo[1];
            tile_sum_hi += hi[0] + hi[1];
            scores[2 * n] = lo;
            scores[2 * n + 1] = hi;
        }
        sum_lo = sum_lo * correction_lo + tile_sum_lo;
        sum_hi = sum_hi * correction_hi + tile_sum_hi;
        #[unroll]
        for n in 0..comptime!(head_dim / 8) {
            acc[2 * n] = acc[2 * n] * Pair::<f32>::new(correction_lo);
            acc[2 * n + 1] = acc[2 * n + 1] * Pair::<f32>::new(correction_hi);
        }
        let packed = pack::<F>(&scores);
        accumulate_p_times_tile::<F, N>(&packed, &v_tiles, base, &mut acc, lane, head_dim);
        // Every warp is done with this stage before the next iteration refills it.
        sync_cube();
    }

    let total_lo = quad_sum(sum_lo);
    let total_hi = quad_sum(sum_hi);
    let out_offset = batch * out.stride(0) + head * out.stride(1);
    store_strip::<F>(
        &acc,
        1.0 / total_lo,
        1.0 / total_hi,
        out,
        out_offset,
        row_lo,
        q_len,
        lane,
        head_dim,
    );
    if lane % 4 == 0 {
        let lse_offset = batch * lse.stride(0) + head * lse.stride(1);
        if row_lo < q_len {
            lse[lse_offset + row_lo * lse.stride(2)] = max_lo + total_lo.ln();
        }
        if row_lo + 8 < q_len {
            lse[lse_offset + (row_lo + 8) * lse.stride(2)] = max_hi + total_hi.ln();
        }
    }
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
    // SAFETY: every global read is bounds-checked against the tensor shapes in the kernel, and
    // the inputs are dense along the head dim (`vector_ready`).
    unsafe {
        flash_forward_mma_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(q_len.div_ceil(BLOCK) as u32, q_heads as u32, batch as u32),
            cube_dim(),
            CHUNK,
            vector_ready(q).into_tensor_arg(),
            vector_ready(k).into_tensor_arg(),
            vector_ready(v).into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            mask.window,
            mask.group,
            options.scale,
            head_dim,
            dtype.into(),
        );
    }
}
