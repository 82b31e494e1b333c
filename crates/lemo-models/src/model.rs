//! The architecture-independent face of a causal LM: loading from a path, the KV cache, LoRA
//! wiring and next-token cross-entropy.

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::{AutodiffBackend, Backend, DTypeUsage};
use burn::tensor::{DType, Int, Tensor};
use lemo_kernels::LemoBackend;
use lemo_kernels::gemm::matmul;
use lemo_kernels::precision::Precision;

use crate::activation_plan::ActivationPlan;
use crate::cache::KvCache;
use crate::config::{ModelConfig, RopeConfig};
use crate::decoder::{self, Decoder};
use crate::gguf::{GgufFile, GgufWeights};
use crate::llama::Llama;
use crate::llama2c::Llama2cCheckpoint;
use crate::lora::{Linear, LoraConfig};
use crate::loss::{self, Batch};
use crate::opt::Opt;
use crate::planned_backward;
use crate::quantized::{FrozenSummary, QuantizeBase};
use crate::rope::RotaryEmbedding;
use crate::token_plan::TokenSparsity;
use crate::weights::{Checkpoint, Loader, SafetensorsWeights, WeightSource};
use crate::{Error, Result};

// One instance per process: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum CausalLm<B: Backend> {
    Llama(Llama<B>),
    Opt(Opt<B>),
}

/// A model folder or checkpoint file, recognized by its shape on disk.
pub enum ModelFormat {
    /// A Hugging Face folder: `config.json` plus `*.safetensors`.
    HuggingFace,
    /// A llama2.c v0 checkpoint `.bin`.
    Llama2c,
    /// A llama.cpp `.gguf` file (weights, configuration and tokenizer in one).
    Gguf,
}

impl ModelFormat {
    pub fn detect(path: &Path) -> Result<Self> {
        if path.is_dir() {
            if !path.join("config.json").exists() {
                return Err(Error::format(path, "model folder has no config.json"));
            }
            Ok(ModelFormat::HuggingFace)
        } else if path.is_file() {
            match path.extension().and_then(|e| e.to_str()) {
                Some("bin") => Ok(ModelFormat::Llama2c),
                Some("gguf") => Ok(ModelFormat::Gguf),
                _ => Err(Error::format(
                    path,
                    "expected a Hugging Face model folder, a llama2.c .bin checkpoint or a .gguf file",
                )),
            }
        } else if path.exists() {
            Err(Error::format(
                path,
                "not a regular file or folder (a pipe or device cannot be read as a model)",
            ))
        } else {
            Err(Error::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder"),
            ))
        }
    }
}

/// The configuration and weights of a Hugging Face folder, a llama2.c checkpoint or a GGUF
/// file, nothing read yet but the headers.
pub fn open_checkpoint(path: &Path) -> Result<(ModelConfig, Box<dyn Checkpoint>)> {
    Ok(match ModelFormat::detect(path)? {
        ModelFormat::HuggingFace => {
            let config = ModelConfig::from_file(path)?;
            let weights = SafetensorsWeights::open(path)?;
            check_layer_count(path, &config, &weights)?;
            (config, Box::new(weights))
        }
        ModelFormat::Llama2c => {
            let checkpoint = Llama2cCheckpoint::open(path)?;
            (
                ModelConfig::Llama(checkpoint.config().clone()),
                Box::new(checkpoint),
            )
        }
        ModelFormat::Gguf => {
            let file = GgufFile::open(path)?;
            let llama = file.llama_config()?;
            let weights = GgufWeights::new(file, &llama);
            (ModelConfig::Llama(llama), Box::new(weights))
        }
    })
}

impl<B: LemoBackend> CausalLm<B> {
    /// Loads a Hugging Face folder, a llama2.c checkpoint or a GGUF file onto `device`, its weights stored
    /// and its hidden states computed as `precision` says (see [`Self::build`]); a GGUF base's
    /// quantized projections stay quantized.
    pub fn from_path(
        path: &Path,
        device: &B::Device,
        precision: Precision,
    ) -> Result<(Self, ModelConfig)> {
        let (model, config, _) =
            Self::from_path_quantized(path, device, precision, QuantizeBase::Keep)?;
        Ok((model, config))
    }

    /// [`Self::from_path`] with the frozen projections stored as `quantize` says, and what was
    /// kept quantized.
    pub fn from_path_quantized(
        path: &Path,
        device: &B::Device,
        precision: Precision,
        quantize: QuantizeBase,
    ) -> Result<(Self, ModelConfig, FrozenSummary)> {
        let (config, mut source) = open_checkpoint(path)?;
        // A weight that disagrees with the config is a problem of this file: name it.
        let (model, summary) =
            Self::build_quantized(&config, source.as_mut(), device, precision, quantize).map_err(
                |e| match e {
                    Error::Shape(message) => Error::format(path, message),
                    other => other,
                },
            )?;
        Ok((model, config, summary))
    }

    /// Builds a model of `config` from any weight source (a checkpoint, or random weights). The
    /// pretrained weights are stored as `precision.frozen` and the hidden states flow as
    /// `precision.activations`; adapters added later, and weights made trainable, are f32.
    pub fn build(
        config: &ModelConfig,
        source: &mut dyn WeightSource,
        device: &B::Device,
        precision: Precision,
    ) -> Result<Self> {
        Self::build_quantized(config, source, device, precision, QuantizeBase::Keep)
            .map(|(model, _)| model)
    }

    /// [`Self::build`] with the frozen projections stored as `quantize` says.
    pub fn build_quantized(
        config: &ModelConfig,
        source: &mut dyn WeightSource,
        device: &B::Device,
        precision: Precision,
        quantize: QuantizeBase,
    ) -> Result<(Self, FrozenSummary)> {
        for dtype in [precision.frozen, precision.activations] {
            if !B::dtype_usage(device, dtype).contains(DTypeUsage::Storage) {
                return Err(Error::Config(format!(
                    "the {} backend has no {dtype:?} tensors: use f32",
                    B::name(device)
                )));
            }
        }
        let mut loader = Loader {
            source,
            device: device.clone(),
            dtype: precision.frozen,
            quantize,
            summary: FrozenSummary::default(),
        };
        let model = match config {
            ModelConfig::Llama(c) => {
                CausalLm::Llama(Llama::load(c, &mut loader, precision.activations)?)
            }
            ModelConfig::Opt(c) => CausalLm::Opt(Opt::load(c, &mut loader)?),
        };
        Ok((model, loader.summary))
    }

    pub fn num_layers(&self) -> usize {
        match self {
            CausalLm::Llama(m) => m.layers.len(),
            CausalLm::Opt(m) => m.layers.len(),
        }
    }

    /// Final hidden states `[batch, len, dim]`; positions continue the cache when there is one,
    /// and the cache grows by `len`. Each block processes the rows `sparsity` gives it.
    pub fn hidden_states(
        &self,
        tokens: Tensor<B, 2, Int>,
        mut cache: Option<&mut KvCache<B>>,
        sparsity: &mut TokenSparsity,
    ) -> Tensor<B, 3> {
        let [_, len] = tokens.dims();
        let start = cache.as_ref().map_or(0, |c| c.len);
        let positions = start..start + len;
        let out = match self {
            CausalLm::Llama(m) => {
                decoder::hidden_states(m, tokens, positions, cache.as_deref_mut(), sparsity)
            }
            CausalLm::Opt(m) => {
                decoder::hidden_states(m, tokens, positions, cache.as_deref_mut(), sparsity)
            }
        };
        if let Some(cache) = cache {
            cache.len += len;
        }
        out
    }

    /// `[vocab, dim]`: the output projection.
    pub fn lm_head_weight(&self) -> Tensor<B, 2> {
        match self {
            CausalLm::Llama(m) => m.lm_head_weight(),
            CausalLm::Opt(m) => m.lm_head_weight(),
        }
    }

    /// Logits `[batch, len, vocab]`, in f32 whatever the model's precision.
    pub fn forward(
        &self,
        tokens: Tensor<B, 2, Int>,
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        let hidden = self.hidden_states(tokens, cache, &mut TokenSparsity::Dense);
        let [batch, len, dim] = hidden.dims();
        let weight = self.lm_head_weight();
        let [vocab, _] = weight.dims();
        matmul(hidden.reshape([batch * len, dim]), weight.transpose())
            .cast(DType::F32)
            .reshape([batch, len, vocab])
    }

    /// Sum over all positions but the last of `-log p(tokens[t+1] | tokens[..=t])` (f32, `[1]`),
    /// and the number of terms, over the positions `labels` does not mask when given (see
    /// [`loss::next_token_loss`]), with each block on the rows `sparsity` gives it.
    pub fn next_token_loss_sum(
        &self,
        tokens: Tensor<B, 2, Int>,
        labels: Option<Tensor<B, 2, Int>>,
        chunk_rows: usize,
        sparsity: &mut TokenSparsity,
    ) -> (Tensor<B, 1>, usize) {
        let hidden = self.hidden_states(tokens.clone(), None, sparsity);
        loss::next_token_loss(hidden, self.lm_head_weight(), tokens, labels, chunk_rows)
    }

    /// [`Self::next_token_loss_sum`] of this rank's positions of `batch`'s sequences, split over
    /// a sequence group (see [`loss::split_loss_sum`]); every block dense.
    pub fn split_loss_sum(&self, batch: Batch<B>, chunk_rows: usize) -> (Tensor<B, 1>, usize) {
        match self {
            CausalLm::Llama(m) => loss::split_loss_sum(m, batch, chunk_rows),
            CausalLm::Opt(m) => loss::split_loss_sum(m, batch, chunk_rows),
        }
    }

    /// Every linear projection with its Hugging Face module path (`model.layers.3.self_attn.q_proj`).
    pub fn projections_mut(&mut self) -> Vec<(String, &mut Linear<B>)> {
        match self {
            CausalLm::Llama(m) => m
                .layers
                .iter_mut()
                .enumerate()
                .flat_map(|(i, l)| {
                    let a = &mut l.self_attn;
                    let f = &mut l.mlp;
                    [
                        ("self_attn.q_proj", &mut a.q_proj),
                        ("self_attn.k_proj", &mut a.k_proj),
                        ("self_attn.v_proj", &mut a.v_proj),
                        ("self_attn.o_proj", &mut a.o_proj),
                        ("mlp.gate_proj", &mut f.gate_proj),
                        ("mlp.up_proj", &mut f.up_proj),
                        ("mlp.down_proj", &mut f.down_proj),
                    ]
                    .map(|(n, lin)| (format!("model.layers.{i}.{n}"), lin))
                })
                .collect(),
            CausalLm::Opt(m) => m
                .layers
                .iter_mut()
                .enumerate()
                .flat_map(|(i, l)| {
                    let a = &mut l.self_attn;
                    [
                        ("self_attn.q_proj", &mut a.q_proj),
                        ("self_attn.k_proj", &mut a.k_proj),
                        ("self_attn.v_proj", &mut a.v_proj),
                        ("self_attn.out_proj", &mut a.out_proj),
                        ("fc1", &mut l.fc1),
                        ("fc2", &mut l.fc2),
                    ]
                    .map(|(n, lin)| (format!("model.decoder.layers.{i}.{n}"), lin))
                })
                .collect(),
        }
    }

    /// Adds fresh LoRA adapters to the projections `config` targets, initialized from `seed`
    /// (the same adapters on every device).
    pub fn with_new_lora(mut self, config: &LoraConfig, seed: u64) -> Result<Self> {
        let mut matched = 0;
        for (name, linear) in self.projections_mut() {
            if config.targets(name.rsplit('.').next().unwrap_or(&name)) {
                *linear = linear.clone().with_new_lora(config, &name, seed);
                matched += 1;
            }
        }
        if matched == 0 {
            return Err(Error::Config(format!(
                "LoRA target modules {:?} match no projection of this model",
                config.target_modules
            )));
        }
        Ok(self)
    }

    /// Folds every adapter into its base weight.
    pub fn merge_lora(mut self) -> Self {
        for (_, linear) in self.projections_mut() {
            *linear = linear.clone().merge_lora();
        }
        self
    }
}

impl<B: AutodiffBackend + LemoBackend> CausalLm<B>
where
    B::InnerBackend: LemoBackend,
{
    /// [`Self::next_token_loss_sum`] and the gradients of `scale` times it, each layer's
    /// activations kept, recomputed or offloaded as `plan` says (see
    /// [`planned_backward::planned_loss_backward`]): the partial backward passes' gradients go to
    /// `on_gradients`. Returns the unscaled loss sum and the number of predictions.
    pub fn next_token_loss_backward_planned(
        &self,
        batch: Batch<B>,
        chunk_rows: usize,
        scale: f64,
        sparsity: &mut TokenSparsity,
        plan: &ActivationPlan,
        on_gradients: &mut dyn FnMut(&B::Gradients),
    ) -> (Tensor<B::InnerBackend, 1>, usize) {
        match self {
            CausalLm::Llama(m) => planned_backward::planned_loss_backward(
                m,
                batch,
                chunk_rows,
                scale,
                sparsity,
                plan,
                on_gradients,
            ),
            CausalLm::Opt(m) => planned_backward::planned_loss_backward(
                m,
                batch,
                chunk_rows,
                scale,
                sparsity,
                plan,
                on_gradients,
            ),
        }
    }
}

impl<B: LemoBackend> CausalLm<B> {
    /// Replaces the rotary position frequencies (a context extension: the scaling chosen for
    /// the context one trains for, or a new base). OPT has learned positions and no rotary
    /// embedding.
    pub fn with_rope(mut self, rope: &RopeConfig) -> Result<Self> {
        match &mut self {
            CausalLm::Llama(m) => {
                let head_dim = m.layers.first().map_or(0, |l| l.self_attn.head_dim);
                let device = m.rotary.cos.device();
                let context = (m.trained_context as f64 * rope.scaling.factor().max(1.0)).ceil();
                m.rotary = RotaryEmbedding::new(rope, head_dim, context as usize, &device)?;
            }
            CausalLm::Opt(_) => {
                return Err(Error::Config(
                    "OPT has learned absolute positions: its RoPE scaling cannot be changed".into(),
                ));
            }
        }
        Ok(self)
    }

    /// Why this model cannot eliminate tokens on sequences of `seq_len` tokens, if it cannot.
    /// Kept rows attend to one another under the plain causal mask, which is exact among them
    /// because their order is kept; a sliding window shorter than the sequence is defined on
    /// positions and would need the original positions in the kernel. S2 groups are laid over
    /// the kept rows instead (Llama family; OPT's attention blocks do not).
    pub fn check_token_elimination(&self, seq_len: usize) -> Result<()> {
        let unsupported = |why: &str| Err(Error::Config(format!("--method lemo: {why}")));
        match self {
            CausalLm::Llama(m) => {
                let attention = &m.layers[0].self_attn;
                if let Some(window) = attention.sliding_window.filter(|&w| w < seq_len) {
                    return unsupported(&format!(
                        "a sliding window of {window} tokens shorter than the sequence ({seq_len}) is not supported with token elimination; use --seq-len {window} or less"
                    ));
                }
            }
            CausalLm::Opt(m) => {
                if m.layers.iter().any(|l| !l.norm_before) {
                    return unsupported(crate::opt::POST_NORM_DENSE);
                }
                if m.layers[0].self_attn.shifted_group.is_some() {
                    return unsupported(
                        "S2 attention with token elimination is built for Llama-family models; train OPT with S2 by --method longlora",
                    );
                }
            }
        }
        Ok(())
    }

    /// Whether a sequence of this model can be split over ranks (context parallelism; see
    /// [`crate::decoder::Decoder::splits_sequences`]).
    pub fn splits_sequences(&self) -> bool {
        match self {
            CausalLm::Llama(m) => m.splits_sequences(),
            CausalLm::Opt(m) => m.splits_sequences(),
        }
    }

    /// Shifted sparse attention (LongLoRA's S2) with groups of `group_size` tokens in every
    /// layer, or dense attention with `None`.
    pub fn set_shifted_group(&mut self, group_size: Option<usize>) {
        match self {
            CausalLm::Llama(m) => m
                .layers
                .iter_mut()
                .for_each(|l| l.self_attn.shifted_group = group_size),
            CausalLm::Opt(m) => m
                .layers
                .iter_mut()
                .for_each(|l| l.self_attn.shifted_group = group_size),
        }
    }

    /// Marks the token embedding and/or the normalization weights trainable (LongLoRA), as
    /// `config.train_embeddings` and `config.train_norms` say. Trainable weights are f32 whatever
    /// the model's precision, and are cast to the activations' dtype where they are used: the f32
    /// master weights LongLoRA's bf16 training keeps (DeepSpeed), so gradients and AdamW state
    /// are f32.
    pub fn set_extra_trainable(mut self, config: &LoraConfig) -> Result<Self> {
        if !(config.train_embeddings || config.train_norms) {
            return Ok(self);
        }
        let CausalLm::Llama(m) = &mut self else {
            return Err(Error::Config(
                "trainable embeddings and norms are supported for Llama-family models only".into(),
            ));
        };
        if config.train_embeddings {
            m.embed_tokens = trainable(m.embed_tokens.clone());
        }
        if config.train_norms {
            for layer in &mut m.layers {
                layer.input_layernorm.weight = trainable(layer.input_layernorm.weight.clone());
                layer.post_attention_layernorm.weight =
                    trainable(layer.post_attention_layernorm.weight.clone());
            }
            m.norm.weight = trainable(m.norm.weight.clone());
        }
        Ok(self)
    }

    /// The non-LoRA weights `config` trains, as `(Hugging Face name, shape, values)`: what PEFT
    /// calls `modules_to_save`.
    pub fn extra_trainable_weights(
        &self,
        config: &LoraConfig,
    ) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let CausalLm::Llama(m) = self else {
            return Vec::new();
        };
        fn values<B: Backend, const D: usize>(
            name: String,
            t: Tensor<B, D>,
        ) -> (String, Vec<usize>, Vec<f32>) {
            let shape = t.dims().to_vec();
            (
                name,
                shape,
                t.into_data().convert::<f32>().into_vec().expect("f32 data"),
            )
        }
        let mut out = Vec::new();
        if config.train_embeddings {
            out.push(values(
                "model.embed_tokens.weight".into(),
                m.embed_tokens.val(),
            ));
        }
        if config.train_norms {
            for (i, layer) in m.layers.iter().enumerate() {
                out.push(values(
                    format!("model.layers.{i}.input_layernorm.weight"),
                    layer.input_layernorm.weight.val(),
                ));
                out.push(values(
                    format!("model.layers.{i}.post_attention_layernorm.weight"),
                    layer.post_attention_layernorm.weight.val(),
                ));
            }
            out.push(values("model.norm.weight".into(), m.norm.weight.val()));
        }
        out
    }

    /// Replaces the named non-LoRA weights (see [`Self::extra_trainable_weights`]), each kept in
    /// the dtype of the weight it replaces; returns how many names matched.
    pub fn set_extra_weights(&mut self, weights: &mut dyn WeightSource) -> Result<usize> {
        let CausalLm::Llama(m) = self else {
            return Ok(0);
        };
        let mut found = 0;
        let mut replace1 =
            |name: &str, param: &mut burn::module::Param<Tensor<B, 1>>| -> Result<()> {
                let shape = param.dims();
                if let Some(v) = weights.fetch(name, &shape)? {
                    let data = burn::tensor::TensorData::new(v, shape);
                    let t = Tensor::from_data(data, (&param.device(), param.dtype()));
                    *param = burn::module::Param::from_tensor(t).set_require_grad(false);
                    found += 1;
                }
                Ok(())
            };
        for (i, layer) in m.layers.iter_mut().enumerate() {
            replace1(
                &format!("model.layers.{i}.input_layernorm.weight"),
                &mut layer.input_layernorm.weight,
            )?;
            replace1(
                &format!("model.layers.{i}.post_attention_layernorm.weight"),
                &mut layer.post_attention_layernorm.weight,
            )?;
        }
        replace1("model.norm.weight", &mut m.norm.weight)?;
        let shape = m.embed_tokens.dims();
        if let Some(v) = weights.fetch("model.embed_tokens.weight", &shape)? {
            let data = burn::tensor::TensorData::new(v, shape);
            let t = Tensor::from_data(data, (&m.embed_tokens.device(), m.embed_tokens.dtype()));
            m.embed_tokens = burn::module::Param::from_tensor(t).set_require_grad(false);
            found += 1;
        }
        Ok(found)
    }
}

/// `param` as a trainable f32 weight (same id).
fn trainable<B: Backend, const D: usize>(
    param: burn::module::Param<Tensor<B, D>>,
) -> burn::module::Param<Tensor<B, D>> {
    param.map(|t| t.cast(DType::F32).detach().require_grad())
}

/// Each layer has several tensors: a config claiming more layers than the weights hold tensors
/// is refused before anything is sized from it.
fn check_layer_count(
    path: &Path,
    config: &ModelConfig,
    weights: &SafetensorsWeights,
) -> Result<()> {
    let tensors = weights.names().count();
    if config.num_layers() > tensors {
        return Err(Error::format(
            path,
            format!(
                "config.json has {} layers but the weights hold only {tensors} tensors",
                config.num_layers()
            ),
        ));
    }
    Ok(())
}
