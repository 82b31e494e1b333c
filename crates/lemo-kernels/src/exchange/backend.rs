//! The exchange family of backend operations: a plain all-gather on every backend, with its
//! reduce-scatter as the backward pass under autodiff.

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
        let local = Tensor::<Self, 2>::from_primitive(TensorPrimitive::Float(local));
        exchange.gather(local).into_primitive().tensor()
    }
}

impl ExchangeBackend for CpuBackend {}

impl<R, F, I, BT> ExchangeBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
}
