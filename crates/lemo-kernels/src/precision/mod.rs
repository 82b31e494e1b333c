//! Mixed-precision policy of LoRA training, as PEFT applies it to a bf16 model:
//! frozen weights and activations in bf16; LoRA parameters, their gradients and the optimizer
//! state in f32; reductions (norms, softmax, losses, GEMM accumulation) in f32 whatever the
//! storage type. The kernels of this crate follow it: every fused kernel loads its storage type
//! and computes in f32, GEMMs accumulate in f32 (cuBLASLt `COMPUTE_32F`), the loss is f32.

pub(crate) mod autodiff;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, Tensor, TensorMetadata, TensorPrimitive};

use crate::ComputeBackend;

/// Storage types of the four kinds of tensor a LoRA step holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    /// Pretrained weights (never updated).
    pub frozen: DType,
    /// Hidden states, attention and MLP activations, and their gradients.
    pub activations: DType,
    /// LoRA `A` and `B` (and their gradients).
    pub trainable: DType,
    /// Optimizer moments.
    pub optimizer: DType,
}

impl Precision {
    /// bf16 model, f32 adapters and optimizer: the policy PEFT uses and ours.
    pub const MIXED_BF16: Self = Self {
        frozen: DType::BF16,
        activations: DType::BF16,
        trainable: DType::F32,
        optimizer: DType::F32,
    };

    /// Everything in f32 (CPU tests, references).
    pub const F32: Self = Self {
        frozen: DType::F32,
        activations: DType::F32,
        trainable: DType::F32,
        optimizer: DType::F32,
    };
}

/// The LoRA update of a linear layer, `scale * (x A^T) B^T` for `x [.., in]` in the activation
/// dtype and f32 `a [r, in]`, `b [out, r]` (PEFT's layout): computed in f32 like PEFT (which
/// casts `x` to the adapter's dtype) and returned in `x`'s dtype, ready to add to the frozen
/// projection. Differentiable in `x`, `a` and `b`; under autodiff it keeps `x` as it came (bf16,
/// usually the same tensor the frozen projection reads) and casts it again in the backward pass,
/// where PEFT keeps an f32 copy of `x` per adapter.
pub fn lora_delta<B: ComputeBackend, const D: usize>(
    x: Tensor<B, D>,
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    scale: f32,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_lora_delta(
        x.into_primitive().tensor(),
        a.into_primitive().tensor(),
        b.into_primitive().tensor(),
        scale,
    )))
}

/// [`lora_delta`] in Burn tensor operations, differentiated by Burn: what the tests compare with.
pub fn lora_delta_reference<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    scale: f32,
) -> Tensor<B, D> {
    let dtype = x.dtype();
    let x = x.cast(a.dtype());
    let down = x.matmul(a.transpose().unsqueeze::<D>());
    (down.matmul(b.transpose().unsqueeze::<D>()) * scale).cast(dtype)
}

/// `x [.., in]` as `[rows, in]`.
fn rows<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let shape = x.shape();
    let width = shape[shape.num_dims() - 1];
    B::float_reshape(x, Shape::new([shape.num_elements() / width, width]))
}

/// The output of [`lora_delta`] and `down = x A^T` (`[rows, r]`, the adapter's dtype), which the
/// backward pass reuses: two products of rank `r`, O(rows * r * (in + out)).
pub(crate) fn lora_delta_forward<B: ComputeBackend>(
    x: FloatTensor<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    scale: f32,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let mut out_shape = x.shape();
    let last = out_shape.num_dims() - 1;
    out_shape[last] = b.shape()[0];
    let (dtype, adapter) = (x.dtype(), a.dtype());
    let x = B::float_cast(rows::<B>(x), adapter.into());
    let down = B::lemo_matmul(x, B::float_transpose(a));
    let up = B::lemo_matmul(down.clone(), B::float_transpose(b));
    let out = B::float_cast(B::float_mul_scalar(up, scale.into()), dtype.into());
    (B::float_reshape(out, out_shape), down)
}

/// `(d x, d a, d b)` of [`lora_delta`] from the saved `x`, `a`, `b`, `down` and `d out`, each
/// when asked for; the f32 copy of `x` exists only while `d a` is computed.
pub(crate) fn lora_delta_backward<B: ComputeBackend>(
    [x, a, b, down]: [FloatTensor<B>; 4],
    grad: FloatTensor<B>,
    scale: f32,
    [want_x, want_a, want_b]: [bool; 3],
) -> [Option<FloatTensor<B>>; 3] {
    let (x_shape, dtype, adapter) = (x.shape(), x.dtype(), a.dtype());
    let grad_up = B::float_mul_scalar(B::float_cast(rows::<B>(grad), adapter.into()), scale.into());
    let grad_b = want_b.then(|| B::lemo_matmul(B::float_transpose(grad_up.clone()), down));
    let grad_down = (want_x || want_a).then(|| B::lemo_matmul(grad_up, b));
    let grad_a = grad_down.clone().filter(|_| want_a).map(|grad_down| {
        let x = B::float_cast(rows::<B>(x), adapter.into());
        B::lemo_matmul(B::float_transpose(grad_down), x)
    });
    let grad_x = grad_down.filter(|_| want_x).map(|grad_down| {
        let grad_x = B::float_cast(B::lemo_matmul(grad_down, a), dtype.into());
        B::float_reshape(grad_x, x_shape)
    });
    [grad_x, grad_a, grad_b]
}
