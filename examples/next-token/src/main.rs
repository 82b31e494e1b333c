//! Using `lemo-models` on its own in a Burn program: load a model, tokenize a prompt, and print
//! the five likeliest next tokens.
//!
//! ```sh
//! cargo run --release -p next-token -- ../shared/data/models/stories260K/stories260K.bin \
//!     ../shared/data/models/stories260K/tok512.bin "Once upon a time"
//! ```

use std::path::PathBuf;

use anyhow::{Context, Result};
use burn::tensor::activation::softmax;
use burn::tensor::{Int, Tensor, TensorData};
use lemo_kernels::CpuBackend;
use lemo_kernels::precision::Precision;
use lemo_models::CausalLm;
use lemo_models::tokenizer::Tokenizer;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: next-token MODEL TOKENIZER PROMPT";
    let model_path = PathBuf::from(args.next().context(usage)?);
    let tokenizer = Tokenizer::from_file(&PathBuf::from(args.next().context(usage)?))?;
    let prompt = args.next().context(usage)?;

    let device = Default::default();
    let (model, _config) = CausalLm::<CpuBackend>::from_path(&model_path, &device, Precision::F32)?;
    let ids: Vec<i32> = tokenizer
        .encode(&prompt)?
        .into_iter()
        .map(|id| id as i32)
        .collect();
    let tokens = Tensor::<CpuBackend, 2, Int>::from_data(
        TensorData::new(ids.clone(), [1, ids.len()]),
        &device,
    );

    let logits = model.forward(tokens, None);
    let [_, len, vocab] = logits.dims();
    let probs: Vec<f32> = softmax(logits.slice([0..1, len - 1..len]).reshape([vocab]), 0)
        .into_data()
        .to_vec()?;
    let mut ranked: Vec<(usize, f32)> = probs.into_iter().enumerate().collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!("{prompt:?} continues with:");
    for (id, p) in ranked.into_iter().take(5) {
        println!(
            "  {:>6.2}%  {:?}",
            100.0 * p,
            tokenizer.decode(&[id as u32])
        );
    }
    Ok(())
}
