//! `generate`: continue a prompt with a KV cache, greedily (temperature 0) or by sampling.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Result, bail};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData, activation::softmax};
use lemo_kernels::LemoBackend;
use lemo_models::KvCache;
use lemo_models::model::ModelFormat;
use lemo_models::tokenizer::Tokenizer;
use rand::{RngExt, SeedableRng, rngs::StdRng};

use crate::device::BackendJob;

pub struct GenerateJob {
    pub model: PathBuf,
    pub tokenizer: Tokenizer,
    pub prompt: String,
    pub max_new_tokens: usize,
    pub temperature: f64,
    /// Sampling draws among the `top_k` likeliest tokens only (`None`: all).
    pub top_k: Option<usize>,
    /// Sampling draws among the likeliest tokens whose probabilities sum to `top_p` (nucleus
    /// sampling; 1: all).
    pub top_p: f64,
    pub seed: u64,
    /// The adapter, RoPE scaling and precision to run the model with.
    pub setup: crate::modelio::ModelSetup,
}

impl BackendJob for GenerateJob {
    type Output = ();

    fn run<B: LemoBackend>(self, device: B::Device) -> Result<()> {
        let (model, config) = crate::modelio::load::<B>(&self.model, &self.setup, &device)?;
        if self.tokenizer.vocab_size() > config.vocab_size() {
            bail!(
                "the tokenizer has {} tokens but the model's vocabulary has only {}: wrong --tokenizer?",
                self.tokenizer.vocab_size(),
                config.vocab_size()
            );
        }
        let prompt = self.tokenizer.encode(&self.prompt)?;
        if prompt.is_empty() {
            bail!(
                "the prompt encodes to no tokens and this tokenizer adds no BOS: give a non-empty --prompt"
            );
        }
        let interpolation = self.setup.interpolation_factor(&config)?;
        let limit = config.max_sequence_length().unwrap_or(
            (crate::modelio::addressable_context(&config) as f64 * interpolation) as usize,
        );
        if prompt.len() + self.max_new_tokens > limit {
            bail!(
                "the prompt ({} tokens) plus --max-new-tokens {} is more than the {limit} positions this model addresses (--target-context extends them)",
                prompt.len(),
                self.max_new_tokens
            );
        }
        // llama2.c models end a story by starting the next one, so BOS stops them as run.c does.
        let mut stop = config.eos_token_ids();
        if matches!(ModelFormat::detect(&self.model)?, ModelFormat::Llama2c) {
            stop = self.tokenizer.bos_id().into_iter().collect();
        }
        stop.extend(self.tokenizer.eos_id());

        let mut out = std::io::stdout().lock();
        // Pieces are printed relative to the token before; a first token other than BOS is text.
        if self.tokenizer.bos_id() != Some(prompt[0]) {
            out.write_all(self.tokenizer.decode(&prompt[..1]).as_bytes())?;
        }
        let mut previous = prompt[0];
        for &id in &prompt[1..] {
            out.write_all(&self.tokenizer.decode_piece(previous, id))?;
            previous = id;
        }
        out.flush()?;

        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut cache = KvCache::new(model.num_layers());
        let mut input = prompt.clone();
        for _ in 0..self.max_new_tokens {
            let ids: Vec<i32> = input.iter().map(|&id| id as i32).collect();
            let tokens =
                Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, input.len()]), &device);
            let logits = model.forward(tokens, Some(&mut cache));
            let [_, len, vocab] = logits.dims();
            let last = logits.slice([0..1, len - 1..len]).reshape([vocab]);
            let next = if self.temperature <= 0.0 {
                last.argmax(0).into_scalar().elem::<i64>() as u32
            } else {
                let probs: Vec<f32> = softmax(last.div_scalar(self.temperature), 0)
                    .into_data()
                    .convert::<f32>()
                    .into_vec()?;
                sample(&probs, self.top_k, self.top_p, rng.random::<f32>())
            };
            if stop.contains(&next) {
                break;
            }
            out.write_all(&self.tokenizer.decode_piece(previous, next))?;
            out.flush()?;
            previous = next;
            input = vec![next];
        }
        writeln!(out)?;
        Ok(())
    }
}

/// A token drawn from `probs` restricted to the `top_k` likeliest and to the smallest set of
/// likeliest tokens whose probabilities reach `top_p`, renormalized; `uniform` is in [0, 1).
fn sample(probs: &[f32], top_k: Option<usize>, top_p: f64, uniform: f32) -> u32 {
    let mut order: Vec<u32> = (0..probs.len() as u32).collect();
    order.sort_by(|&a, &b| probs[b as usize].total_cmp(&probs[a as usize]));
    order.truncate(top_k.unwrap_or(order.len()).max(1));
    let mut kept = 0;
    let mut mass = 0.0f64;
    for &id in &order {
        kept += 1;
        mass += probs[id as usize] as f64;
        if mass >= top_p {
            break;
        }
    }
    order.truncate(kept);
    let mut cumulative = 0.0f64;
    for &id in &order {
        cumulative += probs[id as usize] as f64 / mass;
        if (uniform as f64) < cumulative {
            return id;
        }
    }
    order[order.len() - 1]
}

#[cfg(test)]
mod tests {
    use super::sample;

    #[test]
    fn sampling_draws_from_the_likeliest_tokens_only() {
        let probs = [0.1, 0.5, 0.3, 0.1];
        // Everything: the cumulative order is 1, 2, 0, 3.
        assert_eq!(sample(&probs, None, 1.0, 0.0), 1);
        assert_eq!(sample(&probs, None, 1.0, 0.85), 0);
        assert_eq!(sample(&probs, None, 1.0, 0.99), 3);
        // Top 2: tokens 1 and 2, renormalized to 5/8 and 3/8.
        assert_eq!(sample(&probs, Some(2), 1.0, 0.6), 1);
        assert_eq!(sample(&probs, Some(2), 1.0, 0.7), 2);
        assert_eq!(sample(&probs, Some(2), 1.0, 0.999), 2);
        // Nucleus 0.5: token 1 alone reaches it.
        assert_eq!(sample(&probs, None, 0.5, 0.999), 1);
        // Nucleus 0.75: tokens 1 and 2.
        assert_eq!(sample(&probs, None, 0.75, 0.99), 2);
    }
}
