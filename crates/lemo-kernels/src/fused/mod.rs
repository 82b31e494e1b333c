//! Fused element-wise kernels of a Llama layer, each with its backward: RMSNorm, rotate-half
//! RoPE at explicit positions, and SwiGLU; and the optimizer's AdamW update. Each sits next to
//! its plain Burn reference; CubeCL backends run the kernels (vectorized 16-byte accesses, f32
//! arithmetic in registers, one pass over the data), any other backend the reference. OPT's
//! LayerNorm is one op with its own backward too, on plain tensor ops everywhere (no kernel yet).

pub mod adamw;
pub mod backend;
pub mod layer_norm;
pub mod rms_norm;
pub mod rope;
pub mod swiglu;

pub use adamw::{AdamWStep, adamw_step};
pub use layer_norm::layer_norm;
pub use rms_norm::{NormSaves, rms_norm};
pub use rope::{rope, rope_tables};
pub use swiglu::swiglu;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, Tensor, TensorMetadata, TensorPrimitive};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::server::CubeCountSelection;

/// `[rows, hidden]` f32 view of `t` (every leading dimension is a row), with `t`'s shape and
/// dtype, which the row-wise ops' references and tensor-op paths give their results back in.
pub(crate) fn rows_f32<B: Backend>(t: FloatTensor<B>) -> (Tensor<B, 2>, Shape, DType) {
    let (shape, dtype) = (t.shape(), t.dtype());
    let hidden = shape[shape.num_dims() - 1];
    let rows = shape.num_elements() / hidden.max(1);
    let t = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::float_reshape(
        t,
        [rows, hidden].into(),
    )));
    (t.cast(DType::F32), shape, dtype)
}

/// f32 copy of a parameter vector.
pub(crate) fn vector_f32<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t)).cast(DType::F32)
}

/// The widest vector (at most 16 bytes) dividing `len` elements of `tensor`'s dtype.
pub(crate) fn vector_size<R: CubeRuntime>(tensor: &CubeTensor<R>, len: usize) -> usize {
    tensor
        .client
        .io_optimized_vector_sizes(tensor.dtype.size())
        .find(|size| len.is_multiple_of(*size))
        .unwrap_or(1)
}

/// A grid of at least `cubes` cubes within the device's per-axis limits (kernels check
/// `CUBE_POS` against their own bound).
pub(crate) fn cube_count<R: CubeRuntime>(client: &ComputeClient<R>, cubes: usize) -> CubeCount {
    CubeCountSelection::new(client, cubes as u32).cube_count()
}

/// Threads per cube of the one-thread-per-vector element-wise kernels.
pub(crate) const ELEMENTWISE_THREADS: usize = 256;

/// A contiguous tensor of `like`'s shape and dtype, uninitialized.
pub(crate) fn empty_like<R: CubeRuntime>(like: &CubeTensor<R>) -> CubeTensor<R> {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        like.meta.shape().clone(),
        like.dtype,
    )
}

/// Vector width and grid of an element-wise kernel over `elements` values of `like`'s dtype,
/// one thread per vector, [`ELEMENTWISE_THREADS`] threads per cube.
pub(crate) fn elementwise_grid<R: CubeRuntime>(
    like: &CubeTensor<R>,
    elements: usize,
) -> (usize, CubeCount) {
    let vector = vector_size(like, elements);
    let threads = elements / vector;
    (
        vector,
        cube_count(&like.client, threads.div_ceil(ELEMENTWISE_THREADS)),
    )
}
