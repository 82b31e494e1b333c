//! Segment-based loss ("peak cutting"): the lm_head projection and the cross-entropy run over
//! the sequence in chunks of rows, and each chunk's gradients (for the hidden states, and for
//! the lm_head weight when it is trainable) are computed as soon as its loss is, so the
//! `S x V` logits never exist at once: the loss's peak memory is one chunk's logits and their
//! gradient, whatever the sequence length. Under autodiff the upstream gradient of the summed
//! loss (a scalar) only rescales the saved gradients, so the result equals the plain version's.

pub(crate) mod autodiff;
mod backend;
mod backends;
pub(crate) mod kernel;
pub mod reference;
pub(crate) mod segment;

pub use backend::{LossBackend, SegmentGrads, SegmentOutput};

use burn::tensor::{Int, Tensor, TensorPrimitive};

/// Targets below zero (Hugging Face's `-100`) are ignored: no loss, no gradient.
pub const IGNORE_INDEX: i64 = -100;

/// Summed cross-entropy (f32, shape `[1]`) of the logits `hidden [S, H] x weight[V, H]^T`
/// (lm_head in Hugging Face's `[vocab, hidden]` layout) against `targets [S]`, computed
/// `chunk_rows` rows at a time. Logits are produced in the inputs' dtype (bf16 in training,
/// like `F.linear` then `.float()`), the softmax in f32. Differentiable in `hidden` and
/// `weight`; a tied embedding passed as `weight` receives its gradient. Divide by the number of
/// targets `>= 0` for the mean.
pub fn segment_cross_entropy<B: LossBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    chunk_rows: usize,
) -> Tensor<B, 1> {
    let (loss, _) = B::lemo_segment_cross_entropy(
        hidden.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        targets.into_primitive(),
        chunk_rows,
        false,
        false,
    );
    Tensor::from_primitive(TensorPrimitive::Float(loss))
}

/// Per-row cross-entropy `lse(logits) - logits[target]` (f32, `[rows]`, 0 for ignored rows) of
/// `logits [rows, V]`, and with `grad` the gradient of their sum, `softmax - one_hot`, in the
/// logits' dtype: the fused kernel one chunk of [`segment_cross_entropy`] runs.
pub fn cross_entropy_rows<B: LossBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    grad: bool,
) -> (Tensor<B, 1>, Option<Tensor<B, 2>>) {
    let (losses, grad) = B::lemo_cross_entropy_rows(
        logits.into_primitive().tensor(),
        targets.into_primitive(),
        grad,
    );
    (
        Tensor::from_primitive(TensorPrimitive::Float(losses)),
        grad.map(|g| Tensor::from_primitive(TensorPrimitive::Float(g))),
    )
}
