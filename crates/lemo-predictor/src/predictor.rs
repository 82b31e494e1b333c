//! A layer's predictors and what they predict: token-block log-scores of its attention block
//! (`log sum_c I_c(K_n) mean_{m >= n} I_c(Q_m)`, the column mean of the block matrix
//! `I(B_mn) = sum_c I_c(Q_m) I_c(K_n)`, of rank `c`, over the query blocks that see key block
//! `n`) and of its MLP block (a sketch of the MLP's own channels, [`crate::sketch`]).

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use lemo_kernels::ComputeBackend;
use lemo_sparsity::calibration::Block;

use crate::scorer::{Scorer, block_token_rows, log_mean_exp_over_tokens};
use crate::sketch::MlpSketch;

/// Initial hidden width of the query and key scorers.
pub const DEFAULT_RANK: usize = 64;
/// Rank of the block matrix the query and key scorers approximate (their log-scores per token).
pub const DEFAULT_COMPONENTS: usize = 1;
/// Initial channels of an MLP sketch (at most the MLP's own).
pub const DEFAULT_MLP_CHANNELS: usize = 128;

/// The attention block's predictors: token-block log-scores of queries and of keys.
#[derive(Module, Debug)]
pub struct QueryKey<B: Backend> {
    pub query: Scorer<B>,
    pub key: Scorer<B>,
}

impl<B: Backend> QueryKey<B> {
    pub fn new(hidden: usize, rank: usize, components: usize, device: &B::Device) -> Self {
        Self {
            query: Scorer::new(hidden, rank, components, device),
            key: Scorer::new(hidden, rank, components, device),
        }
    }
}

/// Token-block log-scores `[batch, blocks]` from the query and key scorers' per-token
/// log-scores `[batch, blocks, tokens, components]`: each pooled over its block's tokens, then
/// `log sum_c exp(k_nc + log mean_{m >= n} exp(q_mc))`. Every reduction runs over the last
/// dimension (one component at a time), the layout CubeCL's fused reductions handle on every
/// backend.
pub(crate) fn attention_log_scores<B: Backend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
) -> Tensor<B, 2> {
    let [batch, blocks, tokens, components] = key.dims();
    let pooled = |per_token: &Tensor<B, 4>, component: usize| {
        log_mean_exp_over_tokens(
            per_token
                .clone()
                .narrow(3, component, 1)
                .reshape([batch, blocks, tokens]),
        )
    };
    let terms: Vec<Tensor<B, 2>> = (0..components)
        .map(|c| pooled(&key, c) + suffix_log_mean_exp(pooled(&query, c)))
        .collect();
    if components == 1 {
        return terms.into_iter().next().expect("one component");
    }
    let terms = Tensor::stack::<3>(terms, 2);
    let largest = terms.clone().max_dim(2).detach();
    ((terms - largest.clone()).exp().sum_dim(2).log() + largest).reshape([batch, blocks])
}

/// The predictor of one block of a layer.
// One per block of a layer, never moved in a hot loop: the variants' size difference is moot.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum BlockPredictor<B: Backend> {
    Attention(QueryKey<B>),
    Mlp(MlpSketch<B>),
}

impl<B: Backend> BlockPredictor<B> {
    /// An untrained predictor of `block` for a model of width `hidden`: scorers of width
    /// `rank` and [`DEFAULT_COMPONENTS`], or a sketch of `rank` random channels (trained MLP
    /// sketches start from the model's own channels, [`crate::sketch::MlpInputMap::sketch`]).
    pub fn untrained(block: Block, hidden: usize, rank: usize, device: &B::Device) -> Self {
        match block {
            Block::Attention => {
                Self::Attention(QueryKey::new(hidden, rank, DEFAULT_COMPONENTS, device))
            }
            Block::Mlp => Self::Mlp(MlpSketch::random(hidden, rank, device)),
        }
    }

    pub fn block(&self) -> Block {
        match self {
            Self::Attention(_) => Block::Attention,
            Self::Mlp(_) => Block::Mlp,
        }
    }

    /// Natural-log token-block scores `[batch, blocks]` from the block input's token rows
    /// `[batch, blocks, tokens, hidden]` ([`block_token_rows`]), up to a constant per sequence
    /// (selection is relative to the sequence's mean, so only ratios matter).
    pub fn log_scores(&self, rows: Tensor<B, 4>) -> Tensor<B, 2> {
        match self {
            Self::Attention(QueryKey { query, key }) => {
                attention_log_scores(query.forward(rows.clone()), key.forward(rows))
            }
            Self::Mlp(sketch) => sketch.forward(rows),
        }
    }

    /// Hidden widths: the query scorer's two and the key scorer's two, or the sketch's
    /// channel count.
    pub fn widths(&self) -> Vec<usize> {
        match self {
            Self::Attention(QueryKey { query, key }) => [query.widths(), key.widths()].concat(),
            Self::Mlp(sketch) => vec![sketch.width()],
        }
    }

    pub fn num_params(&self) -> usize {
        match self {
            Self::Attention(QueryKey { query, key }) => query.num_params() + key.num_params(),
            Self::Mlp(sketch) => sketch.num_params(),
        }
    }
}

/// `log(mean_{m >= n} exp(v_m))` for every `n`, of `v: [batch, blocks]`, stably: the log of the
/// mean query score over the query blocks that see key block `n`. O(batch * blocks^2).
pub fn suffix_log_mean_exp<B: Backend>(v: Tensor<B, 2>) -> Tensor<B, 2> {
    let [batch, blocks] = v.dims();
    let device = v.device();
    let mask: Vec<f32> = (0..blocks)
        .flat_map(|n| (0..blocks).map(move |m| if m >= n { 0.0 } else { -1e30 }))
        .collect();
    let mask = Tensor::<B, 1>::from_data(TensorData::new(mask, [blocks * blocks]), &device)
        .reshape([1, blocks, blocks]);
    let terms = v.reshape([batch, 1, blocks]) + mask;
    let largest = terms.clone().max_dim(2).detach();
    let log_sum = (terms - largest.clone()).exp().sum_dim(2).log() + largest;
    let log_count: Vec<f32> = (0..blocks).map(|n| ((blocks - n) as f32).ln()).collect();
    let log_count = Tensor::<B, 1>::from_data(TensorData::new(log_count, [blocks]), &device)
        .reshape([1, blocks]);
    log_sum.reshape([batch, blocks]) - log_count
}

impl<B: ComputeBackend> BlockPredictor<B> {
    /// Token-block scores `[batch, blocks]` (f32, each sequence's largest 1) of the block input
    /// `x: [batch, seq, hidden]`: a few small GEMMs over the tokens (O(seq * hidden * rank))
    /// and the pooling.
    pub fn token_block_scores(&self, x: Tensor<B, 3>, block_size: usize) -> Tensor<B, 2> {
        let log_scores = self.log_scores(block_token_rows(x, block_size, block_size));
        let largest = log_scores.clone().max_dim(1);
        (log_scores - largest).exp()
    }
}

/// The predictors of one layer; `None` where that block of the layer stays dense.
#[derive(Module, Debug)]
pub struct LayerPredictors<B: Backend> {
    pub attention: Option<BlockPredictor<B>>,
    pub mlp: Option<BlockPredictor<B>>,
}

impl<B: Backend> LayerPredictors<B> {
    pub fn block(&self, block: Block) -> Option<&BlockPredictor<B>> {
        match block {
            Block::Attention => self.attention.as_ref(),
            Block::Mlp => self.mlp.as_ref(),
        }
    }

    pub fn num_params(&self) -> usize {
        [&self.attention, &self.mlp]
            .into_iter()
            .flatten()
            .map(BlockPredictor::num_params)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::Distribution;

    type B = NdArray<f32>;

    #[test]
    fn attention_scores_are_column_means_of_the_causal_block_matrix() {
        let _generator = lemo_test_support::exclusive_generator();
        let device = Default::default();
        let (blocks, components) = (5, 2);
        let scorers = QueryKey::<B>::new(8, 4, components, &device);
        let rows =
            Tensor::<B, 4>::random([2, blocks, 3, 8], Distribution::Normal(0.0, 1.0), &device);
        let predictor = BlockPredictor::Attention(scorers.clone());
        let scores: Vec<f32> = predictor
            .log_scores(rows.clone())
            .exp()
            .into_data()
            .to_vec()
            .unwrap();
        // Each scorer's block scores `[sequence][block][component]`: token scores averaged.
        let block_scores = |scorer: &Scorer<B>| -> Vec<f32> {
            scorer
                .forward(rows.clone())
                .exp()
                .mean_dim(2)
                .into_data()
                .to_vec()
                .unwrap()
        };
        let (query, key) = (block_scores(&scorers.query), block_scores(&scorers.key));
        let at = |v: &[f32], sequence: usize, block: usize, component: usize| {
            v[(sequence * blocks + block) * components + component]
        };
        for sequence in 0..2 {
            for n in 0..blocks {
                // Block matrix I(B_mn) = sum_c q_mc k_nc for m >= n; key block n's score is its
                // column mean over the blocks - n query blocks that see it.
                let column: f32 = (n..blocks)
                    .flat_map(|m| (0..components).map(move |c| (m, c)))
                    .map(|(m, c)| at(&query, sequence, m, c) * at(&key, sequence, n, c))
                    .sum::<f32>()
                    / (blocks - n) as f32;
                let got = scores[sequence * blocks + n];
                assert!(
                    (got - column).abs() <= 1e-4 * column.abs(),
                    "{got} vs {column}"
                );
            }
        }
    }

    #[test]
    fn token_block_scores_keep_the_ratios_and_put_the_largest_at_one() {
        let _generator = lemo_test_support::exclusive_generator();
        let device = Default::default();
        let predictor = BlockPredictor::<B>::untrained(Block::Mlp, 8, 4, &device);
        let x = Tensor::<B, 3>::random([1, 40, 8], Distribution::Normal(0.0, 1.0), &device);
        let scores: Vec<f32> = predictor
            .token_block_scores(x.clone(), 8)
            .into_data()
            .to_vec()
            .unwrap();
        let logs: Vec<f32> = predictor
            .log_scores(block_token_rows(x, 8, 8))
            .into_data()
            .to_vec()
            .unwrap();
        assert_eq!(scores.len(), 5);
        let largest = scores.iter().cloned().fold(f32::MIN, f32::max);
        assert!((largest - 1.0).abs() < 1e-6);
        let (ratio, expected) = (scores[1] / scores[3], (logs[1] - logs[3]).exp());
        assert!(
            (ratio - expected).abs() <= 1e-4 * expected,
            "{ratio} vs {expected}"
        );
    }
}
