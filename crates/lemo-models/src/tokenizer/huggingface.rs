//! A Hugging Face `tokenizer.json` run by the `tokenizers` crate, as Python `transformers` runs it.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use tokenizers::DecoderWrapper;

use crate::{Error, Result};

/// Special-token spellings tried, in order, when no `tokenizer_config.json` names BOS or EOS.
const BOS_SPELLINGS: [&str; 4] = ["<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>"];
const EOS_SPELLINGS: [&str; 4] = ["</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"];
/// A `tokenizer.json` run by the `tokenizers` crate, as Python `transformers` would run it.
#[derive(Debug, Clone)]
pub struct HuggingFaceTokenizer {
    path: PathBuf,
    inner: tokenizers::Tokenizer,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    /// Cached: the crate counts added tokens by building the whole vocabulary map.
    vocab_size: usize,
    special_ids: HashSet<u32>,
    /// The decoder turns `<0xHH>` pieces into raw bytes (SentencePiece byte fallback).
    has_byte_fallback: bool,
    /// The decoder maps each character of a piece to one byte (GPT-2 style byte-level BPE).
    has_byte_level: bool,
}

impl HuggingFaceTokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        let json = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let invalid = |e: &dyn std::fmt::Display| {
            Error::format(path, format!("not a Hugging Face tokenizer.json: {e}"))
        };
        // The tokenizers crate panics on some malformed JSON (an invalid escape inside its
        // decoder section, say): plain JSON syntax is checked first, and a panic left over is
        // caught and reported as the file's error.
        serde_json::from_slice::<serde_json::Value>(&json).map_err(|e| invalid(&e))?;
        let inner = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(&json))
            .map_err(|_| invalid(&"the tokenizers library could not read it"))?
            .map_err(|e| invalid(&e))?;
        let config = read_tokenizer_config(path)?;
        let special_id = |config_key: &str, spellings: &[&str]| {
            config
                .as_ref()
                .and_then(|config| special_token_content(config, config_key))
                .and_then(|content| inner.token_to_id(content))
                .or_else(|| {
                    spellings
                        .iter()
                        .find_map(|spelling| inner.token_to_id(spelling))
                })
        };
        let bos_id = special_id("bos_token", &BOS_SPELLINGS);
        let eos_id = special_id("eos_token", &EOS_SPELLINGS);
        Ok(Self::from_parts(path, inner, bos_id, eos_id))
    }

    /// A tokenizer built elsewhere (from a GGUF file's metadata); `path` names it in errors.
    pub(crate) fn from_parts(
        path: &Path,
        inner: tokenizers::Tokenizer,
        bos_id: Option<u32>,
        eos_id: Option<u32>,
    ) -> Self {
        let special_ids = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        let vocab_size = inner.get_vocab_size(true);
        let decoder = inner.get_decoder();
        let has_byte_fallback = decoder.is_some_and(|decoder| {
            decoder_contains(decoder, &|d| matches!(d, DecoderWrapper::ByteFallback(_)))
        });
        let has_byte_level = decoder.is_some_and(|decoder| {
            decoder_contains(decoder, &|d| matches!(d, DecoderWrapper::ByteLevel(_)))
        });
        Self {
            path: path.to_path_buf(),
            inner,
            bos_id,
            eos_id,
            vocab_size,
            special_ids,
            has_byte_fallback,
            has_byte_level,
        }
    }

    /// The vocabulary's spelling of token `id`; empty for an id outside it.
    pub fn token_text(&self, id: u32) -> String {
        self.inner.id_to_token(id).unwrap_or_default()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, true)
            .map_err(|e| Error::format(&self.path, format!("cannot encode text: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn encode_with_offsets(&self, text: &str) -> Result<Vec<(u32, std::ops::Range<usize>)>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::format(&self.path, format!("cannot encode text: {e}")))?;
        Ok(encoding
            .get_ids()
            .iter()
            .zip(encoding.get_offsets())
            .map(|(&id, &(start, end))| (id, start..end))
            .collect())
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        // Decoders fail only on states no tokenizer.json produces; an empty text is then the
        // honest answer for a display helper.
        self.inner.decode(ids, true).unwrap_or_default()
    }

    /// Byte-valued pieces are mapped straight to their bytes, since decoding them one at a time
    /// would turn a character split over several tokens into U+FFFD; any other piece is what
    /// decoding `[prev, id]` adds to decoding `[prev]`, which keeps the decoder's handling of
    /// leading spaces (dropped after BOS, kept between words).
    pub fn decode_piece(&self, prev: u32, id: u32) -> Vec<u8> {
        if self.special_ids.contains(&id) {
            return Vec::new();
        }
        let Some(piece) = self.inner.id_to_token(id) else {
            return Vec::new();
        };
        if self.has_byte_level {
            return byte_level_piece_bytes(&piece);
        }
        if self.has_byte_fallback
            && let Some(byte) = parse_byte_piece(piece.as_bytes())
        {
            return vec![byte];
        }
        let before = self.decode(&[prev]);
        let after = self.decode(&[prev, id]);
        match after.strip_prefix(&before) {
            Some(added) => added.as_bytes().to_vec(),
            None => self.decode(&[id]).into_bytes(),
        }
    }
}

/// `tokenizer_config.json` beside the tokenizer, the file that names BOS and EOS, if there is one.
fn read_tokenizer_config(tokenizer_path: &Path) -> Result<Option<serde_json::Value>> {
    let path = tokenizer_path.with_file_name("tokenizer_config.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&path, e)),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::format(&path, format!("invalid JSON: {e}")))
}

/// A special token in `tokenizer_config.json` is either its text or an object with `content`.
fn special_token_content<'a>(config: &'a serde_json::Value, key: &str) -> Option<&'a str> {
    match config.get(key)? {
        serde_json::Value::String(content) => Some(content),
        serde_json::Value::Object(token) => token.get("content")?.as_str(),
        _ => None,
    }
}

fn decoder_contains(decoder: &DecoderWrapper, is_wanted: &dyn Fn(&DecoderWrapper) -> bool) -> bool {
    match decoder {
        DecoderWrapper::Sequence(sequence) => sequence
            .get_decoders()
            .iter()
            .any(|inner| decoder_contains(inner, is_wanted)),
        other => is_wanted(other),
    }
}

/// Bytes of a byte-level BPE piece; a piece with characters outside the byte alphabet (an added
/// token) is its own UTF-8, as the `tokenizers` ByteLevel decoder treats it.
fn byte_level_piece_bytes(piece: &str) -> Vec<u8> {
    piece
        .chars()
        .map(byte_level_char_to_byte)
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| piece.as_bytes().to_vec())
}

/// Inverse of GPT-2's `bytes_to_unicode`: printable Latin-1 bytes stand for themselves, and the
/// other 68 bytes, in increasing order, are U+0100 onwards.
fn byte_level_char_to_byte(c: char) -> Option<u8> {
    const UNPRINTABLE_LOW: u32 = 33; // bytes 0..=32
    const UNPRINTABLE_MID: u32 = 34; // bytes 127..=160
    let code = u32::from(c);
    match code {
        33..=126 | 161..=172 | 174..=255 => u8::try_from(code).ok(),
        256.. => {
            let rank = code - 256;
            let byte = if rank < UNPRINTABLE_LOW {
                rank
            } else if rank < UNPRINTABLE_LOW + UNPRINTABLE_MID {
                127 + rank - UNPRINTABLE_LOW
            } else if rank == UNPRINTABLE_LOW + UNPRINTABLE_MID {
                173
            } else {
                return None;
            };
            u8::try_from(byte).ok()
        }
        _ => None,
    }
}

/// The byte of a `<0xHH>` piece.
pub(crate) fn parse_byte_piece(piece: &[u8]) -> Option<u8> {
    let hex = piece.strip_prefix(b"<0x")?.strip_suffix(b">")?;
    match hex {
        [high, low] => Some((hex_digit(*high)? << 4) | hex_digit(*low)?),
        _ => None,
    }
}

fn hex_digit(c: u8) -> Option<u8> {
    char::from(c)
        .to_digit(16)
        .and_then(|digit| u8::try_from(digit).ok())
}
