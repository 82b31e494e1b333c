//! `--method lemo`: the thresholds a run eliminates tokens with (from a file, or calibrated on
//! the user's data first), and the `calibrate` and `profile` subcommands ([`inspect`]).
//!
//! Calibration (see `lemo_sparsity::calibration`): the token-block scores of every block of every
//! layer are profiled on a few sequences; each threshold starts at its layer's mean score; one or
//! more rounds of central finite differences of
//! `J = (loss - dense_loss) / dense_loss + 4 (keep - target)^2` move each block's threshold; a
//! common shift per kind of block then puts the attention and the MLP kept fractions on the
//! target. The forward pass of a token-sparse model is exact (only its graph is sparse), so the
//! loss term of `J` is zero and refinement rounds only move the kept fraction: the default is
//! none.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::ElementConversion;
use clap::Args;
use lemo_kernels::LemoBackend;
use lemo_models::token_plan::{Record, TokenPlan, TokenSparsity};
use lemo_models::{CausalLm, ModelConfig};
use lemo_sparsity::calibration::{Block, Calibrator, LayerProfile, objective};
use lemo_sparsity::informativeness::BlockScoring;
use lemo_sparsity::thresholds::Measured;
use lemo_sparsity::{LayerThresholds, Thresholds};
use serde::{Deserialize, Serialize};

use crate::data::int_tokens;
use crate::task_progress::TaskProgress;

mod elimination;
mod inputs;
mod inspect;
mod predictors;
pub mod threshold_cache;

pub use elimination::{
    Elimination, MlpDroppedRows, SAMPLED_QUERY_STRIDE, ScoreSource, bench_elimination, elimination,
    token_sparsity,
};
pub use inputs::InspectArgs;
pub use inspect::{run_calibrate, run_profile, run_train_predictors};
pub use predictors::TrainPredictorsArgs;

/// File name of the thresholds a run used, in its folder and beside its adapter.
pub const THRESHOLDS_FILE: &str = "thresholds.json";

/// Rows of the vocabulary projection per segment of the loss while calibrating.
const LOSS_SEGMENT: usize = 1024;

/// Largest fraction of a block's token blocks calibration lets it drop.
const MAX_DROP: f64 = 0.95;

/// Finite-difference step in drop fraction, and the largest move of one refinement round.
const PROBE: f64 = 0.05;
const STEP: f64 = 0.1;

/// What each kind of block keeps of `--target-keep T` unless its own fraction is given: the
/// attention blocks 1.4 T (at most every token), the MLP blocks T / 2 (at least 2 T - 1, so
/// that 1 keeps every token); 0.5 is 0.7 / 0.25. The MLP blocks back-propagate exactly through
/// the rows they drop, so their kept fraction trades memory against time and leaves the
/// gradients as they are; the attention blocks' sets the gradients' accuracy. On stories260K
/// (512 -> 2048 tokens, three seeds, calibrated thresholds), 0.7 / 0.25 is +2.3% held-out
/// perplexity against `lora` where 0.5 / 0.5 is +4.6%; on Llama-2-7B at 8K tokens (H200) it
/// holds 0.45x PEFT's device peak, where 0.7 / 0.3 holds 0.454x.
const ATTENTION_SHARE: f64 = 1.4;
const MLP_SHARE: f64 = 0.5;

/// How token elimination is set up: the `--method lemo` flags of `train`, `eval`, `bench`,
/// `calibrate`, `profile` and `train-predictors`, and the same keys in a training TOML file. The
/// defaults are the flags' defaults ([`crate::defaults`]).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default)]
pub struct LemoSettings {
    /// Thresholds file (from `train --method lemo` or `calibrate`) [default: calibrate].
    #[arg(long)]
    pub thresholds: Option<PathBuf>,
    /// How many tokens the token-eliminating blocks keep, what calibration aims at: the
    /// attention blocks keep 1.4 times it (at most all), the MLP blocks half of it (at least
    /// 2 F - 1), so 0.5 is 0.7 / 0.25. The MLP blocks back-propagate exactly through the rows
    /// they drop, so dropping more there costs time, not accuracy; the attention blocks' kept
    /// fraction sets the gradients' accuracy (see README).
    #[arg(long, default_value_t = 0.5)]
    pub target_keep: f64,
    /// Fraction of tokens the attention blocks keep [default: from --target-keep].
    #[arg(long)]
    pub attention_keep: Option<f64>,
    /// Fraction of tokens the MLP blocks keep [default: from --target-keep].
    #[arg(long)]
    pub mlp_keep: Option<f64>,
    /// Tokens per block of the elimination.
    #[arg(long, default_value_t = 64)]
    pub block_size: usize,
    /// Least fraction of a sequence's blocks any block keeps.
    #[arg(long, default_value_t = 0.1)]
    pub min_keep: f64,
    /// Layers that keep every token, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub dense_layers: Vec<usize>,
    /// Sequences calibration profiles and evaluates on.
    #[arg(long, default_value_t = 4)]
    pub calibration_sequences: usize,
    /// Finite-difference refinement rounds of calibration (0: the paper's mean initialization
    /// and a shift onto the target).
    #[arg(long, default_value_t = 0)]
    pub calibration_rounds: usize,
    /// Trained predictors (from `train-predictors`): token-block scores come from them, and the
    /// thresholds too unless --thresholds is given.
    #[arg(long)]
    pub predictors: Option<PathBuf>,
    /// Token-block scores: exact, sampled (attention over every 4th query row), or predicted
    /// [default: predicted with --predictors, else sampled].
    #[arg(long, value_enum)]
    pub scores: Option<ScoreSource>,
    /// The backward pass of an MLP block on the rows it drops: the MLP's exact input gradient,
    /// recomputed from those rows (the dense gradient, at the cost of the block's forward pass on
    /// them), or the residual alone.
    #[arg(long, value_enum, default_value_t = MlpDroppedRows::Exact)]
    pub mlp_dropped_rows: MlpDroppedRows,
    /// Keep exactly the kept fraction (--target-keep, --attention-keep, --mlp-keep) of every
    /// sequence's token blocks in every token-eliminating block, the best-scoring ones, instead
    /// of the blocks over calibrated thresholds: the memory is then what `bench` measures. With
    /// thresholds the kept fraction follows the scores' spread, which training moves
    /// (stories260K calibrated at 0.5 kept 0.59 of its attention rows over 120 steps).
    #[arg(long)]
    pub keep_exactly: bool,
}

impl Default for LemoSettings {
    fn default() -> Self {
        crate::defaults()
    }
}

impl LemoSettings {
    /// The kept fraction one kind of block aims at: its own flag, else its share of
    /// `target_keep` ([`ATTENTION_SHARE`], [`MLP_SHARE`]).
    pub fn block_keep(&self, block: Block) -> f64 {
        let target = self.target_keep;
        match block {
            Block::Attention => self
                .attention_keep
                .unwrap_or((ATTENTION_SHARE * target).min(1.0)),
            Block::Mlp => self
                .mlp_keep
                .unwrap_or((MLP_SHARE * target).max(2.0 * target - 1.0)),
        }
    }

    /// How this run scores token blocks where it computes the scores: blocks of `block_size`,
    /// attention over every [`SAMPLED_QUERY_STRIDE`]-th query row unless `--scores exact`.
    pub fn scoring(&self) -> BlockScoring {
        BlockScoring {
            block_size: self.block_size,
            query_stride: match self.scores {
                Some(ScoreSource::Exact) => 1,
                _ => SAMPLED_QUERY_STRIDE,
            },
            // Each layer's S2 group comes from its attention (`Decoder::shifted_group`).
            s2_group: None,
        }
    }

    /// The mean of the two kinds of block's targets.
    pub fn mean_keep(&self) -> f64 {
        0.5 * (self.block_keep(Block::Attention) + self.block_keep(Block::Mlp))
    }

    /// Whether `model` can eliminate tokens of sequences of `seq_len` tokens in blocks of
    /// these settings.
    pub fn check_sequence<B: LemoBackend>(
        &self,
        model: &CausalLm<B>,
        seq_len: usize,
    ) -> Result<()> {
        model.check_token_elimination(seq_len)?;
        if self.block_size > seq_len {
            bail!(
                "--block-size {} is longer than the sequence ({seq_len} tokens): a block is at most the sequence",
                self.block_size
            );
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<()> {
        for (flag, keep) in [
            ("--target-keep", Some(self.target_keep)),
            ("--attention-keep", self.attention_keep),
            ("--mlp-keep", self.mlp_keep),
        ] {
            if let Some(keep) = keep
                && !(keep > 0.0 && keep <= 1.0)
            {
                bail!(
                    "{flag} {keep} is outside (0, 1]: it is the fraction of tokens each block keeps"
                );
            }
        }
        if !(0.0..=1.0).contains(&self.min_keep) {
            bail!("--min-keep {} is outside [0, 1]", self.min_keep);
        }
        if self.block_size == 0 || !self.block_size.is_multiple_of(8) {
            bail!(
                "--block-size {} must be a positive multiple of 8",
                self.block_size
            );
        }
        if self.calibration_sequences == 0 {
            bail!("--calibration-sequences must be positive");
        }
        if self.keep_exactly && self.thresholds.is_some() {
            bail!(
                "--keep-exactly and --thresholds both say which blocks to keep: pass one of them"
            );
        }
        Ok(())
    }
}

/// Thresholds with every block of `config`'s shape set by `layer`.
pub(crate) fn thresholds_for_model(
    config: &ModelConfig,
    model_name: &str,
    settings: &LemoSettings,
    layers: Vec<LayerThresholds>,
) -> Thresholds {
    Thresholds {
        model: model_name.to_string(),
        block_size: settings.block_size,
        min_keep: settings.min_keep as f32,
        target_keep: Some(settings.mean_keep()),
        layers,
        ..Thresholds::keep_all(
            config.architecture(),
            config.num_layers(),
            config.hidden_size(),
        )
    }
}

/// Reads `settings.thresholds`, checked against the model.
pub fn read_thresholds(path: &Path, config: &ModelConfig) -> Result<Thresholds> {
    let thresholds = Thresholds::read(path)?;
    thresholds.check_model(
        path,
        config.architecture(),
        config.num_layers(),
        config.hidden_size(),
    )?;
    Ok(thresholds)
}

/// What one evaluation of a set of thresholds measured.
#[derive(Debug, Clone, Copy)]
pub struct Evaluation {
    pub loss: f64,
    /// Mean kept fraction of the token-eliminating attention / MLP blocks (1 when none).
    pub keep_attention: f64,
    pub keep_mlp: f64,
}

impl Evaluation {
    /// Mean kept fraction over both kinds of token-eliminating blocks.
    pub fn keep(&self) -> f64 {
        0.5 * (self.keep_attention + self.keep_mlp)
    }
}

/// Mean kept fraction of the blocks of one kind that eliminate tokens (1 when none does).
pub fn sparse_keep(plan: &TokenPlan, block: Block) -> f64 {
    let kept: Vec<f64> = plan
        .layers
        .iter()
        .filter_map(|l| l.get(block).as_ref().map(|k| k.fraction()))
        .collect();
    if kept.is_empty() {
        1.0
    } else {
        kept.iter().sum::<f64>() / kept.len() as f64
    }
}

/// Mean next-token loss of `sequences` and the kept fractions under `thresholds` (dense with
/// `None`), attention scored over every `query_stride`-th query row.
pub fn evaluate<B: LemoBackend>(
    model: &CausalLm<B>,
    sequences: &[Vec<u32>],
    thresholds: Option<&Thresholds>,
    query_stride: usize,
) -> Evaluation {
    let device = model.lm_head_weight().device();
    let (mut loss, mut count) = (0.0, 0usize);
    let (mut keep_attention, mut keep_mlp) = (0.0, 0.0);
    for sequence in sequences {
        let tokens = int_tokens::<B>(std::slice::from_ref(sequence), &device);
        let mut sparsity = thresholds.map_or(TokenSparsity::Dense, |thresholds| {
            TokenSparsity::select(thresholds).with_query_stride(query_stride)
        });
        let (sum, n) = model.next_token_loss_sum(tokens, None, LOSS_SEGMENT, &mut sparsity);
        loss += sum.into_scalar().elem::<f64>();
        count += n;
        let plan = sparsity.into_plan().unwrap_or_default();
        keep_attention += sparse_keep(&plan, Block::Attention);
        keep_mlp += sparse_keep(&plan, Block::Mlp);
    }
    let n = sequences.len().max(1) as f64;
    Evaluation {
        loss: loss / count.max(1) as f64,
        keep_attention: keep_attention / n,
        keep_mlp: keep_mlp / n,
    }
}

/// Scores divided by their mean, as thresholds are relative to it (see `KeptRows::select`).
fn relative_to_mean(scores: Option<Vec<f32>>) -> Vec<f32> {
    let scores = scores.unwrap_or_default();
    let mean = scores.iter().map(|&s| s as f64).sum::<f64>() / scores.len().max(1) as f64;
    scores
        .into_iter()
        .map(|s| {
            if mean > 0.0 {
                (s as f64 / mean) as f32
            } else {
                1.0
            }
        })
        .collect()
}

/// Token-block scores of every block of every layer on `sequences`, scored as `scoring` says,
/// from dense passes, each divided by the mean of its sequence's scores in that layer and block.
pub fn profile<B: LemoBackend>(
    model: &CausalLm<B>,
    config: &ModelConfig,
    sequences: &[Vec<u32>],
    scoring: BlockScoring,
    report: bool,
) -> Vec<LayerProfile> {
    let device = model.lm_head_weight().device();
    let observe = Thresholds {
        block_size: scoring.block_size,
        ..Thresholds::keep_all(
            config.architecture(),
            config.num_layers(),
            config.hidden_size(),
        )
    };
    let mut profiles = vec![LayerProfile::default(); config.num_layers()];
    let mut bar = TaskProgress::new(
        sequences.len() as u64,
        "lemo: profiling token-block scores (sequences)",
        report,
    );
    for sequence in sequences {
        let tokens = int_tokens::<B>(std::slice::from_ref(sequence), &device);
        let mut sparsity = TokenSparsity::recording(&observe, Record::Scores)
            .with_query_stride(scoring.query_stride);
        model.hidden_states(tokens, None, &mut sparsity);
        let plan = sparsity.into_plan().unwrap_or_default();
        for (profile, scores) in profiles.iter_mut().zip(plan.scores) {
            profile
                .attention
                .extend(relative_to_mean(scores.attention.map(|r| r.scores)));
            profile
                .mlp
                .extend(relative_to_mean(scores.mlp.map(|r| r.scores)));
        }
        bar.inc("");
    }
    bar.finish();
    profiles
}

/// A calibrator at the paper's initial thresholds, from the profile of `sequences`.
fn profiled_calibrator<B: LemoBackend>(
    model: &CausalLm<B>,
    config: &ModelConfig,
    sequences: &[Vec<u32>],
    settings: &LemoSettings,
    report: bool,
) -> Calibrator {
    let profiles = profile(model, config, sequences, settings.scoring(), report);
    Calibrator::new(
        profiles,
        &settings.dense_layers,
        settings.mean_keep(),
        MAX_DROP,
    )
}

/// Layer-specific thresholds for `model` calibrated on `sequences` toward
/// `settings.target_keep` (see the module docs); progress and the result on stderr when
/// `report` (one rank of several reports).
pub fn calibrate<B: LemoBackend>(
    model: &CausalLm<B>,
    config: &ModelConfig,
    model_name: &str,
    sequences: &[Vec<u32>],
    settings: &LemoSettings,
    report: bool,
) -> Result<Thresholds> {
    let progress = |len, what| TaskProgress::new(len, what, report);
    if sequences.is_empty() {
        bail!("calibration needs at least one sequence of data");
    }
    let started = Instant::now();
    let query_stride = settings.scoring().query_stride;
    let mut calibrator = profiled_calibrator(model, config, sequences, settings, report);
    let sparse: Vec<(usize, Block)> = (0..calibrator.num_layers())
        .flat_map(|l| [(l, Block::Attention), (l, Block::Mlp)])
        .filter(|&(l, b)| calibrator.is_sparse(l, b))
        .collect();
    if sparse.is_empty() {
        bail!(
            "every layer is listed in --dense-layers {:?}: nothing to eliminate tokens in",
            settings.dense_layers
        );
    }
    // The refinement's baseline; without rounds the measured pass below gives the dense loss
    // (the forward pass of a token-sparse model is exact).
    let dense = (settings.calibration_rounds > 0).then(|| evaluate(model, sequences, None, 1));
    let dense_loss = || dense.as_ref().expect("evaluated when refining").loss;
    let cost = |calibrator_thresholds: Vec<LayerThresholds>| {
        let thresholds = thresholds_for_model(config, model_name, settings, calibrator_thresholds);
        let e = evaluate(model, sequences, Some(&thresholds), query_stride);
        objective(e.loss, dense_loss(), e.keep(), settings.mean_keep())
    };
    let mut bar = progress(
        (settings.calibration_rounds * sparse.len() * 2) as u64,
        "calibrate: refining thresholds",
    );
    for _ in 0..settings.calibration_rounds {
        let gradients: Vec<f64> = sparse
            .iter()
            .map(|&(layer, block)| {
                let up = cost(calibrator.perturbed(layer, block, PROBE));
                bar.inc("");
                let down = cost(calibrator.perturbed(layer, block, -PROBE));
                bar.inc("");
                (up - down) / (2.0 * PROBE)
            })
            .collect();
        // Scale-free step: the block with the steepest slope moves by STEP.
        let steepest = gradients.iter().fold(0.0f64, |m, g| m.max(g.abs()));
        if steepest > 0.0 {
            for (&(layer, block), g) in sparse.iter().zip(&gradients) {
                calibrator.descend(layer, block, *g, STEP / steepest);
            }
        }
    }
    bar.finish();
    // Step 3: training keeps exactly each block's fraction, so the profile alone says where a
    // common shift of each kind's drop fractions puts its kept fraction: no pass over the data.
    for block in [Block::Attention, Block::Mlp] {
        calibrator.meet_target(block, settings.block_keep(block));
    }
    let mut thresholds =
        thresholds_for_model(config, model_name, settings, calibrator.thresholds());
    let measured = evaluate(model, sequences, Some(&thresholds), query_stride);
    let dense_loss = dense.map_or(measured.loss, |dense| dense.loss);
    thresholds.measured = Some(Measured {
        dense_loss,
        loss: measured.loss,
        keep_attention: measured.keep_attention,
        keep_mlp: measured.keep_mlp,
        sequences: sequences.len(),
        seq_len: sequences[0].len(),
    });
    if report {
        eprintln!(
            "calibrate: kept fraction {:.3} (attention {:.3}, MLP {:.3}) at loss {:.4} vs dense {:.4} ({:+.2}%), {:.1}s",
            measured.keep(),
            measured.keep_attention,
            measured.keep_mlp,
            measured.loss,
            dense_loss,
            100.0 * (measured.loss - dense_loss) / dense_loss,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(thresholds)
}

/// Writes `thresholds` to `path` atomically.
pub fn write_thresholds(path: &Path, thresholds: &Thresholds) -> Result<()> {
    lemo_models::adapter::write_atomically(path, thresholds.to_json().as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keeps(target: f64, attention: Option<f64>, mlp: Option<f64>) -> [f64; 2] {
        let settings = LemoSettings {
            target_keep: target,
            attention_keep: attention,
            mlp_keep: mlp,
            ..LemoSettings::default()
        };
        [Block::Attention, Block::Mlp].map(|block| settings.block_keep(block))
    }

    #[test]
    fn target_keep_gives_each_kind_of_block_its_share_unless_its_own_is_given() {
        let close = |[a, m]: [f64; 2], [ea, em]: [f64; 2]| {
            assert!(
                (a - ea).abs() < 1e-12 && (m - em).abs() < 1e-12,
                "{a} / {m}"
            )
        };
        close(keeps(0.5, None, None), [0.7, 0.25]);
        close(keeps(0.3, None, None), [0.42, 0.15]);
        // Every token at 1, and the MLP share rising to meet it.
        close(keeps(1.0, None, None), [1.0, 1.0]);
        close(keeps(0.8, None, None), [1.0, 0.6]);
        close(keeps(0.5, Some(0.9), None), [0.9, 0.25]);
        close(keeps(0.5, Some(0.6), Some(0.4)), [0.6, 0.4]);
    }
}
