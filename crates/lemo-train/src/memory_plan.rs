//! The memory plan: the device peak of a training step predicted from the model config,
//! sequence length, batch, method, precision and which layers keep, recompute or offload their
//! activations, before anything is loaded; and the activation plan itself, the fastest that fits
//! the memory budget (`--memory-budget`, `--host-memory-budget`), so that a run that cannot fit
//! is refused at once with the length and the budget that would fit.
//!
//! peak = fixed + weights + trainable state + loss segment + activations, where
//! - weights: every parameter at the frozen precision, but projections kept quantized
//!   (`--quantize-base`, a GGUF base) at their quantized size; a layer dequantizes them per
//!   product, so its graph (kept, or rebuilt for its backward pass) holds them dense besides;
//! - trainable state: LoRA (and LongLoRA's embeddings and norms) in f32 with its gradient and
//!   two AdamW moments, 16 bytes a parameter;
//! - loss segment: logits, probabilities and their gradient of one `loss_segment` in f32;
//! - activations per token and layer: `ACTIVATION_SCALE * (9 hidden + 5 intermediate)`
//!   elements at the activation precision (the inputs of the projections, attention and MLP
//!   products a LoRA step saves; a frozen norm keeps its output, which the adapters after it
//!   save anyway, so the norms add nothing); a kept layer keeps them (`lemo`: the kept fraction
//!   of them, plus the residual row every token keeps and the input rows each MLP block drops,
//!   from which its backward pass recomputes them), a recomputed one only its input, and
//!   `RECOMPUTE_LAYERS` layers' worth is live while a recomputed layer's backward pass runs;
//!   an offloaded layer keeps its input in host memory (see [`cost_table`]);
//! - fixed: the CUDA context, library workspaces and pool slack.
//!
//! The three constants were fitted to device-level peaks (nvidia-smi) of Llama-2-7B `lora`
//! steps on the H200 (`bench/results/h200-device-peaks.json`): 8K and 16K fixed the per-token
//! slope and the fixed part, checkpointed 32K the recomputation term. Exact-size activation
//! buffers and norms that keep their output have since lowered the 8K peak more than the 16K
//! one; the slope was refitted to 16K with the fixed part kept, and the plan over-predicts 8K by
//! 6% (the safe side). `lemo` differs from that formula by an amount fitted to its own peaks
//! there and scaled by the weights' size: without checkpointing it holds less (its blocks'
//! buffers are smaller, so the pool pads less; the mean of 8K and 16K, each within 2 GiB), with
//! checkpointing more (a rebuilt layer's kept-row buffers, of sizes the dense layers' pages do
//! not serve).

use anyhow::{Result, bail};
use lemo_models::ModelConfig;
use lemo_models::activation_plan::planner::{self, Budget, CostTable, LayerCost};
use lemo_models::activation_plan::{ActivationPlan, LayerActivations};

use crate::device::{DeviceKind, PrecisionKind};
use crate::memory::gib;
use crate::method::Method;

const GIB: f64 = (1u64 << 30) as f64;
const ACTIVATION_SCALE: f64 = 0.530;
const FIXED_GIB: f64 = 2.93;
const RECOMPUTE_LAYERS: f64 = 1.69;
/// What lemo adds to the formula on Llama-2-7B, per GiB of bf16 weights: to a kept layer, and to
/// a rebuilt one (fitted to the H200 peak at 32K with every layer recomputed, 28.2 GiB:
/// `bench/results/h200-rebuild-without-mlp-pass.json`).
const LEMO_OFFSET_PER_WEIGHT_GIB: [f64; 2] = [-2.62 / 12.55, 1.90 / 12.55];
/// A plan mixing kept and recomputed layers holds a dense layer's forward working memory besides
/// (see [`cost_table`]), `lemo` this many: the pages beside a kept layer's forward pass that its
/// kept-row buffers and the full-width transients below cannot share (fitted to H100 peaks,
/// `bench/results/h100-idle-buffers.json`: 64K, 9 of 32 kept, 74.2 GiB; 32K, 13 kept, 50.2).
/// On the H200 (`bench/results/h200-mixed-plans.json`) it puts Llama-2-7B's mixed plans 1-5%
/// over their peaks at 32K-128K, but Llama-3-8B's 15-26% over at 96K-128K. One extra input per
/// kept layer instead (1.5 of them fitted the first three of those peaks) failed on the next
/// five: Llama-2-7B at 128K peaked 3.7% over its plan, past the budget, while Llama-3-8B
/// stayed 10-13% under its plans.
const LEMO_MIXED_LAYERS: f64 = 2.23;
/// What a recomputation runs at (bf16 GEMM and attention of a Llama-7B layer on an H100): only
/// the ratio of recomputation to copy time matters to the plan.
const RECOMPUTE_FLOPS: f64 = 200e12;
/// What an offloaded layer adds to a step per byte of its input: its copies to page-locked host
/// memory and back run on a copy stream beside the compute (`lemo_kernels::host_copy`) and hide
/// behind it but for this. Measured on an H200 (`bench/results/h200-offload.json`, Llama-2-7B
/// dense at 32K, one call): 30 of 32 layers offloaded 5.38 s a step against 5.26 s recomputing
/// every layer, 4 ms per 256 MiB input. Priced so, the planner offloads only where recomputing
/// does not fit, and then the layers whose copies cost least.
const HOST_COPY_EXPOSED_BYTES_PER_S: f64 = 64e9;
/// On the CPU backend attention is the plain reference, which materializes one layer's scores
/// at a time, at its peak (forward or backward) `HOST_MASK_BYTES` per query head and position
/// pair (the causal mask and the positions it is built from, shared by a batch's sequences)
/// plus `HOST_SCORE_BYTES` per score of each sequence (scores, probabilities and their
/// gradients). Fitted with `HOST_FIXED_GIB` to stories260K's host peaks (maximum resident set) in
/// `train`: 1024 / 2048 / 3072 / 4096 tokens 0.35 / 1.03 / 2.14 / 3.78 GiB, batch 2 at 2048
/// 1.16 GiB, each within 4%.
const HOST_MASK_BYTES: f64 = 24.75;
const HOST_SCORE_BYTES: f64 = 4.48;
/// A CPU run's process, runtime and data besides the model (there is no device context).
const HOST_FIXED_GIB: f64 = 0.11;

/// What a step's memory depends on.
#[derive(Debug, Clone)]
pub struct PlanInput {
    pub model: ModelConfig,
    /// The CPU backend holds a layer's attention scores; the GPU backends never do.
    pub device: DeviceKind,
    /// Tokens of each sequence (the whole sequence under context parallelism).
    pub seq_len: usize,
    pub batch_size: usize,
    /// Ranks each sequence is split over (context parallelism; 1: none): a rank holds its share
    /// of the tokens, and each layer's graph the keys and values of every position.
    pub context_parallel: usize,
    pub method: Method,
    pub checkpointing: bool,
    pub precision: PrecisionKind,
    pub lora_rank: usize,
    pub lora_targets: Vec<String>,
    /// Trainable embeddings and norms (LongLoRA).
    pub train_extras: bool,
    pub loss_segment: usize,
    /// lemo: kept fraction of the token-eliminating layers, and the layers kept dense.
    pub target_keep: f64,
    pub dense_layers: usize,
    /// Bits a value of the frozen projections kept quantized; `None`: dense.
    pub projection_bits: Option<f64>,
}

/// The predicted peak and its parts, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct MemoryPlan {
    pub fixed: f64,
    pub weights: f64,
    pub trainable: f64,
    pub loss: f64,
    pub activations: f64,
    pub total: f64,
}

/// Sizes of the model that memory depends on.
struct Dims {
    vocab: f64,
    hidden: f64,
    intermediate: f64,
    layers: f64,
    q_heads: f64,
    q_dim: f64,
    kv_dim: f64,
    /// Matrices of the MLP: 3 for SwiGLU, 2 for OPT's.
    mlp_matrices: f64,
    tied: bool,
}

impl Dims {
    fn of(config: &ModelConfig) -> Self {
        match config {
            ModelConfig::Llama(c) => Self {
                vocab: c.vocab_size as f64,
                hidden: c.hidden_size as f64,
                intermediate: c.intermediate_size as f64,
                layers: c.num_hidden_layers as f64,
                q_heads: c.num_attention_heads as f64,
                q_dim: (c.num_attention_heads * c.head_dim) as f64,
                kv_dim: (c.num_key_value_heads * c.head_dim) as f64,
                mlp_matrices: 3.0,
                tied: c.tie_word_embeddings,
            },
            ModelConfig::Opt(c) => Self {
                vocab: c.vocab_size as f64,
                hidden: c.hidden_size as f64,
                intermediate: c.ffn_dim as f64,
                layers: c.num_hidden_layers as f64,
                q_heads: c.num_attention_heads as f64,
                q_dim: c.hidden_size as f64,
                kv_dim: c.hidden_size as f64,
                mlp_matrices: 2.0,
                tied: true,
            },
        }
    }

    fn layer_parameters(&self) -> f64 {
        self.layer_projections() + 2.0 * self.hidden
    }

    /// Values of a layer's projection matrices.
    fn layer_projections(&self) -> f64 {
        let attention = self.hidden * (2.0 * self.q_dim + 2.0 * self.kv_dim);
        attention + self.mlp_matrices * self.hidden * self.intermediate
    }

    fn parameters(&self) -> f64 {
        let embeddings = self.vocab * self.hidden * if self.tied { 1.0 } else { 2.0 };
        embeddings + self.layers * self.layer_parameters() + self.hidden
    }

    /// `(in, out)` of a targeted projection.
    fn projection(&self, name: &str) -> (f64, f64) {
        match name {
            "q_proj" => (self.hidden, self.q_dim),
            "k_proj" | "v_proj" => (self.hidden, self.kv_dim),
            "o_proj" | "out_proj" => (self.q_dim, self.hidden),
            "down_proj" | "fc2" => (self.intermediate, self.hidden),
            _ => (self.hidden, self.intermediate),
        }
    }
}

fn element_bytes(precision: PrecisionKind) -> f64 {
    match precision {
        PrecisionKind::Bf16 => 2.0,
        PrecisionKind::F32 => 4.0,
    }
}

/// Everything the activation plan leaves as it is, in bytes.
struct Fixed {
    fixed: f64,
    weights: f64,
    trainable: f64,
    loss: f64,
    /// One layer's attention scores at a time (the CPU backend).
    attention: f64,
}

/// Parameters a step trains: LoRA's, and LongLoRA's embeddings and norms.
pub fn trainable_parameters(input: &PlanInput) -> usize {
    let dims = Dims::of(&input.model);
    let lora: f64 = input
        .lora_targets
        .iter()
        .map(|t| {
            let (inp, out) = dims.projection(t);
            input.lora_rank as f64 * (inp + out)
        })
        .sum::<f64>()
        * dims.layers;
    let extras = if input.train_extras {
        dims.vocab * dims.hidden + dims.layers * 2.0 * dims.hidden
    } else {
        0.0
    };
    (lora + extras) as usize
}

fn fixed_parts(input: &PlanInput, dims: &Dims) -> Fixed {
    let frozen_bytes = element_bytes(input.precision);
    let projections = dims.layers * dims.layer_projections();
    let projection_bytes = input
        .projection_bits
        .map_or(frozen_bytes, |bits| bits / 8.0);
    let on_host = input.device == DeviceKind::Cpu;
    Fixed {
        fixed: if on_host { HOST_FIXED_GIB } else { FIXED_GIB } * GIB,
        weights: (dims.parameters() - projections) * frozen_bytes + projections * projection_bytes,
        trainable: trainable_parameters(input) as f64 * 16.0,
        loss: input.loss_segment.min(input.seq_len) as f64 * dims.vocab * 4.0 * 3.0,
        attention: if on_host {
            host_attention_bytes(dims.q_heads, input.seq_len, input.batch_size)
        } else {
            0.0
        },
    }
}

/// Bytes the CPU backend's reference attention holds at its peak for `batch` sequences of
/// `seq_len` tokens under `q_heads` query heads (one layer at a time).
pub fn host_attention_bytes(q_heads: f64, seq_len: usize, batch: usize) -> f64 {
    (HOST_MASK_BYTES + HOST_SCORE_BYTES * batch as f64) * q_heads * (seq_len as f64).powi(2)
}

/// What each layer costs kept, recomputed or offloaded (see
/// [`lemo_models::activation_plan::planner`]). A layer's graph is `ACTIVATION_SCALE * (9 hidden
/// + 5 intermediate)` elements per token (`lemo`: its kept fraction of them, the residual row
/// every token keeps and the input rows its MLP block drops); a rebuilt one holds its graph
/// again, and either needs `RECOMPUTE_LAYERS - 1` graphs' worth of working memory beside it
/// during its backward pass (the measured all-kept peaks include it in `ACTIVATION_SCALE`, so
/// they are over-predicted by that much at the top layer); a plan mixing kept and recomputed
/// layers holds a dense layer's forward working memory besides. `lemo`'s offsets are spread
/// over the layers they come from: the smaller pool padding of kept graphs, the kept-row buffers
/// of a rebuilt layer. Times are forward FLOPs at `RECOMPUTE_FLOPS` and input bytes
/// at `HOST_COPY_EXPOSED_BYTES_PER_S`.
pub fn cost_table(input: &PlanInput) -> CostTable {
    let dims = Dims::of(&input.model);
    let parts = fixed_parts(input, &dims);
    let activation_bytes = element_bytes(input.precision);
    let sequence_tokens = (input.seq_len * input.batch_size) as f64;
    let tokens = sequence_tokens / input.context_parallel.max(1) as f64;
    // The keys and values a split sequence's attention gathers, which its graph saves.
    let gathered = match input.context_parallel {
        0 | 1 => 0.0,
        _ => 2.0 * dims.kv_dim * activation_bytes * sequence_tokens,
    };
    let layer = ACTIVATION_SCALE
        * (9.0 * dims.hidden + 5.0 * dims.intermediate)
        * activation_bytes
        * tokens;
    let residual = dims.hidden * activation_bytes * tokens;
    let bf16_weights = dims.parameters() * 2.0;
    let layers = dims.layers as usize;
    let lemo = input.method == Method::Lemo;
    let [kept_offset, rebuilt_offset] =
        LEMO_OFFSET_PER_WEIGHT_GIB.map(|o| if lemo { o * bf16_weights } else { 0.0 });
    let flops = tokens * (2.0 * dims.layer_parameters() + 2.0 * sequence_tokens * dims.q_dim);
    let recompute_ns = flops / RECOMPUTE_FLOPS * 1e9;
    let exposed_copy_ns = residual / HOST_COPY_EXPOSED_BYTES_PER_S * 1e9;
    // A layer's projections dequantized: in its graph while it is kept or rebuilt.
    let dequantized = match input.projection_bits {
        Some(_) => dims.layer_projections() * element_bytes(input.precision),
        None => 0.0,
    };
    let layer_cost = |index: usize| {
        let sparse = lemo && index >= input.dense_layers;
        let keep = if sparse { input.target_keep } else { 1.0 };
        let graph = if lemo {
            keep * layer + residual + (1.0 - keep) * residual
        } else {
            layer
        };
        LayerCost {
            kept_bytes: (graph + gathered + kept_offset / layers as f64 + dequantized).max(0.0)
                as u64,
            rebuilt_bytes: (keep * layer + gathered + rebuilt_offset + dequantized) as u64,
            backward_bytes: ((RECOMPUTE_LAYERS - 1.0) * keep * layer) as u64,
            recompute_ns: recompute_ns as u64,
            exposed_copy_ns: exposed_copy_ns as u64,
        }
    };
    CostTable {
        base_bytes: (parts.fixed + parts.weights + parts.trainable + parts.loss + parts.attention)
            as u64,
        input_bytes: residual as u64,
        // A layer's forward pass outside the graph computes every row, whatever it keeps.
        mixed_bytes: (layer * if lemo { LEMO_MIXED_LAYERS } else { 1.0 }) as u64,
        layers: (0..layers).map(layer_cost).collect(),
    }
}

/// The plan `--checkpointing` forces, or every layer kept.
fn uniform_plan(input: &PlanInput) -> ActivationPlan {
    let mode = if input.checkpointing {
        LayerActivations::Recomputed
    } else {
        LayerActivations::Kept
    };
    ActivationPlan::uniform(mode, Dims::of(&input.model).layers as usize)
}

/// The predicted peak of `plan` and its parts.
pub fn predict_plan(input: &PlanInput, plan: &ActivationPlan) -> MemoryPlan {
    let parts = fixed_parts(input, &Dims::of(&input.model));
    let total = cost_table(input).footprint(plan).device_peak as f64;
    MemoryPlan {
        fixed: parts.fixed,
        weights: parts.weights,
        trainable: parts.trainable,
        loss: parts.loss,
        activations: total - parts.fixed - parts.weights - parts.trainable - parts.loss,
        total,
    }
}

/// A run's activation plan and its predicted peak.
#[derive(Debug, Clone)]
pub struct Planned {
    pub activations: ActivationPlan,
    pub memory: MemoryPlan,
    /// Host bytes of the offloaded layer inputs.
    pub host_bytes: u64,
    pub budget: Option<Budget>,
}

impl Planned {
    /// `plan: 20 layers kept, 12 recomputed, 0 offloaded; 71.3 GiB of 76.0 GiB`.
    pub fn line(&self) -> String {
        let budget = self.budget.map_or("no budget known".into(), |b| {
            format!("{:.1} GiB", gib(b.device))
        });
        let host = if self.host_bytes > 0 {
            format!(", {:.1} GiB on the host", gib(self.host_bytes))
        } else {
            String::new()
        };
        format!(
            "plan: {}; {:.1} GiB of {budget}{host}",
            self.activations,
            self.memory.total / GIB
        )
    }

    /// What the device's memory pools may reserve: the budget less the plan's fixed part (the
    /// device context and library workspaces, which are not the pools'); `None` without a
    /// budget. Near it, the layers return idle buffers to the device (see
    /// [`lemo_kernels::memory::LayerBuffers`]).
    pub fn pool_budget(&self) -> Option<u64> {
        self.budget
            .map(|budget| budget.device.saturating_sub(self.memory.fixed as u64))
    }
}

/// The activation plan of a run within `budget`: every layer recomputed with `--checkpointing`,
/// else the fastest plan that fits (every layer kept where no budget is known). Prints the plan
/// line; a run that cannot fit is refused with the longest length and the budget that would.
pub fn plan(input: &PlanInput, budget: Option<Budget>) -> Result<Planned> {
    let costs = cost_table(input);
    let planned = |chosen: planner::Chosen| Planned {
        memory: predict_plan(input, &chosen.plan),
        host_bytes: chosen.footprint.host,
        activations: chosen.plan,
        budget,
    };
    let Some(limit) = budget else {
        // Unknown memory: every layer kept (or recomputed with --checkpointing).
        let activations = uniform_plan(input);
        let planned = Planned {
            memory: predict_plan(input, &activations),
            host_bytes: 0,
            activations,
            budget,
        };
        eprintln!("{}", planned.line());
        return Ok(planned);
    };
    if costs.base_bytes > limit.device {
        bail!(
            "the memory budget of {:.1} GiB is below the {:.1} GiB that the weights, trainable state \
             and loss take before any activation",
            gib(limit.device),
            gib(costs.base_bytes)
        );
    }
    let chosen = if input.checkpointing {
        planner::check(&costs, uniform_plan(input), limit)
    } else {
        planner::choose(&costs, limit)
    };
    match chosen {
        Ok(chosen) => {
            let planned = planned(chosen);
            eprintln!("{}", planned.line());
            Ok(planned)
        }
        Err(error) => bail!(
            "{error} at --seq-len {}: {}",
            input.seq_len,
            fitting_options(input, limit, crate::memory_budget::host_available_memory())
        ),
    }
}

/// The longest length (a multiple of 1024) that fits `budget`, `--method lemo` where it would
/// make the run fit, and the host memory budget that would, where the machine has that much
/// available (`host_available`) beyond the budget's.
fn fitting_options(input: &PlanInput, budget: Budget, host_available: Option<u64>) -> String {
    let fits = |changed: &PlanInput| {
        let costs = cost_table(changed);
        costs.least_device_bytes(budget.host) <= budget.device
    };
    let mut options = Vec::new();
    let longest = (1..input.seq_len / 1024)
        .rev()
        .map(|k| k * 1024)
        .find(|&seq_len| {
            fits(&PlanInput {
                seq_len,
                checkpointing: false,
                ..input.clone()
            })
        });
    if let Some(seq_len) = longest {
        options.push(format!("--seq-len {seq_len}"));
    }
    if input.method != Method::Lemo {
        let changed = PlanInput {
            method: Method::Lemo,
            ..input.clone()
        };
        if fits(&changed) {
            options.push(format!("--method lemo (kept {})", input.target_keep));
        }
    }
    if let Some(host) = least_fitting_host(input, budget, host_available) {
        options.push(format!(
            "--host-memory-budget {}GiB (layer inputs offloaded to host memory)",
            host >> 30
        ));
    }
    if options.is_empty() {
        "no shorter length fits: a smaller model, a larger budget or more host memory".into()
    } else {
        format!("try {}", options.join(", or "))
    }
}

/// The least host memory (to a GiB) above `budget.host` and within `host_available` with which
/// the run fits the device budget, if any; never on the CPU, where host memory is the device's.
fn least_fitting_host(
    input: &PlanInput,
    budget: Budget,
    host_available: Option<u64>,
) -> Option<u64> {
    const STEP: u64 = 1 << 30;
    let available =
        host_available.filter(|&a| a > budget.host && input.device != DeviceKind::Cpu)?;
    let costs = cost_table(input);
    let fits = |host: u64| costs.least_device_bytes(host) <= budget.device;
    // More host memory never needs more device memory: bisect over whole GiB.
    let (mut low, mut high) = (budget.host.div_ceil(STEP), available / STEP);
    if !fits(high * STEP) {
        return None;
    }
    while low < high {
        let middle = (low + high) / 2;
        if fits(middle * STEP) {
            high = middle;
        } else {
            low = middle + 1;
        }
    }
    Some(high * STEP)
}

#[cfg(test)]
mod tests;
