//! llama2.c's `tokenizer.bin`, reproduced exactly as llama2.c's `run.c` encodes and decodes it,
//! since its models were trained on those ids.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::path::Path;

use super::huggingface::parse_byte_piece;
use crate::{Error, Result};

/// llama2.c's fixed special ids: `run.c` hard-codes them rather than reading them from the file.
pub(crate) const LLAMA2C_BOS_ID: u32 = 1;
pub(crate) const LLAMA2C_EOS_ID: u32 = 2;
/// Byte fallback: byte `b` is token `b + 3` (after `<unk>`, BOS and EOS).
pub(crate) const LLAMA2C_BYTE_TOKEN_OFFSET: u32 = 3;
/// `run.c` starts each merge search with this best score, so a pair scoring no higher never merges.
const LLAMA2C_NO_MERGE_SCORE: f32 = -1e10;

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
    pub fn from_file(path: &Path) -> Result<Self> {
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
    /// Token `id`'s piece as text (lossy where it is not UTF-8); empty for an id outside it.
    pub fn token_text(&self, id: u32) -> String {
        self.pieces
            .get(id as usize)
            .map(|piece| String::from_utf8_lossy(piece).into_owned())
            .unwrap_or_default()
    }

    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    pub fn encode(&self, text: &str) -> Vec<u32> {
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

    pub fn decode(&self, ids: &[u32]) -> String {
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

    pub fn decode_piece(&self, prev: u32, id: u32) -> Vec<u8> {
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
