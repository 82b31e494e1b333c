//! What a run settles once, on the host, before any rank loads its replica: the configuration,
//! the memory plan, the packed data, the LoRA and RoPE settings, the run folder's identity and
//! the checkpoint it resumes from (checked against this run's data, settings and rank count).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn_dataset::Dataset;
use lemo_models::activation_plan::ActivationPlan;
use lemo_models::config::RopeConfig;
use lemo_models::model::ModelFormat;
use lemo_models::{LoraConfig, ModelConfig};

use super::checkpoint::{self, CheckpointFiles};
use super::config::TrainConfig;
use super::run_dir;
use super::{TrainJob, plan_input};
use crate::data::chat::LossOn;
use crate::data::corpus::{Corpus, PackOptions, read_model_documents};
use crate::data::{Document, LazyTokenizer, Sequence, find_tokenizer, special_ids};
use crate::device::PrecisionKind;
use crate::memory_plan;
use crate::method::Method;
use crate::modelio::{Extension, TrainingInfo, extended_rope};

/// The run as every rank sees it.
pub struct Setup {
    pub config: TrainConfig,
    pub precision: PrecisionKind,
    pub model_path: PathBuf,
    pub model_config: ModelConfig,
    pub seq_len: usize,
    /// The RoPE frequencies training runs at where they differ from the model's.
    pub rope: Option<RopeConfig>,
    pub lora: LoraConfig,
    pub corpus: Corpus,
    pub val_sequences: Vec<Sequence>,
    pub run_id: Option<String>,
    /// The checkpoint the run continues from.
    pub resumed: Option<CheckpointFiles>,
    /// Recorded beside every adapter the run writes.
    pub info: TrainingInfo,
    /// Which layers keep, recompute or offload their activations.
    pub activations: ActivationPlan,
    /// What each device's memory pools may reserve (see [`memory_plan::Planned::pool_budget`]).
    pub pool_budget: Option<u64>,
}

impl Setup {
    pub fn ranks(&self) -> usize {
        self.config.gpus
    }

    /// Ranks that read sequences of their own: one per sequence group.
    pub fn data_ranks(&self) -> usize {
        self.config.gpus / self.config.context_parallel
    }

    /// Steps already done (by the checkpoint resumed from).
    pub fn start_step(&self) -> usize {
        self.resumed.as_ref().map_or(0, |r| r.state.step)
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

/// The RoPE of the run's target context (`None`: the model's own), printed when extended.
fn rope_extension(config: &TrainConfig, model_config: &ModelConfig) -> Result<Option<RopeConfig>> {
    let trained_context = model_config.max_position_embeddings();
    let target = config.target_context.unwrap_or(trained_context);
    let extension = Extension {
        kind: config.rope_scaling.clone(),
        theta: config.rope_theta,
    };
    let rope = extended_rope(model_config, target, &extension)?;
    if let Some(rope) = &rope {
        eprintln!(
            "rope: {} scaling {trained_context} -> {target} tokens (factor {}), theta {}",
            rope.scaling.name(),
            rope.scaling.factor(),
            rope.theta
        );
    }
    Ok(rope)
}

pub fn prepare(job: TrainJob) -> Result<Setup> {
    // Under a launcher only rank 0 writes the run folder; the others read a resumed one.
    let owner = job.owns_out();
    let mut config = job.config;
    prepare_inputs(&mut config)?;
    config.validate()?;
    let out = config.out.clone();
    if owner {
        std::fs::create_dir_all(&out)
            .with_context(|| format!("cannot create {}", out.display()))?;
    }
    let model_path = config.model.clone().expect("validated");
    // A resume with another rank count is refused before anything is read or planned.
    let resumed = match &job.resume {
        Some(dir) => Some((dir, load_resumed(dir, &config)?)),
        None => None,
    };

    let precision = job.precision;
    let model_config = crate::modelio::read_config(&model_path)?;
    let trained_context = model_config.max_position_embeddings();
    let seq_len = config
        .seq_len
        .or(config.target_context)
        .unwrap_or(trained_context);
    crate::modelio::check_seq_len(&model_config, seq_len, config.target_context)?;
    crate::modelio::check_lora_rank(&model_config, config.lora_rank)?;
    check_context_parallel(&config, seq_len)?;
    let s2_group = config.s2.group(config.method, seq_len)?;
    // The data first: its errors are the likeliest, and come before any plan is printed.
    let corpus = read_corpus(&config, &model_path, &model_config, seq_len)?;
    if corpus.train.get(0).is_some_and(|s| s.scored.is_some()) {
        // Recorded as trained (a resume keeps it), not left to the default.
        config.loss_on = Some(config.loss_on());
    }
    let projection_bits = lemo_models::quantized::projection_bits(
        &model_path,
        &model_config,
        config.runtime.quantize_base(),
    )?;
    let planned = memory_plan::plan(
        &plan_input(
            &config,
            model_config.clone(),
            seq_len,
            job.device,
            precision,
            projection_bits,
        ),
        job.budget.filter(|_| !job.skip_memory_plan),
    )?;
    if let Some(limit) = model_config.max_sequence_length().filter(|&l| seq_len > l) {
        bail!("--seq-len {seq_len} is longer than this model supports ({limit} positions)");
    }
    let rope = rope_extension(&config, &model_config)?;
    let rope_scaling = rope.as_ref().map(RopeConfig::parameters_json).transpose()?;
    let lora = LoraConfig {
        rank: config.lora_rank,
        alpha: config.lora_alpha,
        dropout: config.lora_dropout,
        target_modules: config.lora_targets.clone(),
        train_embeddings: config.train_embeddings(),
        train_norms: config.train_norms(),
    };
    announce_s2(&config, s2_group);
    let val_sequences = corpus.val_sequences(config.val_sequences);

    let run_id = match owner || job.start == run_dir::Start::Resume {
        true => run_dir::identity(&out, job.start)?.map(|r| r.id),
        false => None,
    };
    let resumed = match resumed {
        Some((dir, files)) => {
            check_resumed(dir, &files.state, &config, seq_len, &corpus, &run_id)?;
            Some(files)
        }
        None => None,
    };
    if owner {
        let mut saved_config = config.clone();
        saved_config.stop_after = None;
        lemo_models::adapter::write_atomically(
            &out.join("config.toml"),
            saved_config.to_toml().as_bytes(),
        )?;
    }
    let info = TrainingInfo {
        method: config.method.name().to_string(),
        base_model: model_path.display().to_string(),
        trained_context,
        target_context: config.target_context,
        rope_scaling,
        seq_len,
        steps: config.steps,
        activation_plan: Some(planned.activations.clone()),
        plan: Some(planned.line()),
    };
    Ok(Setup {
        config,
        precision,
        model_path,
        model_config,
        seq_len,
        rope,
        lora,
        corpus,
        val_sequences,
        run_id,
        resumed,
        info,
        pool_budget: planned.pool_budget(),
        activations: planned.activations,
    })
}

/// The S2 attention line of the run's start, when it trains with S2 groups of `group`.
fn announce_s2(config: &TrainConfig, group: Option<usize>) {
    let Some(group) = group else {
        return;
    };
    let over = match config.method {
        Method::Lemo => ", in groups over each layer's kept rows",
        _ => "",
    };
    eprintln!(
        "{}: S2 attention with groups of {group} tokens while training{over}, dense at evaluation",
        config.method.name()
    );
}

/// The training data, read (tokenized once, then cached) and packed into sequences.
fn read_corpus(
    config: &TrainConfig,
    model_path: &std::path::Path,
    model_config: &ModelConfig,
    seq_len: usize,
) -> Result<Corpus> {
    let data_path = config.data.as_ref().expect("validated");
    let tokenizer_path = config
        .tokenizer
        .clone()
        .or_else(|| find_tokenizer(model_path));
    let mut tokenizer = LazyTokenizer::new(tokenizer_path.clone());
    let cache_dir = config.cache_dir();
    let started_reading = Instant::now();
    let documents = read_model_documents(
        data_path,
        config.token_width,
        &mut tokenizer,
        model_path,
        cache_dir.as_deref(),
        model_config.vocab_size(),
    )?;
    let chats = check_loss_on(config, &documents, data_path, seq_len)?;
    let is_llama2c = matches!(ModelFormat::detect(model_path)?, ModelFormat::Llama2c);
    let (bos, eos) = special_ids(model_config, &mut tokenizer);
    let append_eos = config.append_eos.unwrap_or(!is_llama2c);
    let pack = PackOptions {
        seq_len,
        bos,
        eos: eos.filter(|_| append_eos),
        val_fraction: config.val_fraction,
        seed: config.seed,
        loss_on: config.loss_on(),
    };
    let corpus = Corpus::new(&documents, &pack)?;
    let mut chat_note = String::new();
    if chats > 0 {
        chat_note = format!(
            "; {chats} chat records, loss on {} tokens",
            config.loss_on().name()
        );
        if corpus.unscored > 0 {
            chat_note += &format!(", {} sequences without one left out", corpus.unscored);
        }
        if corpus.padding > 0 {
            chat_note += &format!(
                ", {} padding tokens ({:.1}%) so that no record is split",
                corpus.padding,
                100.0 * corpus.padding as f64 / corpus.tokens.max(1) as f64
            );
        }
    }
    eprintln!(
        "data: {} documents, {} sequences of {seq_len} tokens ({} tokens; {} training, {} validation){chat_note} in {:.1}s",
        corpus.documents,
        corpus.train_len() + corpus.val.len(),
        corpus.tokens,
        corpus.train_len(),
        corpus.val.len(),
        started_reading.elapsed().as_secs_f64()
    );
    Ok(corpus)
}

/// The number of chat records in `documents`, after checking `--loss-on` against them:
/// `assistant` given for data without chat records is refused (plain text has no assistant),
/// and chat records longer than a sequence are warned about (their answers get split from the
/// start of their context).
fn check_loss_on(
    config: &TrainConfig,
    documents: &[Document],
    data_path: &std::path::Path,
    seq_len: usize,
) -> Result<usize> {
    let chats: Vec<&Document> = documents.iter().filter(|d| d.assistant.is_some()).collect();
    if chats.is_empty() && config.loss_on == Some(LossOn::Assistant) {
        bail!(
            "--loss-on assistant: {} has no chat records (\"messages\", or \"prompt\" and \"completion\"), and plain text is trained on every token: leave --loss-on out",
            data_path.display()
        );
    }
    let split = chats.iter().filter(|d| d.tokens.len() > seq_len).count();
    if split > 0 {
        eprintln!(
            "warning: {split} of {} chat records are longer than --seq-len {seq_len}: they are split across sequences, and a later part is trained without the start of its conversation",
            chats.len()
        );
    }
    Ok(chats.len())
}

/// Ranks that form whole sequence groups, and sequences that split evenly over a group.
fn check_context_parallel(config: &TrainConfig, seq_len: usize) -> Result<()> {
    let group = config.context_parallel;
    if !config.gpus.is_multiple_of(group) {
        bail!(
            "--context-parallel {group} does not divide the {} rank(s) (--gpus): the ranks form sequence groups of {group}",
            config.gpus
        );
    }
    // lemo's token blocks must not straddle two ranks' chunks.
    let unit = match config.method {
        Method::Lemo if group > 1 => 2 * group * config.lemo.block_size,
        _ => 2 * group,
    };
    if !seq_len.is_multiple_of(unit) {
        bail!(
            "--seq-len {seq_len}: --context-parallel {group} splits each sequence into {} equal chunks{}, so the length must be a multiple of {unit}",
            2 * group,
            match unit == 2 * group {
                true => String::new(),
                false => format!(" of whole {}-token blocks", config.lemo.block_size),
            }
        );
    }
    Ok(())
}

/// The checkpoint in `dir`, written with as many ranks as this run has.
fn load_resumed(dir: &std::path::Path, config: &TrainConfig) -> Result<CheckpointFiles> {
    let files = checkpoint::load(dir)?;
    let ranks = files.state.ranks;
    if ranks != config.gpus {
        bail!(
            "--resume {}: the checkpoint was trained on {ranks} rank(s) and this run has {} (--gpus): the global batch (ranks x batch x grad-accum) and so the steps differ; resume with --gpus {ranks}",
            dir.display(),
            config.gpus,
        );
    }
    let group = files.state.context_parallel;
    if group != config.context_parallel {
        bail!(
            "--resume {}: the checkpoint was trained with sequence groups of {group} rank(s) and this run has {} (--context-parallel): the data-parallel groups and so the steps differ; resume with --context-parallel {group}",
            dir.display(),
            config.context_parallel,
        );
    }
    Ok(files)
}

/// Checks the resumed checkpoint's state against this run: the same run, data and settings.
fn check_resumed(
    dir: &std::path::Path,
    state: &checkpoint::TrainerState,
    config: &TrainConfig,
    seq_len: usize,
    corpus: &Corpus,
    run_id: &Option<String>,
) -> Result<()> {
    if let (Some(written_by), Some(id)) = (&state.run_id, run_id)
        && written_by != id
    {
        bail!(
            "--resume {}: the checkpoint was written by another run than the one in {}",
            dir.display(),
            config.out.display()
        );
    }
    if state.seq_len != seq_len
        || state.train_sequences != corpus.train_len()
        || state.seed != config.seed
    {
        bail!(
            "--resume {}: the checkpoint was trained with seq_len {}, {} training sequences, seed {}; this run has {seq_len}, {}, {}: same data and settings are needed to continue",
            dir.display(),
            state.seq_len,
            state.train_sequences,
            state.seed,
            corpus.train_len(),
            config.seed
        );
    }
    eprintln!(
        "resume: continuing from step {} ({})",
        state.step,
        dir.display()
    );
    Ok(())
}
