//! `train --preset tiny`: everything a first run needs, made on the spot. A small random-init
//! Llama (written as a Hugging Face folder with a byte-level `tokenizer.json`, so `eval`,
//! `generate` and PEFT can load it too) and a corpus of generated stories with a regular grammar
//! that LoRA can learn in a few hundred steps.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use lemo_models::weights::{RandomWeights, WeightSource};
use lemo_models::{CausalLm, ModelConfig};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use safetensors::{Dtype, tensor::TensorView};
use serde_json::json;

/// The tiny model's `config.json`: 4 layers, width 128, grouped-query attention, trained
/// context 128 (the preset extends it to 256 with position interpolation).
pub fn tiny_config() -> serde_json::Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 259,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32"
    })
}

/// A byte-level tokenizer: `<unk>`, `<s>`, `</s>`, then the 256 bytes as `<0xHH>` (SentencePiece
/// byte fallback), BOS added in front as Llama's tokenizer does.
pub fn byte_tokenizer_json() -> serde_json::Value {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), json!(i));
    }
    for b in 0..256u32 {
        vocab.insert(format!("<0x{b:02X}>"), json!(b + 3));
    }
    let added = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [added(0, "<unk>"), added(1, "<s>"), added(2, "</s>")],
        "normalizer": null,
        "pre_tokenizer": null,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab, "merges": []
        }
    })
}

/// Records every tensor the model asks for, to write the random model as safetensors.
struct Recording<S> {
    inner: S,
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
}

impl<S: WeightSource> WeightSource for Recording<S> {
    fn fetch(&mut self, name: &str, shape: &[usize]) -> lemo_models::Result<Option<Vec<f32>>> {
        let values = self.inner.fetch(name, shape)?;
        if let Some(v) = &values {
            self.tensors
                .push((name.to_string(), shape.to_vec(), v.clone()));
        }
        Ok(values)
    }
}

/// Writes the random-init tiny model (config, weights, tokenizer) into `dir`.
pub fn write_tiny_model(dir: &Path, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let config_json = tiny_config();
    let config = ModelConfig::from_json(config_json.clone())?;
    let mut recording = Recording {
        inner: RandomWeights { std: 0.02, seed },
        tensors: Vec::new(),
    };
    CausalLm::<lemo_kernels::CpuBackend>::build(
        &config,
        &mut recording,
        &Default::default(),
        lemo_kernels::precision::Precision::F32,
    )?;
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = recording
        .tensors
        .into_iter()
        .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).expect("consistent view"),
            )
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let weights =
        safetensors::serialize(views, Some(metadata)).context("serializing the tiny model")?;
    // The weights last: their presence is what says the model is complete.
    lemo_models::adapter::write_atomically(
        &dir.join("config.json"),
        serde_json::to_string_pretty(&config_json)?.as_bytes(),
    )?;
    lemo_models::adapter::write_atomically(
        &dir.join("tokenizer.json"),
        serde_json::to_string(&byte_tokenizer_json())?.as_bytes(),
    )?;
    lemo_models::adapter::write_atomically(&dir.join("model.safetensors"), &weights)?;
    Ok(())
}

const NAMES: [&str; 8] = ["Mia", "Tom", "Lily", "Ben", "Anna", "Max", "Sara", "Leo"];
const ANIMALS: [&str; 6] = ["cat", "dog", "bird", "fox", "frog", "bear"];
const PLACES: [&str; 6] = ["park", "garden", "forest", "beach", "river", "hill"];
const THINGS: [&str; 6] = ["ball", "kite", "box", "hat", "book", "cake"];
const COLORS: [&str; 6] = ["red", "blue", "green", "yellow", "big", "small"];

/// A short story from a fixed grammar: names and objects recur within a story, so later
/// sentences are predictable from earlier ones (some use of context pays off).
pub fn story(rng: &mut StdRng) -> String {
    let pick = |rng: &mut StdRng, list: &[&'static str]| list[rng.random_range(0..list.len())];
    let (name, friend) = (pick(rng, &NAMES), pick(rng, &NAMES));
    let (animal, place, thing, color) = (
        pick(rng, &ANIMALS),
        pick(rng, &PLACES),
        pick(rng, &THINGS),
        pick(rng, &COLORS),
    );
    let mut s = format!("Once upon a time, {name} went to the {place} with a {animal}. ");
    for _ in 0..rng.random_range(2..5) {
        let sentence = match rng.random_range(0..4) {
            0 => format!("{name} saw a {color} {thing} near the {place}. "),
            1 => format!("The {animal} played with the {color} {thing}. "),
            2 => format!("{friend} came to the {place} and said hello to {name}. "),
            _ => format!("{name} and the {animal} were very happy. "),
        };
        s.push_str(&sentence);
    }
    s.push_str(&format!(
        "At the end of the day, {name} took the {color} {thing} home. The end.\n"
    ));
    s
}

/// Writes `count` generated stories as JSONL (`{"text": ...}`) to `path`.
pub fn write_stories(path: &Path, count: usize, seed: u64) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = String::new();
    for _ in 0..count {
        out.push_str(&serde_json::to_string(&json!({"text": story(&mut rng)}))?);
        out.push('\n');
    }
    lemo_models::adapter::write_atomically(path, out.as_bytes())?;
    Ok(())
}
