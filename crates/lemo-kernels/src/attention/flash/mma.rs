//! FlashAttention-2 on the tensor cores of CUDA devices (sm_80 and later), for bf16/f16 inputs
//! with head dims 64 and 128: register-level `mma.sync m16n8k16` (16-bit inputs, f32
//! accumulation) fed by `ldmatrix` from XOR-swizzled shared tiles.
//!
//! Every cube has `WARPS` warps and each warp owns a strip of 16 rows (queries in the forward and
//! the dQ kernel, keys in the dK/dV kernel). A strip's scores against a 64-row tile live in
//! registers as f32 accumulator fragments; after the softmax they are re-packed in place as the
//! 16-bit A fragments of the next product (two m16n8 accumulators are exactly one m16k16 A
//! fragment), so probabilities never touch shared memory. Softmax statistics, the output and
//! gradient accumulators are f32. Same semantics and outputs as the plain kernels.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cmma::MmaDefinition;
use cubecl::ir::features::MmaConfig;
use cubecl::ir::{FastMath, MatrixIdent};
use cubecl::prelude::barrier::{Barrier, copy_async_checked};
use cubecl::prelude::*;

use super::{HIDDEN, MaskParams, first_visible_key, group_shift, is_visible, last_visible_query};
use crate::attention::AttentionOptions;

pub(crate) const WARP: usize = 32;
/// Warps per cube, each owning a 16-row strip.
pub(crate) const WARPS: usize = 4;
/// Rows of one warp's strip (the mma M dimension).
pub(crate) const STRIP: usize = 16;
/// Rows of the cube's own tile.
pub(crate) const BLOCK: usize = WARPS * STRIP;
/// Rows of the tiles streamed past the strips (keys in the forward and dQ, queries in dK/dV).
pub(crate) const STREAM: usize = 64;
/// 16-bit elements per 16-byte vector: the unit of global loads and of `ldmatrix` rows.
pub(crate) const CHUNK: usize = 8;

/// Two 16-bit inputs or two f32 accumulators: one register of an mma fragment.
pub(crate) type Pair<E> = Vector<E, Const<2>>;

/// Whether the tensor-core kernels can run inputs of `dtype` and `head_dim` on this device.
pub fn supports<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType, head_dim: usize) -> bool {
    let hardware = &client.properties().hardware;
    let mma = MmaConfig {
        a_type: dtype.into(),
        b_type: dtype.into(),
        cd_type: DType::F32.into(),
        m: 16,
        n: 8,
        k: 16,
    };
    let features = &client.features().matmul;
    matches!(dtype, DType::BF16 | DType::F16)
        && matches!(head_dim, 64 | 128)
        && hardware.plane_size_min == WARP as u32
        && hardware.plane_size_max == WARP as u32
        && shared_bytes(head_dim, dtype.size()) <= hardware.max_shared_memory_size
        && features.mma.contains(&mma)
        && features.ldmatrix.contains(&dtype.into())
}

/// Shared memory of the largest kernel (dK/dV: K and V tiles, two stages of Q and dO tiles and
/// of their f32 `lse`/`delta` rows, two barriers).
fn shared_bytes(head_dim: usize, elem_size: usize) -> usize {
    (2 * BLOCK + 4 * STREAM) * head_dim * elem_size + 4 * STREAM * 4 + 2 * 8
}

/// Position of 16-byte chunk `chunk` of `row` in a tile of `chunks` chunks per row. The XOR
/// swizzle puts the 8 rows one `ldmatrix` reads at the same column in 8 different bank groups.
#[cube]
fn swizzle(row: usize, chunk: usize, #[comptime] chunks: usize) -> usize {
    row * chunks + (chunk ^ (row % 8))
}

/// Where one batch entry's rows of a `[batch, heads, rows, ..]` input lie (strides in
/// elements). Read from the tensor's metadata once per kernel: that metadata lives in global
/// memory, and the compiler reloads it after every asynchronous copy.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct Rows {
    start: usize,
    head_stride: usize,
    row_stride: usize,
    len: usize,
}

/// The [`Rows`] of batch entry `batch` of `tensor`.
#[cube]
pub(crate) fn rows_of<E: CubePrimitive>(tensor: &Tensor<E>, batch: usize) -> Rows {
    Rows {
        start: batch * tensor.stride(0),
        head_stride: tensor.stride(1),
        row_stride: tensor.stride(2),
        len: tensor.shape(2),
    }
}

/// Copies rows `first_row..first_row + rows` (zeros past the end) of head `head` into a
/// swizzled shared tile, 16 bytes per thread and step.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_tile<F: Float, N: Size>(
    source: &Tensor<Vector<F, N>>,
    layout: &Rows,
    head: usize,
    first_row: usize,
    tile: &mut SharedMemory<Vector<F, N>>,
    thread: usize,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
) {
    let chunks = comptime!(head_dim / CHUNK);
    let threads = comptime!(WARPS * WARP);
    let head_offset = layout.start + head * layout.head_stride;
    #[unroll]
    for step in 0..comptime!(rows * chunks / threads) {
        let element = thread + step * threads;
        let row = element / chunks;
        let chunk = element % chunks;
        let source_row = first_row + row;
        let mut value = Vector::<F, N>::new(F::new(0.0));
        if source_row < layout.len {
            value = source[(head_offset + source_row * layout.row_stride) / CHUNK + chunk];
        }
        tile[swizzle(row, chunk, chunks)] = value;
    }
}

/// Starts asynchronous copies (`cp.async`, 16 bytes per thread and pass) of rows
/// `first_row..first_row + STREAM` (zero-filled past the end) of head `head` into the swizzled
/// tile at vector `base` of `tiles`. A barrier's `commit_copy_async` then tracks them.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn prefetch_tile<F: Float, N: Size>(
    source: &Tensor<Vector<F, N>>,
    layout: &Rows,
    head: usize,
    first_row: usize,
    tiles: &mut SharedMemory<Vector<F, N>>,
    base: usize,
    thread: usize,
    #[comptime] head_dim: usize,
) {
    let chunks = comptime!(head_dim / CHUNK);
    // Each pass copies `pass_rows` whole rows; a multiple of 8 rows, so a thread's chunk keeps
    // its swizzled column and each pass only moves the addresses by constant strides.
    let pass_rows = comptime!(WARPS * WARP / chunks);
    let row = thread / chunks;
    let chunk = thread % chunks;
    let head_vector = (layout.start + head * layout.head_stride) / CHUNK;
    let pass_stride = pass_rows * layout.row_stride / CHUNK;
    let mut source_vector = head_vector + (first_row + row) * layout.row_stride / CHUNK + chunk;
    let destination = base + swizzle(row, chunk, chunks);
    #[unroll]
    for pass in 0..comptime!(STREAM / pass_rows) {
        // Rows past the end copy nothing from a valid address and are zero-filled.
        let mut start = head_vector;
        let mut length = 0usize;
        if first_row + row + pass * pass_rows < layout.len {
            start = source_vector;
            length = 1;
        }
        let to = destination + pass * comptime!(pass_rows * chunks);
        copy_async_checked(
            &source.slice(start, start + length),
            &mut tiles.slice_mut(to, to + 1),
            CHUNK as u32,
        );
        source_vector += pass_stride;
    }
}

/// Starts copying stage `stage` of the forward's and dQ kernel's stream: the K and V tiles of
/// K/V head `kv_head` from key `key_start`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn prefetch_key_step<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    k_rows: &Rows,
    v_rows: &Rows,
    kv_head: usize,
    key_start: usize,
    k_tiles: &mut SharedMemory<Vector<F, N>>,
    v_tiles: &mut SharedMemory<Vector<F, N>>,
    stage: usize,
    thread: usize,
    #[comptime] head_dim: usize,
) {
    let base = stage * comptime!(STREAM * head_dim / CHUNK);
    prefetch_tile::<F, N>(
        k, k_rows, kv_head, key_start, k_tiles, base, thread, head_dim,
    );
    prefetch_tile::<F, N>(
        v, v_rows, kv_head, key_start, v_tiles, base, thread, head_dim,
    );
}

/// One step of the forward's and dQ kernel's K/V stream: starts copying the next key tile (if
/// any) into the other stage, waits until this tile's stage has landed, and returns the stage's
/// vector offset in `k_tiles`/`v_tiles`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn advance_key_stream<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    k_rows: &Rows,
    v_rows: &Rows,
    kv_head: usize,
    key_tile: usize,
    first_key_tile: usize,
    end_key_tile: usize,
    k_tiles: &mut SharedMemory<Vector<F, N>>,
    v_tiles: &mut SharedMemory<Vector<F, N>>,
    ready_0: &Shared<Barrier>,
    ready_1: &Shared<Barrier>,
    thread: usize,
    #[comptime] head_dim: usize,
) -> usize {
    let stage = (key_tile - first_key_tile) % 2;
    if key_tile + 1 < end_key_tile {
        prefetch_key_step::<F, N>(
            k,
            v,
            k_rows,
            v_rows,
            kv_head,
            (key_tile + 1) * STREAM,
            k_tiles,
            v_tiles,
            1 - stage,
            thread,
            head_dim,
        );
        commit_stage(1 - stage, ready_0, ready_1);
    }
    wait_stage(stage, ready_0, ready_1);
    stage * comptime!(STREAM * head_dim / CHUNK)
}

/// Makes the barrier of `stage` track this thread's pending `cp.async` copies.
#[cube]
pub(crate) fn commit_stage(stage: usize, ready_0: &Shared<Barrier>, ready_1: &Shared<Barrier>) {
    if stage == 0 {
        ready_0.commit_copy_async();
    } else {
        ready_1.commit_copy_async();
    }
}

/// Waits until the copies of `stage` have landed and every thread has arrived.
#[cube]
pub(crate) fn wait_stage(stage: usize, ready_0: &Shared<Barrier>, ready_1: &Shared<Barrier>) {
    if stage == 0 {
        ready_0.arrive_and_wait();
    } else {
        ready_1.arrive_and_wait();
    }
}

/// Starts asynchronous copies (4 bytes per thread, zero-filled past the end) of the `STREAM`
/// values of rows `first..first + STREAM` of head `head` of `lse` (threads `0..STREAM`) and
/// `delta` (the next `STREAM` threads) to `lse_tiles[base..]` and `delta_tiles[base..]`.
/// Asynchronous like the tiles, so that no warp waits on global memory in the middle of a step.
#[cube]
#[allow(clippy::too_many_arguments)]
fn prefetch_row_stats(
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    lse_rows: &Rows,
    delta_rows: &Rows,
    head: usize,
    first: usize,
    lse_tiles: &mut SharedMemory<f32>,
    delta_tiles: &mut SharedMemory<f32>,
    base: usize,
    thread: usize,
) {
    let row = thread % STREAM;
    if thread < STREAM {
        prefetch_row_stat(lse, lse_rows, head, first + row, lse_tiles, base + row);
    } else {
        prefetch_row_stat(
            delta,
            delta_rows,
            head,
            first + row,
            delta_tiles,
            base + row,
        );
    }
}

/// Starts the asynchronous copy of row `row`'s value of head `head` of `values` (`lse` or
/// `delta`) to `tiles[slot]`; zero-filled past the last row.
#[cube]
fn prefetch_row_stat(
    values: &Tensor<f32>,
    rows: &Rows,
    head: usize,
    row: usize,
    tiles: &mut SharedMemory<f32>,
    slot: usize,
) {
    let head_start = rows.start + head * rows.head_stride;
    let mut start = head_start;
    let mut length = 0usize;
    if row < rows.len {
        start = head_start + row * rows.row_stride;
        length = 1;
    }
    copy_async_checked(
        &values.slice(start, start + length),
        &mut tiles.slice_mut(slot, slot + 1),
        1u32,
    );
}

/// Starts loading stage `stage` of the dK/dV kernel's stream: the Q and dO tiles of query head
/// `head` from query `query_start` and their `lse` and `delta` rows.
#[cube]
#[allow(clippy::too_many_arguments)]
fn prefetch_query_step<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    grad_out: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    q_rows: &Rows,
    grad_out_rows: &Rows,
    lse_rows: &Rows,
    delta_rows: &Rows,
    head: usize,
    query_start: usize,
    q_tiles: &mut SharedMemory<Vector<F, N>>,
    grad_out_tiles: &mut SharedMemory<Vector<F, N>>,
    lse_tiles: &mut SharedMemory<f32>,
    delta_tiles: &mut SharedMemory<f32>,
    stage: usize,
    thread: usize,
    #[comptime] head_dim: usize,
) {
    let base = stage * comptime!(STREAM * head_dim / CHUNK);
    prefetch_tile::<F, N>(
        q,
        q_rows,
        head,
        query_start,
        q_tiles,
        base,
        thread,
        head_dim,
    );
    prefetch_tile::<F, N>(
        grad_out,
        grad_out_rows,
        head,
        query_start,
        grad_out_tiles,
        base,
        thread,
        head_dim,
    );
    prefetch_row_stats(
        lse,
        delta,
        lse_rows,
        delta_rows,
        head,
        query_start,
        lse_tiles,
        delta_tiles,
        stage * STREAM,
        thread,
    );
}

/// This lane's `ldmatrix.x4` row address, in vectors from the start of any 16 x 16 block at
/// chunk 0 of a swizzled tile with `chunks` chunks per row. Lane `l` addresses row `l % 8` of
/// 8x8 matrix `l / 8`; `rows_first` orders the four matrices rows-then-chunks (the A fragment of
/// a row-major `[m][k]` block, or with `transpose` the B fragments of two n8 tiles of a row-major
/// `[k][n]` block) instead of chunks-then-rows (the B fragments of two n8 tiles of a row-major
/// `[n][k]` block).
#[cube]
fn block_lane_offset(
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
fn load_block<F: Float, N: Size>(
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
fn mma_step<F: Float>(
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
fn pack<F: Float>(p: &Array<Pair<f32>>) -> Array<Pair<F>> {
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
fn accumulate_p_times_tile<F: Float, N: Size>(
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
fn store_strip<F: Float>(
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
fn quad_sum(value: f32) -> f32 {
    let pairs = value + plane_shuffle_xor(value, 1);
    pairs + plane_shuffle_xor(pairs, 2)
}

/// Max over the four lanes that share a row of an accumulator fragment.
#[cube]
fn quad_max(value: f32) -> f32 {
    let pairs = max(value, plane_shuffle_xor(value, 1));
    max(pairs, plane_shuffle_xor(pairs, 2))
}

/// Where a query-tile cube (forward, dQ) works: one cube per (query tile, query head, batch),
/// the heaviest causal tiles first, and the range of K/V tiles its queries can see.
#[derive(CubeType, Clone, Copy)]
struct QueryTile {
    batch: usize,
    head: usize,
    kv_head: usize,
    q_len: usize,
    kv_len: usize,
    /// Position of query row 0 (the keys before it are a cached prefix).
    offset: usize,
    /// S2 shift of this head.
    shift: u32,
    /// First query row of the tile.
    start: usize,
    /// This lane's first row (its second is 8 below).
    row_lo: usize,
    /// Position of the warp's first row.
    warp_first_pos: usize,
    first_key_tile: usize,
    end_key_tile: usize,
}

#[cube]
fn query_tile_of<E: CubePrimitive>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    warp: usize,
    lane: usize,
    window: u32,
    group: u32,
) -> QueryTile {
    let head = CUBE_POS_Y as usize;
    let q_heads = q.shape(1);
    let q_len = q.shape(2);
    let kv_len = k.shape(2);
    let offset = kv_len - q_len;
    let shift = group_shift(head as u32, q_heads as u32, group);
    let start = (q_len.div_ceil(BLOCK) - 1 - CUBE_POS_X as usize) * BLOCK;
    let first_pos = (offset + start) as u32;
    let last_pos = (offset + min(start + BLOCK, q_len) - 1) as u32;
    QueryTile {
        batch: CUBE_POS_Z as usize,
        head,
        kv_head: head / (q_heads / k.shape(1)),
        q_len,
        kv_len,
        offset,
        shift,
        start,
        row_lo: start + warp * STRIP + lane / 4,
        warp_first_pos: offset + start + warp * STRIP,
        first_key_tile: first_visible_key(first_pos, window, group, shift) as usize / STREAM,
        end_key_tile: last_pos as usize / STREAM + 1,
    }
}

/// Whether some score of the warp's strip against the K/V tile at `key_start` may be hidden
/// (causal diagonal, past the keys' end, window or S2 groups): only those tiles pay for masks.
#[cube]
fn needs_mask(tile: &QueryTile, key_start: usize, window: u32, group: u32) -> bool {
    key_start + STREAM > tile.warp_first_pos + 1
        || key_start + STREAM > tile.kv_len
        || window > 0
        || group > 0
}

/// Forward: one cube per (query tile, query head, batch), the heaviest causal tiles first.
/// Streams the visible K/V tiles; online softmax in registers.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
#[allow(
    clippy::manual_is_multiple_of,
    reason = "cube code has no is_multiple_of"
)]
fn flash_forward_mma_kernel<F: Float, N: Size>(
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

/// Probabilities `exp(scores * scale - lse)` in place, `lse` per row (the strip's rows are
/// queries: dQ kernel).
#[cube]
fn row_probabilities(scores: &mut Array<Pair<f32>>, lse_lo: f32, lse_hi: f32, scale: f32) {
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
fn column_pair(stats: &SharedMemory<f32>, stats_base: usize, n: usize, lane: usize) -> Pair<f32> {
    let column = stats_base + 8 * n + 2 * (lane % 4);
    let mut pair = Pair::<f32>::new(0.0);
    pair[0] = stats[column];
    pair[1] = stats[column + 1];
    pair
}

/// Probabilities `exp(scores * scale - lse)` in place, `lse` per column (the strip's rows are
/// keys and its columns queries: dK/dV kernel).
#[cube]
fn column_probabilities(
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
fn hide_invisible(
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
fn row_score_gradients(
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
fn column_score_gradients(
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
fn flash_backward_kv_mma_kernel<F: Float, N: Size>(
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
fn flash_backward_q_mma_kernel<F: Float, N: Size>(
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

pub(crate) fn cube_dim() -> CubeDim {
    CubeDim::new_2d(WARP as u32, WARPS as u32)
}

/// The kernels read 16-byte vectors along the head dim: make every input dense there, with
/// row and head strides that keep the vectors aligned.
pub(crate) fn vector_ready<R: CubeRuntime>(tensor: CubeTensor<R>) -> CubeTensor<R> {
    let strides = tensor.meta.strides();
    let aligned = strides[3] == 1 && strides[..3].iter().all(|s| s % CHUNK == 0);
    if aligned {
        tensor
    } else {
        into_contiguous(tensor)
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
