//! The rotary frequencies a model runs with: the base `theta` and a scaling kind, read from a
//! Hugging Face `rope_parameters` / `rope_scaling` object and written back in the same form, and
//! the per-pair inverse frequencies and cos/sin multiplier each kind gives, computed as
//! transformers' `modeling_rope_utils.py` does (f32 arithmetic where it uses f32).

use serde_json::{Map, Value, json};

use crate::{Error, Result};

/// How rotary position frequencies are computed (transformers' `rope_type`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    Default,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// NTK-aware scaling recomputed from each sequence's length (transformers' `dynamic`): past
    /// `original_max_position_embeddings` positions the base grows so that the lowest frequency
    /// spans the sequence, and the highest frequencies stay almost as they were.
    Dynamic {
        factor: f64,
        original_max_position_embeddings: usize,
    },
    Yarn(YarnScaling),
    /// Llama 3.1's frequency-dependent interpolation.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// One divisor per frequency pair, as a GGUF's `rope_freqs.weight` holds them (llama.cpp
    /// stores Llama 3.1's scaling that way).
    FrequencyFactors(Vec<f32>),
}

/// YaRN ("NTK-by-parts" interpolation with an attention temperature): frequencies that turn
/// more than `beta_fast` times over the original context are kept, those turning fewer than
/// `beta_slow` times are interpolated by `factor`, with a linear ramp between; cos and sin are
/// multiplied by the attention factor (`0.1 ln(factor) + 1` unless the config says otherwise).
#[derive(Debug, Clone, PartialEq)]
pub struct YarnScaling {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    pub beta_fast: Option<f64>,
    pub beta_slow: Option<f64>,
    pub attention_factor: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    pub truncate: Option<bool>,
}

impl YarnScaling {
    /// YaRN by `factor` over `original` positions, every other setting at its default.
    pub fn new(factor: f64, original: usize) -> Self {
        Self {
            factor,
            original_max_position_embeddings: original,
            beta_fast: None,
            beta_slow: None,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: None,
        }
    }

    /// The multiplier on cos and sin (the paper's `sqrt(1/t)`).
    pub fn attention_factor(&self) -> f64 {
        let mscale = |scale: f64, m: f64| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * m * scale.ln() + 1.0
            }
        };
        match (self.attention_factor, self.mscale, self.mscale_all_dim) {
            (Some(given), _, _) => given,
            (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                mscale(self.factor, m) / mscale(self.factor, all)
            }
            _ => mscale(self.factor, 1.0),
        }
    }

    /// transformers treats 0 and absent alike (`get("beta_fast") or 32`).
    fn betas(&self) -> (f64, f64) {
        let or = |v: Option<f64>, default: f64| v.filter(|&v| v != 0.0).unwrap_or(default);
        (or(self.beta_fast, 32.0), or(self.beta_slow, 1.0))
    }

    fn inverse_frequencies(&self, theta: f64, dim: usize) -> Vec<f32> {
        let (beta_fast, beta_slow) = self.betas();
        let original = self.original_max_position_embeddings as f64;
        let correction = |rotations: f64| {
            dim as f64 * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
        if self.truncate.unwrap_or(true) {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0) as f32, high.min(dim as f64 - 1.0) as f32);
        if low == high {
            high += 0.001;
        }
        let factor = self.factor as f32;
        (0..dim / 2)
            .map(|i| {
                let pos_freq = (theta as f32).powf((2 * i) as f32 / dim as f32);
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                (1.0 / (factor * pos_freq)) * (1.0 - extrapolation)
                    + (1.0 / pos_freq) * extrapolation
            })
            .collect()
    }
}

/// The RoPE base and scaling of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// What `--rope-scaling` chooses when extending a context.
pub const EXTENSION_KINDS: [&str; 4] = ["linear", "dynamic", "yarn", "llama3"];

impl RopeScaling {
    /// `kind` extending a model trained on `original` positions to `target` ones (the factor is
    /// their ratio; llama3 uses Llama 3.1's low/high frequency factors 1 and 4).
    pub fn extension(kind: &str, original: usize, target: usize) -> Result<Self> {
        let factor = target as f64 / original as f64;
        Ok(match kind {
            "linear" => RopeScaling::Linear { factor },
            "dynamic" => RopeScaling::Dynamic {
                factor,
                original_max_position_embeddings: original,
            },
            "yarn" => RopeScaling::Yarn(YarnScaling::new(factor, original)),
            "llama3" => RopeScaling::Llama3 {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: original,
            },
            other => {
                return Err(Error::Config(format!(
                    "unknown RoPE scaling {other:?}: choose one of {}",
                    EXTENSION_KINDS.join(", ")
                )));
            }
        })
    }

    /// transformers' name for the kind.
    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Yarn(_) => "yarn",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::FrequencyFactors(_) => "rope_freqs",
        }
    }

    /// How far the scaling stretches the original context (1 for none).
    pub fn factor(&self) -> f64 {
        match self {
            RopeScaling::Default => 1.0,
            RopeScaling::Linear { factor }
            | RopeScaling::Dynamic { factor, .. }
            | RopeScaling::Llama3 { factor, .. } => *factor,
            RopeScaling::Yarn(yarn) => yarn.factor,
            RopeScaling::FrequencyFactors(factors) => {
                factors.iter().copied().fold(1.0f32, f32::max) as f64
            }
        }
    }
}

impl RopeConfig {
    /// Reads a transformers 5 `rope_parameters` object, or an older `rope_scaling` one
    /// (with `rope_theta` given separately). `max_position_embeddings` is transformers' default
    /// for llama3's original context, and dynamic NTK's threshold.
    pub fn from_json(
        params: Option<&Value>,
        theta: Option<f64>,
        max_position_embeddings: usize,
    ) -> Result<Self> {
        let field = |name: &str| params.and_then(|p| p.get(name)).and_then(Value::as_f64);
        let theta = field("rope_theta").or(theta).unwrap_or(10000.0);
        let rope_type = params
            .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let required = |name: &str| {
            field(name)
                .ok_or_else(|| Error::Config(format!("rope type {rope_type:?} needs {name:?}")))
        };
        let original = field("original_max_position_embeddings").map(|v| v as usize);
        let scaling = match rope_type {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear {
                factor: required("factor")?,
            },
            "dynamic" => RopeScaling::Dynamic {
                factor: required("factor")?,
                original_max_position_embeddings: max_position_embeddings,
            },
            "yarn" => RopeScaling::Yarn(YarnScaling {
                factor: required("factor")?,
                original_max_position_embeddings: original.ok_or_else(|| {
                    Error::Config(
                        "rope type \"yarn\" needs \"original_max_position_embeddings\" (the context the model was pretrained with)".into(),
                    )
                })?,
                beta_fast: field("beta_fast"),
                beta_slow: field("beta_slow"),
                attention_factor: field("attention_factor"),
                mscale: field("mscale"),
                mscale_all_dim: field("mscale_all_dim"),
                truncate: params.and_then(|p| p.get("truncate")).and_then(Value::as_bool),
            }),
            "llama3" => RopeScaling::Llama3 {
                factor: required("factor")?,
                low_freq_factor: required("low_freq_factor")?,
                high_freq_factor: required("high_freq_factor")?,
                original_max_position_embeddings: original.unwrap_or(max_position_embeddings),
            },
            other => {
                return Err(Error::Config(format!(
                    "unsupported rope type {other:?}: lemo supports default, {}",
                    EXTENSION_KINDS.join(", ")
                )));
            }
        };
        let config = Self { theta, scaling };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<()> {
        if !(self.theta.is_finite() && self.theta > 1.0) {
            return Err(Error::Config(format!(
                "rope_theta {} must be a finite number above 1",
                self.theta
            )));
        }
        let factor = self.scaling.factor();
        if !(factor.is_finite() && factor > 0.0) {
            return Err(Error::Config(format!(
                "rope scaling {} has factor {factor}: it must be a positive number",
                self.scaling.name()
            )));
        }
        Ok(())
    }

    /// The transformers 5 `rope_parameters` object (theta and scaling together).
    pub fn parameters_json(&self) -> Result<Value> {
        let mut object = self.scaling_fields()?;
        object.insert("rope_type".into(), json!(self.scaling.name()));
        object.insert("rope_theta".into(), json!(self.theta));
        Ok(Value::Object(object))
    }

    /// The older `rope_scaling` object (`None` for the default frequencies), with both the
    /// `rope_type` and the older `type` key so that any transformers version reads it.
    pub fn scaling_json(&self) -> Result<Option<Value>> {
        if self.scaling == RopeScaling::Default {
            return Ok(None);
        }
        let mut object = self.scaling_fields()?;
        object.insert("rope_type".into(), json!(self.scaling.name()));
        object.insert("type".into(), json!(self.scaling.name()));
        Ok(Some(Value::Object(object)))
    }

    fn scaling_fields(&self) -> Result<Map<String, Value>> {
        let value = match &self.scaling {
            RopeScaling::Default => json!({}),
            RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor, .. } => {
                json!({"factor": factor})
            }
            RopeScaling::Yarn(yarn) => {
                let mut value = json!({
                    "factor": yarn.factor,
                    "original_max_position_embeddings": yarn.original_max_position_embeddings,
                });
                let optional = [
                    ("beta_fast", yarn.beta_fast.map(Value::from)),
                    ("beta_slow", yarn.beta_slow.map(Value::from)),
                    ("attention_factor", yarn.attention_factor.map(Value::from)),
                    ("mscale", yarn.mscale.map(Value::from)),
                    ("mscale_all_dim", yarn.mscale_all_dim.map(Value::from)),
                    ("truncate", yarn.truncate.map(Value::from)),
                ];
                for (key, v) in optional {
                    if let Some(v) = v {
                        value[key] = v;
                    }
                }
                value
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => json!({
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
            RopeScaling::FrequencyFactors(_) => {
                return Err(Error::Config(
                    "per-frequency RoPE factors (a GGUF's rope_freqs.weight) have no config.json form: export this model as GGUF instead".into(),
                ));
            }
        };
        Ok(value.as_object().cloned().unwrap_or_default())
    }

    /// The context transformers' `max_position_embeddings` should say for a model extended
    /// from `original` positions by this scaling: the extended one, except for dynamic NTK,
    /// whose threshold that key is.
    pub fn config_context(&self, original: usize) -> usize {
        match self.scaling {
            RopeScaling::Dynamic { .. } | RopeScaling::Default => original,
            _ => (original as f64 * self.scaling.factor()).round() as usize,
        }
    }

    /// The multiplier transformers applies to cos and sin (`attention_scaling`).
    pub fn attention_scaling(&self) -> f32 {
        match &self.scaling {
            RopeScaling::Yarn(yarn) => yarn.attention_factor() as f32,
            _ => 1.0,
        }
    }

    /// Whether the frequencies depend on the sequence length (dynamic NTK past its threshold).
    pub fn is_dynamic(&self) -> bool {
        matches!(self.scaling, RopeScaling::Dynamic { .. })
    }

    /// The per-pair rotation frequencies for a sequence of `seq_len` positions (only dynamic NTK
    /// depends on it), computed as transformers does (f32 arithmetic on the exponents).
    pub fn inverse_frequencies(&self, head_dim: usize, seq_len: usize) -> Result<Vec<f32>> {
        let base = |theta: f64| -> Vec<f32> {
            (0..head_dim / 2)
                .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32))
                .collect()
        };
        Ok(match &self.scaling {
            RopeScaling::Default => base(self.theta),
            RopeScaling::Linear { factor } => base(self.theta)
                .iter()
                .map(|f| f / *factor as f32)
                .collect(),
            RopeScaling::Dynamic {
                factor,
                original_max_position_embeddings,
            } => {
                let original = *original_max_position_embeddings as f64;
                let seq_len = (seq_len as f64).max(original);
                let dim = head_dim as f64;
                let grown = self.theta
                    * ((factor * seq_len / original) - (factor - 1.0)).powf(dim / (dim - 2.0));
                base(grown)
            }
            RopeScaling::Yarn(yarn) => yarn.inverse_frequencies(self.theta, head_dim),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => llama3(
                &base(self.theta),
                *factor as f32,
                *low_freq_factor as f32,
                *high_freq_factor as f32,
                *original_max_position_embeddings as f32,
            ),
            RopeScaling::FrequencyFactors(factors) => {
                if factors.len() != head_dim / 2 {
                    return Err(Error::Config(format!(
                        "rope_freqs has {} factors for {} frequency pairs (head_dim {head_dim})",
                        factors.len(),
                        head_dim / 2
                    )));
                }
                base(self.theta)
                    .iter()
                    .zip(factors)
                    .map(|(f, divisor)| f / divisor)
                    .collect()
            }
        })
    }

    /// llama.cpp's form of the scaling for a GGUF: the per-pair divisors of `rope_freqs.weight`
    /// (Llama 3.1 style scaling), `None` where the GGUF metadata keys carry it.
    pub fn frequency_factors(&self, head_dim: usize) -> Result<Option<Vec<f32>>> {
        Ok(match &self.scaling {
            RopeScaling::Llama3 { .. } => {
                let plain = RopeConfig {
                    theta: self.theta,
                    scaling: RopeScaling::Default,
                };
                let base = plain.inverse_frequencies(head_dim, 0)?;
                let scaled = self.inverse_frequencies(head_dim, 0)?;
                Some(base.iter().zip(&scaled).map(|(b, s)| b / s).collect())
            }
            RopeScaling::FrequencyFactors(factors) => Some(factors.clone()),
            _ => None,
        })
    }
}

/// Llama 3.1: wavelengths shorter than `original / high` kept, longer than `original / low`
/// divided by `factor`, smoothly mixed between.
fn llama3(base: &[f32], factor: f32, low: f32, high: f32, original: f32) -> Vec<f32> {
    let low_freq_wavelen = original / low;
    let high_freq_wavelen = original / high;
    base.iter()
        .map(|&freq| {
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_freq_wavelen {
                freq
            } else if wavelen > low_freq_wavelen {
                freq / factor
            } else {
                let smooth = (original / wavelen - low) / (high - low);
                (1.0 - smooth) * freq / factor + smooth * freq
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yarn_attention_factor_follows_the_paper_and_deepseek() {
        let mut yarn = YarnScaling::new(4.0, 8192);
        assert!((yarn.attention_factor() - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        yarn.mscale = Some(0.707);
        yarn.mscale_all_dim = Some(0.707);
        assert_eq!(yarn.attention_factor(), 1.0);
        yarn.attention_factor = Some(0.5);
        assert_eq!(yarn.attention_factor(), 0.5);
    }

    #[test]
    fn dynamic_ntk_keeps_the_base_up_to_its_threshold() {
        let config = RopeConfig {
            theta: 10000.0,
            scaling: RopeScaling::Dynamic {
                factor: 4.0,
                original_max_position_embeddings: 64,
            },
        };
        let plain = RopeConfig {
            theta: 10000.0,
            scaling: RopeScaling::Default,
        };
        let short = config.inverse_frequencies(16, 64).unwrap();
        assert_eq!(short, plain.inverse_frequencies(16, 64).unwrap());
        let long = config.inverse_frequencies(16, 128).unwrap();
        assert_eq!(long[0], short[0]);
        assert!(long[7] < short[7]);
    }

    #[test]
    fn written_json_reads_back_the_same() {
        for kind in EXTENSION_KINDS {
            let config = RopeConfig {
                theta: 100000.0,
                scaling: RopeScaling::extension(kind, 8192, 32768).unwrap(),
            };
            let parameters = config.parameters_json().unwrap();
            let back = RopeConfig::from_json(Some(&parameters), None, 8192).unwrap();
            assert_eq!(back, config, "{kind}");
            let scaling = config.scaling_json().unwrap();
            let back = RopeConfig::from_json(scaling.as_ref(), Some(100000.0), 8192).unwrap();
            assert_eq!(back, config, "{kind}");
        }
    }

    #[test]
    fn bad_kinds_are_one_line_errors() {
        let error = |json: Value| {
            RopeConfig::from_json(Some(&json), None, 2048)
                .unwrap_err()
                .to_string()
        };
        assert!(
            error(json!({"rope_type": "longrope", "factor": 2.0}))
                .contains("unsupported rope type \"longrope\"")
        );
        assert!(
            error(json!({"rope_type": "yarn", "factor": 4.0}))
                .contains("original_max_position_embeddings")
        );
        assert!(error(json!({"rope_type": "linear", "factor": -1.0})).contains("positive"));
        assert!(RopeScaling::extension("ntk", 10, 20).is_err());
    }
}
