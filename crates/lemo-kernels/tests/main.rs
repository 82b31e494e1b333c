//! The kernels' parity tests, one module per kernel, each against its plain Burn reference on
//! seeded random inputs. One test binary, so that the backends' generic code is compiled once;
//! `exact_size_buffers` reads the device pools and keeps a binary of its own.

mod adamw;
mod attention;
mod block_scores;
mod dequantize;
mod fused;
mod gemm;
mod lora_linear;
mod recomputed_rows;
mod ring_attention;
mod segment_loss;
mod token_movement;
