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

mod backward;
mod forward;
mod fragments;
mod tiles;

pub(crate) use backward::{BackwardTensors, launch_backward};
pub(crate) use forward::launch_forward;
pub(crate) use fragments::{strip_times_tile_t, zeros};
pub(crate) use tiles::{Rows, commit_stage, prefetch_tile, rows_of, wait_stage};

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::features::MmaConfig;
use cubecl::prelude::*;

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
