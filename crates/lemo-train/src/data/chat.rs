//! Chat records (`messages`, or `prompt` / `completion`) as documents: rendered with the model's
//! own chat template and tokenized with the assistant turns marked, so that `--loss-on
//! assistant` scores only what the assistant says.

use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow};
use clap::ValueEnum;
use lemo_models::chat::{self, ChatTemplate};
use lemo_models::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};

use super::Document;

/// Which tokens of chat records the loss is taken on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LossOn {
    /// Every token of the rendered conversation, the prompt's and the template's markup included.
    All,
    /// The assistant turns' tokens (with the end-of-turn markup the template closes them with).
    Assistant,
}

impl LossOn {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            LossOn::All => "all",
            LossOn::Assistant => "assistant",
        }
    }
}

/// Whether a JSONL record is a chat record (rather than `text` or `input_ids`).
pub fn is_chat_record(record: &serde_json::Value) -> bool {
    ["messages", "prompt", "completion"]
        .iter()
        .any(|key| record.get(key).is_some())
}

/// The model's chat template, read and compiled on first use: data without chat records needs
/// none, and a model without one is an error only when such a record is met.
pub struct LazyChatTemplate {
    model: PathBuf,
    loaded: Option<ChatTemplate>,
}

impl LazyChatTemplate {
    /// The template of the model at `model`.
    pub fn new(model: &Path) -> Self {
        Self {
            model: model.to_path_buf(),
            loaded: None,
        }
    }

    /// What tokenized chat records depend on besides the tokenizer, for the token cache: the
    /// template's source (empty when the model has none).
    pub fn identity(&self) -> String {
        ChatTemplate::source_for_model(&self.model).unwrap_or_default()
    }

    pub fn get(&mut self, tokenizer: &Tokenizer) -> Result<&ChatTemplate> {
        if self.loaded.is_none() {
            let model = self.model.as_path();
            ChatTemplate::source_for_model(model).map_err(|e| {
                anyhow!(
                    "{e}: chat records are rendered with it; add one (a chat_template.jinja file beside the model, or \"chat_template\" in its tokenizer_config.json), or give the data as plain \"text\" records"
                )
            })?;
            let template = ChatTemplate::for_model(model, tokenizer).map_err(|e| anyhow!("{e}"))?;
            self.loaded = Some(template);
        }
        Ok(self.loaded.as_ref().expect("loaded above"))
    }
}

/// A chat record as a document: the conversation rendered by `template`, its tokens, and which
/// of them belong to the assistant turns. Errors are one line, without the record's location
/// (the caller adds it).
pub fn chat_document(
    record: &serde_json::Value,
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
) -> Result<Document> {
    let messages = chat::parse_record(record).map_err(|e| anyhow!(e))?;
    let rendered = template
        .render_conversation(&messages)
        .map_err(|e| anyhow!("{e}"))?;
    let (tokens, assistant) = chat::tokenize_chat(tokenizer, &rendered, chat::LossOn::Assistant)
        .map_err(|e| anyhow!("{e}"))?;
    Ok(Document {
        tokens,
        assistant: Some(assistant),
    })
}
