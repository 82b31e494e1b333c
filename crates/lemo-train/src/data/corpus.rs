//! Training data: documents read from text, JSONL or token files (tokenized once, then cached),
//! packed into fixed-length sequences, split into training and validation sets, and served in a
//! deterministic order: epoch `e` visits the training sequences in the order of a shuffle seeded
//! by `seed + e`, so the sequence of any step is known without state (which is what makes
//! `--resume` continue with the same data order).
//!
//! Where the data has chat records, every sequence also says which of its tokens are prediction
//! targets: the assistant's under `--loss-on assistant`, and never the first token of a document
//! packed after another (no label crosses a document boundary). Plain text alone is packed as
//! pretraining packs it, every next token a target.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use burn_dataset::transform::ShuffledDataset;
use burn_dataset::{Dataset, InMemDataset};

use lemo_kernels::loss::IGNORE_INDEX;

use super::chat::{LazyChatTemplate, LossOn};
use super::{Document, LazyTokenizer, TokenWidth, cache, read_jsonl, read_token_file};

/// How documents become sequences.
#[derive(Debug, Clone)]
pub struct PackOptions {
    pub seq_len: usize,
    /// Put before each document that does not start with it.
    pub bos: Option<u32>,
    /// Put after each document.
    pub eos: Option<u32>,
    /// Fraction of the packed sequences held out for validation (at least one when > 0).
    pub val_fraction: f64,
    pub seed: u64,
    /// Which tokens of chat records are prediction targets.
    pub loss_on: LossOn,
}

/// A packed sequence: `seq_len` tokens and, where not every next token is a prediction target
/// (chat data), which ones are.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Sequence {
    pub tokens: Vec<u32>,
    pub scored: Option<Vec<bool>>,
}

impl Sequence {
    /// Position `t`'s Hugging Face label: its token, or [`IGNORE_INDEX`] where no loss is taken.
    pub fn label(&self, t: usize) -> i32 {
        match &self.scored {
            Some(scored) if !scored[t] => IGNORE_INDEX as i32,
            _ => self.tokens[t] as i32,
        }
    }

    /// Next-token predictions the loss is taken on (the first token is never predicted).
    pub fn predictions(&self) -> usize {
        match &self.scored {
            Some(scored) => scored.iter().skip(1).filter(|&&s| s).count(),
            None => self.tokens.len().saturating_sub(1),
        }
    }
}

impl AsRef<[u32]> for Sequence {
    fn as_ref(&self) -> &[u32] {
        &self.tokens
    }
}

type EpochOrder = ShuffledDataset<Arc<InMemDataset<Sequence>>, Sequence>;

/// Packed training and validation sequences.
pub struct Corpus {
    pub train: Arc<InMemDataset<Sequence>>,
    pub val: InMemDataset<Sequence>,
    pub documents: usize,
    /// Tokens in all packed sequences.
    pub tokens: usize,
    /// Sequences left out because no token of theirs is a prediction target (all prompt).
    pub unscored: usize,
    /// Padding tokens that keep chat records whole (see [`pack`]).
    pub padding: usize,
    seed: u64,
    /// The order of the epoch served last (ranks on threads of one process share it).
    epoch: Mutex<Option<(usize, EpochOrder)>>,
}

/// 64-bit FNV-1a: a stable hash for cache keys.
pub fn fnv1a(bytes: &[u8], mut hash: u64) -> u64 {
    for b in bytes {
        hash ^= *b as u64;
        hash = hash.wrapping_mul(0x100000001b3);
    }
    hash
}
const FNV_OFFSET: u64 = 0xcbf29ce484222325;

/// The default token cache: `$XDG_CACHE_HOME/lemo/tokens` or `~/.cache/lemo/tokens`.
pub fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("lemo").join("tokens"))
}

fn list_files(path: &Path) -> Result<Vec<PathBuf>> {
    if path.is_dir() {
        let entries =
            std::fs::read_dir(path).with_context(|| format!("cannot read {}", path.display()))?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.is_file()
                    && !p
                        .file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with('.'))
            })
            .collect();
        files.sort();
        if files.is_empty() {
            let folders: Vec<String> = std::fs::read_dir(path)
                .with_context(|| format!("cannot read {}", path.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_dir())
                .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .collect();
            if !folders.is_empty() {
                bail!(
                    "--data {}: no files here, only folders ({}); subfolders are not read: point \
                     --data at one of them",
                    path.display(),
                    folders.join(", ")
                );
            }
        }
        Ok(files)
    } else if path.is_file() {
        Ok(vec![path.to_path_buf()])
    } else if path.exists() {
        bail!(
            "--data {}: not a regular file or folder (a pipe or device cannot be read twice, as caching and validation do)",
            path.display()
        )
    } else {
        bail!("--data {}: no such file or folder", path.display())
    }
}

/// The documents of `data` for a model of `vocab` token ids, read as [`read_documents_cached`]
/// reads them (chat records rendered with the template beside `model`), every id checked
/// against the vocabulary.
pub fn read_model_documents(
    data: &Path,
    token_width: u8,
    tokenizer: &mut LazyTokenizer,
    model: &Path,
    cache_dir: Option<&Path>,
    vocab: usize,
) -> Result<Vec<Document>> {
    let documents = read_documents_cached(
        data,
        TokenWidth::from_bytes(token_width)?,
        tokenizer,
        &mut LazyChatTemplate::new(model),
        cache_dir,
    )?;
    check_vocabulary(&documents, vocab)
        .with_context(|| format!("{} (wrong tokenizer?)", data.display()))?;
    Ok(documents)
}

/// Refuses documents holding a token id past a vocabulary of `vocab` ids.
pub fn check_vocabulary(documents: &[Document], vocab: usize) -> Result<()> {
    for (index, document) in documents.iter().enumerate() {
        if let Some(bad) = document.tokens.iter().find(|&&id| id as usize >= vocab) {
            bail!(
                "document {}: token id {bad} is outside the model's vocabulary of {vocab}",
                index + 1
            );
        }
    }
    Ok(())
}

/// Token documents of `path` (a file or a folder of files, in name order). Text is tokenized with
/// `tokenizer` (chat records rendered with `chat`'s template) and cached in `cache_dir` under a
/// hash of the file's bytes, the tokenizer's and the chat template.
fn read_documents_cached(
    path: &Path,
    width: TokenWidth,
    tokenizer: &mut LazyTokenizer,
    chat: &mut LazyChatTemplate,
    cache_dir: Option<&Path>,
) -> Result<Vec<Document>> {
    let tokenizer_hash = match tokenizer.path() {
        Some(p) => fnv1a(
            &std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?,
            FNV_OFFSET,
        ),
        None => FNV_OFFSET,
    };
    let mut chat_hash = None;
    let mut documents = Vec::new();
    for file in list_files(path)? {
        let extension = file
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or("")
            .to_string();
        if extension == "bin" {
            documents.push(Document::plain(read_token_file(&file, width)?));
            continue;
        }
        let is_jsonl = matches!(extension.as_str(), "jsonl" | "json");
        let bytes =
            std::fs::read(&file).with_context(|| format!("cannot read {}", file.display()))?;
        let mut key = fnv1a(cache::FORMAT.as_bytes(), tokenizer_hash);
        if is_jsonl {
            key ^= *chat_hash.get_or_insert_with(|| fnv1a(chat.identity().as_bytes(), FNV_OFFSET));
        }
        let key = fnv1a(extension.as_bytes(), fnv1a(&bytes, key));
        let cached = cache_dir.map(|d| d.join(format!("{key:016x}.tokens")));
        if let Some(docs) = cached
            .as_ref()
            .and_then(|c| std::fs::read(c).ok())
            .and_then(|b| cache::decode(&b))
        {
            documents.extend(docs);
            continue;
        }
        let docs = match is_jsonl {
            true => read_jsonl(&file, tokenizer, chat)?,
            false => vec![Document::plain(
                tokenizer.get()?.encode(&super::read_text(&file)?)?,
            )],
        };
        if let Some(cached) = cached {
            // A cache that cannot be written only costs time on the next run.
            if std::fs::create_dir_all(cached.parent().expect("cache file has a folder")).is_ok() {
                let _ = lemo_models::adapter::write_atomically(&cached, &cache::encode(&docs));
            }
        }
        documents.extend(docs);
    }
    documents.retain(|d| !d.tokens.is_empty());
    if documents.is_empty() {
        bail!("{}: no tokens in this data", path.display());
    }
    Ok(documents)
}

/// Concatenates the framed documents into one stream and cuts it into `seq_len` sequences: long
/// documents are split, short ones share a sequence. The incomplete tail is dropped. Plain
/// documents are framed with BOS and EOS; a chat record is taken as its template renders it (the
/// template places its own BOS and end-of-turn tokens, as `apply_chat_template` does).
/// With any chat record in the data every sequence says which tokens are prediction targets:
/// under [`LossOn::Assistant`] a chat record's assistant tokens (a plain document's every
/// token), and in all cases not a document's first token (it is not predicted from the
/// document before it).
///
/// A chat record that fits in one sequence is never split over two: its answers would be
/// trained without the context they are about (a question on a long document whose key
/// sentence fell into the sequence before). Where it would straddle a boundary, the rest of the
/// sequence is padding (EOS, else BOS, else token 0; never a target) and the record starts the
/// next one. Returns the sequences and the padding tokens.
pub fn pack(documents: &[Document], options: &PackOptions) -> (Vec<Sequence>, usize) {
    let labeled = documents.iter().any(|d| d.assistant.is_some());
    let capacity = documents.iter().map(|d| d.tokens.len() + 2).sum();
    let mut stream = Vec::with_capacity(capacity);
    let mut scored = Vec::with_capacity(if labeled { capacity } else { 0 });
    let len = options.seq_len;
    let pad = options.eos.or(options.bos).unwrap_or(0);
    let mut padding = 0;
    for doc in documents {
        let used = stream.len() % len;
        if doc.assistant.is_some()
            && used > 0
            && used + doc.tokens.len() > len
            && doc.tokens.len() <= len
        {
            padding += len - used;
            stream.resize(stream.len() + len - used, pad);
            scored.resize(stream.len(), false);
        }
        let start = stream.len();
        match &doc.assistant {
            Some(assistant) => {
                stream.extend_from_slice(&doc.tokens);
                let all = options.loss_on == LossOn::All;
                scored.extend(assistant.iter().map(|&a| a || all));
            }
            None => {
                if let Some(bos) = options.bos
                    && doc.tokens.first() != Some(&bos)
                {
                    stream.push(bos);
                }
                stream.extend_from_slice(&doc.tokens);
                if let Some(eos) = options.eos {
                    stream.push(eos);
                }
                if labeled {
                    scored.resize(stream.len(), true);
                }
            }
        }
        if labeled && stream.len() > start {
            scored[start] = false;
        }
    }
    let sequences = stream
        .chunks_exact(len)
        .enumerate()
        .map(|(i, tokens)| Sequence {
            tokens: tokens.to_vec(),
            scored: labeled.then(|| scored[i * len..(i + 1) * len].to_vec()),
        })
        .collect();
    (sequences, padding)
}

impl Corpus {
    pub fn new(documents: &[Document], options: &PackOptions) -> Result<Self> {
        let (mut sequences, padding) = pack(documents, options);
        let total: usize = documents.iter().map(|d| d.tokens.len()).sum();
        if sequences.is_empty() {
            bail!(
                "the data has {total} tokens in {} documents: not enough for one sequence of --seq-len {}",
                documents.len(),
                options.seq_len
            );
        }
        // A sequence without a target (a window of a long prompt) would only cost time.
        let packed = sequences.len();
        sequences.retain(|s| s.predictions() > 0);
        let unscored = packed - sequences.len();
        if sequences.is_empty() {
            bail!(
                "no sequence of --seq-len {} has an assistant token to train on (every window is prompt): use a longer --seq-len or --loss-on all",
                options.seq_len
            );
        }
        let count = sequences.len();
        let held_out = if options.val_fraction > 0.0 && count >= 2 {
            ((count as f64 * options.val_fraction).round() as usize).clamp(1, count - 1)
        } else {
            0
        };
        // Validation sequences: a seeded choice, so the split is stable across runs and resumes.
        let order = ShuffledDataset::new(
            InMemDataset::new((0..count).collect::<Vec<usize>>()),
            options.seed ^ 0x5eed,
        );
        let mut is_val = vec![false; count];
        for i in 0..held_out {
            is_val[order.get(i).expect("in range")] = true;
        }
        let (mut train, mut val) = (Vec::new(), Vec::new());
        for (sequence, held) in sequences.into_iter().zip(is_val) {
            if held {
                val.push(sequence)
            } else {
                train.push(sequence)
            }
        }
        Ok(Self {
            tokens: (train.len() + val.len()) * options.seq_len,
            train: Arc::new(InMemDataset::new(train)),
            val: InMemDataset::new(val),
            documents: documents.len(),
            unscored,
            padding,
            seed: options.seed,
            epoch: Mutex::new(None),
        })
    }

    pub fn train_len(&self) -> usize {
        self.train.len()
    }

    /// The first `count` validation sequences (all of them when `count` is 0).
    pub fn val_sequences(&self, count: usize) -> Vec<Sequence> {
        let n = match count {
            0 => self.val.len(),
            n => n.min(self.val.len()),
        };
        (0..n).map(|i| self.val.get(i).expect("in range")).collect()
    }

    /// The `index`-th training sequence served (counting across epochs).
    pub fn train_sequence(&self, index: usize) -> Sequence {
        let n = self.train.len();
        let (epoch, within) = (index / n, index % n);
        let mut cached = self.epoch.lock().unwrap_or_else(|e| e.into_inner());
        if cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let shuffled =
                ShuffledDataset::new(self.train.clone(), self.seed.wrapping_add(epoch as u64));
            *cached = Some((epoch, shuffled));
        }
        cached
            .as_ref()
            .expect("set above")
            .1
            .get(within)
            .expect("index within the epoch")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(seq_len: usize) -> PackOptions {
        PackOptions {
            seq_len,
            bos: Some(1),
            eos: Some(2),
            val_fraction: 0.25,
            seed: 7,
            loss_on: LossOn::Assistant,
        }
    }

    fn plain(docs: &[&[u32]]) -> Vec<Document> {
        docs.iter().map(|d| Document::plain(d.to_vec())).collect()
    }

    /// A chat document whose tokens are `assistant` where the mask is 1.
    fn chat(tokens: &[u32], assistant: &[u8]) -> Document {
        Document {
            tokens: tokens.to_vec(),
            assistant: Some(assistant.iter().map(|&a| a == 1).collect()),
        }
    }

    fn labels(sequence: &Sequence) -> Vec<i32> {
        (0..sequence.tokens.len())
            .map(|t| sequence.label(t))
            .collect()
    }

    #[test]
    fn packing_frames_splits_and_concatenates() {
        let docs = plain(&[&[1, 10, 11], &[20, 21, 22, 23, 24, 25], &[30]]);
        // stream: 1 10 11 2 | 1 20 21 22 23 24 25 2 | 1 30 2
        let (packed, padding) = pack(&docs, &options(4));
        assert_eq!(padding, 0);
        let tokens: Vec<Vec<u32>> = packed.iter().map(|s| s.tokens.clone()).collect();
        assert_eq!(
            tokens,
            vec![vec![1, 10, 11, 2], vec![1, 20, 21, 22], vec![23, 24, 25, 2]]
        );
        assert!(
            packed.iter().all(|s| s.scored.is_none()),
            "plain text alone: every next token is a target"
        );
    }

    #[test]
    fn chat_labels_stop_at_document_boundaries() {
        const I: i32 = IGNORE_INDEX as i32;
        // Two chat records (prompt 0, answer 1) and a plain document, packed into sequences of 6.
        let docs = vec![
            chat(&[50, 51, 52, 53], &[0, 0, 1, 1]),
            chat(&[60, 61, 62], &[0, 1, 1]),
            Document::plain(vec![70, 71]),
        ];
        // The second record would straddle the boundary, so it starts the next sequence:
        // stream: 50 51 52 53 2 2 | 60 61 62 1 70 71 | 2 (the tail dropped)
        let (packed, padding) = pack(&docs, &options(6));
        assert_eq!(padding, 2);
        assert_eq!(packed.len(), 2);
        assert_eq!(packed[0].tokens, [50, 51, 52, 53, 2, 2]);
        assert_eq!(
            labels(&packed[0]),
            [I, I, 52, 53, I, I],
            "padding is never a target"
        );
        assert_eq!(packed[1].tokens, [60, 61, 62, 1, 70, 71]);
        assert_eq!(labels(&packed[1]), [I, 61, 62, I, 70, 71]);
        assert_eq!(packed[1].predictions(), 4);

        let (all, _) = pack(
            &docs,
            &PackOptions {
                loss_on: LossOn::All,
                ..options(5)
            },
        );
        // stream: 50 51 52 53 2 | 60 61 62 1 70 | 71 2: the first token of every document is
        // masked (BOS 1 of the plain one), the prompt's other tokens are targets.
        assert_eq!(labels(&all[0]), [I, 51, 52, 53, I]);
        assert_eq!(labels(&all[1]), [I, 61, 62, I, 70]);
        assert_eq!(all[1].predictions(), 3, "position 0 is never predicted");
    }

    #[test]
    fn chat_records_longer_than_a_sequence_are_split_and_plain_text_is_not_padded() {
        // A record of 7 tokens cannot fit in 4: it is cut as plain text is, with no padding.
        let docs = vec![
            Document::plain(vec![70, 71]),
            chat(&[50, 51, 52, 53, 54, 55, 56], &[0, 0, 0, 0, 1, 1, 1]),
            Document::plain(vec![80]),
        ];
        // stream: 1 70 71 2 | 50 51 52 53 | 54 55 56 1 | 80 2
        let (packed, padding) = pack(&docs, &options(4));
        assert_eq!(padding, 0);
        let tokens: Vec<Vec<u32>> = packed.iter().map(|s| s.tokens.clone()).collect();
        assert_eq!(
            tokens,
            vec![
                vec![1, 70, 71, 2],
                vec![50, 51, 52, 53],
                vec![54, 55, 56, 1]
            ]
        );
    }

    #[test]
    fn sequences_without_targets_are_left_out() {
        // A long prompt: its first window has no assistant token.
        let docs = vec![chat(&[1, 2, 3, 4, 5, 6, 7, 8], &[0, 0, 0, 0, 0, 1, 1, 1])];
        let corpus = Corpus::new(
            &docs,
            &PackOptions {
                val_fraction: 0.0,
                ..options(4)
            },
        )
        .unwrap();
        assert_eq!((corpus.train_len(), corpus.unscored), (1, 1));
        assert_eq!(corpus.train_sequence(0).tokens, [5, 6, 7, 8]);
        let none = vec![chat(&[1, 2, 3, 4], &[0, 0, 1, 0])];
        let error = Corpus::new(&none, &options(2)).err().unwrap().to_string();
        assert!(error.contains("no sequence of --seq-len 2"), "{error}");
    }

    #[test]
    fn order_is_deterministic_and_covers_each_epoch() {
        let docs: Vec<Document> = (0..40)
            .map(|i| Document::plain(vec![100 + i, 200 + i, 300 + i]))
            .collect();
        let a = Corpus::new(&docs, &options(5)).unwrap();
        let b = Corpus::new(&docs, &options(5)).unwrap();
        let n = a.train_len();
        // 40 documents framed as BOS + 3 tokens + EOS: 200 tokens, 40 sequences of 5.
        assert!(!a.val.is_empty() && n + a.val.len() == 40);
        let first: Vec<_> = (0..n).map(|i| a.train_sequence(i)).collect();
        let again: Vec<_> = (0..n).map(|i| b.train_sequence(i)).collect();
        assert_eq!(first, again);
        let mut sorted = first.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), n, "an epoch serves every sequence once");
        let second: Vec<_> = (n..2 * n).map(|i| a.train_sequence(i)).collect();
        assert_ne!(first, second, "epochs are reshuffled");
    }
}
