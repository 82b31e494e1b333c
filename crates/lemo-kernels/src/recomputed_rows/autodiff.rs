//! Autodiff of [`super::with_recomputed_rows`]: an identity node on `x` that saves the given rows
//! of `x` and, in the backward pass, adds the MLP's input gradient into those rows of `d x`.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorPrimitive};

use super::{CHUNK_ELEMENTS, FrozenLinear, FrozenMlp, FrozenNorm};
use crate::ComputeBackend;

#[derive(Debug)]
struct RecomputedRowsBackward;

impl<B: ComputeBackend> Backward<B, 1> for RecomputedRowsBackward {
    /// The rows of `x` (`[batch, n, hidden]`), their positions and the block.
    type State = (FloatTensor<B>, IntTensor<B>, FrozenMlp<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(node) = node_x else { return };
        let (saved, rows, mlp) = ops.state;
        let grad_rows = B::lemo_gather_rows(grad.clone(), rows.clone());
        let wrap = |t| Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(t));
        let grad_input = mlp.input_gradient(wrap(saved), wrap(grad_rows), CHUNK_ELEMENTS);
        grads.register::<B>(
            node.id,
            B::lemo_scatter_add_rows(grad, rows, grad_input.into_primitive().tensor()),
        );
    }
}

/// The block's parameters as the inner backend's (they take no gradient here).
fn inner<B: ComputeBackend, C: CheckpointStrategy>(mlp: FrozenMlp<Autodiff<B, C>>) -> FrozenMlp<B> {
    let linear = |l: FrozenLinear<Autodiff<B, C>>| FrozenLinear {
        weight: l.weight.primitive,
        bias: l.bias.map(|b| b.primitive),
        lora: l.lora.map(|(a, b, s)| (a.primitive, b.primitive, s)),
    };
    FrozenMlp {
        norm: match mlp.norm {
            FrozenNorm::Rms { weight, eps } => FrozenNorm::Rms {
                weight: weight.primitive,
                eps,
            },
            FrozenNorm::Layer { weight, bias, eps } => FrozenNorm::Layer {
                weight: weight.map(|w| w.primitive),
                bias: bias.map(|b| b.primitive),
                eps,
            },
        },
        activation: mlp.activation,
        inputs: mlp.inputs.into_iter().map(linear).collect(),
        output: linear(mlp.output),
    }
}

pub(crate) fn with_recomputed_rows<B: ComputeBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    rows: IntTensor<B>,
    mlp: FrozenMlp<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    match RecomputedRowsBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let saved = B::lemo_gather_rows(x.primitive.clone(), rows.clone());
            prep.finish((saved, rows, inner(mlp)), x.primitive)
        }
        OpsKind::UnTracked(prep) => prep.finish(x.primitive),
    }
}
