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
        if let Some(limit) = config
            .max_sequence_length()
            .filter(|&l| prompt.len() + self.max_new_tokens > l)
        {
            bail!(
                "prompt plus --max-new-tokens is {} tokens; this model supports {limit}",
                prompt.len() + self.max_new_tokens
            );
        }
        // llama2.c models end a story by starting the next one, so BOS stops them as run.c does.
        let mut stop = config.eos_token_ids();
        if matches!(ModelFormat::detect(&self.model)?, ModelFormat::Llama2c) {
            stop = self.tokenizer.bos_id().into_iter().collect();
        }
        stop.extend(self.tokenizer.eos_id());

        let mut out = std::io::stdout().lock();
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
                sample(&probs, rng.random::<f32>())
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

/// The index where the cumulative probability first exceeds `uniform` (in [0, 1)).
fn sample(probs: &[f32], uniform: f32) -> u32 {
    let mut cumulative = 0.0;
    for (index, p) in probs.iter().enumerate() {
        cumulative += p;
        if uniform < cumulative {
            return index as u32;
        }
    }
    probs.len() as u32 - 1
}
