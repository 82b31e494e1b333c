//! Which rows each block of each layer keeps in the graph of one forward pass (LeMo token
//! elimination; the pass itself computes every row, see `decoder::SparseBlock`).
//!
//! A pass runs under a [`TokenSparsity`]: dense, selecting kept rows by thresholds from exact or
//! predicted scores (and recording them in a [`TokenPlan`]), or replaying a recorded plan, which
//! is how the recomputing backward pass of activation checkpointing rebuilds exactly the forward
//! pass.

use burn::tensor::Tensor;
use lemo_kernels::ComputeBackend;
use lemo_kernels::attention::FUSED_ATTENTION_LENGTH_MULTIPLE;
use lemo_predictor::Predictors;
use lemo_predictor::scorer::block_token_rows;
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

/// What a pass recorded of one block of a layer.
#[derive(Debug, Clone, Default)]
pub struct BlockRecord {
    /// Exact token-block scores, row-major `[batch, blocks]`.
    pub scores: Vec<f32>,
    /// The block input's normalized token rows, `[batch, blocks, tokens, hidden]` with the
    /// recorded tokens per block, when asked for (what attention predictors read).
    pub token_rows: Option<Vec<f32>>,
}

/// What a pass recorded of one layer's blocks.
#[derive(Debug, Clone, Default)]
pub struct LayerScores {
    pub attention: Option<BlockRecord>,
    pub mlp: Option<BlockRecord>,
}

impl LayerScores {
    pub fn block(&self, block: Block) -> Option<&BlockRecord> {
        match block {
            Block::Attention => self.attention.as_ref(),
            Block::Mlp => self.mlp.as_ref(),
        }
    }
}

/// What a selecting pass records besides the kept rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    Nothing,
    /// The exact scores of every block (profiling, calibration).
    Scores,
    /// The exact scores, and `tokens_per_block` evenly spaced normalized token rows of each
    /// token block of the attention blocks' inputs (training predictors).
    ScoresAndTokenRows {
        tokens_per_block: usize,
    },
}

/// What the backward pass of a token-sparse MLP block does on the rows it drops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DroppedRows {
    /// The block's exact input gradient there, recomputed from those rows
    /// ([`lemo_kernels::recomputed_rows`]): the MLP's backward pass is the dense one, and only
    /// the dropped rows' input (not their activations) is saved.
    #[default]
    Exact,
    /// The residual alone: cheaper, further from the dense gradient.
    Residual,
}

/// What a token-sparse forward pass chose, layer by layer.
#[derive(Debug, Clone, Default)]
pub struct TokenPlan {
    pub layers: Vec<LayerPlan>,
    /// What the MLP blocks' backward pass does on their dropped rows.
    pub dropped_rows: DroppedRows,
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

    fn record(&mut self, layer: usize, block: Block, record: BlockRecord) {
        if self.scores.len() <= layer {
            self.scores.resize(layer + 1, LayerScores::default());
        }
        let slot = &mut self.scores[layer];
        match block {
            Block::Attention => slot.attention = Some(record),
            Block::Mlp => slot.mlp = Some(record),
        }
    }
}

/// How a forward pass picks the rows of each block.
pub enum TokenSparsity<'a> {
    /// Every block processes every row.
    Dense,
    /// Each block keeps the token blocks whose informativeness reaches its layer's threshold (a
    /// `None` threshold keeps the block dense), exact scores; or, for attention blocks that
    /// `predictors` score, the layer's fixed fraction of predicted ones
    /// ([`Thresholds::selection`]). The choice is recorded in `plan`, with what `record` asks
    /// for.
    Select {
        thresholds: &'a Thresholds,
        predictors: Option<&'a Predictors>,
        plan: TokenPlan,
        record: Record,
    },
    /// The rows a previous pass chose.
    Replay(&'a TokenPlan),
}

impl<'a> TokenSparsity<'a> {
    /// Selection by `thresholds` from exact scores, recording the plan but not the scores.
    pub fn select(thresholds: &'a Thresholds) -> Self {
        Self::recording(thresholds, Record::Nothing)
    }

    /// Selection by `thresholds` from exact scores, recording what `record` asks for.
    pub fn recording(thresholds: &'a Thresholds, record: Record) -> Self {
        TokenSparsity::Select {
            thresholds,
            predictors: None,
            plan: TokenPlan::default(),
            record,
        }
    }

    /// Selection by `thresholds` from the scores `predictors` give.
    pub fn predicted(thresholds: &'a Thresholds, predictors: &'a Predictors) -> Self {
        TokenSparsity::Select {
            thresholds,
            predictors: Some(predictors),
            plan: TokenPlan::default(),
            record: Record::Nothing,
        }
    }

    /// This selection with the MLP blocks' dropped rows treated as `dropped_rows` (recorded in
    /// the plan, so a replay treats them the same).
    pub fn with_dropped_rows(mut self, dropped_rows: DroppedRows) -> Self {
        if let TokenSparsity::Select { plan, .. } = &mut self {
            plan.dropped_rows = dropped_rows;
        }
        self
    }

    /// What the MLP blocks' backward pass does on their dropped rows.
    pub fn dropped_rows(&self) -> DroppedRows {
        match self {
            TokenSparsity::Select { plan, .. } => plan.dropped_rows,
            TokenSparsity::Replay(plan) => plan.dropped_rows,
            TokenSparsity::Dense => DroppedRows::default(),
        }
    }

    /// The recorded plan of a selecting pass.
    pub fn into_plan(self) -> Option<TokenPlan> {
        match self {
            TokenSparsity::Select { plan, .. } => Some(plan),
            _ => None,
        }
    }

    /// The kept rows of `block` of `layer` for the block input `input: [batch, seq, hidden]`
    /// (outside the graph), and the block's pass over every row that they come with; `None`:
    /// the block runs dense. `pass` computes the block outside the graph, with its exact
    /// token-block scores when given a block size, and is called only when the block is sparse
    /// or its scores are recorded.
    pub(crate) fn block<B: ComputeBackend>(
        &mut self,
        layer: usize,
        block: Block,
        input: &Tensor<B, 3>,
        pass: impl FnOnce(Option<usize>) -> BlockPass<B>,
    ) -> Option<(KeptRows, BlockPass<B>)> {
        let [_, seq, _] = input.dims();
        match self {
            TokenSparsity::Dense => None,
            TokenSparsity::Replay(plan) => {
                let kept = plan.layers.get(layer)?.block(block).cloned()?;
                Some((kept, pass(None)))
            }
            TokenSparsity::Select {
                thresholds,
                predictors,
                plan,
                record,
            } => {
                *plan.layer_mut(layer).block_mut(block) = None;
                if thresholds.layers[layer].block(block).is_none() && *record == Record::Nothing {
                    return None;
                }
                let block_size = thresholds.block_size;
                // Only attention blocks are predicted: an MLP block's exact scores are a
                // reduction of the activations its pass computes anyway.
                let predicted = match (predictors, *record, block) {
                    (Some(predictors), Record::Nothing, Block::Attention) => {
                        predictors.token_block_scores(layer, input.clone())
                    }
                    _ => None,
                };
                let selection = thresholds.selection(layer, block, predicted.is_some());
                let (pass, scores) = match predicted {
                    Some(scores) => (pass(None), scores),
                    None => {
                        let mut pass = pass(Some(block_size));
                        let scores = pass
                            .scores
                            .take()
                            .expect("a pass asked for scores gives them");
                        (pass, scores)
                    }
                };
                let [batch, blocks] = scores.dims();
                let values: Vec<f32> = scores
                    .into_data()
                    .convert::<f32>()
                    .into_vec()
                    .expect("f32 scores");
                let kept = selection.map(|(threshold, floor)| {
                    let per_sequence: Vec<&[f32]> =
                        values.chunks(blocks.max(1)).take(batch).collect();
                    KeptRows::from_block_scores_aligned(
                        &per_sequence,
                        block_size,
                        seq,
                        threshold,
                        floor,
                        FUSED_ATTENTION_LENGTH_MULTIPLE,
                    )
                });
                if *record != Record::Nothing {
                    let token_rows = match (*record, block) {
                        (Record::ScoresAndTokenRows { tokens_per_block }, Block::Attention) => {
                            Some(
                                block_token_rows(input.clone(), block_size, tokens_per_block)
                                    .into_data()
                                    .convert::<f32>()
                                    .into_vec()
                                    .expect("f32 token rows"),
                            )
                        }
                        _ => None,
                    };
                    plan.record(
                        layer,
                        block,
                        BlockRecord {
                            scores: values,
                            token_rows,
                        },
                    );
                }
                *plan.layer_mut(layer).block_mut(block) = kept.clone();
                kept.map(|kept| (kept, pass))
            }
        }
    }
}
