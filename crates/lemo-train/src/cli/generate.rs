//! `generate`: continue a prompt.

use anyhow::{Result, bail};
use clap::Args;
use lemo_train::generate::GenerateJob;
use lemo_train::modelio::ModelArgs;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text to continue.
    #[arg(long)]
    prompt: String,
    /// Tokens to generate at most (generation also stops at EOS).
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Sampling: only the K likeliest tokens [default: all].
    #[arg(long)]
    top_k: Option<usize>,
    /// Sampling: only the likeliest tokens whose probabilities sum to P (nucleus sampling).
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Seed of the sampling (temperature above 0).
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        bail!(
            "--temperature {} must be a finite number, 0 (greedy) or more",
            args.temperature
        );
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p {} is outside (0, 1]", args.top_p);
    }
    if args.top_k == Some(0) {
        bail!("--top-k must be at least 1");
    }
    let (device, setup) = args.model.resolve()?;
    let tokenizer = args.model.load_tokenizer()?;
    device.run(GenerateJob {
        model: args.model.model,
        tokenizer,
        prompt: args.prompt,
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        setup,
    })
}
