//! `bench`: time and memory of a few training steps per sequence length.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;
use lemo_train::bench::BenchJob;
use lemo_train::device::{DeviceKind, Runtime};
use lemo_train::lemo::LemoSettings;
use lemo_train::memory::DeviceWatch;
use lemo_train::memory_budget::MemoryBudgetArgs;
use lemo_train::method::{Method, S2Settings};

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Hugging Face config.json (or a folder holding one), e.g. bench/configs/llama-2-7b.json,
    /// whose model gets random weights; or a .gguf file, whose own weights are used.
    #[arg(long)]
    model: PathBuf,
    /// lora (dense), longlora (S2 attention) or lemo (token elimination; with --s2, S2
    /// attention at the kept rows' positions).
    #[arg(long, value_enum, default_value_t = Method::Lora)]
    method: Method,
    #[command(flatten)]
    s2: S2Settings,
    /// Sequence lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4096,8192")]
    seq_lens: Vec<usize>,
    /// Keep only each layer's input and recompute every layer in the backward pass, whatever
    /// the memory budget.
    #[arg(long)]
    checkpointing: bool,
    #[command(flatten)]
    budget: MemoryBudgetArgs,
    /// Print each length's memory plan (or the one line saying why it cannot fit) and run no
    /// step: which lengths this card holds, and how, without the minutes a long step takes.
    #[arg(long)]
    plan_only: bool,
    /// Measured steps per length (the median is reported).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Unmeasured steps first (compilation, autotuning).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// LoRA rank of the adapters.
    #[arg(long, default_value_t = 8)]
    lora_rank: usize,
    /// Seed of the random weights, adapters and data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write all results as one JSON array to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// --method lemo: without --thresholds, every token-eliminating block keeps
    /// --target-keep of the token blocks of the bench's sequence (random weights have no
    /// loss to calibrate against).
    #[command(flatten)]
    lemo: LemoSettings,
    #[command(flatten)]
    runtime: Runtime,
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.steps == 0 || args.lora_rank == 0 {
        bail!("--steps and --lora-rank must be at least 1");
    }
    args.s2.validate(args.method)?;
    if let Some(len) = args.seq_lens.iter().find(|&&l| l < 2) {
        bail!("--seq-lens {len}: a sequence is at least 2 tokens");
    }
    if let Some(out) = &args.out {
        lemo_train::modelio::check_output("--out", out, &[&args.model])?;
    }
    let (device, precision) = args.runtime.resolve()?;
    let job = BenchJob {
        sparsity: args.lemo,
        config: args.model,
        method: args.method,
        s2: args.s2,
        seq_lens: args.seq_lens,
        checkpointing: args.checkpointing,
        plan_only: args.plan_only,
        budget: args.budget.resolve(device)?,
        steps: args.steps,
        warmup: args.warmup,
        lora_rank: args.lora_rank,
        seed: args.seed,
        device,
        precision,
        quantize_base: args.runtime.quantize_base(),
        device_watch: (device == DeviceKind::Cuda)
            .then(DeviceWatch::start)
            .flatten(),
    };
    let results = device.run(job)?;
    if let Some(path) = args.out {
        lemo_models::adapter::write_atomically(
            &path,
            serde_json::to_string_pretty(&results)?.as_bytes(),
        )?;
    }
    Ok(())
}
