//! Block scores on the tensor cores (bf16/f16, head dims 64 and 128, sm_80 and later): one cube
//! per (query tile, key tile, batch) of 64 x 64 pairs streams the heads past its four warps,
//! each warp's 16 x 64 scores of a head come from `mma.sync` into registers, and their ReLU is
//! added into a head sum that stays in registers; the cube then writes one number, the largest
//! visible head sum. q and k are read once per tile and head (double-buffered `cp.async`), and
//! no score leaves the registers: work is the causal half of `Q K^T`, memory the tile maxima.
//! With a query stride `s` (1, 2 or 4) a cube's 64 query rows are every `s`-th row of `s`
//! consecutive 64-row tiles, read in place through a strided row layout: the work is `1 / s` of
//! the exact scores'. The queries may be the last rows of more keys (a slice of the query tiles
//! of the whole matrix), at the work of their tiles alone.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::FastMath;
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use crate::attention::flash::empty_like;
use crate::attention::flash::mma::{
    BLOCK, CHUNK, Rows, STREAM, STRIP, WARP, WARPS, commit_stage, cube_dim, prefetch_tile, rows_of,
    strip_times_tile_t, vector_ready, wait_stage, zeros,
};

/// Query and key rows of a cube's tile pair (the forward's query tile and key stream are both
/// this size).
pub(crate) const TILE: usize = BLOCK;
const _: () = assert!(BLOCK == STREAM, "one tile size for queries and keys");

/// Query strides the kernel takes: a warp's 16 read rows then stay within one 64-row tile.
pub(crate) const QUERY_STRIDES: [usize; 3] = [1, 2, 4];

/// One cube per (key tile, group of `query_stride` query tiles, batch); tiles above the diagonal
/// write 0. Query row `i` is position `keys - queries + i`, a whole number of tiles on.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
fn block_scores_mma_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    tile_max: &mut Tensor<f32>,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] query_stride: usize,
    #[define(F)] _dtype: StorageType,
) {
    let chunks = comptime!(head_dim / CHUNK);
    // Warps per query tile (the cube holds `query_stride` query tiles).
    let warps_per_tile = comptime!(WARPS / query_stride);
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let thread = warp * WARP + lane;
    let key_tile = CUBE_POS_X as usize;
    let first_query_tile = CUBE_POS_Y as usize * query_stride;
    let batch = CUBE_POS_Z as usize;
    let tiles = tile_max.shape(1);
    let offset = k.shape(2) - q.shape(2);
    let out_start = batch * tile_max.stride(0) + key_tile * tile_max.stride(2);
    if key_tile >= offset / TILE + first_query_tile + query_stride {
        if thread < query_stride && first_query_tile + thread < tiles {
            tile_max[out_start + (first_query_tile + thread) * tile_max.stride(1)] = 0.0;
        }
        terminate!();
    }
    let q_heads = q.shape(1);
    let heads_per_kv = q_heads / k.shape(1);
    // Read rows `query_stride - 1`, `2 query_stride - 1`, ... as a dense sequence of rows.
    let every_row = rows_of(q, batch);
    let q_rows = Rows {
        start: every_row.start + (query_stride - 1) * every_row.row_stride,
        head_stride: every_row.head_stride,
        row_stride: every_row.row_stride * query_stride,
        len: every_row.len / query_stride,
    };
    let k_rows = rows_of(k, batch);
    let (q_start, key_start) = (CUBE_POS_Y as usize * TILE, key_tile * TILE);

    // Two stages of each: the next head's tiles are copied while this head's are multiplied.
    let mut q_tiles = SharedMemory::<Vector<F, N>>::new(comptime!(2 * TILE * chunks));
    let mut k_tiles = SharedMemory::<Vector<F, N>>::new(comptime!(2 * TILE * chunks));
    let mut warp_max = SharedMemory::<f32>::new(WARPS);
    let ready_0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let ready_1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

    prefetch_tile::<F, N>(q, &q_rows, 0, q_start, &mut q_tiles, 0, thread, head_dim);
    prefetch_tile::<F, N>(k, &k_rows, 0, key_start, &mut k_tiles, 0, thread, head_dim);
    commit_stage(0, &ready_0, &ready_1);
    // Rows past the end are zero-filled: their scores are 0 and leave every maximum as it is.
    let mut sums = zeros(TILE);
    for head in 0..q_heads {
        let stage = head % 2;
        if head + 1 < q_heads {
            let base = (1 - stage) * comptime!(TILE * chunks);
            let next = head + 1;
            prefetch_tile::<F, N>(
                q,
                &q_rows,
                next,
                q_start,
                &mut q_tiles,
                base,
                thread,
                head_dim,
            );
            let kv_head = next / heads_per_kv;
            prefetch_tile::<F, N>(
                k,
                &k_rows,
                kv_head,
                key_start,
                &mut k_tiles,
                base,
                thread,
                head_dim,
            );
            commit_stage(1 - stage, &ready_0, &ready_1);
        }
        wait_stage(stage, &ready_0, &ready_1);
        let base = stage * comptime!(TILE * chunks);
        let strip_start = base + warp * comptime!(STRIP * chunks);
        let scores =
            strip_times_tile_t::<F, N>(&q_tiles, strip_start, &k_tiles, base, lane, head_dim);
        #[unroll]
        for i in 0..comptime!(TILE / 4) {
            let score = scores[i];
            let mut sum = sums[i];
            sum[0] += max(score[0], 0.0);
            sum[1] += max(score[1], 0.0);
            sums[i] = sum;
        }
        // Every warp is done with this stage before the next head's copies refill it.
        sync_cube();
    }

    // Accumulator 2n + h holds row h * 8 + lane / 4 of the warp's strip and columns
    // 8n + 2 (lane % 4) + {0, 1}; a key after the query's position is hidden.
    let row_lo = q_start + warp * STRIP + lane / 4;
    let position_lo = offset + row_lo * query_stride + query_stride - 1;
    let position_hi = position_lo + 8 * query_stride;
    let mut largest = 0.0f32;
    #[unroll]
    for n in 0..comptime!(TILE / 8) {
        #[unroll]
        for j in 0..2usize {
            let key = key_start + 8 * n + 2 * (lane % 4) + j;
            let lo = sums[2 * n];
            let hi = sums[2 * n + 1];
            if key <= position_lo {
                largest = max(largest, lo[j]);
            }
            if key <= position_hi {
                largest = max(largest, hi[j]);
            }
        }
    }
    let largest = plane_max(largest);
    if lane == 0 {
        warp_max[warp] = largest;
    }
    sync_cube();
    // Thread t writes query tile `first_query_tile + t`, the largest of its warps.
    if thread < query_stride && first_query_tile + thread < tiles {
        let mut tile_largest = 0.0f32;
        #[unroll]
        for w in 0..warps_per_tile {
            tile_largest = max(tile_largest, warp_max[thread * warps_per_tile + w]);
        }
        // relu(scale * s) = scale * relu(s) for scale > 0.
        tile_max[out_start + (first_query_tile + thread) * tile_max.stride(1)] =
            tile_largest * scale / f32::cast_from(q_heads);
    }
}

/// The largest visible head-mean ReLU score of every [`TILE`] x [`TILE`] tile pair, f32
/// `[batch, query_tiles, key_tiles]` (0 above the diagonal; tiles past the end hold zero rows),
/// of `q: [batch, q_heads, rows, head_dim]` and `k: [batch, kv_heads, keys, head_dim]` (GQA; the
/// queries are the last rows of the keys, a multiple of [`TILE`] positions on), over
/// the query rows `query_stride` samples (one of [`QUERY_STRIDES`]; see
/// [`super::sampled_query_rows`]), on the tensor cores (the caller checks
/// [`crate::attention::flash::mma::supports`]).
pub(crate) fn tile_maxima<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    scale: f32,
    [query_tiles, key_tiles]: [usize; 2],
    query_stride: usize,
) -> CubeTensor<R> {
    let [batch, _, rows, head_dim] = q.meta.shape().dims();
    let keys = k.meta.shape()[2];
    assert!(
        query_tiles * TILE >= rows && key_tiles * TILE >= keys,
        "{query_tiles} x {key_tiles} tiles of {TILE} rows hold {rows} queries over {keys} keys"
    );
    assert!(
        rows <= keys && (keys - rows).is_multiple_of(TILE),
        "the queries are the last rows of the keys, a whole number of {TILE}-row tiles on"
    );
    assert!(
        QUERY_STRIDES.contains(&query_stride),
        "the tensor-core block scores read every 1st, 2nd or 4th query row, not every {query_stride}th"
    );
    let tile_max = empty_like(&q, [batch, query_tiles, key_tiles], DType::F32);
    let client = q.client.clone();
    let dtype = q.dtype;
    // SAFETY: every global read is bounds-checked against the tensor shapes in the kernel (rows
    // past the end are zero-filled), the inputs are dense along the head dim (`vector_ready`),
    // and each cube writes its own output elements (its `query_stride` query tiles' entries of
    // its key tile).
    unsafe {
        block_scores_mma_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(
                key_tiles as u32,
                query_tiles.div_ceil(query_stride) as u32,
                batch as u32,
            ),
            cube_dim(),
            CHUNK,
            vector_ready(q).into_tensor_arg(),
            vector_ready(k).into_tensor_arg(),
            tile_max.clone().into_tensor_arg(),
            scale,
            head_dim,
            query_stride,
            dtype.into(),
        );
    }
    tile_max
}
