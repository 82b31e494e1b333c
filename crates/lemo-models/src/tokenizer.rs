//! Text <-> token ids for the two tokenizer files the models come with: a Hugging Face
//! `tokenizer.json`, and llama2.c's `tokenizer.bin`, reproduced exactly as llama2.c's `run.c`
//! encodes and decodes it, since its models were trained on those ids.

use crate::{Error, Result};
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use tokenizers::DecoderWrapper;

/// llama2.c's fixed special ids: `run.c` hard-codes them rather than reading them from the file.
pub(crate) const LLAMA2C_BOS_ID: u32 = 1;
pub(crate) const LLAMA2C_EOS_ID: u32 = 2;
/// Byte fallback: byte `b` is token `b + 3` (after `<unk>`, BOS and EOS).
pub(crate) const LLAMA2C_BYTE_TOKEN_OFFSET: u32 = 3;
/// `run.c` starts each merge search with this best score, so a pair scoring no higher never merges.
const LLAMA2C_NO_MERGE_SCORE: f32 = -1e10;

/// Special-token spellings tried, in order, when no `tokenizer_config.json` names BOS or EOS.
const BOS_SPELLINGS: [&str; 4] = ["<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>"];
const EOS_SPELLINGS: [&str; 4] = ["</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"];

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
            Self::HuggingFace(tokenizer) => tokenizer.inner.id_to_token(id).unwrap_or_default(),
            Self::Llama2c(tokenizer) => tokenizer
                .pieces
                .get(id as usize)
                .map(|piece| String::from_utf8_lossy(piece).into_owned())
                .unwrap_or_default(),
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
            Self::HuggingFace(tokenizer) => tokenizer.bos_id,
            Self::Llama2c(_) => Some(LLAMA2C_BOS_ID),
        }
    }

    /// For llama2.c this is id 2, which `run.c` appends when asked to; its generation loop stops on
    /// BOS instead, because its models were trained on stories that each start with BOS.
    pub fn eos_id(&self) -> Option<u32> {
        match self {
            Self::HuggingFace(tokenizer) => tokenizer.eos_id,
            Self::Llama2c(_) => Some(LLAMA2C_EOS_ID),
        }
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::HuggingFace(tokenizer) => tokenizer.vocab_size,
            Self::Llama2c(tokenizer) => tokenizer.pieces.len(),
        }
    }
}

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
    fn from_file(path: &Path) -> Result<Self> {
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

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, true)
            .map_err(|e| Error::format(&self.path, format!("cannot encode text: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    fn encode_with_offsets(&self, text: &str) -> Result<Vec<(u32, std::ops::Range<usize>)>> {
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

    fn decode(&self, ids: &[u32]) -> String {
        // Decoders fail only on states no tokenizer.json produces; an empty text is then the
        // honest answer for a display helper.
        self.inner.decode(ids, true).unwrap_or_default()
    }

    /// Byte-valued pieces are mapped straight to their bytes, since decoding them one at a time
    /// would turn a character split over several tokens into U+FFFD; any other piece is what
    /// decoding `[prev, id]` adds to decoding `[prev]`, which keeps the decoder's handling of
    /// leading spaces (dropped after BOS, kept between words).
    fn decode_piece(&self, prev: u32, id: u32) -> Vec<u8> {
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
fn parse_byte_piece(piece: &[u8]) -> Option<u8> {
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

/// A llama2.c `tokenizer.bin`: per id a piece (bytes, `▁` already turned into ' ') and a merge
/// score, with `<unk>`, BOS, EOS and the 256 byte pieces at ids 0..259.
#[derive(Debug, Clone)]
pub struct Llama2cTokenizer {
    pieces: Vec<Vec<u8>>,
    scores: Vec<f32>,
    id_by_piece: HashMap<Vec<u8>, u32>,
    /// SentencePiece's dummy prefix: the piece " " put before every non-empty text.
    space_id: u32,
}

impl Llama2cTokenizer {
    fn from_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::parse(path, &bytes)
    }

    /// Layout: i32 max_token_length, then until the end of the file per token an f32 score, an
    /// i32 byte length and the bytes, all little-endian. The file does not store the token count.
    fn parse(path: &Path, bytes: &[u8]) -> Result<Self> {
        let mut reader = ByteReader { rest: bytes };
        let max_token_length = reader
            .i32()
            .ok_or_else(|| Error::format(path, "truncated llama2.c tokenizer: no header"))?;
        let mut pieces = Vec::new();
        let mut scores = Vec::new();
        while !reader.rest.is_empty() {
            let id = pieces.len();
            let truncated = || {
                Error::format(
                    path,
                    format!("truncated llama2.c tokenizer: token {id} is cut off"),
                )
            };
            let score = reader.f32().ok_or_else(truncated)?;
            let length = reader.i32().ok_or_else(truncated)?;
            let piece_length = usize::try_from(length)
                .ok()
                .filter(|_| length <= max_token_length)
                .ok_or_else(|| {
                    Error::format(
                        path,
                        format!(
                            "corrupt llama2.c tokenizer: token {id} has length {length}, \
                             outside 0..={max_token_length}"
                        ),
                    )
                })?;
            pieces.push(reader.take(piece_length).ok_or_else(truncated)?.to_vec());
            scores.push(score);
        }
        for byte in 0..=u8::MAX {
            let id = usize::from(byte) + LLAMA2C_BYTE_TOKEN_OFFSET as usize;
            let expected = format!("<0x{byte:02X}>");
            if pieces.get(id).map(Vec::as_slice) != Some(expected.as_bytes()) {
                return Err(Error::format(
                    path,
                    format!("not a llama2.c tokenizer: id {id} is not the byte piece {expected}"),
                ));
            }
        }
        let mut id_by_piece = HashMap::with_capacity(pieces.len());
        for (id, piece) in pieces.iter().enumerate() {
            let id = u32::try_from(id)
                .map_err(|_| Error::format(path, "llama2.c tokenizer has over 2^32 tokens"))?;
            // run.c's binary search may find any of equal pieces; the first is the usual choice.
            id_by_piece.entry(piece.clone()).or_insert(id);
        }
        let space_id = *id_by_piece
            .get(b" ".as_slice())
            .ok_or_else(|| Error::format(path, "llama2.c tokenizer has no \" \" piece"))?;
        Ok(Self {
            pieces,
            scores,
            id_by_piece,
            space_id,
        })
    }

    /// Each id's piece (SentencePiece's `▁` as a space) and merge score, in id order.
    pub fn vocabulary(&self) -> impl Iterator<Item = (&[u8], f32)> {
        self.pieces
            .iter()
            .map(Vec::as_slice)
            .zip(self.scores.iter().copied())
    }

    /// run.c `encode(text, bos=1, eos=0)`: BOS, the dummy prefix, one token per character (its
    /// UTF-8 bytes as byte tokens when the character is not a piece), then greedy merges.
    /// Unlike run.c, which reads a C string, a NUL character is encoded rather than ending the text.
    fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = vec![LLAMA2C_BOS_ID];
        if !text.is_empty() {
            ids.push(self.space_id);
        }
        let mut utf8 = [0u8; 4];
        for c in text.chars() {
            let bytes = c.encode_utf8(&mut utf8).as_bytes();
            match self.id_by_piece.get(bytes) {
                Some(&id) => ids.push(id),
                None => ids.extend(
                    bytes
                        .iter()
                        .map(|&b| u32::from(b) + LLAMA2C_BYTE_TOKEN_OFFSET),
                ),
            }
        }
        self.merge(ids)
    }

    /// run.c's merge loop: while some adjacent pair concatenates to a piece, merge the pair whose
    /// piece scores highest, the leftmost among equals. run.c rescans every pair for each merge,
    /// which is quadratic; a heap of candidate pairs gives the same merges in n log n, with stale
    /// candidates (a side already merged) skipped when popped.
    fn merge(&self, mut ids: Vec<u32>) -> Vec<u32> {
        let len = ids.len();
        let mut next: Vec<Option<usize>> = (1..=len).map(|i| (i < len).then_some(i)).collect();
        let mut prev: Vec<Option<usize>> = (0..len).map(|i| i.checked_sub(1)).collect();
        let mut alive = vec![true; len];
        let mut scratch = Vec::new();
        let mut candidates: BinaryHeap<MergeCandidate> = (1..len)
            .filter_map(|right| self.merge_candidate(&ids, right - 1, right, &mut scratch))
            .collect();
        while let Some(candidate) = candidates.pop() {
            let MergeCandidate { left, right, .. } = candidate;
            let still_adjacent = alive[left] && next[left] == Some(right);
            if !still_adjacent || ids[left] != candidate.left_id || ids[right] != candidate.right_id
            {
                continue;
            }
            ids[left] = candidate.merged_id;
            alive[right] = false;
            next[left] = next[right];
            if let Some(after) = next[left] {
                prev[after] = Some(left);
                candidates.extend(self.merge_candidate(&ids, left, after, &mut scratch));
            }
            if let Some(before) = prev[left] {
                candidates.extend(self.merge_candidate(&ids, before, left, &mut scratch));
            }
        }
        ids.into_iter()
            .zip(alive)
            .filter_map(|(id, alive)| alive.then_some(id))
            .collect()
    }

    fn merge_candidate(
        &self,
        ids: &[u32],
        left: usize,
        right: usize,
        scratch: &mut Vec<u8>,
    ) -> Option<MergeCandidate> {
        let (left_id, right_id) = (ids[left], ids[right]);
        scratch.clear();
        scratch.extend_from_slice(&self.pieces[left_id as usize]);
        scratch.extend_from_slice(&self.pieces[right_id as usize]);
        let merged_id = *self.id_by_piece.get(scratch.as_slice())?;
        let score = self.scores[merged_id as usize];
        // Written as run.c's `score > best_score` so that a NaN score never merges either.
        (score > LLAMA2C_NO_MERGE_SCORE).then_some(MergeCandidate {
            score,
            left,
            right,
            left_id,
            right_id,
            merged_id,
        })
    }

    fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        let mut prev = None;
        for &id in ids {
            if id != LLAMA2C_BOS_ID && id != LLAMA2C_EOS_ID {
                self.push_piece(prev, id, &mut bytes);
            }
            prev = Some(id);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn decode_piece(&self, prev: u32, id: u32) -> Vec<u8> {
        let mut bytes = Vec::new();
        self.push_piece(Some(prev), id, &mut bytes);
        bytes
    }

    /// run.c `decode(prev, token)`: after BOS a leading space is dropped (SentencePiece drops
    /// the dummy prefix), and `<0xHH>` is that raw byte. An id outside the vocabulary adds nothing.
    fn push_piece(&self, prev: Option<u32>, id: u32, out: &mut Vec<u8>) {
        let Some(piece) = self.pieces.get(id as usize) else {
            return;
        };
        let piece = match piece.strip_prefix(b" ") {
            Some(rest) if prev == Some(LLAMA2C_BOS_ID) => rest,
            _ => piece,
        };
        match parse_byte_piece(piece) {
            Some(byte) => out.push(byte),
            None => out.extend_from_slice(piece),
        }
    }
}

/// Little-endian fields read off the front of a byte slice; `None` once the slice runs out.
struct ByteReader<'a> {
    rest: &'a [u8],
}

impl<'a> ByteReader<'a> {
    fn take(&mut self, count: usize) -> Option<&'a [u8]> {
        let (taken, rest) = self.rest.split_at_checked(count)?;
        self.rest = rest;
        Some(taken)
    }

    fn four_bytes(&mut self) -> Option<[u8; 4]> {
        self.take(4)?.try_into().ok()
    }

    fn i32(&mut self) -> Option<i32> {
        self.four_bytes().map(i32::from_le_bytes)
    }

    fn f32(&mut self) -> Option<f32> {
        self.four_bytes().map(f32::from_le_bytes)
    }
}

/// An adjacent pair that can merge, ordered as run.c chooses: highest score first, then leftmost.
/// Scores here are never NaN (see `merge_candidate`), so `partial_cmp` is total; it also keeps
/// run.c's `-0.0 == 0.0`, which `total_cmp` would not.
struct MergeCandidate {
    score: f32,
    left: usize,
    right: usize,
    left_id: u32,
    right_id: u32,
    merged_id: u32,
}

impl Ord for MergeCandidate {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for MergeCandidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for MergeCandidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for MergeCandidate {}
