//! `passkey`: retrieval prompts as JSONL.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use lemo_models::tokenizer::Tokenizer;

#[derive(Debug, Args)]
pub struct PasskeyArgs {
    /// Tokenizer that measures the lengths (the model's).
    #[arg(long)]
    tokenizer: PathBuf,
    /// Prompt lengths in tokens, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096")]
    lengths: Vec<usize>,
    /// Prompts per length.
    #[arg(long, default_value_t = 10)]
    trials: usize,
    /// Seed of the passkeys and their depths.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output file [default: stdout].
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(args: PasskeyArgs) -> Result<()> {
    if let Some(out) = &args.out {
        lemo_train::modelio::check_output("--out", out, &[&args.tokenizer])?;
    }
    let tokenizer = Tokenizer::from_file(&args.tokenizer)?;
    let text =
        lemo_train::passkey::prompts_jsonl(&tokenizer, &args.lengths, args.trials, args.seed)?;
    match args.out {
        Some(path) => lemo_models::adapter::write_atomically(&path, text.as_bytes())?,
        None => print!("{text}"),
    }
    Ok(())
}
