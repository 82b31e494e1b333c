//! Text <-> token ids for the two tokenizer files the models come with: a Hugging Face
//! `tokenizer.json`, and llama2.c's `tokenizer.bin`, reproduced exactly as llama2.c's `run.c`
//! encodes and decodes it, since its models were trained on those ids.
//!
//! [`huggingface`] runs a `tokenizer.json` (and the tokenizer a GGUF stores, rebuilt as one by
//! [`crate::gguf::tokenizer`]); [`llama2c`] reads a `tokenizer.bin`.

pub mod huggingface;
pub mod llama2c;

use std::path::Path;

pub use huggingface::HuggingFaceTokenizer;
pub use llama2c::Llama2cTokenizer;
use llama2c::{LLAMA2C_BOS_ID, LLAMA2C_EOS_ID};

use crate::{Error, Result};

/// A tokenizer of either format, picked from the file name by [`Tokenizer::from_file`].
#[derive(Debug, Clone)]
pub enum Tokenizer {
    HuggingFace(Box<HuggingFaceTokenizer>),
    Llama2c(Llama2cTokenizer),
}

impl Tokenizer {
    /// Loads `*.json` as a Hugging Face tokenizer, `*.bin` as a llama2.c tokenizer and `*.gguf`
    /// as the tokenizer in a GGUF model's metadata.
    pub fn from_file(path: &Path) -> Result<Self> {
        if path.exists() && !path.is_file() && !path.is_dir() {
            return Err(Error::format(
                path,
                "not a regular file (a pipe or device cannot be read as a tokenizer)",
            ));
        }
        match path.extension().and_then(|extension| extension.to_str()) {
            Some("json") => Ok(Self::HuggingFace(Box::new(
                HuggingFaceTokenizer::from_file(path)?,
            ))),
            Some("bin") => Ok(Self::Llama2c(Llama2cTokenizer::from_file(path)?)),
            Some("gguf") => Ok(Self::HuggingFace(Box::new(
                crate::gguf::tokenizer::from_gguf(path)?,
            ))),
            _ => Err(Error::format(
                path,
                "unknown tokenizer format: expected a Hugging Face tokenizer.json, a llama2.c .bin or a .gguf model",
            )),
        }
    }

    /// Token ids of `text`, with BOS first where the original tokenizer adds it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Self::HuggingFace(tokenizer) => tokenizer.encode(text),
            Self::Llama2c(tokenizer) => Ok(tokenizer.encode(text)),
        }
    }

    /// Token ids of `text` with the byte range each covers, adding no special tokens (a chat
    /// template writes its own): how transformers tokenizes a rendered conversation.
    pub fn encode_with_offsets(&self, text: &str) -> Result<Vec<(u32, std::ops::Range<usize>)>> {
        match self {
            Self::HuggingFace(tokenizer) => tokenizer.encode_with_offsets(text),
            Self::Llama2c(_) => Err(Error::Config(
                "llama2.c tokenizers come with no chat template: chat data needs a Hugging Face or GGUF model".into(),
            )),
        }
    }

    /// The vocabulary's spelling of token `id` (`<s>`, `<|im_end|>`), as a chat template is
    /// given the special tokens.
    pub fn token_text(&self, id: u32) -> String {
        match self {
            Self::HuggingFace(tokenizer) => tokenizer.token_text(id),
            Self::Llama2c(tokenizer) => tokenizer.token_text(id),
        }
    }

    /// The text of `ids`, leaving out BOS and EOS (all special tokens for Hugging Face); bytes
    /// that are not valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Self::HuggingFace(tokenizer) => tokenizer.decode(ids),
            Self::Llama2c(tokenizer) => tokenizer.decode(ids),
        }
    }

    /// The bytes that token `id` adds to the text after token `prev`, for printing generated text
    /// token by token: concatenated over a sequence that starts with BOS they equal the bytes of
    /// [`Tokenizer::decode`]. A piece may be part of a UTF-8 character.
    pub fn decode_piece(&self, prev: u32, id: u32) -> Vec<u8> {
        match self {
            Self::HuggingFace(tokenizer) => tokenizer.decode_piece(prev, id),
            Self::Llama2c(tokenizer) => tokenizer.decode_piece(prev, id),
        }
    }

    pub fn bos_id(&self) -> Option<u32> {
        match self {
            Self::HuggingFace(tokenizer) => tokenizer.bos_id(),
            Self::Llama2c(_) => Some(LLAMA2C_BOS_ID),
        }
    }

    /// For llama2.c this is id 2, which `run.c` appends when asked to; its generation loop stops on
    /// BOS instead, because its models were trained on stories that each start with BOS.
    pub fn eos_id(&self) -> Option<u32> {
        match self {
            Self::HuggingFace(tokenizer) => tokenizer.eos_id(),
            Self::Llama2c(_) => Some(LLAMA2C_EOS_ID),
        }
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::HuggingFace(tokenizer) => tokenizer.vocab_size(),
            Self::Llama2c(tokenizer) => tokenizer.vocab_size(),
        }
    }
}
