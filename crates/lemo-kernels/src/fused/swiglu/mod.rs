//! SwiGLU of the Llama MLP: `silu(gate) * up`, with `silu(g) = g / (1 + exp(-g))`.

pub(crate) mod autodiff;
pub(crate) mod kernel;
pub mod reference;

use burn::tensor::{Tensor, TensorPrimitive};

use crate::ComputeBackend;

/// `silu(gate) * up` for two tensors of one shape (differentiable in both).
pub fn swiglu<B: ComputeBackend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_swiglu(
        gate.into_primitive().tensor(),
        up.into_primitive().tensor(),
    )))
}
