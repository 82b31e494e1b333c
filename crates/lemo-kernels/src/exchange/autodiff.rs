//! Autodiff of the all-gather: the backward pass is the reduce-scatter of the gathered rows'
//! gradient.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::tensor::ops::FloatTensor;

use super::Exchange;
use super::backend::ExchangeBackend;

#[derive(Debug)]
struct AllGatherBackward;

impl<B: ExchangeBackend> Backward<B, 1> for AllGatherBackward {
    type State = Exchange;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let exchange = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::lemo_reduce_scatter_rows(grad, &exchange)
        });
    }
}

impl<B: ExchangeBackend, C: CheckpointStrategy> ExchangeBackend for Autodiff<B, C> {
    fn lemo_all_gather_rows(local: FloatTensor<Self>, exchange: &Exchange) -> FloatTensor<Self> {
        let gathered = B::lemo_all_gather_rows(local.primitive, exchange);
        // Compute-bound: a checkpointing strategy must never run the collective again on one
        // rank alone.
        match AllGatherBackward
            .prepare::<C>([local.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(exchange.clone(), gathered),
            OpsKind::UnTracked(prep) => prep.finish(gathered),
        }
    }
}
