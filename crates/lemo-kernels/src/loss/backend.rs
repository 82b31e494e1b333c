//! The loss family of backend operations: the trait a backend implements (in
//! [`super::backends`]) so that [`super::segment_cross_entropy`] and
//! [`super::cross_entropy_rows`] run on it.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};

/// Gradients the segment-based loss computes while it runs: `(d hidden, d weight)` of the summed
/// loss, each present when asked for.
pub type SegmentGrads<B> = (Option<FloatTensor<B>>, Option<FloatTensor<B>>);

/// The summed loss (f32, `[1]`) and the gradients computed on the way.
pub type SegmentOutput<B> = (FloatTensor<B>, SegmentGrads<B>);

/// Backend operations of the loss.
pub trait LossBackend: Backend {
    /// Per-row cross-entropy of `logits [rows, V]` and, with `grad`, `softmax - one_hot`; see
    /// [`super::cross_entropy_rows`].
    fn lemo_cross_entropy_rows(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>);

    /// Summed cross-entropy of `hidden [S, H] x weight[V, H]^T` against `targets [S]`, chunk by
    /// chunk, with the requested gradients computed on the way; see
    /// [`super::segment_cross_entropy`].
    fn lemo_segment_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        chunk_rows: usize,
        hidden_grad: bool,
        weight_grad: bool,
    ) -> SegmentOutput<Self>;
}
