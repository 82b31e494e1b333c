//! The attention family of backend operations: causal attention forward and backward, and the
//! token-block informativeness LeMo selects by.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::ComputeBackend;
use crate::attention::{self, AttentionOptions};
use crate::backend::CpuBackend;
use crate::block_scores;

/// Attention and the block informativeness computed from its queries and keys.
///
/// Every default body is the plain Burn-tensor reference, so any backend is correct out of the
/// box; [`CubeBackend`] (wgpu, CUDA) overrides them with kernels and `Autodiff<B>` routes the
/// attention gradient through [`AttentionBackend::lemo_attention_backward`].
pub trait AttentionBackend: ComputeBackend {
    /// Causal (optionally sliding-window or shifted-sparse) attention; see [`attention::attention`].
    fn lemo_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> FloatTensor<Self> {
        attention::reference::attention_primitive::<Self>(q, k, v, options)
    }

    /// Attention output and the `logsumexp` of each query's scores, `[batch, q_heads, q_len]`:
    /// what the backward pass needs to recompute the probabilities.
    fn lemo_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention::reference::attention_with_lse_primitive::<Self>(q, k, v, options)
    }

    /// `out`, attention's output computed earlier with its `lse`; see
    /// [`attention::attention_with_value`].
    fn lemo_attention_with_value(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        _lse: FloatTensor<Self>,
        _options: AttentionOptions,
    ) -> FloatTensor<Self> {
        out
    }

    /// `out`, attention made of independent pieces computed earlier with its `lse`; see
    /// [`attention::attention_pieces_with_value`].
    fn lemo_attention_pieces_with_value(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        _lse: FloatTensor<Self>,
        _pieces: Vec<attention::AttentionPiece>,
        _options: AttentionOptions,
    ) -> FloatTensor<Self> {
        out
    }

    /// Gradients `(dq, dk, dv)` of attention from its inputs, output, `lse` and output gradient.
    #[allow(clippy::too_many_arguments)]
    fn lemo_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        attention::reference::attention_backward_primitive::<Self>(
            q, k, v, out, lse, grad_out, options,
        )
    }

    /// Block informativeness `[batch, q_blocks, k_blocks]` over the query rows `query_stride`
    /// samples; see [`block_scores::block_scores`].
    fn lemo_block_scores(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        block_size: usize,
        scale: f32,
        query_stride: usize,
    ) -> FloatTensor<Self> {
        let q = sampled::<Self>(q, query_stride);
        block_scores::reference::block_scores_primitive::<Self>(q, k, block_size, scale)
    }
}

impl AttentionBackend for CpuBackend {}

impl<R, F, I, BT> AttentionBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn lemo_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> FloatTensor<Self> {
        Self::lemo_attention_forward(q, k, v, options).0
    }

    fn lemo_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        #[cfg(feature = "cuda")]
        if attention::flash_kernel() == attention::FlashKernel::Cudnn
            && let Some(result) = attention::cudnn::try_forward(&q, &k, &v, &options)
        {
            return result;
        }
        attention::flash::forward::<R, F, I, BT>(q, k, v, options)
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
        #[cfg(feature = "cuda")]
        if attention::flash_kernel() == attention::FlashKernel::Cudnn
            && let Some(result) =
                attention::cudnn::try_backward(&q, &k, &v, &out, &lse, &grad_out, &options)
        {
            return result;
        }
        attention::flash::backward::<R, F, I, BT>(q, k, v, out, lse, grad_out, options)
    }

    /// On tensor-core devices the tensor-core tile kernel ([`block_scores::mma`], blocks of a
    /// multiple of its 64-token tiles, reading only the sampled query rows), else the GEMM
    /// strips of [`block_scores::chunked`] (cuBLASLt, `S x strip` scores at a time); elsewhere
    /// the tile kernel, which reads each Q/K tile once per head without tensor cores. The last
    /// two read every row, the rows a stride leaves out set to 0.
    fn lemo_block_scores(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        block_size: usize,
        scale: f32,
        query_stride: usize,
    ) -> FloatTensor<Self> {
        let head_dim = q.meta.shape()[3];
        let tensor_cores = attention::tensor_core_supported(&q.client, q.dtype, head_dim);
        if tensor_cores
            && block_size.is_multiple_of(block_scores::mma::TILE)
            && block_scores::mma::QUERY_STRIDES.contains(&query_stride)
        {
            let tiles_per_block = block_size / block_scores::mma::TILE;
            let tiles = |len: usize| len.div_ceil(block_size) * tiles_per_block;
            let tiles = [tiles(q.meta.shape()[2]), tiles(k.meta.shape()[2])];
            let tile_max = block_scores::mma::tile_maxima(q, k, scale, tiles, query_stride);
            return block_scores::kernel::pool_tile_maxima::<R, F, I, BT>(
                tile_max,
                tiles_per_block,
            );
        }
        let q = sampled::<Self>(q, query_stride);
        if tensor_cores {
            let wrap = |t| Tensor::<Self, 4>::from_primitive(TensorPrimitive::Float(t));
            return block_scores::chunked::block_scores(wrap(q), wrap(k), block_size, scale)
                .into_primitive()
                .tensor();
        }
        block_scores::kernel::block_scores::<R, F, I, BT>(q, k, block_size, scale)
    }
}

/// `q` with the query rows `query_stride` leaves out set to 0
/// ([`block_scores::only_sampled_query_rows`]).
fn sampled<B: ComputeBackend>(q: FloatTensor<B>, query_stride: usize) -> FloatTensor<B> {
    let q = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(q));
    block_scores::only_sampled_query_rows(q, query_stride)
        .into_primitive()
        .tensor()
}
