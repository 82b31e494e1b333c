//! A test that cannot run here (no model in the cache, no shared data) returns early, and the
//! test harness still counts it as passed. So it says so in a fixed form, `SKIPPED: <test
//! binary>::<test>: <reason>`, on its output (seen with `-- --nocapture`) and, when
//! `LEMO_SKIP_LOG` names a file, as one line appended to that file: `.ci/run` lists those
//! lines after the tests.

use std::io::Write;

/// What starts a skip report.
pub const SKIP_MARKER: &str = "SKIPPED:";

/// The environment variable naming the file skip reports are appended to.
pub const SKIP_LOG_VARIABLE: &str = "LEMO_SKIP_LOG";

/// Reports the running test as skipped for `reason`; the caller then returns.
pub fn skip(reason: &str) {
    let line = format!("{SKIP_MARKER} {}: {reason}", running_test());
    println!("{line}");
    if let Some(log) = std::env::var_os(SKIP_LOG_VARIABLE) {
        // One write of a whole line with O_APPEND: lines of concurrent tests do not interleave.
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .and_then(|mut file| file.write_all(format!("{line}\n").as_bytes()));
        if let Err(e) = appended {
            panic!("cannot append to {SKIP_LOG_VARIABLE} file: {e}");
        }
    }
}

/// `<test binary>::<test>`: the harness names each test's thread after the test, and the
/// binary is the crate's test target (its file name less Cargo's hash).
fn running_test() -> String {
    let binary = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .map(|stem| match stem.rsplit_once('-') {
            Some((name, hash)) if hash.chars().all(|c| c.is_ascii_hexdigit()) => name.to_string(),
            _ => stem,
        })
        .unwrap_or_else(|| "?".into());
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("?");
    format!("{binary}::{test}")
}
