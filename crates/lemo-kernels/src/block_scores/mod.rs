//! Block informativeness of the attention score matrix (LeMo, section "exact scores"):
//! for blocks `B_mn` of `block_size` queries x `block_size` keys,
//! `I(B_mn) = max over (i, j) in B_mn of sum over heads h of relu(q^h_i . k^h_j * scale) / H`,
//! with the heads summed before the max and hidden (future) pairs counting as 0; blocks above
//! the diagonal (`n > m`) are 0. Token-block informativeness is reduced from these by
//! `lemo-sparsity`.
//!
//! With a query stride `s > 1` the maximum runs over the sampled query rows alone
//! ([`sampled_query_rows`]: the last row of every `s`), the others counting as 0: `1 / s` of the
//! work, and an estimate of the exact scores from below (a block's largest pair is often found
//! again among a quarter of its queries, and a token block's informativeness averages over
//! every query block that sees it).

pub mod chunked;
pub(crate) mod kernel;
pub(crate) mod mma;
pub mod reference;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use crate::LemoBackend;

/// Block scores `[batch, q_blocks, k_blocks]` of `q: [batch, q_heads, rows, head_dim]` and
/// `k: [batch, kv_heads, keys, head_dim]` (GQA: query head `h` reads key head
/// `h / (q_heads / kv_heads)`), with the `1 / sqrt(head_dim)` scale, over the query rows
/// `query_stride` samples (1: every row, the exact scores). The queries are the last `rows`
/// positions of the `keys` (as in [`crate::attention::attention`]), starting on a block boundary:
/// with fewer queries than keys this is one slice of the query blocks of the whole matrix, at
/// the work of that slice alone (a rank's share of a sequence split over ranks). A last partial
/// block holds the remaining tokens. Computed tile by tile on the kernel backends: O(S) memory.
pub fn block_scores<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    block_size: usize,
    query_stride: usize,
) -> Tensor<B, 3> {
    assert!(query_stride >= 1, "a query stride of 0 reads no row");
    let offset = query_offset(q.dims()[2], k.dims()[2], block_size);
    assert!(
        offset.is_multiple_of(query_stride),
        "sampled block scores from query position {offset} would not read the last row of every {query_stride}"
    );
    let scale = (q.dims()[3] as f32).powf(-0.5);
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_block_scores(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        block_size,
        scale,
        query_stride,
    )))
}

/// Where the `rows` queries of block scores start among their `keys` (the queries are the last
/// rows): a multiple of `block_size`, so that query blocks are whole blocks of the sequence.
pub(crate) fn query_offset(rows: usize, keys: usize, block_size: usize) -> usize {
    assert!(
        rows <= keys && (keys - rows).is_multiple_of(block_size),
        "block scores of {rows} queries over {keys} keys: the queries must be the last rows, from a multiple of the {block_size}-token block"
    );
    keys - rows
}

/// The query rows block scores read with `query_stride` among `seq`: `s - 1, 2 s - 1, ...`, the
/// last row of every `s`, so that a block's last row, which sees all of the block's keys, is
/// read (every row for a stride of 1).
pub fn sampled_query_rows(seq: usize, query_stride: usize) -> impl Iterator<Item = usize> {
    (query_stride - 1..seq).step_by(query_stride)
}

/// `q: [batch, heads, seq, head_dim]` with every row [`sampled_query_rows`] leaves out set to 0:
/// such a row's scores are 0 and change no maximum, so exact block scores of the result are the
/// sampled scores of `q` (how the paths without a strided kernel compute them).
pub fn only_sampled_query_rows<B: Backend>(q: Tensor<B, 4>, query_stride: usize) -> Tensor<B, 4> {
    if query_stride == 1 {
        return q;
    }
    let seq = q.dims()[2];
    let mut keep = vec![0.0f32; seq];
    for row in sampled_query_rows(seq, query_stride) {
        keep[row] = 1.0;
    }
    let keep = Tensor::<B, 4>::from_data(TensorData::new(keep, [1, 1, seq, 1]), &q.device())
        .cast(q.dtype());
    q * keep
}
