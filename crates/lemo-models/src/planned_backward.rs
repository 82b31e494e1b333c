//! The loss and its gradients with each layer's activations held as an [`ActivationPlan`] says:
//! kept as a graph, recomputed from its input on the device, or recomputed from its input
//! offloaded to host memory.

use std::ops::Range;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor};
use lemo_kernels::LemoBackend;
use lemo_kernels::memory::LayerBuffers;

use crate::activation_plan::{ActivationPlan, LayerActivations};
use crate::decoder::{Decoder, LayerRun, layer, row_buffers};
use crate::loss::{Batch, PassInputs, targets_loss};
use crate::offload::HostCopy;
use crate::sequence_split::SequenceSplit;
use crate::token_plan::TokenSparsity;

/// What a layer holds between its forward and its backward pass (see [`ActivationPlan`]).
enum Stored<B: AutodiffBackend> {
    /// Its graph, from a leaf input to its output.
    Graph {
        input: Tensor<B, 3>,
        output: Tensor<B, 3>,
    },
    Input(Tensor<B::InnerBackend, 3>),
    Host(HostCopy<B::InnerBackend>),
}

/// What the forward pass of [`planned_loss_backward`] leaves for its backward pass.
struct StoredForward<B: AutodiffBackend> {
    /// What each layer stored.
    layers: Vec<Stored<B>>,
    /// `h_L`.
    last: Tensor<B::InnerBackend, 3>,
    /// The pass's exact-size buffers (see [`crate::decoder::row_buffers`]).
    buffers: LayerBuffers<B::InnerBackend>,
}

/// The forward pass of [`planned_loss_backward`] over `tokens` (this rank's positions of the
/// sequences at `positions` with a `split`): each layer's graph from a leaf copy of its input
/// where `plan` keeps it, else the layer without a graph and its input kept on the device or
/// copied to host memory.
fn forward_storing<B, D>(
    decoder: &D,
    tokens: Tensor<B, 2, Int>,
    (positions, split): (Range<usize>, Option<&SequenceSplit>),
    shared: &D::Shared,
    sparsity: &mut TokenSparsity,
    plan: &ActivationPlan,
) -> StoredForward<B>
where
    B: AutodiffBackend + LemoBackend,
    B::InnerBackend: LemoBackend,
    D: Decoder<B> + AutodiffModule<B>,
    D::InnerModule: Decoder<B::InnerBackend>,
{
    let [batch, len] = tokens.dims();
    let inner = decoder.valid();
    let inner_shared = inner.shared(positions, batch, split);
    let tokens = tokens.inner();
    let mut buffers = row_buffers(&inner, &tokens);
    let mut h = inner.embed(tokens, 0..len);
    let mut stored = Vec::with_capacity(plan.num_layers());
    for (index, mode) in plan.layers().iter().enumerate() {
        // What the layers below left idle must not sit beside what this one saves, nor the
        // inputs already copied to the host.
        buffers.between_layers();
        lemo_kernels::host_copy::release_copied::<B::InnerBackend>(&h.device());
        let saved = match mode {
            LayerActivations::Kept => {
                let input = Tensor::<B, 3>::from_inner(h).require_grad();
                let output = layer(
                    decoder,
                    index,
                    input.clone(),
                    shared,
                    None,
                    sparsity,
                    LayerRun::Graph,
                );
                h = output.clone().inner();
                stored.push(Stored::Graph { input, output });
                continue;
            }
            LayerActivations::Recomputed => Stored::Input(h.clone()),
            LayerActivations::Offloaded => Stored::Host(HostCopy::new(h.clone())),
        };
        stored.push(saved);
        h = layer(
            &inner,
            index,
            h,
            &inner_shared,
            None,
            sparsity,
            LayerRun::Value,
        );
    }
    StoredForward {
        layers: stored,
        last: h,
        buffers,
    }
}

/// [`crate::loss::next_token_loss`] of `tokens` (positions from 0) and the gradients of `scale` times it
/// (with the batch's `split`, of this rank's positions: the loss of the rank's predictions, and
/// its share of the gradients, which summed over the group are the whole sequence's),
/// each layer's activations held as `plan` says. The forward pass builds a kept layer's graph
/// from a leaf copy of its input, and runs the other layers without a graph, keeping only their
/// input (on the device, or copied to host memory); the backward pass then goes down the layers,
/// back-propagating the gradient of each layer's output through its kept graph or through one
/// rebuilt from its input (an offloaded input is fetched back while the layer above runs).
/// Memory is the kept layers' activations, the other layers' inputs and one rebuilt layer's
/// activations, less a frozen MLP block's; a rebuilt layer costs its attention block's forward
/// pass again and its MLP block's input projections (see [`LayerRun::Rebuild`]).
///
/// Each partial backward pass's gradients go to `on_gradients` (the loss head's first, then the
/// layers' from the last, then the embedding's when it is trainable): a trainable parameter gets
/// its gradient from the passes that used it, so the caller sums what it finds in each. Returns
/// the unscaled loss sum and the number of predictions.
pub fn planned_loss_backward<B, D>(
    decoder: &D,
    batch: Batch<B>,
    chunk_rows: usize,
    scale: f64,
    sparsity: &mut TokenSparsity,
    plan: &ActivationPlan,
    on_gradients: &mut dyn FnMut(&B::Gradients),
) -> (Tensor<B::InnerBackend, 1>, usize)
where
    B: AutodiffBackend + LemoBackend,
    B::InnerBackend: LemoBackend,
    D: Decoder<B> + AutodiffModule<B>,
    D::InnerModule: Decoder<B::InnerBackend>,
{
    assert_eq!(
        plan.num_layers(),
        decoder.num_layers(),
        "one mode per layer"
    );
    let PassInputs {
        tokens,
        targets,
        predictions,
        split,
        len,
        shared,
    } = PassInputs::of(decoder, batch);
    let positions = 0..tokens.dims()[1];
    let StoredForward {
        layers: mut stored,
        last: h,
        mut buffers,
    } = forward_storing(
        decoder,
        tokens.clone(),
        (0..len, split.as_ref()),
        &shared,
        sparsity,
        plan,
    );

    let last = Tensor::<B, 3>::from_inner(h).require_grad();
    let loss = targets_loss(
        decoder.output_norm(last.clone()),
        decoder.lm_head_weight(),
        targets,
        chunk_rows,
    );
    let loss_sum = loss.clone().inner();
    let gradients = loss.mul_scalar(scale).backward();
    on_gradients(&gradients);
    let mut grad_h = last.grad(&gradients).expect("the loss depends on h_L");
    drop(gradients);

    // Back-propagating a given output gradient g through f is the backward pass of sum(f(x) * g).
    let propagate = |output: Tensor<B, 3>, grad_output: Tensor<B::InnerBackend, 3>| {
        (output * Tensor::from_inner(grad_output)).sum().backward()
    };
    // The layers are rebuilt on the rows the forward pass chose, so the recomputation is exact.
    let recorded = match sparsity {
        TokenSparsity::Select { plan, .. } => Some(std::mem::take(plan)),
        _ => None,
    };
    let mut replay = match (&recorded, &*sparsity) {
        (Some(plan), _) => TokenSparsity::Replay(plan),
        (None, TokenSparsity::Replay(plan)) => TokenSparsity::Replay(plan),
        _ => TokenSparsity::Dense,
    };
    let mut rebuild = |index: usize, input: Tensor<B::InnerBackend, 3>| {
        let input = Tensor::<B, 3>::from_inner(input).require_grad();
        let output = layer(
            decoder,
            index,
            input.clone(),
            &shared,
            None,
            &mut replay,
            LayerRun::Rebuild,
        );
        (input, output)
    };
    while let Some(saved) = stored.pop() {
        // What the layers above left idle must not sit beside what this one asks for.
        buffers.between_layers();
        let index = stored.len();
        if let Some(Stored::Host(below)) = stored.last_mut() {
            below.prefetch();
        }
        let (input, output) = match saved {
            Stored::Graph { input, output } => (input, output),
            Stored::Input(input) => rebuild(index, input),
            Stored::Host(copy) => rebuild(index, copy.into_device()),
        };
        if let Some(split) = &split {
            split.before_backward();
        }
        let gradients = propagate(output, grad_h);
        on_gradients(&gradients);
        grad_h = input
            .grad(&gradients)
            .expect("a layer's output depends on its input");
    }
    // Reaches the embedding's parameters when they are trainable, and nothing otherwise.
    on_gradients(&propagate(decoder.embed(tokens, positions), grad_h));
    drop(replay);
    // The caller gets the plan of the forward pass, as from a plain forward pass.
    if let (Some(recorded), TokenSparsity::Select { plan, .. }) = (recorded, sparsity) {
        *plan = recorded;
    }
    (loss_sum, predictions)
}
