//! Autodiff of LayerNorm with constant parameters: saves the input or the output (see
//! [`NormSaves`]), the parameters and `rstd`; the gradient reaches `x` only.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::FloatTensor;

use super::reference;
use crate::ComputeBackend;
use crate::fused::NormSaves;

#[derive(Debug)]
struct LayerNormBackward;

impl<B: ComputeBackend> Backward<B, 1> for LayerNormBackward {
    /// The input (or the output), weight, bias, `rstd`, which of the two was saved.
    type State = (
        FloatTensor<B>,
        Option<FloatTensor<B>>,
        Option<FloatTensor<B>>,
        FloatTensor<B>,
        NormSaves,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (saved, weight, bias, rstd, saves) = ops.state;
        if let Some(node) = node_x {
            let grad_x =
                reference::backward::<B>(saved, weight.as_ref(), bias.as_ref(), rstd, grad, saves);
            grads.register::<B>(node.id, grad_x);
        }
    }
}

pub(crate) fn layer_norm<B: ComputeBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    weight: Option<FloatTensor<Autodiff<B, C>>>,
    bias: Option<FloatTensor<Autodiff<B, C>>>,
    eps: f32,
    saves: NormSaves,
) -> FloatTensor<Autodiff<B, C>> {
    let weight = weight.map(|w| w.primitive);
    let bias = bias.map(|b| b.primitive);
    match LayerNormBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (out, rstd) =
                reference::forward::<B>(x.primitive.clone(), weight.as_ref(), bias.as_ref(), eps);
            let saved = match saves {
                NormSaves::Input => x.primitive,
                NormSaves::Output => out.clone(),
            };
            prep.finish((saved, weight, bias, rstd, saves), out)
        }
        OpsKind::UnTracked(prep) => {
            let (out, _) =
                reference::forward::<B>(x.primitive, weight.as_ref(), bias.as_ref(), eps);
            prep.finish(out)
        }
    }
}
