//! The GEMM family of backend operations: every default body is the plain Burn reference;
//! CubeCL backends use cuBLASLt on CUDA where it applies, and `Autodiff<B>` gives each
//! differentiable product its own backward pass.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::DType;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::ops::FloatTensorOps;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::ComputeBackend;
use crate::backend::CpuBackend;
use crate::{gemm, known_value, precision};

/// Matrix products: the projections, the LoRA adapters' products in their precision, and
/// products whose value is known ahead (see the module docs).
pub trait GemmBackend: Backend {
    /// `lhs [.., M, K] x rhs [.., K, N]`; see [`gemm::matmul`].
    fn lemo_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(lhs, rhs)
    }

    /// `alpha * lhs x rhs` for operands of one dtype, accumulated in f32 and written in
    /// `out_dtype`; see [`gemm::matmul_scaled_reference`]. Not differentiable: the adapters' own forward
    /// and backward passes are built from it.
    fn lemo_matmul_scaled(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        alpha: f32,
        out_dtype: DType,
    ) -> FloatTensor<Self> {
        gemm::matmul_scaled_reference::<Self>(lhs, rhs, alpha, out_dtype)
    }

    /// `onto + alpha * lhs x rhs` in `onto`'s dtype (`onto` of the product's shape), summed in
    /// f32; see [`gemm::matmul_onto_reference`]. Not differentiable, like
    /// [`Self::lemo_matmul_scaled`].
    fn lemo_matmul_onto(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        alpha: f32,
        onto: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        gemm::matmul_onto_reference::<Self>(lhs, rhs, alpha, onto)
    }

    /// `value`, the product `lhs x rhs` computed earlier; see [`known_value::matmul_with_value`].
    fn lemo_matmul_with_value(
        _lhs: FloatTensor<Self>,
        _rhs: FloatTensor<Self>,
        value: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        value
    }

    /// `value`, differentiated as `graph`; see [`known_value::with_value`].
    fn lemo_with_value(_graph: FloatTensor<Self>, value: FloatTensor<Self>) -> FloatTensor<Self> {
        value
    }

    /// `frozen + scale * (x A^T) B^T` (`frozen` itself when `whole`), with the backward pass
    /// of the whole projection when the frozen `weight` is given; see
    /// [`precision::lora_linear`].
    fn lemo_lora_linear(
        x: FloatTensor<Self>,
        frozen: FloatTensor<Self>,
        _weight: Option<FloatTensor<Self>>,
        whole: bool,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        precision::lora_linear_forward::<Self>(x, frozen, whole, a, b, scale).0
    }
}

impl GemmBackend for CpuBackend {}

impl<R, F, I, BT> GemmBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn lemo_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(out) = gemm::cublaslt::try_matmul(&lhs, &rhs) {
            return out;
        }
        Self::float_matmul(lhs, rhs)
    }

    fn lemo_matmul_scaled(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        alpha: f32,
        out_dtype: DType,
    ) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(out) = gemm::cublaslt::try_matmul_scaled(&lhs, &rhs, alpha, out_dtype) {
            return out;
        }
        gemm::matmul_scaled_reference::<Self>(lhs, rhs, alpha, out_dtype)
    }

    fn lemo_matmul_onto(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        alpha: f32,
        onto: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        let onto = match gemm::cublaslt::try_matmul_onto(&lhs, &rhs, alpha, onto) {
            Ok(out) => return out,
            Err(onto) => onto,
        };
        gemm::matmul_onto_reference::<Self>(lhs, rhs, alpha, onto)
    }
}

impl<B: ComputeBackend, C: CheckpointStrategy> GemmBackend for Autodiff<B, C> {
    fn lemo_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        gemm::autodiff::matmul::<B, C>(lhs, rhs)
    }

    // Not differentiable: the inner backend's product, with no graph.
    fn lemo_matmul_scaled(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        alpha: f32,
        out_dtype: DType,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::lemo_matmul_scaled(
            Self::inner(lhs),
            Self::inner(rhs),
            alpha,
            out_dtype,
        ))
    }

    fn lemo_matmul_with_value(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        value: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        known_value::autodiff::matmul_with_value::<B, C>(lhs, rhs, value)
    }

    fn lemo_with_value(graph: FloatTensor<Self>, value: FloatTensor<Self>) -> FloatTensor<Self> {
        known_value::autodiff::with_value::<B, C>(graph, value)
    }

    fn lemo_lora_linear(
        x: FloatTensor<Self>,
        frozen: FloatTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        whole: bool,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        precision::autodiff::lora_linear::<B, C>(x, frozen, weight, whole, a, b, scale)
    }
}
