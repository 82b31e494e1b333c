//! The chunked loss with its gradients, written with backend ops (GEMMs through
//! [`crate::GemmBackend::lemo_matmul`], the softmax through the fused row kernel).

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorPrimitive};

use super::backend::{LossBackend, SegmentOutput};
use crate::ComputeBackend;

fn float<B: burn::tensor::backend::Backend, const D: usize>(
    tensor: FloatTensor<B>,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(tensor))
}

/// For each chunk of `chunk_rows` rows: logits `h_c W^T` (`[c, V]`), per-row loss and
/// `d logits` (one fused pass), then `d h_c = d logits W` and `d W += d logits^T h_c` (f32
/// accumulation across chunks). Three GEMMs of `2 c V H` flops per chunk, as the unchunked
/// forward plus backward; peak memory two `c x V` buffers plus the outputs.
pub(crate) fn forward_with_grads<B: ComputeBackend + LossBackend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    chunk_rows: usize,
    hidden_grad: bool,
    weight_grad: bool,
) -> SegmentOutput<B> {
    let hidden = float::<B, 2>(hidden);
    let weight = float::<B, 2>(weight);
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let [rows, width] = hidden.dims();
    assert_eq!(width, weight.dims()[1], "hidden and lm_head widths differ");
    assert_eq!(targets.dims()[0], rows, "one target per hidden row");
    let chunk_rows = chunk_rows.clamp(1, rows.max(1));
    let weight_t = weight.clone().transpose();
    let mut losses = Vec::new();
    let mut hidden_grads = Vec::new();
    let mut weight_acc: Option<Tensor<B, 2>> = None;
    for start in (0..rows).step_by(chunk_rows) {
        let len = chunk_rows.min(rows - start);
        let h = hidden.clone().narrow(0, start, len);
        let logits = crate::gemm::matmul(h.clone(), weight_t.clone());
        let (loss, grad) = super::cross_entropy_rows(
            logits,
            targets.clone().narrow(0, start, len),
            hidden_grad || weight_grad,
        );
        losses.push(loss);
        if let Some(grad) = grad {
            if hidden_grad {
                hidden_grads.push(crate::gemm::matmul(grad.clone(), weight.clone()));
            }
            if weight_grad {
                let part = crate::gemm::matmul(grad.transpose(), h).cast(DType::F32);
                weight_acc = Some(match weight_acc {
                    Some(acc) => acc + part,
                    None => part,
                });
            }
        }
    }
    let loss = if losses.is_empty() {
        Tensor::<B, 1>::zeros([1], &hidden.device()).cast(DType::F32)
    } else {
        Tensor::cat(losses, 0).sum()
    };
    let grad_hidden = hidden_grad.then(|| {
        if hidden_grads.is_empty() {
            hidden.zeros_like().into_primitive().tensor()
        } else {
            Tensor::cat(hidden_grads, 0).into_primitive().tensor()
        }
    });
    let grad_weight = weight_grad.then(|| match weight_acc {
        Some(acc) => acc.cast(weight.dtype()).into_primitive().tensor(),
        None => weight.zeros_like().into_primitive().tensor(),
    });
    (loss.into_primitive().tensor(), (grad_hidden, grad_weight))
}
