//! Bounded fuzzing of every file loader (llama2.c checkpoints and tokenizers, safetensors,
//! Hugging Face tokenizer.json, model config.json): random bytes, and valid files with bytes
//! overwritten, cut short or with counts made huge, must load or fail with a one-line error;
//! never panic, and never ask for an allocation much larger than the file. GGUF has its own in
//! `gguf.rs`. Each loader runs a few thousand inputs in about a second.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};

use lemo_models::llama2c::Llama2cCheckpoint;
use lemo_models::tokenizer::Tokenizer;
use lemo_models::weights::{SafetensorsWeights, WeightSource};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use safetensors::{Dtype, tensor::TensorView};

/// The system allocator, recording the largest single request of the current thread (tests
/// run on their own threads, so each sees only its own loader's requests).
struct LargestRequest;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for LargestRequest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(layout.size())));
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(new_size)));
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: LargestRequest = LargestRequest;

/// Allocations a loader may make beyond the file's size: decoded f32 copies of 2-byte data,
/// hash tables and the like, plus a fixed allowance (the tokenizers crate's caches take a few
/// MB whatever the file).
const ALLOWED_GROWTH: usize = 16;
const ALLOWED_FIXED: usize = 16 << 20;

/// Writes each input to a file named `name` and hands it to `load`, which returns whether it
/// loaded; panics are failures, and so is any single allocation past the allowance.
struct Fuzzer {
    dir: tempfile::TempDir,
    name: &'static str,
    /// Bytes of files the loader reads beside the fuzzed one (a config's weights).
    companion_bytes: usize,
    loaded: usize,
    rejected: usize,
}

impl Fuzzer {
    fn new(name: &'static str) -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            name,
            companion_bytes: 0,
            loaded: 0,
            rejected: 0,
        }
    }

    fn check(&mut self, bytes: &[u8], load: &dyn Fn(&Path) -> Result<(), String>) {
        let path = self.dir.path().join(self.name);
        std::fs::write(&path, bytes).unwrap();
        LARGEST.with(|l| l.set(0));
        match load(&path) {
            Ok(()) => self.loaded += 1,
            Err(message) => {
                assert!(!message.contains('\n'), "not one line: {message}");
                self.rejected += 1;
            }
        }
        let largest = LARGEST.with(Cell::get);
        assert!(
            largest <= ALLOWED_GROWTH * (bytes.len() + self.companion_bytes) + ALLOWED_FIXED,
            "{}: a {}-byte input made a {largest}-byte allocation",
            self.name,
            bytes.len()
        );
    }

    /// `rounds` random inputs and `rounds` mutations of each valid file, all seeded.
    fn run(
        &mut self,
        valid: &[Vec<u8>],
        rounds: usize,
        load: &dyn Fn(&Path) -> Result<(), String>,
    ) {
        let seed = lemo_test_support::seed();
        let mut rng = StdRng::seed_from_u64(seed);
        for _ in 0..rounds {
            let len = rng.random_range(0..512);
            let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            self.check(&bytes, load);
        }
        for base in valid {
            self.check(base, load);
            for _ in 0..rounds {
                self.check(&mutate(base, &mut rng), load);
            }
        }
        assert!(self.rejected > 0);
        assert!(
            self.loaded >= valid.len(),
            "{}: the valid files did not load",
            self.name
        );
    }
}

/// A copy of `base` with a few bytes of its first 2 KB overwritten, cut short, or with a
/// 4- or 8-byte field set to a huge value.
fn mutate(base: &[u8], rng: &mut StdRng) -> Vec<u8> {
    let mut bytes = base.to_vec();
    let header_len = base.len().min(2048);
    match rng.random_range(0..4) {
        0 => {
            for _ in 0..rng.random_range(1..8) {
                bytes[rng.random_range(0..header_len)] = rng.random();
            }
        }
        1 => bytes.truncate(rng.random_range(0..base.len())),
        2 => {
            let at = rng.random_range(0..header_len - 8);
            let huge = [u64::MAX, u64::MAX / 2, 1 << 40, u32::MAX as u64][rng.random_range(0..4)];
            bytes[at..at + 8].copy_from_slice(&huge.to_le_bytes());
        }
        _ => {
            let at = rng.random_range(0..header_len - 4);
            let huge = [i32::MAX, i32::MIN, -1, 0x2020_2020][rng.random_range(0..4)];
            bytes[at..at + 4].copy_from_slice(&huge.to_le_bytes());
        }
    }
    bytes
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn one_line<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// A llama2.c checkpoint of a tiny model: dim 8, hidden 16, 2 layers, 2 heads, vocab 32,
/// 16 positions, unshared classifier.
fn tiny_llama2c() -> Vec<u8> {
    let (dim, hidden, layers, heads, vocab, positions) = (8, 16, 2, 2, 32, 16);
    let mut bytes: Vec<u8> = [dim, hidden, layers, heads, heads, -vocab, positions]
        .iter()
        .flat_map(|v: &i32| v.to_le_bytes())
        .collect();
    let (dim, hidden, layers, vocab, positions) = (
        dim as usize,
        hidden as usize,
        layers as usize,
        vocab as usize,
        positions as usize,
    );
    let head_dim = dim / heads as usize;
    let elements = vocab * dim
        + layers * (2 * dim + 4 * dim * dim + 3 * hidden * dim)
        + dim
        + positions * head_dim
        + vocab * dim;
    bytes.extend((0..elements).flat_map(|i| ((i % 7) as f32 * 0.01).to_le_bytes()));
    bytes
}

#[test]
fn llama2c_checkpoints() {
    let valid = tiny_llama2c();
    let mut spaces_header = vec![b' '; 4096];
    spaces_header.extend_from_slice(&valid);
    let load = |path: &Path| -> Result<(), String> {
        let mut checkpoint = Llama2cCheckpoint::open(path).map_err(one_line)?;
        let dim = checkpoint.config().hidden_size;
        checkpoint
            .fetch("model.norm.weight", &[dim])
            .map_err(one_line)?;
        Ok(())
    };
    let mut fuzzer = Fuzzer::new("model.bin");
    fuzzer.check(&spaces_header, &load);
    assert_eq!(fuzzer.rejected, 1, "a header of spaces must be refused");
    fuzzer.run(&[valid], 2000, &load);
}

/// A llama2.c tokenizer: `<unk>`, `<s>`, `</s>`, the 256 byte pieces, `" "` and a few words.
fn tiny_llama2c_tokenizer() -> Vec<u8> {
    let mut pieces: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    pieces.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    pieces.extend([" ", "a", "b", "ab", " ab"].map(String::from));
    let mut bytes = 8i32.to_le_bytes().to_vec();
    for (i, piece) in pieces.iter().enumerate() {
        bytes.extend((i as f32 * -0.5).to_le_bytes());
        bytes.extend((piece.len() as i32).to_le_bytes());
        bytes.extend(piece.as_bytes());
    }
    bytes
}

fn load_tokenizer(path: &Path) -> Result<(), String> {
    let tokenizer = Tokenizer::from_file(path).map_err(one_line)?;
    let ids = tokenizer.encode("ab ba").map_err(one_line)?;
    tokenizer.decode(&ids);
    Ok(())
}

#[test]
fn llama2c_tokenizers() {
    Fuzzer::new("tokenizer.bin").run(&[tiny_llama2c_tokenizer()], 2000, &load_tokenizer);
}

#[test]
fn hugging_face_tokenizers() {
    let valid = std::fs::read(fixture("tokenizer/byte_level_tokenizer.json")).unwrap();
    Fuzzer::new("tokenizer.json").run(&[valid], 300, &load_tokenizer);
}

fn safetensors_file() -> Vec<u8> {
    let values: Vec<u8> = (0..24).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let halves: Vec<u8> = (0..6)
        .flat_map(|i| half::bf16::from_f32(i as f32).to_le_bytes())
        .collect();
    let views = vec![
        (
            "a".to_string(),
            TensorView::new(Dtype::F32, vec![4, 6], &values).unwrap(),
        ),
        (
            "b".to_string(),
            TensorView::new(Dtype::BF16, vec![6], &halves).unwrap(),
        ),
    ];
    safetensors::serialize(views, None).unwrap()
}

#[test]
fn safetensors_weights() {
    let load = |path: &Path| -> Result<(), String> {
        let mut weights = SafetensorsWeights::open(path).map_err(one_line)?;
        weights.fetch("a", &[4, 6]).map_err(one_line)?;
        weights.fetch("b", &[6]).map_err(one_line)?;
        Ok(())
    };
    Fuzzer::new("model.safetensors").run(&[safetensors_file()], 2000, &load);
}

/// Every number of a valid config.json set to 0 and to huge values, then the generic
/// mutations: the loader must refuse what the weights do not match before sizing anything
/// from it.
#[test]
fn model_configs() {
    let fixture = fixture("hf/llama_gqa_tied");
    let valid = std::fs::read(fixture.join("config.json")).unwrap();
    let weights = fixture.join("model.safetensors");
    let load = |path: &Path| -> Result<(), String> {
        let folder = path.parent().unwrap();
        if !folder.join("model.safetensors").exists() {
            std::fs::copy(&weights, folder.join("model.safetensors")).unwrap();
        }
        lemo_models::CausalLm::<lemo_kernels::CpuBackend>::from_path(
            folder,
            &Default::default(),
            lemo_kernels::precision::Precision::F32,
        )
        .map(drop)
        .map_err(one_line)
    };
    let mut fuzzer = Fuzzer::new("config.json");
    fuzzer.companion_bytes = std::fs::metadata(&weights).unwrap().len() as usize;
    let config: serde_json::Value = serde_json::from_slice(&valid).unwrap();
    for (key, value) in config.as_object().unwrap() {
        if !value.is_number() {
            continue;
        }
        for huge in [0u64, 1 << 31, 1 << 40, u64::MAX] {
            let mut changed = config.clone();
            changed[key] = huge.into();
            fuzzer.check(&serde_json::to_vec(&changed).unwrap(), &load);
        }
    }
    fuzzer.run(&[valid], 150, &load);
}
