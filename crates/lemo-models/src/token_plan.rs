//! Which rows each block of each layer processes in one forward pass (LeMo token elimination).
//!
//! A pass runs under a [`TokenSparsity`]: dense, selecting kept rows by thresholds from exact
//! scores (and recording them in a [`TokenPlan`]), or replaying a recorded plan, which is how the
//! recomputing backward pass of activation checkpointing rebuilds exactly the forward pass.

use burn::tensor::backend::Backend;
use lemo_sparsity::calibration::Block;
use lemo_sparsity::{KeptRows, Thresholds};

use crate::decoder::BlockPass;

/// The kept rows of one layer's two blocks; `None` is a dense block.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerPlan {
    pub attention: Option<KeptRows>,
    pub mlp: Option<KeptRows>,
}

impl LayerPlan {
    pub fn block(&self, block: Block) -> Option<&KeptRows> {
        match block {
            Block::Attention => self.attention.as_ref(),
            Block::Mlp => self.mlp.as_ref(),
        }
    }

    fn block_mut(&mut self, block: Block) -> &mut Option<KeptRows> {
        match block {
            Block::Attention => &mut self.attention,
            Block::Mlp => &mut self.mlp,
        }
    }
}

/// Token-block scores of one layer's blocks, row-major `[batch, blocks]`, when recorded.
#[derive(Debug, Clone, Default)]
pub struct LayerScores {
    pub attention: Option<Vec<f32>>,
    pub mlp: Option<Vec<f32>>,
}

/// What a token-sparse forward pass chose, layer by layer.
#[derive(Debug, Clone, Default)]
pub struct TokenPlan {
    pub layers: Vec<LayerPlan>,
    /// Filled when the pass was asked to record scores (profiling, calibration).
    pub scores: Vec<LayerScores>,
}

impl TokenPlan {
    /// Mean kept fraction of one kind of block over the layers (a dense block keeps 1).
    pub fn keep_fraction(&self, block: Block) -> f64 {
        if self.layers.is_empty() {
            return 1.0;
        }
        let total: f64 = self
            .layers
            .iter()
            .map(|l| l.block(block).map_or(1.0, KeptRows::fraction))
            .sum();
        total / self.layers.len() as f64
    }

    fn layer_mut(&mut self, layer: usize) -> &mut LayerPlan {
        if self.layers.len() <= layer {
            self.layers.resize(layer + 1, LayerPlan::default());
        }
        &mut self.layers[layer]
    }

    fn record_scores(&mut self, layer: usize, block: Block, scores: Vec<f32>) {
        if self.scores.len() <= layer {
            self.scores.resize(layer + 1, LayerScores::default());
        }
        let slot = &mut self.scores[layer];
        match block {
            Block::Attention => slot.attention = Some(scores),
            Block::Mlp => slot.mlp = Some(scores),
        }
    }
}

/// How a forward pass picks the rows of each block.
pub enum TokenSparsity<'a> {
    /// Every block processes every row.
    Dense,
    /// Each block keeps the token blocks whose exact informativeness reaches its layer's
    /// threshold (a `None` threshold keeps the block dense); the choice is recorded in `plan`,
    /// with the scores of every block when `record_scores`.
    Select {
        thresholds: &'a Thresholds,
        plan: TokenPlan,
        record_scores: bool,
    },
    /// The rows a previous pass chose.
    Replay(&'a TokenPlan),
}

impl<'a> TokenSparsity<'a> {
    /// Selection by `thresholds`, recording the plan but not the scores.
    pub fn select(thresholds: &'a Thresholds) -> Self {
        TokenSparsity::Select {
            thresholds,
            plan: TokenPlan::default(),
            record_scores: false,
        }
    }

    /// The recorded plan of a selecting pass.
    pub fn into_plan(self) -> Option<TokenPlan> {
        match self {
            TokenSparsity::Select { plan, .. } => Some(plan),
            _ => None,
        }
    }

    /// The kept rows of `block` of `layer` for a batch of sequences of `seq` tokens, and the
    /// block's pass over every row that they come with; `None`: the block runs dense. `pass`
    /// computes the block outside the graph, with its token-block scores when given a block
    /// size, and is called only when the block is sparse or its scores are recorded.
    pub(crate) fn block<B: Backend>(
        &mut self,
        layer: usize,
        block: Block,
        seq: usize,
        pass: impl FnOnce(Option<usize>) -> BlockPass<B>,
    ) -> Option<(KeptRows, BlockPass<B>)> {
        match self {
            TokenSparsity::Dense => None,
            TokenSparsity::Replay(plan) => {
                let kept = plan.layers.get(layer)?.block(block).cloned()?;
                Some((kept, pass(None)))
            }
            TokenSparsity::Select {
                thresholds,
                plan,
                record_scores,
            } => {
                let layer_thresholds = thresholds.layers[layer];
                let threshold = match block {
                    Block::Attention => layer_thresholds.attention,
                    Block::Mlp => layer_thresholds.mlp,
                };
                *plan.layer_mut(layer).block_mut(block) = None;
                if threshold.is_none() && !*record_scores {
                    return None;
                }
                let mut pass = pass(Some(thresholds.block_size));
                let scores = pass
                    .scores
                    .take()
                    .expect("a pass asked for scores gives them");
                let [batch, blocks] = scores.dims();
                let values: Vec<f32> = scores
                    .into_data()
                    .convert::<f32>()
                    .into_vec()
                    .expect("f32 scores");
                let kept = threshold.map(|t| {
                    let per_sequence: Vec<&[f32]> =
                        values.chunks(blocks.max(1)).take(batch).collect();
                    KeptRows::from_block_scores(
                        &per_sequence,
                        thresholds.block_size,
                        seq,
                        t,
                        thresholds.min_keep,
                    )
                });
                if *record_scores {
                    plan.record_scores(layer, block, values);
                }
                *plan.layer_mut(layer).block_mut(block) = kept.clone();
                kept.map(|kept| (kept, pass))
            }
        }
    }
}
