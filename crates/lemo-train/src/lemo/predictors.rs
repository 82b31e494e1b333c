//! `train-predictors`: the frozen model's exact token-block scores on the user's data, the
//! attention predictors trained on them (every layer at once, with elastic size
//! transformation), their recall of the exactly kept blocks on held-out sequences, and the
//! predictors file. MLP blocks need none: their exact scores come with their pass.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use burn::backend::Autodiff;
use clap::Args;
use lemo_kernels::LemoBackend;
use lemo_models::CausalLm;
use lemo_models::token_plan::{Record, TokenSparsity};
use lemo_predictor::agreement::{Recall, Selection, predicted_log_scores, recall};
use lemo_predictor::predictor::{DEFAULT_COMPONENTS, DEFAULT_RANK};
use lemo_predictor::scorer::ScorerShape;
use lemo_predictor::stacked::{max_attention_epochs, train_attention_layers};
use lemo_predictor::training::{BlockSamples, TrainOptions, TrainedBlock};
use lemo_predictor::{Predictors, PredictorsHeader, QueryKey};
use lemo_sparsity::Thresholds;
use lemo_sparsity::calibration::Block;

use super::inputs::{InspectArgs, read_sequences};
use super::{LemoSettings, calibrate, read_thresholds};
use crate::data::int_tokens;
use crate::task_progress::TaskProgress;

/// What `train-predictors` reads besides the model and data options it shares with `calibrate`.
#[derive(Debug, Args, Clone)]
pub struct TrainPredictorsArgs {
    #[command(flatten)]
    pub inspect: InspectArgs,
    /// Held-out data to report recall on [default: the --eval-sequences sequences of --data
    /// after the training ones].
    #[arg(long)]
    pub eval_data: Option<PathBuf>,
    /// Sequences the predictors train on (a fifth of them decide what pruning may remove).
    #[arg(long, default_value_t = 32)]
    pub sequences: usize,
    /// Held-out sequences recall is reported on.
    #[arg(long, default_value_t = 8)]
    pub eval_sequences: usize,
    /// Evenly spaced tokens of each token block kept as training data (a divisor of the block
    /// size; predictors score every token when used; held-out recall reads every token too).
    #[arg(long, default_value_t = 16)]
    pub tokens_per_block: usize,
    /// Initial hidden width of the attention predictors (query and key scorers).
    #[arg(long, default_value_t = DEFAULT_RANK)]
    pub rank: usize,
    /// Rank of the block matrix the attention predictors approximate: log-scores per token of
    /// the query and key scorers, whose products are summed.
    #[arg(long, default_value_t = DEFAULT_COMPONENTS)]
    pub components: usize,
    /// Full-batch training epochs before elastic size transformation.
    #[arg(long, default_value_t = TrainOptions::default().epochs)]
    pub epochs: usize,
    /// Adam learning rate of the predictors.
    #[arg(long, default_value_t = TrainOptions::default().learning_rate)]
    pub predictor_lr: f64,
    /// Epochs of training after each pruning (0: no elastic size transformation).
    #[arg(long, default_value_t = TrainOptions::default().prune_every)]
    pub prune_every: usize,
    /// Fraction of each hidden layer's neurons a pruning removes, the most often zero.
    #[arg(long, default_value_t = TrainOptions::default().prune_fraction)]
    pub prune_fraction: f64,
    /// Validation recall a pruning may cost (absolute).
    #[arg(long, default_value_t = TrainOptions::default().recall_tolerance)]
    pub recall_tolerance: f64,
    /// Recall of the exactly kept blocks each layer's predictions must reach on the training
    /// sequences held out from fitting: a layer keeps more blocks than exact scores keep, one
    /// at a time, until its predictions find this share of them (0: as many as exact scores).
    #[arg(long, default_value_t = 0.96)]
    pub recall_target: f64,
}

/// Exact token-block scores and `tokens_per_block` normalized token rows per token block of the
/// input of every token-sparse attention block of `thresholds` (`None` where it stays dense),
/// one dense pass per sequence (with a progress bar titled `what`).
fn collect<B: LemoBackend>(
    model: &CausalLm<B>,
    thresholds: &Thresholds,
    sequences: &[Vec<u32>],
    tokens_per_block: usize,
    what: &str,
) -> Vec<Option<BlockSamples>> {
    let device = model.lm_head_weight().device();
    let observe = Thresholds {
        block_size: thresholds.block_size,
        ..Thresholds::keep_all(
            &thresholds.architecture,
            thresholds.num_layers,
            thresholds.hidden_size,
        )
    };
    let mut samples: Vec<Option<BlockSamples>> = vec![None; thresholds.num_layers];
    let mut bar = TaskProgress::new(sequences.len() as u64, what, true);
    for sequence in sequences {
        let tokens = int_tokens::<B>(std::slice::from_ref(sequence), &device);
        let mut sparsity =
            TokenSparsity::recording(&observe, Record::ScoresAndTokenRows { tokens_per_block });
        model.hidden_states(tokens, None, &mut sparsity);
        let plan = sparsity.into_plan().unwrap_or_default();
        for (layer, recorded) in plan.scores.iter().enumerate() {
            if thresholds.layers[layer].attention.is_none() {
                continue;
            }
            let record = recorded
                .attention
                .as_ref()
                .expect("every block is recorded");
            let token_rows = record
                .token_rows
                .as_ref()
                .expect("token rows were asked for");
            samples[layer]
                .get_or_insert_with(|| {
                    BlockSamples::new(
                        record.scores.len(),
                        tokens_per_block,
                        thresholds.hidden_size,
                    )
                })
                .push(token_rows, &record.scores);
        }
        bar.inc("");
    }
    bar.finish();
    samples
}

impl TrainPredictorsArgs {
    fn validate(&self) -> Result<()> {
        if self.sequences < 2 || self.eval_sequences == 0 {
            bail!("--sequences must be at least 2 and --eval-sequences at least 1");
        }
        if self.components == 0 || self.rank == 0 {
            bail!("--components and --rank must be at least 1");
        }
        if !(0.0..=1.0).contains(&self.recall_target) {
            bail!(
                "--recall-target {} is not a share between 0 and 1",
                self.recall_target
            );
        }
        Ok(())
    }

    /// Tokens of each block kept as training data: a divisor of `block_size`.
    fn tokens_per_block(&self, block_size: usize) -> Result<usize> {
        let tokens = self.tokens_per_block.min(block_size);
        if tokens == 0 || !block_size.is_multiple_of(tokens) {
            bail!(
                "--tokens-per-block {} does not divide the block size {block_size}",
                self.tokens_per_block
            );
        }
        Ok(tokens)
    }

    fn options(&self) -> TrainOptions {
        TrainOptions {
            epochs: self.epochs,
            learning_rate: self.predictor_lr,
            prune_every: self.prune_every,
            prune_fraction: self.prune_fraction,
            recall_tolerance: self.recall_tolerance,
            seed: 0,
        }
    }
}

/// Each token-sparse layer: its samples and how it selects (predicted scores keep the fraction
/// the exact scores keep on every training sequence, raised after training to the recall
/// target).
fn fitted_layers<'a>(
    train_samples: &'a [Option<BlockSamples>],
    thresholds: &Thresholds,
) -> Result<Vec<(usize, &'a BlockSamples, Selection)>> {
    let layers: Vec<(usize, &BlockSamples, Selection)> = train_samples
        .iter()
        .enumerate()
        .filter_map(|(layer, samples)| {
            let samples = samples.as_ref()?;
            let threshold = thresholds.layers[layer].attention?;
            let floor = thresholds.min_keep_of(Block::Attention);
            let selection = Selection::fitted(threshold, floor, &samples.scores, samples.blocks);
            Some((layer, samples, selection))
        })
        .collect();
    if layers.is_empty() {
        bail!("these thresholds keep every attention block dense: there is nothing to predict");
    }
    Ok(layers)
}

/// Token sequences of one length.
type Sequences = Vec<Vec<u32>>;

/// The training sequences and the held-out ones (`--eval-data`, else the last of `--data`).
fn read_train_and_held_out(
    args: &TrainPredictorsArgs,
    config: &lemo_models::ModelConfig,
    seq_len: usize,
) -> Result<(Sequences, Sequences)> {
    let inspect = &args.inspect;
    let (train, held_out) = match &args.eval_data {
        Some(eval_data) => (
            read_sequences(inspect, &inspect.data, config, seq_len, args.sequences)?,
            read_sequences(inspect, eval_data, config, seq_len, args.eval_sequences)?,
        ),
        None => {
            let mut all = read_sequences(
                inspect,
                &inspect.data,
                config,
                seq_len,
                args.sequences + args.eval_sequences,
            )?;
            if all.len() <= args.eval_sequences + 1 {
                bail!(
                    "{} holds {} sequences of {seq_len} tokens: too few for --eval-sequences {} held out and at least two to train on (pass --eval-data)",
                    inspect.data.display(),
                    all.len(),
                    args.eval_sequences
                );
            }
            let held_out = all.split_off(all.len() - args.eval_sequences);
            (all, held_out)
        }
    };
    if train.len() < 2 || held_out.is_empty() {
        bail!(
            "train-predictors needs at least two training sequences and one held-out sequence of {seq_len} tokens (found {} and {})",
            train.len(),
            held_out.len()
        );
    }
    Ok((train, held_out))
}

/// Runs `train-predictors` on backend `B` over sequences of `seq_len` tokens, the model's
/// positions interpolated by `position_interpolation` (1: none); returns the predictors file.
pub fn train_predictors<B: LemoBackend>(
    args: &TrainPredictorsArgs,
    settings: &LemoSettings,
    model: &CausalLm<B>,
    config: &lemo_models::ModelConfig,
    seq_len: usize,
    position_interpolation: f64,
) -> Result<PathBuf> {
    let started = Instant::now();
    let inspect = &args.inspect;
    args.validate()?;
    let (train, held_out) = read_train_and_held_out(args, config, seq_len)?;
    let name = inspect.model.model.display().to_string();
    let thresholds = match &settings.thresholds {
        Some(path) => read_thresholds(path, config)?,
        None => {
            let count = settings.calibration_sequences.min(train.len());
            calibrate(model, config, &name, &train[..count], settings, true)?
        }
    };
    eprintln!(
        "train-predictors: {} training and {} held-out sequences of {seq_len} tokens, blocks of {}",
        train.len(),
        held_out.len(),
        thresholds.block_size
    );
    let block_size = thresholds.block_size;
    let tokens_per_block = args.tokens_per_block(block_size)?;
    let train_samples = collect(
        model,
        &thresholds,
        &train,
        tokens_per_block,
        "train-predictors: exact scores",
    );
    let held_out_samples = collect(
        model,
        &thresholds,
        &held_out,
        block_size,
        "train-predictors: held-out scores",
    );
    eprintln!(
        "train-predictors: exact scores of {} sequences collected, {:.1}s",
        train.len() + held_out.len(),
        started.elapsed().as_secs_f64()
    );
    let layers = fitted_layers(&train_samples, &thresholds)?;
    let options = args.options();
    let device = model.lm_head_weight().device();
    // A fifth of the training sequences (at least one) decide what pruning may remove.
    let splits: Vec<(BlockSamples, BlockSamples)> = layers
        .iter()
        .map(|(_, samples, _)| {
            let validation_count = (samples.sequences() / 5).max(1);
            samples.split(samples.sequences() - validation_count)
        })
        .collect();
    let fit: Vec<&BlockSamples> = splits.iter().map(|(fit, _)| fit).collect();
    let validation: Vec<&BlockSamples> = splits.iter().map(|(_, v)| v).collect();
    let selections: Vec<Selection> = layers.iter().map(|&(_, _, s)| s).collect();
    let mut bar = TaskProgress::new(
        max_attention_epochs(args.rank, &options) as u64,
        "train-predictors: attention predictors (every layer)",
        true,
    );
    let results = train_attention_layers::<Autodiff<B>>(
        &fit,
        &validation,
        &selections,
        ScorerShape {
            rank: args.rank,
            components: args.components,
        },
        &options,
        &device,
        &mut || bar.inc(""),
    );
    bar.finish();
    eprintln!(
        "train-predictors: attention predictors of {} layers trained, {:.1}s",
        layers.len(),
        started.elapsed().as_secs_f64()
    );

    let trained: Vec<TrainedLayer<B>> = layers
        .iter()
        .zip(results)
        .zip(validation)
        .map(|((&(layer, _, fitted), result), validation)| TrainedLayer {
            layer,
            fitted,
            result,
            validation,
        })
        .collect();
    let mut header = PredictorsHeader::new(thresholds.clone(), args.rank);
    header.model = name;
    header.recall_target = Some(args.recall_target).filter(|&target| target > 0.0);
    let predictors = held_out_report(&mut header, args, trained, &held_out_samples, &device);
    header.held_out_sequences = held_out.len();
    header.seq_len = seq_len;
    header.position_interpolation = Some(position_interpolation);
    print_report(&header);
    let predictors = Predictors::new(header, &predictors);
    let out = inspect
        .out
        .clone()
        .unwrap_or_else(|| "predictors.safetensors".into());
    lemo_models::adapter::write_atomically(&out, &predictors.to_bytes())?;
    eprintln!(
        "train-predictors: wrote {} ({} parameters), {:.1}s",
        out.display(),
        predictors.num_params(),
        started.elapsed().as_secs_f64()
    );
    Ok(out)
}

/// One layer's trained predictor, with the selection fitted to the training sequences and the
/// validation samples its recall target is met on.
struct TrainedLayer<'a, B: LemoBackend> {
    layer: usize,
    fitted: Selection,
    result: TrainedBlock<B>,
    validation: &'a BlockSamples,
}

/// Each layer's kept fraction raised to the recall target, its held-out recall and size in
/// `header` (and the means); returns the predictors by layer.
fn held_out_report<B: LemoBackend>(
    header: &mut PredictorsHeader,
    args: &TrainPredictorsArgs,
    trained: Vec<TrainedLayer<B>>,
    held_out_samples: &[Option<BlockSamples>],
    device: &B::Device,
) -> Vec<Option<QueryKey<B>>> {
    let mut predictors: Vec<Option<QueryKey<B>>> = vec![None; header.thresholds.num_layers];
    let mut held_out_recalls: Vec<Recall> = Vec::new();
    for TrainedLayer {
        layer,
        fitted,
        result,
        validation,
    } in trained
    {
        let selection = fitted.with_recall_target(
            args.recall_target,
            &predicted_log_scores(&result.predictor, validation, device),
            validation,
        );
        let held_out = held_out_samples[layer]
            .as_ref()
            .expect("held-out sequences have the same blocks");
        let measured = recall(&result.predictor, held_out, selection, device);
        held_out_recalls.push(measured);
        header.thresholds.layers[layer].attention_keep = Some(selection.predicted_keep);
        header.layers[layer] = Some(lemo_predictor::file::BlockReport {
            widths: result.predictor.widths(),
            params_before: result.params_before,
            params_after: result.predictor.num_params(),
            recall: measured.recall,
            precision: measured.precision,
            kept: measured.kept,
            exact_kept: measured.exact_kept,
            captured: measured.captured,
            ranked: measured.ranked,
        });
        predictors[layer] = Some(result.predictor);
    }
    let count = held_out_recalls.len() as f64;
    header.recall = held_out_recalls.iter().map(|r| r.recall).sum::<f64>() / count;
    header.precision = held_out_recalls.iter().map(|r| r.precision).sum::<f64>() / count;
    header.captured = held_out_recalls.iter().map(|r| r.captured).sum::<f64>() / count;
    predictors
}

/// The per-layer table of recall, precision and size, and the means.
fn print_report(header: &PredictorsHeader) {
    eprintln!(
        "layer  recall  precision  captured  ranked  kept (exact)   threshold  params before -> after"
    );
    let (mut before, mut after, mut ranked, mut count) = (0usize, 0usize, 0.0f64, 0usize);
    for (layer, report) in header.layers.iter().enumerate() {
        let Some(b) = report else { continue };
        let threshold = header.thresholds.layers[layer]
            .attention
            .unwrap_or(f32::NAN);
        eprintln!(
            "{layer:>5}  {:>5.1}%  {:>8.1}%  {:>7.1}%  {:>5.1}%  {:>5.1}% ({:>5.1}%)  {threshold:>9.3}  {:>13} -> {}",
            100.0 * b.recall,
            100.0 * b.precision,
            100.0 * b.captured,
            100.0 * b.ranked,
            100.0 * b.kept,
            100.0 * b.exact_kept,
            b.params_before,
            b.params_after
        );
        before += b.params_before;
        after += b.params_after;
        ranked += b.ranked;
        count += 1;
    }
    eprintln!(
        "mean held-out recall {:.2}%, precision {:.2}%, informativeness captured {:.2}%, ranked recall {:.2}% ({} sequences of {} tokens); parameters {before} -> {after} ({:.1}% removed)",
        100.0 * header.recall,
        100.0 * header.precision,
        100.0 * header.captured,
        100.0 * ranked / count.max(1) as f64,
        header.held_out_sequences,
        header.seq_len,
        100.0 * (1.0 - after as f64 / before.max(1) as f64)
    );
    if let Some(target) = header.recall_target {
        eprintln!(
            "each layer keeps more blocks than exact scores keep where its predictions recall under {:.1}% of them on the training sequences held out from fitting (--recall-target)",
            100.0 * target
        );
    }
}
