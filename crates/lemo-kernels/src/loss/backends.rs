//! [`LossBackend`] for the CPU backend (plain Burn ops), the CubeCL backends (the fused row
//! kernel) and autodiff (the segment loss's own backward pass).

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::backend::{LossBackend, SegmentOutput};
use super::{autodiff, kernel, reference, segment};
use crate::ComputeBackend;
use crate::backend::CpuBackend;

impl LossBackend for CpuBackend {
    fn lemo_cross_entropy_rows(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        reference::cross_entropy_rows::<Self>(logits, targets, grad)
    }

    fn lemo_segment_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        chunk_rows: usize,
        hidden_grad: bool,
        weight_grad: bool,
    ) -> SegmentOutput<Self> {
        segment::forward_with_grads::<Self>(
            hidden,
            weight,
            targets,
            chunk_rows,
            hidden_grad,
            weight_grad,
        )
    }
}

impl<R, F, I, BT> LossBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn lemo_cross_entropy_rows(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        kernel::cross_entropy_rows(logits, targets, grad)
    }

    fn lemo_segment_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        chunk_rows: usize,
        hidden_grad: bool,
        weight_grad: bool,
    ) -> SegmentOutput<Self> {
        segment::forward_with_grads::<Self>(
            hidden,
            weight,
            targets,
            chunk_rows,
            hidden_grad,
            weight_grad,
        )
    }
}

impl<B: ComputeBackend + LossBackend, C: CheckpointStrategy> LossBackend for Autodiff<B, C> {
    fn lemo_cross_entropy_rows(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let (losses, grad) = B::lemo_cross_entropy_rows(Self::inner(logits), targets, grad);
        (Self::from_inner(losses), grad.map(Self::from_inner))
    }

    fn lemo_segment_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        chunk_rows: usize,
        hidden_grad: bool,
        weight_grad: bool,
    ) -> SegmentOutput<Self> {
        autodiff::segment_cross_entropy::<B, C>(
            hidden,
            weight,
            targets,
            chunk_rows,
            hidden_grad,
            weight_grad,
        )
    }
}
