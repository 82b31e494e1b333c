//! Checks of a command-line run: its one JSON line on stdout, its one-line errors.

use std::process::{Command, Output};

/// Runs `binary` (a test's `env!("CARGO_BIN_EXE_...")`) with `args`.
pub fn run(binary: &str, args: &[&str]) -> Output {
    Command::new(binary)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {binary}: {e}"))
}

/// The one JSON value a successful run printed on stdout.
pub fn stdout_json(output: &Output) -> serde_json::Value {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "failed: {stderr}");
    let stdout = String::from_utf8(output.stdout.clone()).unwrap();
    assert_eq!(
        stdout.lines().count(),
        1,
        "stdout must hold one JSON value: {stdout:?}"
    );
    serde_json::from_str(&stdout).unwrap()
}

/// Asserts that a run failed with exactly one stderr line, `error: ...`, containing `needle`,
/// and no panic.
pub fn assert_clean_error(output: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "should fail: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got {stderr:?}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(needle),
        "expected `error: ...{needle}...`, got {stderr:?}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}
