//! Autodiff of the known-value operations: the product's node is the matrix product's own
//! backward with the given output; `with_value` is an identity node on `graph`.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, unary};
use burn::tensor::ops::FloatTensor;

use crate::ComputeBackend;
use crate::gemm::autodiff::record_matmul;

pub(crate) fn matmul_with_value<B: ComputeBackend, C: CheckpointStrategy>(
    lhs: FloatTensor<Autodiff<B, C>>,
    rhs: FloatTensor<Autodiff<B, C>>,
    value: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    record_matmul::<B, C>(lhs, rhs, value.primitive)
}

#[derive(Debug)]
struct WithValueBackward;

impl<B: ComputeBackend> Backward<B, 1> for WithValueBackward {
    type State = ();

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        unary::<B, _>(ops.parents, ops.node, grads, |grad| grad);
    }
}

pub(crate) fn with_value<B: ComputeBackend, C: CheckpointStrategy>(
    graph: FloatTensor<Autodiff<B, C>>,
    value: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    WithValueBackward
        .prepare::<C>([graph.node])
        .compute_bound()
        .stateless(value.primitive)
}
