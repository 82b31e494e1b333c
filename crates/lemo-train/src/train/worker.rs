//! One rank's training loop, the same for one rank and for many: forward and backward passes of
//! its slice of the global batch, the sum of gradients and totals over the ranks, clipping and
//! the optimizer step, validation shared among the ranks; rank 0 also coordinates (metrics,
//! progress, checkpoints, the final adapter).

use std::time::Instant;

use anyhow::{Result, bail};
use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use lemo_kernels::LemoBackend;
use lemo_kernels::exchange::Exchange;

use super::TrainSummary;
use super::coordinator::{Coordinator, StepRecord};
use super::interrupt;
use super::optim;
use super::replica::{Replica, has_device_memory};
use super::setup::Setup;
use super::shard::Shard;
use super::sync::{self, StepTotals};
use crate::distributed::Communicator;
use crate::distributed::sequence::ExchangeClock;
use crate::memory::{self, PeakTracker};

/// Trains `setup` as rank `comm.rank()` on `device`; rank 0 returns the run's summary.
pub fn train_rank<B: LemoBackend>(
    setup: &Setup,
    device: B::Device,
    comm: &mut Communicator,
) -> Result<Option<TrainSummary>> {
    let config = &setup.config;
    let (rank, ranks) = (comm.rank(), comm.ranks());
    let mut replica = Replica::<B>::load(setup, device.clone(), rank)?;
    if has_device_memory::<B>(&device) {
        memory::set_probe(memory::backend_probe::<B>(device.clone()));
    }
    if rank == 0 {
        announce(setup, &replica, ranks, &device);
    }
    // The ranks of a sequence group read the same sequences and each trains its positions.
    let group = config.context_parallel;
    let (sequence_group, exchange_clock) = (group > 1)
        .then(|| comm.sequence_group(group))
        .transpose()?
        .unzip();
    let shard = Shard {
        rank: rank / group,
        ranks: ranks / group,
        batch: config.batch_size,
        grad_accum: config.grad_accum,
    };
    let layout = replica.layout();
    let mut coordinator = match rank {
        0 => Some(Coordinator::open(setup)?),
        _ => None,
    };
    let mut peak = PeakTracker::default();
    let start_step = setup.start_step();
    let stop_at = config
        .stop_after
        .map_or(config.steps, |n| (start_step + n).min(config.steps));
    let mut stopped = false;
    if start_step == 0 && !setup.val_sequences.is_empty() {
        let val = validation(setup, &replica, comm, sequence_group.as_ref())?;
        if let Some(coordinator) = &mut coordinator {
            coordinator.validation(0, val)?;
        }
    }
    interrupt::steps_started();
    for step in start_step..stop_at {
        let step_started = Instant::now();
        // Dropout draws from the backend's generator: seeding it per step makes a resumed run
        // draw what the uninterrupted one did, and per rank gives each rank its own masks.
        Autodiff::<B>::seed(
            &device,
            config
                .seed
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(step as u64)
                .wrapping_add((rank as u64) << 32),
        );
        if let Some(clock) = &exchange_clock {
            // What validation waited is not the step's.
            clock.take();
        }
        let (grads, local) =
            replica.accumulate(setup, (&shard, sequence_group.as_ref()), step, &mut peak)?;
        let exchange_time = exchange_clock.as_ref().map(ExchangeClock::take);
        if ranks > 1 {
            // The rank's own backward pass is not collective time.
            lemo_kernels::memory::synchronize::<B>(&device);
        }
        let reduce_started = Instant::now();
        // The totals go first: they also tell every rank that all the others are alive.
        let totals = StepTotals::gather(&local, &peak, interrupt::requested(), comm)?;
        let mut grads = sync::sum_grads(grads, &layout, &device, comm)?;
        let allreduce_time = reduce_started.elapsed().as_secs_f64();
        let loss = totals.loss();
        let grad_norm = optim::global_norm(&grads);
        if let Err(diverged) = check_finite(loss, grad_norm, step + 1) {
            if let Some(coordinator) = &coordinator {
                coordinator.abandon();
            }
            return Err(diverged);
        }
        if config.max_grad_norm > 0.0 && grad_norm > config.max_grad_norm {
            // torch.nn.utils.clip_grad_norm_: multiply by max_norm / (norm + 1e-6).
            grads = optim::scale_grads(grads, config.max_grad_norm / (grad_norm + 1e-6));
        }
        let lr = optim::learning_rate(
            config.schedule,
            config.lr,
            config.min_lr_ratio,
            config.warmup_steps,
            config.steps,
            step,
        );
        replica.update(&grads, lr)?;
        drop(grads);
        let now = peak.record();
        let done = step + 1;
        if let Some(coordinator) = &mut coordinator {
            coordinator.step(
                setup,
                &StepRecord {
                    done,
                    totals: &totals,
                    lr,
                    grad_norm,
                    step_time: step_started.elapsed().as_secs_f64(),
                    allreduce_time,
                    exchange_time,
                    mem_in_use: now.in_use,
                },
            )?;
        }
        let is_last = done == config.steps;
        if !setup.val_sequences.is_empty()
            && ((config.val_every > 0 && done.is_multiple_of(config.val_every)) || is_last)
        {
            let val = validation(setup, &replica, comm, sequence_group.as_ref())?;
            if let Some(coordinator) = &mut coordinator {
                coordinator.validation(done, val)?;
            }
        }
        stopped = totals.stop;
        if let Some(coordinator) = &mut coordinator {
            coordinator.checkpoint(setup, &replica, stopped)?;
        }
        if stopped {
            break;
        }
    }
    coordinator
        .map(|c| c.finish(setup, &replica, stopped, &peak))
        .transpose()
}

/// The run's first line: method, model, trainable parameters, precision, batch and device.
fn announce<B: LemoBackend>(setup: &Setup, replica: &Replica<B>, ranks: usize, device: &B::Device) {
    let config = &setup.config;
    eprintln!(
        "train: {} on {} ({} trainable parameters, {}), {} steps x {} micro-batches x {} sequences x {ranks} rank(s), device {}",
        config.method.name(),
        setup.model_path.display(),
        optim::trainable_count::<Autodiff<B>, _>(&replica.model),
        setup.precision.name(),
        config.steps,
        config.grad_accum,
        config.batch_size,
        B::name(device)
    );
}

/// A diverged step (a loss or gradient norm that is NaN or infinite) ends the run: its update
/// would make the adapter non-finite.
fn check_finite(loss: f64, grad_norm: f64, step: usize) -> Result<()> {
    if !loss.is_finite() {
        bail!("loss became {loss} at step {step}: lower --lr or check the data");
    }
    if !grad_norm.is_finite() {
        bail!(
            "the gradient norm became {grad_norm} at step {step} (loss {loss:.4}): lower --lr or check the data"
        );
    }
    Ok(())
}

/// The validation loss of the replica's model as evaluation sees it (dense attention).
fn validation<B: LemoBackend>(
    setup: &Setup,
    replica: &Replica<B>,
    comm: &mut Communicator,
    sequence_group: Option<&Exchange>,
) -> Result<f64> {
    let mut eval_model = replica.model.valid();
    eval_model.set_shifted_group(None);
    sync::validation_loss(
        &eval_model,
        &setup.val_sequences,
        setup.config.loss_segment,
        (comm, sequence_group),
    )
}
