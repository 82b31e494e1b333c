//! FlashAttention-2 style kernels on CubeCL: the forward with online softmax returns the output
//! and the `logsumexp` of each query; the backward recomputes the probabilities tile by tile from
//! the saved `logsumexp`. No `S x S` buffer exists anywhere: memory is O(S) per head.
//!
//! These are plain tiled kernels (f32 arithmetic in shared memory, any float storage type), the
//! correctness baseline that runs on every CubeCL runtime including wgpu's.

mod backward;
mod forward;
pub(crate) mod mma;

use std::sync::atomic::{AtomicU8, Ordering};

use burn::tensor::DType;
use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::AttentionOptions;

pub(crate) use backward::backward;
pub(crate) use forward::forward;
pub use mma::supports as tensor_core_supported;

/// Which attention kernels (forward and backward) the CubeCL backends run. Each choice falls
/// back to the next where it does not apply: cuDNN (CUDA, 16-bit, plain causal masks, the library
/// present), then the tensor-core kernels (16-bit inputs, head dim 64 or 128, a CUDA device with
/// `mma.sync m16n8k16` and `ldmatrix`), then the plain ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashKernel {
    /// The plain tiled kernel (f32 arithmetic), the reference implementation.
    Plain,
    /// Register-level tensor-core matmuls (`mma.sync`), f32 softmax and accumulation.
    TensorCore,
    /// cuDNN's fused flash attention (see `attention::cudnn`).
    Cudnn,
}

/// 0: not chosen yet (read `LEMO_FLASH_KERNEL` on first use), else `FlashKernel as u8 + 1`.
static FLASH_KERNEL: AtomicU8 = AtomicU8::new(0);

/// Chooses the attention kernels for the whole process (default: the `LEMO_FLASH_KERNEL`
/// environment variable, `plain`, `tensor-core` or `cudnn`, else cuDNN wherever it applies).
pub fn set_flash_kernel(kernel: FlashKernel) {
    FLASH_KERNEL.store(kernel as u8 + 1, Ordering::Relaxed);
}

pub fn flash_kernel() -> FlashKernel {
    match FLASH_KERNEL.load(Ordering::Relaxed) {
        1 => FlashKernel::Plain,
        2 => FlashKernel::TensorCore,
        3 => FlashKernel::Cudnn,
        _ => {
            let kernel = match std::env::var("LEMO_FLASH_KERNEL").as_deref() {
                Ok("plain") => FlashKernel::Plain,
                Ok("tensor-core") => FlashKernel::TensorCore,
                _ => FlashKernel::Cudnn,
            };
            set_flash_kernel(kernel);
            kernel
        }
    }
}

/// Score of a hidden (masked) query/key pair. Finite because WGSL has no `-inf` literal; far
/// below any real score, and every consumer checks for it before exponentiating.
pub(crate) const HIDDEN: f32 = -1.0e30;

/// Mask parameters as the kernels receive them (0 means "off").
#[derive(Clone, Copy, Debug)]
pub(crate) struct MaskParams {
    pub window: u32,
    pub group: u32,
}

impl MaskParams {
    pub fn new(options: &AttentionOptions) -> Self {
        Self {
            window: options.sliding_window.unwrap_or(0) as u32,
            group: options.shifted_group.unwrap_or(0) as u32,
        }
    }
}

/// Shift of the S2 groups of query `head` (see [`AttentionOptions::shifted_group`]).
#[cube]
pub(crate) fn group_shift(head: u32, q_heads: u32, group: u32) -> u32 {
    let mut shift = 0u32;
    if group > 0 && head >= q_heads / 2 {
        shift = group / 2;
    }
    shift
}

/// Whether the query at absolute position `query_pos` sees the key at `key_pos`.
#[cube]
#[allow(clippy::manual_checked_ops, reason = "cube code has no checked_div")]
pub(crate) fn is_visible(
    query_pos: u32,
    key_pos: u32,
    window: u32,
    group: u32,
    shift: u32,
) -> bool {
    let mut visible = key_pos <= query_pos;
    if window > 0 {
        visible = visible && query_pos < key_pos + window;
    }
    if group > 0 {
        visible = visible && (query_pos + shift) / group == (key_pos + shift) / group;
    }
    visible
}

/// First key position the query at `query_pos` sees (non-decreasing in `query_pos`).
#[cube]
#[allow(clippy::manual_checked_ops, reason = "cube code has no checked_div")]
pub(crate) fn first_visible_key(query_pos: u32, window: u32, group: u32, shift: u32) -> u32 {
    let mut first = 0u32;
    if window > 0 && query_pos >= window {
        first = query_pos + 1 - window;
    }
    if group > 0 {
        let shifted_start = (query_pos + shift) / group * group;
        if shifted_start > shift {
            first = max(first, shifted_start - shift);
        }
    }
    first
}

/// Last query position (at most `max_pos`) that sees the key at `key_pos`
/// (non-decreasing in `key_pos`).
#[cube]
#[allow(clippy::manual_checked_ops, reason = "cube code has no checked_div")]
pub(crate) fn last_visible_query(
    key_pos: u32,
    max_pos: u32,
    window: u32,
    group: u32,
    shift: u32,
) -> u32 {
    let mut last = max_pos;
    if window > 0 {
        last = min(last, key_pos + window - 1);
    }
    if group > 0 {
        let shifted_end = ((key_pos + shift) / group + 1) * group;
        last = min(last, shifted_end - shift - 1);
    }
    last
}

/// Copies rows `first_row..first_row + rows` (zeros past `total_rows`) of one head of a
/// `[.., rows, head_dim]` tensor into a shared tile of row pitch `head_dim + 1` (the padding
/// keeps lanes that read different rows of one column on different banks), as f32.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_rows<F: Float>(
    source: &Tensor<F>,
    head_offset: usize,
    first_row: usize,
    total_rows: usize,
    tile: &mut SharedMemory<f32>,
    thread: usize,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] threads: usize,
) {
    let row_stride = source.stride(2);
    let dim_stride = source.stride(3);
    let elements = comptime!(rows * head_dim);
    for step in 0..comptime!(elements.div_ceil(threads)) {
        let element = thread + step * threads;
        if element < elements {
            let row = element / head_dim;
            let dim = element % head_dim;
            let source_row = first_row + row;
            let mut value = 0.0f32;
            if source_row < total_rows {
                value = f32::cast_from(
                    source[head_offset + source_row * row_stride + dim * dim_stride],
                );
            }
            tile[row * comptime!(head_dim + 1) + dim] = value;
        }
    }
}

/// Dot product of row `a_row` of tile `a` with row `b_row` of tile `b` (pitch `head_dim + 1`).
#[cube]
pub(crate) fn tile_dot(
    a: &SharedMemory<f32>,
    a_row: usize,
    b: &SharedMemory<f32>,
    b_row: usize,
    #[comptime] head_dim: usize,
) -> f32 {
    let a_start = a_row * comptime!(head_dim + 1);
    let b_start = b_row * comptime!(head_dim + 1);
    let mut dot = 0.0f32;
    for dim in 0..head_dim {
        dot += a[a_start + dim] * b[b_start + dim];
    }
    dot
}

/// Tile shape shared by the three attention kernels: square `block x block` score tiles, each
/// row handled by `lanes` threads that split the score columns and the head dimensions.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileShape {
    pub block: usize,
    pub lanes: usize,
}

impl TileShape {
    /// The largest square tile whose shared memory (`f32` words as a function of the block)
    /// fits the device, with up to 8 lanes per row.
    pub fn choose<R: CubeRuntime>(
        client: &ComputeClient<R>,
        head_dim: usize,
        shared_words: impl Fn(usize) -> usize,
    ) -> Self {
        let hardware = &client.properties().hardware;
        let lanes = [8, 4, 2, 1]
            .into_iter()
            .find(|lanes| head_dim.is_multiple_of(*lanes))
            .unwrap_or(1);
        let max_threads = (hardware.max_units_per_cube as usize).min(256);
        let block = [64, 32, 16, 8]
            .into_iter()
            .find(|block| {
                block * lanes <= max_threads
                    && shared_words(*block) * 4 <= hardware.max_shared_memory_size
            })
            .expect("no attention tile fits the device's shared memory");
        Self { block, lanes }
    }

    pub fn cube_dim(&self) -> CubeDim {
        CubeDim::new_2d(self.lanes as u32, self.block as u32)
    }
}

/// Words of one padded `block x head_dim` tile.
pub(crate) fn rows_words(block: usize, head_dim: usize) -> usize {
    block * (head_dim + 1)
}

pub(crate) fn check_inputs<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
) -> [usize; 6] {
    let [batch, q_heads, q_len, head_dim] = q.meta.shape().dims();
    let [k_batch, kv_heads, kv_len, k_dim] = k.meta.shape().dims();
    assert_eq!(k.meta.shape(), v.meta.shape(), "k and v shapes differ");
    assert_eq!(batch, k_batch, "q and k batch sizes differ");
    assert_eq!(head_dim, k_dim, "q and k head dims differ");
    assert!(
        kv_heads > 0 && q_heads.is_multiple_of(kv_heads),
        "q heads must be a multiple of kv heads"
    );
    assert!(
        q_len <= kv_len,
        "queries must be the last positions of the keys"
    );
    assert!(
        q.dtype == k.dtype && k.dtype == v.dtype,
        "q, k, v dtypes differ"
    );
    [batch, q_heads, kv_heads, q_len, kv_len, head_dim]
}

pub(crate) fn empty_like<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: impl Into<Shape>,
    dtype: DType,
) -> CubeTensor<R> {
    empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        shape.into(),
        dtype,
    )
}
