//! Any mix of kept, recomputed and offloaded layers gives the loss and gradients of the plain
//! backward pass (offload is a host copy on the CPU backend).

use crate::common::{GradientSums, assert_same_gradients, trainable_model};
use burn::backend::Autodiff;
use lemo_kernels::CpuBackend;
use lemo_models::CausalLm;
use lemo_models::activation_plan::{ActivationPlan, LayerActivations};
use lemo_models::decoder::Decoder;
use lemo_models::lora::LLAMA_PROJECTIONS;
use lemo_models::loss::Batch;
use lemo_models::token_plan::{DroppedRows, TokenSparsity};
use lemo_sparsity::Thresholds;
use lemo_test_support::random_tokens;

type B = Autodiff<CpuBackend>;

/// Every layer recomputed, and the three modes in turn from each starting mode, so that every
/// layer is kept, recomputed and offloaded in one of the plans, next to layers of other modes.
fn plans(num_layers: usize) -> Vec<ActivationPlan> {
    let cycled = |shift: usize| {
        ActivationPlan::new(
            (0..num_layers)
                .map(|layer| LayerActivations::ALL[(layer + shift) % 3])
                .collect(),
        )
    };
    std::iter::once(ActivationPlan::uniform(
        LayerActivations::Recomputed,
        num_layers,
    ))
    .chain((0..3).map(cycled))
    .collect()
}

/// Compares the plain backward pass with the planned one under each of [`plans`], dense or with
/// token elimination by `thresholds` (the recomputation replays the rows the forward pass chose).
fn assert_recomputation_matches(model: &CausalLm<B>, len: usize, thresholds: Option<&Thresholds>) {
    let sparsity = || thresholds.map_or(TokenSparsity::Dense, TokenSparsity::select);
    assert_recomputation_matches_under(model, len, &sparsity);
}

/// [`assert_recomputation_matches`] with each pass's token sparsity made by `sparsity`.
fn assert_recomputation_matches_under<'a>(
    model: &CausalLm<B>,
    len: usize,
    sparsity: &dyn Fn() -> TokenSparsity<'a>,
) {
    let [vocab, _] = model.lm_head_weight().dims();
    let tokens = random_tokens::<B>(vocab, [1, len], &Default::default());
    let (chunk_rows, scale) = (7, 0.25);

    let (loss, predictions) =
        model.next_token_loss_sum(tokens.clone(), None, chunk_rows, &mut sparsity());
    let mut plain = GradientSums::default();
    plain.add(model, &loss.clone().mul_scalar(scale).backward());
    let plain_loss: f32 = loss.into_scalar();

    for plan in plans(model.num_layers()) {
        let mut planned = GradientSums::default();
        let (loss, planned_predictions) = model.next_token_loss_backward_planned(
            Batch::new(tokens.clone(), None),
            chunk_rows,
            scale,
            &mut sparsity(),
            &plan,
            &mut |gradients| planned.add(model, gradients),
        );
        let planned_loss: f32 = loss.into_scalar();
        println!(
            "plan {}: loss {plain_loss} vs {planned_loss}",
            String::from(plan)
        );
        assert_eq!(predictions, planned_predictions);
        assert!(
            (plain_loss - planned_loss).abs() <= 1e-5 * plain_loss.abs(),
            "loss {plain_loss} vs {planned_loss}"
        );
        assert_same_gradients(plain.clone(), planned, 1e-4);
    }
}

#[test]
fn recomputed_lora_gradients_match_llama() {
    let model = trainable_model(
        "llama_gqa_tied",
        &LLAMA_PROJECTIONS,
        false,
        &Default::default(),
    );
    assert_recomputation_matches(&model, 45, None);
}

#[test]
fn recomputed_longlora_gradients_match_with_tied_trainable_embeddings() {
    let mut model = trainable_model(
        "llama_gqa_tied",
        &["q_proj", "v_proj"],
        true,
        &Default::default(),
    );
    model.set_shifted_group(Some(16));
    assert_recomputation_matches(&model, 64, None);
}

#[test]
fn recomputed_lora_gradients_match_opt() {
    for fixture in ["opt_prenorm_proj", "opt_postnorm_proj"] {
        let model = trainable_model(
            fixture,
            &["q_proj", "v_proj", "fc1"],
            false,
            &Default::default(),
        );
        assert_recomputation_matches(&model, 33, None);
    }
}

#[test]
fn recomputed_lemo_gradients_replay_the_kept_rows() {
    let model = trainable_model(
        "llama_gqa_tied",
        &LLAMA_PROJECTIONS,
        true,
        &Default::default(),
    );
    // Blocks of 8 tokens: every block keeps the first and last block and the best half.
    let thresholds = crate::common::half_kept(&model, 8);
    assert_recomputation_matches(&model, 61, Some(&thresholds));
}

/// With S2 at the kept rows' positions (`lemo --s2`): 61 tokens select over the whole sequence
/// (they do not cut into half groups of 8); 64 tokens in groups of 32 select within half groups
/// of four blocks of 4, whose runs the kept rows' attention counts without reading them.
#[test]
fn recomputed_lemo_s2_gradients_replay_the_kept_rows() {
    let mut model = trainable_model(
        "llama_gqa_tied",
        &LLAMA_PROJECTIONS,
        false,
        &Default::default(),
    );
    for (group, block_size, len) in [(16, 8, 61), (32, 4, 64)] {
        model.set_shifted_group(Some(group));
        let thresholds = crate::common::half_kept(&model, block_size);
        assert_recomputation_matches(&model, len, Some(&thresholds));
    }
}

/// Whether layer `index`'s MLP block is frozen, so the recomputation keeps only its input.
fn frozen_mlp(model: &CausalLm<B>, index: usize) -> bool {
    match model {
        CausalLm::Llama(m) => m.frozen_mlp(index).is_some(),
        CausalLm::Opt(m) => m.frozen_mlp(index).is_some(),
    }
}

/// Dense, and token-sparse: a rebuilt frozen MLP block recomputes its backward pass from its
/// input on the rows its gradient reaches, every row with exact dropped rows, the kept rows
/// without.
#[test]
fn recomputed_frozen_mlp_blocks_back_propagate_from_their_input_alone() {
    let attention_only: [(&str, &[&str]); 2] = [
        ("llama_gqa_tied", &LLAMA_PROJECTIONS[..4]),
        ("opt_prenorm_proj", &["q_proj", "v_proj"]),
    ];
    for (fixture, targets) in attention_only {
        let model = trainable_model(fixture, targets, false, &Default::default());
        assert!(
            frozen_mlp(&model, 0),
            "{fixture}: MLP blocks without adapters are frozen"
        );
        assert_recomputation_matches(&model, 37, None);
        let thresholds = crate::common::half_kept(&model, 8);
        for dropped_rows in [DroppedRows::Exact, DroppedRows::Residual] {
            println!("{fixture}, token-sparse, {dropped_rows:?} dropped rows");
            assert_recomputation_matches_under(&model, 61, &|| {
                TokenSparsity::select(&thresholds).with_dropped_rows(dropped_rows)
            });
        }
    }
    // Adapters or a trainable norm in the block keep its activations in the graph.
    let adapted = trainable_model(
        "llama_gqa_tied",
        &LLAMA_PROJECTIONS,
        false,
        &Default::default(),
    );
    let norms = trainable_model(
        "llama_gqa_tied",
        &LLAMA_PROJECTIONS[..4],
        true,
        &Default::default(),
    );
    let post_norm = trainable_model("opt_postnorm_proj", &["q_proj"], false, &Default::default());
    for model in [adapted, norms, post_norm] {
        assert!(!frozen_mlp(&model, 0));
    }
}

#[test]
fn recomputed_lemo_layers_with_a_dense_frozen_mlp_block_match() {
    let model = trainable_model(
        "llama_gqa_tied",
        &LLAMA_PROJECTIONS[..4],
        false,
        &Default::default(),
    );
    let mut thresholds = crate::common::half_kept(&model, 8);
    thresholds.layers[0].mlp = None;
    assert_recomputation_matches(&model, 61, Some(&thresholds));
}

/// OPT's rebuilt token-sparse MLP block with an adapter computes its kept rows alone.
#[test]
fn recomputed_lemo_gradients_match_opt() {
    let model = trainable_model(
        "opt_prenorm_proj",
        &["q_proj", "v_proj", "fc1"],
        false,
        &Default::default(),
    );
    let thresholds = crate::common::half_kept(&model, 8);
    assert_recomputation_matches(&model, 45, Some(&thresholds));
}
