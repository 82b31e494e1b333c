//! OPT, as in Hugging Face's `modeling_opt.py`:
//!
//! ```text
//! h_0 = project_in(embed(tokens)) + embed_positions(position + 2)
//! pre-norm  (do_layer_norm_before):  a = h + attn(ln1(h));   h' = a + fc2(relu(fc1(ln2(a))))
//! post-norm (OPT-350m):              a = ln1(h + attn(h));   h' = ln2(a + fc2(relu(fc1(a))))
//! logits = project_out(final_ln(h_L)) embed^T   (final_ln only for pre-norm models)
//! ```
//! Every projection has a bias (`enable_bias`); attention is causal multi-head.

use std::ops::Range;

use burn::module::{Module, Param};
use burn::tensor::activation::relu;
use burn::tensor::{Int, Tensor, backend::Backend};
use lemo_kernels::token_movement::gather_rows;
use lemo_kernels::{AttentionOptions, LemoBackend, attention::attention};
use lemo_sparsity::informativeness::{self, BlockScoring};

use crate::Result;
use crate::block_pass::BlockPass;
use crate::cache::{LayerCache, append_to_cache};
use crate::config::OptConfig;
use crate::decoder::{Decoder, RowActivations, SparseBlock};
use crate::embedding::embed;
use crate::lora::Linear;
use crate::norm::LayerNorm;
use crate::row_chunks::by_row_slices;
use crate::sequence_split::SequenceSplit;
use crate::weights::Loader;
use lemo_kernels::recomputed_rows::{FrozenMlp, MlpActivation};

const LAYER_NORM_EPS: f64 = 1e-5;

#[derive(Module, Debug)]
pub struct OptAttention<B: Backend> {
    pub q_proj: Linear<B>,
    pub k_proj: Linear<B>,
    pub v_proj: Linear<B>,
    pub out_proj: Linear<B>,
    pub num_heads: usize,
    pub head_dim: usize,
    /// Shifted sparse attention (S2) group size for training; `None` is dense attention.
    pub shifted_group: Option<usize>,
}

/// What the attention block's pass over every row keeps for the graph of its kept rows: the
/// projections' products ([`Linear::pass`]).
pub struct AttentionProducts<B: Backend> {
    pub q: Tensor<B, 3>,
    pub k: Tensor<B, 3>,
    pub v: Tensor<B, 3>,
    pub out: Tensor<B, 3>,
}

/// What the MLP block's pass over every row keeps for the graph of its kept rows: the
/// projections' products ([`Linear::pass`]).
pub struct MlpProducts<B: Backend> {
    pub fc1: Tensor<B, 3>,
    pub fc2: Tensor<B, 3>,
}

impl<B: LemoBackend> OptAttention<B> {
    /// The block's output for `x`, in the graph. With `sparse`, `x` holds its kept rows and the
    /// products are the kept rows of the pass's (see [`Self::pass`]).
    fn forward(
        &self,
        x: Tensor<B, 3>,
        sparse: Option<&SparseBlock<B, AttentionProducts<B>>>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let product = |select: fn(&AttentionProducts<B>) -> &Tensor<B, 3>| {
            sparse.and_then(|s| s.product_rows(select))
        };
        let q = self.heads(
            self.q_proj
                .forward_with_product(x.clone(), product(|p| &p.q)),
        );
        let k = self.heads(
            self.k_proj
                .forward_with_product(x.clone(), product(|p| &p.k)),
        );
        let v = self.heads(self.v_proj.forward_with_product(x, product(|p| &p.v)));
        let (k, v) = append_to_cache(cache, k, v);
        self.out_proj
            .forward_with_product(self.attend(q, k, v), product(|p| &p.out))
    }

    /// The block on every row of `x` outside the graph, with the token-block informativeness
    /// of its queries and keys when `scoring` is given.
    fn pass(
        &self,
        x: Tensor<B, 3>,
        scoring: Option<BlockScoring>,
    ) -> BlockPass<B, AttentionProducts<B>> {
        let (q, q_product) = self.q_proj.pass(x.clone());
        let (k, k_product) = self.k_proj.pass(x.clone());
        let (v, v_product) = self.v_proj.pass(x);
        let (q, k, v) = (self.heads(q), self.heads(k), self.heads(v));
        let scores =
            scoring.map(|scoring| informativeness::attention(q.clone(), k.clone(), scoring));
        let out = self.attend(q, k, v);
        let (output, out_product) = self.out_proj.pass(out);
        BlockPass {
            output,
            scores,
            products: AttentionProducts {
                q: q_product,
                k: k_product,
                v: v_product,
                out: out_product,
            },
        }
    }

    /// Causal (shifted) attention, `[batch, len, hidden]`.
    fn attend(&self, q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 3> {
        let [batch, heads, len, head_dim] = q.dims();
        let options = AttentionOptions {
            shifted_group: self.shifted_group,
            ..AttentionOptions::causal(self.head_dim)
        };
        attention(q, k, v, options)
            .swap_dims(1, 2)
            .reshape([batch, len, heads * head_dim])
    }

    /// `[batch, len, hidden] -> [batch, heads, len, head_dim]`.
    fn heads(&self, t: Tensor<B, 3>) -> Tensor<B, 4> {
        let [batch, len, _] = t.dims();
        t.reshape([batch, len, self.num_heads, self.head_dim])
            .swap_dims(1, 2)
    }
}

#[derive(Module, Debug)]
pub struct OptLayer<B: Backend> {
    pub self_attn_layer_norm: LayerNorm<B>,
    pub self_attn: OptAttention<B>,
    pub final_layer_norm: LayerNorm<B>,
    pub fc1: Linear<B>,
    pub fc2: Linear<B>,
    pub norm_before: bool,
}

impl<B: LemoBackend> OptLayer<B> {
    /// Pre-norm: `h + attn(ln1(h))`; post-norm: `ln1(h + attn(h))`. Token-sparse with `sparse`
    /// (pre-norm only); the kept rows are gathered before the LayerNorm, which has no fused
    /// gathering kernel.
    fn attention_block(
        &self,
        h: Tensor<B, 3>,
        sparse: Option<SparseBlock<B, AttentionProducts<B>>>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let ln1 = &self.self_attn_layer_norm;
        match (sparse, self.norm_before) {
            (None, true) => h.clone() + self.self_attn.forward(ln1.forward(h), None, cache),
            (None, false) => ln1.forward(h.clone() + self.self_attn.forward(h, None, cache)),
            (Some(sparse), true) => {
                let x = ln1.forward(gather_rows(h.clone(), sparse.rows.clone()));
                let out = self.self_attn.forward(x, Some(&sparse), None);
                sparse.residual(h, out)
            }
            (Some(_), false) => panic!("{POST_NORM_DENSE}"),
        }
    }

    /// Pre-norm: `a + fc2(relu(fc1(ln2(a))))`; post-norm: `ln2(a + fc2(relu(fc1(a))))`.
    fn mlp_block(
        &self,
        a: Tensor<B, 3>,
        sparse: Option<SparseBlock<B, MlpProducts<B>>>,
    ) -> Tensor<B, 3> {
        let ln2 = &self.final_layer_norm;
        match (sparse, self.norm_before) {
            (None, true) => a.clone() + self.dense_mlp(ln2.forward(a)),
            (None, false) => ln2.forward(a.clone() + self.dense_mlp(a)),
            (Some(sparse), true) => {
                // The graph and the dropped rows' recomputation share one dense copy of a
                // quantized base's projections (see `Linear::with_dense_weight`).
                let layer = Self {
                    fc1: self.fc1.with_dense_weight(),
                    fc2: self.fc2.with_dense_weight(),
                    ..self.clone()
                };
                let x = ln2.forward(gather_rows(a.clone(), sparse.rows.clone()));
                let out = layer.mlp(x, Some(&sparse));
                sparse.mlp_residual(a, out, || layer.frozen_mlp())
            }
            (Some(_), false) => panic!("{POST_NORM_DENSE}"),
        }
    }

    /// `fc2(relu(fc1(x)))` on every row, in slices of rows on long sequences.
    fn dense_mlp(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        by_row_slices(x, self.fc1.out_features(), |x| self.mlp(x, None))
    }

    /// `fc2(relu(fc1(x)))` in the graph; with `sparse`, on its kept rows reusing the pass's
    /// products.
    fn mlp(
        &self,
        x: Tensor<B, 3>,
        sparse: Option<&SparseBlock<B, MlpProducts<B>>>,
    ) -> Tensor<B, 3> {
        let product = |select: fn(&MlpProducts<B>) -> &Tensor<B, 3>| {
            sparse.and_then(|s| s.product_rows(select))
        };
        let hidden = relu(self.fc1.forward_with_product(x, product(|p| &p.fc1)));
        self.fc2.forward_with_product(hidden, product(|p| &p.fc2))
    }

    /// The pre-norm MLP, frozen, as its dropped rows' recomputed backward pass reads it.
    fn frozen_mlp(&self) -> FrozenMlp<B> {
        FrozenMlp {
            norm: self.final_layer_norm.frozen(),
            activation: MlpActivation::Relu,
            inputs: vec![self.fc1.frozen()],
            output: self.fc2.frozen(),
        }
    }

    /// The MLP on every row of `x` outside the graph, with the informativeness of its ReLU
    /// output when `scoring` is given.
    fn mlp_pass(
        &self,
        x: Tensor<B, 3>,
        scoring: Option<BlockScoring>,
    ) -> BlockPass<B, MlpProducts<B>> {
        let (fc1, fc1_product) = self.fc1.pass(x);
        let activations = relu(fc1);
        let scores =
            scoring.map(|scoring| informativeness::mlp(activations.clone(), scoring.block_size));
        let (output, fc2_product) = self.fc2.pass(activations);
        BlockPass {
            output,
            scores,
            products: MlpProducts {
                fc1: fc1_product,
                fc2: fc2_product,
            },
        }
    }

    /// What the attention block's projections read in a pass over every row, outside the graph:
    /// the normalized input (pre-norm) or the input itself (post-norm).
    fn attention_input(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        if self.norm_before {
            self.self_attn_layer_norm.value(h)
        } else {
            h
        }
    }

    /// [`Self::attention_input`] of the MLP block.
    fn mlp_input(&self, a: Tensor<B, 3>) -> Tensor<B, 3> {
        if self.norm_before {
            self.final_layer_norm.value(a)
        } else {
            a
        }
    }
}

/// Why post-norm OPT layers (OPT-350m) run dense: their output is the norm of the whole residual
/// sum, so a row that skips the block would still change.
pub const POST_NORM_DENSE: &str = "post-norm OPT layers (do_layer_norm_before = false, OPT-350m) cannot eliminate tokens: the LayerNorm after the residual add touches every row";

#[derive(Module, Debug)]
pub struct Opt<B: Backend> {
    /// `[vocab, word_embed_proj_dim]`, also the output projection (OPT ties them).
    pub embed_tokens: Param<Tensor<B, 2>>,
    /// `[max_position_embeddings + 2, hidden]`
    pub embed_positions: Param<Tensor<B, 2>>,
    pub project_in: Option<Linear<B>>,
    pub layers: Vec<OptLayer<B>>,
    pub final_layer_norm: Option<LayerNorm<B>>,
    pub project_out: Option<Linear<B>>,
}

impl<B: LemoBackend> Opt<B> {
    /// Builds the model from Hugging Face tensor names (`model.decoder.layers.{i}.fc1.weight`, ...).
    pub fn load(config: &OptConfig, loader: &mut Loader<B>) -> Result<Self> {
        let hidden = config.hidden_size;
        let word_dim = config.word_embed_proj_dim();
        let bias = config.enable_bias;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("model.decoder.layers.{i}");
            let self_attn = OptAttention {
                q_proj: loader.linear(&format!("{p}.self_attn.q_proj"), hidden, hidden, bias)?,
                k_proj: loader.linear(&format!("{p}.self_attn.k_proj"), hidden, hidden, bias)?,
                v_proj: loader.linear(&format!("{p}.self_attn.v_proj"), hidden, hidden, bias)?,
                out_proj: loader.linear(
                    &format!("{p}.self_attn.out_proj"),
                    hidden,
                    hidden,
                    bias,
                )?,
                num_heads: config.num_attention_heads,
                head_dim: hidden / config.num_attention_heads,
                shifted_group: None,
            };
            let fc1 = loader.linear(&format!("{p}.fc1"), config.ffn_dim, hidden, bias)?;
            let fc2 = loader.linear(&format!("{p}.fc2"), hidden, config.ffn_dim, bias)?;
            layers.push(OptLayer {
                self_attn_layer_norm: layer_norm(
                    loader,
                    config,
                    &format!("{p}.self_attn_layer_norm"),
                )?,
                self_attn,
                final_layer_norm: layer_norm(loader, config, &format!("{p}.final_layer_norm"))?,
                fc1,
                fc2,
                norm_before: config.do_layer_norm_before,
            });
        }
        let projections = word_dim != hidden;
        let project_in = if projections {
            Some(Linear::new(
                loader.required("model.decoder.project_in.weight", [hidden, word_dim])?,
                None,
            ))
        } else {
            None
        };
        let project_out = if projections {
            Some(Linear::new(
                loader.required("model.decoder.project_out.weight", [word_dim, hidden])?,
                None,
            ))
        } else {
            None
        };
        let final_layer_norm = if config.do_layer_norm_before && !config.remove_final_layer_norm {
            Some(layer_norm(
                loader,
                config,
                "model.decoder.final_layer_norm",
            )?)
        } else {
            None
        };
        let frozen = |t| Param::from_tensor(t).set_require_grad(false);
        Ok(Self {
            embed_tokens: frozen(loader.required(
                "model.decoder.embed_tokens.weight",
                [config.vocab_size, word_dim],
            )?),
            embed_positions: frozen(loader.required(
                "model.decoder.embed_positions.weight",
                [
                    config.max_position_embeddings + OptConfig::POSITION_OFFSET,
                    hidden,
                ],
            )?),
            project_in,
            layers,
            final_layer_norm,
            project_out,
        })
    }
}

impl<B: LemoBackend> Decoder<B> for Opt<B> {
    type Shared = ();
    type AttentionProducts = AttentionProducts<B>;
    type MlpProducts = MlpProducts<B>;

    fn shifted_group(&self, index: usize) -> Option<usize> {
        self.layers[index].self_attn.shifted_group
    }

    fn embed(&self, tokens: Tensor<B, 2, Int>, positions: Range<usize>) -> Tensor<B, 3> {
        let [batch, len] = tokens.dims();
        let device = tokens.device();
        let mut h = embed(&self.embed_tokens.val(), tokens);
        if let Some(project_in) = &self.project_in {
            h = project_in.forward(h);
        }
        let offset = OptConfig::POSITION_OFFSET;
        let position_rows = Tensor::<B, 1, Int>::arange(
            (positions.start + offset) as i64..(positions.end + offset) as i64,
            &device,
        );
        let [_, hidden] = self.embed_positions.dims();
        h + self
            .embed_positions
            .val()
            .select(0, position_rows)
            .reshape([1, len, hidden])
            .expand([batch, len, hidden])
    }

    fn shared(&self, _positions: Range<usize>, _batch: usize, split: Option<&SequenceSplit>) {
        assert!(
            split.is_none(),
            "OPT's learned positions do not split: refused when a run is set up"
        );
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn row_activations(&self) -> RowActivations {
        let layer = self.layers.first();
        RowActivations {
            dtype: self.embed_tokens.val().dtype(),
            stream: layer.map_or(Vec::new(), |layer| vec![layer.fc1.in_features()]),
            mlp: layer.map(|layer| layer.fc1.out_features()),
        }
    }

    fn attention_block(
        &self,
        index: usize,
        h: Tensor<B, 3>,
        _shared: &(),
        sparse: Option<SparseBlock<B, AttentionProducts<B>>>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        self.layers[index].attention_block(h, sparse, cache)
    }

    fn mlp_block(
        &self,
        index: usize,
        a: Tensor<B, 3>,
        sparse: Option<SparseBlock<B, MlpProducts<B>>>,
    ) -> Tensor<B, 3> {
        self.layers[index].mlp_block(a, sparse)
    }

    fn attention_pass(
        &self,
        index: usize,
        h: Tensor<B, 3>,
        _shared: &(),
        scoring: Option<BlockScoring>,
    ) -> BlockPass<B, AttentionProducts<B>> {
        let layer = &self.layers[index];
        layer.self_attn.pass(layer.attention_input(h), scoring)
    }

    /// Scores from OPT's ReLU output.
    fn mlp_pass(
        &self,
        index: usize,
        a: Tensor<B, 3>,
        scoring: Option<BlockScoring>,
    ) -> BlockPass<B, MlpProducts<B>> {
        let layer = &self.layers[index];
        layer.mlp_pass(layer.mlp_input(a), scoring)
    }

    fn frozen_mlp(&self, index: usize) -> Option<FrozenMlp<B>> {
        let layer = &self.layers[index];
        let adapted = layer.fc1.lora.is_some() || layer.fc2.lora.is_some();
        let norm = &layer.final_layer_norm;
        let trains = [&norm.weight, &norm.bias]
            .into_iter()
            .flatten()
            .any(|param| param.val().is_require_grad());
        (layer.norm_before && !adapted && !trains).then(|| layer.frozen_mlp())
    }

    /// The final layer norm (pre-norm models) and the projection to `word_embed_proj_dim`.
    fn output_norm(&self, mut h: Tensor<B, 3>) -> Tensor<B, 3> {
        if let Some(norm) = &self.final_layer_norm {
            h = norm.forward(h);
        }
        match &self.project_out {
            Some(project_out) => project_out.forward(h),
            None => h,
        }
    }

    /// The token embedding: OPT ties it to the output projection.
    fn lm_head_weight(&self) -> Tensor<B, 2> {
        self.embed_tokens.val()
    }
}

fn layer_norm<B: Backend>(
    loader: &mut Loader<B>,
    config: &OptConfig,
    name: &str,
) -> Result<LayerNorm<B>> {
    let hidden = config.hidden_size;
    if !config.layer_norm_elementwise_affine {
        return Ok(LayerNorm::new(None, None, LAYER_NORM_EPS));
    }
    Ok(LayerNorm::new(
        Some(loader.required(&format!("{name}.weight"), [hidden])?),
        Some(loader.required(&format!("{name}.bias"), [hidden])?),
        LAYER_NORM_EPS,
    ))
}
