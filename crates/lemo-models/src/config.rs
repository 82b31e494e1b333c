//! Model configurations read straight from a Hugging Face `config.json`. Field names mirror the
//! file; defaults are the ones transformers applies when a key is absent.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

pub use crate::rope::{RopeConfig, RopeScaling, YarnScaling};
use crate::{Error, Result};

/// One of the supported architectures, with its configuration.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    /// Llama-2/3, TinyLlama, and Mistral (a Llama with `sliding_window`).
    Llama(LlamaConfig),
    Opt(OptConfig),
}

impl ModelConfig {
    /// Reads `config.json` (a file, or the folder holding it).
    pub fn from_file(path: &Path) -> Result<Self> {
        let path = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| Error::format(&path, format!("invalid JSON: {e}")))?;
        Self::from_json(json).map_err(|e| match e {
            Error::Config(message) => Error::format(&path, message),
            other => other,
        })
    }

    pub fn from_json(json: Value) -> Result<Self> {
        let model_type = json
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let architecture = json
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let parse = |what: &str| format!("invalid {what} config: ");
        match (model_type.as_str(), architecture.as_str()) {
            ("llama" | "mistral", _) | ("", "LlamaForCausalLM" | "MistralForCausalLM") => {
                let mut json = json;
                if model_type == "mistral" {
                    // transformers' MistralConfig defaults: an absent key is a 4096-token window
                    // (null means none) and 8 KV heads.
                    let object = json.as_object_mut().expect("config.json is an object");
                    object.entry("sliding_window").or_insert(Value::from(4096));
                    object
                        .entry("num_key_value_heads")
                        .or_insert(Value::from(8));
                }
                let raw: RawLlamaConfig = serde_json::from_value(json)
                    .map_err(|e| Error::Config(parse("llama") + &e.to_string()))?;
                Ok(ModelConfig::Llama(raw.resolve(model_type == "mistral")?))
            }
            ("opt", _) | ("", "OPTForCausalLM") => {
                let config: OptConfig = serde_json::from_value(json)
                    .map_err(|e| Error::Config(parse("opt") + &e.to_string()))?;
                config.validate()?;
                Ok(ModelConfig::Opt(config))
            }
            _ => Err(Error::Config(format!(
                "unsupported architecture (model_type {model_type:?}, architectures {architecture:?}): \
                 lemo supports llama, mistral and opt"
            ))),
        }
    }

    /// `llama` (Llama, Mistral, TinyLlama) or `opt`.
    pub fn architecture(&self) -> &'static str {
        match self {
            ModelConfig::Llama(_) => "llama",
            ModelConfig::Opt(_) => "opt",
        }
    }

    pub fn num_layers(&self) -> usize {
        match self {
            ModelConfig::Llama(c) => c.num_hidden_layers,
            ModelConfig::Opt(c) => c.num_hidden_layers,
        }
    }

    pub fn hidden_size(&self) -> usize {
        match self {
            ModelConfig::Llama(c) => c.hidden_size,
            ModelConfig::Opt(c) => c.hidden_size,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Llama(c) => c.vocab_size,
            ModelConfig::Opt(c) => c.vocab_size,
        }
    }

    /// The context length the model was trained with.
    pub fn max_position_embeddings(&self) -> usize {
        match self {
            ModelConfig::Llama(c) => c.max_position_embeddings,
            ModelConfig::Opt(c) => c.max_position_embeddings,
        }
    }

    /// The longest sequence the model can process (OPT's learned positions are a hard limit;
    /// RoPE models can run past the trained context, with degrading quality).
    pub fn max_sequence_length(&self) -> Option<usize> {
        match self {
            ModelConfig::Llama(_) => None,
            ModelConfig::Opt(c) => Some(c.max_position_embeddings),
        }
    }

    pub fn eos_token_ids(&self) -> Vec<u32> {
        match self {
            ModelConfig::Llama(c) => c.eos_token_id.clone(),
            ModelConfig::Opt(c) => c.eos_token_id.into_iter().collect(),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub rope: RopeConfig,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    /// Mistral's sliding-window attention; `None` for Llama.
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Vec<u32>,
}

#[derive(Deserialize)]
struct RawLlamaConfig {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_rms_norm_eps")]
    rms_norm_eps: f64,
    #[serde(default = "default_max_positions")]
    max_position_embeddings: usize,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    sliding_window: Option<usize>,
    #[serde(default = "default_hidden_act")]
    hidden_act: String,
    bos_token_id: Option<u32>,
    eos_token_id: Option<TokenIds>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

/// More positions than any released model addresses: a larger value is a corrupt config, and
/// the RoPE tables sized from it would not fit in memory.
const MAX_POSITIONS: usize = 1 << 24;

fn check_positions(positions: usize) -> Result<()> {
    if positions == 0 || positions > MAX_POSITIONS {
        return Err(Error::Config(format!(
            "max_position_embeddings {positions} is outside 1..={MAX_POSITIONS}"
        )));
    }
    Ok(())
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_max_positions() -> usize {
    2048
}
fn default_hidden_act() -> String {
    "silu".into()
}

impl RawLlamaConfig {
    fn resolve(self, is_mistral: bool) -> Result<LlamaConfig> {
        if self.hidden_act != "silu" {
            return Err(Error::Config(format!(
                "unsupported hidden_act {:?}: Llama-family models use silu",
                self.hidden_act
            )));
        }
        let heads = self.num_attention_heads;
        let kv_heads = self.num_key_value_heads.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(Error::Config(format!(
                "num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads ({kv_heads})"
            )));
        }
        let head_dim = self.head_dim.unwrap_or(self.hidden_size / heads);
        if !head_dim.is_multiple_of(2) {
            return Err(Error::Config(format!(
                "head_dim ({head_dim}) must be even for RoPE"
            )));
        }
        check_positions(self.max_position_embeddings)?;
        let rope_params = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref());
        Ok(LlamaConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: self.rms_norm_eps,
            max_position_embeddings: self.max_position_embeddings,
            rope: RopeConfig::from_json(
                rope_params,
                self.rope_theta,
                self.max_position_embeddings,
            )?,
            tie_word_embeddings: self.tie_word_embeddings,
            attention_bias: self.attention_bias,
            mlp_bias: self.mlp_bias,
            sliding_window: if is_mistral {
                self.sliding_window
            } else {
                None
            },
            bos_token_id: self.bos_token_id,
            eos_token_id: match self.eos_token_id {
                Some(TokenIds::One(id)) => vec![id],
                Some(TokenIds::Many(ids)) => ids,
                None => vec![],
            },
        })
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct OptConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub ffn_dim: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    /// Width of the token embeddings; `project_in`/`project_out` exist when it differs from
    /// `hidden_size` (OPT-350m).
    pub word_embed_proj_dim: Option<usize>,
    #[serde(default = "default_true")]
    pub do_layer_norm_before: bool,
    /// Set on checkpoints converted before OPT's final norm existed.
    #[serde(default, rename = "_remove_final_layer_norm")]
    pub remove_final_layer_norm: bool,
    #[serde(default = "default_true")]
    pub enable_bias: bool,
    #[serde(default = "default_true")]
    pub layer_norm_elementwise_affine: bool,
    #[serde(default = "default_relu")]
    pub activation_function: String,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
}

fn default_true() -> bool {
    true
}
fn default_relu() -> String {
    "relu".into()
}

impl OptConfig {
    pub fn word_embed_proj_dim(&self) -> usize {
        self.word_embed_proj_dim.unwrap_or(self.hidden_size)
    }

    /// OPT's learned position table has two extra rows: positions are looked up at `pos + 2`.
    pub const POSITION_OFFSET: usize = 2;

    fn validate(&self) -> Result<()> {
        check_positions(self.max_position_embeddings)?;
        if self.activation_function != "relu" {
            return Err(Error::Config(format!(
                "unsupported activation_function {:?} for OPT: only relu",
                self.activation_function
            )));
        }
        if self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(Error::Config(format!(
                "hidden_size ({}) must be a multiple of num_attention_heads ({})",
                self.hidden_size, self.num_attention_heads
            )));
        }
        Ok(())
    }
}
