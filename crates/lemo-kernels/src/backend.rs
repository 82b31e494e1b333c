//! The backends lemo runs on.

/// Pure-CPU backend.
pub type CpuBackend = burn::backend::NdArray<f32>;
/// CubeCL on wgpu (Vulkan, Metal, or Mesa's software Vulkan on CPU-only machines).
pub type WgpuBackend = burn::backend::Wgpu<f32, i32, u32>;
/// CubeCL on CUDA.
#[cfg(feature = "cuda")]
pub type CudaBackend = burn::backend::Cuda<f32, i32>;
