//! `bench`: a few training steps of a random-init model of any Hugging Face config, per sequence
//! length: median step time, tokens/s, memory after the forward pass and peak, or a clean
//! out-of-memory result. The same measurement in PyTorch + PEFT is
//! `bench/reference/peft_bench.py`; `bench/run_h200.sh` runs both and writes the comparison.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Tensor};
use lemo_kernels::{LemoBackend, host_reads};
use lemo_models::activation_plan::ActivationPlan;
use lemo_models::activation_plan::planner::Budget;
use lemo_models::loss::Batch;
use lemo_models::quantized::QuantizeBase;
use lemo_models::weights::WeightSource;
use lemo_models::{CausalLm, LoraConfig, ModelConfig};
use lemo_predictor::Predictors;
use serde::Serialize;

use crate::data::int_tokens;
use crate::device::{BackendJob, DeviceKind, PrecisionKind};
use crate::lemo::{self, Elimination, LemoSettings, sparse_keep};
use crate::memory::{self, DeviceWatch, gib};
use crate::memory_plan::{self, PlanInput, Planned};
use crate::method::{Method, S2Settings};
use crate::train::forward_backward;
use crate::train::optim::{self, AdamW, AdamWSettings, NamedTensors};
use lemo_models::token_plan::TokenPlan;
use lemo_sparsity::calibration::Block;

/// Uniform random weights with the standard deviation of Hugging Face's N(0, 0.02) init, ones for
/// norms, zeros for biases, drawn fast (xorshift over chunks on every core, not a normal
/// sampler); the values do not matter for time and memory.
pub struct FastRandomWeights {
    pub seed: u64,
}

/// Values of one tensor drawn per chunk, each chunk from its own seed, so the chunks run in
/// parallel and the values do not depend on the number of threads.
const RANDOM_CHUNK: usize = 1 << 20;

impl WeightSource for FastRandomWeights {
    fn fetch(&mut self, name: &str, shape: &[usize]) -> lemo_models::Result<Option<Vec<f32>>> {
        let count: usize = shape.iter().product();
        if name.ends_with(".bias") {
            return Ok(Some(vec![0.0; count]));
        }
        if name.contains("norm") && name.ends_with(".weight") {
            return Ok(Some(vec![1.0; count]));
        }
        let tensor_seed = crate::data::corpus::fnv1a(name.as_bytes(), self.seed | 1);
        let half_width = 0.02 * 3f32.sqrt();
        let fill = |index: usize, chunk: &mut [f32]| {
            let mut state = (tensor_seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1;
            for value in chunk {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *value = ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * half_width;
            }
        };
        let mut values = vec![0.0f32; count];
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let chunks: Vec<(usize, &mut [f32])> =
            values.chunks_mut(RANDOM_CHUNK).enumerate().collect();
        let per_thread = chunks.len().div_ceil(threads).max(1);
        std::thread::scope(|scope| {
            let mut chunks = chunks.into_iter();
            loop {
                let share: Vec<_> = chunks.by_ref().take(per_thread).collect();
                if share.is_empty() {
                    break;
                }
                scope.spawn(move || share.into_iter().for_each(|(i, c)| fill(i, c)));
            }
        });
        Ok(Some(values))
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    pub model: String,
    pub method: String,
    /// S2 attention's group size (`longlora`, `lemo --s2`); `None`: dense attention.
    pub s2_group: Option<usize>,
    pub seq_len: usize,
    pub checkpointing: bool,
    /// "bf16" or "f32" (`--precision`).
    pub precision: String,
    /// How the frozen projections were stored (`--quantize-base`).
    pub quantize_base: String,
    pub backend: String,
    pub oom: bool,
    pub error: Option<String>,
    pub steps: usize,
    pub step_time_s_median: Option<f64>,
    pub step_times_s: Vec<f64>,
    pub tokens_per_s: Option<f64>,
    pub peak_gib: Option<f64>,
    pub after_forward_gib: Option<f64>,
    /// "device" (CubeCL pool bytes in use, sampled) or "host-rss" (CPU backend).
    pub mem_source: String,
    pub trainable_params: usize,
    /// `--method lemo`: mean kept fraction of the token-eliminating attention and MLP blocks.
    pub keep_attention: Option<f64>,
    pub keep_mlp: Option<f64>,
    /// Device-level peak above the idle level (NVML, polled every 10 ms): pool reservations,
    /// workspaces and the CUDA context included, as `nvidia-smi` counts it. CUDA only.
    pub device_peak_gib: Option<f64>,
    /// The memory plan's prediction of the device peak for this run (`train` checks it before
    /// the first step).
    pub predicted_peak_gib: f64,
    /// (predicted - device peak) / device peak.
    pub predicted_error: Option<f64>,
    /// Each layer kept (k), recomputed (r) or offloaded (o), as the planner chose within the
    /// budget, and the plan line printed for it.
    pub activation_plan: Option<ActivationPlan>,
    pub plan: Option<String>,
    /// With predicted scores: seconds the attention predictors take per step, timed apart
    /// ([`predictor_seconds`]), and their parameters.
    pub predictor_s: Option<f64>,
    pub predictor_params: Option<usize>,
    /// Reads of device values by the host per timed step (each waits for the device to drain;
    /// see `lemo_kernels::host_reads`): the loss, and with token elimination by thresholds
    /// relative to the scores, one per token-eliminating block.
    pub host_syncs_per_step: Option<f64>,
}

pub struct BenchJob {
    pub config: PathBuf,
    pub method: Method,
    /// S2 attention (always with longlora; with lemo when asked).
    pub s2: S2Settings,
    pub seq_lens: Vec<usize>,
    /// Recompute every layer whatever the budget.
    pub checkpointing: bool,
    /// Plan each length and run nothing.
    pub plan_only: bool,
    /// What the activation plan may use (`None`: unknown, every layer kept).
    pub budget: Option<Budget>,
    pub steps: usize,
    pub warmup: usize,
    pub lora_rank: usize,
    pub seed: u64,
    /// The backend: the memory plan counts the CPU's attention scores.
    pub device: DeviceKind,
    pub precision: PrecisionKind,
    /// `--quantize-base`.
    pub quantize_base: QuantizeBase,
    /// `--method lemo`: thresholds from a file, or kept fractions on the bench's own sequence.
    pub sparsity: LemoSettings,
    /// Device-level memory watch, started before the backend creates its CUDA context.
    pub device_watch: Option<DeviceWatch>,
}

impl BackendJob for BenchJob {
    type Output = Vec<BenchResult>;

    fn run<B: LemoBackend>(self, device: B::Device) -> Result<Vec<BenchResult>> {
        run_on::<B>(self, device)
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

/// What the timed steps of one length measured.
struct Measured {
    times: Vec<f64>,
    /// Bytes in use at the peak and after the forward pass.
    peak: u64,
    after_forward: u64,
    /// The last step's token plan (`--method lemo`).
    plan: Option<TokenPlan>,
    /// Host reads of device values over the timed steps.
    host_reads: usize,
}

/// What the memory plan needs of a bench run: batch 1, the bench's 1024-token loss segment.
fn plan_input(job: &BenchJob, setup: &BenchSetup, seq_len: usize) -> PlanInput {
    PlanInput {
        model: setup.config.clone(),
        device: job.device,
        seq_len,
        batch_size: 1,
        context_parallel: 1,
        method: job.method,
        checkpointing: job.checkpointing,
        precision: job.precision,
        lora_rank: setup.lora.rank,
        lora_targets: setup.lora.target_modules.clone(),
        train_extras: setup.lora.train_embeddings || setup.lora.train_norms,
        loss_segment: LOSS_SEGMENT,
        target_keep: job.sparsity.mean_keep(),
        dense_layers: job.sparsity.dense_layers.len(),
        projection_bits: setup.projection_bits,
    }
}

/// Tokens whose logits one loss segment materializes.
const LOSS_SEGMENT: usize = 1024;

/// Seconds the attention predictors take for one training step's worth of scoring: every layer
/// they score, on a random block input of shape `input` in `dtype`, each layer's scores read
/// back to the host as selection reads them. The median of three timed passes after an untimed
/// one.
fn predictor_seconds<B: LemoBackend>(
    predictors: &Predictors,
    input: [usize; 3],
    dtype: DType,
    device: &B::Device,
) -> Result<f64> {
    let x = Tensor::<B, 3>::random(input, Distribution::Normal(0.0, 1.0), device).cast(dtype);
    let layers = predictors.header.num_layers;
    let mut times = Vec::new();
    for pass in 0..4 {
        let started = Instant::now();
        for layer in 0..layers {
            if let Some(scores) = predictors.token_block_scores(layer, x.clone()) {
                scores.into_data();
            }
        }
        B::sync(device).map_err(|e| anyhow::anyhow!("device error: {e:?}"))?;
        if pass > 0 {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

type AB<B> = Autodiff<B>;

/// What the bench reads of its model before building it, all that its memory plan needs.
struct BenchSetup {
    /// The config file's stem, which names the model in the results.
    name: String,
    /// A GGUF file, whose own weights the bench trains; else a Hugging Face config, with random
    /// weights.
    gguf: bool,
    config: ModelConfig,
    /// The adapters it adds.
    lora: LoraConfig,
    /// Bits per weight of the frozen projections where they are kept quantized.
    projection_bits: Option<f64>,
}

/// The bench model's config (a GGUF file's metadata, or a Hugging Face config), without its
/// weights.
fn bench_setup(job: &BenchJob) -> Result<BenchSetup> {
    let gguf = job.config.extension().is_some_and(|e| e == "gguf");
    let config = if gguf {
        lemo_models::model::open_checkpoint(&job.config)?.0
    } else {
        ModelConfig::from_file(&job.config)?
    };
    let projection_bits =
        lemo_models::quantized::projection_bits(&job.config, &config, job.quantize_base)?;
    let lora = LoraConfig {
        rank: job.lora_rank,
        alpha: 2.0 * job.lora_rank as f64,
        train_embeddings: job.s2.train_embeddings(job.method),
        train_norms: job.s2.train_norms(job.method),
        ..LoraConfig::default()
    };
    Ok(BenchSetup {
        name: job
            .config
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().to_string()),
        gguf,
        config,
        lora,
        projection_bits,
    })
}

/// What the bench trains: the model of `setup` with fresh LoRA adapters, a GGUF file's own
/// weights or random ones for a Hugging Face config.
fn bench_model<B: LemoBackend>(
    job: &BenchJob,
    setup: &BenchSetup,
    device: &B::Device,
) -> Result<CausalLm<AB<B>>> {
    AB::<B>::seed(device, job.seed);
    let (base, frozen) = if setup.gguf {
        let (base, _, frozen) = CausalLm::<AB<B>>::from_path_quantized(
            &job.config,
            device,
            job.precision.policy(),
            job.quantize_base,
        )?;
        (base, frozen)
    } else {
        CausalLm::<AB<B>>::build_quantized(
            &setup.config,
            &mut FastRandomWeights { seed: job.seed },
            device,
            job.precision.policy(),
            job.quantize_base,
        )?
    };
    frozen
        .lines()
        .iter()
        .for_each(|line| eprintln!("bench: {line}"));
    Ok(base
        .with_new_lora(&setup.lora, job.seed)?
        .set_extra_trainable(&setup.lora)?)
}

/// `seq_len`'s plan under the job's budget, and its result with nothing measured yet: the plan's
/// prediction, or the refusal as its error.
fn planned_result(
    job: &BenchJob,
    setup: &BenchSetup,
    seq_len: usize,
    backend: String,
    trainable: usize,
) -> (BenchResult, Option<Planned>) {
    let planned = memory_plan::plan(&plan_input(job, setup, seq_len), job.budget);
    let mut result = BenchResult::unmeasured(
        job,
        &setup.name,
        seq_len,
        backend,
        trainable,
        planned.as_ref().ok(),
    );
    if let Err(error) = &planned {
        eprintln!("bench: {seq_len} tokens: {error:#}");
        result.error = Some(format!("{error:#}"));
    }
    (result, planned.ok())
}

/// Prints `result` as one line of JSON and keeps it.
fn emit(results: &mut Vec<BenchResult>, result: BenchResult) -> Result<()> {
    println!("{}", serde_json::to_string(&result)?);
    results.push(result);
    Ok(())
}

impl BenchResult {
    /// A result with nothing measured yet, and the memory plan's prediction.
    fn unmeasured(
        job: &BenchJob,
        name: &str,
        seq_len: usize,
        backend: String,
        trainable_params: usize,
        planned: Option<&Planned>,
    ) -> Self {
        Self {
            model: name.into(),
            method: job.method.name().into(),
            s2_group: job.s2.group(job.method, seq_len).ok().flatten(),
            seq_len,
            checkpointing: job.checkpointing,
            precision: job.precision.name().into(),
            quantize_base: job.quantize_base.name().into(),
            backend,
            oom: false,
            error: None,
            steps: job.steps,
            step_time_s_median: None,
            step_times_s: Vec::new(),
            tokens_per_s: None,
            peak_gib: None,
            after_forward_gib: None,
            mem_source: memory::source().into(),
            trainable_params,
            keep_attention: None,
            keep_mlp: None,
            device_peak_gib: None,
            predicted_peak_gib: planned.map_or(0.0, |p| gib(p.memory.total as u64)),
            predicted_error: None,
            activation_plan: planned.map(|p| p.activations.clone()),
            plan: planned.map(Planned::line),
            predictor_s: None,
            predictor_params: None,
            host_syncs_per_step: None,
        }
    }

    /// Fills in what the timed steps measured, and the device-level peak since the last reset.
    fn record(&mut self, measured: Measured, device_watch: Option<&DeviceWatch>) {
        let Measured {
            times,
            peak,
            after_forward,
            plan,
            host_reads,
        } = measured;
        self.host_syncs_per_step = Some(host_reads as f64 / times.len().max(1) as f64);
        if let Some(plan) = plan {
            self.keep_attention = Some(sparse_keep(&plan, Block::Attention));
            self.keep_mlp = Some(sparse_keep(&plan, Block::Mlp));
        }
        let mut sorted = times.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        self.step_time_s_median = Some(median);
        self.tokens_per_s = Some(self.seq_len as f64 / median);
        self.step_times_s = times;
        self.peak_gib = Some(gib(peak));
        self.after_forward_gib = Some(gib(after_forward));
        if let Some(watch) = device_watch {
            let device_peak = gib(watch.take_peak());
            let error = (self.predicted_peak_gib - device_peak) / device_peak;
            self.device_peak_gib = Some(device_peak);
            self.predicted_error = Some(error);
            eprintln!(
                "bench: {} tokens: device peak {device_peak:.1} GiB, memory plan {:.1} GiB ({:+.1}%)",
                self.seq_len,
                self.predicted_peak_gib,
                100.0 * error
            );
        }
    }

    /// A length that failed: `message`, and whether the device ran out of memory.
    fn failed(&mut self, message: String) {
        self.oom = memory::is_out_of_memory(&message);
        self.error = Some(message);
    }
}

/// `job.warmup` untimed steps, then `job.steps` timed ones, of `model` on the one sequence of
/// `sequences`.
fn measure<B: LemoBackend>(
    job: &BenchJob,
    model: &CausalLm<AB<B>>,
    sequences: &[Vec<u32>],
    activations: &ActivationPlan,
    elimination: Option<&Elimination>,
    device: &B::Device,
) -> Result<Measured> {
    let mut model = model.clone();
    let mut optimizer = AdamW::<B>::new(AdamWSettings::default());
    let (mut times, mut peak, mut after_forward) = (Vec::new(), 0u64, 0u64);
    let mut plan = None;
    let mut reads_before_timing = host_reads::count();
    let scale = 1.0 / (sequences[0].len() - 1) as f64;
    for step in 0..job.warmup + job.steps {
        if step == job.warmup {
            reads_before_timing = host_reads::count();
        }
        let t0 = Instant::now();
        let mut grads = NamedTensors::<B>::new();
        let batch = Batch::new(int_tokens::<AB<B>>(sequences, device), None);
        let mut token_sparsity = lemo::token_sparsity(elimination);
        let (_, _, mem) = forward_backward(
            &model,
            batch,
            LOSS_SEGMENT,
            scale,
            activations,
            &mut token_sparsity,
            &mut grads,
        );
        plan = token_sparsity.into_plan();
        let after_backward = memory::sample().in_use;
        let params = optim::trainable_values::<AB<B>, _>(&model);
        let updated = optimizer.step(params, &grads, 1e-4);
        drop(grads);
        model = optim::set_trainable(model, updated)?;
        AB::<B>::sync(device).map_err(|e| anyhow::anyhow!("device error: {e:?}"))?;
        let elapsed = t0.elapsed().as_secs_f64();
        if step >= job.warmup {
            times.push(elapsed);
            after_forward = after_forward.max(mem);
            peak = peak
                .max(mem)
                .max(after_backward)
                .max(memory::sample().in_use)
                .max(memory::sample().os_peak);
        }
    }
    Ok(Measured {
        times,
        peak,
        after_forward,
        plan,
        host_reads: host_reads::count() - reads_before_timing,
    })
}

fn run_on<B: LemoBackend>(job: BenchJob, device: B::Device) -> Result<Vec<BenchResult>> {
    if job.method == Method::Lemo {
        job.sparsity.validate()?;
    }
    let setup = bench_setup(&job)?;
    let mut results = Vec::new();
    if job.plan_only {
        // The plan needs the config alone: no weights are made, so any model plans anywhere.
        for &seq_len in &job.seq_lens {
            let trainable = memory_plan::trainable_parameters(&plan_input(&job, &setup, seq_len));
            let (result, _) = planned_result(&job, &setup, seq_len, B::name(&device), trainable);
            emit(&mut results, result)?;
        }
        return Ok(results);
    }
    let started = Instant::now();
    let mut model = bench_model::<B>(&job, &setup, &device)?;
    let config = &setup.config;
    let trainable = optim::trainable_count::<AB<B>, _>(&model);
    eprintln!(
        "bench: {} built in {:.1}s ({trainable} trainable parameters, {})",
        setup.name,
        started.elapsed().as_secs_f64(),
        job.precision.name()
    );
    let mut ran_out = false;
    for &seq_len in &job.seq_lens {
        let (mut result, planned) =
            planned_result(&job, &setup, seq_len, B::name(&device), trainable);
        match (planned, ran_out) {
            (None, _) => {}
            (Some(_), true) => {
                result.oom = true;
                result.error = Some("skipped: a shorter sequence already ran out of memory".into());
            }
            (Some(planned), false) => {
                model.set_shifted_group(job.s2.group(job.method, seq_len)?);
                let tokens: Vec<u32> = (0..seq_len)
                    .map(|i| ((i as u64 * 2654435761) % config.vocab_size() as u64) as u32)
                    .collect();
                let elimination = if job.method == Method::Lemo {
                    job.sparsity.check_sequence(&model, seq_len)?;
                    Some(lemo::bench_elimination::<B>(
                        &job.sparsity,
                        config,
                        &device,
                    )?)
                } else {
                    None
                };
                B::memory_cleanup(&device);
                lemo_kernels::memory::set_pool_budget::<B>(&device, planned.pool_budget());
                if let Some(watch) = &job.device_watch {
                    watch.take_peak();
                }
                let activations = &planned.activations;
                let outcome = catch_unwind(AssertUnwindSafe(|| {
                    let sequences = std::slice::from_ref(&tokens);
                    measure::<B>(
                        &job,
                        &model,
                        sequences,
                        activations,
                        elimination.as_ref(),
                        &device,
                    )
                }));
                match outcome {
                    Ok(Ok(measured)) => {
                        result.record(measured, job.device_watch.as_ref());
                        let predictors = elimination.as_ref().and_then(|e| e.predictors.as_ref());
                        if let Some(predictors) = predictors {
                            let input = [1, seq_len, config.hidden_size()];
                            let dtype = model.lm_head_weight().dtype();
                            result.predictor_s =
                                Some(predictor_seconds::<B>(predictors, input, dtype, &device)?);
                            result.predictor_params = Some(predictors.num_params());
                        }
                    }
                    Ok(Err(error)) => result.failed(format!("{error:#}")),
                    Err(payload) => {
                        let message = panic_message(payload.as_ref());
                        result.failed(message.lines().next().unwrap_or("").to_string())
                    }
                }
                ran_out |= result.oom;
            }
        }
        emit(&mut results, result)?;
    }
    Ok(results)
}
