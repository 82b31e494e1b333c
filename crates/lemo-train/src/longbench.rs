//! Multiple-choice scoring of LongBench-v2 style JSONL (`question`, `choice_A`..`choice_D`,
//! `answer`, `context`, optional `_id`, `domain`, `difficulty`) by log-likelihood: the prompt is
//! LongBench-v2's (context, question, the four choices, then "The correct answer is (") and the
//! prediction is the letter whose token the model finds most likely next. Contexts longer than
//! `--max-tokens` are cut in the middle, keeping the beginning and the end, as LongBench does.

use lemo_models::token_plan::TokenSparsity;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::tensor::{Int, Tensor, TensorData, activation::log_softmax};
use lemo_kernels::LemoBackend;
use lemo_models::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};

use crate::device::BackendJob;
use crate::modelio::ModelSetup;

#[derive(Debug, Clone, Deserialize)]
pub struct Sample {
    #[serde(rename = "_id", default)]
    pub id: String,
    #[serde(default)]
    pub domain: String,
    #[serde(default)]
    pub difficulty: String,
    pub question: String,
    #[serde(rename = "choice_A")]
    pub choice_a: String,
    #[serde(rename = "choice_B")]
    pub choice_b: String,
    #[serde(rename = "choice_C")]
    pub choice_c: String,
    #[serde(rename = "choice_D")]
    pub choice_d: String,
    pub answer: String,
    pub context: String,
}

pub fn read_samples(path: &Path) -> Result<Vec<Sample>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| {
                format!(
                    "{} line {}: not a LongBench-v2 sample",
                    path.display(),
                    i + 1
                )
            })
        })
        .collect()
}

fn prompt(sample: &Sample, context: &str) -> String {
    format!(
        "Please read the following text and answer the question below.\n\n<text>\n{context}\n</text>\n\n\
         What is the correct answer to this question: {}\nChoices:\n(A) {}\n(B) {}\n(C) {}\n(D) {}\n\n\
         The correct answer is (",
        sample.question.trim(),
        sample.choice_a.trim(),
        sample.choice_b.trim(),
        sample.choice_c.trim(),
        sample.choice_d.trim()
    )
}

#[derive(Debug, Clone, Serialize)]
pub struct SampleResult {
    pub id: String,
    pub domain: String,
    pub difficulty: String,
    pub answer: String,
    pub predicted: String,
    pub correct: bool,
    /// Log-probabilities of A, B, C, D.
    pub log_probs: [f64; 4],
    pub tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct LongBenchReport {
    pub samples: usize,
    pub correct: usize,
    pub accuracy: f64,
    pub results: Vec<SampleResult>,
}

impl std::fmt::Display for LongBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "longbench: {}/{} correct, accuracy {:.3}",
            self.correct, self.samples, self.accuracy
        )
    }
}

pub struct LongBenchJob {
    pub model: PathBuf,
    pub setup: ModelSetup,
    pub tokenizer: Tokenizer,
    pub samples: Vec<Sample>,
    pub max_tokens: usize,
}

/// Prompt token ids within `max_tokens`, cutting the middle of the context when needed.
fn fit(tokenizer: &Tokenizer, sample: &Sample, max_tokens: usize) -> Result<Vec<u32>> {
    let full = tokenizer.encode(&prompt(sample, &sample.context))?;
    if full.len() <= max_tokens {
        return Ok(full);
    }
    let overhead = tokenizer.encode(&prompt(sample, ""))?.len();
    if overhead + 16 > max_tokens {
        bail!(
            "sample {}: question and choices alone need {overhead} tokens, over --max-tokens {max_tokens}",
            sample.id
        );
    }
    let chars: Vec<char> = sample.context.chars().collect();
    // Shrink the kept characters until the prompt fits (a few tokenizations).
    let mut keep = (chars.len() as f64 * (max_tokens - overhead) as f64
        / (full.len() - overhead) as f64) as usize;
    loop {
        let half = keep / 2;
        let cut: String = chars[..half]
            .iter()
            .chain(chars[chars.len() - half..].iter())
            .collect();
        let ids = tokenizer.encode(&prompt(sample, &cut))?;
        if ids.len() <= max_tokens || keep == 0 {
            return Ok(ids);
        }
        keep = keep * 95 / 100;
    }
}

impl BackendJob for LongBenchJob {
    type Output = LongBenchReport;

    fn run<B: LemoBackend>(self, device: B::Device) -> Result<LongBenchReport> {
        let (model, config) = crate::modelio::load::<B>(&self.model, &self.setup, &device)?;
        if let Some(limit) = config
            .max_sequence_length()
            .filter(|&l| self.max_tokens > l)
        {
            bail!(
                "--max-tokens {} is longer than this model supports ({limit})",
                self.max_tokens
            );
        }
        let letters = ["A", "B", "C", "D"];
        let mut results = Vec::new();
        for (index, sample) in self.samples.iter().enumerate() {
            let ids = fit(&self.tokenizer, sample, self.max_tokens)?;
            // The id each letter gets right after "(", from tokenizing prompt + letter.
            let text = self.tokenizer.decode(&ids);
            let mut letter_ids = [0u32; 4];
            for (slot, letter) in letter_ids.iter_mut().zip(letters) {
                let with = self.tokenizer.encode(&format!("{text}{letter}"))?;
                *slot = *with.last().expect("non-empty");
            }
            let data: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
            let tokens =
                Tensor::<B, 2, Int>::from_data(TensorData::new(data, [1, ids.len()]), &device);
            let hidden = model.hidden_states(tokens, None, &mut TokenSparsity::Dense);
            let [_, len, dim] = hidden.dims();
            let last = hidden.slice([0..1, len - 1..len]).reshape([1, dim]);
            let logits = last.matmul(model.lm_head_weight().transpose());
            let log_probs: Vec<f32> = log_softmax(logits, 1)
                .into_data()
                .convert::<f32>()
                .into_vec()?;
            let scores = letter_ids.map(|id| log_probs[id as usize] as f64);
            let best = (0..4)
                .max_by(|&a, &b| scores[a].total_cmp(&scores[b]))
                .expect("four choices");
            let predicted = letters[best].to_string();
            let correct = predicted == sample.answer.trim();
            eprintln!(
                "longbench {}/{}: {} tokens, answer {} predicted {} {}",
                index + 1,
                self.samples.len(),
                ids.len(),
                sample.answer,
                predicted,
                if correct { "ok" } else { "wrong" }
            );
            results.push(SampleResult {
                id: sample.id.clone(),
                domain: sample.domain.clone(),
                difficulty: sample.difficulty.clone(),
                answer: sample.answer.clone(),
                predicted,
                correct,
                log_probs: scores,
                tokens: ids.len(),
            });
        }
        let correct = results.iter().filter(|r| r.correct).count();
        Ok(LongBenchReport {
            samples: results.len(),
            correct,
            accuracy: correct as f64 / results.len().max(1) as f64,
            results,
        })
    }
}
