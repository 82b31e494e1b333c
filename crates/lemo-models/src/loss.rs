//! The loss head: next-token cross-entropy from a decoder's final hidden states, by the segment
//! loss (the `[len, vocab]` logits never exist at once), with labels that skip positions, and
//! over the positions of a sequence split across ranks.

use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Int, Tensor};
use lemo_kernels::LemoBackend;
use lemo_kernels::loss::{IGNORE_INDEX, segment_cross_entropy};

use crate::decoder::{Decoder, layers_output};
use crate::sequence_split::SequenceSplit;
use crate::token_plan::TokenSparsity;

/// What a pass over a batch runs on: this rank's tokens (every token without a split), the
/// target each of its positions is scored against in the whole sequence (the next token may be
/// another rank's), how many of them are scored, and the state every layer shares.
pub(crate) struct PassInputs<B: Backend, S> {
    pub(crate) tokens: Tensor<B, 2, Int>,
    pub(crate) targets: Tensor<B, 2, Int>,
    pub(crate) predictions: usize,
    pub(crate) split: Option<SequenceSplit>,
    /// Tokens of each whole sequence.
    pub(crate) len: usize,
    pub(crate) shared: S,
}

impl<B: Backend, S> PassInputs<B, S> {
    pub(crate) fn of<D: Decoder<B, Shared = S>>(decoder: &D, batch: Batch<B>) -> Self {
        let Batch {
            tokens,
            labels,
            split,
        } = batch;
        let [batch, len] = tokens.dims();
        let targets = next_token_targets(tokens.clone(), labels.clone());
        let (tokens, targets) = match &split {
            Some(split) => (split.local_columns(tokens), split.local_columns(targets)),
            None => (tokens, targets),
        };
        let predictions = match (&labels, &split) {
            (Some(_), _) => scored_targets(&targets),
            (None, None) => batch * (len - 1),
            (None, Some(split)) => {
                batch * split.positions().iter().filter(|&&p| p + 1 < len).count()
            }
        };
        let shared = decoder.shared(0..len, batch, split.as_ref());
        Self {
            tokens,
            targets,
            predictions,
            split,
            len,
            shared,
        }
    }
}

/// The summed next-token loss of this rank's positions of `batch`'s sequences, split over a
/// sequence group, and how many predictions it sums (evaluation: no graph is needed, every
/// block is dense); summed over the group, the whole sequences' (see [`next_token_loss`]).
pub fn split_loss_sum<B: LemoBackend, D: Decoder<B>>(
    decoder: &D,
    batch: Batch<B>,
    chunk_rows: usize,
) -> (Tensor<B, 1>, usize) {
    let PassInputs {
        tokens,
        targets,
        predictions,
        shared,
        ..
    } = PassInputs::of(decoder, batch);
    let local = tokens.dims()[1];
    let hidden = layers_output(
        decoder,
        tokens,
        0..local,
        &shared,
        None,
        &mut TokenSparsity::Dense,
    );
    let loss = targets_loss(hidden, decoder.lm_head_weight(), targets, chunk_rows);
    (loss, predictions)
}

/// The token ids of a batch, `[batch, len]`, and the labels the loss scores them by where it
/// skips positions (`[batch, len]`, see [`next_token_loss`]); without labels every next token
/// is scored. With a `split`, a rank of a sequence group trains its positions of the batch's
/// sequences ([`crate::planned_backward::planned_loss_backward`]); `tokens` and `labels` are still the whole sequences.
#[derive(Debug, Clone)]
pub struct Batch<B: Backend> {
    pub tokens: Tensor<B, 2, Int>,
    pub labels: Option<Tensor<B, 2, Int>>,
    pub split: Option<SequenceSplit>,
}

impl<B: Backend> Batch<B> {
    /// The whole sequences of `tokens`, scored by `labels`.
    pub fn new(tokens: Tensor<B, 2, Int>, labels: Option<Tensor<B, 2, Int>>) -> Self {
        Self {
            tokens,
            labels,
            split: None,
        }
    }
}

/// Sum over all positions but the last of `-log p(tokens[t+1] | tokens[..=t])` (f32, `[1]`) from
/// the final hidden states, and the number of terms, by the segment-based loss: the vocabulary
/// projection and the cross-entropy run `chunk_rows` positions at a time, so the full
/// `[len, vocab]` logits never exist at once (under autodiff, neither do their gradients).
///
/// With `labels` (`[batch, len]`, Hugging Face's convention: the token, or
/// [`lemo_kernels::loss::IGNORE_INDEX`] where no loss is taken, as for a prompt's tokens or the first token of a
/// packed document) the terms are those of the labels that are not ignored; ignored ones add
/// neither loss nor gradient.
pub fn next_token_loss<B: LemoBackend>(
    hidden: Tensor<B, 3>,
    lm_head_weight: Tensor<B, 2>,
    tokens: Tensor<B, 2, Int>,
    labels: Option<Tensor<B, 2, Int>>,
    chunk_rows: usize,
) -> (Tensor<B, 1>, usize) {
    let [batch, len] = tokens.dims();
    let masked = labels.is_some();
    let targets = next_token_targets(tokens, labels);
    let scored = match masked {
        true => scored_targets(&targets),
        false => batch * (len - 1),
    };
    (
        targets_loss(hidden, lm_head_weight, targets, chunk_rows),
        scored,
    )
}

/// `[batch, len]`: the token each position is scored against (the next one, or its label), and
/// [`IGNORE_INDEX`] at the last position, which has none.
fn next_token_targets<B: Backend>(
    tokens: Tensor<B, 2, Int>,
    labels: Option<Tensor<B, 2, Int>>,
) -> Tensor<B, 2, Int> {
    let [batch, len] = tokens.dims();
    let next = labels.unwrap_or(tokens).slice([0..batch, 1..len]);
    let last = Tensor::full([batch, 1], IGNORE_INDEX, &next.device());
    Tensor::cat(vec![next, last], 1)
}

/// How many of `targets` are scored (not ignored).
fn scored_targets<B: Backend>(targets: &Tensor<B, 2, Int>) -> usize {
    let count: i64 = targets
        .clone()
        .greater_equal_elem(0)
        .int()
        .sum()
        .into_scalar()
        .elem();
    count as usize
}

/// The summed cross-entropy of `hidden: [batch, len, dim]` against `targets: [batch, len]` (see
/// [`next_token_loss`]).
pub(crate) fn targets_loss<B: LemoBackend>(
    hidden: Tensor<B, 3>,
    lm_head_weight: Tensor<B, 2>,
    targets: Tensor<B, 2, Int>,
    chunk_rows: usize,
) -> Tensor<B, 1> {
    let [batch, len, dim] = hidden.dims();
    // Each position is scored against the next token and the last one, which has none, is
    // ignored: shifting the targets rather than slicing off the last hidden state keeps the
    // rows a view of the final norm's output. The slice would be a copy of a size no other
    // buffer has (805 MB at 96K tokens of Llama-2-7B), and the pool serves such a buffer from a
    // page of its largest size class, which then stays reserved (9.4 GB on the H200).
    let inputs = hidden.reshape([batch * len, dim]);
    segment_cross_entropy(
        inputs,
        lm_head_weight,
        targets.reshape([batch * len]),
        chunk_rows,
    )
}
