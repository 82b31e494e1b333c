//! Device kernels for long-context LoRA training, exposed as a Burn backend extension.
//!
//! Every operation is a method of [`LemoBackend`] whose default body is the plain Burn-tensor
//! reference: any backend is correct out of the box, and CubeCL backends override the methods
//! with kernels (with their own autodiff `Backward` where they are differentiable).

pub mod attention;
mod backend;
pub mod block_scores;
pub mod cache;
pub mod compute;
pub mod fused;
pub mod gemm;
pub mod loss;
pub mod memory;
pub mod precision;
pub mod token_movement;

pub use attention::AttentionOptions;
#[cfg(feature = "cuda")]
pub use backend::CudaBackend;
pub use backend::{CpuBackend, LemoBackend, WgpuBackend};
pub use compute::ComputeBackend;
