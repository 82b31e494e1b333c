//! The optimizer family of backend operations: AdamW's update as the plain Burn reference, or
//! one fused kernel on CubeCL backends. `Autodiff<B>` keeps the reference: an update is never
//! differentiated.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::ComputeBackend;
use crate::backend::CpuBackend;
use crate::fused;

/// The optimizer's update.
pub trait OptimizerBackend: Backend {
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
}

impl OptimizerBackend for CpuBackend {}

impl<R, F, I, BT> OptimizerBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn lemo_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        exp_avg: Option<FloatTensor<Self>>,
        exp_avg_sq: Option<FloatTensor<Self>>,
        step: fused::AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        fused::adamw::kernel::adamw_step(param, grad, exp_avg, exp_avg_sq, step)
    }
}

impl<B: ComputeBackend, C: CheckpointStrategy> OptimizerBackend for Autodiff<B, C> {}
