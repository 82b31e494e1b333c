//! Device kernels for long-context LoRA training, exposed as a Burn backend extension.
//!
//! Every operation is a method of [`LemoBackend`] whose default body is the plain Burn-tensor
//! reference: any backend is correct out of the box, and CubeCL backends override the methods
//! with kernels (with their own autodiff `Backward` where they are differentiable).
//!
//! Any Burn model can use the token movement of contextual token sparsity: a block reads its
//! kept rows through the norm and adds its output back into those rows, so the skipped rows pass
//! through untouched and cost nothing:
//!
//! ```no_run
//! # use burn::tensor::{Int, Tensor};
//! # use lemo_kernels::ComputeBackend;
//! use lemo_kernels::fused::NormSaves;
//! use lemo_kernels::token_movement::{gather_rms_norm, scatter_add_rows};
//! # fn block<B: ComputeBackend>(h: Tensor<B, 3>, rows: Tensor<B, 2, Int>, norm: Tensor<B, 1>,
//! #     f: impl Fn(Tensor<B, 3>) -> Tensor<B, 3>) -> Tensor<B, 3> {
//! // h: [batch, seq, hidden]; rows: [batch, kept] increasing positions of each sequence.
//! let x = gather_rms_norm(h.clone(), rows.clone(), norm, 1e-5, NormSaves::Input); // [batch, kept, hidden]
//! scatter_add_rows(h, rows, f(x)) // h with f(x) added into the kept rows, in place
//! # }
//! ```
//!
//! `examples/sparse-block` builds a whole token-sparse attention block this way.

pub mod attention;
mod backend;
pub mod block_scores;
pub mod cache;
pub mod compute;
#[cfg(feature = "cuda")]
mod cuda_interop;
pub mod dequantize;
pub mod exchange;
mod extension;
pub mod fused;
pub mod gemm;
pub mod host_copy;
pub mod host_reads;
pub mod known_value;
pub mod loss;
pub mod memory;
pub mod precision;
pub mod recomputed_rows;
pub mod token_movement;

pub use attention::AttentionOptions;
pub use attention::backend::AttentionBackend;
#[cfg(feature = "cuda")]
pub use backend::CudaBackend;
pub use backend::{CpuBackend, WgpuBackend};
pub use compute::{
    ComputeBackend, DequantizeBackend, FusedBackend, GemmBackend, HostCopyBackend, MemoryBackend,
    OptimizerBackend, TokenMovementBackend,
};
pub use extension::LemoBackend;
pub use loss::LossBackend;
