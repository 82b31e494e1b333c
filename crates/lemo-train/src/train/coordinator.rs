//! Rank 0's part of a run: `metrics.jsonl`, the progress line, validation records, checkpoints,
//! and at the end the adapter, the plots and `summary.json`. The other ranks train and take part
//! in the collectives only.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use lemo_kernels::LemoBackend;
use serde_json::json;

use super::TrainSummary;
use super::checkpoint::{self, TrainerState};
use super::progress::{Progress, RankReport, StepReport};
use super::replica::Replica;
use super::report;
use super::setup::Setup;
use super::sync::StepTotals;
use crate::memory::{self, gib};
use crate::method::Method;

/// What one step did, as rank 0 logs it.
pub struct StepRecord<'a> {
    /// Steps done, this one included.
    pub done: usize,
    pub totals: &'a StepTotals,
    pub lr: f64,
    pub grad_norm: f64,
    pub step_time: f64,
    /// Time spent summing gradients and totals (waiting for the slowest rank included).
    pub allreduce_time: f64,
    /// Under context parallelism, rank 0's time blocked in its sequence group's exchanges during
    /// the forward and backward passes.
    pub exchange_time: Option<f64>,
    /// Rank 0's memory in use after the update.
    pub mem_in_use: u64,
}

pub struct Coordinator {
    metrics: report::MetricsWriter,
    progress: Progress,
    run_started: Instant,
    elapsed_before: f64,
    tokens_seen: u64,
    tokens_per_step: u64,
    first_loss: Option<f64>,
    last_loss: Option<f64>,
    last_val: Option<f64>,
    baseline_val: Option<f64>,
    last_checkpoint: Option<PathBuf>,
    last_save: Instant,
    save_interval: Option<Duration>,
    steps_done: usize,
}

impl Coordinator {
    pub fn open(setup: &Setup) -> Result<Self> {
        let config = &setup.config;
        let start = setup.start_step();
        let resumed = setup.resumed.as_ref().map(|r| &r.state);
        Ok(Self {
            metrics: report::MetricsWriter::open(&config.out, start)?,
            progress: Progress::new(config.steps, start),
            run_started: Instant::now(),
            elapsed_before: resumed.map_or(0.0, |s| s.elapsed_s),
            tokens_seen: resumed.map_or(0, |s| s.tokens_seen),
            tokens_per_step: (setup.data_ranks()
                * config.grad_accum
                * config.batch_size
                * setup.seq_len) as u64,
            first_loss: None,
            last_loss: None,
            last_val: None,
            baseline_val: None,
            last_checkpoint: None,
            last_save: Instant::now(),
            save_interval: config.save_interval()?,
            steps_done: start,
        })
    }

    fn elapsed(&self) -> f64 {
        self.elapsed_before + self.run_started.elapsed().as_secs_f64()
    }

    pub fn step(&mut self, setup: &Setup, record: &StepRecord) -> Result<()> {
        let totals = record.totals;
        let loss = totals.loss();
        self.tokens_seen += self.tokens_per_step;
        self.first_loss.get_or_insert(loss);
        self.last_loss = Some(loss);
        self.steps_done = record.done;
        let kept = (setup.config.method == Method::Lemo)
            .then_some((totals.keep_attention, totals.keep_mlp));
        let peak = totals.peak.iter().copied().max().unwrap_or(0);
        let after_forward = totals.after_forward.iter().copied().max().unwrap_or(0);
        let tokens_per_s = self.tokens_per_step as f64 / record.step_time;
        let allreduce_share = record.allreduce_time / record.step_time;
        let per_rank: Vec<f64> = totals.peak.iter().map(|&p| gib(p)).collect();
        // The device-level peaks, where every rank's device says (CUDA).
        let device_per_rank: Option<Vec<f64>> = totals
            .device_peak
            .iter()
            .all(|&p| p > 0)
            .then(|| totals.device_peak.iter().map(|&p| gib(p)).collect());
        let device_peak = device_per_rank
            .as_ref()
            .map(|v| v.iter().copied().fold(0.0, f64::max));
        self.metrics.write(&json!({
            "kind": "train",
            "step": record.done,
            "loss": loss,
            "lr": record.lr,
            "grad_norm": record.grad_norm,
            "tokens": self.tokens_per_step,
            "tokens_per_s": tokens_per_s,
            "step_time_s": record.step_time,
            "ranks": setup.ranks(),
            "context_parallel": setup.config.context_parallel,
            "allreduce_s": record.allreduce_time,
            "allreduce_share": allreduce_share,
            "sequence_exchange_s": record.exchange_time,
            "mem_in_use_gib": gib(record.mem_in_use),
            "mem_after_forward_gib": gib(after_forward),
            "mem_peak_gib": gib(peak),
            "mem_peak_gib_by_rank": per_rank,
            "mem_device_peak_gib": device_peak,
            "mem_device_peak_gib_by_rank": device_per_rank,
            "mem_source": memory::source(),
            "activation_plan": &setup.activations,
            "precision": setup.precision.name(),
            "keep_attention": kept.map(|k| k.0),
            "keep_mlp": kept.map(|k| k.1),
            "elapsed_s": self.elapsed(),
        }))?;
        self.progress.step(
            record.done,
            &StepReport {
                loss,
                lr: record.lr,
                tokens_per_s,
                mem_gib: gib(peak),
                host_memory: crate::memory::source() == "host-rss",
                device_gib: device_peak,
                kept,
                ranks: (setup.ranks() > 1).then_some(RankReport {
                    mem_gib: per_rank,
                    device_gib: device_per_rank,
                    allreduce_share,
                }),
            },
        );
        Ok(())
    }

    pub fn validation(&mut self, done: usize, val: f64) -> Result<()> {
        if done == 0 {
            self.baseline_val = Some(val);
        }
        self.last_val = Some(val);
        self.metrics
            .write(&json!({"kind": "val", "step": done, "val_loss": val, "val_ppl": val.exp()}))?;
        self.progress.validation(done, val);
        Ok(())
    }

    /// Writes a checkpoint when one is due (every `checkpoint_every` steps, every `save_every`
    /// of wall time), at the last step, and when the run stops.
    pub fn checkpoint<B: LemoBackend>(
        &mut self,
        setup: &Setup,
        replica: &Replica<B>,
        stopping: bool,
    ) -> Result<()> {
        let config = &setup.config;
        let done = self.steps_done;
        let due = (config.checkpoint_every > 0 && done.is_multiple_of(config.checkpoint_every))
            || self
                .save_interval
                .is_some_and(|every| self.last_save.elapsed() >= every);
        if !(due || done == config.steps || stopping) {
            return Ok(());
        }
        let state = TrainerState {
            step: done,
            seed: config.seed,
            seq_len: setup.seq_len,
            train_sequences: setup.corpus.train_len(),
            ranks: setup.ranks(),
            context_parallel: setup.config.context_parallel,
            tokens_seen: self.tokens_seen,
            elapsed_s: self.elapsed(),
            run_id: setup.run_id.clone(),
        };
        let files = replica.checkpoint_files(state);
        let saved = checkpoint::save(&config.out, &files, config.keep_checkpoints, |dir| {
            replica.write_adapter(setup, dir)
        })?;
        self.last_checkpoint = Some(saved);
        self.last_save = Instant::now();
        Ok(())
    }

    /// Leaves the progress bar as it is (the run ends with an error).
    pub fn abandon(&self) {
        self.progress.abandon();
    }

    /// The final adapter (when every step is done), the plots and `summary.json`.
    pub fn finish<B: LemoBackend>(
        self,
        setup: &Setup,
        replica: &Replica<B>,
        interrupted: bool,
        peak: &crate::memory::PeakTracker,
    ) -> Result<TrainSummary> {
        self.progress.finish();
        let out = &setup.config.out;
        let adapter = if self.steps_done == setup.config.steps {
            let dir = out.join("adapter");
            replica.write_adapter(setup, &dir)?;
            Some(dir)
        } else {
            None
        };
        let summary = TrainSummary {
            out: out.clone(),
            adapter,
            steps_done: self.steps_done,
            interrupted,
            first_loss: self.first_loss,
            last_loss: self.last_loss,
            baseline_val_loss: self.baseline_val,
            val_loss: self.last_val,
            elapsed_s: self.elapsed(),
            tokens_per_s: self.tokens_seen as f64 / self.elapsed().max(1e-9),
            peak_gib: gib(peak.peak),
            device_peak_gib: (peak.device_peak > 0).then(|| gib(peak.device_peak)),
            plots: report::plot(out)?,
            metrics: out.join(report::METRICS_FILE),
            last_checkpoint: self.last_checkpoint,
        };
        lemo_models::adapter::write_atomically(
            &out.join("summary.json"),
            serde_json::to_string_pretty(&summary)?.as_bytes(),
        )?;
        Ok(summary)
    }
}
