//! Training configuration: defaults, then a preset, then a TOML file (`--config`), then
//! command-line flags, each overriding the one before. The resolved configuration is written to
//! `<out>/config.toml`, which `--resume` reads back.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use lemo_models::lora::LLAMA_PROJECTIONS;
use serde::{Deserialize, Serialize};

use crate::device::{DeviceKind, PrecisionKind};
use crate::sparsity::{MlpDroppedRows, ScoreSource, SparsityArgs, SparsitySettings};
use crate::train::optim::Schedule;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Dense LoRA: the plain baseline.
    Lora,
    /// LongLoRA: shifted sparse attention (S2) while training, dense attention at evaluation,
    /// embeddings and normalization weights train with the adapters.
    Longlora,
    /// LeMo's token elimination: each layer's attention and MLP blocks process only their
    /// informative token blocks; the others ride the residual stream unchanged.
    Lemo,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Method::Lora => "lora",
            Method::Longlora => "longlora",
            Method::Lemo => "lemo",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// A small random-init Llama trained on generated text, on the CPU, in a few minutes.
    Tiny,
}

/// Everything a training run needs; field docs are the TOML keys' meanings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Hugging Face model folder or llama2.c `.bin` (unset with a preset: it builds its own).
    pub model: Option<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub data: Option<PathBuf>,
    pub token_width: u8,
    pub out: PathBuf,
    pub method: Method,
    pub seq_len: Option<usize>,
    pub target_context: Option<usize>,
    pub steps: usize,
    pub batch_size: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub warmup_steps: usize,
    pub schedule: Schedule,
    pub min_lr_ratio: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Global-norm clipping threshold; 0 turns clipping off.
    pub max_grad_norm: f64,
    pub lora_rank: usize,
    pub lora_alpha: f64,
    pub lora_dropout: f64,
    pub lora_targets: Vec<String>,
    /// Unset: true for longlora, false otherwise.
    pub train_embeddings: Option<bool>,
    pub train_norms: Option<bool>,
    /// S2 group size for longlora; unset: a quarter of the sequence (LongLoRA's ratio).
    pub s2_group_size: Option<usize>,
    pub checkpointing: bool,
    /// lemo: thresholds file; unset: calibrate on the first training sequences.
    pub thresholds: Option<PathBuf>,
    /// lemo: what the kept fractions of the attention and the MLP blocks follow where not given.
    pub target_keep: f64,
    /// lemo: kept fractions of the attention and the MLP blocks; unset: from `target_keep`
    /// (`SparsitySettings::block_keep`).
    pub attention_keep: Option<f64>,
    pub mlp_keep: Option<f64>,
    /// lemo: tokens per block of the elimination.
    pub block_size: usize,
    /// lemo: least fraction of each sequence's blocks a block keeps.
    pub min_keep: f64,
    /// lemo: layers that keep every token.
    pub dense_layers: Vec<usize>,
    /// lemo: sequences calibration profiles and evaluates on.
    pub calibration_sequences: usize,
    /// lemo: finite-difference rounds of calibration.
    pub calibration_rounds: usize,
    /// lemo: trained predictors; unset: exact scores.
    pub predictors: Option<PathBuf>,
    /// lemo: exact or predicted scores; unset: predicted with `predictors`.
    pub scores: Option<ScoreSource>,
    /// lemo: the MLP blocks' backward pass on their dropped rows ("exact" or "residual").
    pub mlp_dropped_rows: MlpDroppedRows,
    /// lemo: keep exactly the kept fraction of every sequence's blocks (no thresholds).
    pub keep_exactly: bool,
    /// Rows of the vocabulary projection per segment of the segment-based loss.
    pub loss_segment: usize,
    pub seed: u64,
    pub val_fraction: f64,
    pub val_every: usize,
    /// Validation sequences scored per validation (0: all).
    pub val_sequences: usize,
    pub checkpoint_every: usize,
    /// Wall time between checkpoints besides `checkpoint_every` ("10m", "90s", "1h"; "0": off).
    pub save_every: String,
    pub keep_checkpoints: usize,
    /// Append EOS after each document when packing (unset: yes, except llama2.c models).
    pub append_eos: Option<bool>,
    /// Tokenized-data cache; "none" turns caching off.
    pub cache_dir: Option<PathBuf>,
    pub device: DeviceKind,
    /// Data-parallel ranks: one per CUDA device, or simulated ranks sharing the CPU/wgpu device.
    pub gpus: usize,
    /// How long a rank waits for the others in a collective ("10m"; "off": no limit).
    pub collective_timeout: String,
    /// Unset: bf16 on cuda, f32 elsewhere.
    pub precision: Option<PrecisionKind>,
    pub preset: Option<Preset>,
    /// Stop after this many steps in this process (a deliberate interruption, for testing resume).
    pub stop_after: Option<usize>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        let lemo = SparsitySettings::default();
        Self {
            model: None,
            tokenizer: None,
            data: None,
            token_width: 2,
            out: PathBuf::from("runs/lemo"),
            method: Method::Lora,
            seq_len: None,
            target_context: None,
            steps: 1000,
            batch_size: 1,
            grad_accum: 1,
            lr: 2e-4,
            warmup_steps: 20,
            schedule: Schedule::Constant,
            min_lr_ratio: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            lora_rank: 8,
            lora_alpha: 16.0,
            lora_dropout: 0.0,
            lora_targets: ["q_proj", "k_proj", "v_proj", "o_proj"]
                .map(String::from)
                .to_vec(),
            train_embeddings: None,
            train_norms: None,
            s2_group_size: None,
            checkpointing: false,
            thresholds: lemo.thresholds,
            target_keep: lemo.target_keep,
            attention_keep: lemo.attention_keep,
            mlp_keep: lemo.mlp_keep,
            block_size: lemo.block_size,
            min_keep: lemo.min_keep,
            dense_layers: lemo.dense_layers,
            calibration_sequences: lemo.calibration_sequences,
            calibration_rounds: lemo.calibration_rounds,
            predictors: lemo.predictors,
            scores: lemo.scores,
            mlp_dropped_rows: lemo.mlp_dropped_rows,
            keep_exactly: lemo.keep_exactly,
            loss_segment: 1024,
            seed: 42,
            val_fraction: 0.02,
            val_every: 100,
            val_sequences: 8,
            checkpoint_every: 100,
            save_every: "10m".to_string(),
            keep_checkpoints: 2,
            append_eos: None,
            cache_dir: None,
            device: DeviceKind::Auto,
            gpus: 1,
            collective_timeout: "10m".to_string(),
            precision: None,
            preset: None,
            stop_after: None,
        }
    }
}

impl TrainConfig {
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
                device: DeviceKind::Cpu,
                preset: Some(Preset::Tiny),
                ..Self::default()
            },
        }
    }

    pub fn from_toml_file(path: &Path) -> Result<toml::Table> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("{}: invalid TOML", path.display()))
    }

    /// `self` with the keys of `table` replaced.
    pub fn merged(self, table: &toml::Table) -> Result<Self> {
        let mut base = toml::Table::try_from(&self).context("serializing the configuration")?;
        for (key, value) in table {
            base.insert(key.clone(), value.clone());
        }
        base.try_into().context("invalid training configuration")
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("the configuration serializes")
    }

    pub fn train_embeddings(&self) -> bool {
        self.train_embeddings
            .unwrap_or(self.method == Method::Longlora)
    }

    pub fn train_norms(&self) -> bool {
        self.train_norms.unwrap_or(self.method == Method::Longlora)
    }

    /// The token-elimination settings (`--method lemo`).
    pub fn sparsity(&self) -> SparsitySettings {
        SparsitySettings {
            thresholds: self.thresholds.clone(),
            target_keep: self.target_keep,
            attention_keep: self.attention_keep,
            mlp_keep: self.mlp_keep,
            block_size: self.block_size,
            min_keep: self.min_keep,
            dense_layers: self.dense_layers.clone(),
            calibration_sequences: self.calibration_sequences,
            calibration_rounds: self.calibration_rounds,
            predictors: self.predictors.clone(),
            scores: self.scores,
            mlp_dropped_rows: self.mlp_dropped_rows,
            keep_exactly: self.keep_exactly,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.preset.is_none() && self.model.is_none() {
            bail!("no model: pass --model PATH (or --preset tiny)");
        }
        if let Some(model) = self.model.as_ref().filter(|m| !m.exists()) {
            bail!("--model {}: no such file or folder", model.display());
        }
        if self.preset.is_none() && self.data.is_none() {
            bail!("no training data: pass --data FILE_OR_DIR");
        }
        if self.method == Method::Lemo {
            self.sparsity().validate()?;
        }
        if self.steps == 0 || self.batch_size == 0 || self.grad_accum == 0 {
            bail!("--steps, --batch-size and --grad-accum must be positive");
        }
        if self.seq_len.is_some_and(|s| s < 2) {
            bail!("--seq-len must be at least 2");
        }
        if self.lr.is_nan() || self.lr <= 0.0 || self.lora_rank == 0 {
            bail!("--lr and --lora-rank must be positive");
        }
        self.save_interval()?;
        self.collective_timeout()?;
        Ok(())
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

/// An integer option as a TOML value; TOML integers are i64, so larger values are refused
/// rather than wrapped around.
fn int(key: &str, value: Option<usize>) -> Result<Option<toml::Value>> {
    value
        .map(|v| match i64::try_from(v) {
            Ok(v) => Ok(toml::Value::Integer(v)),
            Err(_) => bail!("--{} {v} is too large", key.replace('_', "-")),
        })
        .transpose()
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

/// `train` flags: each overrides the configuration file and preset when given.
#[derive(Debug, Args, Default)]
pub struct TrainArgs {
    /// Built-in setup: `tiny` trains a small random-init Llama on generated text on the CPU.
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,
    /// TOML file with any of the options below (snake_case keys, e.g. `seq_len = 4096`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Hugging Face model folder (config.json + *.safetensors), llama2.c .bin checkpoint or
    /// .gguf file.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// tokenizer.json or llama2.c tokenizer .bin [default: the one beside the model].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Text files, JSONL (`text` or `input_ids`), raw token .bin files, or a folder of these.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Bytes per token id in .bin token files: 2 or 4 [default: 2].
    #[arg(long)]
    pub token_width: Option<u8>,
    /// Run folder: adapter/, checkpoints/, metrics.jsonl, plots/, config.toml [default: runs/lemo].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue a run: its folder (latest checkpoint) or one checkpoint folder.
    #[arg(long, conflicts_with_all = ["out", "overwrite"])]
    pub resume: Option<PathBuf>,
    /// Replace the run already in --out (its adapter, checkpoints, metrics and plots); without
    /// it a new run refuses a folder that holds one.
    #[arg(long)]
    pub overwrite: bool,
    /// Train even where the memory plan predicts the step will not fit in the device's free
    /// memory.
    #[arg(long)]
    pub skip_memory_plan: bool,
    /// lora (dense baseline), longlora (S2 attention + trainable embeddings/norms), or lemo
    /// (token elimination: each layer processes only its informative token blocks, chosen by
    /// per-layer thresholds calibrated toward --target-keep) [default: lora].
    #[arg(long, value_enum)]
    pub method: Option<Method>,
    /// Training sequence length in tokens [default: the target context, else the model's].
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Context to extend to: sets linear RoPE position interpolation with factor
    /// target / trained context (none when not larger).
    #[arg(long)]
    pub target_context: Option<usize>,
    /// Optimizer steps [default: 1000].
    #[arg(long)]
    pub steps: Option<usize>,
    /// Sequences per micro-batch [default: 1].
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Micro-batches per optimizer step [default: 1].
    #[arg(long)]
    pub grad_accum: Option<usize>,
    /// Peak learning rate [default: 2e-4].
    #[arg(long)]
    pub lr: Option<f64>,
    /// Linear warm-up steps [default: 20].
    #[arg(long)]
    pub warmup_steps: Option<usize>,
    /// After warm-up: constant or cosine [default: constant].
    #[arg(long, value_enum)]
    pub schedule: Option<Schedule>,
    /// Cosine floor as a fraction of --lr [default: 0].
    #[arg(long)]
    pub min_lr_ratio: Option<f64>,
    /// AdamW beta1 [default: 0.9].
    #[arg(long)]
    pub beta1: Option<f64>,
    /// AdamW beta2 [default: 0.999].
    #[arg(long)]
    pub beta2: Option<f64>,
    /// AdamW epsilon [default: 1e-8].
    #[arg(long)]
    pub eps: Option<f64>,
    /// AdamW decoupled weight decay [default: 0].
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Global gradient-norm clipping; 0 is off [default: 1.0].
    #[arg(long)]
    pub max_grad_norm: Option<f64>,
    /// LoRA rank [default: 8].
    #[arg(long)]
    pub lora_rank: Option<usize>,
    /// LoRA alpha (scaling alpha / rank) [default: 16].
    #[arg(long)]
    pub lora_alpha: Option<f64>,
    /// LoRA dropout [default: 0].
    #[arg(long)]
    pub lora_dropout: Option<f64>,
    /// Comma-separated projections to adapt [default: q_proj,k_proj,v_proj,o_proj].
    #[arg(long, value_delimiter = ',')]
    pub lora_targets: Option<Vec<String>>,
    /// Train the token embeddings too [default: true for longlora].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub train_embeddings: Option<bool>,
    /// Train the normalization weights too [default: true for longlora].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub train_norms: Option<bool>,
    /// longlora's S2 attention group size [default: seq-len / 4].
    #[arg(long)]
    pub s2_group_size: Option<usize>,
    /// Activation checkpointing: keep only each layer's input and recompute the layer in the
    /// backward pass (one more forward pass, memory of one layer's activations).
    #[arg(long)]
    pub checkpointing: bool,
    #[command(flatten)]
    pub sparsity: SparsityArgs,
    /// Positions per segment of the segment-based loss [default: 1024].
    #[arg(long)]
    pub loss_segment: Option<usize>,
    /// Seed of LoRA initialization, data order and dropout [default: 42].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Fraction of the packed sequences held out for validation [default: 0.02].
    #[arg(long)]
    pub val_fraction: Option<f64>,
    /// Validate every N steps and at the end; 0 only at the end [default: 100].
    #[arg(long)]
    pub val_every: Option<usize>,
    /// Validation sequences per validation; 0 all [default: 8].
    #[arg(long)]
    pub val_sequences: Option<usize>,
    /// Write a checkpoint every N steps (and always at the end) [default: 100].
    #[arg(long)]
    pub checkpoint_every: Option<usize>,
    /// Also write a checkpoint when this much wall time passed since the last one: 10m, 90s,
    /// 1h, or 0 for off [default: 10m].
    #[arg(long)]
    pub save_every: Option<String>,
    /// Checkpoints kept; older ones of this run are deleted [default: 2].
    #[arg(long)]
    pub keep_checkpoints: Option<usize>,
    /// Append EOS to each document when packing [default: yes, except llama2.c models].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub append_eos: Option<bool>,
    /// Tokenized-data cache folder, or "none" [default: ~/.cache/lemo/tokens].
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Stop after N steps in this process, as an interruption would (resume continues).
    #[arg(long)]
    pub stop_after: Option<usize>,
    /// auto (CUDA when an NVIDIA driver is present, else the CPU), cuda, wgpu or cpu.
    #[arg(long, value_enum)]
    pub device: Option<DeviceKind>,
    /// Data-parallel training on N GPUs of this machine (CUDA devices 0..N, one thread each,
    /// gradients summed by NCCL). Each GPU holds a whole replica and runs --batch-size x
    /// --grad-accum sequences per step, so memory per GPU is that of one GPU and the global
    /// batch is N x batch x grad-accum: N times the tokens per step at about the step time of
    /// one GPU. On cpu and wgpu, N simulated ranks share the device (for testing). Under a
    /// launcher (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment: one
    /// process per GPU, on one machine or several) leave it out [default: 1].
    #[arg(long, visible_alias = "ranks")]
    pub gpus: Option<usize>,
    /// How long a rank waits for the others (a rank that died or hangs) before the run ends
    /// with an error: 10m, 90s, 1h, or off [default: 10m].
    #[arg(long)]
    pub collective_timeout: Option<String>,
    /// bf16 (model and activations; LoRA, gradients and optimizer f32) or f32
    /// [default: bf16 on cuda; f32 on cpu and wgpu, which have no bf16].
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionKind>,
}

impl TrainArgs {
    /// The flags given, as a TOML table of overrides.
    pub fn overrides(&self) -> Result<toml::Table> {
        let mut t = toml::Table::new();
        let mut put = |key: &str, value: Option<toml::Value>| {
            if let Some(v) = value {
                t.insert(key.to_string(), v);
            }
        };
        let path = |p: &Option<PathBuf>| {
            p.as_ref()
                .map(|p| toml::Value::String(p.display().to_string()))
        };

        let float = |v: Option<f64>| v.map(toml::Value::Float);
        let enum_value = |v: Option<String>| v.map(toml::Value::String);
        put("model", path(&self.model));
        put("tokenizer", path(&self.tokenizer));
        put("data", path(&self.data));
        put(
            "token_width",
            int("token_width", self.token_width.map(usize::from))?,
        );
        put("out", path(&self.out));
        put(
            "method",
            enum_value(self.method.map(|m| m.name().to_string())),
        );
        put("seq_len", int("seq_len", self.seq_len)?);
        put(
            "target_context",
            int("target_context", self.target_context)?,
        );
        put("steps", int("steps", self.steps)?);
        put("batch_size", int("batch_size", self.batch_size)?);
        put("grad_accum", int("grad_accum", self.grad_accum)?);
        put("lr", float(self.lr));
        put("warmup_steps", int("warmup_steps", self.warmup_steps)?);
        put(
            "schedule",
            enum_value(
                self.schedule
                    .map(|s| s.to_possible_value().expect("named").get_name().to_string()),
            ),
        );
        put("min_lr_ratio", float(self.min_lr_ratio));
        put("beta1", float(self.beta1));
        put("beta2", float(self.beta2));
        put("eps", float(self.eps));
        put("weight_decay", float(self.weight_decay));
        put("max_grad_norm", float(self.max_grad_norm));
        put("lora_rank", int("lora_rank", self.lora_rank)?);
        put("lora_alpha", float(self.lora_alpha));
        put("lora_dropout", float(self.lora_dropout));
        put(
            "lora_targets",
            self.lora_targets
                .as_ref()
                .map(|v| toml::Value::Array(v.iter().cloned().map(toml::Value::String).collect())),
        );
        put(
            "train_embeddings",
            self.train_embeddings.map(toml::Value::Boolean),
        );
        put("train_norms", self.train_norms.map(toml::Value::Boolean));
        put("s2_group_size", int("s2_group_size", self.s2_group_size)?);
        if self.checkpointing {
            put("checkpointing", Some(toml::Value::Boolean(true)));
        }
        let lemo = &self.sparsity;
        put("thresholds", path(&lemo.thresholds));
        put("target_keep", float(lemo.target_keep));
        put("attention_keep", float(lemo.attention_keep));
        put("mlp_keep", float(lemo.mlp_keep));
        put("block_size", int("block_size", lemo.block_size)?);
        put("min_keep", float(lemo.min_keep));
        put(
            "dense_layers",
            lemo.dense_layers.as_ref().map(|v| {
                toml::Value::Array(v.iter().map(|&l| toml::Value::Integer(l as i64)).collect())
            }),
        );
        put(
            "calibration_sequences",
            int("calibration_sequences", lemo.calibration_sequences)?,
        );
        put(
            "calibration_rounds",
            int("calibration_rounds", lemo.calibration_rounds)?,
        );
        put("predictors", path(&lemo.predictors));
        put(
            "scores",
            enum_value(
                lemo.scores
                    .map(|s| s.to_possible_value().expect("named").get_name().to_string()),
            ),
        );
        put(
            "mlp_dropped_rows",
            enum_value(
                lemo.mlp_dropped_rows
                    .map(|s| s.to_possible_value().expect("named").get_name().to_string()),
            ),
        );
        if lemo.keep_exactly {
            put("keep_exactly", Some(toml::Value::Boolean(true)));
        }
        put("loss_segment", int("loss_segment", self.loss_segment)?);
        put("seed", int("seed", self.seed.map(|v| v as usize))?);
        put("val_fraction", float(self.val_fraction));
        put("val_every", int("val_every", self.val_every)?);
        put("val_sequences", int("val_sequences", self.val_sequences)?);
        put(
            "checkpoint_every",
            int("checkpoint_every", self.checkpoint_every)?,
        );
        put(
            "save_every",
            self.save_every.clone().map(toml::Value::String),
        );
        put(
            "keep_checkpoints",
            int("keep_checkpoints", self.keep_checkpoints)?,
        );
        put("append_eos", self.append_eos.map(toml::Value::Boolean));
        put("cache_dir", path(&self.cache_dir));
        put("stop_after", int("stop_after", self.stop_after)?);
        put(
            "device",
            enum_value(
                self.device
                    .map(|d| d.to_possible_value().expect("named").get_name().to_string()),
            ),
        );
        put("gpus", int("gpus", self.gpus)?);
        put(
            "collective_timeout",
            self.collective_timeout.clone().map(toml::Value::String),
        );
        put(
            "precision",
            enum_value(self.precision.map(|p| p.name().to_string())),
        );
        Ok(t)
    }
}
