//! `lemo-train`: long-context LoRA fine-tuning of Llama, Mistral and OPT models.

mod bench;
mod corpus;
mod data;
mod device;
mod distributed;
mod eval;
mod generate;
mod longbench;
mod memory;
mod memory_plan;
mod merge;
mod modelio;
mod passkey;
mod preset;
mod sparsity;
mod train;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use lemo_models::tokenizer::Tokenizer;

use crate::corpus::{default_cache_dir, read_documents_cached};
use crate::data::{LazyTokenizer, TokenWidth, find_tokenizer};
use crate::device::{DeviceKind, PrecisionKind};

#[derive(Parser)]
#[command(
    name = "lemo-train",
    version,
    about = "Long-context LoRA fine-tuning that spends memory only on the tokens that matter"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// LoRA fine-tuning for long context. Start with `train --preset tiny`.
    Train(Box<train::config::TrainArgs>),
    /// Mean next-token cross-entropy and perplexity of a model over a dataset.
    Eval {
        /// Hugging Face model folder (config.json + *.safetensors), llama2.c .bin checkpoint or
        /// .gguf file.
        #[arg(long)]
        model: PathBuf,
        /// Plain text, JSONL (`text` or `input_ids` per line), a raw token .bin, or a folder of
        /// these (perplexity); with --longbench, a LongBench-v2 JSONL file.
        #[arg(long, required_unless_present = "passkey")]
        data: Option<PathBuf>,
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
        /// Multiple-choice accuracy on LongBench-v2 style JSONL given by --data, by log-likelihood.
        #[arg(long)]
        longbench: bool,
        /// Prompt budget for --longbench: longer contexts are cut in the middle.
        #[arg(long, default_value_t = 4096)]
        max_tokens: usize,
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
        /// Apply this PEFT adapter folder, with the RoPE scaling it was trained with.
        #[arg(long)]
        adapter: Option<PathBuf>,
        /// Linear RoPE position interpolation for this context (overrides the adapter's).
        #[arg(long)]
        target_context: Option<usize>,
        /// lora: every token through every layer; lemo: perplexity with token elimination by
        /// --thresholds (default: the adapter's thresholds.json).
        #[arg(long, value_enum, default_value_t = train::config::Method::Lora)]
        method: train::config::Method,
        #[command(flatten)]
        sparsity: sparsity::SparsityArgs,
        /// bf16 (model and activations; LoRA, gradients and optimizer f32) or f32
        /// [default: bf16 on cuda; f32 on cpu and wgpu, which have no bf16].
        #[arg(long, value_enum)]
        precision: Option<PrecisionKind>,
        /// auto (CUDA when an NVIDIA driver is present, else the CPU), cuda, wgpu or cpu.
        #[arg(long, value_enum, default_value_t = DeviceKind::Auto)]
        device: DeviceKind,
    },
    /// Per-layer token-elimination thresholds calibrated on your data toward --target-keep
    /// (written as JSON for `train --method lemo --thresholds`).
    Calibrate(Box<sparsity::InspectArgs>),
    /// Informativeness statistics per layer and block type, and a heat map of kept token
    /// blocks (profile.json, kept.svg).
    Profile(Box<sparsity::InspectArgs>),
    /// Per-layer predictors of token-block informativeness trained on your data against the
    /// model's exact scores, with their recall on held-out sequences (a safetensors file for
    /// `train --method lemo --predictors`).
    TrainPredictors(Box<sparsity::TrainPredictorsArgs>),
    /// Time and memory of a few training steps of a random-init model, per sequence length
    /// (one JSON line each).
    Bench {
        /// Hugging Face config.json (or a folder holding one), e.g. bench/configs/llama-2-7b.json,
        /// whose model gets random weights; or a .gguf file, whose own weights are used.
        #[arg(long)]
        model: PathBuf,
        /// lora (dense), longlora (S2 attention) or lemo (token elimination).
        #[arg(long, value_enum, default_value_t = train::config::Method::Lora)]
        method: train::config::Method,
        /// Sequence lengths, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "4096,8192")]
        seq_lens: Vec<usize>,
        /// Keep only each layer's input and recompute the layer in the backward pass.
        #[arg(long)]
        checkpointing: bool,
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
        sparsity: sparsity::SparsityArgs,
        /// bf16 (model and activations; LoRA, gradients and optimizer f32) or f32
        /// [default: bf16 on cuda; f32 on cpu and wgpu, which have no bf16].
        #[arg(long, value_enum)]
        precision: Option<PrecisionKind>,
        /// auto (CUDA when an NVIDIA driver is present, else the CPU), cuda, wgpu or cpu.
        #[arg(long, value_enum, default_value_t = DeviceKind::Auto)]
        device: DeviceKind,
    },
    /// Write passkey retrieval prompts (JSONL: text, passkey, depth, tokens, length).
    Passkey {
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
    },
    /// Continue a prompt (greedy by default) and print the prompt plus the continuation.
    Generate {
        /// Hugging Face model folder, llama2.c .bin checkpoint or .gguf file.
        #[arg(long)]
        model: PathBuf,
        /// tokenizer.json, llama2.c tokenizer .bin or .gguf [default: the one beside the model].
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// Text to continue.
        #[arg(long)]
        prompt: String,
        /// Tokens to generate at most (generation also stops at EOS).
        #[arg(long, default_value_t = 256)]
        max_new_tokens: usize,
        /// Sampling temperature; 0 is greedy decoding.
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        /// Seed of the sampling (temperature above 0).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Apply this PEFT adapter folder, with the RoPE scaling it was trained with.
        #[arg(long)]
        adapter: Option<PathBuf>,
        /// Linear RoPE position interpolation for this context (overrides the adapter's).
        #[arg(long)]
        target_context: Option<usize>,
        /// bf16 (model and activations; LoRA, gradients and optimizer f32) or f32
        /// [default: bf16 on cuda; f32 on cpu and wgpu, which have no bf16].
        #[arg(long, value_enum)]
        precision: Option<PrecisionKind>,
        /// auto (CUDA when an NVIDIA driver is present, else the CPU), cuda, wgpu or cpu.
        #[arg(long, value_enum, default_value_t = DeviceKind::Auto)]
        device: DeviceKind,
    },
    /// Fold a PEFT adapter into its base model: a Hugging Face folder (config, safetensors,
    /// tokenizer) that transformers loads, and optionally a GGUF file for llama.cpp.
    Merge(Box<merge::MergeArgs>),
    /// Token ids of a text (BOS included where the tokenizer adds it).
    Tokenize {
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
    },
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(args) => {
            // Under a launcher rank 0 reports the run; the other processes end quietly.
            let Some(summary) = run_train(*args)? else {
                return Ok(());
            };
            print_train_summary(&summary);
            if summary.interrupted {
                eprintln!(
                    "interrupted after step {}: continue with `lemo-train train --resume {}`",
                    summary.steps_done,
                    summary.out.display()
                );
                std::process::exit(train::interrupt::EXIT_STATUS);
            }
        }
        Command::Merge(args) => {
            let out = merge::run(*args)?;
            println!("{}", out.display());
        }
        Command::Calibrate(args) => {
            let path = sparsity::run_calibrate(*args)?;
            println!("{}", path.display());
        }
        Command::Profile(args) => {
            let path = sparsity::run_profile(*args)?;
            println!("{}", path.display());
        }
        Command::TrainPredictors(args) => {
            let path = sparsity::run_train_predictors(*args)?;
            println!("{}", path.display());
        }
        Command::Bench {
            model,
            method,
            seq_lens,
            checkpointing,
            steps,
            warmup,
            lora_rank,
            seed,
            out,
            sparsity,
            precision,
            device,
        } => {
            let device = device.resolve();
            let precision = device.precision(precision)?;
            let job = bench::BenchJob {
                sparsity: sparsity.settings(),
                config: model,
                method,
                seq_lens,
                checkpointing,
                steps: steps.max(1),
                warmup,
                lora_rank,
                seed,
                precision,
                device_watch: (device == DeviceKind::Cuda)
                    .then(memory::DeviceWatch::start)
                    .flatten(),
            };
            let results = device.run(job)?;
            if let Some(path) = out {
                lemo_models::adapter::write_atomically(
                    &path,
                    serde_json::to_string_pretty(&results)?.as_bytes(),
                )?;
            }
        }
        Command::Passkey {
            tokenizer,
            lengths,
            trials,
            seed,
            out,
        } => {
            let tokenizer = Tokenizer::from_file(&tokenizer)?;
            let mut text = String::new();
            for (length, prompt) in passkey::make_prompts(&tokenizer, &lengths, trials, seed)? {
                let mut record = serde_json::to_value(&prompt)?;
                record["length"] = length.into();
                text.push_str(&record.to_string());
                text.push('\n');
            }
            match out {
                Some(path) => lemo_models::adapter::write_atomically(&path, text.as_bytes())?,
                None => print!("{text}"),
            }
        }
        Command::Eval {
            model,
            data,
            passkey,
            lengths,
            trials,
            seed,
            longbench,
            max_tokens,
            adapter,
            target_context,
            precision,
            device,
            tokenizer,
            json,
            method,
            ..
        } if passkey || longbench => {
            require_model(&model)?;
            if method == train::config::Method::Lemo {
                anyhow::bail!(
                    "--method lemo scores perplexity only; passkey and LongBench run the model dense"
                );
            }
            let device = device.resolve();
            let precision = device.precision(precision)?;
            let path = tokenizer
                .or_else(|| find_tokenizer(&model))
                .context("no tokenizer beside the model: pass --tokenizer")?;
            let tokenizer = Tokenizer::from_file(&path)?;
            let setup = modelio::ModelSetup {
                adapter,
                target_context,
                precision,
            };
            if passkey {
                let results = device.run(passkey::PasskeyJob {
                    model,
                    setup,
                    tokenizer,
                    lengths,
                    trials,
                    seed,
                })?;
                if json {
                    println!("{}", serde_json::to_string(&results)?);
                } else {
                    for r in &results {
                        println!(
                            "passkey length {:>6}: {}/{} correct, accuracy {:.2}",
                            r.length, r.correct, r.trials, r.accuracy
                        );
                    }
                }
            } else {
                let samples =
                    longbench::read_samples(&data.context("--longbench needs --data FILE.jsonl")?)?;
                let report = device.run(longbench::LongBenchJob {
                    model,
                    setup,
                    tokenizer,
                    samples,
                    max_tokens,
                })?;
                if json {
                    println!("{}", serde_json::to_string(&report)?);
                } else {
                    println!(
                        "longbench: {}/{} correct, accuracy {:.3}",
                        report.correct, report.samples, report.accuracy
                    );
                }
            }
        }
        Command::Eval {
            model,
            data,
            seq_len,
            stride,
            token_width,
            tokenizer,
            json,
            adapter,
            target_context,
            method,
            sparsity,
            precision,
            device,
            ..
        } => {
            if stride == 0 {
                anyhow::bail!("--stride must be at least 1");
            }
            require_model(&model)?;
            let device = device.resolve();
            let precision = device.precision(precision)?;
            let data = data.context("--data is required")?;
            let tokenizer_path = tokenizer.or_else(|| find_tokenizer(&model));
            let mut tokenizer = LazyTokenizer::new(tokenizer_path.clone());
            let documents = read_documents_cached(
                &data,
                TokenWidth::from_bytes(token_width)?,
                &mut tokenizer,
                tokenizer_path.as_deref(),
                default_cache_dir().as_deref(),
            )?;
            let setup = modelio::ModelSetup {
                adapter,
                target_context,
                precision,
            };
            let sparsity = (method == train::config::Method::Lemo).then(|| sparsity.settings());
            if let Some(settings) = &sparsity {
                settings.validate()?;
            }
            let report = device.run(eval::EvalJob {
                model,
                documents,
                seq_len,
                stride,
                setup,
                sparsity,
            })?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!(
                    "loss {:.6}  perplexity {:.4}  over {} predicted tokens",
                    report.loss, report.ppl, report.tokens
                );
                if let (Some(attention), Some(mlp)) = (report.keep_attention, report.keep_mlp) {
                    println!("kept fraction: attention {attention:.3}, MLP {mlp:.3}");
                }
            }
        }
        Command::Generate {
            model,
            tokenizer,
            prompt,
            max_new_tokens,
            temperature,
            seed,
            adapter,
            target_context,
            precision,
            device,
        } => {
            require_model(&model)?;
            let device = device.resolve();
            let precision = device.precision(precision)?;
            let path = tokenizer
                .or_else(|| find_tokenizer(&model))
                .context("no tokenizer beside the model: pass --tokenizer")?;
            let tokenizer = Tokenizer::from_file(&path)?;
            device.run(generate::GenerateJob {
                model,
                tokenizer,
                prompt,
                max_new_tokens,
                temperature,
                seed,
                setup: modelio::ModelSetup {
                    adapter,
                    target_context,
                    precision,
                },
            })?;
        }
        Command::Tokenize {
            tokenizer,
            text,
            file,
            json,
            device: _,
        } => {
            let tokenizer = Tokenizer::from_file(&tokenizer)?;
            let text = match (text, file) {
                (Some(text), _) => text,
                (None, Some(file)) => std::fs::read_to_string(&file)
                    .with_context(|| format!("cannot read {}", file.display()))?,
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

/// A missing `--model` is named as such before anything looks for files beside it.
fn require_model(model: &std::path::Path) -> Result<()> {
    if !model.exists() {
        anyhow::bail!("--model {}: no such file or folder", model.display());
    }
    Ok(())
}

/// Resolves the configuration (defaults < preset < --config file < flags, or the resumed run's
/// saved configuration < flags) and trains.
fn run_train(args: train::config::TrainArgs) -> Result<Option<train::TrainSummary>> {
    use train::config::TrainConfig;
    use train::run_dir::Start;
    let overrides = args.overrides()?;
    let (config, resume) = if let Some(path) = &args.resume {
        let checkpoint = train::checkpoint::resolve(path)?;
        let run_dir = train::checkpoint::run_dir_of(&checkpoint).unwrap_or_else(|| path.clone());
        let saved = run_dir.join("config.toml");
        let mut base = TrainConfig::default().merged(&TrainConfig::from_toml_file(&saved)?)?;
        base.out = run_dir;
        (base.merged(&overrides)?, Some(checkpoint))
    } else {
        let mut config = args.preset.map(TrainConfig::preset).unwrap_or_default();
        if let Some(file) = &args.config {
            config = config.merged(&TrainConfig::from_toml_file(file)?)?;
        }
        (config.merged(&overrides)?, None)
    };
    let start = match (&resume, args.overwrite) {
        (Some(_), _) => Start::Resume,
        (None, true) => Start::Overwrite,
        (None, false) => Start::Fresh,
    };
    let launch = distributed::launch::Launch::from_env()?;
    let device = config.device.resolve();
    let job = train::TrainJob {
        precision: device.precision(config.precision)?,
        device,
        config,
        resume,
        start,
        skip_memory_plan: args.skip_memory_plan,
        launch,
    };
    if job.owns_out() {
        train::run_dir::prepare(&job.config.out, start)?;
    }
    job.device.run(job)
}

fn print_train_summary(summary: &train::TrainSummary) {
    let loss = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
    println!(
        "trained {} steps: loss {} -> {}, validation loss {}",
        summary.steps_done,
        loss(summary.first_loss),
        loss(summary.last_loss),
        loss(summary.val_loss)
    );
    println!("outputs in {}:", summary.out.display());
    if let Some(adapter) = &summary.adapter {
        println!("  adapter (PEFT)   {}", adapter.display());
    } else {
        println!(
            "  adapter          not written: the run stopped early; continue: --resume {}",
            summary.out.display()
        );
    }
    if let Some(checkpoint) = &summary.last_checkpoint {
        println!("  last checkpoint  {}", checkpoint.display());
    }
    println!("  metrics          {}", summary.metrics.display());
    for plot in &summary.plots {
        println!("  plot             {}", plot.display());
    }
}

fn main() -> ExitCode {
    // Errors from deep inside a backend surface as panics; show them as one line like any other.
    // Only the first is shown: on several GPUs the panics that follow (the other ranks, a device
    // left broken by the first) are its consequences, and the first names the cause.
    static REPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    std::panic::set_hook(Box::new(|info| {
        if REPORTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        // A rank's thread is named `rank-N`: say which GPU failed.
        let rank = std::thread::current()
            .name()
            .and_then(|name| name.strip_prefix("rank-"))
            .map(|rank| format!("rank {rank}: "))
            .unwrap_or_default();
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("unknown panic");
        let first_line = message.lines().next().unwrap_or("");
        if memory::is_out_of_memory(message) {
            eprintln!(
                "error: {rank}the device ran out of memory ({first_line}): try a shorter --seq-len (training: --checkpointing or a smaller --batch-size)"
            );
        } else {
            eprintln!("error: {rank}internal failure: {first_line}");
        }
        // For a bug report: where it failed, and how it got there.
        if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
            if let Some(location) = info.location() {
                eprintln!("  at {location}");
            }
            eprintln!("{}", std::backtrace::Backtrace::force_capture());
        }
    }));
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", format!("{error:#}").replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}
