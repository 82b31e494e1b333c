//! `eval`: mean next-token cross-entropy and perplexity of a model over token documents.
//!
//! A document no longer than `seq_len` is scored in one window. Longer ones are scored in
//! windows of `seq_len` tokens starting every `stride` tokens (by default `seq_len`: each token
//! once; LongLoRA's protocol uses 256), each scored on all its next-token predictions; the loss
//! is the mean over all scored predictions. Of a chat record, the predictions scored are those
//! of its assistant tokens under [`LossOn::Assistant`], as `train` takes its loss.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use lemo_kernels::LemoBackend;
use lemo_kernels::loss::IGNORE_INDEX;
use lemo_sparsity::calibration::Block;

use lemo_models::ModelConfig;

use crate::data::Document;
use crate::data::chat::LossOn;
use crate::data::corpus::check_vocabulary;
use crate::device::{BackendJob, DeviceKind};
use crate::lemo::{LemoSettings, THRESHOLDS_FILE, read_thresholds, sparse_keep};
use crate::memory::gib;
use crate::memory_budget::host_available_memory;
use crate::memory_plan::host_attention_bytes;
use crate::task_progress::TaskProgress;

/// Rows of the vocabulary projection computed at once.
const LOSS_CHUNK_ROWS: usize = 1024;

#[derive(Debug, Clone, serde::Serialize)]
pub struct EvalReport {
    pub loss: f64,
    pub ppl: f64,
    /// Next-token predictions scored.
    pub tokens: usize,
    /// `--method lemo`: mean kept fraction of the token-eliminating attention and MLP blocks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keep_attention: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keep_mlp: Option<f64>,
}

impl std::fmt::Display for EvalReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "loss {:.6}  perplexity {:.4}  over {} predicted tokens",
            self.loss, self.ppl, self.tokens
        )?;
        if let (Some(attention), Some(mlp)) = (self.keep_attention, self.keep_mlp) {
            writeln!(f, "kept fraction: attention {attention:.3}, MLP {mlp:.3}")?;
        }
        Ok(())
    }
}

pub struct EvalJob {
    pub model: PathBuf,
    pub documents: Vec<Document>,
    /// Which predictions of chat records are scored.
    pub loss_on: LossOn,
    pub seq_len: Option<usize>,
    /// Window starts' distance on long documents; unset: `seq_len` (each token scored once).
    pub stride: Option<usize>,
    pub setup: crate::modelio::ModelSetup,
    /// `--method lemo`: score with token elimination, by `--thresholds` or the adapter's.
    pub sparsity: Option<LemoSettings>,
}

/// `(start, end)` of each scored window of a document of `len` tokens.
pub fn windows(len: usize, seq_len: usize, stride: usize) -> Vec<(usize, usize)> {
    if len <= seq_len {
        return vec![(0, len)];
    }
    (0..=len - seq_len)
        .step_by(stride.max(1))
        .map(|start| (start, start + seq_len))
        .collect()
}

impl EvalJob {
    /// Refuses, before the model is loaded, windows past the positions the model addresses
    /// under this setup, and on the CPU windows whose attention (which the CPU backend
    /// materializes, `heads x len x len` scores and their mask) exceeds the host's available
    /// memory.
    pub fn check_request(&self, device: DeviceKind) -> Result<()> {
        let config = crate::modelio::read_config(&self.model)?;
        check_vocabulary(&self.documents, config.vocab_size())?;
        if let Some(seq_len) = self.seq_len {
            self.setup.check_seq_len(&config, seq_len)?;
        }
        let seq_len = self.seq_len.unwrap_or(config.max_position_embeddings());
        let window = self
            .documents
            .iter()
            .map(|document| document.tokens.len())
            .max()
            .unwrap_or(0)
            .min(seq_len);
        let heads = match &config {
            ModelConfig::Llama(c) => c.num_attention_heads,
            ModelConfig::Opt(c) => c.num_attention_heads,
        };
        let attention = host_attention_bytes(heads as f64, window, 1);
        if let (DeviceKind::Cpu, Some(available)) = (device, host_available_memory())
            && attention > available as f64
        {
            bail!(
                "--seq-len {seq_len}: windows of {window} tokens need about {:.1} GiB of memory for attention on the CPU, more than the {:.1} GiB available: use a shorter --seq-len",
                attention / (1u64 << 30) as f64,
                gib(available)
            );
        }
        Ok(())
    }
}

impl BackendJob for EvalJob {
    type Output = EvalReport;

    fn run<B: LemoBackend>(self, device: B::Device) -> Result<EvalReport> {
        let (model, config) = crate::modelio::load::<B>(&self.model, &self.setup, &device)?;
        let seq_len = self.seq_len.unwrap_or(config.max_position_embeddings());
        if seq_len < 2 {
            bail!("--seq-len must be at least 2");
        }
        if let Some(limit) = config
            .max_sequence_length()
            .filter(|&limit| seq_len > limit)
        {
            bail!("--seq-len {seq_len} is longer than this model supports ({limit} positions)");
        }
        let elimination = match &self.sparsity {
            Some(settings) => {
                settings.check_sequence(&model, seq_len)?;
                let beside_adapter = self.setup.adapter.as_ref().map(|a| a.join(THRESHOLDS_FILE));
                let interpolation = Some(self.setup.interpolation_factor(&config)?);
                Some(crate::lemo::elimination(
                    settings,
                    &config,
                    interpolation,
                    || {
                        let path = beside_adapter
                        .filter(|p| p.exists())
                        .context("eval --method lemo needs --thresholds FILE (written by `train --method lemo` beside its adapter, or by `calibrate`) or --predictors FILE")?;
                        eprintln!(
                            "lemo: token elimination with the thresholds of {}",
                            path.display()
                        );
                        read_thresholds(&path, &config)
                    },
                )?)
            }
            None => None,
        };
        let plan: Vec<(&Document, usize, usize)> = self
            .documents
            .iter()
            .filter(|d| d.tokens.len() >= 2)
            .flat_map(|d| {
                windows(d.tokens.len(), seq_len, self.stride.unwrap_or(seq_len))
                    .into_iter()
                    .map(move |(s, e)| (d, s, e))
            })
            .collect();
        if plan.is_empty() {
            bail!("no document has the two tokens needed to score a prediction");
        }
        let started = Instant::now();
        let mut progress = TaskProgress::new(plan.len() as u64, "eval: windows", true);
        let plan_len = plan.len() as f64;
        let (mut loss_sum, mut tokens) = (0.0f64, 0usize);
        let (mut keep_attention, mut keep_mlp) = (0.0, 0.0);
        for (document, start, end) in &plan {
            let window = &document.tokens[*start..*end];
            let ids: Vec<i32> = window.iter().map(|&id| id as i32).collect();
            let input =
                Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, end - start]), &device);
            let labels = match (&document.assistant, self.loss_on) {
                (Some(assistant), LossOn::Assistant) => {
                    let labels: Vec<i32> = window
                        .iter()
                        .zip(&assistant[*start..*end])
                        .map(|(&id, &a)| if a { id as i32 } else { IGNORE_INDEX as i32 })
                        .collect();
                    let shape = [1, end - start];
                    Some(Tensor::<B, 2, Int>::from_data(
                        TensorData::new(labels, shape),
                        &device,
                    ))
                }
                _ => None,
            };
            let mut sparsity = crate::lemo::token_sparsity(elimination.as_ref());
            let (sum, count) =
                model.next_token_loss_sum(input, labels, LOSS_CHUNK_ROWS, &mut sparsity);
            if let Some(plan) = sparsity.into_plan() {
                keep_attention += sparse_keep(&plan, Block::Attention) / plan_len;
                keep_mlp += sparse_keep(&plan, Block::Mlp) / plan_len;
            }
            loss_sum += sum.into_scalar().elem::<f64>();
            tokens += count;
            progress.inc(&format!(
                "| loss {:.4} | {:.0} tokens/s",
                loss_sum / tokens as f64,
                tokens as f64 / started.elapsed().as_secs_f64()
            ));
        }
        progress.finish();
        if tokens == 0 {
            bail!("no window has an assistant token to score (--loss-on all scores every token)");
        }
        let loss = loss_sum / tokens as f64;
        Ok(EvalReport {
            loss,
            ppl: loss.exp(),
            tokens,
            keep_attention: elimination.as_ref().map(|_| keep_attention),
            keep_mlp: elimination.as_ref().map(|_| keep_mlp),
        })
    }
}
