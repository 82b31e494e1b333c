//! What `calibrate`, `profile` and `train-predictors` read: the model, the data and the LeMo
//! settings, and the data packed into sequences as `train` packs them.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use lemo_models::ModelConfig;

use super::LemoSettings;
use crate::data::chat::LossOn;
use crate::data::corpus::{Corpus, PackOptions, default_cache_dir, read_model_documents};
use crate::data::{LazyTokenizer, special_ids};
use crate::modelio::ModelArgs;

/// What `calibrate`, `profile` and `train-predictors` read.
#[derive(Debug, Args, Clone)]
pub struct InspectArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text files, JSONL (`text` or `input_ids`), raw token .bin files, or a folder of these.
    #[arg(long)]
    pub data: PathBuf,
    /// Bytes per token id in .bin token files: 2 or 4.
    #[arg(long, default_value_t = 2)]
    pub token_width: u8,
    /// Sequence length in tokens [default: --target-context, else the model's trained context].
    #[arg(long)]
    pub seq_len: Option<usize>,
    #[command(flatten)]
    pub lemo: LemoSettings,
    /// calibrate: the thresholds file to write [default: thresholds.json];
    /// profile: the folder for profile.json and kept.svg [default: profile];
    /// train-predictors: the predictors file [default: predictors.safetensors].
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The first `count` sequences of `seq_len` tokens of `data`, packed as `train` packs them.
pub fn read_sequences(
    args: &InspectArgs,
    data: &Path,
    config: &ModelConfig,
    seq_len: usize,
    count: usize,
) -> Result<Vec<Vec<u32>>> {
    let mut tokenizer = LazyTokenizer::new(args.model.tokenizer_path());
    let documents = read_model_documents(
        data,
        args.token_width,
        &mut tokenizer,
        &args.model.model,
        default_cache_dir().as_deref(),
        config.vocab_size(),
    )?;
    let (bos, eos) = special_ids(config, &mut tokenizer);
    let corpus = Corpus::new(
        &documents,
        &PackOptions {
            seq_len,
            bos,
            eos,
            val_fraction: 0.0,
            seed: 0,
            // Calibration and predictors see every token: the sequences' tokens are what counts.
            loss_on: LossOn::All,
        },
    )?;
    Ok((0..count.min(corpus.train_len()))
        .map(|i| corpus.train_sequence(i).tokens)
        .collect())
}
