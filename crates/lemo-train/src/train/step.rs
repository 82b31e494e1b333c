//! One training step's arithmetic: the loss and gradients of a micro-batch, and validation loss.

use burn::tensor::ElementConversion;
use burn::tensor::backend::AutodiffBackend;
use lemo_kernels::exchange::Exchange;
use lemo_kernels::{LemoBackend, host_reads};
use lemo_models::CausalLm;
use lemo_models::activation_plan::ActivationPlan;
use lemo_models::loss::Batch;
use lemo_models::sequence_split::SequenceSplit;
use lemo_models::token_plan::TokenSparsity;

use super::optim::{self, NamedTensors};
use crate::data::{Sequence, int_labels, int_tokens};
use crate::memory;

/// Loss and gradient of one micro-batch. The model's next-token loss is the segment-based one:
/// the vocabulary projection and cross-entropy run (forward and backward) one segment of
/// `segment` positions at a time during the forward pass, so at most one segment's logits exist
/// at once; the backward pass then starts from the hidden-state gradients they left. Each layer
/// keeps, recomputes or offloads its activations as `activations` says (every layer kept: the
/// plain backward pass over one graph). Each block processes the rows `sparsity` gives it (the kept rows of `--method
/// lemo`), and the plan it chose is left in `sparsity`.
///
/// The batch's labels (Hugging Face style, see [`crate::data::int_labels`]) choose the predictions
/// scored; none: every one. `scale` multiplies the loss (1 / scored predictions of the global batch). Gradients of the
/// trainable parameters are added into `grads`; returns the unscaled loss sum, the number of
/// predictions and the memory in use at the end of the forward pass (with layers not kept: once
/// the loss's backward pass has run, while every layer's stored part is held).
pub fn forward_backward<B: AutodiffBackend + LemoBackend>(
    model: &CausalLm<B>,
    batch: Batch<B>,
    segment: usize,
    scale: f64,
    activations: &ActivationPlan,
    sparsity: &mut TokenSparsity,
    grads: &mut NamedTensors<B::InnerBackend>,
) -> (f64, usize, u64)
where
    B::InnerBackend: LemoBackend,
{
    // A rank of a sequence group runs the planned passes, which split the batch's sequences.
    let (loss_sum, predictions, after_forward) =
        if !activations.is_all_kept() || batch.split.is_some() {
            let mut after_forward = None;
            let (loss_sum, predictions) = model.next_token_loss_backward_planned(
                batch,
                segment,
                scale,
                sparsity,
                activations,
                &mut |gradients| {
                    after_forward.get_or_insert_with(|| memory::sample().in_use);
                    optim::accumulate_grads(model, gradients, grads);
                },
            );
            (loss_sum, predictions, after_forward.unwrap_or_default())
        } else {
            let Batch { tokens, labels, .. } = batch;
            let (loss, predictions) = model.next_token_loss_sum(tokens, labels, segment, sparsity);
            let after_forward = memory::sample().in_use;
            let loss_sum = loss.clone().inner();
            let model_grads = loss.mul_scalar(scale).backward();
            optim::accumulate_grads(model, &model_grads, grads);
            (loss_sum, predictions, after_forward)
        };
    // The step's one host read.
    let loss_sum = host_reads::read_f32(loss_sum)[0] as f64;
    (loss_sum, predictions, after_forward)
}

/// Summed next-token loss of `sequences` over their scored predictions, and the number of these
/// (evaluation mode: dense attention, no graph); with a `sequence_group`, of this rank's
/// positions of each sequence (summed over the group: the whole sequences').
pub fn validation_sums<B: LemoBackend>(
    model: &CausalLm<B>,
    sequences: &[Sequence],
    segment: usize,
    sequence_group: Option<&Exchange>,
) -> anyhow::Result<(f64, usize)> {
    let device = model.lm_head_weight().device();
    let (mut sum, mut count) = (0.0, 0usize);
    for sequence in sequences {
        let one = std::slice::from_ref(sequence);
        let (tokens, labels) = (int_tokens::<B>(one, &device), int_labels::<B>(one, &device));
        let (loss, n) = match sequence_group {
            Some(group) => {
                let split = SequenceSplit::zigzag(tokens.dims()[1], group.clone())?;
                let batch = Batch {
                    split: Some(split),
                    ..Batch::new(tokens, labels)
                };
                model.split_loss_sum(batch, segment)
            }
            None => model.next_token_loss_sum(tokens, labels, segment, &mut TokenSparsity::Dense),
        };
        sum += loss.into_scalar().elem::<f64>();
        count += n;
    }
    Ok((sum, count))
}
