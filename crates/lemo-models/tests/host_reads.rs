//! A token-sparse training step reads nothing back from the device when its blocks keep a
//! fixed fraction of their best token blocks (`--keep-exactly`, predicted scores): the kept
//! counts are known ahead and the rows are selected on the device. Thresholds relative to the
//! scores cost one read per token-eliminating block. Counted the way `bench` counts them
//! (`lemo_kernels::host_reads`, per thread).

use crate::common::{half_kept, trainable_model};
use burn::backend::Autodiff;
use burn::tensor::{Distribution, Int, Tensor};
use lemo_kernels::{CpuBackend, host_reads};
use lemo_models::CausalLm;
use lemo_models::activation_plan::{ActivationPlan, LayerActivations};
use lemo_models::lora::LLAMA_PROJECTIONS;
use lemo_models::loss::Batch;
use lemo_models::token_plan::TokenSparsity;
use lemo_sparsity::Thresholds;
use lemo_sparsity::calibration::Block;

type B = Autodiff<CpuBackend>;

/// Host reads of one forward and backward pass (plain graph, or per-layer recomputation) of
/// `tokens` under `thresholds`, and the mean kept fraction of the attention blocks.
fn reads_of_a_step(
    model: &CausalLm<B>,
    tokens: Tensor<B, 2, Int>,
    thresholds: &Thresholds,
    recomputed: bool,
) -> (usize, f64) {
    let before = host_reads::count();
    let mut sparsity = TokenSparsity::select(thresholds);
    if recomputed {
        let plan = ActivationPlan::uniform(LayerActivations::Recomputed, model.num_layers());
        model.next_token_loss_backward_planned(
            Batch::new(tokens, None),
            5,
            1.0,
            &mut sparsity,
            &plan,
            &mut |_| {},
        );
    } else {
        let (loss, _) = model.next_token_loss_sum(tokens, None, 5, &mut sparsity);
        drop(loss.backward());
    }
    let plan = sparsity.into_plan().expect("a selecting pass has a plan");
    (
        host_reads::count() - before,
        plan.keep_fraction(Block::Attention),
    )
}

#[test]
fn a_step_keeping_the_best_blocks_reads_nothing_back_and_relative_thresholds_read_per_block() {
    let device = Default::default();
    let model = trainable_model::<B>("llama_gqa_tied", &LLAMA_PROJECTIONS, false, &device);
    let [vocab, _] = model.lm_head_weight().dims();
    let tokens =
        Tensor::<B, 2, Int>::random([2, 96], Distribution::Uniform(0.0, vocab as f64), &device);
    // Twelve blocks of 8 tokens per sequence; every block of every layer keeps its best half.
    let best = half_kept(&model, 8);
    for recomputed in [false, true] {
        let (reads, keep) = reads_of_a_step(&model, tokens.clone(), &best, recomputed);
        assert_eq!(reads, 0, "recomputed: {recomputed}");
        assert_eq!(keep, 0.5, "recomputed: {recomputed}");
    }
    // Thresholds relative to each sequence's mean score: the count comes from the scores.
    let mut relative = best.clone();
    for layer in &mut relative.layers {
        (layer.attention, layer.mlp) = (Some(1.0), Some(1.0));
    }
    let (reads, _) = reads_of_a_step(&model, tokens, &relative, false);
    assert_eq!(reads, 2 * model.num_layers());
}
