//! Moving tiles into shared memory: swizzled layouts, synchronous and asynchronous (`cp.async`)
//! copies of Q/K/V/dO tiles and of the `lse` / `delta` rows, the two-stage barriers, and where a
//! query-tile cube works.

use cubecl::prelude::barrier::{Barrier, copy_async_checked};
use cubecl::prelude::*;

use crate::attention::flash::{first_visible_key, group_shift};

use super::*;

/// Position of 16-byte chunk `chunk` of `row` in a tile of `chunks` chunks per row. The XOR
/// swizzle puts the 8 rows one `ldmatrix` reads at the same column in 8 different bank groups.
#[cube]
pub(crate) fn swizzle(row: usize, chunk: usize, #[comptime] chunks: usize) -> usize {
    row * chunks + (chunk ^ (row % 8))
}

/// Where one batch entry's rows of a `[batch, heads, rows, ..]` input lie (strides in
/// elements). Read from the tensor's metadata once per kernel: that metadata lives in global
/// memory, and the compiler reloads it after every asynchronous copy.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct Rows {
    pub(crate) start: usize,
    pub(crate) head_stride: usize,
    pub(crate) row_stride: usize,
    pub(crate) len: usize,
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
pub(crate) fn load_tile<F: Float, N: Size>(
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
pub(crate) fn prefetch_key_step<F: Float, N: Size>(
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
pub(crate) fn advance_key_stream<F: Float, N: Size>(
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
pub(crate) fn prefetch_row_stats(
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
pub(crate) fn prefetch_row_stat(
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
pub(crate) fn prefetch_query_step<F: Float, N: Size>(
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

/// Where a query-tile cube (forward, dQ) works: one cube per (query tile, query head, batch),
/// the heaviest causal tiles first, and the range of K/V tiles its queries can see.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct QueryTile {
    pub(crate) batch: usize,
    pub(crate) head: usize,
    pub(crate) kv_head: usize,
    pub(crate) q_len: usize,
    pub(crate) kv_len: usize,
    /// Position of query row 0 (the keys before it are a cached prefix).
    pub(crate) offset: usize,
    /// S2 shift of this head.
    pub(crate) shift: u32,
    /// First query row of the tile.
    pub(crate) start: usize,
    /// This lane's first row (its second is 8 below).
    pub(crate) row_lo: usize,
    /// Position of the warp's first row.
    pub(crate) warp_first_pos: usize,
    pub(crate) first_key_tile: usize,
    pub(crate) end_key_tile: usize,
}

#[cube]
pub(crate) fn query_tile_of<E: CubePrimitive>(
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
pub(crate) fn needs_mask(tile: &QueryTile, key_start: usize, window: u32, group: u32) -> bool {
    key_start + STREAM > tile.warp_first_pos + 1
        || key_start + STREAM > tile.kv_len
        || window > 0
        || group > 0
}
