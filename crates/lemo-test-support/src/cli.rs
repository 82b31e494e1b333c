//! Checks of a command-line run: its one JSON line on stdout, its one-line errors.

use std::process::{Command, Output};

/// A training run of three steps at a fixed learning rate that saves nothing along the way
/// (no warm-up, validation, checkpoints or token cache): what a test that trains and then looks
/// at the adapter needs.
pub const SHORT_TRAINING: [&str; 12] = [
    "--steps",
    "3",
    "--warmup-steps",
    "0",
    "--lr",
    "1e-2",
    "--val-every",
    "0",
    "--checkpoint-every",
    "0",
    "--cache-dir",
    "none",
];

/// [`run`], which must succeed: a failure panics with the arguments and the command's stderr.
pub fn run_ok(binary: &str, args: &[&str]) -> Output {
    let output = run(binary, args);
    assert!(
        output.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// A path as a command-line argument (test paths are UTF-8).
pub fn path(path: &std::path::Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

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

/// Runs `binary` with `args` as [`run`] does, but kills it and fails the test when it has not
/// ended within `limit`: a command that must refuse a request up front, not start on it.
pub fn run_within(binary: &str, args: &[&str], limit: std::time::Duration) -> Output {
    use std::process::Stdio;
    let started = std::time::Instant::now();
    let mut child = Command::new(binary)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {binary}: {e}"));
    // Pipes are drained on threads: a child blocked on a full pipe would never end.
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                std::io::Read::read_to_end(&mut pipe, &mut bytes).ok();
            }
            bytes
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let status = loop {
        if let Some(status) = child.try_wait().expect("the child's status") {
            break status;
        }
        if started.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            panic!("{args:?} still ran after {limit:?}: it must be refused up front");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().expect("stdout"),
        stderr: stderr.join().expect("stderr"),
    }
}

/// Asserts that a run failed with one stderr line `error: ...` containing `needle`, as its
/// last line, and no panic; progress lines before it are allowed (`train` reports its plan and
/// data before a later check fails).
pub fn assert_error_line(output: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "should fail: {stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "expected one error line, got {stderr:?}");
    assert!(
        stderr.trim_end().ends_with(errors[0]) && errors[0].contains(needle),
        "expected a last line `error: ...{needle}...`, got {stderr:?}"
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("stack backtrace"),
        "{stderr}"
    );
}
