//! Device memory accounting for the trainer and the benchmarks.
//!
//! What each number is, and how it compares with PyTorch:
//! - `bytes_in_use`: bytes of live tensors in cubecl's pools (its `MemoryUsage::bytes_in_use`,
//!   padding excluded), the analogue of `torch.cuda.memory_allocated()`. Read after the forward
//!   pass it is the paper's metric.
//! - `bytes_reserved`: bytes cubecl's pools hold from the device, the analogue of
//!   `torch.cuda.memory_reserved()`.
//! - `device_used`/`device_total` (CUDA only): `cuMemGetInfo`'s total minus free, i.e. what
//!   `nvidia-smi` shows for the whole device (context, cuBLASLt workspace, other processes).
//!
//! cubecl keeps no high-water mark, so peaks are sampled: [`PeakMemory`] keeps the maximum of
//! every [`MemoryStats`] it is given. `max_memory_reserved` is matched closely by sampling at
//! the end of a step (cubecl's pools keep pages until [`memory_cleanup`], so the reserved bytes
//! only grow within a step); `max_memory_allocated` is approximated from below by the largest
//! sample, so sample where live memory peaks (after the forward pass, and after the backward
//! pass before gradients are dropped). cubecl reports the pools of the calling thread's stream:
//! sample from the thread that runs the step. Backends without pools (NdArray) report zeros.

pub mod backend;

use std::collections::BTreeMap;
use std::sync::Mutex;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

use crate::ComputeBackend;

/// One reading of device memory (see the module docs for each field).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub bytes_in_use: u64,
    pub bytes_reserved: u64,
    pub device_used: Option<u64>,
    pub device_total: Option<u64>,
}

/// Current memory of `device`.
pub fn memory_stats<B: ComputeBackend>(device: &B::Device) -> MemoryStats {
    B::lemo_memory_stats(device)
}

/// Returns the pools' unused pages to the device (after waiting for queued work), so that a
/// following measurement starts from live tensors only.
pub fn memory_cleanup<B: ComputeBackend>(device: &B::Device) {
    B::lemo_memory_cleanup(device)
}

/// The largest buffer `device`'s memory pool cuts from pages of four times its size, or `None`
/// where buffers get their own allocations (the `exclusive-pools` build, backends without pools).
///
/// CubeCL's default pools carve buffers out of pages sized from the device's largest page
/// (a quarter of its memory on CUDA): buffers up to 1/64 of it come from pages of 1/16 (on the
/// H200: 586 MB from 2.35 GB pages), larger ones from pages of 1/4 (9.38 GB), which a few
/// sub-gigabyte intermediates leave mostly empty. Models split row-wise work whose
/// intermediates would exceed this, so a long sequence does not reserve such a page.
pub fn pooled_buffer_limit<B: ComputeBackend>(device: &B::Device) -> Option<u64> {
    B::lemo_pooled_buffer_limit(device)
}

/// Serves every later buffer of the byte size of each of `shapes` (in `dtype`) from exact-size
/// allocations of its own, reused by any later buffer of that size, instead of slices of the
/// pool's shared pages. Shapes under 1 MiB are left to the pages.
///
/// Why: a training step allocates and frees buffers of a few per-token shapes (the residual
/// stream, keys and values, the MLP's intermediate) dozens of times per layer. In the shared
/// pages they interleave with longer-lived ones (checkpointed layer inputs, saved activations)
/// and leave pages part-empty that the pool cannot return; larger than the small pages' limit,
/// each takes a page of a quarter of the largest. In exact-size slices they cost their peak count
/// and nothing more. CubeCL's persistent pool gives this: once it holds a slice of a size, every
/// request of that size reuses a free one or gets a new one.
///
/// Free slices stay reserved until an explicit [`memory_cleanup`], and a size no later pass
/// asks for would never be reused: when the shapes differ from those the device was last given
/// (scoring documents of many lengths), the free ones are returned first. A run at one length
/// (training) never pays for that; a change of length pays a synchronization and the pool's
/// allocations again.
pub fn exact_size_buffers<B: ComputeBackend>(
    device: &B::Device,
    dtype: DType,
    shapes: &[[usize; 3]],
) {
    const SMALLEST: usize = 1 << 20;
    /// Each device's last dtype and shapes.
    static REGISTERED: PerDevice<(DType, Vec<[usize; 3]>)> = PerDevice::new();
    let shapes: Vec<[usize; 3]> = shapes
        .iter()
        .filter(|shape| shape.iter().product::<usize>() * dtype.size() >= SMALLEST)
        .copied()
        .collect();
    if shapes.is_empty() || pooled_buffer_limit::<B>(device).is_none() {
        return;
    }
    let last = REGISTERED.insert(device, Some((dtype, shapes.clone())));
    if last.is_some_and(|last| last != (dtype, shapes.clone())) {
        memory_cleanup::<B>(device);
    }
    B::memory_persistent_allocations(device, shapes, |shapes| {
        for shape in shapes {
            drop(Tensor::<B, 3>::empty(shape, (device, dtype)));
        }
    });
}

/// A value per device, by the device's name: what the process set for each device it uses.
struct PerDevice<T>(Mutex<BTreeMap<String, T>>);

impl<T: Clone> PerDevice<T> {
    const fn new() -> Self {
        Self(Mutex::new(BTreeMap::new()))
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, T>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sets (`Some`) or clears (`None`) `device`'s value and returns the one it had.
    fn insert(&self, device: &impl std::fmt::Debug, value: Option<T>) -> Option<T> {
        let key = format!("{device:?}");
        match value {
            Some(value) => self.entries().insert(key, value),
            None => self.entries().remove(&key),
        }
    }

    fn get(&self, device: &impl std::fmt::Debug) -> Option<T> {
        self.entries().get(&format!("{device:?}")).cloned()
    }
}

/// Each device's pool budget (see [`set_pool_budget`]).
static POOL_BUDGETS: PerDevice<u64> = PerDevice::new();

/// The bytes `device`'s pools may reserve in a step whose plan was made for a memory budget
/// (`None`: no budget, nothing is ever released early); see [`LayerBuffers`].
pub fn set_pool_budget<B: ComputeBackend>(device: &B::Device, bytes: Option<u64>) {
    POOL_BUDGETS.insert(device, bytes);
}

/// `device`'s pool budget, if one was set.
fn pool_budget(device: &impl std::fmt::Debug) -> Option<u64> {
    POOL_BUDGETS.get(device)
}

/// The exact-size buffers of a pass down a model's layers (see [`exact_size_buffers`]), and the
/// idle memory it returns to the device between layers near the pool budget
/// ([`set_pool_budget`]).
///
/// Why: a buffer of one size cannot serve a request of another, and a pass down the layers
/// leaves buffers of sizes the next layers do not ask for: the transients of layers that ran
/// without a graph while the kept layers above them save their activations, the forward pass's
/// residual-stream buffers while the backward pass asks for row buffers. On an H100 (Llama-2-7B,
/// `lemo` at 32K tokens, 13 of 32 layers kept) the device peak went from 55.6 to 50.2 GiB for
/// 3% more step time (`bench/results/h100-idle-buffers.json`). What a layer leaves idle within
/// itself stays until its end. Releasing waits for the device's queue (about 30 ms at 64K), so
/// it happens only where the next layer could pass the budget.
pub struct LayerBuffers<B: Backend> {
    device: B::Device,
    dtype: DType,
    shapes: Vec<[usize; 3]>,
    /// The pools' reserved bytes at the last boundary between layers.
    reserved: u64,
    /// The most the reserved bytes grew from one boundary to the next.
    largest_growth: u64,
}

impl<B: ComputeBackend> LayerBuffers<B> {
    /// Serves `shapes` in `dtype` from exact-size buffers (see [`exact_size_buffers`]).
    pub fn new(device: &B::Device, dtype: DType, shapes: Vec<[usize; 3]>) -> Self {
        exact_size_buffers::<B>(device, dtype, &shapes);
        // Growth is measured only where a budget asks for releases: a pass without one (each
        // token of `generate`) reads no memory figures.
        let reserved = pool_budget(device).map_or(0, |_| memory_stats::<B>(device).bytes_reserved);
        Self {
            device: device.clone(),
            dtype,
            reserved,
            largest_growth: 0,
            shapes,
        }
    }

    /// Between two layers: when the pools' reserved bytes plus the most they grew over one layer
    /// so far (at least one of their largest pages, 16 times [`pooled_buffer_limit`], 5.3 GB on
    /// an 80 GB card) would pass the pool budget, and at least a page of it lies idle, returns
    /// the idle memory to the device and registers the shapes again. Says whether it released
    /// anything.
    pub fn between_layers(&mut self) -> bool {
        let (Some(budget), Some(limit)) = (
            pool_budget(&self.device),
            pooled_buffer_limit::<B>(&self.device),
        ) else {
            return false;
        };
        let page = 16 * limit;
        let stats = memory_stats::<B>(&self.device);
        self.largest_growth = self
            .largest_growth
            .max(stats.bytes_reserved.saturating_sub(self.reserved));
        self.reserved = stats.bytes_reserved;
        if stats.bytes_reserved + self.largest_growth.max(page) <= budget
            || stats.bytes_reserved.saturating_sub(stats.bytes_in_use) < page
        {
            return false;
        }
        memory_cleanup::<B>(&self.device);
        exact_size_buffers::<B>(&self.device, self.dtype, &self.shapes);
        self.reserved = memory_stats::<B>(&self.device).bytes_reserved;
        true
    }
}

/// Waits until all work queued on `device` is done (on CUDA, cuBLASLt's stream too): for
/// host-side timings and measurements at a well-defined point.
pub fn synchronize<B: ComputeBackend>(device: &B::Device) {
    B::lemo_synchronize(device)
}

/// Running maximum of memory readings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeakMemory {
    pub bytes_in_use: u64,
    pub bytes_reserved: u64,
    pub device_used: Option<u64>,
}

impl PeakMemory {
    /// Folds one reading into the peaks and returns it.
    pub fn record(&mut self, stats: MemoryStats) -> MemoryStats {
        self.bytes_in_use = self.bytes_in_use.max(stats.bytes_in_use);
        self.bytes_reserved = self.bytes_reserved.max(stats.bytes_reserved);
        self.device_used = match (self.device_used, stats.device_used) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        stats
    }

    /// Reads `device` and folds the reading in.
    pub fn sample<B: ComputeBackend>(&mut self, device: &B::Device) -> MemoryStats {
        self.record(memory_stats::<B>(device))
    }
}

/// Reading of a CubeCL runtime's pools (and of the whole device on CUDA).
pub(crate) fn cube_stats<R: burn_cubecl::CubeRuntime>(device: &R::Device) -> MemoryStats {
    let client = R::client(device);
    let mut stats = MemoryStats::default();
    if let Ok(usage) = client.memory_usage() {
        stats.bytes_in_use = usage.bytes_in_use;
        stats.bytes_reserved = usage.bytes_reserved;
    }
    #[cfg(feature = "cuda")]
    if std::any::TypeId::of::<R>() == std::any::TypeId::of::<cubecl::cuda::CudaRuntime>() {
        // On cubecl's device thread, where the device's context is current.
        if let Ok(Ok((free, total))) = client.exclusive(cudarc::driver::result::mem_get_info) {
            stats.device_used = Some((total - free) as u64);
            stats.device_total = Some(total as u64);
        }
    }
    stats
}

/// See [`pooled_buffer_limit`]: cubecl-runtime's `MemoryConfiguration::SubSlices` layout.
pub(crate) fn cube_pooled_buffer_limit<R: burn_cubecl::CubeRuntime>(
    device: &R::Device,
) -> Option<u64> {
    if cfg!(feature = "exclusive-pools") {
        return None;
    }
    Some(R::client(device).properties().memory.max_page_size / 64)
}

/// Waits for queued work and releases the pools' free pages.
pub(crate) fn cube_cleanup<R: burn_cubecl::CubeRuntime>(device: &R::Device) {
    cube_synchronize::<R>(device);
    R::client(device).memory_cleanup();
    cube_synchronize::<R>(device);
}

/// cubecl's own synchronization, and on CUDA the whole context's (cuBLASLt runs on a stream
/// cubecl does not know), on cubecl's device thread after everything submitted before.
pub(crate) fn cube_synchronize<R: burn_cubecl::CubeRuntime>(device: &R::Device) {
    let client = R::client(device);
    cubecl::future::block_on(client.sync()).expect("device synchronization");
    #[cfg(feature = "cuda")]
    if std::any::TypeId::of::<R>() == std::any::TypeId::of::<cubecl::cuda::CudaRuntime>() {
        client
            .exclusive(cudarc::driver::result::ctx::synchronize)
            .expect("cubecl device thread")
            .expect("cuCtxSynchronize");
    }
}
