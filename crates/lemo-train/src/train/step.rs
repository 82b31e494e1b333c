//! One training step's arithmetic: the loss and gradients of a micro-batch, and validation loss.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Int, Tensor};
use lemo_kernels::LemoBackend;
use lemo_models::CausalLm;
use lemo_models::token_plan::TokenSparsity;

use super::optim::{self, NamedTensors};
use crate::data::int_tokens;
use crate::memory;

/// Loss and gradient of one micro-batch. The model's next-token loss is the segment-based one:
/// the vocabulary projection and cross-entropy run (forward and backward) one segment of
/// `segment` positions at a time during the forward pass, so at most one segment's logits exist
/// at once; the backward pass then starts from the hidden-state gradients they left. With
/// `checkpointing`, only each layer's input is kept and the backward pass recomputes one layer
/// at a time. Each block processes the rows `sparsity` gives it (the kept rows of `--method
/// lemo`), and the plan it chose is left in `sparsity`.
///
/// `scale` multiplies the loss (1 / predicted tokens / accumulation steps). Gradients of the
/// trainable parameters are added into `grads`; returns the unscaled loss sum, the number of
/// predictions and the memory in use at the end of the forward pass (with checkpointing: once
/// the loss's backward pass has run, while every layer input is kept).
pub fn forward_backward<B: AutodiffBackend + LemoBackend>(
    model: &CausalLm<B>,
    tokens: Tensor<B, 2, Int>,
    segment: usize,
    scale: f64,
    checkpointing: bool,
    sparsity: &mut TokenSparsity,
    grads: &mut NamedTensors<B::InnerBackend>,
) -> (f64, usize, u64)
where
    B::InnerBackend: LemoBackend,
{
    let (loss_sum, predictions, after_forward) = if checkpointing {
        let mut after_forward = None;
        let (loss_sum, predictions) = model.next_token_loss_backward_recomputed(
            tokens,
            None,
            segment,
            scale,
            sparsity,
            &mut |gradients| {
                after_forward.get_or_insert_with(|| memory::sample().in_use);
                optim::accumulate_grads(model, gradients, grads);
            },
        );
        (loss_sum, predictions, after_forward.unwrap_or_default())
    } else {
        let (loss, predictions) = model.next_token_loss_sum(tokens, None, segment, sparsity);
        let after_forward = memory::sample().in_use;
        let loss_sum = loss.clone().inner();
        let model_grads = loss.mul_scalar(scale).backward();
        optim::accumulate_grads(model, &model_grads, grads);
        (loss_sum, predictions, after_forward)
    };
    (
        loss_sum.into_scalar().elem::<f64>(),
        predictions,
        after_forward,
    )
}

/// Summed next-token loss of `sequences` and the number of predictions (evaluation mode: dense
/// attention, no graph).
pub fn validation_sums<B: LemoBackend>(
    model: &CausalLm<B>,
    sequences: &[Vec<u32>],
    segment: usize,
) -> (f64, usize) {
    let device = model.lm_head_weight().device();
    let (mut sum, mut count) = (0.0, 0usize);
    for sequence in sequences {
        let tokens = int_tokens::<B>(std::slice::from_ref(sequence), &device);
        let (loss, n) = model.next_token_loss_sum(tokens, None, segment, &mut TokenSparsity::Dense);
        sum += loss.into_scalar().elem::<f64>();
        count += n;
    }
    (sum, count)
}
