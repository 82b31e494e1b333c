//! Llama-2/3, TinyLlama and Mistral, as in Hugging Face's `modeling_llama.py`/`modeling_mistral.py`:
//!
//! ```text
//! h_0 = embed(tokens)
//! a_l = h_l + o_proj(attention(rope(q_proj(rms(h_l))), rope(k_proj(rms(h_l))), v_proj(rms(h_l))))
//! h_{l+1} = a_l + down_proj(silu(gate_proj(rms(a_l))) * up_proj(rms(a_l)))
//! logits = lm_head(rms(h_L))            (lm_head = embed when tied)
//! ```
//! Attention is causal, grouped-query (each K/V head serves `heads / kv_heads` query heads), and
//! for Mistral limited to a sliding window.

use std::ops::Range;

use burn::module::{Module, Param};
use burn::tensor::{DType, Int, Tensor, TensorData, backend::Backend};
use lemo_kernels::attention::{attention, attention_with_lse, attention_with_value};
use lemo_kernels::fused::swiglu;
use lemo_kernels::recomputed_rows::{FrozenMlp, MlpActivation};
use lemo_kernels::{AttentionOptions, LemoBackend};
use lemo_sparsity::informativeness::{self, BlockScoring};

use crate::Result;
use crate::block_pass::BlockPass;
use crate::cache::{LayerCache, append_to_cache};
use crate::config::LlamaConfig;
use crate::decoder::{Decoder, RowActivations, SparseBlock};
use crate::embedding::embed;
use crate::kept_s2::kept_rows_s2_attention;
use crate::lora::Linear;
use crate::norm::RmsNorm;
use crate::rope::{RotaryEmbedding, Rotation};
use crate::row_chunks::by_row_slices;
use crate::sequence_split::SequenceSplit;
use crate::weights::Loader;

#[derive(Module, Debug)]
pub struct LlamaAttention<B: Backend> {
    pub q_proj: Linear<B>,
    pub k_proj: Linear<B>,
    pub v_proj: Linear<B>,
    pub o_proj: Linear<B>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub sliding_window: Option<usize>,
    /// LongLoRA's shifted sparse attention (S2) with this group size, for training; `None` is
    /// dense attention.
    pub shifted_group: Option<usize>,
}

/// What the attention block's pass over every row keeps for the graph of its kept rows: the
/// projections' products ([`Linear::pass`]), the attention output
/// `[batch, len, heads * head_dim]` and its `logsumexp` `[batch, heads, len]`.
pub struct AttentionProducts<B: Backend> {
    pub q: Tensor<B, 3>,
    pub k: Tensor<B, 3>,
    pub v: Tensor<B, 3>,
    pub o: Tensor<B, 3>,
    pub out: Tensor<B, 3>,
    pub lse: Tensor<B, 3>,
}

impl<B: LemoBackend> LlamaAttention<B> {
    /// The block's output for `x`, in the graph. With `sparse`, `x` holds its kept rows and the
    /// products and the attention output are the kept rows of the pass's (see [`Self::pass`]):
    /// nothing of the forward pass is computed again, and attention back-propagates with the
    /// pass's `logsumexp`, i.e. as attention over every key restricted to the kept ones; with S2
    /// groups, S2 attention at the kept rows' original positions restricted the same way
    /// ([`kept_rows_s2_attention`]), so the forward pass is LongLoRA's.
    /// With a `split` (dense only), `x` holds this rank's rows of a sequence split over a
    /// sequence group, and attention reads every position's keys and values.
    fn forward(
        &self,
        x: Tensor<B, 3>,
        rotation: &Rotation<B>,
        sparse: Option<&SparseBlock<B, AttentionProducts<B>>>,
        cache: Option<&mut LayerCache<B>>,
        split: Option<&SequenceSplit>,
    ) -> Tensor<B, 3> {
        let product = |select: fn(&AttentionProducts<B>) -> &Tensor<B, 3>| {
            sparse.and_then(|s| s.product_rows(select))
        };
        let [batch, len, _] = x.dims();
        let q = self
            .q_proj
            .forward_with_product(x.clone(), product(|p| &p.q));
        let k = self
            .k_proj
            .forward_with_product(x.clone(), product(|p| &p.k));
        let v = self.v_proj.forward_with_product(x, product(|p| &p.v));
        let q = rotation.apply(self.heads(q, self.num_heads));
        let k = rotation.apply(self.heads(k, self.num_kv_heads));
        let v = self.heads(v, self.num_kv_heads);
        let (k, v) = append_to_cache(cache, k, v);
        let (out, o_product) = match (sparse, self.shifted_group) {
            (None, _) => match split {
                Some(split) => (split.attention(q, k, v, self.options()), None),
                None => (attention(q, k, v, self.options()), None),
            },
            (Some(sparse), group) => {
                let out = product(|p| &p.out).expect("an attention block has its pass");
                let out = self.heads(out, self.num_heads);
                let lse = sparse.every_row().products.lse.clone().gather(
                    2,
                    sparse
                        .rows
                        .clone()
                        .unsqueeze_dim::<3>(1)
                        .expand([batch, self.num_heads, len]),
                );
                let out = match (split, &sparse.whole, group) {
                    (Some(split), Some(whole), _) => {
                        split.kept_attention((q, k, v), (out, lse), whole, self.options())
                    }
                    (_, _, Some(_)) => kept_rows_s2_attention(
                        (q, k, v),
                        (out, lse),
                        sparse.kept_rows(),
                        self.options(),
                    ),
                    _ => attention_with_value(q, k, v, (out, lse), self.options()),
                };
                (out, product(|p| &p.o))
            }
        };
        self.o_proj
            .forward_with_product(self.merge_heads(out), o_product)
    }

    /// The block on every row of `x` outside the graph, with the token-block informativeness
    /// of its rotated queries and keys when `scoring` is given.
    fn pass(
        &self,
        x: Tensor<B, 3>,
        rotation: &Rotation<B>,
        scoring: Option<BlockScoring>,
        split: Option<&SequenceSplit>,
    ) -> BlockPass<B, AttentionProducts<B>> {
        let projections = [&self.q_proj, &self.k_proj, &self.v_proj];
        let [(q, q_product), (k, k_product), (v, v_product)] =
            projections.map(|p| p.pass(x.clone()));
        let q = rotation.apply(self.heads(q, self.num_heads));
        let k = rotation.apply(self.heads(k, self.num_kv_heads));
        let v = self.heads(v, self.num_kv_heads);
        let ((out, lse), scores) = match split {
            Some(split) => {
                let (k, v) = split.gather_key_values(k, v);
                let scores = scoring
                    .map(|scoring| split.attention_column_sums(q.clone(), k.clone(), scoring));
                (split.attention_with_lse(q, k, v, self.options()), scores)
            }
            None => {
                let scores = scoring
                    .map(|scoring| informativeness::attention(q.clone(), k.clone(), scoring));
                (attention_with_lse(q, k, v, self.options()), scores)
            }
        };
        let out = self.merge_heads(out);
        let (output, o_product) = self.o_proj.pass(out.clone());
        BlockPass {
            output,
            scores,
            products: AttentionProducts {
                q: q_product,
                k: k_product,
                v: v_product,
                o: o_product,
                out,
                lse,
            },
        }
    }

    /// Causal attention, windowed and shifted as configured.
    fn options(&self) -> AttentionOptions {
        AttentionOptions {
            sliding_window: self.sliding_window,
            shifted_group: self.shifted_group,
            ..AttentionOptions::causal(self.head_dim)
        }
    }

    /// `[batch, heads, len, head_dim] -> [batch, len, heads * head_dim]`.
    fn merge_heads(&self, out: Tensor<B, 4>) -> Tensor<B, 3> {
        let [batch, heads, len, head_dim] = out.dims();
        out.swap_dims(1, 2).reshape([batch, len, heads * head_dim])
    }

    /// `[batch, len, n * head_dim] -> [batch, n, len, head_dim]`.
    fn heads(&self, t: Tensor<B, 3>, n: usize) -> Tensor<B, 4> {
        let [batch, len, _] = t.dims();
        t.reshape([batch, len, n, self.head_dim]).swap_dims(1, 2)
    }
}

#[derive(Module, Debug)]
pub struct LlamaMlp<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
}

/// What the MLP block's pass over every row keeps for the graph of its kept rows: the
/// projections' products ([`Linear::pass`]).
pub struct MlpProducts<B: Backend> {
    pub gate: Tensor<B, 3>,
    pub up: Tensor<B, 3>,
    pub down: Tensor<B, 3>,
}

impl<B: LemoBackend> LlamaMlp<B> {
    /// `down(silu(gate(x)) * up(x))` in the graph; with `sparse`, on its kept rows reusing the
    /// pass's products.
    fn forward(
        &self,
        x: Tensor<B, 3>,
        sparse: Option<&SparseBlock<B, MlpProducts<B>>>,
    ) -> Tensor<B, 3> {
        let product = |select: fn(&MlpProducts<B>) -> &Tensor<B, 3>| {
            sparse.and_then(|s| s.product_rows(select))
        };
        let gate = self
            .gate_proj
            .forward_with_product(x.clone(), product(|p| &p.gate));
        let up = self.up_proj.forward_with_product(x, product(|p| &p.up));
        self.down_proj
            .forward_with_product(swiglu(gate, up), product(|p| &p.down))
    }

    /// The graph of a token-sparse block and its dropped rows' recomputation share one dense
    /// copy of a quantized base's projections (see [`Linear::with_dense_weight`]).
    fn with_dense_weights(&self) -> Self {
        Self {
            gate_proj: self.gate_proj.with_dense_weight(),
            up_proj: self.up_proj.with_dense_weight(),
            down_proj: self.down_proj.with_dense_weight(),
        }
    }

    /// This MLP after `norm`, frozen, as its dropped rows' recomputed backward pass reads it.
    fn frozen(&self, norm: &RmsNorm<B>) -> FrozenMlp<B> {
        FrozenMlp {
            norm: norm.frozen(),
            activation: MlpActivation::SwiGlu,
            inputs: vec![self.gate_proj.frozen(), self.up_proj.frozen()],
            output: self.down_proj.frozen(),
        }
    }

    /// The block on every row of `x` outside the graph, with the token-block informativeness
    /// of `silu(gate) * up` when `scoring` is given.
    fn pass(&self, x: Tensor<B, 3>, scoring: Option<BlockScoring>) -> BlockPass<B, MlpProducts<B>> {
        let (gate, gate_product) = self.gate_proj.pass(x.clone());
        let (up, up_product) = self.up_proj.pass(x);
        let activations = swiglu(gate, up);
        let scores =
            scoring.map(|scoring| informativeness::mlp(activations.clone(), scoring.block_size));
        let (output, down_product) = self.down_proj.pass(activations);
        BlockPass {
            output,
            scores,
            products: MlpProducts {
                gate: gate_product,
                up: up_product,
                down: down_product,
            },
        }
    }
}

#[derive(Module, Debug)]
pub struct LlamaLayer<B: Backend> {
    pub input_layernorm: RmsNorm<B>,
    pub self_attn: LlamaAttention<B>,
    pub post_attention_layernorm: RmsNorm<B>,
    pub mlp: LlamaMlp<B>,
}

impl<B: LemoBackend> LlamaLayer<B> {
    /// `h + attention(rms(h))`; token-sparse with `sparse`.
    fn attention_block(
        &self,
        h: Tensor<B, 3>,
        shared: &LlamaShared<B>,
        sparse: Option<SparseBlock<B, AttentionProducts<B>>>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let norm = &self.input_layernorm;
        let rotation = &shared.rotation;
        match sparse {
            None => {
                let x = norm.forward(h.clone());
                h + self
                    .self_attn
                    .forward(x, rotation, None, cache, shared.split.as_ref())
            }
            Some(sparse) => {
                let x = norm.forward_rows(h.clone(), sparse.rows.clone());
                let rotation = rotation.of_rows(sparse.rows.clone());
                let split = shared.split.as_ref();
                let out = self
                    .self_attn
                    .forward(x, &rotation, Some(&sparse), None, split);
                sparse.residual(h, out)
            }
        }
    }

    /// `a + mlp(rms(a))`; token-sparse with `sparse`.
    fn mlp_block(
        &self,
        a: Tensor<B, 3>,
        sparse: Option<SparseBlock<B, MlpProducts<B>>>,
    ) -> Tensor<B, 3> {
        let norm = &self.post_attention_layernorm;
        match sparse {
            None => {
                let width = self.mlp.gate_proj.out_features();
                a.clone() + by_row_slices(norm.forward(a), width, |x| self.mlp.forward(x, None))
            }
            Some(sparse) => {
                let mlp = self.mlp.with_dense_weights();
                let x = norm.forward_rows(a.clone(), sparse.rows.clone());
                let out = mlp.forward(x, Some(&sparse));
                sparse.mlp_residual(a, out, || mlp.frozen(norm))
            }
        }
    }
}

/// What the layers of one pass share: the rotary tables at the pass's positions, and the
/// sequence split when the pass runs one rank's positions of it.
pub struct LlamaShared<B: Backend> {
    pub rotation: Rotation<B>,
    pub split: Option<SequenceSplit>,
}

#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    /// `[vocab, hidden]`
    pub embed_tokens: Param<Tensor<B, 2>>,
    pub layers: Vec<LlamaLayer<B>>,
    pub norm: RmsNorm<B>,
    /// `[vocab, hidden]`; `None` when tied to `embed_tokens`.
    pub lm_head: Option<Param<Tensor<B, 2>>>,
    pub rotary: RotaryEmbedding<B>,
    /// The context the model was trained for (`max_position_embeddings`).
    pub trained_context: usize,
    /// Storage type of the hidden states (a trainable f32 embedding is cast to it).
    pub activations: DType,
}

impl<B: LemoBackend> Llama<B> {
    /// Builds the model from Hugging Face tensor names (`model.layers.{i}.self_attn.q_proj.weight`,
    /// ...); hidden states will flow as `activations`.
    pub fn load(config: &LlamaConfig, loader: &mut Loader<B>, activations: DType) -> Result<Self> {
        let (hidden, head_dim) = (config.hidden_size, config.head_dim);
        let q_width = config.num_attention_heads * head_dim;
        let kv_width = config.num_key_value_heads * head_dim;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let (ab, mb) = (config.attention_bias, config.mlp_bias);
            let self_attn = LlamaAttention {
                q_proj: loader.linear(&format!("{p}.self_attn.q_proj"), q_width, hidden, ab)?,
                k_proj: loader.linear(&format!("{p}.self_attn.k_proj"), kv_width, hidden, ab)?,
                v_proj: loader.linear(&format!("{p}.self_attn.v_proj"), kv_width, hidden, ab)?,
                o_proj: loader.linear(&format!("{p}.self_attn.o_proj"), hidden, q_width, ab)?,
                num_heads: config.num_attention_heads,
                num_kv_heads: config.num_key_value_heads,
                head_dim,
                sliding_window: config.sliding_window,
                shifted_group: None,
            };
            let mlp = LlamaMlp {
                gate_proj: loader.linear(
                    &format!("{p}.mlp.gate_proj"),
                    config.intermediate_size,
                    hidden,
                    mb,
                )?,
                up_proj: loader.linear(
                    &format!("{p}.mlp.up_proj"),
                    config.intermediate_size,
                    hidden,
                    mb,
                )?,
                down_proj: loader.linear(
                    &format!("{p}.mlp.down_proj"),
                    hidden,
                    config.intermediate_size,
                    mb,
                )?,
            };
            let input_layernorm = RmsNorm::new(
                loader.required(&format!("{p}.input_layernorm.weight"), [hidden])?,
                config.rms_norm_eps,
            );
            let post_attention_layernorm = RmsNorm::new(
                loader.required(&format!("{p}.post_attention_layernorm.weight"), [hidden])?,
                config.rms_norm_eps,
            );
            layers.push(LlamaLayer {
                input_layernorm,
                self_attn,
                post_attention_layernorm,
                mlp,
            });
        }
        let embed_tokens =
            loader.required("model.embed_tokens.weight", [config.vocab_size, hidden])?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(loader.required("lm_head.weight", [config.vocab_size, hidden])?)
        };
        Ok(Self {
            embed_tokens: Param::from_tensor(embed_tokens).set_require_grad(false),
            layers,
            norm: RmsNorm::new(
                loader.required("model.norm.weight", [hidden])?,
                config.rms_norm_eps,
            ),
            lm_head: lm_head.map(|w| Param::from_tensor(w).set_require_grad(false)),
            rotary: RotaryEmbedding::new(
                &config.rope,
                head_dim,
                config.max_position_embeddings,
                &loader.device,
            )?,
            trained_context: config.max_position_embeddings,
            activations,
        })
    }
}

impl<B: LemoBackend> Decoder<B> for Llama<B> {
    type Shared = LlamaShared<B>;
    type AttentionProducts = AttentionProducts<B>;
    type MlpProducts = MlpProducts<B>;

    fn embed(&self, tokens: Tensor<B, 2, Int>, _positions: Range<usize>) -> Tensor<B, 3> {
        embed(&self.embed_tokens.val(), tokens).cast(self.activations)
    }

    fn shared(
        &self,
        positions: Range<usize>,
        batch: usize,
        split: Option<&SequenceSplit>,
    ) -> LlamaShared<B> {
        let rotation = self.rotary.rotation(positions, batch);
        let rotation = match split {
            Some(split) => {
                let local: Vec<i64> = split.positions().iter().map(|&p| p as i64).collect();
                let len = local.len();
                let device = self.embed_tokens.device();
                let local = Tensor::<B, 1, Int>::from_data(TensorData::new(local, [len]), &device)
                    .reshape([1, len])
                    .repeat_dim(0, batch);
                rotation.at(local)
            }
            None => rotation,
        };
        LlamaShared {
            rotation,
            split: split.cloned(),
        }
    }

    fn shifted_group(&self, index: usize) -> Option<usize> {
        self.layers[index].self_attn.shifted_group
    }

    fn sequence_split<'s>(&self, shared: &'s LlamaShared<B>) -> Option<&'s SequenceSplit> {
        shared.split.as_ref()
    }

    fn splits_sequences(&self) -> bool {
        self.layers.iter().all(|layer| {
            let attention = &layer.self_attn;
            attention.sliding_window.is_none() && attention.shifted_group.is_none()
        })
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn row_activations(&self) -> RowActivations {
        let layer = self.layers.first();
        RowActivations {
            dtype: self.activations,
            stream: layer.map_or(Vec::new(), |layer| {
                let attention = &layer.self_attn;
                vec![
                    attention.q_proj.in_features(),
                    attention.k_proj.out_features(),
                ]
            }),
            mlp: layer.map(|layer| layer.mlp.gate_proj.out_features()),
        }
    }

    fn attention_block(
        &self,
        index: usize,
        h: Tensor<B, 3>,
        shared: &LlamaShared<B>,
        sparse: Option<SparseBlock<B, AttentionProducts<B>>>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        self.layers[index].attention_block(h, shared, sparse, cache)
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
        shared: &LlamaShared<B>,
        scoring: Option<BlockScoring>,
    ) -> BlockPass<B, AttentionProducts<B>> {
        let layer = &self.layers[index];
        let x = layer.input_layernorm.value(h);
        layer
            .self_attn
            .pass(x, &shared.rotation, scoring, shared.split.as_ref())
    }

    fn mlp_pass(
        &self,
        index: usize,
        a: Tensor<B, 3>,
        scoring: Option<BlockScoring>,
    ) -> BlockPass<B, MlpProducts<B>> {
        let layer = &self.layers[index];
        let x = layer.post_attention_layernorm.value(a);
        layer.mlp.pass(x, scoring)
    }

    fn frozen_mlp(&self, index: usize) -> Option<FrozenMlp<B>> {
        let layer = &self.layers[index];
        let mlp = &layer.mlp;
        let adapted = [&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj]
            .iter()
            .any(|projection| projection.lora.is_some());
        let norm = &layer.post_attention_layernorm;
        (!adapted && !norm.weight.val().is_require_grad()).then(|| mlp.frozen(norm))
    }

    fn output_norm(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        self.norm.forward(h)
    }

    /// The output projection (the embedding when tied), in the activations' dtype.
    fn lm_head_weight(&self) -> Tensor<B, 2> {
        let weight = self.lm_head.as_ref().unwrap_or(&self.embed_tokens).val();
        weight.cast(self.activations)
    }
}
