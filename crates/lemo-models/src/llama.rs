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
use burn::tensor::{DType, Int, Tensor, backend::Backend};
use lemo_kernels::fused::swiglu;
use lemo_kernels::token_movement::scatter_add_rows;
use lemo_kernels::{AttentionOptions, ComputeBackend, LemoBackend, attention::attention};
use lemo_sparsity::informativeness;

use crate::Result;
use crate::cache::{LayerCache, append_to_cache};
use crate::config::LlamaConfig;
use crate::decoder::Decoder;
use crate::embedding::embed;
use crate::lora::Linear;
use crate::norm::RmsNorm;
use crate::rope::{RotaryEmbedding, Rotation};
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

impl<B: LemoBackend> LlamaAttention<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        rotation: &Rotation<B>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let [batch, len, _] = x.dims();
        let q = rotation.apply(self.heads(self.q_proj.forward(x.clone()), self.num_heads));
        let k = rotation.apply(self.heads(self.k_proj.forward(x.clone()), self.num_kv_heads));
        let v = self.heads(self.v_proj.forward(x), self.num_kv_heads);
        let (k, v) = append_to_cache(cache, k, v);
        let options = AttentionOptions {
            sliding_window: self.sliding_window,
            shifted_group: self.shifted_group,
            ..AttentionOptions::causal(self.head_dim)
        };
        let out = attention(q, k, v, options).swap_dims(1, 2).reshape([
            batch,
            len,
            self.num_heads * self.head_dim,
        ]);
        self.o_proj.forward(out)
    }

    /// `[batch, len, n * head_dim] -> [batch, n, len, head_dim]`.
    fn heads(&self, t: Tensor<B, 3>, n: usize) -> Tensor<B, 4> {
        let [batch, len, _] = t.dims();
        t.reshape([batch, len, n, self.head_dim]).swap_dims(1, 2)
    }

    /// Exact token-block informativeness from the rotated queries and keys of every token of
    /// `x`, outside the graph.
    fn informativeness(
        &self,
        x: Tensor<B, 3>,
        rotation: &Rotation<B>,
        block_size: usize,
    ) -> Tensor<B, 2> {
        let q =
            rotation.apply(self.heads(self.q_proj.forward_untracked(x.clone()), self.num_heads));
        let k = rotation.apply(self.heads(self.k_proj.forward_untracked(x), self.num_kv_heads));
        informativeness::attention(q, k, block_size)
    }
}

#[derive(Module, Debug)]
pub struct LlamaMlp<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
}

impl<B: ComputeBackend> LlamaMlp<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.down_proj.forward(swiglu(
            self.gate_proj.forward(x.clone()),
            self.up_proj.forward(x),
        ))
    }

    /// Token-block informativeness from `silu(gate) * up` of every token of `x`, outside the
    /// graph.
    fn informativeness(&self, x: Tensor<B, 3>, block_size: usize) -> Tensor<B, 2> {
        let activations = swiglu(
            self.gate_proj.forward_untracked(x.clone()),
            self.up_proj.forward_untracked(x),
        );
        informativeness::mlp(activations, block_size)
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
    /// `h + attention(rms(h))`, on the kept rows only when there are `rows`.
    fn attention_block(
        &self,
        h: Tensor<B, 3>,
        rotation: &Rotation<B>,
        rows: Option<&Tensor<B, 2, Int>>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let norm = &self.input_layernorm;
        match rows {
            None => h.clone() + self.self_attn.forward(norm.forward(h), rotation, cache),
            Some(rows) => {
                let x = norm.forward_rows(h.clone(), rows.clone());
                let out = self.self_attn.forward(x, &rotation.at(rows.clone()), None);
                scatter_add_rows(h, rows.clone(), out)
            }
        }
    }

    /// `a + mlp(rms(a))`, on the kept rows only when there are `rows`.
    fn mlp_block(&self, a: Tensor<B, 3>, rows: Option<&Tensor<B, 2, Int>>) -> Tensor<B, 3> {
        let norm = &self.post_attention_layernorm;
        match rows {
            None => a.clone() + self.mlp.forward(norm.forward(a)),
            Some(rows) => {
                let out = self.mlp.forward(norm.forward_rows(a.clone(), rows.clone()));
                scatter_add_rows(a, rows.clone(), out)
            }
        }
    }
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
            ),
            trained_context: config.max_position_embeddings,
            activations,
        })
    }
}

impl<B: LemoBackend> Decoder<B> for Llama<B> {
    type Shared = Rotation<B>;

    fn embed(&self, tokens: Tensor<B, 2, Int>, _positions: Range<usize>) -> Tensor<B, 3> {
        embed(&self.embed_tokens.val(), tokens).cast(self.activations)
    }

    fn shared(&self, positions: Range<usize>, batch: usize) -> Rotation<B> {
        self.rotary.rotation(positions, batch)
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn attention_block(
        &self,
        index: usize,
        h: Tensor<B, 3>,
        rotation: &Rotation<B>,
        rows: Option<&Tensor<B, 2, Int>>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        self.layers[index].attention_block(h, rotation, rows, cache)
    }

    fn mlp_block(
        &self,
        index: usize,
        a: Tensor<B, 3>,
        rows: Option<&Tensor<B, 2, Int>>,
    ) -> Tensor<B, 3> {
        self.layers[index].mlp_block(a, rows)
    }

    fn attention_informativeness(
        &self,
        index: usize,
        h: Tensor<B, 3>,
        rotation: &Rotation<B>,
        block_size: usize,
    ) -> Tensor<B, 2> {
        let layer = &self.layers[index];
        let x = layer.input_layernorm.forward(h);
        layer.self_attn.informativeness(x, rotation, block_size)
    }

    fn mlp_informativeness(
        &self,
        index: usize,
        a: Tensor<B, 3>,
        block_size: usize,
    ) -> Tensor<B, 2> {
        let layer = &self.layers[index];
        layer
            .mlp
            .informativeness(layer.post_attention_layernorm.forward(a), block_size)
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
