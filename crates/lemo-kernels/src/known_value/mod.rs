//! Operations whose value the caller already has and whose backward pass is that of a cheaper
//! graph. A token-sparse block computes its output for every row outside the graph (so the
//! forward pass, and the loss, stay exact), then builds its graph on the kept rows only with
//! these: its saved activations and its backward pass cover the kept rows, and no product of
//! the forward pass is computed twice.

pub(crate) mod autodiff;

use burn::tensor::{Tensor, TensorPrimitive};

use crate::ComputeBackend;

/// `value`, which must be `lhs x rhs` (e.g. rows of a product computed for every row), with the
/// backward pass of [`crate::gemm::matmul`]: the product itself is not computed again.
pub fn matmul_with_value<B: ComputeBackend, const D: usize>(
    lhs: Tensor<B, D>,
    rhs: Tensor<B, D>,
    value: Tensor<B, D>,
) -> Tensor<B, D> {
    assert_eq!(
        value.dims()[D - 1],
        rhs.dims()[D - 1],
        "the value of lhs x rhs has rhs's columns"
    );
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_matmul_with_value(
        lhs.into_primitive().tensor(),
        rhs.into_primitive().tensor(),
        value.into_primitive().tensor(),
    )))
}

/// `value` in the forward pass; in the backward pass its gradient goes to `graph` unchanged
/// (`graph` is what the gradient is taken through, `value` what the pass computes).
pub fn with_value<B: ComputeBackend, const D: usize>(
    graph: Tensor<B, D>,
    value: Tensor<B, D>,
) -> Tensor<B, D> {
    assert_eq!(graph.dims(), value.dims(), "a value of the graph's shape");
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_with_value(
        graph.into_primitive().tensor(),
        value.into_primitive().tensor(),
    )))
}
