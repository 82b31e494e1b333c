//! Loading a model the way training left it: base weights, RoPE position interpolation for the
//! context it was extended to, and the LoRA adapter. An adapter folder written by `train` holds
//! `lemo_training.json` next to PEFT's files, recording the RoPE scaling it was trained with.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use lemo_kernels::LemoBackend;
use lemo_models::activation_plan::ActivationPlan;
use lemo_models::config::{RopeConfig, RopeScaling};
use lemo_models::gguf::GgufFile;
use lemo_models::llama2c::Llama2cCheckpoint;
use lemo_models::model::ModelFormat;
use lemo_models::quantized::QuantizeBase;
use lemo_models::tokenizer::Tokenizer;
use lemo_models::{CausalLm, ModelConfig};
use serde::{Deserialize, Serialize};

use crate::data::corpus::{default_cache_dir, read_model_documents};
use crate::data::{Document, LazyTokenizer};
use crate::device::{DeviceKind, PrecisionKind, Runtime};

pub const TRAINING_INFO_FILE: &str = "lemo_training.json";

/// The model a command runs, as training left it: the flags `eval`, `generate`, `calibrate`,
/// `profile` and `train-predictors` share.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Hugging Face model folder (config.json + *.safetensors), llama2.c .bin checkpoint or
    /// .gguf file.
    #[arg(long)]
    pub model: PathBuf,
    /// tokenizer.json, llama2.c tokenizer .bin or .gguf [default: the one beside the model].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Apply this PEFT adapter folder, with the RoPE scaling it was trained with.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Linear RoPE position interpolation for this context (overrides the adapter's).
    #[arg(long)]
    pub target_context: Option<usize>,
    #[command(flatten)]
    pub runtime: Runtime,
}

impl ModelArgs {
    /// The device to run on and how to load the model there; the model must exist.
    pub fn resolve(&self) -> Result<(DeviceKind, ModelSetup)> {
        require_model(&self.model)?;
        check_target_context(self.target_context)?;
        let (device, precision) = self.runtime.resolve()?;
        let setup = ModelSetup {
            adapter: self.adapter.clone(),
            target_context: self.target_context,
            precision,
            quantize_base: self.runtime.quantize_base(),
        };
        Ok((device, setup))
    }

    /// `--tokenizer`, else the one beside the model.
    pub fn tokenizer_path(&self) -> Option<PathBuf> {
        self.tokenizer
            .clone()
            .or_else(|| crate::data::find_tokenizer(&self.model))
    }

    /// The documents of `data` for this model (tokenized with its tokenizer, chat records with
    /// its template, cached in the default cache), every id checked against its vocabulary.
    pub fn read_documents(&self, data: &Path, token_width: u8) -> Result<Vec<Document>> {
        read_model_documents(
            data,
            token_width,
            &mut LazyTokenizer::new(self.tokenizer_path()),
            &self.model,
            default_cache_dir().as_deref(),
            read_config(&self.model)?.vocab_size(),
        )
    }

    /// The tokenizer of [`Self::tokenizer_path`], loaded.
    pub fn load_tokenizer(&self) -> Result<Tokenizer> {
        let path = self
            .tokenizer_path()
            .context("no tokenizer beside the model: pass --tokenizer")?;
        Ok(Tokenizer::from_file(&path)?)
    }
}

/// Refuses an output (`flag`'s path) that would overwrite what the command reads: an input
/// itself, a folder holding an input, or a file already inside an input folder (a model's).
pub fn check_output(flag: &str, out: &Path, inputs: &[&Path]) -> Result<()> {
    let absolute = |path: &Path| -> Option<PathBuf> {
        std::fs::canonicalize(path).ok().or_else(|| {
            let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
            let parent = std::fs::canonicalize(parent.unwrap_or(Path::new("."))).ok()?;
            Some(parent.join(path.file_name()?))
        })
    };
    let Some(target) = absolute(out) else {
        return Ok(());
    };
    for input in inputs {
        let Some(input) = std::fs::canonicalize(input).ok() else {
            continue;
        };
        let overwrites = target == input
            || input.starts_with(&target)
            || (out.exists() && target.starts_with(&input));
        if overwrites {
            bail!(
                "{flag} {}: that would overwrite {}, which this command reads",
                out.display(),
                input.display()
            );
        }
    }
    Ok(())
}

/// Whether two paths name the same existing file or folder.
pub fn same_path(a: &Path, b: &Path) -> bool {
    matches!(
        (std::fs::canonicalize(a), std::fs::canonicalize(b)),
        (Ok(a), Ok(b)) if a == b
    )
}

/// A missing `--model` is named as such before anything looks for files beside it.
pub fn require_model(model: &Path) -> Result<()> {
    if !model.exists() {
        bail!("--model {}: no such file or folder", model.display());
    }
    Ok(())
}

/// What `train` records beside an adapter.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainingInfo {
    pub method: String,
    pub base_model: String,
    /// The model's own trained context.
    pub trained_context: usize,
    /// `--target-context` of the run, if any.
    pub target_context: Option<usize>,
    /// The RoPE frequencies the adapter was trained with where they differ from the model's
    /// (transformers' `rope_parameters`: `rope_type`, `rope_theta` and the kind's fields).
    pub rope_scaling: Option<serde_json::Value>,
    pub seq_len: usize,
    pub steps: usize,
    /// Each layer kept (k), recomputed (r) or offloaded (o) in the training steps, and the
    /// plan line printed for it (absent in adapters of earlier versions).
    #[serde(default)]
    pub activation_plan: Option<ActivationPlan>,
    #[serde(default)]
    pub plan: Option<String>,
}

impl TrainingInfo {
    pub fn read(adapter: &Path) -> Result<Option<Self>> {
        let path = adapter.join(TRAINING_INFO_FILE);
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        Ok(Some(
            serde_json::from_str(&text).with_context(|| format!("{}: invalid", path.display()))?,
        ))
    }

    /// The recorded frequencies (an older record without `rope_theta` has the model's).
    pub fn rope(&self, config: &ModelConfig) -> Result<Option<RopeConfig>> {
        let (Some(recorded), ModelConfig::Llama(c)) = (&self.rope_scaling, config) else {
            return Ok(None);
        };
        let rope = RopeConfig::from_json(Some(recorded), Some(c.rope.theta), self.trained_context)
            .with_context(|| format!("{TRAINING_INFO_FILE}: rope_scaling"))?;
        Ok(Some(rope))
    }
}

/// How a context is extended: the RoPE scaling kind (`--rope-scaling`) and a new base
/// (`--rope-theta`).
#[derive(Debug, Clone, PartialEq)]
pub struct Extension {
    pub kind: String,
    pub theta: Option<f64>,
}

impl Default for Extension {
    fn default() -> Self {
        Self {
            kind: "linear".into(),
            theta: None,
        }
    }
}

/// The RoPE configuration for running `config` at `target_context` tokens: `extension`'s
/// kind by the factor `target / trained` when that is above 1, and its new base if any;
/// `None` when nothing changes.
pub fn extended_rope(
    config: &ModelConfig,
    target_context: usize,
    extension: &Extension,
) -> Result<Option<RopeConfig>> {
    check_target_context(Some(target_context))?;
    let trained = config.max_position_embeddings();
    let ModelConfig::Llama(c) = config else {
        if target_context > trained || extension.theta.is_some() {
            bail!(
                "--target-context / --rope-theta: OPT has learned positions up to {trained} and cannot be extended by RoPE scaling"
            );
        }
        return Ok(None);
    };
    let theta = extension.theta.unwrap_or(c.rope.theta);
    if target_context <= trained {
        return Ok(extension.theta.map(|theta| RopeConfig {
            theta,
            scaling: c.rope.scaling.clone(),
        }));
    }
    if c.rope.scaling != RopeScaling::Default {
        bail!(
            "--target-context: the model already has RoPE scaling {}; scaling on top of it is not supported",
            c.rope.scaling.name()
        );
    }
    Ok(Some(RopeConfig {
        theta,
        scaling: RopeScaling::extension(&extension.kind, trained, target_context)?,
    }))
}

/// Refuses a `--target-context` too short to hold a prediction (0 would scale positions by 0).
pub fn check_target_context(target_context: Option<usize>) -> Result<()> {
    if let Some(target) = target_context.filter(|&t| t < 2) {
        bail!("--target-context {target}: a context is at least 2 tokens");
    }
    Ok(())
}

/// A model's configuration alone, without loading its weights.
pub fn read_config(path: &Path) -> Result<ModelConfig> {
    Ok(match ModelFormat::detect(path)? {
        ModelFormat::HuggingFace => ModelConfig::from_file(path)?,
        ModelFormat::Llama2c => ModelConfig::Llama(Llama2cCheckpoint::open(path)?.config().clone()),
        ModelFormat::Gguf => ModelConfig::Llama(GgufFile::open(path)?.llama_config()?),
    })
}

/// The longest sequence a model addresses as configured: its trained context, times the factor
/// of a linear interpolation or dynamic NTK scaling its config applies (both are given over the
/// original context; YaRN and llama3 configs give the extended one).
pub fn addressable_context(config: &ModelConfig) -> usize {
    let trained = config.max_position_embeddings();
    match config {
        ModelConfig::Llama(c) => match c.rope.scaling {
            RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor, .. } => {
                (trained as f64 * factor.max(1.0)) as usize
            }
            _ => trained,
        },
        ModelConfig::Opt(_) => trained,
    }
}

/// Refuses training sequences past what the model addresses unless `--target-context` extends
/// the context to cover them.
pub fn check_seq_len(
    config: &ModelConfig,
    seq_len: usize,
    target_context: Option<usize>,
) -> Result<()> {
    let addressable = addressable_context(config);
    let extended = target_context.unwrap_or(0).max(addressable);
    if seq_len > extended {
        let hint = match target_context {
            Some(target) => format!("--target-context {target} does not reach it"),
            None => {
                format!("pass --target-context {seq_len} to extend it by position interpolation")
            }
        };
        bail!(
            "--seq-len {seq_len} is past the {addressable} positions this model addresses: \
             {hint}, or use --seq-len {addressable} or less"
        );
    }
    Ok(())
}

/// Refuses a LoRA rank above the model's hidden size: past a projection's width a rank adds
/// parameters and no capacity, and an absurd one would only fail when allocated.
pub fn check_lora_rank(config: &ModelConfig, rank: usize) -> Result<()> {
    let hidden = config.hidden_size();
    if rank > hidden {
        bail!("--lora-rank {rank} is more than the model's hidden size of {hidden}");
    }
    Ok(())
}

/// How `eval` (and friends) should set the model up.
#[derive(Debug, Clone)]
pub struct ModelSetup {
    pub adapter: Option<PathBuf>,
    /// Overrides the adapter's recorded scaling.
    pub target_context: Option<usize>,
    pub precision: PrecisionKind,
    pub quantize_base: QuantizeBase,
}

impl ModelSetup {
    /// The RoPE frequencies this setup runs `config` at, and where they come from:
    /// `--target-context` (linear position interpolation), else the ones recorded with the
    /// adapter; `None`: the model's own.
    pub fn rope(&self, config: &ModelConfig) -> Result<Option<(RopeConfig, String)>> {
        if let Some(target) = self.target_context {
            return Ok(extended_rope(config, target, &Extension::default())?
                .map(|rope| (rope, format!("--target-context {target}"))));
        }
        let info = match &self.adapter {
            Some(dir) => TrainingInfo::read(dir)?,
            None => None,
        };
        Ok(match info {
            Some(info) => info
                .rope(config)?
                .map(|rope| (rope, "recorded with the adapter".to_string())),
            None => None,
        })
    }

    /// How far [`Self::rope`] stretches the model's positions (1 for its own).
    pub fn interpolation_factor(&self, config: &ModelConfig) -> Result<f64> {
        Ok(self
            .rope(config)?
            .map_or(1.0, |(rope, _)| rope.scaling.factor()))
    }

    /// Refuses `seq_len` past the longest sequence the model addresses under this setup, as
    /// `train` does (positions past the trained context without interpolation are ones the
    /// model never saw).
    pub fn check_seq_len(&self, config: &ModelConfig, seq_len: usize) -> Result<()> {
        let factor = self
            .rope(config)?
            .map_or(1.0, |(rope, _)| rope.scaling.factor());
        let extended =
            (factor > 1.0).then(|| (config.max_position_embeddings() as f64 * factor) as usize);
        check_seq_len(config, seq_len, self.target_context.or(extended))
    }
}

/// Loads `path` with `setup` applied; says on stderr what was applied.
pub fn load<B: LemoBackend>(
    path: &Path,
    setup: &ModelSetup,
    device: &B::Device,
) -> Result<(CausalLm<B>, ModelConfig)> {
    let (mut model, config, frozen) = CausalLm::<B>::from_path_quantized(
        path,
        device,
        setup.precision.policy(),
        setup.quantize_base,
    )?;
    frozen.lines().iter().for_each(|line| eprintln!("{line}"));
    if let Some((rope, source)) = setup.rope(&config)? {
        model = model.with_rope(&rope)?;
        eprintln!(
            "rope: {} scaling, factor {}, theta {} ({source})",
            rope.scaling.name(),
            rope.scaling.factor(),
            rope.theta
        );
    }
    if let Some(dir) = &setup.adapter {
        let (with_adapter, lora) = model
            .load_adapter(dir)
            .with_context(|| format!("adapter {}", dir.display()))?;
        model = with_adapter;
        eprintln!(
            "adapter: {} (rank {}, {:?})",
            dir.display(),
            lora.rank,
            lora.target_modules
        );
    }
    Ok((model, config))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The factor of dynamic NTK scaling is given over the original context, as linear
    /// interpolation's is: a 32-position model scaled by 4 addresses 128 (transformers evaluates
    /// the fixture at 64).
    #[test]
    fn dynamic_scaling_extends_the_addressable_context() {
        let fixture = lemo_test_support::hf_fixture("llama_rope_dynamic_old_config");
        let config = read_config(&fixture).unwrap();
        assert_eq!(config.max_position_embeddings(), 32);
        assert_eq!(addressable_context(&config), 128);
        check_seq_len(&config, 64, None).unwrap();
        assert!(check_seq_len(&config, 129, None).is_err());
    }
}
