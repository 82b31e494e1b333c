//! Llama, Mistral and OPT causal language models in Burn, with LoRA adapters, loaded from
//! Hugging Face folders, llama2.c checkpoints or GGUF files.

pub mod activation_plan;
pub mod adapter;
pub mod block_pass;
pub mod cache;
pub mod chat;
pub mod config;
pub mod decoder;
pub mod embedding;
pub mod error;
pub mod export;
pub mod gguf;
pub mod kept_s2;
pub mod llama;
pub mod llama2c;
pub mod lora;
pub mod loss;
pub mod merge;
pub mod model;
pub mod norm;
pub mod offload;
pub mod opt;
pub mod planned_backward;
pub mod quantized;
pub mod random;
pub mod rope;
pub mod row_chunks;
pub mod sequence_split;
pub mod token_plan;
pub mod tokenizer;
pub mod weights;

pub use cache::KvCache;
pub use config::ModelConfig;
pub use error::{Error, Result};
pub use lora::LoraConfig;
pub use model::CausalLm;
