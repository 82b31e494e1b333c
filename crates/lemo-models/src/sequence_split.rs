//! One rank's share of a sequence split over the ranks of a sequence group (context
//! parallelism): the rank holds the rows of its positions through every layer (projections, MLP,
//! loss), and attention gathers the keys and values of every position from the group.
//!
//! The split is zig-zag: the sequence in `2 * ranks` equal chunks, rank `r` holding chunk `r`
//! and chunk `2 ranks - 1 - r`, so every rank has as many causal query-key pairs and none waits
//! on another. Each chunk's queries attend to the keys of every position up to its own end, as
//! causal attention over the last rows of a longer sequence does, so the fused kernels (and
//! their backward passes) run unchanged. With grouped-query attention the keys and values are
//! `heads / kv_heads` times smaller than the queries, which makes gathering them cheaper than
//! exchanging queries (Ulysses) or passing slices around a ring; the cost is every position's
//! keys and values on every rank, for each layer whose graph is kept.
//!
//! Token elimination splits too: each rank scores its rows' token blocks (attention: its query
//! blocks' column sums over every key block; MLP: its own blocks), the scores of the whole
//! sequence are assembled from all ranks, every rank selects the same kept blocks from them,
//! and each rank's share is topped up to as many blocks as the rank keeping most
//! ([`KeptRows::balanced`]). The kept rows' graph attends to the kept keys and values of every
//! rank, gathered the same way; the forward pass stays exact.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use lemo_kernels::attention::ring::zigzag_positions;
use lemo_kernels::attention::{attention, attention_with_lse, attention_with_value};
use lemo_kernels::block_scores::block_scores;
use lemo_kernels::exchange::{Exchange, all_gather_rows};
use lemo_kernels::token_movement::gather_rows;
use lemo_kernels::{AttentionOptions, LemoBackend};
use lemo_sparsity::KeptRows;
use lemo_sparsity::calibration::Block;
use lemo_sparsity::informativeness::{BlockScoring, column_means};

use crate::token_plan::BlockRows;
use crate::{Error, Result};

/// This rank's positions of a sequence split zig-zag over a sequence group.
#[derive(Debug, Clone)]
pub struct SequenceSplit {
    seq: usize,
    /// The rank's positions, in two chunks, increasing.
    chunks: [Range<usize>; 2],
    /// For each position, its row among the rows gathered from the ranks in rank order.
    gathered_row: Vec<i64>,
    exchange: Exchange,
}

impl SequenceSplit {
    /// The zig-zag share of `exchange`'s rank of a sequence of `seq` tokens, which must be a
    /// multiple of twice the group's rank count.
    pub fn zigzag(seq: usize, exchange: Exchange) -> Result<Self> {
        let ranks = exchange.ranks();
        if ranks == 0 || seq == 0 || !seq.is_multiple_of(2 * ranks) {
            return Err(Error::Config(format!(
                "a sequence of {seq} tokens does not split over {ranks} ranks: context parallelism needs a multiple of {} tokens (twice the ranks)",
                2 * ranks.max(1)
            )));
        }
        let layout = zigzag_positions(seq, ranks);
        // The ranks' rows gathered in rank order: each position's row is its index there.
        let mut gathered_row = vec![0; seq];
        for (row, &position) in layout.concat().iter().enumerate() {
            gathered_row[position] = row as i64;
        }
        let own = &layout[exchange.rank()];
        let chunk = seq / (2 * ranks);
        let chunk_from = |first: usize| own[first]..own[first] + chunk;
        Ok(Self {
            seq,
            chunks: [chunk_from(0), chunk_from(chunk)],
            gathered_row,
            exchange,
        })
    }

    /// Waits for every rank of the group: before each backward pass through a layer of a split
    /// sequence (see [`Exchange::before_backward`]).
    pub fn before_backward(&self) {
        self.exchange.before_backward();
    }

    /// Tokens in the whole sequence.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// The rank's positions, increasing.
    pub fn positions(&self) -> Vec<usize> {
        self.chunks.iter().flat_map(|chunk| chunk.clone()).collect()
    }

    /// The rank's columns of `t: [batch, seq]` (token ids, labels, targets).
    pub fn local_columns<B: Backend>(&self, t: Tensor<B, 2, Int>) -> Tensor<B, 2, Int> {
        let positions: Vec<i64> = self.positions().iter().map(|&p| p as i64).collect();
        let len = positions.len();
        let indices = Tensor::from_data(TensorData::new(positions, [len]), &t.device());
        t.select(1, indices)
    }

    /// The rank holding `position`, and its row among that rank's rows.
    fn owner(&self, position: usize) -> (usize, usize) {
        let ranks = self.exchange.ranks();
        let chunk = self.seq / (2 * ranks);
        let row = self.gathered_row[position] as usize;
        (row / (2 * chunk), row % (2 * chunk))
    }

    /// This rank's row holding `position`, if it holds it.
    fn local_row(&self, position: usize) -> Option<usize> {
        let (owner, row) = self.owner(position);
        (owner == self.exchange.rank()).then_some(row)
    }

    /// Every rank's `local: [rows, width]` stacked in rank order (see [`all_gather_rows`]).
    fn gather<B: LemoBackend>(&self, local: Tensor<B, 2>) -> Tensor<B, 2> {
        all_gather_rows(local, &self.exchange)
    }

    /// Every rank's keys and values `[batch, kv_heads, rows, head_dim]` (as many rows on each),
    /// in one collective (so every rank makes the same calls in the same order, in the backward
    /// pass too), then the rows `order` names of the rank-ordered rows, each at most once. The
    /// reordering is a row gather whose backward pass writes each row once (a `select`'s
    /// backward would accumulate with one thread per column, looping over every row).
    fn gather_rows_of<B: LemoBackend>(
        &self,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        order: Vec<i64>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let [batch, kv_heads, rows, head_dim] = k.dims();
        let width = batch * kv_heads * 2 * head_dim;
        let local = Tensor::cat(vec![k, v], 3)
            .permute([2, 0, 1, 3])
            .reshape([rows, width]);
        let gathered = self.gather(local);
        let len = order.len();
        let order = Tensor::from_data(TensorData::new(order, [1, len]), &gathered.device());
        let both = gather_rows(gathered.unsqueeze_dim::<3>(0), order)
            .reshape([len, batch, kv_heads, 2 * head_dim])
            .permute([1, 2, 0, 3]);
        (
            both.clone().narrow(3, 0, head_dim),
            both.narrow(3, head_dim, head_dim),
        )
    }

    /// Every position's keys and values `[batch, kv_heads, seq, head_dim]` from this rank's
    /// `k, v: [batch, kv_heads, rows, head_dim]`.
    pub fn gather_key_values<B: LemoBackend>(
        &self,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        self.gather_rows_of(k, v, self.gathered_row.clone())
    }

    /// This rank's queries `q: [batch, q_heads, rows, head_dim]` in its two chunks, each with the
    /// length of the key prefix it attends to (the keys up to the chunk's end).
    fn chunk_queries<B: Backend>(&self, q: Tensor<B, 4>) -> Vec<(Tensor<B, 4>, usize)> {
        let mut start = 0;
        self.chunks
            .iter()
            .map(|chunk| {
                let queries = q.clone().narrow(2, start, chunk.len());
                start += chunk.len();
                (queries, chunk.end)
            })
            .collect()
    }

    /// Attention of this rank's queries `q: [batch, q_heads, rows, head_dim]` to the keys and
    /// values of every position, causal by position, given this rank's `k, v`.
    pub fn attention<B: LemoBackend>(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        options: AttentionOptions,
    ) -> Tensor<B, 4> {
        let (k, v) = self.gather_key_values(k, v);
        let outputs = self
            .chunk_queries(q)
            .into_iter()
            .map(|(queries, end)| {
                let keys = k.clone().narrow(2, 0, end);
                let values = v.clone().narrow(2, 0, end);
                attention(queries, keys, values, options)
            })
            .collect();
        Tensor::cat(outputs, 2)
    }

    /// [`Self::attention`] outside the graph, with each query's log-sum-exp, given the keys and
    /// values of every position (`k, v: [batch, kv_heads, seq, head_dim]`).
    pub fn attention_with_lse<B: LemoBackend>(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        options: AttentionOptions,
    ) -> (Tensor<B, 4>, Tensor<B, 3>) {
        let (outputs, lse): (Vec<_>, Vec<_>) = self
            .chunk_queries(q)
            .into_iter()
            .map(|(queries, end)| {
                let keys = k.clone().narrow(2, 0, end);
                let values = v.clone().narrow(2, 0, end);
                attention_with_lse(queries, keys, values, options)
            })
            .unzip();
        (Tensor::cat(outputs, 2), Tensor::cat(lse, 2))
    }

    /// This rank's share of the attention block's token-block informativeness: for every key
    /// block of the sequence, the sum of its block scores over this rank's query blocks,
    /// `[batch, blocks]` (f32), given every position's keys `k`. Each chunk's queries are the
    /// last rows of the keys up to the chunk's end, scored at the work of their own blocks. The
    /// chunks must be whole token blocks.
    pub fn attention_column_sums<B: LemoBackend>(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        scoring: BlockScoring,
    ) -> Tensor<B, 2> {
        let blocks = self.seq.div_ceil(scoring.block_size);
        self.chunk_queries(q)
            .into_iter()
            .map(|(queries, end)| {
                let keys = k.clone().narrow(2, 0, end);
                let sums = block_scores(queries, keys, scoring.block_size, scoring.query_stride)
                    .sum_dim(1)
                    .squeeze_dim::<2>(1);
                let seen = sums.dims()[1];
                sums.pad((0, blocks - seen, 0, 0), 0.0)
            })
            .reduce(|a, b| a + b)
            .expect("two chunks")
    }

    /// The token-block scores of the whole sequence `[batch, blocks]` from each rank's share
    /// `scores`: an attention block's column sums ([`Self::attention_column_sums`]) summed over
    /// the ranks and divided by the query blocks that see each key block; an MLP block's scores
    /// of the rank's own blocks put in their places.
    pub fn whole_scores<B: LemoBackend>(
        &self,
        block: Block,
        scores: Tensor<B, 2>,
        block_size: usize,
    ) -> Tensor<B, 2> {
        let [batch, width] = scores.dims();
        match block {
            Block::Attention => {
                let all = self.gather(scores.reshape([1, batch * width]));
                column_means(all.sum_dim(0).reshape([batch, width]))
            }
            Block::Mlp => {
                let all = self.gather(scores.swap_dims(0, 1));
                let order: Vec<i64> = (0..self.seq.div_ceil(block_size))
                    .map(|n| self.gathered_row[n * block_size] / block_size as i64)
                    .collect();
                let blocks = order.len();
                let order = Tensor::from_data(TensorData::new(order, [blocks]), &all.device());
                all.select(0, order).swap_dims(0, 1)
            }
        }
    }

    /// `kept` (kept blocks of the whole sequence, a batch of one) with every rank's share topped
    /// up to as many blocks as the largest share ([`KeptRows::balanced`]).
    pub fn balance(&self, kept: &KeptRows, scores: &[f32], block_size: usize) -> KeptRows {
        kept.balanced(scores, block_size, self.exchange.ranks(), |block| {
            self.owner(block * block_size).0
        })
    }

    /// This rank's share of `kept` (rows of the whole sequence, a batch of one): its rows among
    /// the rank's rows, with their complement where `kept` has dropped rows, and the whole
    /// sequence's rows in [`BlockRows::whole`].
    pub fn localize<B: Backend>(&self, kept: &BlockRows, device: &B::Device) -> BlockRows {
        let whole = kept.to_host::<B>();
        assert_eq!(whole.batch, 1, "a split sequence is trained one at a time");
        let rows: Vec<u32> = whole
            .rows
            .iter()
            .filter_map(|&p| self.local_row(p as usize).map(|r| r as u32))
            .collect();
        let local = KeptRows {
            kept: rows.len(),
            rows,
            batch: 1,
            seq: self.chunks.iter().map(Range::len).sum(),
        };
        let mut rows = BlockRows::from_host::<B>(local, kept.dropped::<B>().is_some(), device);
        rows.whole = Some(whole);
        rows
    }

    /// Attention of this rank's kept rows (`q, k, v: [batch, heads, kept, head_dim]`, as many
    /// on every rank) to the kept rows of the whole sequence (`whole`), whose output and
    /// log-sum-exp `known` the pass over every row computed: the value is `known`'s output, and
    /// the backward pass is that of attention over every key restricted to the kept ones (see
    /// [`attention_with_value`]), its key and value gradients returned to their ranks.
    pub fn kept_attention<B: LemoBackend>(
        &self,
        (q, k, v): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>),
        (out, lse): (Tensor<B, 4>, Tensor<B, 3>),
        whole: &KeptRows,
        options: AttentionOptions,
    ) -> Tensor<B, 4> {
        let kept = k.dims()[2];
        // Each kept position's row among the gathered kept rows: its rank's, in order.
        let mut seen = vec![0usize; self.exchange.ranks()];
        let order: Vec<i64> = whole
            .rows
            .iter()
            .map(|&p| {
                let (owner, _) = self.owner(p as usize);
                seen[owner] += 1;
                (owner * kept + seen[owner] - 1) as i64
            })
            .collect();
        assert!(
            seen.iter().all(|&n| n == kept),
            "every rank keeps as many rows ({seen:?}, this rank {kept})"
        );
        let (k, v) = self.gather_rows_of(k, v, order);
        let mut start = 0;
        let outputs: Vec<Tensor<B, 4>> = self
            .chunks
            .iter()
            .filter_map(|chunk| {
                let in_chunk = |p: &&u32| chunk.contains(&(**p as usize));
                let queries = whole.rows.iter().filter(in_chunk).count();
                let prefix = whole
                    .rows
                    .iter()
                    .filter(|&&p| (p as usize) < chunk.end)
                    .count();
                let rows = start;
                start += queries;
                (queries > 0).then(|| {
                    attention_with_value(
                        q.clone().narrow(2, rows, queries),
                        k.clone().narrow(2, 0, prefix),
                        v.clone().narrow(2, 0, prefix),
                        (
                            out.clone().narrow(2, rows, queries),
                            lse.clone().narrow(2, rows, queries),
                        ),
                        options,
                    )
                })
            })
            .collect();
        Tensor::cat(outputs, 2)
    }
}
