//! The `lemo-train` subcommands: one file of flags each, over the library.

mod bench;
mod eval;
mod generate;
mod lemo;
mod merge;
mod passkey;
mod tokenize;
mod train;

use anyhow::Result;
use clap::{ArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "lemo-train",
    version,
    about = "Long-context LoRA fine-tuning that spends memory only on the tokens that matter"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// LoRA fine-tuning for long context. Start with `train --preset tiny`.
    Train(Box<train::TrainArgs>),
    /// Mean next-token cross-entropy and perplexity of a model over a dataset; passkey
    /// retrieval; LongBench-v2 multiple choice.
    Eval(Box<eval::EvalArgs>),
    /// Per-layer token-elimination thresholds calibrated on your data toward --target-keep
    /// (written as JSON for `train --method lemo --thresholds`).
    Calibrate(Box<lemo_train::lemo::InspectArgs>),
    /// Informativeness statistics per layer and block type, and a heat map of kept token
    /// blocks (profile.json, kept.svg).
    Profile(Box<lemo_train::lemo::InspectArgs>),
    /// Per-layer predictors of token-block informativeness trained on your data against the
    /// model's exact scores, with their recall on held-out sequences (a safetensors file for
    /// `train --method lemo --predictors`).
    TrainPredictors(Box<lemo_train::lemo::TrainPredictorsArgs>),
    /// Time and memory of a few training steps of a random-init model, per sequence length
    /// (one JSON line each).
    Bench(Box<bench::BenchArgs>),
    /// Write passkey retrieval prompts (JSONL: text, passkey, depth, tokens, length).
    Passkey(passkey::PasskeyArgs),
    /// Continue a prompt (greedy by default) and print the prompt plus the continuation.
    Generate(Box<generate::GenerateArgs>),
    /// Fold a PEFT adapter into its base model: a Hugging Face folder (config, safetensors,
    /// tokenizer) that transformers loads, and optionally a GGUF file for llama.cpp.
    Merge(Box<merge::MergeArgs>),
    /// Token ids of a text (BOS included where the tokenizer adds it).
    Tokenize(tokenize::TokenizeArgs),
}

/// Parses the command line and runs the subcommand.
pub fn run() -> Result<()> {
    let matches = command()
        .try_get_matches()
        .unwrap_or_else(|error| exit_on(error));
    let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches)
        .unwrap_or_else(|error| exit_on(error));
    let subcommand = |name| -> &ArgMatches {
        matches
            .subcommand_matches(name)
            .expect("the parsed subcommand")
    };
    match cli.command {
        Command::Train(args) => train::run(*args, subcommand("train")),
        Command::Eval(args) => eval::run(*args),
        Command::Calibrate(args) => lemo::calibrate(*args),
        Command::Profile(args) => lemo::profile(*args),
        Command::TrainPredictors(args) => lemo::train_predictors(*args),
        Command::Bench(args) => bench::run(*args),
        Command::Passkey(args) => passkey::run(args),
        Command::Generate(args) => generate::run(*args),
        Command::Merge(args) => merge::run(*args),
        Command::Tokenize(args) => tokenize::run(args),
    }
}

/// The command line's grammar. Values may be negative numbers (`--temperature -1`), so that a
/// range check names the flag instead of clap reading the value as an unknown flag.
fn command() -> clap::Command {
    let mut command = <Cli as clap::CommandFactory>::command();
    let names: Vec<String> = command
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .collect();
    for name in names {
        command = command.mut_subcommand(name, |s| s.mut_args(|a| a.allow_negative_numbers(true)));
    }
    command
}

/// Help and version go to stdout as clap writes them; a parse error becomes one line, its
/// tips kept and the usage dropped, like every other error of the command.
fn exit_on(error: clap::Error) -> ! {
    if !error.use_stderr() {
        error.exit();
    }
    let text = error.render().to_string();
    let line: Vec<&str> = text
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .collect();
    eprintln!("{}", line.join(" "));
    std::process::exit(error.exit_code());
}
