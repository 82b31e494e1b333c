//! One block of a layer (attention or MLP) computed for every row outside the graph: what the
//! token-eliminating pass computes first, before the graph of the block's kept rows reuses it.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// A block's pass over every row. `P` names the products the graph of the kept rows reuses
/// instead of computing them again (each architecture has its own, beside its blocks).
pub struct BlockPass<B: Backend, P> {
    /// What the block adds to the residual stream, `[batch, seq, hidden]`.
    pub output: Tensor<B, 3>,
    /// Token-block informativeness `[batch, blocks]`, when asked for.
    pub scores: Option<Tensor<B, 2>>,
    pub products: P,
}
