//! Autodiff of [`super::lora_delta`]: the forward keeps `x` in its own dtype, `a`, `b` and the
//! small `down = x A^T`; the backward computes only the gradients its parents need.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::FloatTensor;

use super::{lora_delta_backward, lora_delta_forward};
use crate::ComputeBackend;

#[derive(Debug)]
struct LoraDeltaBackward;

impl<B: ComputeBackend> Backward<B, 3> for LoraDeltaBackward {
    /// `[x, a, b, down]` and the scale.
    type State = ([FloatTensor<B>; 4], f32);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (saved, scale) = ops.state;
        let wanted = ops.parents.each_ref().map(Option::is_some);
        let computed = lora_delta_backward::<B>(saved, grad, scale, wanted);
        for (node, grad) in ops.parents.into_iter().zip(computed) {
            if let (Some(node), Some(grad)) = (node, grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

pub(crate) fn lora_delta<B: ComputeBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    a: FloatTensor<Autodiff<B, C>>,
    b: FloatTensor<Autodiff<B, C>>,
    scale: f32,
) -> FloatTensor<Autodiff<B, C>> {
    match LoraDeltaBackward
        .prepare::<C>([x.node.clone(), a.node.clone(), b.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (out, down) = lora_delta_forward::<B>(
                x.primitive.clone(),
                a.primitive.clone(),
                b.primitive.clone(),
                scale,
            );
            let saved = [x.primitive, a.primitive, b.primitive, down];
            prep.finish((saved, scale), out)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(lora_delta_forward::<B>(x.primitive, a.primitive, b.primitive, scale).0)
        }
    }
}
