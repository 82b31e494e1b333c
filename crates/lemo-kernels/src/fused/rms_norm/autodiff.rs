//! Autodiff of RMSNorm: saves `x` (or the output, see [`NormSaves`]), the weight and the per-row
//! `rstd` (4 bytes a row), and calls [`crate::FusedBackend::lemo_rms_norm_backward`]; the weight
//! gradient only when it is tracked.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::FloatTensor;

use super::NormSaves;
use crate::ComputeBackend;

#[derive(Debug)]
struct RmsNormBackward;

impl<B: ComputeBackend> Backward<B, 2> for RmsNormBackward {
    /// `x` (or the output), weight, rstd, which of the two was saved.
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, NormSaves);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_weight] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (saved, weight, rstd, saves) = ops.state;
        let (grad_x, grad_weight) =
            B::lemo_rms_norm_backward(saved, weight, rstd, grad, node_weight.is_some(), saves);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, grad_x);
        }
        if let (Some(node), Some(grad)) = (node_weight, grad_weight) {
            grads.register::<B>(node.id, grad);
        }
    }
}

pub(crate) fn rms_norm<B: ComputeBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
    eps: f32,
    saves: NormSaves,
) -> FloatTensor<Autodiff<B, C>> {
    match RmsNormBackward
        .prepare::<C>([x.node.clone(), weight.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (out, rstd) =
                B::lemo_rms_norm_forward(x.primitive.clone(), weight.primitive.clone(), eps);
            let saved = match saves {
                NormSaves::Input => x.primitive,
                NormSaves::Output => out.clone(),
            };
            prep.finish((saved, weight.primitive, rstd, saves), out)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(B::lemo_rms_norm(x.primitive, weight.primitive, eps, saves))
        }
    }
}
