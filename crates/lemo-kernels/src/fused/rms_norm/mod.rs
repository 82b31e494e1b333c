//! RMSNorm over the last dimension: `y = weight * x / sqrt(mean(x^2) + eps)`, computed in f32
//! and rounded once to the input dtype (Llama, Mistral).

pub(crate) mod autodiff;
pub(crate) mod kernel;
pub mod reference;

use burn::tensor::{Tensor, TensorPrimitive};

use crate::ComputeBackend;

/// RMSNorm of `x [.., hidden]` with `weight [hidden]` (differentiable in both).
pub fn rms_norm<B: ComputeBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f32,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_rms_norm(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        eps,
    )))
}
