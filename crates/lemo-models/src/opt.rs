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
use lemo_kernels::{AttentionOptions, LemoBackend, attention::attention};

use crate::Result;
use crate::config::OptConfig;
use crate::decoder::Decoder;
use crate::lora::Linear;
use crate::model::{LayerCache, append_to_cache, embed};
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
        let heads = |t: Tensor<B, 3>| {
            t.reshape([batch, len, self.num_heads, self.head_dim])
                .swap_dims(1, 2)
        };
        let q = heads(self.q_proj.forward(x.clone()));
        let (k, v) = append_to_cache(
            cache,
            heads(self.k_proj.forward(x.clone())),
            heads(self.v_proj.forward(x)),
        );
        let options = AttentionOptions {
            shifted_group: self.shifted_group,
            ..AttentionOptions::causal(self.head_dim)
        };
        let out = attention(q, k, v, options);
        self.out_proj
            .forward(out.swap_dims(1, 2).reshape([batch, len, hidden]))
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
    fn forward(&self, h: Tensor<B, 3>, cache: Option<&mut LayerCache<B>>) -> Tensor<B, 3> {
        let (ln1, ln2) = (&self.self_attn_layer_norm, &self.final_layer_norm);
        if self.norm_before {
            let a = h.clone() + self.self_attn.forward(ln1.forward(h), cache);
            a.clone() + self.fc2.forward(relu(self.fc1.forward(ln2.forward(a))))
        } else {
            let a = ln1.forward(h.clone() + self.self_attn.forward(h, cache));
            ln2.forward(a.clone() + self.fc2.forward(relu(self.fc1.forward(a))))
        }
    }
}

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

    fn layer(
        &self,
        index: usize,
        h: Tensor<B, 3>,
        _shared: &(),
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        self.layers[index].forward(h, cache)
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
