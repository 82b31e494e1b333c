//! Training configuration: defaults, then a preset, then a TOML file (`--config`), then
//! command-line flags, each overriding the one before. One struct, [`TrainConfig`], is the
//! flags (clap), the TOML keys (serde) and what the library trains with: every setting and its
//! default is spelled once, on its field. The resolved configuration is written to
//! `<out>/config.toml`, which `--resume` reads back.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{ArgMatches, Args, ValueEnum, parser::ValueSource};
use lemo_models::lora::LLAMA_PROJECTIONS;
use serde::{Deserialize, Serialize};

use crate::data::chat::LossOn;
use crate::device::{DeviceKind, Runtime};
use crate::lemo::LemoSettings;
use crate::method::Method;
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
    /// Train the token embeddings too [default: true for longlora].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub train_embeddings: Option<bool>,
    /// Train the normalization weights too [default: true for longlora].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub train_norms: Option<bool>,
    /// longlora's S2 attention group size [default: seq-len / 4].
    #[arg(long)]
    pub s2_group_size: Option<usize>,
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

    /// The keys a TOML file may set: the flags' names in snake_case, and `preset`.
    fn keys() -> Vec<String> {
        let command = Self::augment_args(clap::Command::new("train"));
        let mut keys: Vec<String> = command
            .get_arguments()
            .map(|arg| arg.get_id().to_string())
            .filter(|id| id != "help")
            .collect();
        keys.push("preset".to_string());
        keys
    }

    /// A TOML configuration file as a table of overrides, its keys checked.
    pub fn from_toml_file(path: &Path) -> Result<toml::Table> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let table: toml::Table =
            toml::from_str(&text).with_context(|| format!("{}: invalid TOML", path.display()))?;
        let keys = Self::keys();
        if let Some(unknown) = table.keys().find(|key| !keys.contains(key)) {
            bail!(
                "{}: unknown key `{unknown}` (the keys are the train flags in snake_case, e.g. seq_len)",
                path.display()
            );
        }
        Ok(table)
    }

    /// The settings given on the command line (`matches` are the `train` subcommand's), as a
    /// table of overrides: a flag left at its default overrides nothing.
    pub fn given_on_command_line(&self, matches: &ArgMatches) -> Result<toml::Table> {
        let given =
            |id: &&clap::Id| matches.value_source(id.as_str()) == Some(ValueSource::CommandLine);
        // TOML integers are i64: a larger count is refused rather than wrapped around.
        for id in matches.ids().filter(given) {
            let too_large = matches
                .get_raw(id.as_str())
                .into_iter()
                .flatten()
                .filter_map(|raw| raw.to_str()?.parse::<u128>().ok())
                .find(|&value| value > i64::MAX as u128);
            if let Some(value) = too_large {
                bail!("--{} {value} is too large", id.as_str().replace('_', "-"));
            }
        }
        let all = toml::Table::try_from(self).context("a flag's value is out of range")?;
        Ok(all
            .into_iter()
            .filter(|(key, _)| matches.value_source(key) == Some(ValueSource::CommandLine))
            .collect())
    }

    /// `self` with the keys of `table` replaced.
    pub fn merged(self, table: &toml::Table) -> Result<Self> {
        let mut base = toml::Table::try_from(&self).context("serializing the configuration")?;
        for (key, value) in table {
            base.insert(key.clone(), value.clone());
        }
        base.try_into().context("invalid training configuration")
    }

    /// The configuration a resumed run continues with, and the checkpoint it resumes from:
    /// the run's saved `config.toml`, `overrides` over it. Settings that make the adapter or the
    /// run what it is cannot change on resume: those overrides are refused before anything is
    /// read or written.
    /// A run folder whose run stopped before its first checkpoint has none to resume from:
    /// it starts over (checkpoint `None`) with its saved configuration.
    pub fn resumed(path: &Path, overrides: &toml::Table) -> Result<(Self, Option<PathBuf>)> {
        let checkpoint = match super::checkpoint::resolve(path) {
            Err(_) if path.join("config.toml").is_file() => None,
            found => Some(found?),
        };
        let run_dir = checkpoint
            .as_deref()
            .and_then(super::checkpoint::run_dir_of)
            .unwrap_or_else(|| path.into());
        let saved = Self::from_toml_file(&run_dir.join("config.toml"))?;
        for key in FIXED_ON_RESUME {
            if let Some(value) = overrides.get(*key)
                && saved.get(*key) != Some(value)
            {
                let was = saved
                    .get(*key)
                    .map_or("unset".to_string(), |v| v.to_string());
                bail!(
                    "--{} {value}: the run in {} was trained with {was}, and a resumed run keeps it (start a new run with --out to change it)",
                    key.replace('_', "-"),
                    run_dir.display()
                );
            }
        }
        let mut config = Self::default().merged(&saved)?;
        config.out = run_dir;
        Ok((config.merged(overrides)?, checkpoint))
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

    /// Which tokens of chat records are trained on: the assistant's unless told otherwise.
    pub fn loss_on(&self) -> LossOn {
        self.loss_on.unwrap_or(LossOn::Assistant)
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
        if !lemo_models::rope::EXTENSION_KINDS.contains(&self.rope_scaling.as_str()) {
            bail!(
                "--rope-scaling {:?}: unknown kind, choose one of {}",
                self.rope_scaling,
                lemo_models::rope::EXTENSION_KINDS.join(", ")
            );
        }
        if let Some(theta) = self.rope_theta.filter(|t| !(t.is_finite() && *t > 1.0)) {
            bail!("--rope-theta {theta}: the RoPE base must be a finite number above 1");
        }
        if self.method == Method::Lemo {
            self.lemo.validate()?;
        }
        if self.steps == 0 || self.batch_size == 0 || self.grad_accum == 0 {
            bail!("--steps, --batch-size and --grad-accum must be positive");
        }
        if self.seq_len.is_some_and(|s| s < 2) {
            bail!("--seq-len must be at least 2");
        }
        crate::modelio::check_target_context(self.target_context)?;
        if self.lora_rank == 0 {
            bail!("--lora-rank must be positive");
        }
        if self.loss_segment == 0 {
            bail!("--loss-segment must be positive");
        }
        if self.s2_group_size.is_some_and(|g| g < 2) {
            bail!("--s2-group-size must be at least 2 tokens");
        }
        let in_range = |flag: &str, value: f64, range: Range| -> Result<()> {
            if !range.contains(value) {
                bail!("--{flag} {value} is outside {}", range.describe());
            }
            Ok(())
        };
        in_range("lr", self.lr, Range::Positive)?;
        in_range("lora-alpha", self.lora_alpha, Range::Positive)?;
        in_range("lora-dropout", self.lora_dropout, Range::Fraction)?;
        in_range("beta1", self.beta1, Range::Fraction)?;
        in_range("beta2", self.beta2, Range::Fraction)?;
        in_range("eps", self.eps, Range::Positive)?;
        in_range("weight-decay", self.weight_decay, Range::NonNegative)?;
        in_range("max-grad-norm", self.max_grad_norm, Range::NonNegative)?;
        in_range("min-lr-ratio", self.min_lr_ratio, Range::Probability)?;
        in_range("val-fraction", self.val_fraction, Range::Fraction)?;
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

/// Settings a resumed run must keep: the model, the method and the adapter's shape.
const FIXED_ON_RESUME: &[&str] = &[
    "model",
    "method",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "train_embeddings",
    "train_norms",
    "target_context",
    "rope_scaling",
    "rope_theta",
    "block_size",
    "loss_on",
];

/// The ranges a real-valued setting may take.
#[derive(Clone, Copy)]
enum Range {
    /// (0, inf)
    Positive,
    /// [0, inf)
    NonNegative,
    /// [0, 1)
    Fraction,
    /// [0, 1]
    Probability,
}

impl Range {
    fn contains(self, value: f64) -> bool {
        value.is_finite()
            && match self {
                Range::Positive => value > 0.0,
                Range::NonNegative => value >= 0.0,
                Range::Fraction => (0.0..1.0).contains(&value),
                Range::Probability => (0.0..=1.0).contains(&value),
            }
    }

    fn describe(self) -> &'static str {
        match self {
            Range::Positive => "(0, inf): it must be a positive number",
            Range::NonNegative => "[0, inf): it must be a finite number, 0 or more",
            Range::Fraction => "[0, 1)",
            Range::Probability => "[0, 1]",
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `train` as the binary parses it: its options and the configuration flattened.
    #[derive(clap::Parser)]
    struct Train {
        #[command(flatten)]
        config: TrainConfig,
    }

    fn parse(flags: &[&str]) -> (TrainConfig, ArgMatches) {
        let matches = <Train as clap::CommandFactory>::command()
            .try_get_matches_from(std::iter::once("train").chain(flags.iter().copied()))
            .expect("flags parse");
        let config = <Train as clap::FromArgMatches>::from_arg_matches(&matches)
            .expect("matches convert")
            .config;
        (config, matches)
    }

    #[test]
    fn only_flags_given_override_a_file_and_a_preset() {
        let (flags, matches) = parse(&["--lr", "1e-3", "--target-keep", "0.3", "--device", "cpu"]);
        let overrides = flags.given_on_command_line(&matches).unwrap();
        let mut keys: Vec<&str> = overrides.keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(keys, ["device", "lr", "target_keep"]);

        let file: toml::Table = toml::from_str("steps = 7\nlr = 0.5\nblock_size = 32").unwrap();
        let config = TrainConfig::preset(Preset::Tiny)
            .merged(&file)
            .unwrap()
            .merged(&overrides)
            .unwrap();
        assert_eq!(config.steps, 7, "the file's key");
        assert_eq!(config.lr, 1e-3, "the flag over the file");
        assert_eq!(config.lemo.block_size, 32, "a flattened key from the file");
        assert_eq!(config.lemo.target_keep, 0.3, "a flattened flag");
        assert_eq!(
            config.lora_rank, 16,
            "the preset's, untouched by defaults of flags"
        );
        assert_eq!(config.preset, Some(Preset::Tiny));
    }

    #[test]
    fn the_defaults_are_the_flags_defaults_and_round_trip_through_toml() {
        let (flags, _) = parse(&[]);
        assert_eq!(flags, TrainConfig::default());
        let config = TrainConfig::default();
        assert_eq!(config.steps, 1000);
        assert_eq!(config.lemo.dense_layers, vec![0]);
        let table: toml::Table = toml::from_str(&config.to_toml()).unwrap();
        assert_eq!(TrainConfig::default().merged(&table).unwrap(), config);
    }

    #[test]
    fn a_file_with_an_unknown_key_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.toml");
        std::fs::write(&path, "seq_len = 64\nlearning_rate = 0.1\n").unwrap();
        let error = TrainConfig::from_toml_file(&path).unwrap_err().to_string();
        assert!(error.contains("unknown key `learning_rate`"), "{error}");
        std::fs::write(&path, "seq_len = 64\ntarget_keep = 0.4\ndevice = \"cpu\"\n").unwrap();
        TrainConfig::from_toml_file(&path).expect("flattened keys are known");
    }

    #[test]
    fn settings_out_of_range_are_refused_naming_the_flag() {
        let base = TrainConfig::preset(Preset::Tiny);
        for (change, flag) in [
            (
                TrainConfig {
                    lora_dropout: 2.0,
                    ..base.clone()
                },
                "--lora-dropout",
            ),
            (
                TrainConfig {
                    beta1: 2.0,
                    ..base.clone()
                },
                "--beta1",
            ),
            (
                TrainConfig {
                    beta2: -1.0,
                    ..base.clone()
                },
                "--beta2",
            ),
            (
                TrainConfig {
                    eps: 0.0,
                    ..base.clone()
                },
                "--eps",
            ),
            (
                TrainConfig {
                    val_fraction: 2.0,
                    ..base.clone()
                },
                "--val-fraction",
            ),
            (
                TrainConfig {
                    lr: f64::NAN,
                    ..base.clone()
                },
                "--lr",
            ),
            (
                TrainConfig {
                    s2_group_size: Some(0),
                    ..base.clone()
                },
                "--s2-group-size",
            ),
        ] {
            let error = change.validate().unwrap_err().to_string();
            assert!(error.contains(flag), "{flag}: {error}");
        }
        base.validate().expect("the preset is valid");
    }
}
