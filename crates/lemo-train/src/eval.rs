//! `eval`: mean next-token cross-entropy and perplexity of a model over token documents.
//!
//! A document no longer than `seq_len` is scored in one window. Longer ones follow LongLoRA's
//! protocol: windows of `seq_len` tokens starting every `stride` tokens, each scored on all its
//! next-token predictions; the loss is the mean over all scored predictions.

use lemo_models::token_plan::TokenSparsity;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use lemo_kernels::LemoBackend;

use crate::device::BackendJob;

/// Rows of the vocabulary projection computed at once.
const LOSS_CHUNK_ROWS: usize = 1024;

#[derive(Debug, Clone, serde::Serialize)]
pub struct EvalReport {
    pub loss: f64,
    pub ppl: f64,
    /// Next-token predictions scored.
    pub tokens: usize,
}

pub struct EvalJob {
    pub model: PathBuf,
    pub documents: Vec<Vec<u32>>,
    pub seq_len: Option<usize>,
    pub stride: usize,
    pub setup: crate::modelio::ModelSetup,
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
        let vocab = config.vocab_size();
        for (index, document) in self.documents.iter().enumerate() {
            if let Some(bad) = document.iter().find(|&&id| id as usize >= vocab) {
                bail!(
                    "document {}: token id {bad} is outside the model's vocabulary of {vocab}",
                    index + 1
                );
            }
        }
        let plan: Vec<(&[u32], usize, usize)> = self
            .documents
            .iter()
            .filter(|d| d.len() >= 2)
            .flat_map(|d| {
                windows(d.len(), seq_len, self.stride)
                    .into_iter()
                    .map(move |(s, e)| (d.as_slice(), s, e))
            })
            .collect();
        if plan.is_empty() {
            bail!("no document has the two tokens needed to score a prediction");
        }
        let started = Instant::now();
        let (mut loss_sum, mut tokens) = (0.0f64, 0usize);
        for (index, (document, start, end)) in plan.iter().enumerate() {
            let ids: Vec<i32> = document[*start..*end].iter().map(|&id| id as i32).collect();
            let input =
                Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, end - start]), &device);
            let (sum, count) =
                model.next_token_loss_sum(input, LOSS_CHUNK_ROWS, &mut TokenSparsity::Dense);
            loss_sum += sum.into_scalar().elem::<f64>();
            tokens += count;
            eprint!(
                "\reval: window {}/{} | loss {:.4} | {:.0} tokens/s ",
                index + 1,
                plan.len(),
                loss_sum / tokens as f64,
                tokens as f64 / started.elapsed().as_secs_f64()
            );
        }
        eprintln!();
        let loss = loss_sum / tokens as f64;
        Ok(EvalReport {
            loss,
            ppl: loss.exp(),
            tokens,
        })
    }
}
