//! Plain Burn SwiGLU, forward and backward, in f32 whatever the storage dtype.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorMetadata, TensorPrimitive};

fn flat_f32<B: Backend>(tensor: FloatTensor<B>) -> Tensor<B, 1> {
    let elements = tensor.shape().num_elements();
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
        tensor,
        [elements].into(),
    )))
    .cast(DType::F32)
}

/// `silu(gate) * up` in `gate`'s dtype and shape.
pub fn forward<B: Backend>(gate: FloatTensor<B>, up: FloatTensor<B>) -> FloatTensor<B> {
    let (shape, dtype) = (gate.shape(), gate.dtype());
    let (gate, up) = (flat_f32::<B>(gate), flat_f32::<B>(up));
    let silu = gate.clone() * burn::tensor::activation::sigmoid(gate);
    B::float_reshape((silu * up).cast(dtype).into_primitive().tensor(), shape)
}

/// `d gate = g up s (1 + gate (1 - s))` and `d up = g silu(gate)`, with `s = sigmoid(gate)`.
pub fn backward<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (shape, dtype) = (gate.shape(), gate.dtype());
    let (gate, up, grad) = (flat_f32::<B>(gate), flat_f32::<B>(up), flat_f32::<B>(grad));
    let sigmoid = burn::tensor::activation::sigmoid(gate.clone());
    let silu = gate.clone() * sigmoid.clone();
    let grad_gate = grad.clone() * up * sigmoid.clone() * ((gate * (sigmoid.neg() + 1.0)) + 1.0);
    let grad_up = grad * silu;
    let back =
        |t: Tensor<B, 1>| B::float_reshape(t.cast(dtype).into_primitive().tensor(), shape.clone());
    (back(grad_gate), back(grad_up))
}
