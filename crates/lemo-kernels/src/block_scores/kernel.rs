use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor as BurnTensor, TensorPrimitive};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use crate::attention::flash::{TileShape, empty_like, load_rows, rows_words, tile_dot};

/// One cube per (key tile, query tile, batch) of `tile x tile` pairs, `lanes` threads per query
/// row; each thread keeps the head sums of `tile / lanes` pairs in registers. The queries are
/// the last rows of the keys (query row `i` is position `keys - queries + i`).
#[cube(launch)]
fn block_scores_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    tile_max: &mut Tensor<f32>,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] lanes: usize,
    #[define(F)] _dtype: StorageType,
) {
    let threads = comptime!(tile * lanes);
    let lane = UNIT_POS_X as usize;
    let row = UNIT_POS_Y as usize;
    let thread = row * lanes + lane;
    let key_tile = CUBE_POS_X as usize;
    let query_tile = CUBE_POS_Y as usize;
    let batch = CUBE_POS_Z as usize;
    let queries = q.shape(2);
    let keys = k.shape(2);
    let offset = keys - queries;
    let q_heads = q.shape(1);
    let heads_per_kv = q_heads / k.shape(1);
    let out_index = batch * tile_max.stride(0)
        + query_tile * tile_max.stride(1)
        + key_tile * tile_max.stride(2);

    let q_start = query_tile * tile;
    let key_start = key_tile * tile;
    // Above the diagonal or past the end: no visible pair.
    if q_start >= queries || key_start >= offset + q_start + tile {
        if thread == 0 {
            tile_max[out_index] = 0.0;
        }
        terminate!();
    }

    let mut q_tile = SharedMemory::<f32>::new(comptime!(rows_words(tile, head_dim)));
    let mut k_tile = SharedMemory::<f32>::new(comptime!(rows_words(tile, head_dim)));
    let mut thread_max = SharedMemory::<f32>::new(threads);
    let mut sums = Array::<f32>::new(comptime!(tile / lanes));
    for c in 0..comptime!(tile / lanes) {
        sums[c] = 0.0;
    }

    for head in 0..q_heads {
        let kv_head = head / heads_per_kv;
        let q_offset = batch * q.stride(0) + head * q.stride(1);
        let k_offset = batch * k.stride(0) + kv_head * k.stride(1);
        load_rows::<F>(
            q,
            q_offset,
            q_start,
            queries,
            &mut q_tile,
            thread,
            tile,
            head_dim,
            threads,
        );
        load_rows::<F>(
            k,
            k_offset,
            key_start,
            keys,
            &mut k_tile,
            thread,
            tile,
            head_dim,
            threads,
        );
        sync_cube();
        for c in 0..comptime!(tile / lanes) {
            let col = lane + c * lanes;
            let score = tile_dot(&q_tile, row, &k_tile, col, head_dim) * scale;
            sums[c] += max(score, 0.0);
        }
        sync_cube();
    }

    let query = q_start + row;
    let mut local_max = 0.0f32;
    for c in 0..comptime!(tile / lanes) {
        let key = key_start + lane + c * lanes;
        if query < queries && key <= offset + query {
            local_max = max(local_max, sums[c]);
        }
    }
    thread_max[thread] = local_max;
    sync_cube();
    if thread == 0 {
        let mut block_max = 0.0f32;
        for t in 0..threads {
            block_max = max(block_max, thread_max[t]);
        }
        tile_max[out_index] = block_max / f32::cast_from(q_heads);
    }
}

/// Block informativeness (see [`super::block_scores`]): the kernel computes the max over
/// `tile x tile` sub-blocks (tile = the largest of 32, 16, 8 dividing `block_size`), then a max
/// pool over `block_size / tile` sub-blocks per side gives the blocks. Output f32
/// `[batch, q_blocks, k_blocks]`. Work O(batch * q_heads * rows * keys * head_dim) for `rows`
/// queries over `keys` keys (half that with as many of each: the causal half of `Q K^T`);
/// memory O(rows * keys / tile^2) for the sub-block maxima, no score matrix.
pub(crate) fn block_scores<R, F, I, BT>(
    q: FloatTensor<CubeBackend<R, F, I, BT>>,
    k: FloatTensor<CubeBackend<R, F, I, BT>>,
    block_size: usize,
    scale: f32,
) -> FloatTensor<CubeBackend<R, F, I, BT>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [batch, q_heads, queries, head_dim] = q.meta.shape().dims();
    let [_, kv_heads, keys, _] = k.meta.shape().dims();
    super::query_offset(queries, keys, block_size);
    assert!(
        q_heads.is_multiple_of(kv_heads),
        "q heads must be a multiple of kv heads"
    );
    assert_eq!(q.dtype, k.dtype, "q and k dtypes differ");
    let tile_size = [32, 16, 8]
        .into_iter()
        .find(|tile| block_size.is_multiple_of(*tile))
        .unwrap_or_else(|| panic!("block size {block_size} is not a multiple of 8"));
    let lanes = TileShape::choose(&q.client, head_dim, |_| 0).lanes;

    let tiles_per_block = block_size / tile_size;
    let query_tiles = queries.div_ceil(block_size) * tiles_per_block;
    let key_tiles = keys.div_ceil(block_size) * tiles_per_block;
    let tile_max = empty_like(&q, [batch, query_tiles, key_tiles], DType::F32);
    let client = q.client.clone();
    let dtype = q.dtype;
    block_scores_kernel::launch::<R>(
        &client,
        CubeCount::Static(key_tiles as u32, query_tiles as u32, batch as u32),
        CubeDim::new_2d(lanes as u32, tile_size as u32),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        tile_max.clone().into_tensor_arg(),
        scale,
        head_dim,
        tile_size,
        lanes,
        dtype.into(),
    );

    pool_tile_maxima::<R, F, I, BT>(tile_max, tiles_per_block)
}

/// Block scores `[batch, q_blocks, k_blocks]` from tile maxima `[batch, q_tiles, k_tiles]`: the
/// max over each block's `tiles_per_block` tiles per side.
pub(crate) fn pool_tile_maxima<R, F, I, BT>(
    tile_max: FloatTensor<CubeBackend<R, F, I, BT>>,
    tiles_per_block: usize,
) -> FloatTensor<CubeBackend<R, F, I, BT>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let tile_max: BurnTensor<CubeBackend<R, F, I, BT>, 3> =
        BurnTensor::from_primitive(TensorPrimitive::Float(tile_max));
    if tiles_per_block == 1 {
        return tile_max.into_primitive().tensor();
    }
    let [batch, query_tiles, key_tiles] = tile_max.dims();
    let (query_blocks, key_blocks) = (query_tiles / tiles_per_block, key_tiles / tiles_per_block);
    tile_max
        .reshape([
            batch,
            query_blocks,
            tiles_per_block,
            key_blocks,
            tiles_per_block,
        ])
        .max_dim(4)
        .max_dim(2)
        .reshape([batch, query_blocks, key_blocks])
        .into_primitive()
        .tensor()
}
