//! The tokenizer stored in a GGUF file's metadata, rebuilt as a Hugging Face tokenizer so the
//! `tokenizers` crate runs it: `tokenizer.ggml.model = gpt2` is byte-level BPE from the stored
//! tokens and merges, split first by the pre-tokenizer that `tokenizer.ggml.pre` names;
//! `llama` is SentencePiece-style BPE over the stored scores, with byte fallback. Control and
//! user-defined tokens are matched whole in the text, as llama.cpp does with special parsing on.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Value as Json, json};

use super::{GgufFile, Value};
use crate::tokenizer::huggingface::HuggingFaceTokenizer;
use crate::tokenizer::llama2c::{
    LLAMA2C_BOS_ID, LLAMA2C_BYTE_TOKEN_OFFSET, LLAMA2C_EOS_ID, Llama2cTokenizer,
};
use crate::{Error, Result};

/// GPT-2's split of text into words, contractions, numbers, punctuation runs and spaces.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's split: case-insensitive contractions, numbers of at most three digits, and line
/// breaks kept with the punctuation or spaces before them.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// SentencePiece's visible space.
const SPM_SPACE: &str = "\u{2581}";

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const TOKEN_TYPE_NORMAL: i64 = 1;
const TOKEN_TYPE_UNKNOWN: i64 = 2;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;
const TOKEN_TYPE_BYTE: i64 = 6;

/// Tokenizer metadata (`tokenizer.*` keys of a GGUF file, or built for one), with the path its
/// errors name.
pub struct Metadata<'a> {
    pub values: &'a HashMap<String, Value>,
    pub path: &'a Path,
}

impl Metadata<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.values.get(key)
    }

    fn error(&self, message: impl Into<String>) -> Error {
        Error::format(self.path, message)
    }

    fn token_id(&self, key: &str) -> Option<u32> {
        self.get(key)
            .and_then(Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
    }
}

/// llama.cpp's tokenizer metadata for a llama2.c vocabulary: SentencePiece-style BPE (`llama`)
/// over its pieces and scores, `<unk>`, BOS and EOS at ids 0-2 and the byte pieces after them,
/// BOS added and a space put before the text, as `run.c` encodes.
pub fn llama2c_metadata(tokenizer: &Llama2cTokenizer) -> HashMap<String, Value> {
    let byte_ids = LLAMA2C_BYTE_TOKEN_OFFSET..LLAMA2C_BYTE_TOKEN_OFFSET + 256;
    let (mut tokens, mut scores, mut types) = (Vec::new(), Vec::new(), Vec::new());
    for (id, (piece, score)) in (0u32..).zip(tokenizer.vocabulary()) {
        let piece = String::from_utf8_lossy(piece).replace(' ', SPM_SPACE);
        let kind = match id {
            0 => TOKEN_TYPE_UNKNOWN,
            LLAMA2C_BOS_ID | LLAMA2C_EOS_ID => TOKEN_TYPE_CONTROL,
            _ if byte_ids.contains(&id) => TOKEN_TYPE_BYTE,
            _ => TOKEN_TYPE_NORMAL,
        };
        tokens.push(Value::String(piece));
        scores.push(Value::F32(score));
        types.push(Value::I32(kind as i32));
    }
    [
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens)),
        ("tokenizer.ggml.scores", Value::Array(scores)),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
        ("tokenizer.ggml.bos_token_id", Value::U32(LLAMA2C_BOS_ID)),
        ("tokenizer.ggml.eos_token_id", Value::U32(LLAMA2C_EOS_ID)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
        ("tokenizer.ggml.add_eos_token", Value::Bool(false)),
        ("tokenizer.ggml.add_space_prefix", Value::Bool(true)),
    ]
    .into_iter()
    .map(|(key, value)| (key.to_string(), value))
    .collect()
}

/// Reads the tokenizer of the GGUF file at `path`.
pub fn from_gguf(path: &Path) -> Result<HuggingFaceTokenizer> {
    let file = GgufFile::open(path)?;
    let meta = Metadata {
        values: &file.header.metadata,
        path,
    };
    let spec = tokenizer_json(&meta)?;
    let inner = tokenizers::Tokenizer::from_bytes(spec.to_string().as_bytes())
        .map_err(|e| meta.error(format!("cannot build the tokenizer from the metadata: {e}")))?;
    Ok(HuggingFaceTokenizer::from_parts(
        path,
        inner,
        meta.token_id("tokenizer.ggml.bos_token_id"),
        meta.token_id("tokenizer.ggml.eos_token_id"),
    ))
}

/// The Hugging Face `tokenizer.json` that runs the tokenizer `meta` describes.
pub fn tokenizer_json(meta: &Metadata) -> Result<Json> {
    let model = metadata_str(meta, "tokenizer.ggml.model")?;
    let tokens: Vec<&str> = string_array(meta, "tokenizer.ggml.tokens")?
        .ok_or_else(|| meta.error("no tokenizer.ggml.tokens in the metadata"))?;
    let token_types: Vec<i64> = match meta.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(value) => value
            .as_array()
            .filter(|types| types.len() == tokens.len())
            .and_then(|types| types.iter().map(integer).collect::<Option<Vec<_>>>())
            .ok_or_else(|| meta.error("tokenizer.ggml.token_type is not one integer per token"))?,
    };
    let flag = |key: &str| meta.get(key).and_then(Value::as_bool);
    let bos_id = meta.token_id("tokenizer.ggml.bos_token_id");
    let eos_id = meta.token_id("tokenizer.ggml.eos_token_id");
    let (add_bos, add_eos) = (
        flag("tokenizer.ggml.add_bos_token"),
        flag("tokenizer.ggml.add_eos_token").unwrap_or(false),
    );

    let (mut spec, add_bos_default) = match model {
        "gpt2" => gpt2_spec(meta, &tokens)?,
        "llama" => (
            sentencepiece_spec(meta, &tokens)?,
            // llama.cpp adds BOS for SentencePiece vocabularies unless told otherwise.
            true,
        ),
        other => {
            return Err(meta.error(format!(
                "tokenizer.ggml.model {other:?} is not supported: lemo reads gpt2 and llama"
            )));
        }
    };
    spec["added_tokens"] = added_tokens(&tokens, &token_types);
    let framing = |add: bool, id: Option<u32>| add.then_some(id).flatten();
    spec["post_processor"] = post_processor(
        &tokens,
        framing(add_bos.unwrap_or(add_bos_default), bos_id),
        framing(add_eos, eos_id),
    );
    Ok(spec)
}

fn metadata_str<'a>(meta: &'a Metadata, key: &str) -> Result<&'a str> {
    meta.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| meta.error(format!("no {key} in the metadata")))
}

/// A metadata array of strings; `None` when the key is absent.
fn string_array<'a>(meta: &'a Metadata, key: &str) -> Result<Option<Vec<&'a str>>> {
    let Some(value) = meta.get(key) else {
        return Ok(None);
    };
    value
        .as_array()
        .and_then(|values| values.iter().map(Value::as_str).collect::<Option<Vec<_>>>())
        .map(Some)
        .ok_or_else(|| meta.error(format!("{key} is not an array of strings")))
}

fn integer(value: &Value) -> Option<i64> {
    match *value {
        Value::I32(v) => Some(v.into()),
        Value::I64(v) => Some(v),
        _ => value.as_u64().and_then(|v| i64::try_from(v).ok()),
    }
}

fn vocab_json(tokens: &[&str]) -> Json {
    Json::Object(
        tokens
            .iter()
            .enumerate()
            .rev() // the first of duplicate spellings keeps its id, as llama.cpp's lookup does
            .map(|(id, token)| (token.to_string(), json!(id)))
            .collect(),
    )
}

/// Byte-level BPE; the pre-tokenizer is chosen by name, as llama.cpp chooses its regexes. Also
/// says whether BOS is added when the metadata does not say (llama.cpp adds it for Llama 3).
fn gpt2_spec(meta: &Metadata, tokens: &[&str]) -> Result<(Json, bool)> {
    let merges = string_array(meta, "tokenizer.ggml.merges")?
        .ok_or_else(|| meta.error("a gpt2 tokenizer needs tokenizer.ggml.merges"))?;
    let pre = meta
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("gpt-2");
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    let is_llama3 = matches!(pre, "llama-bpe" | "llama3");
    let (pre_tokenizer, ignore_merges) = match pre {
        "gpt-2" | "gpt2" => (
            split_then_bytes(split(GPT2_PATTERN), byte_level(false)),
            false,
        ),
        // Every digit on its own, then GPT-2's split.
        "smollm" | "starcoder" | "refact" => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                split(GPT2_PATTERN),
                byte_level(false),
            ]}),
            false,
        ),
        // A word that is itself a token is taken whole, before any merge.
        _ if is_llama3 => (
            split_then_bytes(split(LLAMA3_PATTERN), byte_level(false)),
            true,
        ),
        other => {
            return Err(meta.error(format!(
                "tokenizer.ggml.pre {other:?} is not supported: lemo reads gpt-2, smollm, starcoder, refact and llama-bpe"
            )));
        }
    };
    let spec = json!({
        "version": "1.0",
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "decoder": byte_level(true),
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": ignore_merges,
            "vocab": vocab_json(tokens),
            "merges": merges,
        },
    });
    Ok((spec, is_llama3))
}

fn split_then_bytes(split: Json, bytes: Json) -> Json {
    json!({"type": "Sequence", "pretokenizers": [split, bytes]})
}

/// SentencePiece-style BPE: spaces become `▁` (one put before the text too, unless
/// `tokenizer.ggml.add_space_prefix` is false), and the adjacent pair whose concatenation is the
/// highest-scoring token merges first. `tokenizers` ranks merges instead, so every way of
/// splitting a token into two tokens becomes a merge ranked by the token's score.
fn sentencepiece_spec(meta: &Metadata, tokens: &[&str]) -> Result<Json> {
    let scores: Vec<f64> = meta
        .get("tokenizer.ggml.scores")
        .and_then(Value::as_array)
        .filter(|scores| scores.len() == tokens.len())
        .and_then(|scores| scores.iter().map(Value::as_f64).collect())
        .ok_or_else(|| meta.error("a llama tokenizer needs one tokenizer.ggml.scores per token"))?;
    let add_space_prefix = meta
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let unk = meta
        .token_id("tokenizer.ggml.unknown_token_id")
        .unwrap_or(0) as usize;
    let id_of: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .rev()
        .map(|(id, token)| (*token, id))
        .collect();
    let mut merges = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        for (split, _) in token.char_indices().skip(1) {
            let (left, right) = token.split_at(split);
            if id_of.contains_key(left) && id_of.contains_key(right) {
                merges.push((-scores[id], id, split, left, right));
            }
        }
    }
    merges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Vec<[&str; 2]> = merges.iter().map(|m| [m.3, m.4]).collect();
    let mut normalizers = Vec::new();
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space_prefix {
        normalizers.push(json!({"type": "Prepend", "prepend": SPM_SPACE}));
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": SPM_SPACE}));
    Ok(json!({
        "version": "1.0",
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": tokens.get(unk),
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": true,
            "byte_fallback": true,
            "ignore_merges": false,
            "vocab": vocab_json(tokens),
            "merges": merges,
        },
    }))
}

/// Control tokens (special: left out when decoding) and user-defined tokens, matched whole.
fn added_tokens(tokens: &[&str], token_types: &[i64]) -> Json {
    Json::Array(
        tokens
            .iter()
            .zip(token_types)
            .enumerate()
            .filter(|(_, (_, kind))| [TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED].contains(kind))
            .map(|(id, (token, kind))| {
                json!({
                    "id": id,
                    "content": token,
                    "single_word": false,
                    "lstrip": false,
                    "rstrip": false,
                    "normalized": false,
                    "special": *kind == TOKEN_TYPE_CONTROL,
                })
            })
            .collect(),
    )
}

/// BOS before and EOS after each encoded text, where the metadata asks for them.
fn post_processor(tokens: &[&str], bos: Option<u32>, eos: Option<u32>) -> Json {
    let framing: Vec<(u32, &str)> = [bos, eos]
        .into_iter()
        .flatten()
        .filter_map(|id| tokens.get(id as usize).map(|token| (id, *token)))
        .collect();
    if framing.is_empty() {
        return Json::Null;
    }
    let special = |id: Option<u32>| {
        id.and_then(|id| tokens.get(id as usize))
            .map(|token| json!({"SpecialToken": {"id": token, "type_id": 0}}))
    };
    let sequence = |name: &str| json!({"Sequence": {"id": name, "type_id": 0}});
    let single: Vec<Json> = special(bos)
        .into_iter()
        .chain([sequence("A")])
        .chain(special(eos))
        .collect();
    let pair: Vec<Json> = single
        .iter()
        .cloned()
        .chain(special(bos))
        .chain([sequence("B")])
        .chain(special(eos))
        .collect();
    let special_tokens: serde_json::Map<String, Json> = framing
        .iter()
        .map(|(id, token)| {
            (
                token.to_string(),
                json!({"id": token, "ids": [id], "tokens": [token]}),
            )
        })
        .collect();
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens})
}
