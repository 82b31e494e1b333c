//! What the lemo crates' tests share: one seed per test run (fixed by default, printed,
//! overridable with `LEMO_TEST_SEED`), a host-side generator that follows it, the relative-error
//! check for tensors, where the fixtures and the optional shared data (real models, books) are
//! found ([`files`]), how a test that cannot run says so ([`skip`]), and the checks of a
//! command-line run ([`cli`]).

pub mod cli;
pub mod files;
pub mod skip;

pub use cli::{
    SHORT_TRAINING, assert_clean_error, assert_error_line, path, run, run_ok, run_within,
    stdout_json,
};
pub use files::{
    gradient_fixture, hf_fixture, read_json, read_safetensors, repo_root, shared_data,
    smollm2_gguf, snapshot,
};
pub use skip::skip;

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

/// Asserts `max |actual - expected| <= tolerance * max |expected|` for host values of one
/// tensor, printing the relative error; an all-zero expectation fails, as in [`assert_close`].
pub fn assert_close_values(what: &str, actual: &[f32], expected: &[f32], tolerance: f64) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    let scale = expected.iter().fold(0f64, |m, &e| m.max((e as f64).abs()));
    assert!(scale > 0.0, "{what}: the expected values are all zeros");
    let error = actual
        .iter()
        .zip(expected)
        .fold(0f64, |m, (&a, &e)| m.max((a as f64 - e as f64).abs()))
        / scale;
    println!("{what}: relative error {error:.2e}");
    assert!(
        error <= tolerance,
        "{what}: relative error {error:.2e} over {tolerance}"
    );
}

/// Token ids uniform in `0..vocab`, `[batch, len]`, from the backend's (seeded) generator.
pub fn random_tokens<B: Backend>(
    vocab: usize,
    shape: [usize; 2],
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    Tensor::random(shape, Distribution::Uniform(0.0, vocab as f64), device)
}
