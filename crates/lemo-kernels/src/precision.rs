//! Mixed-precision policy of LoRA training, as PEFT applies it to a bf16 model:
//! frozen weights and activations in bf16; LoRA parameters, their gradients and the optimizer
//! state in f32; reductions (norms, softmax, losses, GEMM accumulation) in f32 whatever the
//! storage type. The kernels of this crate follow it: every fused kernel loads its storage type
//! and computes in f32, GEMMs accumulate in f32 (cuBLASLt `COMPUTE_32F`), the loss is f32.

use burn::tensor::{DType, Tensor};

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
/// projection. Differentiable in `x`, `a` and `b`.
pub fn lora_delta<B: ComputeBackend, const D: usize>(
    x: Tensor<B, D>,
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    scale: f32,
) -> Tensor<B, D> {
    let dtype = x.dtype();
    let adapter = a.dtype();
    let x = x.cast(adapter);
    let down = crate::gemm::matmul(x, a.transpose().unsqueeze::<D>());
    let up = crate::gemm::matmul(down, b.transpose().unsqueeze::<D>());
    (up * scale).cast(dtype)
}
