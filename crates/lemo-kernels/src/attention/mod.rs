//! Causal attention: the options shared by the reference and the flash kernels, and the public
//! entry points the models call.

mod autodiff;
pub mod backend;
#[cfg(feature = "cuda")]
pub(crate) mod cudnn;
pub(crate) mod flash;
mod pieces;
pub mod reference;
pub mod ring;

#[cfg(feature = "cuda")]
pub use cudnn::set_cudnn_dq_accumulator_limit;
pub use flash::{FlashKernel, flash_kernel, set_flash_kernel, tensor_core_supported};
pub use pieces::{AttentionPiece, attention_pieces_with_value};

use burn::tensor::{Tensor, TensorPrimitive};

use crate::LemoBackend;

/// Sequence lengths the fused attention path (cuDNN on CUDA) takes are multiples of this; others
/// run on the CubeCL kernels (slower on Hopper), so token-sparse blocks round their kept rows up
/// to it where they can.
pub const FUSED_ATTENTION_LENGTH_MULTIPLE: usize = 128;

/// Which keys each query may attend to, beyond plain causality.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOptions {
    /// Multiplier of `q . k` before the softmax (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Hugging Face's sliding window: query at position `i` sees keys `j` with `i - j < window`.
    pub sliding_window: Option<usize>,
    /// Shifted sparse attention (LongLoRA's S2) with this group size: a query sees only the keys
    /// of its own group of `group_size` consecutive positions. Query heads in the second half
    /// (`head >= q_heads / 2`) use groups shifted by `group_size / 2`, so information flows
    /// between neighbouring groups through them. Unlike LongLoRA's `roll`, the shift does not
    /// wrap around: the first shifted group holds only `group_size / 2` tokens and no token
    /// ever sees a later one.
    pub shifted_group: Option<usize>,
}

impl AttentionOptions {
    /// Plain causal attention with the usual `1 / sqrt(head_dim)` scale.
    pub fn causal(head_dim: usize) -> Self {
        Self {
            scale: (head_dim as f32).powf(-0.5),
            sliding_window: None,
            shifted_group: None,
        }
    }

    /// Restrict every query to the last `window` positions (itself included).
    pub fn with_sliding_window(self, window: usize) -> Self {
        assert!(
            window > 0,
            "a sliding window must hold at least the query itself"
        );
        Self {
            sliding_window: Some(window),
            ..self
        }
    }

    /// Shifted sparse attention with groups of `group_size` tokens (see [`Self::shifted_group`]).
    pub fn with_shifted_groups(self, group_size: usize) -> Self {
        assert!(
            group_size >= 2,
            "S2 groups need at least two tokens to shift by half"
        );
        Self {
            shifted_group: Some(group_size),
            ..self
        }
    }

    /// The S2 groups of a sequence of `len` positions for query heads shifted by `shift` (see
    /// [`Self::group_shift`]): consecutive ranges cut where `(position + shift) % group == 0`.
    pub fn shifted_groups(
        len: usize,
        group: usize,
        shift: usize,
    ) -> impl Iterator<Item = std::ops::Range<usize>> {
        let mut start = 0;
        std::iter::from_fn(move || {
            (start < len).then(|| {
                let end = (((start + shift) / group + 1) * group - shift).min(len);
                let range = start..end;
                start = end;
                range
            })
        })
    }

    /// How far the S2 groups of query head `head` (out of `q_heads`) are shifted.
    pub fn group_shift(&self, head: usize, q_heads: usize) -> usize {
        match self.shifted_group {
            Some(group) if head >= q_heads / 2 => group / 2,
            _ => 0,
        }
    }
}

/// `softmax(q k^T * scale + mask) v` for `q: [batch, q_heads, q_len, head_dim]` and
/// `k, v: [batch, kv_heads, kv_len, head_dim]`, where `q_heads` is a multiple of `kv_heads`
/// (query head `h` reads key/value head `h / (q_heads / kv_heads)`) and the queries are the last
/// `q_len` positions of the `kv_len` keys (so `q_len < kv_len` is decoding with a KV cache).
/// On CubeCL backends this runs the flash kernels (O(S) memory, also under autodiff), or
/// cuDNN's on CUDA (S2 attention as causal attention over its groups, see `cudnn::segments`).
pub fn attention<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: AttentionOptions,
) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_attention(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        options,
    )))
}

/// Like [`attention`], also returning the natural-log `logsumexp` of each query's masked,
/// scaled scores, `[batch, q_heads, q_len]` (f32 on the kernel backends). Not differentiable.
pub fn attention_with_lse<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: AttentionOptions,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let (out, lse) = B::lemo_attention_forward(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        options,
    );
    (
        Tensor::from_primitive(TensorPrimitive::Float(out)),
        Tensor::from_primitive(TensorPrimitive::Float(lse)),
    )
}

/// `out`, the attention output of `q, k, v` computed earlier with its `lse` (e.g. the kept rows
/// of attention over more rows, then `q` holds those rows), with the backward pass of
/// [`attention`] at that output: the probabilities are recomputed from `lse`, so with `lse` of
/// attention over more keys the gradient is that attention's, restricted to the keys in `k`.
pub fn attention_with_value<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    (out, lse): (Tensor<B, 4>, Tensor<B, 3>),
    options: AttentionOptions,
) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_attention_with_value(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        out.into_primitive().tensor(),
        lse.into_primitive().tensor(),
        options,
    )))
}

/// Gradients `(dq, dk, dv)` of [`attention`] given its saved output and `lse` and the output
/// gradient: exposed so the backward kernels can be tested and benchmarked on their own.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    out: Tensor<B, 4>,
    lse: Tensor<B, 3>,
    grad_out: Tensor<B, 4>,
    options: AttentionOptions,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    let (dq, dk, dv) = B::lemo_attention_backward(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        out.into_primitive().tensor(),
        lse.into_primitive().tensor(),
        grad_out.into_primitive().tensor(),
        options,
    );
    let wrap = |t| Tensor::from_primitive(TensorPrimitive::Float(t));
    (wrap(dq), wrap(dk), wrap(dv))
}
