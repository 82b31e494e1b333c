//! RMSNorm over the last dimension: `y = weight * x / sqrt(mean(x^2) + eps)`, computed in f32
//! and rounded once to the input dtype (Llama, Mistral).

pub(crate) mod autodiff;
pub(crate) mod kernel;
pub mod reference;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, ElementConversion, Tensor, TensorPrimitive};

use crate::ComputeBackend;
use crate::fused::{rows_f32, vector_f32};

/// What an RMSNorm keeps for its backward pass besides `rstd` (4 bytes a row).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormSaves {
    /// Its input: right for any weight.
    Input,
    /// Its output, from which the backward pass recovers the input, `x = y / (weight * rstd)`
    /// (one elementwise pass): free where the output is saved anyway, as the input of the
    /// adapters that follow, and the norm's own copy of its input is then the only thing it
    /// adds. Only for a weight without zero (or subnormal) entries, whose inputs cannot be
    /// recovered.
    Output,
}

impl NormSaves {
    /// Whether `weight` allows [`NormSaves::Output`]: no zero or subnormal entry (a host read of
    /// the weight: decide once, when the weight is loaded).
    pub fn invertible<B: Backend>(weight: &Tensor<B, 1>) -> bool {
        let smallest = weight
            .clone()
            .cast(DType::F32)
            .abs()
            .min()
            .into_scalar()
            .elem::<f32>();
        smallest >= f32::MIN_POSITIVE
    }
}

/// RMSNorm of `x [.., hidden]` with `weight [hidden]` (differentiable in both), keeping what
/// `saves` says for the backward pass.
pub fn rms_norm<B: ComputeBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f32,
    saves: NormSaves,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_rms_norm(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        eps,
        saves,
    )))
}

/// The input of an RMSNorm from its output `y [.., hidden]`, `weight` and `rstd [rows]`:
/// `y / (weight * rstd)` in f32, in `y`'s dtype and shape (see [`NormSaves::Output`]).
pub(crate) fn input_from_output<B: Backend>(
    y: FloatTensor<B>,
    weight: FloatTensor<B>,
    rstd: FloatTensor<B>,
) -> FloatTensor<B> {
    let (y, shape, dtype) = rows_f32::<B>(y);
    let rows = y.dims()[0];
    let rstd = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(rstd)).reshape([rows, 1]);
    let x = y / (vector_f32::<B>(weight).unsqueeze::<2>() * rstd);
    B::float_reshape(x.cast(dtype).into_primitive().tensor(), shape)
}
