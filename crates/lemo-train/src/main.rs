//! `lemo-train`: long-context LoRA fine-tuning of Llama, Mistral and OPT models.

mod data;
mod device;
mod eval;
mod generate;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use lemo_models::tokenizer::Tokenizer;

use crate::data::{LazyTokenizer, TokenWidth, find_tokenizer, read_documents};
use crate::device::DeviceKind;

#[derive(Parser)]
#[command(name = "lemo-train", version, about = "Long-context LoRA fine-tuning that spends memory only on the tokens that matter")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Mean next-token cross-entropy and perplexity of a model over a dataset.
    Eval {
        /// Hugging Face model folder (config.json + *.safetensors) or llama2.c .bin checkpoint.
        #[arg(long)]
        model: PathBuf,
        /// Plain text, JSONL (`text` or `input_ids` per line), a raw token .bin, or a folder of these.
        #[arg(long)]
        data: PathBuf,
        /// Window length in tokens [default: the model's trained context].
        #[arg(long)]
        seq_len: Option<usize>,
        /// Distance between the starts of consecutive windows on long documents.
        #[arg(long, default_value_t = 256)]
        stride: usize,
        /// Bytes per token id in .bin token files: 2 (u16) or 4 (u32).
        #[arg(long, default_value_t = 2)]
        token_width: u8,
        /// Tokenizer for text data [default: the one beside the model].
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// Print only `{"loss": .., "ppl": .., "tokens": ..}` on stdout.
        #[arg(long)]
        json: bool,
        #[arg(long, value_enum, default_value_t = DeviceKind::Auto)]
        device: DeviceKind,
    },
    /// Continue a prompt (greedy by default) and print the prompt plus the continuation.
    Generate {
        #[arg(long)]
        model: PathBuf,
        /// [default: the one beside the model]
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        #[arg(long)]
        prompt: String,
        #[arg(long, default_value_t = 256)]
        max_new_tokens: usize,
        /// 0 is greedy decoding.
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, value_enum, default_value_t = DeviceKind::Auto)]
        device: DeviceKind,
    },
    /// Token ids of a text (BOS included where the tokenizer adds it).
    Tokenize {
        /// tokenizer.json (Hugging Face) or tokenizer.bin (llama2.c).
        #[arg(long)]
        tokenizer: PathBuf,
        #[arg(long, conflicts_with = "file", required_unless_present = "file")]
        text: Option<String>,
        #[arg(long)]
        file: Option<PathBuf>,
        /// Print the ids as one JSON array.
        #[arg(long)]
        json: bool,
        /// Accepted for uniformity with the other subcommands; tokenizing runs on the CPU.
        #[arg(long, value_enum, default_value_t = DeviceKind::Auto)]
        device: DeviceKind,
    },
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Eval { model, data, seq_len, stride, token_width, tokenizer, json, device } => {
            let mut tokenizer = LazyTokenizer::new(tokenizer.or_else(|| find_tokenizer(&model)));
            let documents = read_documents(&data, TokenWidth::from_bytes(token_width)?, &mut tokenizer)?;
            let report = device.run(eval::EvalJob { model, documents, seq_len, stride })?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!("loss {:.6}  perplexity {:.4}  over {} predicted tokens", report.loss, report.ppl, report.tokens);
            }
        }
        Command::Generate { model, tokenizer, prompt, max_new_tokens, temperature, seed, device } => {
            let path = tokenizer
                .or_else(|| find_tokenizer(&model))
                .context("no tokenizer beside the model: pass --tokenizer")?;
            let tokenizer = Tokenizer::from_file(&path)?;
            device.run(generate::GenerateJob { model, tokenizer, prompt, max_new_tokens, temperature, seed })?;
        }
        Command::Tokenize { tokenizer, text, file, json, device: _ } => {
            let tokenizer = Tokenizer::from_file(&tokenizer)?;
            let text = match (text, file) {
                (Some(text), _) => text,
                (None, Some(file)) => {
                    std::fs::read_to_string(&file).with_context(|| format!("cannot read {}", file.display()))?
                }
                (None, None) => unreachable!("clap requires --text or --file"),
            };
            let ids = tokenizer.encode(&text)?;
            if json {
                println!("{}", serde_json::to_string(&ids)?);
            } else {
                for &id in &ids {
                    println!("{id}\t{:?}", tokenizer.decode(&[id]));
                }
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    // Errors from deep inside a backend surface as panics; show them as one line like any other.
    std::panic::set_hook(Box::new(|info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("unknown panic");
        eprintln!("error: internal failure: {}", message.lines().next().unwrap_or(""));
    }));
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", format!("{error:#}").replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}
