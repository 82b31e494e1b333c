//! Reading token documents (plain text, JSONL with `text`, `input_ids` or chat records, raw
//! token files), packing them into sequences ([`corpus`]), and token batches as tensors.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use lemo_models::ModelConfig;
use lemo_models::tokenizer::Tokenizer;

pub use corpus::Sequence;

mod cache;
pub mod chat;
pub mod corpus;

use chat::{LazyChatTemplate, chat_document, is_chat_record};

/// One document's tokens; a chat record's also say which tokens are the assistant's.
#[derive(Debug, Clone, PartialEq)]
pub struct Document {
    pub tokens: Vec<u32>,
    /// Per token: part of an assistant turn. `None` for plain text and token ids.
    pub assistant: Option<Vec<bool>>,
}

impl Document {
    pub fn plain(tokens: Vec<u32>) -> Self {
        Self {
            tokens,
            assistant: None,
        }
    }
}

/// Byte width of each token id in a raw `.bin` token file (little-endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenWidth {
    U16,
    U32,
}

impl TokenWidth {
    pub fn from_bytes(bytes: u8) -> Result<Self> {
        match bytes {
            2 => Ok(TokenWidth::U16),
            4 => Ok(TokenWidth::U32),
            other => bail!("--token-width must be 2 or 4, not {other}"),
        }
    }
}

/// A UTF-8 text file, without the byte-order mark some editors put first.
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{}: not UTF-8 text (byte {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    })
}

/// A tokenizer loaded on first use, so data that is already tokens needs none.
pub struct LazyTokenizer {
    path: Option<PathBuf>,
    loaded: Option<Tokenizer>,
}

impl LazyTokenizer {
    pub fn new(path: Option<PathBuf>) -> Self {
        Self { path, loaded: None }
    }

    /// The tokenizer file, loaded or not.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    pub fn get(&mut self) -> Result<&Tokenizer> {
        if self.loaded.is_none() {
            let path = self.path.as_ref().context(
                "this data is text and needs a tokenizer: pass --tokenizer (none was found beside the model)",
            )?;
            self.loaded = Some(Tokenizer::from_file(path)?);
        }
        Ok(self.loaded.as_ref().expect("loaded above"))
    }
}

/// One document per non-empty line: `input_ids` used as given, `text` tokenized, or a chat
/// record (`messages`, or `prompt` / `completion`) rendered with the model's chat template.
pub fn read_jsonl(
    path: &Path,
    tokenizer: &mut LazyTokenizer,
    chat: &mut LazyChatTemplate,
) -> Result<Vec<Document>> {
    let text = read_text(path)?;
    let mut documents = Vec::new();
    for (index, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let at = || format!("{} line {}", path.display(), index + 1);
        let record: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}: invalid JSON", at()))?;
        if let Some(ids) = record.get("input_ids") {
            let ids: Vec<u32> = serde_json::from_value(ids.clone())
                .with_context(|| format!("{}: input_ids must be token ids", at()))?;
            documents.push(Document::plain(ids));
        } else if let Some(text) = record.get("text").and_then(|t| t.as_str()) {
            documents.push(Document::plain(tokenizer.get()?.encode(text)?));
        } else if is_chat_record(&record) {
            let tokenizer = tokenizer.get()?;
            let document =
                chat_document(&record, chat.get(tokenizer)?, tokenizer).with_context(at)?;
            documents.push(document);
        } else {
            bail!(
                "{}: expected a \"text\" or \"input_ids\" field, or a chat record (\"messages\", or \"prompt\" and \"completion\")",
                at()
            );
        }
    }
    Ok(documents)
}

pub fn read_token_file(path: &Path, width: TokenWidth) -> Result<Vec<u32>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let size = match width {
        TokenWidth::U16 => 2,
        TokenWidth::U32 => 4,
    };
    if bytes.len() % size != 0 {
        bail!(
            "{}: {} bytes is not a whole number of {size}-byte tokens (see --token-width)",
            path.display(),
            bytes.len()
        );
    }
    Ok(match width {
        TokenWidth::U16 => bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as u32)
            .collect(),
        TokenWidth::U32 => bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    })
}

/// Where a model's tokenizer lives when `--tokenizer` is not given: `tokenizer.json` in a
/// Hugging Face folder; `tokenizer.bin` or a single `tok*.bin` beside a llama2.c checkpoint; the
/// model file itself for GGUF, whose metadata holds the tokenizer.
pub fn find_tokenizer(model: &Path) -> Option<PathBuf> {
    if model.is_file() && model.extension().is_some_and(|e| e == "gguf") {
        return Some(model.to_path_buf());
    }
    if model.is_dir() {
        return Some(model.join("tokenizer.json")).filter(|p| p.exists());
    }
    let dir = model.parent()?;
    let beside = dir.join("tokenizer.bin");
    if beside.exists() {
        return Some(beside);
    }
    let mut candidates: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("tok") && name.ends_with(".bin") && p.as_path() != model
        })
        .collect();
    if candidates.len() == 1 {
        candidates.pop()
    } else {
        None
    }
}

/// Token sequences of one length (token lists or [`Sequence`]s) as a `[sequences, length]` id
/// tensor.
pub fn int_tokens<B: Backend>(
    sequences: &[impl AsRef<[u32]>],
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    let len = sequences[0].as_ref().len();
    let ids: Vec<i32> = sequences
        .iter()
        .flat_map(|s| s.as_ref().iter().map(|&t| t as i32))
        .collect();
    Tensor::from_data(TensorData::new(ids, [sequences.len(), len]), device)
}

/// The Hugging Face style labels of sequences of one length (`[sequences, length]`: the token,
/// or [`lemo_kernels::loss::IGNORE_INDEX`] where no loss is taken), or `None` when every
/// prediction is scored.
pub fn int_labels<B: Backend>(
    sequences: &[Sequence],
    device: &B::Device,
) -> Option<Tensor<B, 2, Int>> {
    if sequences.iter().all(|s| s.scored.is_none()) {
        return None;
    }
    let len = sequences[0].tokens.len();
    let labels: Vec<i32> = sequences
        .iter()
        .flat_map(|s| (0..len).map(move |t| s.label(t)))
        .collect();
    Some(Tensor::from_data(
        TensorData::new(labels, [sequences.len(), len]),
        device,
    ))
}

/// BOS to put before documents and EOS after them: the tokenizer's, else the model config's.
pub fn special_ids(
    config: &ModelConfig,
    tokenizer: &mut LazyTokenizer,
) -> (Option<u32>, Option<u32>) {
    let from_tokenizer = tokenizer.get().ok().map(|t| (t.bos_id(), t.eos_id()));
    let (bos, eos) = from_tokenizer.unwrap_or((None, None));
    let model_bos = match config {
        ModelConfig::Llama(c) => c.bos_token_id,
        ModelConfig::Opt(c) => c.bos_token_id,
    };
    (
        bos.or(model_bos),
        eos.or(config.eos_token_ids().first().copied()),
    )
}
