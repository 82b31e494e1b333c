//! Rows exchanged between the ranks of a sequence group (context parallelism): each rank holds
//! some rows of one sequence, and an operation that needs every row (attention's keys and
//! values) gathers them from all ranks. [`all_gather_rows`] is differentiable: its backward
//! pass sums every rank's gradient of the gathered rows and hands each rank the part of its own
//! rows (a reduce-scatter), so gradients reach the rank that computed the rows.
//!
//! How the rows travel is the caller's: a [`RowExchange`] moves host values (the ranks of one
//! process share memory), so any backend takes part; one that also has collectives on device
//! memory ([`DeviceRowExchange`], NCCL) moves CUDA tensors without the host. The collective runs
//! once per call in the forward pass and once in the backward pass, and every rank of the group
//! must make the same calls in the same order.

mod autodiff;
pub mod backend;
#[cfg(feature = "cuda")]
mod cuda;

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};

use backend::ExchangeBackend;

/// The collectives of one rank of a sequence group.
///
/// A collective that fails (a rank stopped, or did not answer within the group's deadline)
/// cannot return an error from inside a backward pass: it returns zeros of the right length and
/// leaves the failure with the group, which the caller checks once the step is done.
pub trait RowExchange: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn ranks(&self) -> usize;
    /// Every rank's `local` values (as many on each rank), concatenated in rank order.
    fn all_gather(&self, local: Vec<f32>) -> Vec<f32>;
    /// The sum over the ranks of `full` (as long on each rank, a multiple of the rank count),
    /// and of it this rank's share: the `rank`-th of `ranks` equal parts.
    fn reduce_scatter(&self, full: Vec<f32>) -> Vec<f32>;
    /// Returns once every rank of the group has called it.
    fn barrier(&self);
    /// The group's collectives on device memory, when it has them.
    fn device(&self) -> Option<&dyn DeviceRowExchange> {
        None
    }
}

/// Collectives of a sequence group on buffers of each rank's CUDA device (NCCL).
///
/// Both run on cubecl's device thread with the rank's CUDA context current, are enqueued on
/// `stream` (which already waits for the kernels that wrote `send`), and return once they have
/// finished. A collective that fails returns the reason and leaves the failure with the group,
/// as [`RowExchange`]'s do.
pub trait DeviceRowExchange: Send + Sync {
    /// Every rank's `count` values of `dtype` at `send`, concatenated in rank order at `recv`.
    ///
    /// # Safety
    /// `send` holds `count` values and `recv` room for `ranks * count`, live device buffers of
    /// the current context; `stream` is a stream of that context.
    unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: usize,
    ) -> Result<(), String>;

    /// This rank's share, `count` values at `recv`, of the sum over the ranks of the
    /// `ranks * count` values of `dtype` at `send`.
    ///
    /// # Safety
    /// As [`Self::all_gather`], with the sizes of `send` and `recv` swapped.
    unsafe fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: usize,
    ) -> Result<(), String>;
}

/// A shared handle on a rank's [`RowExchange`].
#[derive(Clone)]
pub struct Exchange(pub Arc<dyn RowExchange>);

impl std::fmt::Debug for Exchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Exchange(rank {} of {})", self.0.rank(), self.0.ranks())
    }
}

impl Exchange {
    pub fn rank(&self) -> usize {
        self.0.rank()
    }

    /// Waits for every rank of the group before a backward pass that runs a collective. The
    /// ranks of one process share Burn's autodiff bookkeeping: a rank ending a backward pass
    /// locks every graph, its peers' too, so a peer already waiting inside its own backward pass
    /// for this rank's contribution would never get it.
    pub fn before_backward(&self) {
        self.0.barrier();
    }

    pub fn ranks(&self) -> usize {
        self.0.ranks()
    }

    /// Every rank's `local: [rows, width]` stacked in rank order, `[ranks * rows, width]`, in
    /// `local`'s dtype, outside any graph, through the host.
    fn gather<B: Backend>(&self, local: Tensor<B, 2>) -> Tensor<B, 2> {
        let [rows, width] = local.dims();
        let values = self.0.all_gather(host_values(local.clone()));
        let gathered = TensorData::new(values, [self.ranks() * rows, width]);
        Tensor::<B, 2>::from_data(gathered, &local.device()).cast(local.dtype())
    }

    /// This rank's rows `[rows, width]` of the sum over the ranks of `full:
    /// [ranks * rows, width]`, in `full`'s dtype, outside any graph, through the host.
    fn scatter<B: Backend>(&self, full: Tensor<B, 2>) -> Tensor<B, 2> {
        let [total, width] = full.dims();
        let values = self.0.reduce_scatter(host_values(full.clone()));
        let mine = TensorData::new(values, [total / self.ranks(), width]);
        Tensor::<B, 2>::from_data(mine, &full.device()).cast(full.dtype())
    }
}

fn host_values<B: Backend>(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 values after the conversion")
}

/// Every rank's `local: [rows, width]` (as many rows on each rank) stacked in rank order,
/// `[ranks * rows, width]`. Differentiable: the gradient of this rank's `local` is the sum over
/// the ranks of their gradients of its rows. Costs one all-gather forward and one
/// reduce-scatter backward of `ranks * rows * width` values.
pub fn all_gather_rows<B: ExchangeBackend>(
    local: Tensor<B, 2>,
    exchange: &Exchange,
) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_all_gather_rows(
        local.into_primitive().tensor(),
        exchange,
    )))
}
