//! Token embedding lookup, shared by every architecture.

use burn::tensor::{Int, Tensor, backend::Backend};

/// Rows of `table: [vocab, dim]` for `tokens: [batch, len]`.
pub(crate) fn embed<B: Backend>(table: &Tensor<B, 2>, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    let [batch, len] = tokens.dims();
    let [_, dim] = table.dims();
    table
        .clone()
        .select(0, tokens.reshape([batch * len]))
        .reshape([batch, len, dim])
}
