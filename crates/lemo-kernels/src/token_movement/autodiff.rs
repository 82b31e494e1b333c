//! Autodiff of token movement. Gather-RMSNorm saves the kept rows of `x` (copied by its forward
//! pass) or its own output (see [`NormSaves`]), the weight, `rstd` and the rows, never `x`
//! itself: the residual stream stays
//! exclusively owned, so the scatter-add that follows updates it in place. The scatter-add passes
//! `d out` through to `x` and gathers `d values` from it; both gathers add their row gradients
//! straight into the gradient `x` already has, instead of a zero-padded full-size tensor.

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape, TensorMetadata};

use crate::ComputeBackend;
use crate::fused::rms_norm::NormSaves;

/// The gradient registered so far for the parent `$node`, taken out of `$grads`: the caller
/// adds into it (in place when nothing else holds it) and registers the sum, where
/// `Gradients::register` would add a second full-size tensor. `$key` is any tensor of backend
/// `$B`; only the node identifies the gradient (Burn names the node type in no public path).
macro_rules! take_grad {
    ($B:ty, $grads:expr, $node:expr, $key:expr) => {{
        let node = $node;
        let key: FloatTensor<Autodiff<$B>> = AutodiffKey::<$B> {
            primitive: $key,
            node: node.clone(),
            rc: Arc::new(node.id),
        };
        $grads.remove::<$B>(&key)
    }};
}

type AutodiffKey<B> = FloatTensor<Autodiff<B>>;

/// `(d x, d weight)` where `x: [batch, seq, hidden]`.
#[derive(Debug)]
struct GatherRmsNormBackward;

impl<B: ComputeBackend> Backward<B, 2> for GatherRmsNormBackward {
    /// Kept input rows `[batch, kept, hidden]` (or the output), rows, weight, `rstd`, `seq`,
    /// which of the two was saved.
    type State = (
        FloatTensor<B>,
        IntTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        usize,
        NormSaves,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_weight] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (saved, rows, weight, rstd, seq, saves) = ops.state;
        let grad_x = node_x
            .as_ref()
            .and_then(|node| take_grad!(B, grads, node, rstd.clone()));
        let (grad_x, grad_weight) = B::lemo_gather_rms_norm_backward(
            saved,
            rows,
            weight,
            rstd,
            grad,
            grad_x,
            seq,
            node_weight.is_some(),
            saves,
        );
        if let Some(node) = node_x {
            grads.register::<B>(node.id, grad_x);
        }
        if let (Some(node), Some(grad)) = (node_weight, grad_weight) {
            grads.register::<B>(node.id, grad);
        }
    }
}

pub(crate) fn gather_rms_norm<B: ComputeBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    rows: IntTensor<B>,
    weight: FloatTensor<Autodiff<B, C>>,
    eps: f32,
    saves: NormSaves,
) -> FloatTensor<Autodiff<B, C>> {
    let seq = x.shape()[1];
    match GatherRmsNormBackward
        .prepare::<C>([x.node.clone(), weight.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (out, rstd, kept) = B::lemo_gather_rms_norm_forward(
                x.primitive,
                rows.clone(),
                weight.primitive.clone(),
                eps,
                saves == NormSaves::Input,
            );
            let saved = kept.unwrap_or_else(|| out.clone());
            prep.finish((saved, rows, weight.primitive, rstd, seq, saves), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::lemo_gather_rms_norm(
            x.primitive,
            rows,
            weight.primitive,
            eps,
            saves,
        )),
    }
}

#[derive(Debug)]
struct ScatterAddBackward;

impl<B: ComputeBackend> Backward<B, 2> for ScatterAddBackward {
    /// Rows and the dtype of the values.
    type State = (IntTensor<B>, DType);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_values] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (rows, dtype) = ops.state;
        if let Some(node) = node_values {
            let grad_values = B::lemo_gather_rows(grad.clone(), rows);
            let grad_values = match grad_values.dtype() == dtype {
                true => grad_values,
                false => B::float_cast(grad_values, dtype.into()),
            };
            grads.register::<B>(node.id, grad_values);
        }
        if let Some(node) = node_x {
            grads.register::<B>(node.id, grad);
        }
    }
}

pub(crate) fn scatter_add_rows<B: ComputeBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    rows: IntTensor<B>,
    values: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let dtype = values.dtype();
    match ScatterAddBackward
        .prepare::<C>([x.node.clone(), values.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (rows.clone(), dtype),
            B::lemo_scatter_add_rows(x.primitive, rows, values.primitive),
        ),
        OpsKind::UnTracked(prep) => prep.finish(B::lemo_scatter_add_rows(
            x.primitive,
            rows,
            values.primitive,
        )),
    }
}

#[derive(Debug)]
struct GatherRowsBackward;

impl<B: ComputeBackend> Backward<B, 1> for GatherRowsBackward {
    /// Rows and the shape of `x`.
    type State = (IntTensor<B>, Shape);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (rows, shape) = ops.state;
        let Some(node) = node_x else { return };
        let grad_x = take_grad!(B, grads, &node, grad.clone())
            .unwrap_or_else(|| B::float_zeros(shape, &B::float_device(&grad), grad.dtype().into()));
        grads.register::<B>(node.id, B::lemo_scatter_add_rows(grad_x, rows, grad));
    }
}

pub(crate) fn gather_rows<B: ComputeBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    rows: IntTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    let shape = x.shape();
    match GatherRowsBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (rows.clone(), shape),
            B::lemo_gather_rows(x.primitive, rows),
        ),
        OpsKind::UnTracked(prep) => prep.finish(B::lemo_gather_rows(x.primitive, rows)),
    }
}
