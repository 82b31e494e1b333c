//! How a run scores token blocks: exact scores, or trained predictors (`--predictors FILE`,
//! the default whenever a file is given; `--scores exact` turns them off).

use std::path::Path;

use anyhow::{Result, bail};
use burn::tensor::backend::Backend;
use lemo_models::ModelConfig;
use lemo_models::token_plan::DroppedRows;
use lemo_models::token_plan::TokenSparsity;
use lemo_predictor::predictor::DEFAULT_COMPONENTS;
use lemo_predictor::{Predictors, PredictorsHeader, QueryKey};
use lemo_sparsity::calibration::Block;
use lemo_sparsity::{LayerThresholds, Thresholds};
use serde::{Deserialize, Serialize};

use super::LemoSettings;

/// Width of `bench`'s untrained attention predictors. Trained ones start at
/// [`lemo_predictor::predictor::DEFAULT_RANK`], and elastic size transformation leaves most
/// layers at its floor of 4 neurons (SmolLM2-135M: 26 of 29 layers; stories260K: every layer),
/// so `bench` times twice that.
const BENCH_PREDICTOR_RANK: usize = 8;

/// Query rows the sampled attention scores read: one in 4, a quarter of the exact scores' work
/// (at 32K tokens on the Llama-2-7B shape the exact ones cost about a fifth of a step).
pub const SAMPLED_QUERY_STRIDE: usize = 4;

/// Where token-block scores come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScoreSource {
    /// Exact scores from each block's pass over every token (O(s^2 h) per attention block).
    Exact,
    /// Attention blocks' scores from the pass's queries and keys over every
    /// [`SAMPLED_QUERY_STRIDE`]-th query row (a block's largest score among a quarter of its
    /// queries); MLP blocks' exact scores, which their pass computes anyway.
    Sampled,
    /// Trained predictors (`--predictors FILE`) for the attention blocks: a few small GEMMs per
    /// block. MLP blocks keep their exact scores, which their pass computes anyway.
    Predicted,
}

/// What the backward pass of a token-sparse MLP block does on the rows it drops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MlpDroppedRows {
    /// The MLP's exact input gradient, recomputed from the dropped rows in the backward pass
    /// (only their input is saved): the MLP's backward pass is the dense one. Runs recorded
    /// as "stand-in" (the linear stand-in this replaced) resume with this.
    #[default]
    #[serde(alias = "stand-in")]
    Exact,
    /// Through the residual alone: faster, further from the dense gradient.
    Residual,
}

impl MlpDroppedRows {
    fn model(self) -> DroppedRows {
        match self {
            MlpDroppedRows::Exact => DroppedRows::Exact,
            MlpDroppedRows::Residual => DroppedRows::Residual,
        }
    }
}

/// Token elimination of a run: thresholds, the predictors that score for them (if any), the
/// query rows the scores computed from queries and keys read, and what the MLP blocks' backward
/// pass does on their dropped rows.
pub struct Elimination {
    pub thresholds: Thresholds,
    pub predictors: Option<Predictors>,
    pub query_stride: usize,
    pub mlp_dropped_rows: MlpDroppedRows,
}

impl Elimination {
    /// The token sparsity of one forward pass.
    pub fn token_sparsity(&self) -> TokenSparsity<'_> {
        let sparsity = match &self.predictors {
            Some(predictors) => TokenSparsity::predicted(&self.thresholds, predictors),
            None => TokenSparsity::select(&self.thresholds),
        };
        sparsity
            .with_query_stride(self.query_stride)
            .with_dropped_rows(self.mlp_dropped_rows.model())
    }
}

/// The token sparsity of a pass of a run with (`Some`) or without token elimination.
pub fn token_sparsity(elimination: Option<&Elimination>) -> TokenSparsity<'_> {
    elimination.map_or(TokenSparsity::Dense, Elimination::token_sparsity)
}

/// The predictors `settings` ask for, checked against the model: `--predictors` unless
/// `--scores exact`; `--scores predicted` without a file is an error.
pub fn read_predictors(
    settings: &LemoSettings,
    config: &ModelConfig,
) -> Result<Option<Predictors>> {
    let path = match (settings.scores, &settings.predictors) {
        (Some(ScoreSource::Exact | ScoreSource::Sampled), _) | (None, None) => return Ok(None),
        (_, Some(path)) => path,
        (Some(ScoreSource::Predicted), None) => bail!(
            "--scores predicted needs --predictors FILE (written by `cargo xtask train-predictors`)"
        ),
    };
    let predictors = Predictors::read(path)?;
    predictors.check_model(
        path,
        config.architecture(),
        config.num_layers(),
        config.hidden_size(),
    )?;
    Ok(Some(predictors))
}

/// Checks that `predictors` can score for `thresholds`: the same block size, and a predictor
/// for every token-sparse attention block.
pub fn check_coverage(predictors: &Predictors, path: &Path, thresholds: &Thresholds) -> Result<()> {
    let h = &predictors.header;
    if h.block_size != thresholds.block_size {
        bail!(
            "{} predicts blocks of {} tokens, but the thresholds use blocks of {}",
            path.display(),
            h.block_size,
            thresholds.block_size
        );
    }
    for (layer, (wanted, trained)) in thresholds
        .layers
        .iter()
        .zip(&h.thresholds.layers)
        .enumerate()
    {
        if wanted.attention.is_some() && trained.attention.is_none() {
            bail!(
                "{} has no predictor for the attention block of layer {layer}, which these thresholds make token-sparse (retrain the predictors with the same --dense-layers)",
                path.display()
            );
        }
    }
    Ok(())
}

/// The thresholds given by `--thresholds`, else [`keep_exactly`]'s with `--keep-exactly`, else
/// those the predictors were trained with, else `otherwise()` (calibration, a run folder's
/// file...), with the predictors. A run whose model
/// runs at `position_interpolation` (its linear RoPE factor; `None`: not a question, as for
/// `bench`) is warned when the predictors learned from another one.
pub fn elimination(
    settings: &LemoSettings,
    config: &ModelConfig,
    position_interpolation: Option<f64>,
    otherwise: impl FnOnce() -> Result<Thresholds>,
) -> Result<Elimination> {
    let predictors = read_predictors(settings, config)?;
    let thresholds = match (&settings.thresholds, &predictors) {
        (Some(path), _) => {
            let thresholds = super::read_thresholds(path, config)?;
            if thresholds.block_size != settings.block_size {
                bail!(
                    "--thresholds {} was calibrated with blocks of {} tokens, not --block-size {}: pass --block-size {}",
                    path.display(),
                    thresholds.block_size,
                    settings.block_size,
                    thresholds.block_size
                );
            }
            thresholds
        }
        (None, _) if settings.keep_exactly => keep_exactly(config, settings),
        (None, Some(predictors)) => predictors.header.thresholds.clone(),
        (None, None) => otherwise()?,
    };
    if let (Some(predictors), Some(path)) = (&predictors, &settings.predictors) {
        check_coverage(predictors, path, &thresholds)?;
        eprintln!(
            "lemo: token-block scores predicted by {} ({} parameters; held-out recall {:.1}%)",
            path.display(),
            predictors.num_params(),
            100.0 * predictors.header.recall
        );
        if let (Some(trained), Some(run)) = (
            predictors.header.position_interpolation,
            position_interpolation,
        ) && (trained - run).abs() > 1e-9
        {
            eprintln!(
                "lemo: warning: {} learned from the model at RoPE position interpolation x{trained}, this run interpolates x{run}: its kept fractions will be off (train the predictors with this run's --target-context)",
                path.display()
            );
        }
    }
    Ok(Elimination {
        thresholds,
        predictors,
        query_stride: settings.scoring().query_stride,
        mlp_dropped_rows: settings.mlp_dropped_rows,
    })
}

/// Thresholds under which every token-eliminating block keeps exactly its kept fraction
/// ([`LemoSettings::block_keep`]) of its token blocks, the best-scoring ones (a floor and no
/// threshold): what `bench` measures with on random weights, where exact and predicted scores
/// then keep as many tokens.
pub fn keep_exactly(config: &ModelConfig, settings: &LemoSettings) -> Thresholds {
    let layers = (0..config.num_layers())
        .map(|layer| {
            let sparse = (!settings.dense_layers.contains(&layer)).then_some(f32::MAX);
            LayerThresholds {
                attention: sparse,
                mlp: sparse,
                attention_keep: None,
                mlp_keep: None,
            }
        })
        .collect();
    let mut thresholds = super::thresholds_for_model(config, "", settings, layers);
    thresholds.block_min_keep =
        Some([Block::Attention, Block::Mlp].map(|b| settings.block_keep(b) as f32));
    thresholds
}

/// `bench`'s token elimination: `--thresholds` or [`keep_exactly`]; with `--scores predicted`
/// and no `--predictors`, untrained attention predictors of the size trained ones end at
/// ([`BENCH_PREDICTOR_RANK`]; their time and memory are those of trained ones, their choice of
/// blocks is not).
pub fn bench_elimination<B: Backend>(
    settings: &LemoSettings,
    config: &ModelConfig,
    device: &B::Device,
) -> Result<Elimination> {
    let untrained =
        settings.scores == Some(ScoreSource::Predicted) && settings.predictors.is_none();
    let exact = LemoSettings {
        scores: untrained.then_some(ScoreSource::Exact).or(settings.scores),
        ..settings.clone()
    };
    let mut elimination = elimination(&exact, config, None, || Ok(keep_exactly(config, settings)))?;
    if untrained {
        let rank = BENCH_PREDICTOR_RANK;
        let layers: Vec<Option<QueryKey<B>>> = elimination
            .thresholds
            .layers
            .iter()
            .map(|t| {
                t.attention
                    .map(|_| QueryKey::new(config.hidden_size(), rank, DEFAULT_COMPONENTS, device))
            })
            .collect();
        let header = PredictorsHeader::new(elimination.thresholds.clone(), rank);
        let predictors = Predictors::new(header, &layers);
        eprintln!(
            "bench: untrained attention predictors of rank {rank} ({} parameters), for timing only",
            predictors.num_params()
        );
        elimination.predictors = Some(predictors);
    }
    Ok(elimination)
}
