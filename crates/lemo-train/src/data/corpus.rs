//! Training data: documents read from text, JSONL or token files (tokenized once, then cached),
//! packed into fixed-length sequences, split into training and validation sets, and served in a
//! deterministic order: epoch `e` visits the training sequences in the order of a shuffle seeded
//! by `seed + e`, so the sequence of any step is known without state (which is what makes
//! `--resume` continue with the same data order).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use burn_dataset::transform::ShuffledDataset;
use burn_dataset::{Dataset, InMemDataset};

use super::{LazyTokenizer, TokenWidth, read_jsonl, read_token_file};

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
}

type EpochOrder = ShuffledDataset<Arc<InMemDataset<Vec<u32>>>, Vec<u32>>;

/// Packed training and validation sequences.
pub struct Corpus {
    pub train: Arc<InMemDataset<Vec<u32>>>,
    pub val: InMemDataset<Vec<u32>>,
    pub documents: usize,
    /// Tokens in all packed sequences.
    pub tokens: usize,
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

fn encode_docs(docs: &[Vec<u32>]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend((docs.len() as u32).to_le_bytes());
    for doc in docs {
        out.extend((doc.len() as u32).to_le_bytes());
        for id in doc {
            out.extend(id.to_le_bytes());
        }
    }
    out
}

fn decode_docs(bytes: &[u8]) -> Option<Vec<Vec<u32>>> {
    let mut words = bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let count = words.next()?;
    // A corrupt file's count is not trusted with an allocation: it is checked against the bytes.
    let mut docs = Vec::with_capacity((count as usize).min(bytes.len() / 4));
    for _ in 0..count {
        let len = words.next()? as usize;
        let doc: Vec<u32> = words.by_ref().take(len).collect();
        if doc.len() != len {
            return None;
        }
        docs.push(doc);
    }
    words.next().is_none().then_some(docs)
}

/// Token documents of `path` (a file or a folder of files, in name order). Text is tokenized with
/// `tokenizer` and cached in `cache_dir` under a hash of the file's and the tokenizer's bytes.
pub fn read_documents_cached(
    path: &Path,
    width: TokenWidth,
    tokenizer: &mut LazyTokenizer,
    tokenizer_path: Option<&Path>,
    cache_dir: Option<&Path>,
) -> Result<Vec<Vec<u32>>> {
    let tokenizer_hash = match tokenizer_path {
        Some(p) => fnv1a(
            &std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?,
            FNV_OFFSET,
        ),
        None => FNV_OFFSET,
    };
    let mut documents = Vec::new();
    for file in list_files(path)? {
        let extension = file
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or("")
            .to_string();
        if extension == "bin" {
            documents.push(read_token_file(&file, width)?);
            continue;
        }
        let bytes =
            std::fs::read(&file).with_context(|| format!("cannot read {}", file.display()))?;
        let key = fnv1a(extension.as_bytes(), fnv1a(&bytes, tokenizer_hash));
        let cached = cache_dir.map(|d| d.join(format!("{key:016x}.tokens")));
        if let Some(docs) = cached
            .as_ref()
            .and_then(|c| std::fs::read(c).ok())
            .and_then(|b| decode_docs(&b))
        {
            documents.extend(docs);
            continue;
        }
        let docs = match extension.as_str() {
            "jsonl" | "json" => read_jsonl(&file, tokenizer)?,
            _ => {
                vec![tokenizer.get()?.encode(&super::read_text(&file)?)?]
            }
        };
        if let Some(cached) = cached {
            // A cache that cannot be written only costs time on the next run.
            if std::fs::create_dir_all(cached.parent().expect("cache file has a folder")).is_ok() {
                let _ = lemo_models::adapter::write_atomically(&cached, &encode_docs(&docs));
            }
        }
        documents.extend(docs);
    }
    documents.retain(|d| !d.is_empty());
    if documents.is_empty() {
        bail!("{}: no tokens in this data", path.display());
    }
    Ok(documents)
}

/// Concatenates the framed documents into one stream and cuts it into `seq_len` sequences: long
/// documents are split, short ones share a sequence. The incomplete tail is dropped.
pub fn pack(documents: &[Vec<u32>], options: &PackOptions) -> Vec<Vec<u32>> {
    let mut stream = Vec::with_capacity(documents.iter().map(|d| d.len() + 2).sum());
    for doc in documents {
        if let Some(bos) = options.bos
            && doc.first() != Some(&bos)
        {
            stream.push(bos);
        }
        stream.extend_from_slice(doc);
        if let Some(eos) = options.eos {
            stream.push(eos);
        }
    }
    stream
        .chunks_exact(options.seq_len)
        .map(<[u32]>::to_vec)
        .collect()
}

impl Corpus {
    pub fn new(documents: &[Vec<u32>], options: &PackOptions) -> Result<Self> {
        let sequences = pack(documents, options);
        let total: usize = documents.iter().map(Vec::len).sum();
        if sequences.is_empty() {
            bail!(
                "the data has {total} tokens in {} documents: not enough for one sequence of --seq-len {}",
                documents.len(),
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
            seed: options.seed,
            epoch: Mutex::new(None),
        })
    }

    pub fn train_len(&self) -> usize {
        self.train.len()
    }

    /// The `index`-th training sequence served (counting across epochs).
    pub fn train_sequence(&self, index: usize) -> Vec<u32> {
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
        }
    }

    #[test]
    fn packing_frames_splits_and_concatenates() {
        let docs = vec![vec![1, 10, 11], vec![20, 21, 22, 23, 24, 25], vec![30]];
        // stream: 1 10 11 2 | 1 20 21 22 23 24 25 2 | 1 30 2
        let packed = pack(&docs, &options(4));
        assert_eq!(
            packed,
            vec![vec![1, 10, 11, 2], vec![1, 20, 21, 22], vec![23, 24, 25, 2]]
        );
    }

    #[test]
    fn order_is_deterministic_and_covers_each_epoch() {
        let docs: Vec<Vec<u32>> = (0..40).map(|i| vec![100 + i, 200 + i, 300 + i]).collect();
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

    #[test]
    fn cache_round_trips() {
        let docs = vec![vec![1, 2, 3], vec![], vec![7]];
        assert_eq!(decode_docs(&encode_docs(&docs)).unwrap(), docs);
    }
}
