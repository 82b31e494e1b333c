//! A decoder-only model as stages: embed the tokens, run the layers one after another, normalize
//! the last hidden state. Every architecture exposes these stages, so the model-independent
//! passes live here once:
//!
//! - [`hidden_states`]: the plain forward pass (training, evaluation, generation with a cache);
//! - [`next_token_loss`]: next-token cross-entropy from the final hidden states;
//! - [`planned_loss_backward`]: the loss and its gradients with each layer's activations kept,
//!   recomputed from its input, or recomputed from its input offloaded to host memory.

use std::ops::Range;

use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, ElementConversion, Int, Tensor};
use lemo_kernels::LemoBackend;
use lemo_kernels::known_value::with_value;
use lemo_kernels::loss::{IGNORE_INDEX, segment_cross_entropy};
use lemo_kernels::memory::LayerBuffers;
use lemo_kernels::recomputed_rows::{FrozenMlp, with_recomputed_rows};
use lemo_kernels::token_movement::{gather_rows, scatter_add_rows};

use lemo_sparsity::KeptRows;
use lemo_sparsity::calibration::Block;
use lemo_sparsity::informativeness::BlockScoring;

use crate::activation_plan::{ActivationPlan, LayerActivations};
use crate::block_pass::BlockPass;
use crate::cache::{KvCache, LayerCache};
use crate::offload::HostCopy;
use crate::row_chunks::slice_len;
use crate::sequence_split::SequenceSplit;
use crate::token_plan::{BlockRows, TokenSparsity};

pub trait Decoder<B: Backend> {
    /// What every layer of one pass shares (Llama: the rotary tables of the pass's positions).
    type Shared;
    /// What an attention block's pass over every row keeps for the graph of its kept rows.
    type AttentionProducts;
    /// What an MLP block's pass over every row keeps for the graph of its kept rows.
    type MlpProducts;

    /// `h_0: [batch, len, hidden]` of `tokens: [batch, len]` at `positions`.
    fn embed(&self, tokens: Tensor<B, 2, Int>, positions: Range<usize>) -> Tensor<B, 3>;

    /// What the layers of a pass over `positions` share; with `split`, the pass runs this rank's
    /// positions of a sequence split over a sequence group ([`SequenceSplit`], checked to be
    /// supported with [`Decoder::splits_sequences`]), and `positions` are the whole sequence's.
    fn shared(
        &self,
        positions: Range<usize>,
        batch: usize,
        split: Option<&SequenceSplit>,
    ) -> Self::Shared;

    /// The S2 group size of layer `index`'s attention (LongLoRA's shifted sparse attention);
    /// `None`: causal.
    fn shifted_group(&self, index: usize) -> Option<usize>;

    /// The sequence split a pass with `shared` runs under, if any.
    fn sequence_split<'s>(&self, _shared: &'s Self::Shared) -> Option<&'s SequenceSplit> {
        None
    }

    /// Whether a sequence of this model can be split over ranks (context parallelism): its
    /// positions enter attention alone (rotary embeddings), and it has no sliding window or S2
    /// groups, whose masks a split's chunks would not follow.
    fn splits_sequences(&self) -> bool {
        false
    }

    fn num_layers(&self) -> usize;

    /// The per-token activations every layer allocates and frees over and over: they get
    /// exact-size buffers (see [`row_buffers`]), as does the embedding's output.
    fn row_activations(&self) -> RowActivations;

    /// The attention block of layer `index`, `h + attention(norm(h))`. With `sparse`, the pass
    /// already computed the block for every row: that is the value, and the graph (its saved
    /// activations and its backward pass) covers only the kept rows, which attend to one
    /// another at their original positions (with S2 groups too, see
    /// [`crate::kept_s2`]). With a cache, the keys and values are appended to
    /// it (dense only).
    fn attention_block(
        &self,
        index: usize,
        h: Tensor<B, 3>,
        shared: &Self::Shared,
        sparse: Option<SparseBlock<B, Self::AttentionProducts>>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3>;

    /// The MLP block of layer `index`, `a + mlp(norm(a))`, token-sparse as above.
    fn mlp_block(
        &self,
        index: usize,
        a: Tensor<B, 3>,
        sparse: Option<SparseBlock<B, Self::MlpProducts>>,
    ) -> Tensor<B, 3>;

    /// The attention block of layer `index` on every row of `h` outside the graph, with its
    /// token-block informativeness (from its queries and keys) when `scoring` is given.
    fn attention_pass(
        &self,
        index: usize,
        h: Tensor<B, 3>,
        shared: &Self::Shared,
        scoring: Option<BlockScoring>,
    ) -> BlockPass<B, Self::AttentionProducts>;

    /// The MLP block of layer `index` on every row of `a` outside the graph, with its
    /// token-block informativeness (from its intermediate activations) when `scoring` is
    /// given.
    fn mlp_pass(
        &self,
        index: usize,
        a: Tensor<B, 3>,
        scoring: Option<BlockScoring>,
    ) -> BlockPass<B, Self::MlpProducts>;

    /// The MLP block of layer `index` as constants, when nothing in it trains (no adapters on
    /// its projections, a frozen norm) and it is pre-norm: its backward pass can then be
    /// recomputed from its input rows alone (see [`LayerRun::Rebuild`]).
    fn frozen_mlp(&self, index: usize) -> Option<FrozenMlp<B>>;

    /// What output projection reads, from `h_L`.
    fn output_norm(&self, h: Tensor<B, 3>) -> Tensor<B, 3>;

    /// `[vocab, dim]`: the output projection, in the hidden states' dtype.
    fn lm_head_weight(&self) -> Tensor<B, 2>;
}

/// A layer's per-token activations (see [`Decoder::row_activations`]).
pub struct RowActivations {
    /// Their dtype (the embedding's output has it too).
    pub dtype: DType,
    /// Those of the residual stream and of the attention block (queries, keys and values).
    pub stream: Vec<usize>,
    /// The MLP's intermediate; `None` without layers.
    pub mlp: Option<usize>,
}

/// A token-sparse block: its kept rows `[batch, kept]`, its pass over every row, and the rows it
/// drops `[batch, seq - kept]` where its backward pass reaches them.
pub struct SparseBlock<B: Backend, P> {
    pub rows: Tensor<B, 2, Int>,
    /// Under a sequence split, the kept rows of the whole sequence (`rows` are the rank's).
    pub whole: Option<KeptRows>,
    /// `None` where nothing reads the block's value ([`LayerRun::Rebuild`] of an MLP block):
    /// its kept rows then compute their products themselves.
    pub pass: Option<BlockPass<B, P>>,
    /// The dropped rows, when the block's backward pass recomputes them (MLP blocks with
    /// [`crate::token_plan::DroppedRows::Exact`]) and there are any.
    pub dropped: Option<Tensor<B, 2, Int>>,
    kept: BlockRows,
}

impl<B: Backend, P> SparseBlock<B, P> {
    /// A block of `kept` rows (and the dropped rows its backward pass reaches, if any) with its
    /// pass over every row, when it has one.
    pub fn new(kept: &BlockRows, pass: Option<BlockPass<B, P>>) -> Self {
        Self {
            rows: kept.rows(),
            whole: kept.whole.clone(),
            dropped: kept.dropped(),
            kept: kept.clone(),
            pass,
        }
    }

    /// The block's kept rows (S2 groups follow their positions).
    pub fn kept_rows(&self) -> &BlockRows {
        &self.kept
    }

    /// The block's pass over every row, which an attention block always has.
    pub fn every_row(&self) -> &BlockPass<B, P> {
        self.pass
            .as_ref()
            .expect("only a rebuilt MLP block runs without its pass")
    }
}

impl<B: LemoBackend, P> SparseBlock<B, P> {
    /// `x + pass.output` (exact, every row), with the backward pass of `x` plus `graph`, the
    /// block's output on the kept rows, added into those rows: the gradient reaches the block
    /// through its kept rows only.
    /// Without a pass, the value is the graph's alone, which differs from the block's on the
    /// dropped rows: nothing reads it ([`LayerRun::Rebuild`]).
    pub fn residual(&self, x: Tensor<B, 3>, graph: Tensor<B, 3>) -> Tensor<B, 3> {
        let value = self.value(x.clone());
        let graph = scatter_add_rows(x, self.rows.clone(), graph);
        match value {
            Some(value) => with_value(graph, value),
            None => graph,
        }
    }

    /// `x + pass.output`: the block's exact value on every row, outside any graph; `None`
    /// without a pass.
    pub fn value(&self, x: Tensor<B, 3>) -> Option<Tensor<B, 3>> {
        let pass = self.pass.as_ref()?;
        Some(x.detach() + pass.output.clone())
    }

    /// [`Self::residual`] of an MLP block, whose backward pass also reaches the dropped rows
    /// through `mlp`'s exact input gradient, recomputed there, when the block keeps them.
    pub fn mlp_residual(
        &self,
        x: Tensor<B, 3>,
        graph: Tensor<B, 3>,
        mlp: impl FnOnce() -> FrozenMlp<B>,
    ) -> Tensor<B, 3> {
        let x = match &self.dropped {
            Some(dropped) => with_recomputed_rows(x, dropped.clone(), mlp()),
            None => x,
        };
        self.residual(x, graph)
    }

    /// The kept rows of the pass's product that `select` names, `[batch, kept, width]`; `None`
    /// without a pass.
    pub fn product_rows(&self, select: fn(&P) -> &Tensor<B, 3>) -> Option<Tensor<B, 3>> {
        let pass = self.pass.as_ref()?;
        Some(gather_rows(
            select(&pass.products).clone(),
            self.rows.clone(),
        ))
    }
}

/// What a layer runs for, which decides what its blocks compute and hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerRun {
    /// Its graph, for a backward pass through the whole step, or its output where nothing is
    /// differentiated (evaluation, generation, profiling): every block as it is.
    Graph,
    /// Its output alone, outside any graph: the forward pass of a layer whose backward pass
    /// rebuilds it. A token-sparse block's value is its pass over every row (the MLP's runs a
    /// slice of rows at a time, [`mlp_pass_by_slices`]); its kept rows are not computed again.
    Value,
    /// Its graph again, for its backward pass: nothing reads the output's value, only its
    /// gradient's way back to the input. So the MLP block computes no value:
    /// - frozen ([`Decoder::frozen_mlp`]), it saves only its input, and the backward pass
    ///   recomputes the input projections from it ([`lemo_kernels::recomputed_rows`], two
    ///   GEMMs of `rows x hidden x ffn`) on every row its gradient reaches (token-sparse with
    ///   exact dropped rows: every row);
    /// - adapted and token-sparse, its kept rows compute their own products, without the pass
    ///   over every row (no full-width products, and the dropped rows' share of the work less);
    /// - adapted and dense, it is its graph.
    Rebuild,
}

/// `h_{index+1}` from `h_index`: the attention block then the MLP block, each on the rows
/// `sparsity` gives it, computing what `run` needs.
pub fn layer<B: LemoBackend, D: Decoder<B>>(
    decoder: &D,
    index: usize,
    h: Tensor<B, 3>,
    shared: &D::Shared,
    cache: Option<&mut LayerCache<B>>,
    sparsity: &mut TokenSparsity,
    run: LayerRun,
) -> Tensor<B, 3> {
    let split = decoder.sequence_split(shared);
    let input = h.clone().detach();
    let sparse = sparsity
        .block(
            index,
            Block::Attention,
            (&input, split),
            decoder.shifted_group(index),
            |scoring| decoder.attention_pass(index, input.clone(), shared, scoring),
        )
        .map(|(kept, pass)| SparseBlock::new(&kept, Some(pass)));
    drop(input);
    let a = match sparse {
        // Outside any graph the block's value is its pass's output: the graph of its kept rows
        // would only gather and scatter copies of what the pass computed.
        Some(sparse) if run == LayerRun::Value => {
            sparse.value(h).expect("an attention block has its pass")
        }
        sparse => decoder.attention_block(index, h, shared, sparse, cache),
    };
    match run {
        LayerRun::Graph => {
            let input = a.clone().detach();
            let sparse = sparsity
                .block(index, Block::Mlp, (&input, split), None, |scoring| {
                    decoder.mlp_pass(index, input.clone(), scoring)
                })
                .map(|(kept, pass)| SparseBlock::new(&kept, Some(pass)));
            drop(input);
            decoder.mlp_block(index, a, sparse)
        }
        LayerRun::Value => {
            let [batch, seq, _] = a.dims();
            let width = decoder.row_activations().mlp.unwrap_or(0);
            let slice_rows = slice_len::<B>(&a.device(), a.dtype(), [batch, seq], width);
            let input = a.clone().detach();
            let pass = sparsity.block(index, Block::Mlp, (&input, split), None, |scoring| {
                mlp_pass_by_slices(decoder, index, input.clone(), scoring, slice_rows)
            });
            drop(input);
            match pass {
                Some((_, pass)) => a + pass.output,
                None => decoder.mlp_block(index, a, None),
            }
        }
        LayerRun::Rebuild => {
            let kept = sparsity.replayed::<B>(index, Block::Mlp, split, &a.device());
            match (decoder.frozen_mlp(index), kept) {
                (Some(frozen), kept) => {
                    let rows = match kept {
                        // Without exact dropped rows the gradient reaches the kept rows alone.
                        Some(kept) if kept.dropped::<B>().is_none() => kept.rows(),
                        _ => {
                            let [batch, seq, _] = a.dims();
                            Tensor::<B, 1, Int>::arange(0..seq as i64, &a.device())
                                .unsqueeze::<2>()
                                .repeat_dim(0, batch)
                        }
                    };
                    with_recomputed_rows(a, rows, frozen)
                }
                (None, kept) => {
                    let sparse = kept.map(|kept| SparseBlock::new(&kept, None));
                    decoder.mlp_block(index, a, sparse)
                }
            }
        }
    }
}

/// [`Decoder::mlp_pass`] of layer `index` on `a: [batch, seq, hidden]`, without the products
/// the graph of its kept rows would reuse, over slices of about `slice_rows` rows (whole token
/// blocks when scored), so that the MLP's full-width intermediates (`rows x ffn`) never exist
/// for every row at once: the output and the scores are those of the whole pass.
pub fn mlp_pass_by_slices<B: LemoBackend, D: Decoder<B>>(
    decoder: &D,
    index: usize,
    a: Tensor<B, 3>,
    scoring: Option<BlockScoring>,
    slice_rows: usize,
) -> BlockPass<B, ()> {
    let seq = a.dims()[1];
    let block = scoring.map_or(1, |scoring| scoring.block_size);
    let rows = (slice_rows / block).max(1) * block;
    let slices = if rows >= seq {
        vec![a]
    } else {
        a.split(rows, 1)
    };
    let (outputs, scores): (Vec<_>, Vec<_>) = slices
        .into_iter()
        .map(|slice| {
            let pass = decoder.mlp_pass(index, slice, scoring);
            (pass.output, pass.scores)
        })
        .unzip();
    BlockPass {
        output: Tensor::cat(outputs, 1),
        scores: scores
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .map(|scores| Tensor::cat(scores, 1)),
        products: (),
    }
}

/// Exact-size buffers for the per-token activations of a pass over `tokens` (see
/// [`lemo_kernels::memory::exact_size_buffers`]), the MLP's intermediate both whole (the
/// token-sparse passes) and in the row slices of a dense block (see [`slice_len`]). Made before
/// the embedding, so that its output, the first layer's input that lives all step, gets one too
/// rather than a slice of one of the pool's largest pages.
fn row_buffers<B: LemoBackend, D: Decoder<B>>(
    decoder: &D,
    tokens: &Tensor<B, 2, Int>,
) -> LayerBuffers<B> {
    let [batch, len] = tokens.dims();
    let device = tokens.device();
    let RowActivations { dtype, stream, mlp } = decoder.row_activations();
    let sliced = mlp.map(|width| {
        [
            batch,
            slice_len::<B>(&device, dtype, [batch, len], width),
            width,
        ]
    });
    let shapes: Vec<[usize; 3]> = stream
        .into_iter()
        .chain(mlp)
        .map(|width| [batch, len, width])
        .chain(sliced)
        .collect();
    LayerBuffers::new(&device, dtype, shapes)
}

/// Final normalized hidden states of `tokens` at `positions`; with a cache, the tokens continue
/// the cached sequence (the caller advances `cache.len`).
pub fn hidden_states<B: LemoBackend, D: Decoder<B>>(
    decoder: &D,
    tokens: Tensor<B, 2, Int>,
    positions: Range<usize>,
    cache: Option<&mut KvCache<B>>,
    sparsity: &mut TokenSparsity,
) -> Tensor<B, 3> {
    let [batch, _] = tokens.dims();
    let shared = decoder.shared(positions.clone(), batch, None);
    layers_output(decoder, tokens, positions, &shared, cache, sparsity)
}

/// The final normalized hidden states of `tokens`, embedded at `positions`, through every layer
/// with `shared`.
fn layers_output<B: LemoBackend, D: Decoder<B>>(
    decoder: &D,
    tokens: Tensor<B, 2, Int>,
    positions: Range<usize>,
    shared: &D::Shared,
    mut cache: Option<&mut KvCache<B>>,
    sparsity: &mut TokenSparsity,
) -> Tensor<B, 3> {
    row_buffers(decoder, &tokens);
    let mut h = decoder.embed(tokens, positions);
    for index in 0..decoder.num_layers() {
        let layer_cache = cache.as_deref_mut().map(|c| &mut c.layers[index]);
        h = layer(
            decoder,
            index,
            h,
            shared,
            layer_cache,
            sparsity,
            LayerRun::Graph,
        );
    }
    decoder.output_norm(h)
}

/// What a pass over a batch runs on: this rank's tokens (every token without a split), the
/// target each of its positions is scored against in the whole sequence (the next token may be
/// another rank's), how many of them are scored, and the state every layer shares.
struct PassInputs<B: Backend, S> {
    tokens: Tensor<B, 2, Int>,
    targets: Tensor<B, 2, Int>,
    predictions: usize,
    split: Option<SequenceSplit>,
    /// Tokens of each whole sequence.
    len: usize,
    shared: S,
}

impl<B: Backend, S> PassInputs<B, S> {
    fn of<D: Decoder<B, Shared = S>>(decoder: &D, batch: Batch<B>) -> Self {
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
/// sequences ([`planned_loss_backward`]); `tokens` and `labels` are still the whole sequences.
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
fn targets_loss<B: LemoBackend>(
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
    /// The pass's exact-size buffers (see [`row_buffers`]).
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

/// [`next_token_loss`] of `tokens` (positions from 0) and the gradients of `scale` times it
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
