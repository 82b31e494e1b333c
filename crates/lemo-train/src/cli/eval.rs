//! `eval`: perplexity (dense, or with token elimination), passkey retrieval, or LongBench-v2
//! multiple choice.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use lemo_train::data::chat::LossOn;
use lemo_train::eval::EvalJob;
use lemo_train::lemo::LemoSettings;
use lemo_train::longbench::{self, LongBenchJob};
use lemo_train::method::Method;
use lemo_train::modelio::ModelArgs;
use lemo_train::passkey::{PasskeyJob, PasskeyReport};

#[derive(Debug, Args)]
pub struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Plain text, JSONL (`text`, `input_ids` or a chat record per line), a raw token .bin, or a
    /// folder of these (perplexity); with --longbench, a LongBench-v2 JSONL file.
    #[arg(long, required_unless_present = "passkey")]
    data: Option<PathBuf>,
    /// Which predictions of chat records are scored: assistant (the answers, as `train` takes
    /// its loss) or all. Plain text: every token.
    #[arg(long, value_enum, default_value_t = LossOn::Assistant)]
    loss_on: LossOn,
    /// Passkey retrieval accuracy per length instead of perplexity.
    #[arg(long, conflicts_with = "longbench")]
    passkey: bool,
    /// Prompt lengths in tokens for --passkey, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048")]
    lengths: Vec<usize>,
    /// Prompts per length for --passkey.
    #[arg(long, default_value_t = 10)]
    trials: usize,
    /// Seed of the passkey prompts (keys and depths).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// With --passkey: each prompt, up to its question, as a user turn of the model's chat
    /// template (an instruct model's own format), the model answering as its assistant; a
    /// prompt and its markup together stay within --lengths.
    #[arg(long, requires = "passkey")]
    chat: bool,
    /// Multiple-choice accuracy on LongBench-v2 style JSONL given by --data, by log-likelihood.
    #[arg(long)]
    longbench: bool,
    /// Prompt budget for --longbench: longer contexts are cut in the middle.
    #[arg(long, default_value_t = 4096)]
    max_tokens: usize,
    /// Window length in tokens [default: the model's trained context].
    #[arg(long)]
    seq_len: Option<usize>,
    /// Distance between the starts of consecutive windows on long documents; a stride shorter
    /// than --seq-len scores tokens again with more context before them (LongLoRA uses 256)
    /// [default: --seq-len, each token scored once].
    #[arg(long)]
    stride: Option<usize>,
    /// Bytes per token id in .bin token files: 2 (u16) or 4 (u32).
    #[arg(long, default_value_t = 2)]
    token_width: u8,
    /// Print only `{"loss": .., "ppl": .., "tokens": ..}` on stdout.
    #[arg(long)]
    json: bool,
    /// lora: every token through every layer; lemo: perplexity with token elimination by
    /// --thresholds (default: the adapter's thresholds.json).
    #[arg(long, value_enum, default_value_t = Method::Lora)]
    method: Method,
    #[command(flatten)]
    lemo: LemoSettings,
}

pub fn run(args: EvalArgs) -> Result<()> {
    if args.stride == Some(0) {
        bail!("--stride must be at least 1");
    }
    if args.passkey || args.longbench {
        if args.method == Method::Lemo {
            bail!(
                "--method lemo scores perplexity only; passkey and LongBench run the model dense"
            );
        }
        return retrieval(args);
    }
    let (device, setup) = args.model.resolve()?;
    let data = args.data.clone().context("--data is required")?;
    let documents = args.model.read_documents(&data, args.token_width)?;
    let sparsity = (args.method == Method::Lemo).then_some(args.lemo);
    if let Some(settings) = &sparsity {
        settings.validate()?;
    }
    let job = EvalJob {
        model: args.model.model,
        documents,
        loss_on: args.loss_on,
        seq_len: args.seq_len,
        stride: args.stride,
        setup,
        sparsity,
    };
    job.check_request(device)?;
    let report = device.run(job)?;
    print(&report, args.json)
}

/// `--passkey` or `--longbench`.
fn retrieval(args: EvalArgs) -> Result<()> {
    let (device, setup) = args.model.resolve()?;
    let tokenizer = args.model.load_tokenizer()?;
    if args.passkey {
        let results = device.run(PasskeyJob {
            model: args.model.model,
            setup,
            tokenizer,
            lengths: args.lengths,
            trials: args.trials,
            seed: args.seed,
            chat: args.chat,
        })?;
        return print(&PasskeyReport(results), args.json);
    }
    let data = args.data.context("--longbench needs --data FILE.jsonl")?;
    let report = device.run(LongBenchJob {
        model: args.model.model,
        setup,
        tokenizer,
        samples: longbench::read_samples(&data)?,
        max_tokens: args.max_tokens,
    })?;
    print(&report, args.json)
}

/// A report as one JSON line (`--json`) or as text.
fn print(report: &(impl serde::Serialize + std::fmt::Display), json: bool) -> Result<()> {
    match json {
        true => println!("{}", serde_json::to_string(report)?),
        false => print!("{report}"),
    }
    Ok(())
}
