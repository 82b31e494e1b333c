//! `train`: LoRA fine-tuning (dense `lora`, `longlora`) with AdamW, warm-up and schedule,
//! gradient accumulation, global-norm clipping, position interpolation, the segment-based loss,
//! atomic checkpoints with exact resume, `metrics.jsonl`, plots and a progress bar.

pub mod checkpoint;
pub mod config;
pub mod interrupt;
pub mod optim;
mod progress;
pub mod report;
pub mod run_dir;
mod step;

pub use step::{forward_backward, int_tokens, validation_loss};

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use lemo_kernels::LemoBackend;
use lemo_models::model::ModelFormat;
use lemo_models::{CausalLm, LoraConfig, ModelConfig};
use serde_json::json;

use crate::corpus::{Corpus, PackOptions, default_cache_dir, read_documents_cached};
use crate::data::{LazyTokenizer, TokenWidth, find_tokenizer};
use crate::device::{BackendJob, DeviceKind, PrecisionKind};
use crate::memory::{self, PeakTracker, gib};
use crate::memory_plan;
use crate::modelio::{TRAINING_INFO_FILE, TrainingInfo, interpolated_rope};
use crate::sparsity::{self, THRESHOLDS_FILE, sparse_keep};
use burn_dataset::Dataset;
use checkpoint::{CheckpointFiles, TrainerState};
use config::{Method, TrainConfig};
use lemo_sparsity::calibration::Block;
use optim::{AdamW, AdamWSettings, NamedTensors};
use progress::{Progress, StepReport};

/// What a finished (or stopped) run reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TrainSummary {
    pub out: PathBuf,
    pub adapter: Option<PathBuf>,
    pub steps_done: usize,
    /// A signal stopped the run (after a checkpoint).
    pub interrupted: bool,
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
    /// A new run, a replacement of the run in `config.out`, or its continuation.
    pub start: run_dir::Start,
    /// `config.precision` resolved for the device.
    pub precision: PrecisionKind,
    /// The device the run uses (whose free memory the memory plan reads).
    pub device: DeviceKind,
    /// Train even where the memory plan predicts the run will not fit.
    pub skip_memory_plan: bool,
}

/// What the memory plan needs of a run.
fn plan_input(
    config: &TrainConfig,
    model: ModelConfig,
    seq_len: usize,
    precision: PrecisionKind,
) -> memory_plan::PlanInput {
    memory_plan::PlanInput {
        model,
        seq_len,
        batch_size: config.batch_size,
        method: config.method,
        checkpointing: config.checkpointing,
        precision,
        lora_rank: config.lora_rank,
        lora_targets: config.lora_targets.clone(),
        train_extras: config.train_embeddings() || config.train_norms(),
        loss_segment: config.loss_segment,
        target_keep: config.target_keep,
        dense_layers: config.dense_layers.len(),
    }
}

impl BackendJob for TrainJob {
    type Output = TrainSummary;

    fn run<B: LemoBackend>(self, device: B::Device) -> Result<TrainSummary> {
        run_on::<B>(self, device)
    }
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
    let planned_config = crate::modelio::read_config(&model_path)?;
    let planned_seq_len = config
        .seq_len
        .or(config.target_context)
        .unwrap_or(planned_config.max_position_embeddings());
    crate::modelio::check_seq_len(&planned_config, planned_seq_len, config.target_context)?;
    if !job.skip_memory_plan {
        let plan = plan_input(&config, planned_config, planned_seq_len, precision);
        memory_plan::check(&plan, memory_plan::free_memory(job.device))?;
    }
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

    // Token elimination: the run's thresholds, from --thresholds, from its predictors, from the
    // run folder when resuming, or calibrated on the first training sequences with the fresh
    // adapter; scores from the predictors unless --scores exact.
    let elimination = if config.method == Method::Lemo {
        model.check_token_elimination(seq_len)?;
        let settings = config.sparsity();
        let saved = out.join(THRESHOLDS_FILE);
        let elimination = sparsity::elimination(&settings, &model_config, || {
            if job.resume.is_some() && saved.exists() {
                return sparsity::read_thresholds(&saved, &model_config);
            }
            let count = settings.calibration_sequences.min(corpus.train_len());
            let sequences: Vec<Vec<u32>> = (0..count).map(|i| corpus.train_sequence(i)).collect();
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
            )
        })?;
        sparsity::write_thresholds(&saved, &elimination.thresholds)?;
        Some(elimination)
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
    let run = run_dir::identity(&out, job.start)?;
    let run_id = run.map(|r| r.id);
    if let Some(dir) = &job.resume {
        let files = checkpoint::load(dir)?;
        if let (Some(written_by), Some(id)) = (&files.state.run_id, &run_id)
            && written_by != id
        {
            bail!(
                "--resume {}: the checkpoint was written by another run than the one in {}",
                dir.display(),
                out.display()
            );
        }
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
        if let Some(elimination) = &elimination {
            sparsity::write_thresholds(&dir.join(THRESHOLDS_FILE), &elimination.thresholds)?;
        }
        lemo_models::adapter::write_atomically(
            &dir.join(TRAINING_INFO_FILE),
            serde_json::to_string_pretty(&info)?.as_bytes(),
        )?;
        Ok(())
    };

    let mut metrics = report::MetricsWriter::open(&out, start_step)?;
    let mut progress = Progress::new(config.steps, start_step);
    let run_started = Instant::now();
    let mut peak = PeakTracker::default();
    let mut first_loss = None;
    let mut last_loss = None;
    let mut last_val = None;
    let mut last_checkpoint = None;
    let mut last_save = Instant::now();
    let save_interval = config.save_interval()?;
    let stop_at = config
        .stop_after
        .map_or(config.steps, |n| (start_step + n).min(config.steps));
    let mut steps_done = start_step;
    let tokens_per_step = (config.grad_accum * config.batch_size * seq_len) as u64;
    interrupt::install();
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
            let mut token_sparsity = sparsity::token_sparsity(elimination.as_ref());
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
            progress.abandon();
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
        steps_done = done;
        let kept = elimination.as_ref().map(|_| (keep_attention, keep_mlp));
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
            "keep_attention": kept.map(|k| k.0),
            "keep_mlp": kept.map(|k| k.1),
            "elapsed_s": elapsed_before + run_started.elapsed().as_secs_f64(),
        }))?;
        progress.step(
            done,
            &StepReport {
                loss,
                lr,
                tokens_per_s: tokens_per_step as f64 / step_time,
                mem_gib: gib(peak.peak),
                kept,
            },
        );
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
            progress.validation(done, val);
        }
        let interrupted = interrupt::requested();
        let due = (config.checkpoint_every > 0 && done % config.checkpoint_every == 0)
            || save_interval.is_some_and(|every| last_save.elapsed() >= every);
        if due || is_last || interrupted {
            let state = TrainerState {
                step: done,
                seed: config.seed,
                seq_len,
                train_sequences: corpus.train_len(),
                tokens_seen,
                elapsed_s: elapsed_before + run_started.elapsed().as_secs_f64(),
                run_id: run_id.clone(),
            };
            let files = checkpoint_files(state, &model, &optimizer);
            let saved = checkpoint::save(&out, &files, config.keep_checkpoints, |dir| {
                write_adapter(&model, dir)
            })?;
            last_checkpoint = Some(saved);
            last_save = Instant::now();
        }
        if interrupted {
            break;
        }
    }
    progress.finish();
    let finished = steps_done == config.steps;
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
        steps_done,
        interrupted: interrupt::requested(),
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

/// What a checkpoint holds of the model and optimizer after `state.step` steps.
fn checkpoint_files<B: LemoBackend>(
    state: TrainerState,
    model: &CausalLm<Autodiff<B>>,
    optimizer: &AdamW<B>,
) -> CheckpointFiles {
    CheckpointFiles {
        state,
        trainable: optim::trainable_values::<Autodiff<B>, _>(model)
            .into_iter()
            .map(|(k, t)| (k, t.into_data().convert::<f32>().into_vec().expect("f32")))
            .collect(),
        optimizer: optimizer.state_tensors(),
        optimizer_step: optimizer.step,
    }
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
