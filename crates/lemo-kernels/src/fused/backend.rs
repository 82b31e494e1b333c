//! The fused element-wise family of backend operations (norms, RoPE, SwiGLU): every default
//! body is the plain Burn reference, CubeCL backends run the kernels of this module, and
//! `Autodiff<B>` gives each its own backward pass.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::ComputeBackend;
use crate::backend::CpuBackend;
use crate::fused::{self, rms_norm::NormSaves};

/// Fused element-wise kernels: RMSNorm and LayerNorm, RoPE, SwiGLU.
pub trait FusedBackend: Backend {
    /// RMSNorm over the last dimension; see [`fused::rms_norm`] (what it saves matters only
    /// under autodiff).
    fn lemo_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
        _saves: NormSaves,
    ) -> FloatTensor<Self> {
        Self::lemo_rms_norm_forward(x, weight, eps).0
    }

    /// RMSNorm output and the f32 reciprocal root mean square of each row (`[rows]`, the
    /// product of the leading dimensions), which the backward pass reuses.
    fn lemo_rms_norm_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        fused::rms_norm::reference::forward::<Self>(x, weight, eps)
    }

    /// `(d x, d weight)` of RMSNorm from `saved` (`x`, or the output where `saves` says so), the
    /// weight, the saved `rstd` and `d out`; the weight gradient only when `weight_grad`.
    fn lemo_rms_norm_backward(
        saved: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        weight_grad: bool,
        saves: NormSaves,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let x = saved_input::<Self>(saved, &weight, &rstd, saves);
        fused::rms_norm::reference::backward::<Self>(x, weight, rstd, grad, weight_grad)
    }

    /// Rotate-half rotary embedding at explicit positions; see [`fused::rope`]. With `inverse`
    /// the rotation goes the other way (the backward pass).
    fn lemo_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        positions: IntTensor<Self>,
        inverse: bool,
    ) -> FloatTensor<Self> {
        fused::rope::reference::rope::<Self>(x, cos, sin, positions, inverse)
    }

    /// LayerNorm with constant parameters; see [`fused::layer_norm`] (what it saves matters only
    /// under autodiff).
    fn lemo_layer_norm(
        x: FloatTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        bias: Option<FloatTensor<Self>>,
        eps: f32,
        _saves: NormSaves,
    ) -> FloatTensor<Self> {
        fused::layer_norm::reference::forward::<Self>(x, weight.as_ref(), bias.as_ref(), eps).0
    }

    /// `silu(gate) * up`; see [`fused::swiglu`].
    fn lemo_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        fused::swiglu::reference::forward::<Self>(gate, up)
    }

    /// `(d gate, d up)` of [`FusedBackend::lemo_swiglu`].
    fn lemo_swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        fused::swiglu::reference::backward::<Self>(gate, up, grad)
    }
}

impl FusedBackend for CpuBackend {}

impl<R, F, I, BT> FusedBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn lemo_rms_norm_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        fused::rms_norm::kernel::forward(x, weight, eps)
    }

    fn lemo_rms_norm_backward(
        saved: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        weight_grad: bool,
        saves: NormSaves,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let grad_weight = weight_grad.then(|| {
            let x = saved_input::<Self>(saved.clone(), &weight, &rstd, saves);
            fused::rms_norm::reference::weight_grad::<Self>(x, rstd.clone(), grad.clone())
        });
        (
            fused::rms_norm::kernel::backward(saved, weight, rstd, grad, saves),
            grad_weight,
        )
    }

    fn lemo_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        positions: IntTensor<Self>,
        inverse: bool,
    ) -> FloatTensor<Self> {
        fused::rope::kernel::rope(x, cos, sin, positions, inverse)
    }

    fn lemo_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        fused::swiglu::kernel::forward(gate, up)
    }

    fn lemo_swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        fused::swiglu::kernel::backward(gate, up, grad)
    }
}

impl<B: ComputeBackend, C: CheckpointStrategy> FusedBackend for Autodiff<B, C> {
    fn lemo_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
        saves: NormSaves,
    ) -> FloatTensor<Self> {
        fused::rms_norm::autodiff::rms_norm::<B, C>(x, weight, eps, saves)
    }

    fn lemo_rms_norm_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (out, rstd) = B::lemo_rms_norm_forward(Self::inner(x), Self::inner(weight), eps);
        (Self::from_inner(out), Self::from_inner(rstd))
    }

    fn lemo_rms_norm_backward(
        saved: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        weight_grad: bool,
        saves: NormSaves,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let (grad_x, grad_weight) = B::lemo_rms_norm_backward(
            Self::inner(saved),
            Self::inner(weight),
            Self::inner(rstd),
            Self::inner(grad),
            weight_grad,
            saves,
        );
        (Self::from_inner(grad_x), grad_weight.map(Self::from_inner))
    }

    fn lemo_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        positions: IntTensor<Self>,
        inverse: bool,
    ) -> FloatTensor<Self> {
        fused::rope::autodiff::rope::<B, C>(x, cos, sin, positions, inverse)
    }

    fn lemo_layer_norm(
        x: FloatTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        bias: Option<FloatTensor<Self>>,
        eps: f32,
        saves: NormSaves,
    ) -> FloatTensor<Self> {
        fused::layer_norm::autodiff::layer_norm::<B, C>(x, weight, bias, eps, saves)
    }

    fn lemo_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        fused::swiglu::autodiff::swiglu::<B, C>(gate, up)
    }

    fn lemo_swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (grad_gate, grad_up) =
            B::lemo_swiglu_backward(Self::inner(gate), Self::inner(up), Self::inner(grad));
        (Self::from_inner(grad_gate), Self::from_inner(grad_up))
    }
}

/// The norm's input from what its forward pass saved (see [`NormSaves`]).
pub(crate) fn saved_input<B: Backend>(
    saved: FloatTensor<B>,
    weight: &FloatTensor<B>,
    rstd: &FloatTensor<B>,
    saves: NormSaves,
) -> FloatTensor<B> {
    match saves {
        NormSaves::Input => saved,
        NormSaves::Output => {
            fused::rms_norm::input_from_output::<B>(saved, weight.clone(), rstd.clone())
        }
    }
}
