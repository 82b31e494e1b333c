//! Permutation-free token movement (LeMo, "high-performance kernel optimization"): a block of a
//! token-sparse layer reads only its kept rows of the residual stream and adds its output back
//! into those rows, with no compacted copy of the input and no zero-padded copy of the output.
//!
//! - [`gather_rms_norm`]: `y[b, i] = RMSNorm(x[b, rows[b, i]])`, the gather fused into the norm
//!   that starts the block;
//! - [`scatter_add_rows`]: `x[b, rows[b, i]] += values[b, i]`, the padding and the residual add in
//!   one step, in place when `x` is not shared;
//! - [`gather_rows`]: `x[b, rows[b, i]]`, the plain gather (positions, MLP activations).
//!
//! `rows: [batch, kept]` holds distinct positions `0..seq` of each sequence (the scatter writes
//! each row once, without atomics); a token-sparse layer keeps them increasing, so that causal
//! attention over the kept rows stays causal, and a row permutation (the rows of a sequence
//! gathered from several ranks, put in position order) is a gather too. Under autodiff the
//! gather saves only the kept rows of `x`, never `x` itself, which is what lets the residual
//! stream be updated in place.

pub(crate) mod autodiff;
pub mod backend;
pub(crate) mod kernel;
pub mod reference;

use burn::tensor::{Int, Tensor, TensorPrimitive};

use crate::ComputeBackend;
use crate::fused::rms_norm::NormSaves;

/// RMSNorm of the kept rows: `[batch, kept, hidden]` from `x: [batch, seq, hidden]`,
/// `rows: [batch, kept]` and `weight: [hidden]` (differentiable in `x` and `weight`), keeping
/// what `saves` says for the backward pass.
pub fn gather_rms_norm<B: ComputeBackend>(
    x: Tensor<B, 3>,
    rows: Tensor<B, 2, Int>,
    weight: Tensor<B, 1>,
    eps: f32,
    saves: NormSaves,
) -> Tensor<B, 3> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_gather_rms_norm(
        x.into_primitive().tensor(),
        rows.into_primitive(),
        weight.into_primitive().tensor(),
        eps,
        saves,
    )))
}

/// `x` with `values: [batch, kept, hidden]` added into its rows `rows: [batch, kept]`; the other
/// rows are unchanged (differentiable in `x` and `values`).
pub fn scatter_add_rows<B: ComputeBackend>(
    x: Tensor<B, 3>,
    rows: Tensor<B, 2, Int>,
    values: Tensor<B, 3>,
) -> Tensor<B, 3> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_scatter_add_rows(
        x.into_primitive().tensor(),
        rows.into_primitive(),
        values.into_primitive().tensor(),
    )))
}

/// The rows `rows: [batch, kept]` of `x: [batch, seq, width]`, `[batch, kept, width]`
/// (differentiable in `x`).
pub fn gather_rows<B: ComputeBackend>(x: Tensor<B, 3>, rows: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_gather_rows(
        x.into_primitive().tensor(),
        rows.into_primitive(),
    )))
}
