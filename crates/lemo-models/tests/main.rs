//! The models' tests against outside references (transformers, PyTorch autograd, llama.cpp,
//! llama2.c), one module per subject. One test binary, so that the backends' generic code is
//! compiled once; `loader_fuzz` and `pass_memory` install their own global allocators and keep
//! binaries of their own.

mod chat;
mod common;
mod gguf;
mod gguf_writer;
mod gradients;
mod host_reads;
mod masked_loss;
mod models;
mod quantized;
mod recompute;
mod sampled_scores;
mod token_sparsity;
mod tokenizer;
