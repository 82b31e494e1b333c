//! `tokenize`: token ids of a text.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use lemo_models::tokenizer::Tokenizer;
use lemo_train::device::DeviceKind;

#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// tokenizer.json (Hugging Face), tokenizer.bin (llama2.c) or a .gguf model.
    #[arg(long)]
    tokenizer: PathBuf,
    /// Text to tokenize.
    #[arg(long, conflicts_with = "file", required_unless_present = "file")]
    text: Option<String>,
    /// File whose text to tokenize.
    #[arg(long)]
    file: Option<PathBuf>,
    /// Print the ids as one JSON array.
    #[arg(long)]
    json: bool,
    /// Accepted for uniformity with the other subcommands; tokenizing runs on the CPU.
    #[arg(long, value_enum, default_value_t = DeviceKind::Auto)]
    device: DeviceKind,
}

pub fn run(args: TokenizeArgs) -> Result<()> {
    let tokenizer = Tokenizer::from_file(&args.tokenizer)?;
    let text = match (args.text, args.file) {
        (Some(text), _) => text,
        (None, Some(file)) => lemo_train::data::read_text(&file)?,
        (None, None) => unreachable!("clap requires --text or --file"),
    };
    let ids = tokenizer.encode(&text)?;
    if args.json {
        println!("{}", serde_json::to_string(&ids).context("ids as JSON")?);
    } else {
        for &id in &ids {
            println!("{id}\t{:?}", tokenizer.decode(&[id]));
        }
    }
    Ok(())
}
