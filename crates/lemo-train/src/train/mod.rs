//! `train`: LoRA fine-tuning (dense `lora`, `longlora`, `lemo`) with AdamW, warm-up and
//! schedule, gradient accumulation, global-norm clipping, position interpolation, the
//! segment-based loss, atomic checkpoints with exact resume, `metrics.jsonl`, plots and a
//! progress bar, on one device or data-parallel on several.
//!
//! A run is settled once on the host ([`setup`]), then every rank trains its replica on its
//! slice of each global batch ([`worker`], [`replica`], [`shard`]), the ranks sum gradients and
//! totals ([`sync`]), and rank 0 keeps the records ([`coordinator`]). One rank is the same code
//! path with collectives that do nothing.

pub mod checkpoint;
pub mod config;
mod coordinator;
pub mod interrupt;
pub mod optim;
mod progress;
mod replica;
pub mod report;
pub mod run_dir;
mod setup;
mod shard;
mod step;
mod sync;
mod worker;

pub use step::forward_backward;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};
use burn::tensor::backend::{Backend, Device, DeviceId};
use lemo_kernels::LemoBackend;
use lemo_models::ModelConfig;

use crate::device::{BackendJob, DeviceKind, PrecisionKind};
use crate::distributed::launch::Launch;
use crate::distributed::{self, Engine, Layout};
use crate::memory_budget::MemoryBudgetArgs;
use crate::memory_plan;
use config::TrainConfig;

/// What a finished (or stopped) run reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TrainSummary {
    pub out: PathBuf,
    pub adapter: Option<PathBuf>,
    pub steps_done: usize,
    /// A signal stopped the run (after a checkpoint).
    pub interrupted: bool,
    pub first_loss: Option<f64>,
    pub last_loss: Option<f64>,
    /// Validation loss of the model before the first step (the baseline), and the last one.
    pub baseline_val_loss: Option<f64>,
    pub val_loss: Option<f64>,
    /// Wall time of the run (resumed runs included), and training tokens per second over it.
    pub elapsed_s: f64,
    pub tokens_per_s: f64,
    /// Largest memory in use on rank 0 (device, or host RSS on the CPU), and the device-level
    /// peak where known, in GiB.
    pub peak_gib: f64,
    pub device_peak_gib: Option<f64>,
    pub plots: Vec<PathBuf>,
    pub metrics: PathBuf,
    pub last_checkpoint: Option<PathBuf>,
}

/// What a user reads at the end of a run: time, throughput, losses, memory and the outputs.
impl std::fmt::Display for TrainSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let loss = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
        writeln!(
            f,
            "trained {} steps in {:.1} s ({:.0} tokens/s): training loss {} -> {}, validation loss {} -> {}",
            self.steps_done,
            self.elapsed_s,
            self.tokens_per_s,
            loss(self.first_loss),
            loss(self.last_loss),
            loss(self.baseline_val_loss),
            loss(self.val_loss)
        )?;
        let device = self
            .device_peak_gib
            .map_or(String::new(), |d| format!(" (device {d:.2} GiB)"));
        writeln!(f, "memory peak {:.2} GiB{device}", self.peak_gib)?;
        writeln!(f, "outputs in {}:", self.out.display())?;
        match &self.adapter {
            Some(adapter) => writeln!(f, "  adapter (PEFT)   {}", adapter.display())?,
            None => writeln!(
                f,
                "  adapter          not written: the run stopped early; continue: --resume {}",
                self.out.display()
            )?,
        }
        if let Some(checkpoint) = &self.last_checkpoint {
            writeln!(f, "  last checkpoint  {}", checkpoint.display())?;
        }
        writeln!(f, "  metrics          {}", self.metrics.display())?;
        for plot in &self.plots {
            writeln!(f, "  plot             {}", plot.display())?;
        }
        Ok(())
    }
}

pub struct TrainJob {
    pub config: TrainConfig,
    /// Checkpoint folder to continue from.
    pub resume: Option<PathBuf>,
    /// A new run, a replacement of the run in `config.out`, or its continuation.
    pub start: run_dir::Start,
    /// `config.runtime.precision` resolved for the device.
    pub precision: PrecisionKind,
    /// The device the run uses (whose free memory the memory plan reads).
    pub device: DeviceKind,
    /// Train even where the memory plan predicts the run will not fit (every layer kept, or
    /// recomputed with `--checkpointing`).
    pub skip_memory_plan: bool,
    /// What the activation plan may use (`None`: unknown, every layer kept).
    pub budget: Option<lemo_models::activation_plan::planner::Budget>,
    /// This process's rank when a launcher started one process per GPU (`WORLD_SIZE`, ...).
    pub launch: Option<Launch>,
}

impl TrainJob {
    /// A run of `config` in this process (this process's rank, under a launcher): a new run
    /// (`start` fresh or overwrite) or the continuation of checkpoint `resume`.
    pub fn new(
        config: TrainConfig,
        resume: Option<PathBuf>,
        start: run_dir::Start,
    ) -> Result<Self> {
        let (device, precision) = config.runtime.resolve()?;
        Ok(Self {
            config,
            resume,
            start,
            precision,
            device,
            skip_memory_plan: false,
            budget: MemoryBudgetArgs::default().resolve(device)?,
            launch: Launch::from_env()?,
        })
    }

    /// Prepares the run folder (when this process owns it) and trains; `None` in the processes
    /// of a launch other than rank 0's, which reports the run.
    pub fn train(self) -> Result<Option<TrainSummary>> {
        self.config.validate()?;
        let out = self.config.out.clone();
        let created = self.owns_out() && !out.exists();
        let _lock = match self.owns_out() {
            true => {
                let lock = run_dir::RunLock::acquire(&self.config.out)?;
                run_dir::prepare(&self.config.out, self.start)?;
                Some(lock)
            }
            false => None,
        };
        let result = self.device.run(self);
        // A failed fresh run leaves nothing to resume: its folder would only block a rerun.
        if result.is_err() && created && checkpoint::list(&out, None).is_empty() {
            let _ = std::fs::remove_dir_all(&out);
        }
        result
    }

    /// Whether this process writes the run folder (rank 0 of a launch, or the only process).
    pub fn owns_out(&self) -> bool {
        self.launch.as_ref().is_none_or(|launch| launch.rank == 0)
    }
}

/// What the memory plan needs of a run.
fn plan_input(
    config: &TrainConfig,
    model: ModelConfig,
    seq_len: usize,
    device: DeviceKind,
    precision: PrecisionKind,
    projection_bits: Option<f64>,
) -> memory_plan::PlanInput {
    memory_plan::PlanInput {
        model,
        device,
        seq_len,
        batch_size: config.batch_size,
        context_parallel: config.context_parallel,
        method: config.method,
        checkpointing: config.checkpointing,
        precision,
        lora_rank: config.lora_rank,
        lora_targets: config.lora_targets.clone(),
        train_extras: config.train_embeddings() || config.train_norms(),
        loss_segment: config.loss_segment,
        target_keep: config.lemo.mean_keep(),
        dense_layers: config.lemo.dense_layers.len(),
        projection_bits,
    }
}

impl BackendJob for TrainJob {
    /// `None` in the processes of a launch other than rank 0's, which reports the run.
    type Output = Option<TrainSummary>;

    fn run<B: LemoBackend>(self, device: B::Device) -> Result<Option<TrainSummary>> {
        run_on::<B>(self, device)
    }
}

fn run_on<B: LemoBackend>(mut job: TrainJob, device: B::Device) -> Result<Option<TrainSummary>> {
    if job.config.gpus == 0 {
        bail!("--gpus must be at least 1");
    }
    // "off" waits as good as forever.
    let timeout = job
        .config
        .collective_timeout()?
        .unwrap_or(Duration::from_secs(365 * 24 * 3600));
    let (layout, engine) = match &job.launch {
        None => (
            Layout::local(job.config.gpus),
            engine(job.device, job.config.gpus)?,
        ),
        Some(launch) => {
            if job.config.gpus != 1 {
                bail!(
                    "--gpus {}: under a launcher (WORLD_SIZE={}) each process trains on one GPU, its LOCAL_RANK; leave --gpus out",
                    job.config.gpus,
                    launch.world
                );
            }
            // The run's rank count (saved in checkpoints, checked on resume) is the launch's.
            job.config.gpus = launch.world;
            let layout = Layout {
                world: launch.world,
                first_rank: launch.rank,
                first_device: launch.local_rank,
                local: 1,
            };
            (layout, launched_engine(job.device, launch, timeout)?)
        }
    };
    let devices = rank_devices::<B>(&device, job.device, layout)?;
    let setup = setup::prepare(job)?;
    interrupt::install();
    let summaries = distributed::run_ranks(layout, timeout, engine, |comm| {
        worker::train_rank::<B>(&setup, devices[comm.local()].clone(), comm)
    })?;
    Ok(summaries.into_iter().next().flatten())
}

/// The device of each of this process's ranks: CUDA devices from `layout.first_device` on, or
/// the one device the simulated ranks of the CPU and wgpu backends share.
fn rank_devices<B: Backend>(
    device: &B::Device,
    kind: DeviceKind,
    layout: Layout,
) -> Result<Vec<B::Device>> {
    if kind != DeviceKind::Cuda {
        return Ok(vec![device.clone(); layout.local]);
    }
    let type_id = device.to_id().type_id;
    let present = B::device_count(type_id);
    let end = layout.first_device + layout.local;
    if end > present {
        match layout.local == layout.world {
            true => bail!("--gpus {end}: this machine has {present} CUDA device(s)"),
            false => bail!(
                "LOCAL_RANK={}: this machine has {present} CUDA device(s)",
                layout.first_device
            ),
        }
    }
    Ok((layout.first_device..end)
        .map(|index| B::Device::from_id(DeviceId::new(type_id, index as u16)))
        .collect())
}

/// What sums gradients between `ranks` ranks of this process on `kind`.
fn engine(kind: DeviceKind, ranks: usize) -> Result<Engine> {
    #[cfg(feature = "cuda")]
    if kind == DeviceKind::Cuda && ranks > 1 {
        return Ok(Engine::Nccl(distributed::nccl::UniqueId::new()?));
    }
    let _ = (kind, ranks);
    Ok(Engine::InProcess)
}

/// NCCL between the processes of a launch: rank 0's unique id, handed out at the rendezvous.
fn launched_engine(kind: DeviceKind, launch: &Launch, timeout: Duration) -> Result<Engine> {
    if kind != DeviceKind::Cuda {
        bail!(
            "WORLD_SIZE={}: ranks in several processes sum through NCCL and need --device cuda",
            launch.world
        );
    }
    #[cfg(feature = "cuda")]
    {
        use distributed::nccl::UniqueId;
        let id = launch.share_id(|| Ok(UniqueId::new()?.to_bytes()), timeout)?;
        Ok(Engine::Nccl(UniqueId::from_bytes(id)?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = timeout;
        bail!("this build has no CUDA support")
    }
}
