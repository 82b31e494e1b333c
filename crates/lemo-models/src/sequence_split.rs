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

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use lemo_kernels::exchange::{Exchange, all_gather_rows};
use lemo_kernels::{AttentionOptions, LemoBackend};

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
        let chunk = seq / (2 * ranks);
        let chunk_range = |index: usize| index * chunk..(index + 1) * chunk;
        let rank = exchange.rank();
        // Rank `owner` holds chunk `owner` then its mirror: the gathered rows of chunk `c` start
        // at `2 * chunk * owner`, plus `chunk` for the mirror.
        let gathered_row = (0..seq)
            .map(|position| {
                let index = position / chunk;
                let (owner, second) = match index < ranks {
                    true => (index, 0),
                    false => (2 * ranks - 1 - index, 1),
                };
                ((2 * owner + second) * chunk + position % chunk) as i64
            })
            .collect();
        Ok(Self {
            seq,
            chunks: [chunk_range(rank), chunk_range(2 * ranks - 1 - rank)],
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

    /// Every position's keys and values `[batch, kv_heads, seq, head_dim]` from this rank's
    /// `k, v: [batch, kv_heads, rows, head_dim]`: one collective for both (so every rank makes
    /// the same calls in the same order, in the backward pass too).
    fn gather_key_values<B: LemoBackend>(
        &self,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let [batch, kv_heads, rows, head_dim] = k.dims();
        let local = Tensor::cat(vec![k, v], 3)
            .permute([2, 0, 1, 3])
            .reshape([rows, batch * kv_heads * 2 * head_dim]);
        let gathered = all_gather_rows(local, &self.exchange);
        let order = Tensor::from_data(
            TensorData::new(self.gathered_row.clone(), [self.seq]),
            &gathered.device(),
        );
        let both = gathered
            .select(0, order)
            .reshape([self.seq, batch, kv_heads, 2 * head_dim])
            .permute([1, 2, 0, 3]);
        (
            both.clone().narrow(3, 0, head_dim),
            both.narrow(3, head_dim, head_dim),
        )
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
        let mut start = 0;
        let outputs = self
            .chunks
            .iter()
            .map(|chunk| {
                let queries = q.clone().narrow(2, start, chunk.len());
                start += chunk.len();
                let keys = k.clone().narrow(2, 0, chunk.end);
                let values = v.clone().narrow(2, 0, chunk.end);
                lemo_kernels::attention::attention(queries, keys, values, options)
            })
            .collect();
        Tensor::cat(outputs, 2)
    }
}
