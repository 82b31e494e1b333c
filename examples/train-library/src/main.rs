//! Training through the `lemo-train` library from another program: the tiny preset's generated
//! model and stories, LeMo's token elimination keeping half of the tokens, on the CPU.
//!
//! ```sh
//! cargo run --release -p train-library -- runs/library-example
//! ```

use anyhow::{Context, Result};
use lemo_train::lemo::LemoSettings;
use lemo_train::method::Method;
use lemo_train::train::config::{Preset, TrainConfig};
use lemo_train::train::{TrainJob, run_dir::Start};

fn main() -> Result<()> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or("runs/library-example".into());
    let config = TrainConfig {
        method: Method::Lemo,
        steps: 40,
        out: out.into(),
        lemo: LemoSettings {
            target_keep: 0.5,
            keep_exactly: true,
            ..LemoSettings::default()
        },
        ..TrainConfig::preset(Preset::Tiny)
    };
    let summary = TrainJob::new(config, None, Start::Overwrite)?
        .train()?
        .context("a run in one process reports itself")?;
    println!(
        "{} steps, validation loss {:.4}; adapter in {}",
        summary.steps_done,
        summary.val_loss.unwrap_or(f64::NAN),
        summary.adapter.context("the run finished")?.display()
    );
    Ok(())
}
