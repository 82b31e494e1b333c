//! The exchange family of backend operations: an all-gather and a reduce-scatter through the
//! host on every backend, on the device on CUDA when the group has device collectives; under
//! autodiff the reduce-scatter is the all-gather's backward pass.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::Exchange;
use crate::backend::CpuBackend;

/// Rows exchanged between the ranks of a sequence group; see [`super`].
pub trait ExchangeBackend: Backend {
    /// See [`super::all_gather_rows`].
    fn lemo_all_gather_rows(local: FloatTensor<Self>, exchange: &Exchange) -> FloatTensor<Self> {
        through_host(local, |local| exchange.gather::<Self>(local))
    }

    /// This rank's rows `[rows, width]` of the sum over the ranks of `full: [ranks * rows,
    /// width]` (the backward pass of [`Self::lemo_all_gather_rows`]).
    fn lemo_reduce_scatter_rows(full: FloatTensor<Self>, exchange: &Exchange) -> FloatTensor<Self> {
        through_host(full, |full| exchange.scatter::<Self>(full))
    }
}

fn through_host<B: Backend>(
    rows: FloatTensor<B>,
    collective: impl FnOnce(Tensor<B, 2>) -> Tensor<B, 2>,
) -> FloatTensor<B> {
    collective(Tensor::from_primitive(TensorPrimitive::Float(rows)))
        .into_primitive()
        .tensor()
}

impl ExchangeBackend for CpuBackend {}

impl<R, F, I, BT> ExchangeBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn lemo_all_gather_rows(local: FloatTensor<Self>, exchange: &Exchange) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(gathered) =
            super::cuda::on_device(&local, exchange, super::cuda::Collective::AllGather)
        {
            return gathered;
        }
        through_host(local, |local| exchange.gather::<Self>(local))
    }

    fn lemo_reduce_scatter_rows(full: FloatTensor<Self>, exchange: &Exchange) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(scattered) =
            super::cuda::on_device(&full, exchange, super::cuda::Collective::ReduceScatter)
        {
            return scattered;
        }
        through_host(full, |full| exchange.scatter::<Self>(full))
    }
}
