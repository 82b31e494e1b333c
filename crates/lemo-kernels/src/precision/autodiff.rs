//! Autodiff of [`super::lora_linear`]: the forward keeps `x` in its own dtype, `a`, `b`, the
//! small `down = x A^T` and the frozen weight if any; the backward computes only the gradients
//! its parents need.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::{FloatTensor, FloatTensorOps};

use super::{lora_linear_backward, lora_linear_forward};
use crate::ComputeBackend;

#[derive(Debug)]
struct LoraLinearBackward;

impl<B: ComputeBackend> Backward<B, 4> for LoraLinearBackward {
    /// `[x, a, b, down]`, the frozen weight and the scale.
    type State = ([FloatTensor<B>; 4], Option<FloatTensor<B>>, f32);

    fn backward(
        self,
        ops: Ops<Self::State, 4>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (saved, weight, scale) = ops.state;
        let [x, a, b, frozen] = ops.parents;
        if let Some(frozen) = frozen {
            grads.register::<B>(frozen.id, grad.clone());
        }
        let parents = [x, a, b];
        let wanted = parents.each_ref().map(Option::is_some);
        let computed = lora_linear_backward::<B>(saved, weight, grad, scale, wanted);
        for (node, grad) in parents.into_iter().zip(computed) {
            if let (Some(node), Some(grad)) = (node, grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

pub(crate) fn lora_linear<B: ComputeBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    frozen: FloatTensor<Autodiff<B, C>>,
    weight: Option<FloatTensor<Autodiff<B, C>>>,
    whole: bool,
    a: FloatTensor<Autodiff<B, C>>,
    b: FloatTensor<Autodiff<B, C>>,
    scale: f32,
) -> FloatTensor<Autodiff<B, C>> {
    // With a weight, `frozen` is a value whose gradient `d x` already carries: out of the graph,
    // so that whatever computed it is not differentiated too.
    let frozen = match weight {
        Some(_) => Autodiff::<B, C>::float_set_require_grad(frozen, false),
        None => frozen,
    };
    let nodes = [
        x.node.clone(),
        a.node.clone(),
        b.node.clone(),
        frozen.node.clone(),
    ];
    match LoraLinearBackward
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (out, down) = lora_linear_forward::<B>(
                x.primitive.clone(),
                frozen.primitive,
                whole,
                a.primitive.clone(),
                b.primitive.clone(),
                scale,
            );
            let saved = [x.primitive, a.primitive, b.primitive, down];
            prep.finish((saved, weight.map(|w| w.primitive), scale), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(
            lora_linear_forward::<B>(
                x.primitive,
                frozen.primitive,
                whole,
                a.primitive,
                b.primitive,
                scale,
            )
            .0,
        ),
    }
}
