//! The backends lemo runs on, and [`LemoBackend`], the union of the backend-extension families.

use crate::ComputeBackend;
use crate::attention::backend::AttentionBackend;
use crate::loss::LossBackend;

/// Pure-CPU backend.
pub type CpuBackend = burn::backend::NdArray<f32>;
/// CubeCL on wgpu (Vulkan, Metal, or Mesa's software Vulkan on CPU-only machines).
pub type WgpuBackend = burn::backend::Wgpu<f32, i32, u32>;
/// CubeCL on CUDA.
#[cfg(feature = "cuda")]
pub type CudaBackend = burn::backend::Cuda<f32, i32>;

/// Every family of the backend extension: what lemo's models need beyond Burn's own operations.
/// Each family is its own trait next to its kernels (attention, loss, and the dense compute
/// families of [`ComputeBackend`]); a backend gets this one by implementing them all.
pub trait LemoBackend: AttentionBackend + ComputeBackend + LossBackend {}

impl<B> LemoBackend for B where B: AttentionBackend + ComputeBackend + LossBackend {}
