//! Autodiff for attention: the forward saves `q, k, v`, the output and the `lse` (O(S) memory)
//! and the backward calls the inner backend's [`AttentionBackend::lemo_attention_backward`], so no
//! `S x S` score matrix is kept between the passes.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use super::AttentionOptions;
use super::backend::AttentionBackend;
use super::pieces::{AttentionPiece, pieces_backward};
use crate::LemoBackend;

#[derive(Debug)]
struct AttentionBackward;

impl<B: LemoBackend> Backward<B, 3> for AttentionBackward {
    /// `q, k, v, out, lse, options`.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        AttentionOptions,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad_out = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse, options) = ops.state;
        let (grad_q, grad_k, grad_v) =
            B::lemo_attention_backward(q, k, v, out, lse, grad_out, options);
        for (node, grad) in [(node_q, grad_q), (node_k, grad_k), (node_v, grad_v)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

#[derive(Debug)]
struct PiecesBackward;

impl<B: LemoBackend> Backward<B, 3> for PiecesBackward {
    /// `q, k, v, out, lse, pieces, options`.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        Vec<AttentionPiece>,
        AttentionOptions,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad_out = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse, pieces, options) = ops.state;
        let wrap = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
        let (grad_q, grad_k, grad_v) = pieces_backward(
            wrap(q),
            wrap(k),
            wrap(v),
            wrap(out),
            Tensor::from_primitive(TensorPrimitive::Float(lse)),
            wrap(grad_out),
            &pieces,
            options,
        );
        for (node, grad) in [(node_q, grad_q), (node_k, grad_k), (node_v, grad_v)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad.into_primitive().tensor());
            }
        }
    }
}

impl<B: LemoBackend, C: CheckpointStrategy> AttentionBackend for Autodiff<B, C> {
    fn lemo_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> FloatTensor<Self> {
        record_attention::<B, C>(q, k, v, options, None)
    }

    fn lemo_attention_with_value(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> FloatTensor<Self> {
        record_attention::<B, C>(q, k, v, options, Some((out.primitive, lse.primitive)))
    }

    fn lemo_attention_pieces_with_value(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        pieces: Vec<AttentionPiece>,
        options: AttentionOptions,
    ) -> FloatTensor<Self> {
        match PiecesBackward
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = (
                    q.primitive,
                    k.primitive,
                    v.primitive,
                    out.primitive.clone(),
                    lse.primitive,
                    pieces,
                    options,
                );
                prep.finish(state, out.primitive)
            }
            OpsKind::UnTracked(prep) => prep.finish(out.primitive),
        }
    }

    fn lemo_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (out, lse) =
            B::lemo_attention_forward(Self::inner(q), Self::inner(k), Self::inner(v), options);
        (Self::from_inner(out), Self::from_inner(lse))
    }

    fn lemo_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (grad_q, grad_k, grad_v) = B::lemo_attention_backward(
            Self::inner(q),
            Self::inner(k),
            Self::inner(v),
            Self::inner(out),
            Self::inner(lse),
            Self::inner(grad_out),
            options,
        );
        (
            Self::from_inner(grad_q),
            Self::from_inner(grad_k),
            Self::from_inner(grad_v),
        )
    }

    fn lemo_block_scores(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        block_size: usize,
        scale: f32,
        query_stride: usize,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::lemo_block_scores(
            Self::inner(q),
            Self::inner(k),
            block_size,
            scale,
            query_stride,
        ))
    }
}

/// Attention's node over `q, k, v`, with its output `known` (the output and its `lse`, computed
/// earlier) or computed here (the `lse` only when the graph keeps it).
fn record_attention<B: LemoBackend, C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<B, C>>,
    k: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    options: AttentionOptions,
    known: Option<(FloatTensor<B>, FloatTensor<B>)>,
) -> FloatTensor<Autodiff<B, C>> {
    match AttentionBackward
        .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (out, lse) = known.unwrap_or_else(|| {
                B::lemo_attention_forward(
                    q.primitive.clone(),
                    k.primitive.clone(),
                    v.primitive.clone(),
                    options,
                )
            });
            let state = (
                q.primitive,
                k.primitive,
                v.primitive,
                out.clone(),
                lse,
                options,
            );
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(match known {
            Some((out, _)) => out,
            None => B::lemo_attention(q.primitive, k.primitive, v.primitive, options),
        }),
    }
}
