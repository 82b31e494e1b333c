//! The dense compute families of the backend extension, each its own trait next to its
//! kernels: GEMM ([`GemmBackend`]), fused element-wise kernels ([`FusedBackend`]), token movement
//! ([`TokenMovementBackend`]), the optimizer ([`OptimizerBackend`]), device memory
//! ([`MemoryBackend`]), copies to host memory and back ([`HostCopyBackend`]) and the
//! dequantization of frozen weights ([`DequantizeBackend`]).
//! [`ComputeBackend`] is all of them; the loss and attention families build on it.

pub use crate::dequantize::backend::DequantizeBackend;
pub use crate::fused::adamw::backend::OptimizerBackend;
pub use crate::fused::backend::FusedBackend;
pub use crate::gemm::backend::GemmBackend;
pub use crate::host_copy::backend::HostCopyBackend;
pub use crate::memory::backend::MemoryBackend;
pub use crate::token_movement::backend::TokenMovementBackend;

/// Every dense compute family: what a training step needs besides attention and the loss.
pub trait ComputeBackend:
    GemmBackend
    + FusedBackend
    + TokenMovementBackend
    + OptimizerBackend
    + MemoryBackend
    + HostCopyBackend
    + DequantizeBackend
{
}

impl<B> ComputeBackend for B where
    B: GemmBackend
        + FusedBackend
        + TokenMovementBackend
        + OptimizerBackend
        + MemoryBackend
        + HostCopyBackend
        + DequantizeBackend
{
}
