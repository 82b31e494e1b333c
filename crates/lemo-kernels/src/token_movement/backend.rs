//! The token-movement family of backend operations: every default body is the plain Burn
//! reference, CubeCL backends run the kernels of this module, and `Autodiff<B>` gives each its
//! own backward pass.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::TensorMetadata;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::ComputeBackend;
use crate::backend::CpuBackend;
use crate::fused::backend::{FusedBackend, saved_input};
use crate::fused::{self, rms_norm::NormSaves};
use crate::recomputed_rows::{self, FrozenMlp};
use crate::token_movement;

/// Moving token rows: gathering the kept rows (fused with the RMSNorm before a block),
/// scattering gradients back, and the MLP's recomputed dropped rows.
pub trait TokenMovementBackend: FusedBackend {
    /// RMSNorm of the rows `rows [batch, kept]` of `x [batch, seq, hidden]`; see
    /// [`token_movement::gather_rms_norm`] (what it saves matters only under autodiff).
    fn lemo_gather_rms_norm(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
        _saves: NormSaves,
    ) -> FloatTensor<Self> {
        token_movement::reference::gather_rms_norm_primitive::<Self>(x, rows, weight, eps)
    }

    /// Gather-RMSNorm output, the f32 `rstd` of each kept row (`[batch * kept]`) and, with
    /// `save_input`, a copy of the kept input rows (`[batch, kept, hidden]`): all the backward
    /// pass needs, so `x` itself need not be kept.
    fn lemo_gather_rms_norm_forward(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
        save_input: bool,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        let kept = Self::lemo_gather_rows(x, rows);
        let (out, rstd) = Self::lemo_rms_norm_forward(kept.clone(), weight, eps);
        (out, rstd, save_input.then_some(kept))
    }

    /// `(d x, d weight)` of gather-RMSNorm from the saved kept rows (or the output, where `saves`
    /// says so), the rows, the weight, `rstd` and `d out`: `d x` is `grad_x` (the gradient `x`
    /// already has, `[batch, seq, hidden]`, or zeros without it) with the RMSNorm gradient of
    /// each kept row added into its row; the weight gradient only when `weight_grad`.
    #[allow(clippy::too_many_arguments)]
    fn lemo_gather_rms_norm_backward(
        kept: FloatTensor<Self>,
        rows: IntTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        grad_x: Option<FloatTensor<Self>>,
        seq: usize,
        weight_grad: bool,
        saves: NormSaves,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let grad_x = grad_x.unwrap_or_else(|| {
            let [batch, _, hidden] = kept.shape().dims();
            Self::float_zeros(
                [batch, seq, hidden].into(),
                &Self::float_device(&kept),
                kept.dtype().into(),
            )
        });
        let (grad_kept, grad_weight) =
            Self::lemo_rms_norm_backward(kept, weight, rstd, grad, weight_grad, saves);
        (
            Self::lemo_scatter_add_rows(grad_x, rows, grad_kept),
            grad_weight,
        )
    }

    /// `x` with `values [batch, kept, hidden]` added into its rows `rows`; see
    /// [`token_movement::scatter_add_rows`].
    fn lemo_scatter_add_rows(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        values: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        token_movement::reference::scatter_add_rows_primitive::<Self>(x, rows, values)
    }

    /// The rows `rows [batch, kept]` of `x [batch, seq, width]`; see
    /// [`token_movement::gather_rows`].
    fn lemo_gather_rows(x: FloatTensor<Self>, rows: IntTensor<Self>) -> FloatTensor<Self> {
        token_movement::reference::gather_rows_primitive::<Self>(x, rows)
    }

    /// `x`, whose backward pass adds `mlp`'s input gradient into the rows `rows`, recomputed
    /// there; see [`recomputed_rows::with_recomputed_rows`].
    fn lemo_with_recomputed_rows(
        x: FloatTensor<Self>,
        _rows: IntTensor<Self>,
        _mlp: FrozenMlp<Self>,
    ) -> FloatTensor<Self> {
        x
    }
}

impl TokenMovementBackend for CpuBackend {}

impl<R, F, I, BT> TokenMovementBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn lemo_gather_rms_norm(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
        _saves: NormSaves,
    ) -> FloatTensor<Self> {
        token_movement::kernel::gather_rms_norm(x, rows, weight, eps, false).0
    }

    fn lemo_gather_rms_norm_forward(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
        save_input: bool,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        token_movement::kernel::gather_rms_norm(x, rows, weight, eps, save_input)
    }

    fn lemo_gather_rms_norm_backward(
        kept: FloatTensor<Self>,
        rows: IntTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        grad_x: Option<FloatTensor<Self>>,
        seq: usize,
        weight_grad: bool,
        saves: NormSaves,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let grad_weight = weight_grad.then(|| {
            let x = saved_input::<Self>(kept.clone(), &weight, &rstd, saves);
            fused::rms_norm::reference::weight_grad::<Self>(x, rstd.clone(), grad.clone())
        });
        let grad_x = token_movement::kernel::gather_rms_norm_backward(
            kept, rows, weight, rstd, grad, grad_x, seq, saves,
        );
        (grad_x, grad_weight)
    }

    fn lemo_scatter_add_rows(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        values: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        token_movement::kernel::scatter_add_rows(x, rows, values)
    }

    fn lemo_gather_rows(x: FloatTensor<Self>, rows: IntTensor<Self>) -> FloatTensor<Self> {
        token_movement::kernel::gather_rows(x, rows)
    }
}

impl<B: ComputeBackend, C: CheckpointStrategy> TokenMovementBackend for Autodiff<B, C> {
    fn lemo_gather_rms_norm(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
        saves: NormSaves,
    ) -> FloatTensor<Self> {
        token_movement::autodiff::gather_rms_norm::<B, C>(x, rows, weight, eps, saves)
    }

    fn lemo_gather_rms_norm_forward(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
        save_input: bool,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        let (out, rstd, kept) = B::lemo_gather_rms_norm_forward(
            Self::inner(x),
            rows,
            Self::inner(weight),
            eps,
            save_input,
        );
        (
            Self::from_inner(out),
            Self::from_inner(rstd),
            kept.map(Self::from_inner),
        )
    }

    fn lemo_gather_rms_norm_backward(
        kept: FloatTensor<Self>,
        rows: IntTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        grad_x: Option<FloatTensor<Self>>,
        seq: usize,
        weight_grad: bool,
        saves: NormSaves,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let (grad_x, grad_weight) = B::lemo_gather_rms_norm_backward(
            Self::inner(kept),
            rows,
            Self::inner(weight),
            Self::inner(rstd),
            Self::inner(grad),
            grad_x.map(Self::inner),
            seq,
            weight_grad,
            saves,
        );
        (Self::from_inner(grad_x), grad_weight.map(Self::from_inner))
    }

    fn lemo_scatter_add_rows(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        values: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        token_movement::autodiff::scatter_add_rows::<B, C>(x, rows, values)
    }

    fn lemo_gather_rows(x: FloatTensor<Self>, rows: IntTensor<Self>) -> FloatTensor<Self> {
        token_movement::autodiff::gather_rows::<B, C>(x, rows)
    }

    fn lemo_with_recomputed_rows(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        mlp: FrozenMlp<Self>,
    ) -> FloatTensor<Self> {
        recomputed_rows::autodiff::with_recomputed_rows::<B, C>(x, rows, mlp)
    }
}
