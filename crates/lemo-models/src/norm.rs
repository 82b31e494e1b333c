//! Normalizations: statistics and arithmetic in f32 whatever the storage dtype, the output in the
//! input's dtype (as transformers computes them for bf16 models).

use burn::module::{Module, Param};
use burn::tensor::{DType, ElementConversion, Int, Tensor, backend::Backend};
use lemo_kernels::ComputeBackend;
use lemo_kernels::fused::{NormSaves, layer_norm, rms_norm};
use lemo_kernels::recomputed_rows::FrozenNorm;
use lemo_kernels::token_movement::gather_rms_norm;

use crate::block_pass::untracked;

/// `x / sqrt(mean(x^2) + eps) * weight` (Llama).
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
    /// Whether the loaded weight has no zero entry, so that the norm's backward pass can
    /// recover its input from its output (see [`NormSaves::Output`]).
    pub invertible: bool,
}

impl<B: Backend> RmsNorm<B> {
    pub fn new(weight: Tensor<B, 1>, eps: f64) -> Self {
        Self {
            invertible: NormSaves::invertible(&weight),
            weight: Param::from_tensor(weight).set_require_grad(false),
            eps,
        }
    }

    /// What the norm keeps for its backward pass: an invertible norm keeps its output, which
    /// the adapters that read it save anyway (the attention block's projections), instead of a
    /// copy of its input: at 8K tokens a Llama-2-7B layer's input is 64 MiB, and with LongLoRA's
    /// trainable norms at 32K every layer would keep 260 MB more of kept rows under `lemo`. A
    /// trainable weight keeps that right: the output carries its relative precision whatever
    /// the weight's magnitude, so `y / w` recovers the input unless an entry is exactly zero,
    /// which optimizer steps on a nonzero f32 weight do not land on.
    fn saves(&self) -> NormSaves {
        if self.invertible {
            NormSaves::Output
        } else {
            NormSaves::Input
        }
    }
}

impl<B: ComputeBackend> RmsNorm<B> {
    /// This norm as the frozen one a recomputed backward pass reads.
    pub fn frozen(&self) -> FrozenNorm<B> {
        FrozenNorm::Rms {
            weight: self.weight.val().into_primitive().tensor(),
            eps: self.eps,
        }
    }

    /// The fused kernel; a trainable (f32) weight is cast to `x`'s dtype on use.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let weight = self.weight.val().cast(x.dtype());
        rms_norm(x, weight, self.eps as f32, self.saves())
    }

    /// [`Self::forward`] outside any graph (a pass over every row): neither a trainable weight
    /// (LongLoRA) nor an input that is a graph's leaf records a node, whose saved tensor (a
    /// `[seq, hidden]` per norm) would outlive the output until the backward pass.
    pub fn value<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let weight = untracked(self.weight.val()).cast(x.dtype());
        rms_norm(untracked(x), weight, self.eps as f32, self.saves())
    }

    /// The norm of the rows `rows: [batch, kept]` of `x: [batch, seq, hidden]`, read from `x`
    /// by the norm itself (no compacted copy of `x`).
    pub fn forward_rows(&self, x: Tensor<B, 3>, rows: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let weight = self.weight.val().cast(x.dtype());
        gather_rms_norm(x, rows, weight, self.eps as f32, self.saves())
    }
}

/// `(x - mean) / sqrt(var + eps) * weight + bias` (OPT), weight and bias optional as in
/// `layer_norm_elementwise_affine = false`.
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    pub weight: Option<Param<Tensor<B, 1>>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    pub eps: f64,
    /// Whether the backward pass can recover the normalized input from the output,
    /// `(y - b) / w`, about as precisely as from a saved copy: a weight (if any) without zero
    /// entries and a bias no larger than the weight in any channel (where it is larger, the
    /// subtraction cancels the leading digits of a bf16 output).
    pub invertible: bool,
}

impl<B: Backend> LayerNorm<B> {
    pub fn new(weight: Option<Tensor<B, 1>>, bias: Option<Tensor<B, 1>>, eps: f64) -> Self {
        let frozen = |t| Param::from_tensor(t).set_require_grad(false);
        let magnitude = |t: &Tensor<B, 1>| t.clone().cast(DType::F32).abs();
        // The largest |bias| per unit of |weight| (a weight of one where there is none).
        let bias_within_weight = bias.as_ref().is_none_or(|b| {
            let ratio = match &weight {
                Some(w) => magnitude(b) / magnitude(w),
                None => magnitude(b),
            };
            ratio.max().into_scalar().elem::<f32>() <= 1.0
        });
        Self {
            invertible: bias_within_weight && weight.as_ref().is_none_or(NormSaves::invertible),
            weight: weight.map(frozen),
            bias: bias.map(frozen),
            eps,
        }
    }

    /// This norm as the frozen one a recomputed backward pass reads.
    pub fn frozen(&self) -> FrozenNorm<B> {
        let vector = |p: &Param<Tensor<B, 1>>| p.val().into_primitive().tensor();
        FrozenNorm::Layer {
            weight: self.weight.as_ref().map(vector),
            bias: self.bias.as_ref().map(vector),
            eps: self.eps,
        }
    }
}

impl<B: ComputeBackend> LayerNorm<B> {
    /// Whether the weight or the bias trains (LongLoRA).
    fn trainable(&self) -> bool {
        [&self.weight, &self.bias]
            .into_iter()
            .flatten()
            .any(|p| p.is_require_grad())
    }

    /// Frozen: one op that keeps its output (or, for a weight with a zero entry, its input) for
    /// the backward pass; trainable: the plain tensor ops, which give the parameters' gradients.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.normalize(x, |p| p.val())
    }

    /// [`Self::forward`] outside any graph (a pass over every row, see [`RmsNorm::value`]).
    pub fn value<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.normalize(untracked(x), |p| untracked(p.val()))
    }

    /// [`Self::forward`] with the parameters as `parameter` reads them.
    fn normalize<const D: usize>(
        &self,
        x: Tensor<B, D>,
        parameter: impl Fn(&Param<Tensor<B, 1>>) -> Tensor<B, 1>,
    ) -> Tensor<B, D> {
        let weight = self.weight.as_ref().map(&parameter);
        let bias = self.bias.as_ref().map(&parameter);
        if !self.trainable() {
            let saves = if self.invertible {
                NormSaves::Output
            } else {
                NormSaves::Input
            };
            return layer_norm(x, weight, bias, self.eps as f32, saves);
        }
        let dtype = x.dtype();
        let x = x.cast(DType::F32);
        let mean = x.clone().mean_dim(D - 1);
        let centered = x - mean;
        let variance = centered.clone().square().mean_dim(D - 1);
        let mut y = centered.div(variance.add_scalar(self.eps).sqrt());
        if let Some(weight) = weight {
            y = y * weight.cast(DType::F32).unsqueeze();
        }
        if let Some(bias) = bias {
            y = y + bias.cast(DType::F32).unsqueeze();
        }
        y.cast(dtype)
    }
}
