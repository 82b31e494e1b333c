//! The exact backward pass of a frozen pre-norm MLP block on rows its graph leaves out,
//! recomputed from those rows alone.
//!
//! A token-sparse block keeps only its kept rows in the graph. Through an MLP block whose weights
//! are frozen the only gradient a dropped row needs is the block's input gradient,
//! `d x += J_t^T d y` with `J_t` the Jacobian of `mlp(norm(x_t))`. Saving the MLP's activations
//! for those rows would give back the memory sparsity saves; [`with_recomputed_rows`] saves the
//! dropped rows of the block's input instead (`rows x hidden`) and, in the backward pass,
//! recomputes the norm and the input projections from them, then back-propagates through the
//! activation, the input projections and the norm:
//!
//! ```text
//! n = norm(x_t),  p_i = n W_i^T + b_i,  d a = d y W_out,  d p_i = d a * slope_i(p),
//! d n = sum_i d p_i W_i,  d x_t = norm'(x_t)^T d n
//! ```
//!
//! Five GEMMs of `rows x hidden x ffn` for SwiGLU (three for ReLU): about the block's own forward
//! pass plus its input projections, on the dropped rows, a chunk of rows at a time so the
//! recomputed activations never exist for every row at once. LoRA adapters on the projections
//! take part in the input gradient; their own weight gradients come from the kept rows only.

pub(crate) mod autodiff;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Int, Tensor, TensorPrimitive};

use crate::ComputeBackend;
use crate::fused::NormSaves;
use crate::gemm::matmul;
use crate::precision::{Frozen, lora_linear};

/// The activation between an MLP's input and output projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpActivation {
    /// `silu(gate) * up`: inputs `[gate, up]`.
    SwiGlu,
    /// `relu(fc1)`: inputs `[fc1]`.
    Relu,
}

/// A linear map `y = x W^T + b + s (x A^T) B^T` (`W: [out, in]`, the adapter in PEFT's layout),
/// as primitives of backend `B`; nothing here receives a gradient.
#[derive(Debug, Clone)]
pub struct FrozenLinear<B: Backend> {
    pub weight: FloatTensor<B>,
    pub bias: Option<FloatTensor<B>>,
    /// `(A [r, in], B [out, r], s)`.
    pub lora: Option<(FloatTensor<B>, FloatTensor<B>, f64)>,
}

/// The norm in front of the MLP.
#[derive(Debug, Clone)]
pub enum FrozenNorm<B: Backend> {
    Rms {
        weight: FloatTensor<B>,
        eps: f64,
    },
    Layer {
        weight: Option<FloatTensor<B>>,
        bias: Option<FloatTensor<B>>,
        eps: f64,
    },
}

/// A pre-norm MLP block `mlp(norm(x))` with frozen parameters.
#[derive(Debug, Clone)]
pub struct FrozenMlp<B: Backend> {
    pub norm: FrozenNorm<B>,
    pub activation: MlpActivation,
    /// The input projections, in the order [`MlpActivation`] names them.
    pub inputs: Vec<FrozenLinear<B>>,
    pub output: FrozenLinear<B>,
}

/// Elements of one chunk's widest recomputed activation (`chunk rows x ffn`): a few hundred MiB
/// in bf16 at Llama-2-7B's width, whatever the number of dropped rows.
pub(crate) const CHUNK_ELEMENTS: usize = 1 << 25;

fn wrap<B: Backend, const D: usize>(tensor: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(tensor))
}

fn primitive<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> FloatTensor<B> {
    tensor.into_primitive().tensor()
}

/// `x` in the forward pass; in the backward pass its gradient plus, on the rows `rows`
/// (`[batch, n]` of `x: [batch, seq, hidden]`), the input gradient of `mlp` there: the rows'
/// backward pass through the whole residual block `x + mlp(norm(x))`, from those rows of `x`
/// (the only thing saved) by recomputation. See the module docs for the cost.
pub fn with_recomputed_rows<B: ComputeBackend>(
    x: Tensor<B, 3>,
    rows: Tensor<B, 2, Int>,
    mlp: FrozenMlp<B>,
) -> Tensor<B, 3> {
    wrap(B::lemo_with_recomputed_rows(
        primitive(x),
        rows.into_primitive(),
        mlp,
    ))
}

impl<B: ComputeBackend> FrozenLinear<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let dtype = x.dtype();
        let weight: Tensor<B, 2> = wrap(self.weight.clone());
        let mut y = matmul(x.clone(), weight.transpose());
        if let Some(bias) = &self.bias {
            y = y + wrap::<B, 1>(bias.clone()).cast(dtype).unsqueeze();
        }
        if let Some((a, b, scale)) = &self.lora {
            y = lora_linear(
                x,
                Frozen::Graph(y),
                wrap(a.clone()),
                wrap(b.clone()),
                *scale as f32,
            );
        }
        y
    }

    /// `d x = d y W + s (d y B) A`: the adapter's term is the LoRA update with `A` and `B`
    /// swapped and transposed.
    fn input_gradient(&self, grad: Tensor<B, 2>) -> Tensor<B, 2> {
        let mut grad_x = matmul(grad.clone(), wrap(self.weight.clone()));
        if let Some((a, b, scale)) = &self.lora {
            let (a, b): (Tensor<B, 2>, Tensor<B, 2>) = (wrap(a.clone()), wrap(b.clone()));
            grad_x = lora_linear(
                grad,
                Frozen::Graph(grad_x),
                b.transpose(),
                a.transpose(),
                *scale as f32,
            );
        }
        grad_x
    }
}

impl<B: ComputeBackend> FrozenNorm<B> {
    /// The norm's input gradient on the rows `x: [rows, hidden]` for `d out`.
    fn input_gradient(
        &self,
        x: Tensor<B, 2>,
        forward: impl FnOnce(Tensor<B, 2>) -> Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        match self {
            FrozenNorm::Rms { weight, eps } => {
                let dtype = x.dtype();
                let weight = primitive(wrap::<B, 1>(weight.clone()).cast(dtype));
                let (out, rstd) =
                    B::lemo_rms_norm_forward(primitive(x.clone()), weight.clone(), *eps as f32);
                let grad = forward(wrap(out));
                let (grad_x, _) = B::lemo_rms_norm_backward(
                    primitive(x),
                    weight,
                    rstd,
                    primitive(grad),
                    false,
                    NormSaves::Input,
                );
                wrap(grad_x)
            }
            FrozenNorm::Layer { weight, bias, eps } => {
                // `x_hat = (x - mean) r`, `y = x_hat w + b`:
                // `d x = r (g - mean(g) - x_hat mean(g x_hat))` with `g = w d y`.
                let dtype = x.dtype();
                let [_, hidden] = x.dims();
                let x = x.cast(DType::F32);
                let centered = x.clone() - x.mean_dim(1);
                let rstd = centered
                    .clone()
                    .square()
                    .mean_dim(1)
                    .add_scalar(*eps)
                    .sqrt()
                    .recip();
                let normalized = centered * rstd.clone();
                let vector = |t: &FloatTensor<B>| wrap::<B, 1>(t.clone()).cast(DType::F32);
                let mut out = normalized.clone();
                if let Some(weight) = weight {
                    out = out * vector(weight).unsqueeze();
                }
                if let Some(bias) = bias {
                    out = out + vector(bias).unsqueeze();
                }
                let mut grad = forward(out.cast(dtype)).cast(DType::F32);
                if let Some(weight) = weight {
                    grad = grad * vector(weight).unsqueeze();
                }
                let grad_mean = grad.clone().sum_dim(1) / hidden as f32;
                let projection = (grad.clone() * normalized.clone()).sum_dim(1) / hidden as f32;
                (rstd * (grad - grad_mean - normalized * projection)).cast(dtype)
            }
        }
    }
}

impl<B: ComputeBackend> FrozenMlp<B> {
    fn ffn(&self) -> usize {
        wrap::<B, 2>(self.output.weight.clone()).dims()[1]
    }

    /// `J^T d y` on rows `x: [rows, hidden]` with output gradients `grad: [rows, hidden]`.
    fn rows_input_gradient(&self, x: Tensor<B, 2>, grad: Tensor<B, 2>) -> Tensor<B, 2> {
        self.norm.input_gradient(x, |normed| {
            let grad_activation = self.output.input_gradient(grad);
            let pre: Vec<Tensor<B, 2>> = self
                .inputs
                .iter()
                .map(|linear| linear.forward(normed.clone()))
                .collect();
            let grad_pre: Vec<Tensor<B, 2>> = match (self.activation, pre.as_slice()) {
                (MlpActivation::SwiGlu, [gate, up]) => {
                    let (grad_gate, grad_up) = B::lemo_swiglu_backward(
                        primitive(gate.clone()),
                        primitive(up.clone()),
                        primitive(grad_activation),
                    );
                    vec![wrap(grad_gate), wrap(grad_up)]
                }
                (MlpActivation::Relu, [fc1]) => {
                    vec![grad_activation.mask_fill(fc1.clone().lower_equal_elem(0.0), 0.0)]
                }
                (activation, pre) => {
                    panic!("{activation:?} with {} input projections", pre.len())
                }
            };
            drop(pre);
            self.inputs
                .iter()
                .zip(grad_pre)
                .map(|(linear, grad)| linear.input_gradient(grad))
                .reduce(|sum, term| sum + term)
                .expect("an MLP has an input projection")
        })
    }

    /// [`Self::rows_input_gradient`] on `x, grad: [batch, n, hidden]`, chunks of rows of at
    /// most `chunk_elements` recomputed activations at a time.
    pub(crate) fn input_gradient(
        &self,
        x: Tensor<B, 3>,
        grad: Tensor<B, 3>,
        chunk_elements: usize,
    ) -> Tensor<B, 3> {
        let [batch, n, hidden] = x.dims();
        let rows = batch * n;
        let x = x.reshape([rows, hidden]);
        let grad = grad.reshape([rows, hidden]).cast(x.dtype());
        let chunk = (chunk_elements / self.ffn().max(1)).max(1);
        let chunks: Vec<Tensor<B, 2>> = (0..rows)
            .step_by(chunk)
            .map(|start| {
                let end = (start + chunk).min(rows);
                self.rows_input_gradient(
                    x.clone().narrow(0, start, end - start),
                    grad.clone().narrow(0, start, end - start),
                )
            })
            .collect();
        Tensor::cat(chunks, 0).reshape([batch, n, hidden])
    }
}

/// The block written with Burn tensor operations, differentiated by Burn: what the tests compare
/// [`with_recomputed_rows`] with (`mlp(norm(x))` for `x: [.., hidden]`).
pub fn reference<B: ComputeBackend, const D: usize>(
    x: Tensor<B, D>,
    mlp: &FrozenMlp<B>,
) -> Tensor<B, D> {
    let vector = |t: &FloatTensor<B>| wrap::<B, 1>(t.clone());
    let matrix = |t: &FloatTensor<B>| wrap::<B, 2>(t.clone());
    let normed = match &mlp.norm {
        FrozenNorm::Rms { weight, eps } => {
            let rms = x.clone().square().mean_dim(D - 1).add_scalar(*eps).sqrt();
            x / rms * vector(weight).unsqueeze()
        }
        FrozenNorm::Layer { weight, bias, eps } => {
            let centered = x.clone() - x.mean_dim(D - 1);
            let std = centered
                .clone()
                .square()
                .mean_dim(D - 1)
                .add_scalar(*eps)
                .sqrt();
            let mut y = centered / std;
            if let Some(weight) = weight {
                y = y * vector(weight).unsqueeze();
            }
            if let Some(bias) = bias {
                y = y + vector(bias).unsqueeze();
            }
            y
        }
    };
    let linear = |x: Tensor<B, D>, linear: &FrozenLinear<B>| {
        let mut y = x
            .clone()
            .matmul(matrix(&linear.weight).transpose().unsqueeze());
        if let Some(bias) = &linear.bias {
            y = y + vector(bias).unsqueeze();
        }
        if let Some((a, b, scale)) = &linear.lora {
            let down = x.matmul(matrix(a).transpose().unsqueeze());
            y = y + down.matmul(matrix(b).transpose().unsqueeze()) * *scale;
        }
        y
    };
    let activation = match mlp.activation {
        MlpActivation::SwiGlu => {
            let gate = linear(normed.clone(), &mlp.inputs[0]);
            burn::tensor::activation::silu(gate) * linear(normed, &mlp.inputs[1])
        }
        MlpActivation::Relu => burn::tensor::activation::relu(linear(normed, &mlp.inputs[0])),
    };
    linear(activation, &mlp.output)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;
    use burn::tensor::Distribution;

    /// Chunks of rows give what one chunk of every row gives.
    #[test]
    fn chunks_of_rows_add_up_to_the_whole() {
        let device = Default::default();
        let (hidden, ffn) = (6, 10);
        let random = |shape: [usize; 2]| {
            primitive(Tensor::<CpuBackend, 2>::random(
                shape,
                Distribution::Normal(0.0, 1.0),
                &device,
            ))
        };
        let linear = |out, input| FrozenLinear {
            weight: random([out, input]),
            bias: None,
            lora: None,
        };
        let mlp = FrozenMlp::<CpuBackend> {
            norm: FrozenNorm::Rms {
                weight: primitive(Tensor::<CpuBackend, 1>::ones([hidden], &device)),
                eps: 1e-5,
            },
            activation: MlpActivation::SwiGlu,
            inputs: vec![linear(ffn, hidden), linear(ffn, hidden)],
            output: linear(hidden, ffn),
        };
        let x: Tensor<CpuBackend, 3> =
            wrap::<CpuBackend, 2>(random([14, hidden])).reshape([2, 7, hidden]);
        let grad: Tensor<CpuBackend, 3> =
            wrap::<CpuBackend, 2>(random([14, hidden])).reshape([2, 7, hidden]);
        let whole = mlp.input_gradient(x.clone(), grad.clone(), usize::MAX);
        let chunked = mlp.input_gradient(x, grad, 3 * ffn);
        whole.into_data().assert_approx_eq::<f32>(
            &chunked.into_data(),
            burn::tensor::Tolerance::absolute(1e-6),
        );
    }
}
