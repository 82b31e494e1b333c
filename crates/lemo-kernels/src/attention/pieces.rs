//! Attention made of independent pieces, with its output known: the value is one tensor (no
//! copy of it per piece), the backward pass runs each piece's attention backward on its slices.
//! S2 attention over kept rows is such a sum of pieces (one causal attention per run of kept rows
//! in a group and half of the heads); a graph built from per-piece nodes and concatenations
//! instead would save a second copy of the output and pay a full-size gradient per slice.

use std::ops::Range;

use burn::tensor::{Tensor, TensorPrimitive};

use super::{AttentionOptions, attention_backward};
use crate::LemoBackend;

/// One causal attention inside a larger one: the query heads `heads` of sequence `sequence` on
/// the rows `rows`, which read the keys and values of the same rows of those heads' key/value
/// heads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionPiece {
    pub sequence: usize,
    pub heads: Range<usize>,
    pub rows: Range<usize>,
}

impl AttentionPiece {
    /// The key/value heads the piece's query heads read, `per_kv` query heads to one.
    fn kv_heads(&self, per_kv: usize) -> Range<usize> {
        assert!(
            self.heads.start.is_multiple_of(per_kv) && self.heads.end.is_multiple_of(per_kv),
            "attention piece heads {:?} split groups of {per_kv} query heads",
            self.heads
        );
        self.heads.start / per_kv..self.heads.end / per_kv
    }
}

/// `out`, the output of attention over `q: [batch, q_heads, rows, head_dim]` and
/// `k, v: [batch, kv_heads, rows, head_dim]` computed earlier with its `lse`
/// (`[batch, q_heads, rows]`), where the attention is the sum of independent causal `pieces`
/// ([`AttentionPiece`]) that cover every query row and read disjoint key/value rows. Its backward
/// pass is each piece's [`super::attention_with_value`] backward: with `lse` of attention over
/// more keys, that attention's gradient restricted to the keys in `k`.
/// Work: the backward pass of each piece, written into one gradient per input.
pub fn attention_pieces_with_value<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    (out, lse): (Tensor<B, 4>, Tensor<B, 3>),
    pieces: Vec<AttentionPiece>,
    options: AttentionOptions,
) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_attention_pieces_with_value(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        out.into_primitive().tensor(),
        lse.into_primitive().tensor(),
        pieces,
        options,
    )))
}

/// Gradients `(dq, dk, dv)` of [`attention_pieces_with_value`] from its saved inputs and the
/// output gradient: each piece's attention backward, written into its slices.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pieces_backward<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    out: Tensor<B, 4>,
    lse: Tensor<B, 3>,
    grad_out: Tensor<B, 4>,
    pieces: &[AttentionPiece],
    options: AttentionOptions,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    let per_kv = q.dims()[1] / k.dims()[1];
    let (mut dq, mut dk, mut dv) = (q.zeros_like(), k.zeros_like(), v.zeros_like());
    for piece in pieces {
        let sequence = piece.sequence..piece.sequence + 1;
        let rows = piece.rows.clone();
        let query = [sequence.clone(), piece.heads.clone(), rows.clone()];
        let key = [sequence, piece.kv_heads(per_kv), rows];
        let (piece_dq, piece_dk, piece_dv) = attention_backward(
            q.clone().slice(query.clone()),
            k.clone().slice(key.clone()),
            v.clone().slice(key.clone()),
            out.clone().slice(query.clone()),
            lse.clone().slice(query.clone()),
            grad_out.clone().slice(query.clone()),
            options,
        );
        dq = dq.slice_assign(query, piece_dq);
        dk = dk.slice_assign(key.clone(), piece_dk);
        dv = dv.slice_assign(key, piece_dv);
    }
    (dq, dk, dv)
}
