//! RMSNorm over the last dimension: `y = weight * x / sqrt(mean(x^2) + eps)`, computed in f32
//! and rounded once to the input dtype (Llama, Mistral).

pub(crate) mod autodiff;
pub(crate) mod kernel;
pub mod reference;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, ElementConversion, Tensor, TensorMetadata, TensorPrimitive};

use crate::ComputeBackend;

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
    /// [`NormSaves::Output`] where `weight` allows it (a host read of the weight: decide once,
    /// when the weight is loaded), else [`NormSaves::Input`].
    pub fn output_if_invertible<B: Backend>(weight: &Tensor<B, 1>) -> Self {
        let smallest = weight
            .clone()
            .cast(DType::F32)
            .abs()
            .min()
            .into_scalar()
            .elem::<f32>();
        if smallest >= f32::MIN_POSITIVE {
            NormSaves::Output
        } else {
            NormSaves::Input
        }
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
    let (shape, dtype) = (y.shape(), y.dtype());
    let hidden = shape[shape.num_dims() - 1];
    let rows = shape.num_elements() / hidden.max(1);
    let y = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::float_reshape(
        y,
        [rows, hidden].into(),
    )))
    .cast(DType::F32);
    let weight = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(weight)).cast(DType::F32);
    let rstd = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(rstd)).reshape([rows, 1]);
    let x = y / (weight.unsqueeze::<2>() * rstd);
    B::float_reshape(x.cast(dtype).into_primitive().tensor(), shape)
}
