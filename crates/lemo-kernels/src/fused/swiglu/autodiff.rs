//! Autodiff of SwiGLU: saves `gate` and `up` (the MLP's own activations, no extra tensor) and
//! calls [`crate::FusedBackend::lemo_swiglu_backward`], which produces both gradients in one pass.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::FloatTensor;

use crate::ComputeBackend;

#[derive(Debug)]
struct SwigluBackward;

impl<B: ComputeBackend> Backward<B, 2> for SwigluBackward {
    /// `gate, up`.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_gate, node_up] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let (grad_gate, grad_up) = B::lemo_swiglu_backward(gate, up, grad);
        if let Some(node) = node_gate {
            grads.register::<B>(node.id, grad_gate);
        }
        if let Some(node) = node_up {
            grads.register::<B>(node.id, grad_up);
        }
    }
}

pub(crate) fn swiglu<B: ComputeBackend, C: CheckpointStrategy>(
    gate: FloatTensor<Autodiff<B, C>>,
    up: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    match SwigluBackward
        .prepare::<C>([gate.node.clone(), up.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let out = B::lemo_swiglu(gate.primitive.clone(), up.primitive.clone());
            prep.finish((gate.primitive, up.primitive), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::lemo_swiglu(gate.primitive, up.primitive)),
    }
}
