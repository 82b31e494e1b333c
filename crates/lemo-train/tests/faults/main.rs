//! Fault injection: the `lemo-train` command fed missing, corrupt and wrong-format files,
//! settings out of range, requests it cannot serve, and training that diverges. Every case must
//! fail with one stderr line `error: ...` naming the problem (no panic, no backtrace), in bounded
//! time, and leave every file it was given as it was.
//!
//! Each test is one class of faults and runs its cases one after another, reporting every case
//! that failed, not only the first.

mod gguf;
mod inputs;
mod non_finite;
mod nothing_lost;
mod settings;
mod unbounded;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

/// How long a refused command may take. Refusals come before any work, so this is the time to
/// load a fixture; it is generous for CI's two loaded cores.
const REFUSAL_LIMIT: Duration = Duration::from_secs(60);

pub fn lemo_binary() -> &'static str {
    env!("CARGO_BIN_EXE_lemo-train")
}

pub fn lemo(args: &[&str]) -> Output {
    lemo_test_support::run_within(lemo_binary(), args, REFUSAL_LIMIT)
}

pub use lemo_test_support::path;

/// The Llama fixture (128 positions, a vocabulary of 128) and its `tokens.jsonl`.
pub fn llama_fixture() -> (PathBuf, PathBuf) {
    let model = lemo_test_support::hf_fixture("llama_gqa_tied");
    let tokens = model.join("tokens.jsonl");
    (model, tokens)
}

/// `name` in `dir` holding `bytes`.
pub fn write(dir: &Path, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
    let file = dir.join(name);
    if let Some(parent) = file.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::write(&file, bytes).unwrap();
    file
}

/// `ids.jsonl` in `dir`: `documents` documents of `len` token ids below 128.
pub fn id_documents(dir: &Path, documents: u64, len: u64) -> PathBuf {
    let lines: Vec<String> = (0..documents)
        .map(|d| {
            let ids: Vec<u64> = (0..len).map(|i| (d * 7919 + i * 104729) % 128).collect();
            serde_json::json!({ "input_ids": ids }).to_string()
        })
        .collect();
    write(dir, "ids.jsonl", lines.join("\n"))
}

/// One bad invocation: what must fail, the word its error must name, the folders that must be
/// unchanged after it, and how long it may take.
pub struct Case {
    args: Vec<String>,
    needle: String,
    watched: Vec<PathBuf>,
    limit: Duration,
}

/// `args` must fail with one line naming `needle`.
pub fn case<S: AsRef<str>>(args: &[S], needle: &str) -> Case {
    Case {
        args: args.iter().map(|a| a.as_ref().to_string()).collect(),
        needle: needle.into(),
        watched: Vec::new(),
        limit: REFUSAL_LIMIT,
    }
}

impl Case {
    /// ... and leave every file under `dir` byte-identical.
    pub fn watching(mut self, dir: &Path) -> Self {
        self.watched.push(dir.to_path_buf());
        self
    }

    /// ... and end within `limit`.
    pub fn within(mut self, limit: Duration) -> Self {
        self.limit = limit;
        self
    }

    fn check(&self) {
        let before: Vec<_> = self
            .watched
            .iter()
            .map(|d| lemo_test_support::snapshot(d))
            .collect();
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let output = lemo_test_support::run_within(lemo_binary(), &args, self.limit);
        lemo_test_support::assert_error_line(&output, &self.needle);
        for (dir, before) in self.watched.iter().zip(before) {
            let after = lemo_test_support::snapshot(dir);
            assert!(
                before == after,
                "{} changed: before {:?}, after {:?}",
                dir.display(),
                before.keys().collect::<Vec<_>>(),
                after.keys().collect::<Vec<_>>()
            );
        }
    }
}

/// Runs every case, then fails listing each case that did not fail cleanly.
pub fn check_all(cases: impl IntoIterator<Item = Case>) {
    let mut failures = Vec::new();
    let mut count = 0;
    for case in cases {
        count += 1;
        println!("case: {:?} (needs {:?})", case.args, case.needle);
        if let Err(panic) = std::panic::catch_unwind(|| case.check()) {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            failures.push(format!("{:?}: {message}", case.args));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {count} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
