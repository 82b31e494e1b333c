//! The loss on masked labels (chat data trained on the assistant's tokens only, packed
//! documents whose first token is not predicted from the previous document): the segment-based
//! loss with ignored labels equals a plain cross-entropy over the kept positions alone, with the
//! same gradients, through the plain, the recomputing and the token-eliminating passes.

use crate::common::{GradientSums, assert_same_gradients, half_kept, trainable_model};
use burn::backend::Autodiff;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Distribution, ElementConversion, Int, Tensor, TensorData};
use lemo_kernels::CpuBackend;
use lemo_kernels::loss::IGNORE_INDEX;
use lemo_models::CausalLm;
use lemo_models::activation_plan::{ActivationPlan, LayerActivations};
use lemo_models::lora::LLAMA_PROJECTIONS;
use lemo_models::loss::Batch;
use lemo_models::token_plan::TokenSparsity;

type B = Autodiff<CpuBackend>;

const SHAPE: [usize; 2] = [2, 48];

/// Random tokens and labels that ignore about half of the positions in runs (prompts).
fn batch(model: &CausalLm<B>) -> (Tensor<B, 2, Int>, Vec<i64>) {
    let [vocab, _] = model.lm_head_weight().dims();
    let tokens = Tensor::<B, 2, Int>::random(
        SHAPE,
        Distribution::Uniform(0.0, vocab as f64),
        &Default::default(),
    );
    let ids: Vec<i64> = tokens.to_data().convert::<i64>().to_vec().unwrap();
    let mut rng = lemo_test_support::HostRng::new(lemo_test_support::seed());
    let mut trained = false;
    let labels = ids
        .iter()
        .map(|&id| {
            if rng.below(6) == 0 {
                trained = !trained;
            }
            if trained { id } else { IGNORE_INDEX }
        })
        .collect();
    (tokens, labels)
}

fn label_tensor(labels: &[i64]) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(labels.to_vec(), SHAPE), &Default::default())
}

/// `sum -log p(labels[b, t] | tokens[b, ..t])` over the labels kept, from the full logits.
fn plain_cross_entropy(
    model: &CausalLm<B>,
    tokens: Tensor<B, 2, Int>,
    labels: &[i64],
) -> (Tensor<B, 1>, usize) {
    let [batch, len] = SHAPE;
    let logits = model.forward(tokens, None);
    let vocab = logits.dims()[2];
    let log_probs = log_softmax(logits, 2);
    let mut terms = Vec::new();
    for b in 0..batch {
        for t in 1..len {
            let label = labels[b * len + t];
            if label >= 0 {
                terms.push(
                    log_probs
                        .clone()
                        .slice([b..b + 1, t - 1..t, label as usize..label as usize + 1])
                        .reshape([1]),
                );
            }
        }
    }
    assert!(vocab > 0 && !terms.is_empty());
    let count = terms.len();
    (Tensor::cat(terms, 0).sum().neg(), count)
}

fn gradients(model: &CausalLm<B>, loss: Tensor<B, 1>) -> GradientSums<B> {
    let mut sums = GradientSums::default();
    sums.add(model, &loss.backward());
    sums
}

fn close(what: &str, a: Tensor<B, 1>, b: Tensor<B, 1>) {
    let (a, b): (f32, f32) = (a.into_scalar().elem(), b.into_scalar().elem());
    assert!((a - b).abs() <= 1e-5 * b.abs(), "{what}: {a} vs {b}");
}

#[test]
fn masked_segment_loss_is_the_cross_entropy_of_the_kept_labels() {
    let model = trainable_model::<B>(
        "llama_gqa_tied",
        &LLAMA_PROJECTIONS,
        false,
        &Default::default(),
    );
    let (tokens, labels) = batch(&model);
    let (expected, count) = plain_cross_entropy(&model, tokens.clone(), &labels);
    let (loss, scored) = model.next_token_loss_sum(
        tokens.clone(),
        Some(label_tensor(&labels)),
        7,
        &mut TokenSparsity::Dense,
    );
    assert_eq!(scored, count);
    close("masked loss", loss.clone(), expected.clone());
    let masked: f32 = loss.clone().into_scalar().elem();
    assert_same_gradients(gradients(&model, expected), gradients(&model, loss), 1e-4);

    // The unmasked loss differs: the mask is honoured, not ignored.
    let (all, rows) = model.next_token_loss_sum(tokens, None, 7, &mut TokenSparsity::Dense);
    assert_eq!(rows, SHAPE[0] * (SHAPE[1] - 1));
    let all: f32 = all.into_scalar().elem();
    assert!(all > masked * 1.2, "{all} vs {masked}");
}

#[test]
fn recomputing_and_token_eliminating_passes_honour_the_mask() {
    let model = trainable_model::<B>(
        "llama_gqa_tied",
        &LLAMA_PROJECTIONS,
        false,
        &Default::default(),
    );
    let (tokens, labels) = batch(&model);
    let (dense, count) = model.next_token_loss_sum(
        tokens.clone(),
        Some(label_tensor(&labels)),
        7,
        &mut TokenSparsity::Dense,
    );
    let dense_value = dense.clone().inner();
    let dense_gradients = gradients(&model, dense);

    let mut recomputed = GradientSums::default();
    let (loss, scored) = model.next_token_loss_backward_planned(
        Batch::new(tokens.clone(), Some(label_tensor(&labels))),
        7,
        1.0,
        &mut TokenSparsity::Dense,
        &ActivationPlan::uniform(LayerActivations::Recomputed, model.num_layers()),
        &mut |g| recomputed.add(&model, g),
    );
    assert_eq!(scored, count);
    close(
        "recomputed",
        Tensor::from_inner(loss),
        Tensor::from_inner(dense_value.clone()),
    );
    assert_same_gradients(dense_gradients, recomputed, 1e-4);

    // Token elimination computes every row's loss (the dense loss) on the same labels.
    let thresholds = half_kept(&model, 8);
    let (sparse, scored) = model.next_token_loss_sum(
        tokens,
        Some(label_tensor(&labels)),
        7,
        &mut TokenSparsity::select(&thresholds),
    );
    assert_eq!(scored, count);
    close(
        "token elimination",
        sparse.clone(),
        Tensor::from_inner(dense_value),
    );
    assert!(!gradients(&model, sparse).is_zero());
}
