//! A decoder-only model as stages: embed the tokens, run the layers one after another, normalize
//! the last hidden state. Every architecture exposes these stages, so the model-independent
//! passes are written once, over [`Decoder`]:
//!
//! - [`hidden_states`]: the plain forward pass (training, evaluation, generation with a cache),
//!   one [`layer`] after another;
//! - [`crate::loss`]: next-token cross-entropy from the final hidden states;
//! - [`crate::planned_backward`]: the loss and its gradients with each layer's activations kept,
//!   recomputed from its input, or recomputed from its input offloaded to host memory.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor};
use lemo_kernels::LemoBackend;
use lemo_kernels::known_value::with_value;
use lemo_kernels::memory::LayerBuffers;
use lemo_kernels::recomputed_rows::{FrozenMlp, with_recomputed_rows};
use lemo_kernels::token_movement::{gather_rows, scatter_add_rows};

use lemo_sparsity::KeptRows;
use lemo_sparsity::calibration::Block;
use lemo_sparsity::informativeness::BlockScoring;

use crate::block_pass::{BlockPass, untracked};
use crate::cache::{KvCache, LayerCache};
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
        Some(untracked(x) + pass.output.clone())
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
    let input = untracked(h.clone());
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
            let input = untracked(a.clone());
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
            let input = untracked(a.clone());
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
pub(crate) fn row_buffers<B: LemoBackend, D: Decoder<B>>(
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
pub(crate) fn layers_output<B: LemoBackend, D: Decoder<B>>(
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
