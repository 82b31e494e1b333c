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
use lemo_kernels::token_movement::{gather_rows, scatter_add_rows};
use lemo_kernels::{AttentionOptions, LemoBackend, attention::attention};
use lemo_sparsity::informativeness;

use crate::Result;
use crate::cache::{LayerCache, append_to_cache};
use crate::config::OptConfig;
use crate::decoder::Decoder;
use crate::embedding::embed;
use crate::lora::Linear;
use crate::norm::LayerNorm;
use crate::weights::Loader;

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

impl<B: LemoBackend> OptAttention<B> {
    fn forward(&self, x: Tensor<B, 3>, cache: Option<&mut LayerCache<B>>) -> Tensor<B, 3> {
        let [batch, len, hidden] = x.dims();
        let q = self.heads(self.q_proj.forward(x.clone()));
        let (k, v) = append_to_cache(
            cache,
            self.heads(self.k_proj.forward(x.clone())),
            self.heads(self.v_proj.forward(x)),
        );
        let options = AttentionOptions {
            shifted_group: self.shifted_group,
            ..AttentionOptions::causal(self.head_dim)
        };
        let out = attention(q, k, v, options);
        self.out_proj
            .forward(out.swap_dims(1, 2).reshape([batch, len, hidden]))
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
    /// Pre-norm: `h + attn(ln1(h))`; post-norm: `ln1(h + attn(h))`. Kept rows (pre-norm only)
    /// are gathered before the LayerNorm, which has no fused gathering kernel.
    fn attention_block(
        &self,
        h: Tensor<B, 3>,
        rows: Option<&Tensor<B, 2, Int>>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let ln1 = &self.self_attn_layer_norm;
        match (rows, self.norm_before) {
            (None, true) => h.clone() + self.self_attn.forward(ln1.forward(h), cache),
            (None, false) => ln1.forward(h.clone() + self.self_attn.forward(h, cache)),
            (Some(rows), true) => {
                let x = ln1.forward(gather_rows(h.clone(), rows.clone()));
                scatter_add_rows(h, rows.clone(), self.self_attn.forward(x, None))
            }
            (Some(_), false) => panic!("{POST_NORM_DENSE}"),
        }
    }

    /// Pre-norm: `a + fc2(relu(fc1(ln2(a))))`; post-norm: `ln2(a + fc2(relu(fc1(a))))`.
    fn mlp_block(&self, a: Tensor<B, 3>, rows: Option<&Tensor<B, 2, Int>>) -> Tensor<B, 3> {
        let ln2 = &self.final_layer_norm;
        let mlp = |x: Tensor<B, 3>| self.fc2.forward(relu(self.fc1.forward(x)));
        match (rows, self.norm_before) {
            (None, true) => a.clone() + mlp(ln2.forward(a)),
            (None, false) => ln2.forward(a.clone() + mlp(a)),
            (Some(rows), true) => {
                let x = ln2.forward(gather_rows(a.clone(), rows.clone()));
                scatter_add_rows(a, rows.clone(), mlp(x))
            }
            (Some(_), false) => panic!("{POST_NORM_DENSE}"),
        }
    }

    /// What the attention block's projections read: the normalized input (pre-norm) or the
    /// input itself (post-norm).
    fn attention_input(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        if self.norm_before {
            self.self_attn_layer_norm.forward(h)
        } else {
            h
        }
    }

    fn mlp_input(&self, a: Tensor<B, 3>) -> Tensor<B, 3> {
        if self.norm_before {
            self.final_layer_norm.forward(a)
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

    fn shared(&self, _positions: Range<usize>, _batch: usize) {}

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn attention_block(
        &self,
        index: usize,
        h: Tensor<B, 3>,
        _shared: &(),
        rows: Option<&Tensor<B, 2, Int>>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        self.layers[index].attention_block(h, rows, cache)
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
        _shared: &(),
        block_size: usize,
    ) -> Tensor<B, 2> {
        let layer = &self.layers[index];
        let attn = &layer.self_attn;
        let x = layer.attention_input(h);
        let q = attn.heads(attn.q_proj.forward_untracked(x.clone()));
        let k = attn.heads(attn.k_proj.forward_untracked(x));
        informativeness::attention(q, k, block_size)
    }

    /// From OPT's ReLU output.
    fn mlp_informativeness(
        &self,
        index: usize,
        a: Tensor<B, 3>,
        block_size: usize,
    ) -> Tensor<B, 2> {
        let layer = &self.layers[index];
        let activations = relu(layer.fc1.forward_untracked(layer.mlp_input(a)));
        informativeness::mlp(activations, block_size)
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
