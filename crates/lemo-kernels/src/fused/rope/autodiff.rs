//! Autodiff of RoPE: a rotation, so the gradient is the inverse rotation of the output gradient
//! at the same positions; only the tables and positions are kept (no activation).

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::tensor::ops::{FloatTensor, IntTensor};

use crate::ComputeBackend;

#[derive(Debug)]
struct RopeBackward;

impl<B: ComputeBackend> Backward<B, 1> for RopeBackward {
    /// `cos, sin, positions, inverse`.
    type State = (FloatTensor<B>, FloatTensor<B>, IntTensor<B>, bool);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let (cos, sin, positions, inverse) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::lemo_rope(grad, cos, sin, positions, !inverse)
        });
    }
}

pub(crate) fn rope<B: ComputeBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    cos: FloatTensor<Autodiff<B, C>>,
    sin: FloatTensor<Autodiff<B, C>>,
    positions: IntTensor<Autodiff<B, C>>,
    inverse: bool,
) -> FloatTensor<Autodiff<B, C>> {
    let (cos, sin) = (cos.primitive, sin.primitive);
    match RopeBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let out = B::lemo_rope(
                x.primitive,
                cos.clone(),
                sin.clone(),
                positions.clone(),
                inverse,
            );
            prep.finish((cos, sin, positions, inverse), out)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(B::lemo_rope(x.primitive, cos, sin, positions, inverse))
        }
    }
}
