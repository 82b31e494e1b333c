//! What predictors learn from and are measured on: the token rows and exact token-block scores
//! of one block of one layer, one row per sequence.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// Training data of one block of one layer, one row per sequence.
#[derive(Debug, Clone, Default)]
pub struct BlockSamples {
    pub hidden: usize,
    pub blocks: usize,
    /// Token rows kept per block (`scorer::block_token_rows`).
    pub tokens: usize,
    /// `[sequences, blocks, tokens, hidden]`.
    pub token_rows: Vec<f32>,
    /// Exact token-block scores `[sequences, blocks]`.
    pub scores: Vec<f32>,
}

impl BlockSamples {
    pub fn new(blocks: usize, tokens: usize, hidden: usize) -> Self {
        Self {
            hidden,
            blocks,
            tokens,
            ..Self::default()
        }
    }

    /// Appends sequences: `token_rows` `[n, blocks, tokens, hidden]` and `scores` `[n, blocks]`.
    pub fn push(&mut self, token_rows: &[f32], scores: &[f32]) {
        assert_eq!(token_rows.len(), scores.len() * self.tokens * self.hidden);
        assert_eq!(scores.len() % self.blocks, 0, "whole sequences");
        self.token_rows.extend_from_slice(token_rows);
        self.scores.extend_from_slice(scores);
    }

    pub fn sequences(&self) -> usize {
        self.scores.len() / self.blocks.max(1)
    }

    /// The first `count` sequences and the rest.
    pub fn split(&self, count: usize) -> (Self, Self) {
        let (r, s) = (
            count * self.blocks * self.tokens * self.hidden,
            count * self.blocks,
        );
        let part = |token_rows: &[f32], scores: &[f32]| Self {
            hidden: self.hidden,
            blocks: self.blocks,
            tokens: self.tokens,
            token_rows: token_rows.to_vec(),
            scores: scores.to_vec(),
        };
        (
            part(&self.token_rows[..r], &self.scores[..s]),
            part(&self.token_rows[r..], &self.scores[s..]),
        )
    }

    /// `[sequences, blocks, tokens, hidden]`.
    pub fn token_rows<B: Backend>(&self, device: &B::Device) -> Tensor<B, 4> {
        let shape = [self.sequences(), self.blocks, self.tokens, self.hidden];
        Tensor::from_data(TensorData::new(self.token_rows.clone(), shape), device)
    }

    /// Per sequence, `(log score, +1 kept / -1 dropped by the threshold alone)`.
    pub(crate) fn targets<B: Backend>(
        &self,
        threshold: f32,
        device: &B::Device,
    ) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let mut labels = Vec::with_capacity(self.scores.len());
        for scores in self.scores.chunks(self.blocks) {
            let mean = scores.iter().map(|&v| v as f64).sum::<f64>() / self.blocks as f64;
            let bar = threshold as f64 * mean;
            labels.extend(
                scores
                    .iter()
                    .map(|&v| if v as f64 >= bar { 1.0 } else { -1.0 }),
            );
        }
        let logs: Vec<f32> = self.scores.iter().map(|&v| v.max(1e-30).ln()).collect();
        let shape = [self.sequences(), self.blocks];
        (
            Tensor::from_data(TensorData::new(logs, shape), device),
            Tensor::from_data(TensorData::new(labels, shape), device),
        )
    }
}
