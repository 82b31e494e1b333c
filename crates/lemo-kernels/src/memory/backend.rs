//! The device-memory family of backend operations: zeros and no-ops where the backend keeps no
//! pools (the CPU), the CubeCL memory manager's figures elsewhere.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::backend::Backend;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::ComputeBackend;
use crate::backend::CpuBackend;
use crate::memory::{self, MemoryStats};

/// What the device's memory holds, releasing its caches, and waiting for its queue.
pub trait MemoryBackend: Backend {
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

impl MemoryBackend for CpuBackend {}

impl<R, F, I, BT> MemoryBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
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

impl<B: ComputeBackend, C: CheckpointStrategy> MemoryBackend for Autodiff<B, C> {
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
