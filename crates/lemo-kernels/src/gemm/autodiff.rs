//! Autodiff of the matrix product: `d lhs = grad rhs^T`, `d rhs = lhs^T grad`, both through
//! [`crate::GemmBackend::lemo_matmul`] on transposed views (no copies), and only for the operands
//! that need a gradient (a frozen weight costs one product in the backward pass, not two).

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};

use crate::ComputeBackend;

#[derive(Debug)]
struct MatmulBackward;

impl<B: ComputeBackend> Backward<B, 2> for MatmulBackward {
    /// `lhs` (kept when rhs needs a gradient), `rhs` (kept when lhs needs one), and both shapes.
    type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>, Shape, Shape);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let (lhs, rhs, lhs_shape, rhs_shape) = ops.state;
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            |grad| {
                let rhs = rhs.expect("rhs kept for the lhs gradient");
                let grad = B::lemo_matmul(grad, B::float_transpose(rhs));
                sum_broadcast::<B>(grad, &lhs_shape)
            },
            |grad| {
                let lhs = lhs.expect("lhs kept for the rhs gradient");
                let rank = rhs_shape.num_dims();
                let grad_dims = grad.shape().to_vec();
                let rhs_batch: usize = rhs_shape[..rank - 2].iter().product();
                let grad_batch: usize = grad_dims[..rank - 2].iter().product();
                let lhs_batch: usize = lhs_shape[..rank - 2].iter().product();
                if rhs_batch == 1 && grad_batch > 1 && lhs_batch == grad_batch {
                    // A rhs shared by the batch: one tall `K x (batch M)` product.
                    let rows = grad_batch * grad_dims[rank - 2];
                    let flat = |cols: usize| {
                        let mut dims = vec![1; rank];
                        dims[rank - 2] = rows;
                        dims[rank - 1] = cols;
                        Shape::from(dims)
                    };
                    let lhs = B::float_reshape(lhs, flat(lhs_shape[rank - 1]));
                    let grad = B::float_reshape(grad, flat(grad_dims[rank - 1]));
                    B::lemo_matmul(B::float_transpose(lhs), grad)
                } else {
                    let grad = B::lemo_matmul(B::float_transpose(lhs), grad);
                    sum_broadcast::<B>(grad, &rhs_shape)
                }
            },
        );
    }
}

/// Sums `grad` over the batch dimensions in which `target` has size 1.
fn sum_broadcast<B: ComputeBackend>(mut grad: FloatTensor<B>, target: &Shape) -> FloatTensor<B> {
    let dims = grad.shape().to_vec();
    for (dim, (&size, &wanted)) in dims.iter().zip(target.iter()).enumerate() {
        if wanted == 1 && size != 1 {
            grad = B::float_sum_dim(grad, dim);
        }
    }
    grad
}

pub(crate) fn matmul<B: ComputeBackend, C: CheckpointStrategy>(
    lhs: FloatTensor<Autodiff<B, C>>,
    rhs: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let output = B::lemo_matmul(lhs.primitive.clone(), rhs.primitive.clone());
    record_matmul::<B, C>(lhs, rhs, output)
}

/// `output` (the value of `lhs x rhs`) as the product's node: each operand is kept only for the
/// other's gradient.
pub(crate) fn record_matmul<B: ComputeBackend, C: CheckpointStrategy>(
    lhs: FloatTensor<Autodiff<B, C>>,
    rhs: FloatTensor<Autodiff<B, C>>,
    output: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    let (lhs_tracked, rhs_tracked) = (lhs.is_tracked(), rhs.is_tracked());
    match MatmulBackward
        .prepare::<C>([lhs.node.clone(), rhs.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = (
                rhs_tracked.then(|| lhs.primitive.clone()),
                lhs_tracked.then(|| rhs.primitive.clone()),
                lhs.primitive.shape(),
                rhs.primitive.shape(),
            );
            prep.finish(state, output)
        }
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}
