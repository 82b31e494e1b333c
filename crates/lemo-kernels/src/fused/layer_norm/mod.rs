//! LayerNorm over the last dimension with frozen parameters: `y = (x - mean) r w + b`,
//! `r = 1 / sqrt(var + eps)`, computed in f32 and rounded once to the input dtype (OPT). One
//! differentiable op whose backward pass needs only what [`NormSaves`] says plus `r` (4 bytes a
//! row), where the same chain of tensor ops under autodiff keeps the centered input in f32 (twice
//! the bytes of a bf16 row) besides. Plain Burn ops on every backend (no kernel yet).

pub(crate) mod autodiff;
pub mod reference;

use burn::tensor::{Tensor, TensorPrimitive};

use crate::ComputeBackend;
use crate::fused::NormSaves;

/// LayerNorm of `x [.., hidden]` with optional constant `weight` and `bias` (`[hidden]`),
/// differentiable in `x` only (a trainable weight or bias needs the plain tensor ops), keeping
/// what `saves` says for the backward pass.
pub fn layer_norm<B: ComputeBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: Option<Tensor<B, 1>>,
    bias: Option<Tensor<B, 1>>,
    eps: f32,
    saves: NormSaves,
) -> Tensor<B, D> {
    let primitive = |t: Tensor<B, 1>| t.into_primitive().tensor();
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_layer_norm(
        x.into_primitive().tensor(),
        weight.map(primitive),
        bias.map(primitive),
        eps,
        saves,
    )))
}
