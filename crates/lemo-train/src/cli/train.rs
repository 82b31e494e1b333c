//! `train`: the configuration resolved from defaults, a preset, a TOML file and the flags (or a
//! resumed run's saved configuration and the flags), then the run, then its summary.

use std::path::PathBuf;

use anyhow::Result;
use clap::{ArgMatches, Args};
use lemo_train::memory_budget::MemoryBudgetArgs;
use lemo_train::train::config::{Preset, TrainConfig};
use lemo_train::train::{TrainJob, interrupt};

#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Built-in setup: `tiny` trains a small random-init Llama on generated text on the CPU.
    #[arg(long, value_enum)]
    preset: Option<Preset>,
    /// TOML file with any of the options below (snake_case keys, e.g. `seq_len = 4096`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Continue a run: its folder (latest checkpoint) or one checkpoint folder.
    #[arg(long, conflicts_with_all = ["out", "overwrite"])]
    resume: Option<PathBuf>,
    /// Replace the run already in --out (its adapter, checkpoints, metrics and plots); without
    /// it a new run refuses a folder that holds one.
    #[arg(long)]
    overwrite: bool,
    /// Train even where the memory plan predicts the step will not fit in the device's free
    /// memory.
    #[arg(long)]
    skip_memory_plan: bool,
    #[command(flatten)]
    budget: MemoryBudgetArgs,
    #[command(flatten)]
    settings: TrainConfig,
}

pub fn run(args: TrainArgs, matches: &ArgMatches) -> Result<()> {
    let overrides = args.settings.given_on_command_line(matches)?;
    let (config, resume, start) = TrainConfig::requested(
        args.preset,
        args.config.as_deref(),
        args.resume.as_deref(),
        args.overwrite,
        &overrides,
    )?;
    let mut job = TrainJob::new(config, resume, start)?;
    job.skip_memory_plan = args.skip_memory_plan;
    job.budget = args.budget.resolve(job.device)?;
    // Under a launcher rank 0 reports the run; the other processes end quietly.
    let Some(summary) = job.train()? else {
        return Ok(());
    };
    print!("{summary}");
    if summary.interrupted {
        eprintln!(
            "interrupted after step {}: continue with `lemo-train train --resume {}`",
            summary.steps_done,
            summary.out.display()
        );
        std::process::exit(interrupt::EXIT_STATUS);
    }
    Ok(())
}
