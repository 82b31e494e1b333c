use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use crate::attention::{self, AttentionOptions};

/// Pure-CPU backend.
pub type CpuBackend = burn::backend::NdArray<f32>;
/// CubeCL on wgpu (Vulkan, Metal, or Mesa's software Vulkan on CPU-only machines).
pub type WgpuBackend = burn::backend::Wgpu<f32, i32, u32>;
/// CubeCL on CUDA.
#[cfg(feature = "cuda")]
pub type CudaBackend = burn::backend::Cuda<f32, i32>;

/// Backend extension with the operations lemo's models need beyond Burn's own.
pub trait LemoBackend: Backend + crate::ComputeBackend {
    /// Causal attention; see [`attention::attention`].
    fn lemo_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> FloatTensor<Self> {
        attention::reference::attention_primitive::<Self>(q, k, v, options)
    }
}

impl LemoBackend for CpuBackend {}
impl LemoBackend for WgpuBackend {}
#[cfg(feature = "cuda")]
impl LemoBackend for CudaBackend {}
impl<B: LemoBackend, C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy>
    LemoBackend for burn::backend::Autodiff<B, C>
{
}
