//! Plain Burn cross-entropy over the full `S x V` logits (what the segment-based loss must
//! equal), and the per-row loss/gradient the fused kernel is checked against.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorPrimitive};

use crate::ComputeBackend;

/// Summed cross-entropy of `hidden [S, H] x weight[V, H]^T` against `targets [S]` (negative
/// targets ignored): logits in the inputs' dtype, softmax in f32. Differentiable through Burn's
/// own autodiff; materializes the `S x V` logits (and their gradient in the backward pass).
/// The product goes through [`crate::gemm::matmul`] so that on CUDA the comparison is about
/// the loss, not about the GEMM.
pub fn cross_entropy<B: ComputeBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
) -> Tensor<B, 1> {
    let logits = crate::gemm::matmul(hidden, weight.transpose()).cast(DType::F32);
    let (losses, _, _) = rows::<B>(logits, targets);
    losses.sum()
}

/// Per-row loss of f32 `logits [rows, V]`, the `[rows, 1]` validity mask and `logsumexp`.
fn rows<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
) -> (Tensor<B, 1>, Tensor<B, 2>, Tensor<B, 2>) {
    let rows = logits.dims()[0];
    let valid = targets
        .clone()
        .greater_equal_elem(0)
        .float()
        .reshape([rows, 1]);
    let safe = targets.clamp_min(0).reshape([rows, 1]);
    let max = logits.clone().detach().max_dim(1);
    let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
    let picked = logits.gather(1, safe);
    let losses = ((lse.clone() - picked) * valid.clone()).reshape([rows]);
    (losses, valid, lse)
}

/// Default body of [`super::LossBackend::lemo_cross_entropy_rows`] with Burn ops.
pub fn cross_entropy_rows<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    grad: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let logits = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(logits));
    let dtype = logits.dtype();
    let logits = logits.cast(DType::F32);
    let [row_count, vocab] = logits.dims();
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let (losses, valid, lse) = rows::<B>(logits.clone(), targets.clone());
    let grad = grad.then(|| {
        let probs = (logits - lse).exp();
        let vocab_ids =
            Tensor::<B, 1, Int>::arange(0..vocab as i64, &probs.device()).reshape([1, vocab]);
        let one_hot = vocab_ids.equal(targets.reshape([row_count, 1])).float();
        ((probs - one_hot) * valid)
            .cast(dtype)
            .into_primitive()
            .tensor()
    });
    (losses.into_primitive().tensor(), grad)
}
