//! One block of a layer (attention or MLP) computed for every row outside the graph: what the
//! token-eliminating pass computes first, before the graph of the block's kept rows reuses it.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// `t` outside the autodiff graph, for the passes over every row. Burn's `detach` keeps a leaf's
/// `require_grad`, so a detached parameter (an adapter, LongLoRA's trainable norms) or a detached
/// layer input (a kept layer's leaf under an activation plan) would still record every operation
/// on it, and what they save, in the graph until the step's backward pass: a full-width tensor
/// per norm and layer, or two per adapted projection.
pub fn untracked<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    t.set_require_grad(false)
}

/// A block's pass over every row. `P` names the products the graph of the kept rows reuses
/// instead of computing them again (each architecture has its own, beside its blocks).
pub struct BlockPass<B: Backend, P> {
    /// What the block adds to the residual stream, `[batch, seq, hidden]`.
    pub output: Tensor<B, 3>,
    /// Token-block informativeness `[batch, blocks]`, when asked for.
    pub scores: Option<Tensor<B, 2>>,
    pub products: P,
}
