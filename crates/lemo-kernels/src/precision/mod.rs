//! Mixed-precision policy of LoRA training, as PEFT applies it to a bf16 model:
//! frozen weights and activations in bf16; LoRA parameters, their gradients and the optimizer
//! state in f32; reductions (norms, softmax, losses, GEMM accumulation) in f32 whatever the
//! storage type. The kernels of this crate follow it: every fused kernel loads its storage type
//! and computes in f32, GEMMs accumulate in f32 (cuBLASLt `COMPUTE_32F`), the loss is f32.
//! The adapters' products read the activations as stored, with `A` and `B` rounded to meet them
//! (as PyTorch's bf16 autocast does; see [`lora_linear`]).

pub(crate) mod autodiff;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, Tensor, TensorMetadata, TensorPrimitive};

use crate::{ComputeBackend, GemmBackend};

/// Storage types of the four kinds of tensor a LoRA step holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    /// Pretrained weights (never updated).
    pub frozen: DType,
    /// Hidden states, attention and MLP activations, and their gradients.
    pub activations: DType,
    /// LoRA `A` and `B` (and their gradients).
    pub trainable: DType,
    /// Optimizer moments.
    pub optimizer: DType,
}

impl Precision {
    /// bf16 model, f32 adapters and optimizer: the policy PEFT uses and ours.
    pub const MIXED_BF16: Self = Self {
        frozen: DType::BF16,
        activations: DType::BF16,
        trainable: DType::F32,
        optimizer: DType::F32,
    };

    /// Everything in f32 (CPU tests, references).
    pub const F32: Self = Self {
        frozen: DType::F32,
        activations: DType::F32,
        trainable: DType::F32,
        optimizer: DType::F32,
    };
}

/// The frozen part of a LoRA projection `y = x W^T (+ bias) + scale * (x A^T) B^T`, as
/// [`lora_linear`] takes it.
pub enum Frozen<B: Backend, const D: usize> {
    /// `x W^T (+ bias)` as a tensor of the graph: it receives `d y` unchanged (with dropout,
    /// where the adapter reads another `x` than the frozen product).
    Graph(Tensor<B, D>),
    /// `x W^T (+ bias)` computed outside the graph, and the frozen `W [out, in]`: the backward
    /// pass is that of the whole projection, `d x = d y W + scale (d y B) A`, the adapter's part
    /// added in the epilogue of `d y W`'s product.
    Value(Tensor<B, D>, Tensor<B, 2>),
    /// The whole output `y` computed outside the graph (without dropout), and `W`: as `Value`,
    /// but the forward pass computes only `x A^T`, which the backward pass needs.
    Output(Tensor<B, D>, Tensor<B, 2>),
}

/// A linear layer with a LoRA adapter: `frozen + scale * (x A^T) B^T` for `x [.., in]` in the
/// activation dtype, the frozen part `[.., out]` (see [`Frozen`]) and f32 `a [r, in]`,
/// `b [out, r]` (PEFT's layout), returned in the frozen part's dtype. The adapter's second
/// product adds the frozen part in its epilogue (one rounding, no separate addition). Each
/// product reads the large operand (`x`, or the output gradient) as stored, in one pass, and
/// accumulates in f32; the small ones (`A`, `B` and the rank-`r` intermediate `x A^T`) are
/// rounded to the activation dtype to meet it, as under PyTorch's bf16 autocast. The
/// intermediate and the adapters' gradients stay f32. With f32 activations every step is f32.
/// Differentiable in `x`, `a` and `b`; under autodiff it keeps `x` as it came (usually the
/// tensor the frozen projection reads too), the f32 `x A^T` and `W`.
pub fn lora_linear<B: ComputeBackend, const D: usize>(
    x: Tensor<B, D>,
    frozen: Frozen<B, D>,
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    scale: f32,
) -> Tensor<B, D> {
    let primitive = |t: Tensor<B, D>| t.into_primitive().tensor();
    let weight = |w: Tensor<B, 2>| Some(w.into_primitive().tensor());
    let (frozen, weight, whole) = match frozen {
        Frozen::Graph(frozen) => (primitive(frozen), None, false),
        Frozen::Value(frozen, w) => (primitive(frozen), weight(w), false),
        Frozen::Output(output, w) => (primitive(output), weight(w), true),
    };
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_lora_linear(
        primitive(x),
        frozen,
        weight,
        whole,
        a.into_primitive().tensor(),
        b.into_primitive().tensor(),
        scale,
    )))
}

/// [`lora_linear`] in Burn tensor operations, differentiated by Burn: what the tests compare
/// with. With a weight, the value given is ignored and `x W^T` is computed in the graph.
pub fn lora_linear_reference<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    frozen: Frozen<B, D>,
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    scale: f32,
) -> Tensor<B, D> {
    let frozen = match frozen {
        Frozen::Graph(frozen) => frozen,
        Frozen::Value(value, weight) | Frozen::Output(value, weight) => x
            .clone()
            .matmul(weight.transpose().unsqueeze::<D>())
            .cast(value.dtype()),
    };
    let dtype = frozen.dtype();
    let x = x.cast(a.dtype());
    let down = x.matmul(a.transpose().unsqueeze::<D>());
    let delta = down.matmul(b.transpose().unsqueeze::<D>()) * scale;
    (frozen.cast(delta.dtype()) + delta).cast(dtype)
}

/// `x [.., in]` as `[rows, in]`.
fn rows<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let shape = x.shape();
    let width = shape[shape.num_dims() - 1];
    B::float_reshape(x, Shape::new([shape.num_elements() / width, width]))
}

/// The output of [`lora_linear`] and `down = x A^T` (`[rows, r]`, the adapter's dtype), which
/// the backward pass reuses: two products of rank `r`, O(rows * r * (in + out)), the second
/// adding `frozen` as it writes; with `whole`, `frozen` is the output and only `down` is
/// computed.
pub(crate) fn lora_linear_forward<B: GemmBackend>(
    x: FloatTensor<B>,
    frozen: FloatTensor<B>,
    whole: bool,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    scale: f32,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let out_shape = frozen.shape();
    let (dtype, adapter) = (x.dtype(), a.dtype());
    let to_activations = |t: FloatTensor<B>| B::float_cast(t, dtype.into());
    let down = B::lemo_matmul_scaled(
        rows::<B>(x),
        B::float_transpose(to_activations(a)),
        1.0,
        adapter,
    );
    if whole {
        return (frozen, down);
    }
    let out = B::lemo_matmul_onto(
        to_activations(down.clone()),
        B::float_transpose(to_activations(b)),
        scale,
        rows::<B>(frozen),
    );
    (B::float_reshape(out, out_shape), down)
}

/// `(d x, d a, d b)` of [`lora_linear`] from the saved `x`, `a`, `b`, `down`, the frozen
/// `weight` if any and `d out`, each when asked for: four products of rank `r`, each reading `x`
/// or `d out` once as stored, and with `weight` the product `d out W` that the adapter's part of
/// `d x` is added onto.
pub(crate) fn lora_linear_backward<B: GemmBackend>(
    [x, a, b, down]: [FloatTensor<B>; 4],
    weight: Option<FloatTensor<B>>,
    grad: FloatTensor<B>,
    scale: f32,
    [want_x, want_a, want_b]: [bool; 3],
) -> [Option<FloatTensor<B>>; 3] {
    let (x_shape, dtype, adapter) = (x.shape(), x.dtype(), a.dtype());
    let to_activations = |t: FloatTensor<B>| B::float_cast(t, dtype.into());
    let grad = rows::<B>(grad);
    let grad_b = want_b.then(|| {
        let down = to_activations(down);
        B::lemo_matmul_scaled(B::float_transpose(grad.clone()), down, scale, adapter)
    });
    let frozen_grad_x = weight
        .filter(|_| want_x)
        .map(|weight| B::lemo_matmul(grad.clone(), weight));
    let grad_down = (want_x || want_a).then(|| {
        to_activations(B::lemo_matmul_scaled(
            grad,
            to_activations(b),
            scale,
            adapter,
        ))
    });
    let grad_a = grad_down.clone().filter(|_| want_a).map(|grad_down| {
        B::lemo_matmul_scaled(B::float_transpose(grad_down), rows::<B>(x), 1.0, adapter)
    });
    let grad_x = grad_down.filter(|_| want_x).map(|grad_down| {
        let grad_x = match frozen_grad_x {
            Some(onto) => B::lemo_matmul_onto(grad_down, to_activations(a), 1.0, onto),
            None => B::lemo_matmul_scaled(grad_down, to_activations(a), 1.0, dtype),
        };
        B::float_reshape(grad_x, x_shape)
    });
    [grad_x, grad_a, grad_b]
}
