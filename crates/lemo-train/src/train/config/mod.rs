//! Training configuration: defaults, then a preset, then a TOML file (`--config`), then
//! command-line flags, each overriding the one before. One struct, [`TrainConfig`], is the
//! flags (clap), the TOML keys (serde) and what the library trains with: every setting and its
//! default is spelled once, on its field. The resolved configuration is written to
//! `<out>/config.toml`, which `--resume` reads back. The layering lives in [`layers`], the
//! checks of the resolved configuration in [`validate`].

mod layers;
mod validate;

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use lemo_models::lora::LLAMA_PROJECTIONS;
use serde::{Deserialize, Serialize};

use crate::data::chat::LossOn;
use crate::device::{DeviceKind, Runtime};
use crate::lemo::LemoSettings;
use crate::method::{Method, S2Settings};
use crate::train::optim::Schedule;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// A small random-init Llama trained on generated text, on the CPU, in a few minutes.
    Tiny,
}

/// Everything a training run needs: the `train` flags, and the keys of a TOML `--config` file
/// (snake_case, e.g. `seq_len = 4096`).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainConfig {
    /// Hugging Face model folder (config.json + *.safetensors), llama2.c .bin checkpoint or
    /// .gguf file (unset with a preset: it builds its own).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// tokenizer.json, llama2.c tokenizer .bin or .gguf [default: the one beside the model].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Text files, JSONL (`text`, `input_ids`, or chat records: `messages` or `prompt` /
    /// `completion`, rendered with the model's chat template), raw token .bin files, or a folder
    /// of these.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Which tokens of chat records the loss is taken on: assistant (the answers, with their
    /// end-of-turn markup) or all [default: assistant]. Plain text and token ids are always
    /// trained on every token (--loss-on assistant without chat records is an error).
    #[arg(long, value_enum)]
    pub loss_on: Option<LossOn>,
    /// Bytes per token id in .bin token files: 2 or 4.
    #[arg(long, default_value_t = 2)]
    pub token_width: u8,
    /// Run folder: adapter/, checkpoints/, metrics.jsonl, plots/, config.toml.
    #[arg(long, default_value = "runs/lemo")]
    pub out: PathBuf,
    /// lora (dense baseline), longlora (S2 attention + trainable embeddings/norms), or lemo
    /// (token elimination: each layer processes only its informative token blocks, chosen by
    /// per-layer thresholds calibrated toward --target-keep).
    #[arg(long, value_enum, default_value_t = Method::Lora)]
    pub method: Method,
    /// Training sequence length in tokens [default: the target context, else the model's].
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Context to extend to: RoPE scaling (--rope-scaling) by the factor target / trained
    /// context (none when not larger).
    #[arg(long)]
    pub target_context: Option<usize>,
    /// How --target-context extends the RoPE frequencies: linear (position interpolation),
    /// dynamic (NTK-aware, by sequence length), yarn (NTK-by-parts with an attention
    /// temperature: keeps the high frequencies copying needs) or llama3 (Llama 3.1's).
    #[arg(long, default_value = "linear")]
    pub rope_scaling: String,
    /// Train with this RoPE base instead of the model's (adjusted base frequency, "ABF").
    #[arg(long)]
    pub rope_theta: Option<f64>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 1000)]
    pub steps: usize,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 2e-4)]
    pub lr: f64,
    /// Linear warm-up steps.
    #[arg(long, default_value_t = 20)]
    pub warmup_steps: usize,
    /// After warm-up: constant or cosine.
    #[arg(long, value_enum, default_value_t = Schedule::Constant)]
    pub schedule: Schedule,
    /// Cosine floor as a fraction of --lr.
    #[arg(long, default_value_t = 0.0)]
    pub min_lr_ratio: f64,
    /// AdamW beta1.
    #[arg(long, default_value_t = 0.9)]
    pub beta1: f64,
    /// AdamW beta2.
    #[arg(long, default_value_t = 0.999)]
    pub beta2: f64,
    /// AdamW epsilon.
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f64,
    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Global gradient-norm clipping; 0 is off.
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// LoRA rank.
    #[arg(long, default_value_t = 8)]
    pub lora_rank: usize,
    /// LoRA alpha (scaling alpha / rank).
    #[arg(long, default_value_t = 16.0)]
    pub lora_alpha: f64,
    /// LoRA dropout probability, in [0, 1).
    #[arg(long, default_value_t = 0.0)]
    pub lora_dropout: f64,
    /// Comma-separated projections to adapt.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "q_proj,k_proj,v_proj,o_proj"
    )]
    pub lora_targets: Vec<String>,
    #[command(flatten)]
    #[serde(flatten)]
    pub s2: S2Settings,
    /// Activation checkpointing: keep only each layer's input and recompute every layer in the
    /// backward pass, whatever the memory budget (without it, the planner recomputes only the
    /// layers whose activations do not fit --memory-budget).
    #[arg(long)]
    pub checkpointing: bool,
    #[command(flatten)]
    #[serde(flatten)]
    pub lemo: LemoSettings,
    /// Positions per segment of the segment-based loss.
    #[arg(long, default_value_t = 1024)]
    pub loss_segment: usize,
    /// Seed of LoRA initialization, data order and dropout.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Fraction of the packed sequences held out for validation, in [0, 1).
    #[arg(long, default_value_t = 0.02)]
    pub val_fraction: f64,
    /// Validate every N steps and at the end; 0 only at the end.
    #[arg(long, default_value_t = 100)]
    pub val_every: usize,
    /// Validation sequences per validation; 0 all.
    #[arg(long, default_value_t = 8)]
    pub val_sequences: usize,
    /// Write a checkpoint every N steps (and always at the end).
    #[arg(long, default_value_t = 100)]
    pub checkpoint_every: usize,
    /// Also write a checkpoint when this much wall time passed since the last one: 10m, 90s,
    /// 1h, or 0 for off.
    #[arg(long, default_value = "10m")]
    pub save_every: String,
    /// Checkpoints kept; older ones of this run are deleted.
    #[arg(long, default_value_t = 2)]
    pub keep_checkpoints: usize,
    /// Append EOS to each document when packing [default: yes, except llama2.c models].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub append_eos: Option<bool>,
    /// Cache folder of tokenized data, and of calibrated thresholds (in its `thresholds`
    /// folder), or "none" [default: ~/.cache/lemo/tokens].
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    #[command(flatten)]
    #[serde(flatten)]
    pub runtime: Runtime,
    /// Data-parallel training on N GPUs of this machine (CUDA devices 0..N, one thread each,
    /// gradients summed by NCCL). Each GPU holds a whole replica and runs --batch-size x
    /// --grad-accum sequences per step, so memory per GPU is that of one GPU and the global
    /// batch is N x batch x grad-accum: N times the tokens per step at about the step time of
    /// one GPU. On cpu and wgpu, N simulated ranks share the device (for testing). Under a
    /// launcher (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment: one
    /// process per GPU, on one machine or several) leave it out.
    #[arg(long, visible_alias = "ranks", default_value_t = 1)]
    pub gpus: usize,
    /// Context parallelism: each sequence is split over groups of N of the --gpus ranks (N
    /// divides --gpus; --gpus 4 --context-parallel 2 is two data-parallel groups of two). A rank
    /// holds 2/(2N) of each sequence's tokens (zig-zag, so the causal work is balanced) through
    /// every layer and gathers the keys and values of the others for attention: activations per
    /// rank shrink N-fold, so sequences N times longer fit. --method lora, or lemo with
    /// --batch-size 1; the sequence length must be a multiple of 2N (lemo: of 2N x --block-size).
    #[arg(long, default_value_t = 1)]
    pub context_parallel: usize,
    /// How long a rank waits for the others (a rank that died or hangs) before the run ends
    /// with an error: 10m, 90s, 1h, or off.
    #[arg(long, default_value = "10m")]
    pub collective_timeout: String,
    /// The preset this configuration started from (`train --preset`).
    #[arg(skip)]
    pub preset: Option<Preset>,
    /// Stop after N steps in this process, as an interruption would (resume continues).
    #[arg(long)]
    pub stop_after: Option<usize>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        crate::defaults()
    }
}

impl TrainConfig {
    /// The cache folder `--cache-dir` names: `None` for "none" or without a home folder.
    pub fn cache_dir(&self) -> Option<PathBuf> {
        match &self.cache_dir {
            Some(dir) if dir.as_os_str() == "none" => None,
            Some(dir) => Some(dir.clone()),
            None => crate::data::corpus::default_cache_dir(),
        }
    }

    /// The preset's settings over the defaults.
    pub fn preset(preset: Preset) -> Self {
        match preset {
            Preset::Tiny => Self {
                out: PathBuf::from("runs/tiny"),
                seq_len: Some(256),
                target_context: Some(256),
                steps: 200,
                batch_size: 2,
                grad_accum: 2,
                lr: 3e-3,
                warmup_steps: 10,
                schedule: Schedule::Cosine,
                min_lr_ratio: 0.1,
                lora_rank: 16,
                lora_alpha: 32.0,
                lora_targets: LLAMA_PROJECTIONS.map(String::from).to_vec(),
                loss_segment: 128,
                val_fraction: 0.05,
                val_every: 50,
                val_sequences: 8,
                checkpoint_every: 50,
                runtime: Runtime {
                    device: DeviceKind::Cpu,
                    ..Runtime::default()
                },
                preset: Some(Preset::Tiny),
                ..Self::default()
            },
        }
    }

    pub fn train_embeddings(&self) -> bool {
        self.s2.train_embeddings(self.method)
    }

    pub fn train_norms(&self) -> bool {
        self.s2.train_norms(self.method)
    }

    /// Which tokens of chat records are trained on: the assistant's unless told otherwise.
    pub fn loss_on(&self) -> LossOn {
        self.loss_on.unwrap_or(LossOn::Assistant)
    }

    /// `collective_timeout` as a duration; `None` when off.
    pub fn collective_timeout(&self) -> Result<Option<std::time::Duration>> {
        parse_duration(&self.collective_timeout)
            .with_context(|| format!("--collective-timeout {:?}", self.collective_timeout))
    }

    /// `save_every` as a duration; `None` when wall-time checkpoints are off.
    pub fn save_interval(&self) -> Result<Option<std::time::Duration>> {
        parse_duration(&self.save_every)
            .with_context(|| format!("--save-every {:?}", self.save_every))
    }
}

/// `"90s"`, `"10m"`, `"2h"` or plain seconds; `"0"` or `"off"` is `None`.
pub fn parse_duration(text: &str) -> Result<Option<std::time::Duration>> {
    let text = text.trim();
    if text == "0" || text == "off" {
        return Ok(None);
    }
    let (number, unit) = match text.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((at, _)) => text.split_at(at),
        None => (text, "s"),
    };
    let seconds_per_unit = match unit {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => bail!("unknown unit {unit:?}: use s, m or h, e.g. 10m"),
    };
    let value: f64 = number
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite() && *v > 0.0)
        .context("expected a positive duration such as 10m, 90s or 1h (0 turns it off)")?;
    Ok(Some(std::time::Duration::from_secs_f64(
        value * seconds_per_unit,
    )))
}
