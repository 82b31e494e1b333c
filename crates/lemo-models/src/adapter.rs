//! LoRA adapters in Hugging Face PEFT's folder layout: `adapter_config.json` plus
//! `adapter_model.safetensors` with keys `base_model.model.{module}.lora_A.weight` (`[r, in]`)
//! and `...lora_B.weight` (`[out, r]`), so PEFT loads what lemo writes and the reverse.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use burn::tensor::{Tensor, TensorData};
use lemo_kernels::LemoBackend;
use safetensors::{Dtype, tensor::TensorView};
use serde_json::{Value, json};

use crate::lora::LoraConfig;
use crate::model::CausalLm;
use crate::weights::{SafetensorsWeights, WeightSource};
use crate::{Error, Result};

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// What PEFT puts before every key: `base_model.model.{module}...`.
pub(crate) const PREFIX: &str = "base_model.model";

/// Writes `bytes` to `path` so that a reader (or a crash) sees the old file or the new one,
/// never a part (see [`write_atomically_with`]).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically_with(path, |file| {
        file.write_all(bytes).map_err(|e| Error::write(path, e))
    })
}

/// Writes `path` through `write`, atomically: the bytes go to a temporary file in the same folder
/// (a rename is atomic only within one file system), are flushed to disk, and the temporary is
/// renamed over `path`; the folder is flushed too, so the rename itself survives a power loss.
/// `write` may stream a file larger than memory; if it fails, the temporary is removed.
pub fn write_atomically_with(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> Result<()>,
) -> Result<()> {
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| Error::Config(format!("{} is not a file path", path.display())))?;
    let temporary = folder.join(format!(
        ".{}.{}.partial",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = std::fs::File::create(&temporary)
        .map_err(|e| Error::write(&temporary, e))
        .and_then(|file| {
            let mut out = std::io::BufWriter::new(file);
            write(&mut out)?;
            let file = out
                .into_inner()
                .map_err(|e| Error::write(&temporary, e.into_error()))?;
            file.sync_all().map_err(|e| Error::write(&temporary, e))
        });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&temporary);
        return Err(e);
    }
    std::fs::rename(&temporary, path).map_err(|e| Error::write(path, e))?;
    sync_folder(folder);
    Ok(())
}

/// Flushes a folder's entries (new names, renames) to disk; best effort, as some file systems
/// cannot open folders for it.
pub fn sync_folder(folder: &Path) {
    if let Ok(dir) = std::fs::File::open(folder) {
        let _ = dir.sync_all();
    }
}

/// Refuses adapter values that are not finite: a diverged run's adapter is neither written nor
/// applied (merged, evaluated) as if it were one.
pub(crate) fn check_finite(path: &Path, name: &str, values: &[f32]) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(at) => Err(Error::format(
            path,
            format!(
                "{name} holds {} at index {at}: the adapter diverged",
                values[at]
            ),
        )),
        None => Ok(()),
    }
}

/// The `adapter_config.json` PEFT expects for `config`.
pub fn peft_config_json(config: &LoraConfig, base_model: &str) -> Value {
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": config.target_modules,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": modules_to_save(config),
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
    })
}

/// PEFT's `modules_to_save` for the non-LoRA weights `config` trains (LongLoRA), or null. The
/// order matters to PEFT, which matches these names as substrings of the saved keys.
fn modules_to_save(config: &LoraConfig) -> Value {
    let mut names = Vec::new();
    if config.train_embeddings {
        names.push("embed_tokens");
    }
    if config.train_norms {
        names.extend(["input_layernorm", "post_attention_layernorm", "norm"]);
    }
    if names.is_empty() {
        Value::Null
    } else {
        json!(names)
    }
}

/// Reads the LoRA settings of a PEFT `adapter_config.json`.
pub fn read_peft_config(dir: &Path) -> Result<LoraConfig> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| Error::format(&path, format!("invalid JSON: {e}")))?;
    let bad = |message: String| Error::format(&path, message);
    if json.get("peft_type").and_then(Value::as_str) != Some("LORA") {
        return Err(bad("not a LoRA adapter (peft_type must be \"LORA\")".into()));
    }
    for unsupported in ["use_rslora", "use_dora"] {
        if json.get(unsupported).and_then(Value::as_bool) == Some(true) {
            return Err(bad(format!("{unsupported} adapters are not supported")));
        }
    }
    for pattern in ["rank_pattern", "alpha_pattern"] {
        if json
            .get(pattern)
            .and_then(Value::as_object)
            .is_some_and(|o| !o.is_empty())
        {
            return Err(bad(format!("per-module {pattern} is not supported")));
        }
    }
    let rank = json
        .get("r")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("missing \"r\"".into()))? as usize;
    let target_modules = match json.get("target_modules") {
        Some(Value::Array(names)) => names
            .iter()
            .filter_map(Value::as_str)
            .map(String::from)
            .collect(),
        Some(Value::String(name)) => vec![name.clone()],
        _ => return Err(bad("missing \"target_modules\"".into())),
    };
    let saved: Vec<&str> = json
        .get("modules_to_save")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    Ok(LoraConfig {
        train_embeddings: saved.contains(&"embed_tokens"),
        train_norms: saved.iter().any(|m| m.ends_with("norm")),
        rank,
        alpha: json
            .get("lora_alpha")
            .and_then(Value::as_f64)
            .unwrap_or(8.0),
        dropout: json
            .get("lora_dropout")
            .and_then(Value::as_f64)
            .unwrap_or(0.0),
        target_modules,
    })
}

impl<B: LemoBackend> CausalLm<B> {
    /// Writes this model's adapters as a PEFT folder (created if needed).
    pub fn save_adapter(&self, dir: &Path, config: &LoraConfig, base_model: &str) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut model = self.clone();
        for (name, linear) in model.projections_mut() {
            if let Some(lora) = &linear.lora {
                for (part, param) in [("lora_A", &lora.a), ("lora_B", &lora.b)] {
                    let value = param.val();
                    let shape = value.dims().to_vec();
                    let values: Vec<f32> = value
                        .into_data()
                        .convert::<f32>()
                        .into_vec()
                        .expect("f32 data");
                    let key = format!("{PREFIX}.{name}.{part}.weight");
                    check_finite(&dir.join(WEIGHTS_FILE), &key, &values)?;
                    let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                    tensors.push((key, shape, bytes));
                }
            }
        }
        if tensors.is_empty() {
            return Err(Error::Config(
                "the model has no LoRA adapters to save".into(),
            ));
        }
        for (name, shape, values) in self.extra_trainable_weights(config) {
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.push((format!("{PREFIX}.{name}"), shape, bytes));
        }
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(name, shape, bytes)| {
                (
                    name.clone(),
                    TensorView::new(Dtype::F32, shape.clone(), bytes).expect("consistent view"),
                )
            })
            .collect();
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        let bytes = safetensors::serialize(views, Some(metadata))
            .map_err(|e| Error::format(&dir.join(WEIGHTS_FILE), e.to_string()))?;
        write_atomically(&dir.join(WEIGHTS_FILE), &bytes)?;
        let config_json = serde_json::to_string_pretty(&peft_config_json(config, base_model))
            .expect("valid JSON");
        write_atomically(&dir.join(CONFIG_FILE), config_json.as_bytes())
    }

    /// Attaches the adapters of a PEFT folder; returns the adapter's LoRA settings.
    pub fn load_adapter(mut self, dir: &Path) -> Result<(Self, LoraConfig)> {
        let config = read_peft_config(dir)?;
        let weights_path = dir.join(WEIGHTS_FILE);
        let mut weights = SafetensorsWeights::open(&weights_path)?;
        let mut attached = 0;
        for (name, linear) in self.projections_mut() {
            let key = |part: &str| format!("{PREFIX}.{name}.{part}.weight");
            let (a_shape, b_shape) = (
                [config.rank, linear.in_features()],
                [linear.out_features(), config.rank],
            );
            let a = weights.fetch(&key("lora_A"), &a_shape)?;
            let b = weights.fetch(&key("lora_B"), &b_shape)?;
            match (a, b) {
                (Some(a), Some(b)) => {
                    check_finite(&weights_path, &key("lora_A"), &a)?;
                    check_finite(&weights_path, &key("lora_B"), &b)?;
                    let device = linear.weight.device();
                    let a = Tensor::from_data(TensorData::new(a, a_shape), &device);
                    let b = Tensor::from_data(TensorData::new(b, b_shape), &device);
                    *linear = linear.clone().with_lora(a, b, &config);
                    attached += 1;
                }
                (None, None) => {}
                _ => {
                    return Err(Error::format(
                        &weights_path,
                        format!("{name} has only one of lora_A/lora_B"),
                    ));
                }
            }
        }
        if attached == 0 {
            return Err(Error::format(
                &weights_path,
                "no LoRA weights match this model's projections",
            ));
        }
        if config.train_embeddings || config.train_norms {
            struct Prefixed<'a>(&'a mut SafetensorsWeights);
            impl WeightSource for Prefixed<'_> {
                fn fetch(&mut self, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>> {
                    let key = format!("{PREFIX}.{name}");
                    if self.0.contains(&key) {
                        self.0.fetch(&key, shape)
                    } else {
                        Ok(None)
                    }
                }
            }
            self.set_extra_weights(&mut Prefixed(&mut weights))?;
        }
        Ok((self, config))
    }
}
