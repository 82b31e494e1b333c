//! Attention scores over sampled query rows keep the blocks exact scores keep: SmolLM2-135M
//! (the GGUF `cargo xtask fetch-model smollm2-135m` caches) on two shared books, every layer's
//! attention token-block scores with every query row and with every 4th, and the share of the
//! exactly kept blocks (the best 70%, `train`'s attention default) that the sampled scores keep
//! too. Skipped without the model or the shared data.

use burn::tensor::{Int, Tensor, TensorData};
use lemo_kernels::CpuBackend;
use lemo_kernels::precision::Precision;
use lemo_models::CausalLm;
use lemo_models::token_plan::{Record, TokenSparsity};
use lemo_models::tokenizer::Tokenizer;
use lemo_sparsity::Thresholds;
use lemo_test_support::{shared_data, smollm2_gguf};

type B = CpuBackend;

const TOKENS: usize = 2048;
const BLOCK: usize = 64;
const KEEP: f64 = 0.7;
const BOOKS: [&str; 2] = ["pg1342.txt", "pg2701.txt"];

/// Every layer's attention token-block scores of `tokens`, reading every `query_stride`-th
/// query row.
fn attention_scores(
    model: &CausalLm<B>,
    observe: &Thresholds,
    tokens: &[u32],
    query_stride: usize,
) -> Vec<Vec<f32>> {
    let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(
        TensorData::new(ids, [1, tokens.len()]),
        &Default::default(),
    );
    let mut sparsity =
        TokenSparsity::recording(observe, Record::Scores).with_query_stride(query_stride);
    model.hidden_states(tokens, None, &mut sparsity);
    let plan = sparsity.into_plan().expect("a recording pass has a plan");
    plan.scores
        .into_iter()
        .map(|layer| {
            layer
                .attention
                .expect("every attention block recorded")
                .scores
        })
        .collect()
}

/// The `count` best-scoring blocks.
fn best(scores: &[f32], count: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    order.truncate(count);
    order
}

#[test]
fn sampled_attention_scores_keep_the_exactly_kept_blocks() {
    let Some(path) = smollm2_gguf() else { return };
    let Some(data) = shared_data() else { return };
    let (model, config) =
        CausalLm::<B>::from_path(&path, &Default::default(), Precision::F32).unwrap();
    let tokenizer = Tokenizer::from_file(&path).unwrap();
    let observe = Thresholds {
        block_size: BLOCK,
        ..Thresholds::keep_all(
            config.architecture(),
            config.num_layers(),
            config.hidden_size(),
        )
    };
    let blocks = TOKENS / BLOCK;
    let count = (KEEP * blocks as f64).ceil() as usize;
    let mut recalls = vec![0.0f64; config.num_layers()];
    let mut differs = false;
    for book in BOOKS {
        let text = std::fs::read_to_string(data.join("corpora/gutenberg").join(book)).unwrap();
        let ids = tokenizer.encode(&text).unwrap();
        let tokens = &ids[ids.len() / 3..ids.len() / 3 + TOKENS];
        let exact = attention_scores(&model, &observe, tokens, 1);
        let sampled = attention_scores(&model, &observe, tokens, 4);
        differs |= exact != sampled;
        for (layer, (exact, sampled)) in exact.iter().zip(&sampled).enumerate() {
            let kept = best(sampled, count);
            let found = best(exact, count)
                .iter()
                .filter(|b| kept.contains(b))
                .count();
            recalls[layer] += found as f64 / count as f64 / BOOKS.len() as f64;
        }
    }
    let mean = recalls.iter().sum::<f64>() / recalls.len() as f64;
    let lowest = recalls.iter().cloned().fold(1.0, f64::min);
    let per_layer: Vec<String> = recalls.iter().map(|r| format!("{:.3}", r)).collect();
    println!(
        "SmolLM2-135M, {TOKENS} tokens of {BOOKS:?}, best {KEEP} of {blocks} blocks: recall of the exactly kept blocks by every-4th-row scores, mean {mean:.3}, lowest {lowest:.3}; per layer {}",
        per_layer.join(" ")
    );
    assert!(differs, "the sampled scores equal the exact ones");
    assert!(mean >= 0.9, "mean recall {mean:.3}");
}
