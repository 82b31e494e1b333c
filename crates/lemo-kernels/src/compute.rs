//! The compute half of the backend extension: GEMM, fused element-wise kernels, token movement,
//! the optimizer step and device memory (the loss is its own family, [`crate::loss::LossBackend`]).
//! Every default body is the plain Burn reference; CubeCL backends override the kernels, CUDA
//! adds cuBLASLt, and `Autodiff<B>` gives each differentiable operation its own backward.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::backend::CpuBackend;
use crate::fused::rms_norm::NormSaves;
use crate::memory::{self, MemoryStats};
use crate::recomputed_rows::{self, FrozenMlp};
use crate::{fused, gemm, known_value, precision, token_movement};

/// Backend operations for the dense parts of a training step (see the module docs).
pub trait ComputeBackend: Backend {
    /// `lhs [.., M, K] x rhs [.., K, N]`; see [`gemm::matmul`].
    fn lemo_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(lhs, rhs)
    }

    /// `alpha * lhs x rhs` for operands of one dtype, accumulated in f32 and written in
    /// `out_dtype`; see [`gemm::matmul_scaled_reference`]. Not differentiable: the adapters' own forward
    /// and backward passes are built from it.
    fn lemo_matmul_scaled(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        alpha: f32,
        out_dtype: DType,
    ) -> FloatTensor<Self> {
        gemm::matmul_scaled_reference::<Self>(lhs, rhs, alpha, out_dtype)
    }

    /// `onto + alpha * lhs x rhs` in `onto`'s dtype (`onto` of the product's shape), summed in
    /// f32; see [`gemm::matmul_onto_reference`]. Not differentiable, like
    /// [`Self::lemo_matmul_scaled`].
    fn lemo_matmul_onto(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        alpha: f32,
        onto: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        gemm::matmul_onto_reference::<Self>(lhs, rhs, alpha, onto)
    }

    /// `value`, the product `lhs x rhs` computed earlier; see [`known_value::matmul_with_value`].
    fn lemo_matmul_with_value(
        _lhs: FloatTensor<Self>,
        _rhs: FloatTensor<Self>,
        value: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        value
    }

    /// `value`, differentiated as `graph`; see [`known_value::with_value`].
    fn lemo_with_value(_graph: FloatTensor<Self>, value: FloatTensor<Self>) -> FloatTensor<Self> {
        value
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

    /// `frozen + scale * (x A^T) B^T` (`frozen` itself when `whole`), with the backward pass
    /// of the whole projection when the frozen `weight` is given; see
    /// [`precision::lora_linear`].
    fn lemo_lora_linear(
        x: FloatTensor<Self>,
        frozen: FloatTensor<Self>,
        _weight: Option<FloatTensor<Self>>,
        whole: bool,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        precision::lora_linear_forward::<Self>(x, frozen, whole, a, b, scale).0
    }

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

    /// `(d gate, d up)` of [`ComputeBackend::lemo_swiglu`].
    fn lemo_swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        fused::swiglu::reference::backward::<Self>(gate, up, grad)
    }

    /// One AdamW update: the new `(param, exp_avg, exp_avg_sq)` from the parameter, its gradient
    /// and its moments (absent before the first update); see [`fused::adamw_step`].
    fn lemo_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        exp_avg: Option<FloatTensor<Self>>,
        exp_avg_sq: Option<FloatTensor<Self>>,
        step: fused::AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        fused::adamw::reference::adamw_step::<Self>(param, grad, exp_avg, exp_avg_sq, step)
    }

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

    /// Current memory of `device`; see [`crate::memory`]. Zeros where the backend has no pools.
    fn lemo_memory_stats(_device: &Self::Device) -> MemoryStats {
        MemoryStats::default()
    }

    /// Releases cached device memory; see [`crate::memory::memory_cleanup`].
    fn lemo_memory_cleanup(_device: &Self::Device) {}

    /// Largest buffer the device's memory pool cuts from small pages; see
    /// [`crate::memory::pooled_buffer_limit`].
    fn lemo_pooled_buffer_limit(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// Waits until all work queued on `device` is done, cuBLASLt products included.
    fn lemo_synchronize(device: &Self::Device) {
        Self::sync(device).expect("device synchronization");
    }
}

impl ComputeBackend for CpuBackend {}

impl<R, F, I, BT> ComputeBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn lemo_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(out) = gemm::cublaslt::try_matmul(&lhs, &rhs) {
            return out;
        }
        Self::float_matmul(lhs, rhs)
    }

    fn lemo_matmul_scaled(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        alpha: f32,
        out_dtype: DType,
    ) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(out) = gemm::cublaslt::try_matmul_scaled(&lhs, &rhs, alpha, out_dtype) {
            return out;
        }
        gemm::matmul_scaled_reference::<Self>(lhs, rhs, alpha, out_dtype)
    }

    fn lemo_matmul_onto(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        alpha: f32,
        onto: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        let onto = match gemm::cublaslt::try_matmul_onto(&lhs, &rhs, alpha, onto) {
            Ok(out) => return out,
            Err(onto) => onto,
        };
        gemm::matmul_onto_reference::<Self>(lhs, rhs, alpha, onto)
    }

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

    fn lemo_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        exp_avg: Option<FloatTensor<Self>>,
        exp_avg_sq: Option<FloatTensor<Self>>,
        step: fused::AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        fused::adamw::kernel::adamw_step(param, grad, exp_avg, exp_avg_sq, step)
    }

    fn lemo_memory_stats(device: &Self::Device) -> MemoryStats {
        memory::cube_stats::<R>(device)
    }

    fn lemo_memory_cleanup(device: &Self::Device) {
        memory::cube_cleanup::<R>(device)
    }

    fn lemo_pooled_buffer_limit(device: &Self::Device) -> Option<u64> {
        memory::cube_pooled_buffer_limit::<R>(device)
    }

    fn lemo_synchronize(device: &Self::Device) {
        memory::cube_synchronize::<R>(device)
    }
}

impl<B: ComputeBackend, C: CheckpointStrategy> ComputeBackend for Autodiff<B, C> {
    fn lemo_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        gemm::autodiff::matmul::<B, C>(lhs, rhs)
    }

    // Not differentiable: the inner backend's product, with no graph.
    fn lemo_matmul_scaled(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        alpha: f32,
        out_dtype: DType,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::lemo_matmul_scaled(
            Self::inner(lhs),
            Self::inner(rhs),
            alpha,
            out_dtype,
        ))
    }

    fn lemo_matmul_with_value(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        value: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        known_value::autodiff::matmul_with_value::<B, C>(lhs, rhs, value)
    }

    fn lemo_with_value(graph: FloatTensor<Self>, value: FloatTensor<Self>) -> FloatTensor<Self> {
        known_value::autodiff::with_value::<B, C>(graph, value)
    }

    fn lemo_with_recomputed_rows(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        mlp: FrozenMlp<Self>,
    ) -> FloatTensor<Self> {
        recomputed_rows::autodiff::with_recomputed_rows::<B, C>(x, rows, mlp)
    }

    fn lemo_lora_linear(
        x: FloatTensor<Self>,
        frozen: FloatTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        whole: bool,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        precision::autodiff::lora_linear::<B, C>(x, frozen, weight, whole, a, b, scale)
    }

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

    fn lemo_memory_stats(device: &Self::Device) -> MemoryStats {
        B::lemo_memory_stats(device)
    }

    fn lemo_memory_cleanup(device: &Self::Device) {
        B::lemo_memory_cleanup(device)
    }

    fn lemo_pooled_buffer_limit(device: &Self::Device) -> Option<u64> {
        B::lemo_pooled_buffer_limit(device)
    }

    fn lemo_synchronize(device: &Self::Device) {
        B::lemo_synchronize(device)
    }
}

/// The norm's input from what its forward pass saved (see [`NormSaves`]).
fn saved_input<B: Backend>(
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
