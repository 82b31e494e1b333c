//! Register fragments of `mma.sync m16n8k16`: `ldmatrix` loads, the products of a strip with a
//! tile, packing f32 accumulators into 16-bit A fragments, quad reductions and strip stores.

use cubecl::cmma::MmaDefinition;
use cubecl::ir::MatrixIdent;
use cubecl::prelude::*;

use super::*;

/// This lane's `ldmatrix.x4` row address, in vectors from the start of any 16 x 16 block at
/// chunk 0 of a swizzled tile with `chunks` chunks per row. Lane `l` addresses row `l % 8` of
/// 8x8 matrix `l / 8`; `rows_first` orders the four matrices rows-then-chunks (the A fragment of
/// a row-major `[m][k]` block, or with `transpose` the B fragments of two n8 tiles of a row-major
/// `[k][n]` block) instead of chunks-then-rows (the B fragments of two n8 tiles of a row-major
/// `[n][k]` block).
#[cube]
pub(crate) fn block_lane_offset(
    lane: usize,
    #[comptime] chunks: usize,
    #[comptime] rows_first: bool,
) -> usize {
    let matrix = lane / 8usize;
    let mut row_half = matrix / 2usize;
    let mut chunk_half = matrix % 2usize;
    if comptime!(rows_first) {
        row_half = matrix % 2usize;
        chunk_half = matrix / 2usize;
    }
    (lane % 8usize + 8usize * row_half) * chunks + (chunk_half ^ (lane % 8usize))
}

/// `ldmatrix.x4` of the 16 x 16 block at chunks `chunk0, chunk0 + 1` (`chunk0` even) of the
/// swizzled rows starting at vector `block_start` (a multiple of 8 rows into the tile), with this
/// lane's `lane_offset` from [`block_lane_offset`]. For such blocks the swizzle of
/// `(row, chunk0 + c)` is the chunk-0 address XOR `chunk0`, so a block costs one XOR on a
/// per-lane constant and the row offset folds into the instruction.
#[cube]
pub(crate) fn load_block<F: Float, N: Size>(
    tile: &SharedMemory<Vector<F, N>>,
    block_start: usize,
    lane_offset: usize,
    #[comptime] chunk0: usize,
    #[comptime] transpose: bool,
) -> Array<Pair<F>> {
    let mma = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let index = block_start + (lane_offset ^ chunk0);
    mma.load_matrix::<Vector<F, N>, Const<2>>(
        &tile.slice(index, index + 1),
        MatrixIdent::A,
        4usize,
        transpose,
    )
}

/// `acc[acc_at..acc_at + 2] += a[a_at..a_at + 4] x b[b_at..b_at + 2]`: one m16n8k16 step on
/// fragments kept in larger register arrays.
#[cube]
pub(crate) fn mma_step<F: Float>(
    a: &Array<Pair<F>>,
    a_at: usize,
    b: &Array<Pair<F>>,
    b_at: usize,
    acc: &mut Array<Pair<f32>>,
    acc_at: usize,
) {
    let mma = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let mut a_frag = Array::<Pair<F>>::new(4usize);
    #[unroll]
    for i in 0..4usize {
        a_frag[i] = a[a_at + i];
    }
    let mut b_frag = Array::<Pair<F>>::new(2usize);
    #[unroll]
    for i in 0..2usize {
        b_frag[i] = b[b_at + i];
    }
    let mut c_frag = Array::<Pair<f32>>::new(2usize);
    #[unroll]
    for i in 0..2usize {
        c_frag[i] = acc[acc_at + i];
    }
    mma.execute_inplace(&a_frag, &b_frag, &mut c_frag);
    #[unroll]
    for i in 0..2usize {
        acc[acc_at + i] = c_frag[i];
    }
}

/// Zeroed accumulator fragments of a `16 x cols` result.
#[cube]
pub(crate) fn zeros(#[comptime] cols: usize) -> Array<Pair<f32>> {
    let mut acc = Array::<Pair<f32>>::new(comptime!(cols / 4));
    #[unroll]
    for i in 0..comptime!(cols / 4) {
        acc[i] = Pair::<f32>::new(0.0);
    }
    acc
}

/// `strip . tile^T`: the `16 x STREAM` scores of the 16-row strip starting at vector
/// `strip_start` of `strips` against the rows of the `STREAM x head_dim` tile at vector `base` of
/// `tile`. Both operands are read from shared memory one 16-column block at a time, which keeps
/// only one A fragment live. Accumulator `2n + h` holds row `h * 8 + lane / 4`, columns
/// `8n + 2 (lane % 4) + {0, 1}`.
#[cube]
pub(crate) fn strip_times_tile_t<F: Float, N: Size>(
    strips: &SharedMemory<Vector<F, N>>,
    strip_start: usize,
    tile: &SharedMemory<Vector<F, N>>,
    base: usize,
    lane: usize,
    #[comptime] head_dim: usize,
) -> Array<Pair<f32>> {
    let chunks = comptime!(head_dim / CHUNK);
    let a_offset = block_lane_offset(lane, chunks, true);
    let b_offset = block_lane_offset(lane, chunks, false);
    let mut scores = zeros(STREAM);
    #[unroll]
    for kk in 0..comptime!(head_dim / 16) {
        let a = load_block::<F, N>(strips, strip_start, a_offset, comptime!(2 * kk), false);
        #[unroll]
        for pair in 0..comptime!(STREAM / 16) {
            let b = load_block::<F, N>(
                tile,
                base + comptime!(16 * pair * chunks),
                b_offset,
                comptime!(2 * kk),
                false,
            );
            mma_step::<F>(&a, 0, &b, 0, &mut scores, 4 * pair);
            mma_step::<F>(&a, 0, &b, 2, &mut scores, 4 * pair + 2);
        }
    }
    scores
}

/// The `16 x STREAM` f32 accumulators `p` rounded to 16-bit A fragments: accumulators
/// `4c..4c + 4` (two n8 tiles) are the A fragment of k-block `c`, in order, so element `i` of
/// the result is element `i` of `p`.
#[cube]
pub(crate) fn pack<F: Float>(p: &Array<Pair<f32>>) -> Array<Pair<F>> {
    let mut packed = Array::<Pair<F>>::new(comptime!(STREAM / 4));
    #[unroll]
    for i in 0..comptime!(STREAM / 4) {
        packed[i] = Pair::<F>::cast_from(p[i]);
    }
    packed
}

/// `acc += p . tile` for the `16 x STREAM` matrix `p` (packed A fragments, see [`pack`]) and a
/// `STREAM x head_dim` tile.
#[cube]
pub(crate) fn accumulate_p_times_tile<F: Float, N: Size>(
    packed: &Array<Pair<F>>,
    tile: &SharedMemory<Vector<F, N>>,
    base: usize,
    acc: &mut Array<Pair<f32>>,
    lane: usize,
    #[comptime] head_dim: usize,
) {
    let chunks = comptime!(head_dim / CHUNK);
    let b_offset = block_lane_offset(lane, chunks, true);
    #[unroll]
    for kc in 0..comptime!(STREAM / 16) {
        #[unroll]
        for pair in 0..comptime!(head_dim / 16) {
            let b = load_block::<F, N>(
                tile,
                base + comptime!(16 * kc * chunks),
                b_offset,
                comptime!(2 * pair),
                true,
            );
            mma_step::<F>(packed, 4 * kc, &b, 0, acc, 4 * pair);
            mma_step::<F>(packed, 4 * kc, &b, 2, acc, 4 * pair + 2);
        }
    }
}

/// Writes a warp's `16 x head_dim` accumulator times `scale` (rows past `total_rows` skipped).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_strip<F: Float>(
    acc: &Array<Pair<f32>>,
    scale_lo: f32,
    scale_hi: f32,
    out: &mut Tensor<F>,
    head_offset: usize,
    row_lo: usize,
    total_rows: usize,
    lane: usize,
    #[comptime] head_dim: usize,
) {
    let row_stride = out.stride(2);
    let column = 2 * (lane % 4);
    #[unroll]
    for n in 0..comptime!(head_dim / 8) {
        #[unroll]
        for half in 0..2usize {
            let row = row_lo + 8 * half;
            let mut scale = scale_lo;
            if half == 1 {
                scale = scale_hi;
            }
            if row < total_rows {
                let at = head_offset + row * row_stride + 8 * n + column;
                let value = acc[2 * n + half];
                out[at] = F::cast_from(value[0] * scale);
                out[at + 1] = F::cast_from(value[1] * scale);
            }
        }
    }
}

/// Sum over the four lanes that share a row of an accumulator fragment.
#[cube]
pub(crate) fn quad_sum(value: f32) -> f32 {
    let pairs = value + plane_shuffle_xor(value, 1);
    pairs + plane_shuffle_xor(pairs, 2)
}

/// Max over the four lanes that share a row of an accumulator fragment.
#[cube]
pub(crate) fn quad_max(value: f32) -> f32 {
    let pairs = max(value, plane_shuffle_xor(value, 1));
    max(pairs, plane_shuffle_xor(pairs, 2))
}
