//! What the lemo crates' tests share: one seed per test run (fixed by default, printed,
//! overridable with `LEMO_TEST_SEED`), a host-side generator that follows it, the relative-error
//! check for tensors, where the fixtures and the optional shared data (real models, books) are
//! found, and the checks of a command-line run (its JSON output, its one-line errors).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, ElementConversion, Int, Tensor, TensorData};

/// The seed tests use unless `LEMO_TEST_SEED` says otherwise.
pub const DEFAULT_SEED: u64 = 20_251_120;

/// The test seed: `LEMO_TEST_SEED` when set, else [`DEFAULT_SEED`]; printed so that a failure
/// under another seed can be rerun.
pub fn seed() -> u64 {
    let seed = match std::env::var("LEMO_TEST_SEED") {
        Ok(value) => value.parse().expect("LEMO_TEST_SEED must be an integer"),
        Err(_) => DEFAULT_SEED,
    };
    println!("seed {seed} (rerun with LEMO_TEST_SEED={seed})");
    seed
}

/// Held by every test of a crate that draws from a backend's generator (one per process, shared
/// by the test threads) where what it asserts depends on the values drawn, such as a training
/// run reaching some recall: without it, draws of tests running in parallel interleave, and a
/// seed no longer reproduces the data. Tests that draw but assert identities need it only when
/// a seeded test of the same crate runs beside them.
pub fn exclusive_generator() -> std::sync::MutexGuard<'static, ()> {
    static GENERATOR: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A failed test poisons the lock; the generator is still usable.
    GENERATOR
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Seeds `B`'s generator on `device` with [`seed`] and returns the seed.
pub fn seed_backend<B: Backend>(device: &B::Device) -> u64 {
    let seed = seed();
    B::seed(device, seed);
    seed
}

/// Standard normal samples of `shape` from the backend's (seeded) generator.
pub fn random<B: Backend, const D: usize>(shape: [usize; D], device: &B::Device) -> Tensor<B, D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

/// SplitMix64: host-side choices (index sets, sizes) that follow the printed seed.
pub struct HostRng(u64);

impl HostRng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// `count` strictly increasing positions in `0..seq` for each of `batch` sequences, each
/// sequence its own (`[batch, count]`, printed): kept or dropped rows of a token-sparse block.
pub fn random_rows<B: Backend>(
    rng: &mut HostRng,
    batch: usize,
    seq: usize,
    count: usize,
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    let mut rows = Vec::with_capacity(batch * count);
    for _ in 0..batch {
        let mut positions: Vec<usize> = (0..seq).collect();
        for i in 0..count {
            let j = i + rng.below(seq - i);
            positions.swap(i, j);
        }
        let mut chosen = positions[..count].to_vec();
        chosen.sort_unstable();
        rows.extend(chosen.into_iter().map(|row| row as i32));
    }
    println!("rows {rows:?}");
    Tensor::from_data(TensorData::new(rows, [batch, count]), device)
}

/// `max |actual - expected| / max |expected|`.
pub fn relative_error<B: Backend, const D: usize>(
    actual: Tensor<B, D>,
    expected: Tensor<B, D>,
) -> f32 {
    let scale: f32 = expected.clone().abs().max().into_scalar().elem();
    let error: f32 = (actual - expected).abs().max().into_scalar().elem();
    error / scale.max(1e-12)
}

/// Asserts equal shapes and a relative error (see [`relative_error`]) of at most `tolerance`,
/// printing it; `0.0` asks for bit-equal results. An all-zero expectation fails: it would hide
/// an output that was never written.
pub fn assert_close<B: Backend, const D: usize>(
    what: &str,
    actual: Tensor<B, D>,
    expected: Tensor<B, D>,
    tolerance: f32,
) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shapes differ");
    let scale: f32 = expected.clone().abs().max().into_scalar().elem();
    assert!(scale > 0.0, "{what}: the expected tensor is all zeros");
    let error = relative_error(actual, expected);
    println!("{what}: relative error {error:.2e}");
    assert!(
        error <= tolerance,
        "{what}: relative error {error} over {tolerance}"
    );
}

/// Asserts `|actual - expected| <= tolerance * |expected|` for scalars.
pub fn assert_close_scalar(what: &str, actual: f64, expected: f64, tolerance: f64) {
    let error = (actual - expected).abs() / expected.abs().max(1e-12);
    assert!(
        error <= tolerance,
        "{what}: {actual} vs {expected}, relative error {error:.2e} over {tolerance}"
    );
}

/// The repository's root folder.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The shared data (real models and corpora, never in the repository) beside the repository,
/// `../shared/data`, or `$LEMO_SHARED_DATA`; `None`, with a note that the test skips, when
/// absent.
pub fn shared_data() -> Option<PathBuf> {
    let path = std::env::var_os("LEMO_SHARED_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("../shared/data"));
    if path.is_dir() {
        Some(path)
    } else {
        println!("skipping: {} not found", path.display());
        None
    }
}

/// `file` from the model cache that `cargo xtask fetch-model` fills (`$LEMO_MODEL_CACHE`, else
/// `~/.cache/lemo/models`); `None`, with a note that the test skips, when it is not there.
pub fn cached_model(file: &str) -> Option<PathBuf> {
    let cache = std::env::var_os("LEMO_MODEL_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/lemo/models"))
        })?;
    let path = cache.join(file);
    if path.is_file() {
        Some(path)
    } else {
        println!(
            "skipping: {file} is not in the model cache {} (run `cargo xtask fetch-model`)",
            cache.display()
        );
        None
    }
}

/// A tiny random-init Hugging Face model saved by transformers, with its losses
/// (`crates/lemo-models/tests/fixtures/hf/{case}`).
pub fn hf_fixture(case: &str) -> PathBuf {
    repo_root()
        .join("crates/lemo-models/tests/fixtures/hf")
        .join(case)
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
