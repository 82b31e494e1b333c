//! `merge`: folds a PEFT adapter into its base model and writes a Hugging Face folder
//! (`config.json`, safetensors weights, tokenizer), optionally a GGUF file too. The merge runs on
//! the host one tensor at a time (see `lemo_models::merge`), so any model the disk holds merges.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use lemo_models::adapter::write_atomically;
use lemo_models::config::{LlamaConfig, RopeConfig};
use lemo_models::export::{self, INDEX_FILE, SINGLE_FILE};
use lemo_models::gguf::tokenizer::{Metadata, llama2c_metadata, tokenizer_json};
use lemo_models::gguf::{self, GgufFile, GgufPrecision, Value};
use lemo_models::merge::AdapterWeights;
use lemo_models::model::{ModelFormat, open_checkpoint};
use lemo_models::quantized::{QuantFormat, QuantizeBase};
use lemo_models::tokenizer::Tokenizer;
use lemo_models::weights::StoredTensor;
use lemo_models::{Error, ModelConfig};
use serde_json::{Value as Json, json};

use crate::data::find_tokenizer;
use crate::device::PrecisionKind;
use crate::modelio::ModelSetup;

/// Tokenizer files of a Hugging Face folder, copied as they are.
const TOKENIZER_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GgufKind {
    F16,
    #[value(name = "q8_0")]
    Q8_0,
}

#[derive(Debug, Args)]
pub struct MergeArgs {
    /// The base model the adapter was trained on: Hugging Face folder, llama2.c .bin checkpoint
    /// or .gguf file.
    #[arg(long)]
    model: PathBuf,
    /// PEFT adapter folder (written by `train`, or by PEFT).
    #[arg(long)]
    adapter: PathBuf,
    /// Folder for the merged Hugging Face model (created; refused if it holds files).
    #[arg(long)]
    out: PathBuf,
    /// Also write the merged model as a GGUF file (DIR/model-f16.gguf or DIR/model-q8_0.gguf).
    #[arg(long, value_enum)]
    gguf: Option<GgufKind>,
    /// Linear RoPE position interpolation for this context in the merged config (overrides the
    /// scaling recorded with the adapter).
    #[arg(long)]
    target_context: Option<usize>,
    /// Largest safetensors file in MB; larger models are sharded with an index.
    #[arg(long, default_value_t = 5000.0)]
    max_shard_mb: f64,
    /// Replace the merged-model files of an --out folder that holds files.
    #[arg(long)]
    overwrite: bool,
}

/// Merges as `args` say; returns the output folder.
pub fn run(args: MergeArgs) -> Result<PathBuf> {
    crate::modelio::require_model(&args.model)?;
    crate::modelio::check_target_context(args.target_context)?;
    if !args.adapter.is_dir() {
        bail!(
            "--adapter {}: no such adapter folder",
            args.adapter.display()
        );
    }
    if args.max_shard_mb.is_nan() || args.max_shard_mb <= 0.0 {
        bail!("--max-shard-mb must be positive");
    }
    let format = ModelFormat::detect(&args.model)?;
    let (config, mut checkpoint) = open_checkpoint(&args.model)?;
    let tensors = checkpoint.tensors();
    let adapter = AdapterWeights::read(&args.adapter)
        .with_context(|| format!("adapter {}", args.adapter.display()))?;
    adapter.check_against(&tensors)?;
    let rope = trained_rope(&args, &config)?;
    let llama = match (&config, args.gguf) {
        (ModelConfig::Llama(c), _) => Some(with_rope(c, rope.as_ref())),
        (ModelConfig::Opt(_), Some(_)) => bail!("--gguf: GGUF export covers Llama models, not OPT"),
        (ModelConfig::Opt(_), None) => None,
    };
    crate::modelio::check_output("--out", &args.out, &[&args.model, &args.adapter])?;
    prepare_out(&args.out, args.overwrite)?;
    eprintln!(
        "merge: {} + adapter {} (rank {}, alpha {}, {:?}{}){}",
        args.model.display(),
        args.adapter.display(),
        adapter.config.rank,
        adapter.config.alpha,
        adapter.config.target_modules,
        if adapter.config.train_embeddings || adapter.config.train_norms {
            ", trained embeddings/norms"
        } else {
            ""
        },
        rope.as_ref().map_or(String::new(), |r| format!(
            ", RoPE {} x{} theta {}",
            r.scaling.name(),
            r.scaling.factor(),
            r.theta
        ))
    );

    let mut merged = |tensor: &StoredTensor| -> lemo_models::Result<Vec<f32>> {
        let mut values = checkpoint
            .fetch(&tensor.name, &tensor.shape)?
            .expect("listed tensors are present");
        adapter.apply(&tensor.name, &mut values);
        Ok(values)
    };
    let max_shard_bytes = (args.max_shard_mb * 1e6) as u64;
    export::write_safetensors(&args.out, &tensors, max_shard_bytes, &mut merged, report)?;
    if let ModelFormat::Gguf = format
        && let Some(note) = quantized_base_note(&GgufFile::open(&args.model)?, &tensors)
    {
        eprintln!("merge: {note}");
    }

    let tokenizer = write_tokenizer(&args.model, &format, &args.out)?;
    let config_json = match (&format, &llama) {
        (ModelFormat::HuggingFace, _) => patched_config(&args.model, &config, rope.as_ref())?,
        (_, Some(llama)) => export::llama_config_json(llama, export::torch_dtype(&tensors))?,
        (_, None) => unreachable!("llama2.c and GGUF bases are Llama models"),
    };
    let path = args.out.join("config.json");
    write_atomically(
        &path,
        serde_json::to_string_pretty(&config_json)?.as_bytes(),
    )?;
    report(&path);

    if let (Some(kind), Some(llama)) = (args.gguf, &llama) {
        let (precision, suffix) = match kind {
            GgufKind::F16 => (GgufPrecision::F16, "f16"),
            GgufKind::Q8_0 => (GgufPrecision::Q8_0, "q8_0"),
        };
        // llama.cpp loads a file without a vocabulary when the model type says `none`.
        let tokenizer = tokenizer.unwrap_or_else(|| {
            eprintln!("merge: no tokenizer to put in the GGUF file (see the README)");
            HashMap::from([("tokenizer.ggml.model".into(), Value::String("none".into()))])
        });
        let path = args.out.join(format!("model-{suffix}.gguf"));
        let name = args
            .out
            .file_name()
            .map_or("merged".into(), |n| n.to_string_lossy().into_owned());
        gguf::write_llama(
            &path,
            &name,
            llama,
            &tokenizer,
            &tensors,
            precision,
            &mut merged,
        )?;
        report(&path);
    }
    Ok(args.out)
}

/// What merging into a quantized GGUF base does to its blocks, and the precision written.
fn quantized_base_note(base: &GgufFile, tensors: &[StoredTensor]) -> Option<String> {
    let types: BTreeSet<String> = base
        .header
        .tensors
        .values()
        .filter(|info| QuantFormat::keeps(info.ggml_type))
        .map(|info| format!("{:?}", info.ggml_type))
        .collect();
    (!types.is_empty()).then(|| {
        format!(
            "the base's {} blocks were dequantized to fold the adapter in: the merged weights \
             are written in {} (--gguf q8_0 requantizes them)",
            types.into_iter().collect::<Vec<_>>().join(", "),
            export::torch_dtype(tensors)
        )
    })
}

fn report(path: &Path) {
    let size = std::fs::metadata(path).map_or(0, |m| m.len());
    eprintln!(
        "merge: wrote {} ({:.1} MB)",
        path.display(),
        size as f64 / 1e6
    );
}

/// The RoPE frequencies the merged model runs with: `--target-context`'s, else the ones
/// recorded with the adapter, as `eval --adapter` applies them.
fn trained_rope(args: &MergeArgs, config: &ModelConfig) -> Result<Option<RopeConfig>> {
    let setup = ModelSetup {
        adapter: Some(args.adapter.clone()),
        target_context: args.target_context,
        precision: PrecisionKind::F32,
        quantize_base: QuantizeBase::None,
    };
    Ok(setup.rope(config)?.map(|(rope, _)| rope))
}

/// `config` running at `rope`, with the context it addresses then.
fn with_rope(config: &LlamaConfig, rope: Option<&RopeConfig>) -> LlamaConfig {
    let mut config = config.clone();
    if let Some(rope) = rope {
        config.max_position_embeddings = rope.config_context(config.max_position_embeddings);
        config.rope = rope.clone();
    }
    config
}

/// A new or empty `--out`, or with `--overwrite` one whose earlier merged-model files are removed
/// (stale shards would otherwise sit beside the new ones); nothing else in it is touched.
fn prepare_out(out: &Path, overwrite: bool) -> Result<()> {
    let entries: Vec<PathBuf> = match std::fs::read_dir(out) {
        Ok(entries) => entries.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(_) => Vec::new(),
    };
    if !entries.is_empty() && !overwrite {
        bail!(
            "--out {} already holds files: pass --overwrite to replace the merged model there",
            out.display()
        );
    }
    for path in entries {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let ours = name.is_some_and(|n| {
            n == SINGLE_FILE
                || n == INDEX_FILE
                || (n.starts_with("model-") && n.ends_with(".safetensors"))
                || (n.starts_with("model-") && n.ends_with(".gguf"))
        });
        if ours {
            std::fs::remove_file(&path)
                .with_context(|| format!("--overwrite: cannot remove {}", path.display()))?;
        }
    }
    std::fs::create_dir_all(out)
        .with_context(|| format!("cannot create --out {}", out.display()))?;
    Ok(())
}

/// The base's own `config.json` with the RoPE frequencies the adapter was trained with and the
/// context they address, in the spelling the file uses.
fn patched_config(model: &Path, config: &ModelConfig, rope: Option<&RopeConfig>) -> Result<Json> {
    let path = model.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let mut json: Json = serde_json::from_str(&text)
        .map_err(|e| Error::format(&path, format!("invalid JSON: {e}")))?;
    if let Some(rope) = rope {
        let context = rope.config_context(config.max_position_embeddings());
        export::set_rope(&mut json, rope, context)?;
    }
    Ok(json)
}

/// Writes the merged folder's tokenizer: a Hugging Face base's files copied; for a llama2.c or
/// GGUF base, the `tokenizer.json` lemo builds from the GGUF metadata or the llama2.c vocabulary.
/// Returns the tokenizer as GGUF metadata where lemo has it in that form (GGUF and llama2.c
/// bases), for `--gguf`.
fn write_tokenizer(
    model: &Path,
    format: &ModelFormat,
    out: &Path,
) -> Result<Option<HashMap<String, Value>>> {
    let (source, metadata) = match format {
        ModelFormat::HuggingFace => {
            for name in TOKENIZER_FILES {
                let source = model.join(name);
                if source.is_file() {
                    let bytes = std::fs::read(&source).map_err(|e| Error::io(&source, e))?;
                    write_atomically(&out.join(name), &bytes)?;
                    report(&out.join(name));
                }
            }
            return Ok(None);
        }
        ModelFormat::Gguf => {
            let file = GgufFile::open(model)?;
            let metadata: HashMap<String, Value> = file
                .header
                .metadata
                .into_iter()
                .filter(|(key, _)| key.starts_with("tokenizer."))
                .collect();
            (model.to_path_buf(), metadata)
        }
        ModelFormat::Llama2c => match find_tokenizer(model) {
            Some(path) => match Tokenizer::from_file(&path)? {
                Tokenizer::Llama2c(tokenizer) => (path, llama2c_metadata(&tokenizer)),
                Tokenizer::HuggingFace(_) => return Ok(None),
            },
            None => {
                eprintln!("merge: no tokenizer.bin beside the checkpoint: none written");
                return Ok(None);
            }
        },
    };
    let spec = tokenizer_json(&Metadata {
        values: &metadata,
        path: &source,
    })?;
    let path = out.join("tokenizer.json");
    write_atomically(&path, spec.to_string().as_bytes())?;
    report(&path);
    let path = out.join("tokenizer_config.json");
    let config = tokenizer_config(&spec, &metadata);
    write_atomically(&path, serde_json::to_string_pretty(&config)?.as_bytes())?;
    report(&path);
    Ok(Some(metadata))
}

/// A `tokenizer_config.json` naming the special tokens of a built `tokenizer.json`, so that
/// transformers' `AutoTokenizer` finds BOS and EOS.
fn tokenizer_config(spec: &Json, metadata: &HashMap<String, Value>) -> Json {
    let vocab = spec["model"]["vocab"].as_object();
    let spelling = |key: &str| -> Json {
        let id = metadata.get(key).and_then(Value::as_u64);
        vocab
            .and_then(|v| v.iter().find(|(_, i)| i.as_u64() == id && id.is_some()))
            .map_or(Json::Null, |(token, _)| json!(token))
    };
    let flag = |key: &str| metadata.get(key).and_then(Value::as_bool);
    json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spelling("tokenizer.ggml.bos_token_id"),
        "eos_token": spelling("tokenizer.ggml.eos_token_id"),
        "unk_token": spelling("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": flag("tokenizer.ggml.add_bos_token"),
        "add_eos_token": flag("tokenizer.ggml.add_eos_token"),
    })
}
