//! Matrix products of the training shapes (activations against frozen weights, forward and
//! both backward forms) with autodiff.
//!
//! On CUDA, bf16/f16/f32 products go to cuBLASLt (see `cublaslt`), with f32 accumulation for
//! bf16/f16 and full f32 arithmetic for f32 (Burn's own f32 matmul runs on TF32 tensor cores,
//! about 3e-4 relative error). Every other backend and dtype uses Burn's matmul, which is also
//! the reference the parity tests compare with.

pub(crate) mod autodiff;
pub mod backend;
#[cfg(feature = "cuda")]
pub(crate) mod cublaslt;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorMetadata, TensorPrimitive};

use crate::ComputeBackend;

/// `lhs [.., M, K] x rhs [.., K, N] -> [.., M, N]`. The batch dimensions must be equal, or those
/// of one side all 1 (a weight shared by the batch: then the product is one tall GEMM).
/// Transposed views (`swap_dims` of the last two) are read in place.
pub fn matmul<B: ComputeBackend, const D: usize>(
    lhs: Tensor<B, D>,
    rhs: Tensor<B, D>,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_matmul(
        lhs.into_primitive().tensor(),
        rhs.into_primitive().tensor(),
    )))
}

/// `alpha * lhs x rhs` for operands of one dtype, accumulated in f32 and written in
/// `out_dtype` (one cuBLASLt product on CUDA); not differentiable. See
/// [`crate::GemmBackend::lemo_matmul_scaled`].
pub fn matmul_scaled<B: ComputeBackend, const D: usize>(
    lhs: Tensor<B, D>,
    rhs: Tensor<B, D>,
    alpha: f32,
    out_dtype: DType,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_matmul_scaled(
        lhs.into_primitive().tensor(),
        rhs.into_primitive().tensor(),
        alpha,
        out_dtype,
    )))
}

/// The plain Burn product the kernels are checked against.
pub fn reference<B: burn::tensor::backend::Backend, const D: usize>(
    lhs: Tensor<B, D>,
    rhs: Tensor<B, D>,
) -> Tensor<B, D> {
    lhs.matmul(rhs)
}

/// `alpha * lhs x rhs` for `lhs` and `rhs` of one dtype, accumulated in f32 and written in
/// `out_dtype`, in Burn operations (operands widened to f32, product, scale, cast): the default
/// of [`crate::GemmBackend::lemo_matmul_scaled`], which CUDA runs as one cuBLASLt product whose
/// epilogue scales and converts. What the adapters' products are made of: each reads its large
/// operand (activations, output gradients) as stored, in one pass.
pub fn matmul_scaled_reference<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    alpha: f32,
    out_dtype: DType,
) -> FloatTensor<B> {
    let widen = |t: FloatTensor<B>| match t.dtype() {
        DType::F32 | DType::F64 => t,
        _ => B::float_cast(t, DType::F32.into()),
    };
    let product = B::float_matmul(widen(lhs), widen(rhs));
    let scaled = if alpha == 1.0 {
        product
    } else {
        B::float_mul_scalar(product, alpha.into())
    };
    if scaled.dtype() == out_dtype {
        scaled
    } else {
        B::float_cast(scaled, out_dtype.into())
    }
}

/// `onto + alpha * lhs x rhs` in `onto`'s dtype, summed in f32 before one rounding, in Burn
/// operations: the default of [`crate::GemmBackend::lemo_matmul_onto`], which CUDA runs as one
/// cuBLASLt product that adds `onto` in its epilogue.
pub fn matmul_onto_reference<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    alpha: f32,
    onto: FloatTensor<B>,
) -> FloatTensor<B> {
    let dtype = onto.dtype();
    let product = matmul_scaled_reference::<B>(lhs, rhs, alpha, DType::F32);
    let onto = match dtype {
        DType::F32 => onto,
        _ => B::float_cast(onto, DType::F32.into()),
    };
    let sum = B::float_add(onto, product);
    match dtype {
        DType::F32 => sum,
        _ => B::float_cast(sum, dtype.into()),
    }
}
