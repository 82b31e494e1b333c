//! `train`: LoRA fine-tuning (dense `lora`, `longlora`) with AdamW, warm-up and schedule,
//! gradient accumulation, global-norm clipping, position interpolation, the segment-based loss,
//! atomic checkpoints with exact resume, `metrics.jsonl`, plots and a progress bar.

pub mod checkpoint;
pub mod config;
pub mod optim;
pub mod report;

use lemo_models::token_plan::TokenSparsity;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use lemo_kernels::LemoBackend;
use lemo_models::model::ModelFormat;
use lemo_models::{CausalLm, LoraConfig, ModelConfig};
use serde_json::json;

use crate::corpus::{Corpus, PackOptions, default_cache_dir, read_documents_cached};
use crate::data::{LazyTokenizer, TokenWidth, find_tokenizer};
use crate::device::{BackendJob, PrecisionKind};
use crate::memory::{self, PeakTracker, gib};
use crate::modelio::{TRAINING_INFO_FILE, TrainingInfo, interpolated_rope};
use crate::sparsity::{self, THRESHOLDS_FILE, sparse_keep};
use burn_dataset::Dataset;
use checkpoint::{CheckpointFiles, TrainerState};
use config::{Method, TrainConfig};
use lemo_sparsity::calibration::Block;
use optim::{AdamW, AdamWSettings, NamedTensors};

/// What a finished (or stopped) run reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TrainSummary {
    pub out: PathBuf,
    pub adapter: Option<PathBuf>,
    pub steps_done: usize,
    pub first_loss: Option<f64>,
    pub last_loss: Option<f64>,
    pub val_loss: Option<f64>,
    pub plots: Vec<PathBuf>,
    pub metrics: PathBuf,
    pub last_checkpoint: Option<PathBuf>,
}

pub struct TrainJob {
    pub config: TrainConfig,
    /// Checkpoint folder to continue from.
    pub resume: Option<PathBuf>,
    /// `config.precision` resolved for the device.
    pub precision: PrecisionKind,
}

impl BackendJob for TrainJob {
    type Output = TrainSummary;

    fn run<B: LemoBackend>(self, device: B::Device) -> Result<TrainSummary> {
        run_on::<B>(self, device)
    }
}

/// Loss and gradient of one micro-batch. The model's next-token loss is the segment-based one:
/// the vocabulary projection and cross-entropy run (forward and backward) one segment of
/// `segment` positions at a time during the forward pass, so at most one segment's logits exist
/// at once; the backward pass then starts from the hidden-state gradients they left. With
/// `checkpointing`, only each layer's input is kept and the backward pass recomputes one layer
/// at a time. Each block processes the rows `sparsity` gives it (the kept rows of `--method
/// lemo`), and the plan it chose is left in `sparsity`.
///
/// `scale` multiplies the loss (1 / predicted tokens / accumulation steps). Gradients of the
/// trainable parameters are added into `grads`; returns the unscaled loss sum, the number of
/// predictions and the memory in use at the end of the forward pass (with checkpointing: once
/// the loss's backward pass has run, while every layer input is kept).
pub fn forward_backward<B: AutodiffBackend + LemoBackend>(
    model: &CausalLm<B>,
    tokens: Tensor<B, 2, Int>,
    segment: usize,
    scale: f64,
    checkpointing: bool,
    sparsity: &mut TokenSparsity,
    grads: &mut NamedTensors<B::InnerBackend>,
) -> (f64, usize, u64)
where
    B::InnerBackend: LemoBackend,
{
    let (loss_sum, predictions, after_forward) = if checkpointing {
        let mut after_forward = None;
        let (loss_sum, predictions) = model.next_token_loss_backward_recomputed(
            tokens,
            segment,
            scale,
            sparsity,
            &mut |gradients| {
                after_forward.get_or_insert_with(|| memory::sample().in_use);
                optim::accumulate_grads(model, gradients, grads);
            },
        );
        (loss_sum, predictions, after_forward.unwrap_or_default())
    } else {
        let (loss, predictions) = model.next_token_loss_sum(tokens, segment, sparsity);
        let after_forward = memory::sample().in_use;
        let loss_sum = loss.clone().inner();
        let model_grads = loss.mul_scalar(scale).backward();
        optim::accumulate_grads(model, &model_grads, grads);
        (loss_sum, predictions, after_forward)
    };
    (
        loss_sum.into_scalar().elem::<f64>(),
        predictions,
        after_forward,
    )
}

/// Mean next-token loss of `sequences` (evaluation mode: dense attention, no graph).
pub fn validation_loss<B: LemoBackend>(
    model: &CausalLm<B>,
    sequences: &[Vec<u32>],
    segment: usize,
) -> f64 {
    let device = model.lm_head_weight().device();
    let (mut sum, mut count) = (0.0, 0usize);
    for sequence in sequences {
        let tokens = int_tokens::<B>(std::slice::from_ref(sequence), &device);
        let (loss, n) = model.next_token_loss_sum(tokens, segment, &mut TokenSparsity::Dense);
        sum += loss.into_scalar().elem::<f64>();
        count += n;
    }
    sum / count.max(1) as f64
}

pub fn int_tokens<B: Backend>(sequences: &[Vec<u32>], device: &B::Device) -> Tensor<B, 2, Int> {
    let len = sequences[0].len();
    let ids: Vec<i32> = sequences
        .iter()
        .flat_map(|s| s.iter().map(|&t| t as i32))
        .collect();
    Tensor::from_data(TensorData::new(ids, [sequences.len(), len]), device)
}

/// Settles what the run trains on: the model path, tokenizer and data (making the preset's).
fn prepare_inputs(config: &mut TrainConfig) -> Result<()> {
    if config.preset.is_some() && config.model.is_none() {
        let base = config.out.join("base-model");
        if !base.join("model.safetensors").exists() {
            crate::preset::write_tiny_model(&base, config.seed)?;
        }
        config.model = Some(base.clone());
        config.tokenizer.get_or_insert(base.join("tokenizer.json"));
    }
    if config.preset.is_some() && config.data.is_none() {
        let data = config.out.join("data").join("stories.jsonl");
        if !data.exists() {
            crate::preset::write_stories(&data, 1500, config.seed)?;
        }
        config.data = Some(data);
    }
    Ok(())
}

fn run_on<B: LemoBackend>(job: TrainJob, device: B::Device) -> Result<TrainSummary> {
    type AB<B> = Autodiff<B>;
    let mut config = job.config;
    prepare_inputs(&mut config)?;
    config.validate()?;
    let out = config.out.clone();
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let model_path = config.model.clone().expect("validated");
    let data_path = config.data.clone().expect("validated");

    AB::<B>::seed(&device, config.seed);
    let precision = job.precision;
    let (mut model, model_config) =
        CausalLm::<AB<B>>::from_path(&model_path, &device, precision.policy())?;
    let trained_context = model_config.max_position_embeddings();
    let mut rope_scaling = None;
    if let Some(target) = config.target_context
        && let Some((rope, factor)) = interpolated_rope(&model_config, target)?
    {
        model = model.with_rope(&rope)?;
        rope_scaling = Some(json!({"rope_type": "linear", "factor": factor}));
        eprintln!(
            "rope: linear position interpolation {trained_context} -> {target} tokens (factor {factor})"
        );
    }
    let seq_len = config
        .seq_len
        .or(config.target_context)
        .unwrap_or(trained_context);
    if let Some(limit) = model_config.max_sequence_length().filter(|&l| seq_len > l) {
        bail!("--seq-len {seq_len} is longer than this model supports ({limit} positions)");
    }
    let lora = LoraConfig {
        rank: config.lora_rank,
        alpha: config.lora_alpha,
        dropout: config.lora_dropout,
        target_modules: config.lora_targets.clone(),
        train_embeddings: config.train_embeddings(),
        train_norms: config.train_norms(),
    };
    model = model
        .with_new_lora(&lora, config.seed)?
        .set_extra_trainable(&lora)?;
    if config.method == Method::Longlora {
        let group = config.s2_group_size.unwrap_or(seq_len / 4).max(2);
        model.set_shifted_group(Some(group));
        eprintln!(
            "longlora: S2 attention with groups of {group} tokens while training, dense at evaluation"
        );
    }

    // Data.
    let tokenizer_path = config
        .tokenizer
        .clone()
        .or_else(|| find_tokenizer(&model_path));
    let mut tokenizer = LazyTokenizer::new(tokenizer_path.clone());
    let cache_dir = match &config.cache_dir {
        Some(p) if p.as_os_str() == "none" => None,
        Some(p) => Some(p.clone()),
        None => default_cache_dir(),
    };
    let started_reading = Instant::now();
    let documents = read_documents_cached(
        &data_path,
        TokenWidth::from_bytes(config.token_width)?,
        &mut tokenizer,
        tokenizer_path.as_deref(),
        cache_dir.as_deref(),
    )?;
    let vocab = model_config.vocab_size();
    if let Some(bad) = documents.iter().flatten().find(|&&id| id as usize >= vocab) {
        bail!("token id {bad} is outside the model's vocabulary of {vocab} (wrong tokenizer?)");
    }
    let is_llama2c = matches!(ModelFormat::detect(&model_path)?, ModelFormat::Llama2c);
    let (bos, eos) = special_ids(&model_config, &mut tokenizer);
    let append_eos = config.append_eos.unwrap_or(!is_llama2c);
    let pack = PackOptions {
        seq_len,
        bos,
        eos: eos.filter(|_| append_eos),
        val_fraction: config.val_fraction,
        seed: config.seed,
    };
    let corpus = Corpus::new(&documents, &pack)?;
    eprintln!(
        "data: {} documents, {} sequences of {seq_len} tokens ({} tokens; {} training, {} validation) in {:.1}s",
        corpus.documents,
        corpus.train_len() + corpus.val.len(),
        corpus.tokens,
        corpus.train_len(),
        corpus.val.len(),
        started_reading.elapsed().as_secs_f64()
    );
    let val_sequences: Vec<Vec<u32>> = {
        use burn_dataset::Dataset;
        let n = if config.val_sequences == 0 {
            corpus.val.len()
        } else {
            config.val_sequences.min(corpus.val.len())
        };
        (0..n)
            .map(|i| corpus.val.get(i).expect("in range"))
            .collect()
    };

    // Token elimination: the run's thresholds, from --thresholds, from the run folder when
    // resuming, or calibrated on the first training sequences with the fresh adapter.
    let thresholds = if config.method == Method::Lemo {
        model.check_token_elimination(seq_len)?;
        let settings = config.sparsity();
        let saved = out.join(THRESHOLDS_FILE);
        let thresholds = match &settings.thresholds {
            Some(path) => sparsity::read_thresholds(path, &model_config)?,
            None if job.resume.is_some() && saved.exists() => {
                sparsity::read_thresholds(&saved, &model_config)?
            }
            None => {
                let count = settings.calibration_sequences.min(corpus.train_len());
                let sequences: Vec<Vec<u32>> =
                    (0..count).map(|i| corpus.train_sequence(i)).collect();
                eprintln!(
                    "lemo: calibrating per-layer thresholds on {count} training sequences toward a kept fraction of {}",
                    settings.target_keep
                );
                sparsity::calibrate(
                    &model.valid(),
                    &model_config,
                    &model_path.display().to_string(),
                    &sequences,
                    &settings,
                )?
            }
        };
        sparsity::write_thresholds(&saved, &thresholds)?;
        Some(thresholds)
    } else {
        None
    };

    // Optimizer and resume.
    let settings = AdamWSettings {
        beta1: config.beta1,
        beta2: config.beta2,
        eps: config.eps,
        weight_decay: config.weight_decay,
    };
    let mut optimizer = AdamW::<B>::new(settings);
    let mut start_step = 0usize;
    let mut tokens_seen = 0u64;
    let mut elapsed_before = 0.0;
    if let Some(dir) = &job.resume {
        let files = checkpoint::load(dir)?;
        if files.state.seq_len != seq_len
            || files.state.train_sequences != corpus.train_len()
            || files.state.seed != config.seed
        {
            bail!(
                "--resume {}: the checkpoint was trained with seq_len {}, {} training sequences, seed {}; this run has {seq_len}, {}, {}: same data and settings are needed to continue",
                dir.display(),
                files.state.seq_len,
                files.state.train_sequences,
                files.state.seed,
                corpus.train_len(),
                config.seed
            );
        }
        let values: NamedTensors<B> = files
            .trainable
            .into_iter()
            .map(|(name, v)| {
                let len = v.len();
                (
                    name,
                    Tensor::<B, 1>::from_data(TensorData::new(v, [len]), &device),
                )
            })
            .collect();
        model = optim::set_trainable(model, values)?;
        optimizer.load_state(files.optimizer_step, files.optimizer, &device)?;
        start_step = files.state.step;
        tokens_seen = files.state.tokens_seen;
        elapsed_before = files.state.elapsed_s;
        eprintln!(
            "resume: continuing from step {start_step} ({})",
            dir.display()
        );
    }
    let mut saved_config = config.clone();
    saved_config.stop_after = None;
    lemo_models::adapter::write_atomically(
        &out.join("config.toml"),
        saved_config.to_toml().as_bytes(),
    )?;

    let trainable = optim::trainable_count::<AB<B>, _>(&model);
    eprintln!(
        "train: {} on {} ({} trainable parameters, {}), {} steps x {} micro-batches x {} sequences, device {}",
        config.method.name(),
        model_path.display(),
        trainable,
        precision.name(),
        config.steps,
        config.grad_accum,
        config.batch_size,
        B::name(&device)
    );

    let info = TrainingInfo {
        method: config.method.name().to_string(),
        base_model: model_path.display().to_string(),
        trained_context,
        target_context: config.target_context,
        rope_scaling: rope_scaling.clone(),
        seq_len,
        steps: config.steps,
    };
    let write_adapter = |model: &CausalLm<AB<B>>, dir: &Path| -> Result<()> {
        let inner = model.valid();
        inner.save_adapter(dir, &lora, &model_path.display().to_string())?;
        if let Some(thresholds) = &thresholds {
            sparsity::write_thresholds(&dir.join(THRESHOLDS_FILE), thresholds)?;
        }
        lemo_models::adapter::write_atomically(
            &dir.join(TRAINING_INFO_FILE),
            serde_json::to_string_pretty(&info)?.as_bytes(),
        )?;
        Ok(())
    };

    let mut metrics = report::MetricsWriter::open(&out, start_step)?;
    let bar = progress_bar(config.steps, start_step);
    let run_started = Instant::now();
    let mut peak = PeakTracker::default();
    let mut first_loss = None;
    let mut last_loss = None;
    let mut last_val = None;
    let mut last_checkpoint = None;
    let stop_at = config
        .stop_after
        .map_or(config.steps, |n| (start_step + n).min(config.steps));
    let tokens_per_step = (config.grad_accum * config.batch_size * seq_len) as u64;
    for step in start_step..stop_at {
        let step_started = Instant::now();
        // Dropout draws from the backend's generator: seeding it per step makes a resumed run
        // draw what the uninterrupted one did.
        AB::<B>::seed(
            &device,
            config
                .seed
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(step as u64),
        );
        let mut grads = NamedTensors::<B>::new();
        let (mut loss_sum, mut predictions) = (0.0, 0usize);
        let mut after_forward = 0u64;
        let (mut keep_attention, mut keep_mlp) = (0.0, 0.0);
        let predictions_per_micro = config.batch_size * (seq_len - 1);
        let scale = 1.0 / (predictions_per_micro * config.grad_accum) as f64;
        for micro in 0..config.grad_accum {
            let first = (step * config.grad_accum + micro) * config.batch_size;
            let batch: Vec<Vec<u32>> = (first..first + config.batch_size)
                .map(|i| corpus.train_sequence(i))
                .collect();
            let tokens = int_tokens::<AB<B>>(&batch, &device);
            let mut token_sparsity = thresholds
                .as_ref()
                .map_or(TokenSparsity::Dense, TokenSparsity::select);
            let (loss, n, mem) = forward_backward(
                &model,
                tokens,
                config.loss_segment,
                scale,
                config.checkpointing,
                &mut token_sparsity,
                &mut grads,
            );
            if let Some(plan) = token_sparsity.into_plan() {
                keep_attention += sparse_keep(&plan, Block::Attention) / config.grad_accum as f64;
                keep_mlp += sparse_keep(&plan, Block::Mlp) / config.grad_accum as f64;
            }
            loss_sum += loss;
            predictions += n;
            after_forward = after_forward.max(mem);
            peak.peak = peak.peak.max(mem);
            peak.record();
        }
        let loss = loss_sum / predictions as f64;
        if !loss.is_finite() {
            bar.abandon();
            bail!(
                "loss became {loss} at step {}: lower --lr or check the data",
                step + 1
            );
        }
        let grad_norm = optim::global_norm(&grads);
        if config.max_grad_norm > 0.0 && grad_norm > config.max_grad_norm {
            // torch.nn.utils.clip_grad_norm_: multiply by max_norm / (norm + 1e-6).
            grads = optim::scale_grads(grads, config.max_grad_norm / (grad_norm + 1e-6));
        }
        let lr = optim::learning_rate(
            config.schedule,
            config.lr,
            config.min_lr_ratio,
            config.warmup_steps,
            config.steps,
            step,
        );
        let params = optim::trainable_values::<AB<B>, _>(&model);
        let updated = optimizer.step(params, &grads, lr);
        model = optim::set_trainable(model, updated)?;
        drop(grads);
        let now = peak.record();
        tokens_seen += tokens_per_step;
        let step_time = step_started.elapsed().as_secs_f64();
        first_loss.get_or_insert(loss);
        last_loss = Some(loss);
        let done = step + 1;
        metrics.write(&json!({
            "kind": "train",
            "step": done,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens_per_step,
            "tokens_per_s": tokens_per_step as f64 / step_time,
            "step_time_s": step_time,
            "mem_in_use_gib": gib(now.in_use),
            "mem_after_forward_gib": gib(after_forward),
            "mem_peak_gib": gib(peak.peak),
            "mem_source": memory::source(),
            "precision": precision.name(),
            "keep_attention": thresholds.as_ref().map(|_| keep_attention),
            "keep_mlp": thresholds.as_ref().map(|_| keep_mlp),
            "elapsed_s": elapsed_before + run_started.elapsed().as_secs_f64(),
        }))?;
        bar.set_position(done as u64);
        let kept = match &thresholds {
            Some(_) => format!(" | kept {keep_attention:.2}/{keep_mlp:.2}"),
            None => String::new(),
        };
        bar.set_message(format!(
            "loss {loss:.4} | lr {lr:.2e} | {:.0} tok/s | mem {:.2} GiB{kept}",
            tokens_per_step as f64 / step_time,
            gib(peak.peak)
        ));
        if !bar.is_hidden() {
        } else if done == 1 || done % (config.steps / 20).max(1) == 0 || done == config.steps {
            eprintln!(
                "step {done}/{} | loss {loss:.4} | lr {lr:.2e} | {:.0} tok/s | mem {:.2} GiB{kept}",
                config.steps,
                tokens_per_step as f64 / step_time,
                gib(peak.peak)
            );
        }
        let is_last = done == config.steps;
        if !val_sequences.is_empty()
            && ((config.val_every > 0 && done % config.val_every == 0) || is_last)
        {
            let mut eval_model = model.valid();
            eval_model.set_shifted_group(None);
            let val = validation_loss(&eval_model, &val_sequences, config.loss_segment);
            last_val = Some(val);
            metrics.write(
                &json!({"kind": "val", "step": done, "val_loss": val, "val_ppl": val.exp()}),
            )?;
            bar.println(format!(
                "step {done}: validation loss {val:.4} (perplexity {:.3})",
                val.exp()
            ));
        }
        if (config.checkpoint_every > 0 && done % config.checkpoint_every == 0) || is_last {
            let files = CheckpointFiles {
                state: TrainerState {
                    step: done,
                    seed: config.seed,
                    seq_len,
                    train_sequences: corpus.train_len(),
                    tokens_seen,
                    elapsed_s: elapsed_before + run_started.elapsed().as_secs_f64(),
                },
                trainable: optim::trainable_values::<AB<B>, _>(&model)
                    .into_iter()
                    .map(|(k, t)| (k, t.into_data().convert::<f32>().into_vec().expect("f32")))
                    .collect(),
                optimizer: optimizer.state_tensors(),
                optimizer_step: optimizer.step,
            };
            let saved = checkpoint::save(&out, &files, config.keep_checkpoints, |dir| {
                write_adapter(&model, dir)
            })?;
            last_checkpoint = Some(saved);
        }
    }
    bar.finish_and_clear();
    let finished = stop_at == config.steps;
    let adapter = if finished {
        let dir = out.join("adapter");
        write_adapter(&model, &dir)?;
        Some(dir)
    } else {
        None
    };
    let plots = report::plot(&out)?;
    let summary = TrainSummary {
        out: out.clone(),
        adapter,
        steps_done: stop_at,
        first_loss,
        last_loss,
        val_loss: last_val,
        plots,
        metrics: out.join(report::METRICS_FILE),
        last_checkpoint,
    };
    lemo_models::adapter::write_atomically(
        &out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?.as_bytes(),
    )?;
    Ok(summary)
}

/// BOS to put before documents and EOS after them: the tokenizer's, else the model config's.
pub(crate) fn special_ids(
    config: &ModelConfig,
    tokenizer: &mut LazyTokenizer,
) -> (Option<u32>, Option<u32>) {
    let from_tokenizer = tokenizer.get().ok().map(|t| (t.bos_id(), t.eos_id()));
    let (bos, eos) = from_tokenizer.unwrap_or((None, None));
    let model_bos = match config {
        ModelConfig::Llama(c) => c.bos_token_id,
        ModelConfig::Opt(c) => c.bos_token_id,
    };
    (
        bos.or(model_bos),
        eos.or(config.eos_token_ids().first().copied()),
    )
}

fn progress_bar(steps: usize, start: usize) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(steps as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30.cyan/blue} step {pos}/{len} | {msg} | ETA {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_position(start as u64);
    bar.reset_eta();
    bar
}
