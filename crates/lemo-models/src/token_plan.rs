//! Which rows each block of each layer keeps in the graph of one forward pass (LeMo token
//! elimination; the pass itself computes every row, see `decoder::SparseBlock`).
//!
//! A pass runs under a [`TokenSparsity`]: dense, selecting kept rows by thresholds from exact or
//! predicted scores (and recording them in a [`TokenPlan`]), or replaying a recorded plan, which
//! is how the recomputing backward pass of activation checkpointing rebuilds exactly the forward
//! pass.

use std::any::Any;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use lemo_kernels::LemoBackend;
use lemo_kernels::attention::FUSED_ATTENTION_LENGTH_MULTIPLE;
use lemo_kernels::host_reads;
use lemo_predictor::Predictors;
use lemo_predictor::scorer::block_token_rows;
use lemo_sparsity::best_blocks::{best_block_count, best_block_rows_by_segment, segment_or_whole};
use lemo_sparsity::calibration::Block;
use lemo_sparsity::informativeness::BlockScoring;
use lemo_sparsity::{KeptRows, PerBlock, Selection, Thresholds};

use crate::block_pass::BlockPass;
use crate::sequence_split::SequenceSplit;

/// A device int tensor `[batch, n]` without its backend in the type: a plan is chosen by a pass
/// of one backend and replayed by another (the checkpointed backward pass replays under
/// autodiff the inner backend's forward pass, and the two share their int tensors).
#[derive(Clone)]
struct DeviceRows(Arc<dyn Any + Send + Sync>);

impl DeviceRows {
    fn new<B: Backend>(rows: Tensor<B, 2, Int>) -> Self {
        Self(Arc::new(rows.into_primitive()))
    }

    fn tensor<B: Backend>(&self) -> Tensor<B, 2, Int> {
        let rows = self
            .0
            .downcast_ref::<B::IntTensorPrimitive>()
            .expect("kept rows are replayed on the backend that chose them, or its autodiff");
        Tensor::from_primitive(rows.clone())
    }
}

/// One block's kept rows, `[batch, kept]` positions of each sequence in increasing order, on the
/// device of the pass that chose them; with the rows it drops where its backward pass reaches
/// them (MLP blocks with [`DroppedRows::Exact`]).
#[derive(Clone)]
pub struct BlockRows {
    pub batch: usize,
    pub kept: usize,
    pub seq: usize,
    /// The same rows on the host, where they were selected there (thresholds relative to the
    /// scores: the count is known only from them).
    pub host: Option<KeptRows>,
    /// Under a sequence split, the kept rows of the whole sequence, of which these (positions
    /// among the rank's rows) are the rank's share.
    pub whole: Option<KeptRows>,
    /// Where every segment of this many positions keeps as many rows (S2 half groups,
    /// [`best_block_rows_by_segment`]): the rows of each segment follow from the count.
    pub segment: Option<usize>,
    rows: DeviceRows,
    dropped: Option<DeviceRows>,
}

impl std::fmt::Debug for BlockRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockRows")
            .field("batch", &self.batch)
            .field("kept", &self.kept)
            .field("seq", &self.seq)
            .field("dropped", &self.dropped.is_some())
            .finish()
    }
}

impl BlockRows {
    /// Rows chosen on the device: `rows: [batch, kept]`, `dropped: [batch, seq - kept]`.
    pub fn on_device<B: Backend>(
        rows: Tensor<B, 2, Int>,
        dropped: Option<Tensor<B, 2, Int>>,
        seq: usize,
    ) -> Self {
        let [batch, kept] = rows.dims();
        Self {
            batch,
            kept,
            seq,
            host: None,
            whole: None,
            segment: None,
            rows: DeviceRows::new(rows),
            dropped: dropped.map(DeviceRows::new),
        }
    }

    /// Rows chosen on the host, uploaded to `device`, with their complement when `dropped`
    /// (and there is one).
    pub fn from_host<B: Backend>(kept: KeptRows, dropped: bool, device: &B::Device) -> Self {
        let upload = |rows: &KeptRows| {
            let values: Vec<i32> = rows.rows.iter().map(|&r| r as i32).collect();
            Tensor::<B, 2, Int>::from_data(TensorData::new(values, [rows.batch, rows.kept]), device)
        };
        let dropped = (dropped && !kept.is_all()).then(|| upload(&kept.complement()));
        Self {
            host: Some(kept.clone()),
            ..Self::on_device(upload(&kept), dropped, kept.seq)
        }
    }

    /// These rows, known to keep as many in every `segment` of positions; a `segment` of the
    /// whole sequence says nothing.
    pub fn in_segments(self, segment: usize) -> Self {
        Self {
            segment: (segment < self.seq).then_some(segment),
            ..self
        }
    }

    /// Kept rows over all rows.
    pub fn fraction(&self) -> f64 {
        self.kept as f64 / self.seq.max(1) as f64
    }

    /// `[batch, kept]` kept positions.
    pub fn rows<B: Backend>(&self) -> Tensor<B, 2, Int> {
        self.rows.tensor()
    }

    /// `[batch, seq - kept]` dropped positions, where the block's backward pass reaches them.
    pub fn dropped<B: Backend>(&self) -> Option<Tensor<B, 2, Int>> {
        self.dropped.as_ref().map(DeviceRows::tensor)
    }

    /// The kept rows on the host: those selected there, or a (counted) read of the device's.
    pub fn to_host<B: Backend>(&self) -> KeptRows {
        if let Some(host) = &self.host {
            return host.clone();
        }
        let values = host_reads::read(self.rows::<B>())
            .convert::<i64>()
            .into_vec::<i64>()
            .expect("i64 rows after conversion");
        KeptRows {
            rows: values.into_iter().map(|r| r as u32).collect(),
            batch: self.batch,
            kept: self.kept,
            seq: self.seq,
        }
    }
}

/// The kept rows of one layer's two blocks; `None` is a dense block.
pub type LayerPlan = PerBlock<Option<BlockRows>>;

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
pub type LayerScores = PerBlock<Option<BlockRecord>>;

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
            .map(|l| l.get(block).as_ref().map_or(1.0, BlockRows::fraction))
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
        *self.scores[layer].get_mut(block) = Some(record);
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
    /// for. Attention scores read every `query_stride`-th query row
    /// ([`lemo_kernels::block_scores::sampled_query_rows`]).
    Select {
        thresholds: &'a Thresholds,
        predictors: Option<&'a Predictors>,
        plan: TokenPlan,
        record: Record,
        query_stride: usize,
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
            query_stride: 1,
        }
    }

    /// Selection by `thresholds` from the scores `predictors` give.
    pub fn predicted(thresholds: &'a Thresholds, predictors: &'a Predictors) -> Self {
        TokenSparsity::Select {
            thresholds,
            predictors: Some(predictors),
            plan: TokenPlan::default(),
            record: Record::Nothing,
            query_stride: 1,
        }
    }

    /// This selection with the attention blocks it scores from their queries and keys reading
    /// every `stride`-th query row (1: the exact scores).
    pub fn with_query_stride(mut self, stride: usize) -> Self {
        if let TokenSparsity::Select { query_stride, .. } = &mut self {
            *query_stride = stride.max(1);
        }
        self
    }

    /// This selection with the MLP blocks' dropped rows treated as `dropped_rows` (recorded in
    /// the plan, so a replay treats them the same).
    pub fn with_dropped_rows(mut self, dropped_rows: DroppedRows) -> Self {
        if let TokenSparsity::Select { plan, .. } = &mut self {
            plan.dropped_rows = dropped_rows;
        }
        self
    }

    /// The recorded plan of a selecting pass.
    pub fn into_plan(self) -> Option<TokenPlan> {
        match self {
            TokenSparsity::Select { plan, .. } => Some(plan),
            _ => None,
        }
    }

    /// The kept rows a replayed plan gives `block` of `layer`, for a block that needs no pass
    /// over every row (an MLP block rebuilt for its backward pass, see
    /// [`crate::decoder::LayerRun::Rebuild`]); `None`: the block runs dense, as it does without
    /// token sparsity. A selecting pass has no rows to give before it selects, so a rebuilt
    /// block asking one is a caller's error.
    /// Under a `split`, the rank's share of them (on `device`).
    pub(crate) fn replayed<B: Backend>(
        &self,
        layer: usize,
        block: Block,
        split: Option<&SequenceSplit>,
        device: &B::Device,
    ) -> Option<BlockRows> {
        let kept = match self {
            TokenSparsity::Replay(plan) => plan.layers.get(layer)?.get(block).clone(),
            TokenSparsity::Dense => None,
            TokenSparsity::Select { .. } => {
                panic!("a rebuilt block replays the rows its forward pass selected")
            }
        };
        kept.map(|kept| localized::<B>(kept, split, device))
    }

    /// The kept rows of `block` of `layer` for the block input `input: [batch, seq, hidden]`
    /// (outside the graph), and the block's pass over every row that they come with; `None`:
    /// the block runs dense. `pass` computes the block outside the graph, with its token-block
    /// scores when given a [`BlockScoring`], and is called only when the block is sparse or its
    /// scores are recorded. A block that keeps its best blocks selects on the device; one
    /// with a threshold relative to its scores, or whose scores are recorded, reads them.
    ///
    /// With attention in S2 groups of `s2_group` tokens, an attention block that keeps its best
    /// blocks keeps as many in every half group, so each group's kept rows, for either half of
    /// the heads, are whole half groups' shares, lengths the fused attention takes (see
    /// [`crate::kept_s2`]); a sequence that does not cut into whole half groups of whole blocks
    /// selects over the whole sequence.
    ///
    /// Under a `split`, `input` holds the rank's rows and the pass scores their share (see
    /// [`SequenceSplit::whole_scores`]): every rank selects from the whole sequence's scores on
    /// the host, balances the ranks' shares, records the whole sequence's rows in the plan and
    /// returns its own share.
    pub(crate) fn block<B: LemoBackend, P>(
        &mut self,
        layer: usize,
        block: Block,
        (input, split): (&Tensor<B, 3>, Option<&SequenceSplit>),
        s2_group: Option<usize>,
        pass: impl FnOnce(Option<BlockScoring>) -> BlockPass<B, P>,
    ) -> Option<(BlockRows, BlockPass<B, P>)> {
        let seq = split.map_or(input.dims()[1], SequenceSplit::seq);
        let device = input.device();
        match self {
            TokenSparsity::Dense => None,
            TokenSparsity::Replay(plan) => {
                let kept = plan.layers.get(layer)?.get(block).clone()?;
                Some((localized::<B>(kept, split, &device), pass(None)))
            }
            TokenSparsity::Select {
                thresholds,
                predictors,
                plan,
                record,
                query_stride,
            } => {
                *plan.layer_mut(layer).get_mut(block) = None;
                if thresholds.layers[layer].block(block).is_none() && *record == Record::Nothing {
                    return None;
                }
                let block_size = thresholds.block_size;
                let selection = thresholds.selection(layer, block);
                let s2_group = s2_group.filter(|_| block == Block::Attention);
                // A block that would keep every block runs dense: the same values and gradients
                // without the sparse path's copies.
                if let (Some(Selection::Best(fraction)), Record::Nothing) = (selection, *record)
                    && best_block_count(fraction, block_size, seq, FUSED_ATTENTION_LENGTH_MULTIPLE)
                        >= seq.div_ceil(block_size)
                {
                    return None;
                }
                // Only attention blocks are predicted: an MLP block's exact scores are a
                // reduction of the activations its pass computes anyway.
                // Predictors read whole sequences.
                let predicted = match (predictors, *record, block, split) {
                    (Some(predictors), Record::Nothing, Block::Attention, None) => {
                        predictors.token_block_scores(layer, input.clone())
                    }
                    _ => None,
                };
                let (pass, scores) = match predicted {
                    Some(scores) => (pass(None), scores),
                    None => {
                        let mut pass = pass(Some(BlockScoring {
                            block_size,
                            query_stride: *query_stride,
                            s2_group,
                        }));
                        let scores = pass
                            .scores
                            .take()
                            .expect("a pass asked for scores gives them");
                        (pass, scores)
                    }
                };
                let scores = match split {
                    Some(split) => split.whole_scores(block, scores, block_size),
                    None => scores,
                };
                let dropped = block == Block::Mlp && plan.dropped_rows == DroppedRows::Exact;
                let relative = matches!(selection, Some(Selection::Relative { .. }));
                let values = (relative || *record != Record::Nothing || split.is_some())
                    .then(|| host_reads::read_f32(scores.clone()));
                let kept = selection.map(|selection| match (split, values.as_deref()) {
                    (Some(split), Some(values)) => {
                        let kept = split_rows(selection, values, block_size, seq, split);
                        BlockRows::from_host::<B>(kept, dropped, &device)
                    }
                    (_, host_scores) => {
                        let segment = s2_group
                            .map_or(seq, |group| segment_or_whole(seq, group / 2, block_size));
                        select_rows(
                            selection,
                            (scores, host_scores),
                            block_size,
                            (seq, segment),
                            dropped,
                        )
                    }
                });
                if let Some(values) = values.filter(|_| *record != Record::Nothing) {
                    let token_rows = match (*record, block) {
                        (Record::ScoresAndTokenRows { tokens_per_block }, Block::Attention) => {
                            Some(host_reads::read_f32(block_token_rows(
                                input.clone(),
                                block_size,
                                tokens_per_block,
                            )))
                        }
                        _ => None,
                    };
                    let scores = values;
                    plan.record(layer, block, BlockRecord { scores, token_rows });
                }
                *plan.layer_mut(layer).get_mut(block) = kept.clone();
                kept.map(|kept| (localized::<B>(kept, split, &device), pass))
            }
        }
    }
}

/// `kept`, or under a `split` the rank's share of it.
fn localized<B: Backend>(
    kept: BlockRows,
    split: Option<&SequenceSplit>,
    device: &B::Device,
) -> BlockRows {
    match split {
        Some(split) => split.localize::<B>(&kept, device),
        None => kept,
    }
}

/// The rows of a split sequence `selection` keeps by the whole sequence's `scores` (one per
/// block), as one rank would choose them, with the ranks' shares balanced.
fn split_rows(
    selection: Selection,
    scores: &[f32],
    block_size: usize,
    seq: usize,
    split: &SequenceSplit,
) -> KeptRows {
    // Keeping the best fraction is a threshold no block reaches, with that fraction as floor.
    let (threshold, floor) = match selection {
        Selection::Best(fraction) => (f32::INFINITY, fraction),
        Selection::Relative { threshold, floor } => (threshold, floor),
    };
    let kept = KeptRows::from_block_scores_aligned(
        &[scores],
        block_size,
        seq,
        threshold,
        floor,
        FUSED_ATTENTION_LENGTH_MULTIPLE,
    );
    split.balance(&kept, scores, block_size)
}

/// The rows `selection` keeps by `scores: [batch, blocks]` of a sequence of `seq` tokens, with
/// the dropped rows when `dropped`: on the device for a count known ahead (the best blocks of
/// every `segment` of tokens), else from the scores on the host (`host_scores`, read by the
/// caller).
fn select_rows<B: Backend>(
    selection: Selection,
    (scores, host_scores): (Tensor<B, 2>, Option<&[f32]>),
    block_size: usize,
    (seq, segment): (usize, usize),
    dropped: bool,
) -> BlockRows {
    match selection {
        Selection::Best(fraction) => {
            let count = best_block_count(
                fraction,
                block_size,
                segment,
                FUSED_ATTENTION_LENGTH_MULTIPLE,
            );
            let (rows, dropped) =
                best_block_rows_by_segment(scores, count, block_size, (seq, segment), dropped);
            BlockRows::on_device(rows, dropped, seq).in_segments(segment)
        }
        Selection::Relative { threshold, floor } => {
            let values = host_scores.expect("relative thresholds read the scores");
            let per_sequence: Vec<&[f32]> = values.chunks(seq.div_ceil(block_size)).collect();
            let kept = KeptRows::from_block_scores_aligned(
                &per_sequence,
                block_size,
                seq,
                threshold,
                floor,
                FUSED_ATTENTION_LENGTH_MULTIPLE,
            );
            BlockRows::from_host::<B>(kept, dropped, &scores.device())
        }
    }
}
