//! Long-context LoRA fine-tuning of Llama, Mistral and OPT models with LeMo's contextual token
//! sparsity, as a library: the `lemo-train` command is a thin layer of flags over it.
//!
//! - [`train`]: a training run ([`train::TrainJob`] from a [`train::config::TrainConfig`]), on
//!   one device or data-parallel over several ([`distributed`]);
//! - [`lemo`]: token elimination's settings, thresholds (calibration) and predictors;
//! - [`eval`], [`passkey`], [`longbench`], [`generate`]: perplexity, retrieval, multiple choice
//!   and decoding with a trained adapter;
//! - [`merge`]: an adapter folded into its base (Hugging Face folder, GGUF);
//! - [`bench`], [`memory_plan`], [`memory`]: step time and memory, predicted and measured;
//! - [`data`]: documents read, tokenized, cached and packed into sequences;
//! - [`device`], [`modelio`]: the backend a job runs on, and models loaded as training left them.
//!
//! ```no_run
//! use lemo_train::train::{TrainJob, config::TrainConfig, run_dir::Start};
//! # fn main() -> anyhow::Result<()> {
//! let config = TrainConfig {
//!     model: Some("models/stories260K.bin".into()),
//!     data: Some("books/".into()),
//!     seq_len: Some(2048),
//!     target_context: Some(2048),
//!     steps: 100,
//!     ..TrainConfig::default()
//! };
//! let summary = TrainJob::new(config, None, Start::Fresh)?.train()?;
//! # Ok(()) }
//! ```

pub mod bench;
pub mod data;
pub mod device;
pub mod distributed;
pub mod errors;
pub mod eval;
pub mod generate;
pub mod lemo;
pub mod longbench;
pub mod memory;
pub mod memory_budget;
pub mod memory_plan;
pub mod merge;
pub mod method;
pub mod modelio;
pub mod passkey;
pub mod preset;
pub mod task_progress;
pub mod train;

/// A settings struct at its flags' defaults. Each setting's default is spelled once, in the
/// `#[arg(default_value..)]` of its field; `Default` and serde's missing keys come from here.
pub fn defaults<T: clap::Args + clap::FromArgMatches>() -> T {
    let command = T::augment_args(clap::Command::new("defaults").no_binary_name(true));
    let matches = command
        .try_get_matches_from(std::iter::empty::<&str>())
        .expect("every setting has a default or is optional");
    T::from_arg_matches(&matches).expect("defaults convert")
}
