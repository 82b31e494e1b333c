//! `lemo-train`: long-context LoRA fine-tuning of Llama, Mistral and OPT models.

mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    lemo_train::errors::report_panics_in_one_line();
    match cli::run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", format!("{error:#}").replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}
