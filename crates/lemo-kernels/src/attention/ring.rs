//! Causal attention over a sequence split across ranks (context parallelism), computed as a ring
//! of key/value slices computes it: the definition the distributed path is checked against.
//!
//! Each rank holds the query, key and value rows of its own positions ([`zigzag_positions`]
//! balances the causal work). A rank attends its queries to one rank's keys at a time, in the
//! order a ring delivers them, and folds each partial result into a running one by the
//! log-sum-exp of each query row ([`merge`]): with `m = max(lse_a, lse_b)`, weights
//! `w = e^(lse - m)`, `out = (w_a out_a + w_b out_b) / (w_a + w_b)` and
//! `lse = m + ln(w_a + w_b)`. Masks compare original positions, so every rank ends with causal
//! attention over the whole sequence for its rows, and gradients reach every rank's keys and
//! values through the merges. Each pair of slices is materialized: O(rows^2) memory per head.

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor, TensorData};

/// The partial log-sum-exp of a query row that sees none of a slice's keys: finite, so that
/// merges stay finite, and so small that the partial carries no weight in them.
const UNSEEN: f32 = -1.0e30;

/// The positions each of `ranks` ranks holds of a sequence of `seq` tokens, zig-zag: the
/// sequence in `2 * ranks` equal chunks, rank `r` holding chunk `r` and chunk `2 ranks - 1 - r`,
/// so that every rank has as many causal query-key pairs. `seq` must be a multiple of
/// `2 * ranks`.
pub fn zigzag_positions(seq: usize, ranks: usize) -> Vec<Vec<usize>> {
    assert!(
        ranks > 0 && seq.is_multiple_of(2 * ranks),
        "a zig-zag split of {seq} tokens over {ranks} ranks needs a multiple of {} tokens",
        2 * ranks.max(1)
    );
    let chunk = seq / (2 * ranks);
    (0..ranks)
        .map(|rank| {
            let mirror = 2 * ranks - 1 - rank;
            (rank * chunk..(rank + 1) * chunk)
                .chain(mirror * chunk..(mirror + 1) * chunk)
                .collect()
        })
        .collect()
}

/// One rank's rows: `[batch, heads, rows, head_dim]` queries, keys and values (K/V heads
/// dividing the query heads) at increasing sequence `positions`.
#[derive(Debug, Clone)]
pub struct RankSlice<B: Backend> {
    pub q: Tensor<B, 4>,
    pub k: Tensor<B, 4>,
    pub v: Tensor<B, 4>,
    pub positions: Vec<usize>,
}

/// A partial attention result: the output `[batch, q_heads, rows, head_dim]` and the natural-log
/// log-sum-exp of each query row's visible scores `[batch, q_heads, rows]`.
pub type Partial<B> = (Tensor<B, 4>, Tensor<B, 3>);

/// `[q_rows, k_rows]`: true where the query may not see the key (it comes later).
fn hidden_by_position<B: Backend>(
    q_positions: &[usize],
    k_positions: &[usize],
    device: &B::Device,
) -> Tensor<B, 2, Bool> {
    let positions = |p: &[usize]| {
        let values: Vec<i64> = p.iter().map(|&p| p as i64).collect();
        Tensor::<B, 1, Int>::from_data(TensorData::new(values, [p.len()]), device)
    };
    let (q_rows, k_rows) = (q_positions.len(), k_positions.len());
    let query = positions(q_positions)
        .reshape([q_rows, 1])
        .expand([q_rows, k_rows]);
    let key = positions(k_positions)
        .reshape([1, k_rows])
        .expand([q_rows, k_rows]);
    key.greater(query)
}

/// Attention of `queries` to the keys and values of `keys`, causal by position, scores scaled by
/// `scale`. A row that sees none of the keys gets a zero output and a log-sum-exp of [`UNSEEN`].
pub fn partial_attention<B: Backend>(
    queries: &RankSlice<B>,
    keys: &RankSlice<B>,
    scale: f32,
) -> Partial<B> {
    let [batch, q_heads, q_rows, head_dim] = queries.q.dims();
    let [_, kv_heads, k_rows, _] = keys.k.dims();
    let group = q_heads / kv_heads;
    // The query heads of one K/V head fold into rows (row `g * q_rows + i`), as in the reference.
    let folded = [batch, kv_heads, group * q_rows, k_rows];
    let q = queries
        .q
        .clone()
        .reshape([batch, kv_heads, group * q_rows, head_dim]);
    let hidden = hidden_by_position::<B>(&queries.positions, &keys.positions, &q.device())
        .reshape([1, 1, 1, q_rows, k_rows])
        .expand([batch, kv_heads, group, q_rows, k_rows])
        .reshape(folded);
    let scores = q
        .matmul(keys.k.clone().swap_dims(2, 3))
        .mul_scalar(scale)
        .mask_fill(hidden.clone(), UNSEEN);
    let row_max = scores.clone().max_dim(3);
    let weights = (scores - row_max.clone()).exp().mask_fill(hidden, 0.0);
    let sum = weights.clone().sum_dim(3).clamp_min(f32::MIN_POSITIVE);
    let out =
        (weights.matmul(keys.v.clone()) / sum.clone()).reshape([batch, q_heads, q_rows, head_dim]);
    let lse = (sum.log() + row_max).reshape([batch, q_heads, q_rows]);
    (out, lse)
}

/// Two partial results over disjoint sets of keys folded into one over both (see the module
/// docs).
pub fn merge<B: Backend>((out_a, lse_a): Partial<B>, (out_b, lse_b): Partial<B>) -> Partial<B> {
    let [batch, heads, rows] = lse_a.dims();
    let top = lse_a.clone().max_pair(lse_b.clone());
    let weight_a = (lse_a - top.clone()).exp();
    let weight_b = (lse_b - top.clone()).exp();
    let total = weight_a.clone() + weight_b.clone();
    let column = |t: Tensor<B, 3>| t.reshape([batch, heads, rows, 1]);
    let out = (out_a * column(weight_a) + out_b * column(weight_b)) / column(total.clone());
    (out, top + total.log())
}

/// Each rank's attention output for its rows: rank `r`'s queries against the key/value slices
/// of ranks `r, r - 1, ..., r + 1` (mod the rank count), the order in which a ring passing the
/// slices to the next rank delivers them, merged as they arrive.
pub fn ring_attention<B: Backend>(slices: &[RankSlice<B>], scale: f32) -> Vec<Tensor<B, 4>> {
    let ranks = slices.len();
    (0..ranks)
        .map(|rank| {
            let queries = &slices[rank];
            let partial = |step: usize| {
                partial_attention(queries, &slices[(rank + ranks - step) % ranks], scale)
            };
            let (out, _) = (1..ranks).fold(partial(0), |merged, step| merge(merged, partial(step)));
            out
        })
        .collect()
}
