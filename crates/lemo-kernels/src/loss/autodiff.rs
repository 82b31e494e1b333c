//! Autodiff of the segment-based loss: the forward computes the gradients of the summed loss
//! for the tracked inputs (chunk by chunk, see `segment`) and saves only those; the backward
//! scales them by the upstream gradient of the loss (a scalar). Neither the hidden states nor
//! the logits are kept.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::TensorMetadata;
use burn::tensor::ops::{FloatTensor, IntTensor};

use super::backend::{LossBackend, SegmentGrads, SegmentOutput};

#[derive(Debug)]
struct SegmentLossBackward;

/// `grad [rows, ..] * upstream` with the scalar upstream gradient cast to `grad`'s dtype.
fn scale<B: LossBackend>(grad: FloatTensor<B>, upstream: &FloatTensor<B>) -> FloatTensor<B> {
    let rank = grad.shape().num_dims();
    let upstream = B::float_reshape(
        B::float_cast(upstream.clone(), grad.dtype().into()),
        vec![1; rank].into(),
    );
    B::float_mul(grad, upstream)
}

impl<B: LossBackend> Backward<B, 2> for SegmentLossBackward {
    /// `d hidden` and `d weight` of the summed loss, for the tracked inputs.
    type State = SegmentGrads<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_hidden, node_weight] = ops.parents;
        let upstream = grads.consume::<B>(&ops.node);
        let (grad_hidden, grad_weight) = ops.state;
        if let (Some(node), Some(grad)) = (node_hidden, grad_hidden) {
            grads.register::<B>(node.id, scale::<B>(grad, &upstream));
        }
        if let (Some(node), Some(grad)) = (node_weight, grad_weight) {
            grads.register::<B>(node.id, scale::<B>(grad, &upstream));
        }
    }
}

/// Tracked inputs get their gradients through the graph; the returned ones are always `None`.
pub(crate) fn segment_cross_entropy<B: LossBackend, C: CheckpointStrategy>(
    hidden: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
    targets: IntTensor<Autodiff<B, C>>,
    chunk_rows: usize,
    _hidden_grad: bool,
    _weight_grad: bool,
) -> SegmentOutput<Autodiff<B, C>> {
    let (hidden_tracked, weight_tracked) = (hidden.is_tracked(), weight.is_tracked());
    let loss = match SegmentLossBackward
        .prepare::<C>([hidden.node.clone(), weight.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (loss, grads) = B::lemo_segment_cross_entropy(
                hidden.primitive,
                weight.primitive,
                targets,
                chunk_rows,
                hidden_tracked,
                weight_tracked,
            );
            prep.finish(grads, loss)
        }
        OpsKind::UnTracked(prep) => {
            let (loss, _) = B::lemo_segment_cross_entropy(
                hidden.primitive,
                weight.primitive,
                targets,
                chunk_rows,
                false,
                false,
            );
            prep.finish(loss)
        }
    };
    (loss, (None, None))
}
