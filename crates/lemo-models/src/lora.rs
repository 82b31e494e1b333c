//! Linear layers with frozen base weights and an optional low-rank adapter:
//! `y = x W^T + b + (alpha / r) * dropout(x) A^T B^T`, with `A: [r, in]` and `B: [out, r]`
//! named and shaped as in Hugging Face PEFT (`lora_A`, `lora_B`). The frozen product runs in the
//! weight's dtype (bf16 or f32, f32 accumulation); the adapter is f32 and its term is computed in
//! f32, as PEFT does for a bf16 model.

use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig};
use burn::tensor::{DType, Distribution, Tensor, backend::Backend};
use lemo_kernels::ComputeBackend;
use lemo_kernels::gemm::matmul;
use lemo_kernels::known_value::matmul_with_value;
use lemo_kernels::precision::{Frozen, lora_linear};
use lemo_kernels::recomputed_rows::FrozenLinear;

use crate::block_pass::untracked;
use crate::quantized::device::FrozenWeight;
use crate::random::seeded_random;

/// Every projection of a Llama layer, in PEFT's `target_modules` names.
pub const LLAMA_PROJECTIONS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// Where adapters go, how large they are, and what else trains with them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    pub dropout: f64,
    /// Projection names, as in PEFT's `target_modules`: q_proj, k_proj, v_proj, o_proj,
    /// gate_proj, up_proj, down_proj (OPT: q_proj, k_proj, v_proj, out_proj, fc1, fc2).
    pub target_modules: Vec<String>,
    /// LongLoRA's setting: token embeddings train too.
    pub train_embeddings: bool,
    /// LongLoRA's setting: normalization weights train too.
    pub train_norms: bool,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: ["q_proj", "k_proj", "v_proj", "o_proj"]
                .map(String::from)
                .to_vec(),
            train_embeddings: false,
            train_norms: false,
        }
    }
}

impl LoraConfig {
    pub fn scaling(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    pub fn targets(&self, projection: &str) -> bool {
        self.target_modules.iter().any(|m| m == projection)
    }
}

#[derive(Module, Debug)]
pub struct Lora<B: Backend> {
    /// `lora_A`: `[rank, in]`, f32, Kaiming-uniform initialized as PEFT does.
    pub a: Param<Tensor<B, 2>>,
    /// `lora_B`: `[out, rank]`, f32, zero at initialization so training starts from the base model.
    pub b: Param<Tensor<B, 2>>,
    pub scaling: f64,
    pub dropout: Dropout,
}

/// A linear projection stored as `[out, in]` (the checkpoint's layout), base weights frozen
/// (dense, or kept quantized: see [`crate::quantized`]).
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    pub weight: FrozenWeight<B>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    pub lora: Option<Lora<B>>,
}

impl<B: Backend> Linear<B> {
    pub fn new(weight: impl Into<FrozenWeight<B>>, bias: Option<Tensor<B, 1>>) -> Self {
        Self {
            weight: weight.into(),
            bias: bias.map(|b| Param::from_tensor(b).set_require_grad(false)),
            lora: None,
        }
    }

    pub fn in_features(&self) -> usize {
        self.weight.dims()[1]
    }

    pub fn out_features(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Adds a fresh adapter (A random, B zero). A is drawn on the host from `seed` and `name`
    /// (the projection's path), so that a seed gives the same adapter on every device.
    pub fn with_new_lora(self, config: &LoraConfig, name: &str, seed: u64) -> Self {
        let device = self.weight.device();
        // PEFT: kaiming_uniform_(a=sqrt(5)) on [r, in], i.e. U(-1/sqrt(in), 1/sqrt(in)).
        let bound = 1.0 / (self.in_features() as f64).sqrt();
        let values = seeded_random(
            &format!("{name}.lora_A"),
            seed,
            &[config.rank, self.in_features()],
            Distribution::Uniform(-bound, bound),
        );
        let a = Tensor::from_data(values, (&device, DType::F32));
        let b = Tensor::zeros([self.out_features(), config.rank], (&device, DType::F32));
        self.with_lora(a, b, config)
    }

    /// Attaches an adapter with the given `lora_A` and `lora_B` weights.
    pub fn with_lora(mut self, a: Tensor<B, 2>, b: Tensor<B, 2>, config: &LoraConfig) -> Self {
        self.lora = Some(Lora {
            a: Param::from_tensor(a),
            b: Param::from_tensor(b),
            scaling: config.scaling(),
            dropout: DropoutConfig::new(config.dropout).init(),
        });
        self
    }
}

impl<B: ComputeBackend> Linear<B> {
    /// This layer's parameters as the frozen map a recomputed backward pass reads.
    pub fn frozen(&self) -> FrozenLinear<B> {
        let primitive = |t: Tensor<B, 2>| t.into_primitive().tensor();
        FrozenLinear {
            weight: primitive(self.weight.val()),
            bias: self
                .bias
                .as_ref()
                .map(|b| b.val().into_primitive().tensor()),
            lora: self
                .lora
                .as_ref()
                .map(|l| (primitive(l.a.val()), primitive(l.b.val()), l.scaling)),
        }
    }

    /// This projection with a quantized weight dequantized once, for a block whose graph and
    /// recomputation both read it: they then hold one dense copy between them, not one each.
    /// A dense weight is shared as it is.
    pub fn with_dense_weight(&self) -> Self {
        match &self.weight {
            FrozenWeight::Dense(_) => self.clone(),
            FrozenWeight::Quantized(quantized) => Self {
                weight: quantized.dequantize().into(),
                bias: self.bias.clone(),
                lora: self.lora.clone(),
            },
        }
    }

    /// Folds the adapter into the base weight: `W + scaling * B A`, summed in f32 and stored
    /// dense in the weight's dtype (a quantized weight is dequantized first).
    pub fn merge_lora(mut self) -> Self {
        if let Some(lora) = self.lora.take() {
            let weight = self.weight.val();
            let dtype = weight.dtype();
            let delta = matmul(lora.b.val(), lora.a.val()).mul_scalar(lora.scaling);
            let merged = (weight.cast(DType::F32) + delta).cast(dtype);
            self.weight = merged.detach().into();
        }
        self
    }

    /// `x: [..., in] -> [..., out]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.forward_with_product(x, None)
    }

    /// The projection of every row of `x` outside the graph (the adapter read detached and
    /// without dropout: what the forward pass and token-elimination scores see), and what
    /// [`Self::forward_with_product`] takes of it for the rows it keeps: the output itself, or,
    /// where dropout makes the graph's adapter read another `x`, the frozen product. The
    /// adapter's term is added onto the frozen product in place.
    pub fn pass<const D: usize>(&self, x: Tensor<B, D>) -> (Tensor<B, D>, Tensor<B, D>) {
        let (x, out_dims) = self.rows(untracked(x));
        let base = self.frozen_product(x.clone(), self.weight.val());
        let (output, product) = match &self.lora {
            None => (base.clone(), base),
            Some(lora) => {
                let (a, b) = (untracked(lora.a.val()), untracked(lora.b.val()));
                let scale = lora.scaling as f32;
                if self.product_is_output() {
                    let output = lora_linear(x, Frozen::Graph(base), a, b, scale);
                    (output.clone(), output)
                } else {
                    (
                        lora_linear(x, Frozen::Graph(base.clone()), a, b, scale),
                        base,
                    )
                }
            }
        };
        (output.reshape(out_dims), product.reshape(out_dims))
    }

    /// [`Self::forward`] of `x`; with `product`, the rows of [`Self::pass`]'s product for the
    /// rows of `x`, the graph has the backward pass of the full projection but computes only
    /// the adapter's products (or, when `product` is the output, only `x A^T`).
    pub fn forward_with_product<const D: usize>(
        &self,
        x: Tensor<B, D>,
        product: Option<Tensor<B, D>>,
    ) -> Tensor<B, D> {
        let (x, out_dims) = self.rows(x);
        let product = product.map(|p| p.reshape([x.dims()[0], self.out_features()]));
        // One dense weight per call: a quantized one is dequantized once for all its uses here.
        let dense = self.weight.val();
        let weight = || dense.clone();
        let frozen_in_graph = |x: Tensor<B, 2>, product: Option<Tensor<B, 2>>| match product {
            Some(base) => matmul_with_value(x, weight().transpose(), base),
            None => self.frozen_product(x, weight()),
        };
        let y = match &self.lora {
            None => frozen_in_graph(x, product),
            Some(lora) => {
                let (a, b, scale) = (lora.a.val(), lora.b.val(), lora.scaling as f32);
                let frozen = match product {
                    Some(output) if self.product_is_output() => Frozen::Output(output, weight()),
                    None if self.product_is_output() => Frozen::Value(
                        self.frozen_product(untracked(x.clone()), weight()),
                        weight(),
                    ),
                    product => Frozen::Graph(frozen_in_graph(x.clone(), product)),
                };
                let x = match frozen {
                    Frozen::Graph(_) => lora.dropout.forward(x),
                    _ => x,
                };
                lora_linear(x, frozen, a, b, scale)
            }
        };
        y.reshape(out_dims)
    }

    /// Whether [`Self::pass`] keeps the output for the graph: with an adapter, unless dropout
    /// makes the graph's adapter term differ from the pass's.
    fn product_is_output(&self) -> bool {
        self.lora.as_ref().is_some_and(|l| l.dropout.prob == 0.0)
    }

    /// `x [..., in]` as `[rows, in]`, and the output's dims `[..., out]`.
    fn rows<const D: usize>(&self, x: Tensor<B, D>) -> (Tensor<B, 2>, [usize; D]) {
        let mut out_dims = x.dims();
        out_dims[D - 1] = self.out_features();
        let rows: usize = x.dims()[..D - 1].iter().product();
        (x.reshape([rows, self.in_features()]), out_dims)
    }

    /// `x W^T + bias` for `x [rows, in]` and the dense `weight`.
    fn frozen_product(&self, x: Tensor<B, 2>, weight: Tensor<B, 2>) -> Tensor<B, 2> {
        let y = matmul(x, weight.transpose());
        match &self.bias {
            Some(bias) => y + bias.val().unsqueeze_dim(0),
            None => y,
        }
    }
}
