//! GGUF files against llama.cpp: dequantization against its `gguf` package, a SentencePiece-style
//! vocabulary and SmolLM2-135M (token ids, losses, greedy continuation) against llama-cpp-python,
//! from the numbers that `fixtures/gguf/reference.py` wrote. Losses are compared with llama.cpp
//! running the model dequantized to F32, the function lemo computes. Malformed files must end in
//! one-line errors.

use std::path::{Path, PathBuf};

use burn::tensor::activation::log_softmax;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use lemo_kernels::CpuBackend;
use lemo_kernels::precision::Precision;
use lemo_models::gguf::{GgufFile, Header};
use lemo_models::tokenizer::Tokenizer;
use lemo_models::{CausalLm, KvCache, ModelConfig};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use serde_json::Value;

type B = CpuBackend;

const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// SmolLM2-135M from the cache that `cargo xtask fetch-model smollm2-135m` fills, or `None`
/// with the reason printed.
fn smollm2() -> Option<PathBuf> {
    lemo_test_support::cached_model(SMOLLM2_FILE)
}

#[test]
fn dequantizes_every_type_as_llama_cpp_does() {
    let file = GgufFile::open(&fixture("quant.gguf")).unwrap();
    let expected = read_json(&fixture("quant.json"));
    let types = expected["values"].as_object().unwrap();
    assert_eq!(types.len(), 8);
    for (name, values) in types {
        let info = &file.header.tensors[name];
        assert_eq!(info.shape(), [2, 256], "{name}");
        let found = file.dequantize(info);
        let values: Vec<f32> = serde_json::from_value(values.clone()).unwrap();
        assert_eq!(found.len(), values.len(), "{name}");
        for (index, (f, e)) in found.iter().zip(&values).enumerate() {
            assert!(
                (f - e).abs() <= 1e-6 * e.abs().max(1.0),
                "{name}[{index}]: {f} vs llama.cpp's {e}"
            );
        }
    }
}

/// A GGUF v3 file from typed metadata and F32 tensors (row-major shapes), for malformed-input
/// tests. Values are written as the format defines them, independently of the reader.
struct GgufBuilder {
    metadata: Vec<(String, u32, Vec<u8>)>,
    tensors: Vec<(String, Vec<usize>, u32, Vec<u8>)>,
}

impl GgufBuilder {
    fn new() -> Self {
        Self {
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    fn string_bytes(s: &str) -> Vec<u8> {
        let mut out = (s.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(s.as_bytes());
        out
    }

    fn string(mut self, key: &str, value: &str) -> Self {
        self.metadata
            .push((key.into(), 8, Self::string_bytes(value)));
        self
    }

    fn u32(mut self, key: &str, value: u32) -> Self {
        self.metadata
            .push((key.into(), 4, value.to_le_bytes().to_vec()));
        self
    }

    fn tensor(mut self, name: &str, shape: &[usize], type_id: u32, data: Vec<u8>) -> Self {
        self.tensors
            .push((name.into(), shape.to_vec(), type_id, data));
        self
    }

    fn f32_tensor(self, name: &str, shape: &[usize]) -> Self {
        let count: usize = shape.iter().product();
        let data = (0..count)
            .flat_map(|i| (i as f32 * 0.01).to_le_bytes())
            .collect();
        self.tensor(name, shape, 0, data)
    }

    fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, kind, value) in &self.metadata {
            out.extend(Self::string_bytes(key));
            out.extend(kind.to_le_bytes());
            out.extend(value);
        }
        let mut offset = 0u64;
        for (name, shape, type_id, data) in &self.tensors {
            out.extend(Self::string_bytes(name));
            out.extend((shape.len() as u32).to_le_bytes());
            for &dim in shape.iter().rev() {
                out.extend((dim as u64).to_le_bytes());
            }
            out.extend(type_id.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offset += (data.len() as u64).next_multiple_of(32);
        }
        for (_, _, _, data) in &self.tensors {
            out.resize(out.len().next_multiple_of(32), 0);
            out.extend(data);
        }
        out
    }
}

/// A two-layer Llama with 2 heads of 4 (hidden 8), FFN 16, vocab 10, all F32.
fn tiny_llama() -> GgufBuilder {
    let mut builder = GgufBuilder::new()
        .string("general.architecture", "llama")
        .u32("llama.block_count", 2)
        .u32("llama.context_length", 64)
        .u32("llama.embedding_length", 8)
        .u32("llama.feed_forward_length", 16)
        .u32("llama.attention.head_count", 2)
        .f32_tensor("token_embd.weight", &[10, 8])
        .f32_tensor("output_norm.weight", &[8]);
    for layer in 0..2 {
        for (name, shape) in [
            ("attn_norm", vec![8]),
            ("ffn_norm", vec![8]),
            ("attn_q", vec![8, 8]),
            ("attn_k", vec![8, 8]),
            ("attn_v", vec![8, 8]),
            ("attn_output", vec![8, 8]),
            ("ffn_gate", vec![16, 8]),
            ("ffn_up", vec![16, 8]),
            ("ffn_down", vec![8, 16]),
        ] {
            builder = builder.f32_tensor(&format!("blk.{layer}.{name}.weight"), &shape);
        }
    }
    builder
}

fn load_error(bytes: &[u8], name: &str) -> String {
    let dir = std::env::temp_dir().join(format!("lemo-gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    let result = CausalLm::<B>::from_path(&path, &Default::default(), Precision::F32);
    std::fs::remove_file(&path).unwrap();
    let message = match result {
        Ok(_) => panic!("{name} loaded"),
        Err(e) => e.to_string(),
    };
    assert!(!message.contains('\n'), "not one line: {message}");
    assert!(message.contains(name), "does not name the file: {message}");
    message
}

#[test]
fn builds_a_llama_from_metadata() {
    let dir = std::env::temp_dir().join(format!("lemo-gguf-ok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    std::fs::write(&path, tiny_llama().build()).unwrap();
    let (model, config) =
        CausalLm::<B>::from_path(&path, &Default::default(), Precision::F32).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let ModelConfig::Llama(config) = config else {
        panic!("not a Llama")
    };
    assert_eq!(
        (
            config.num_hidden_layers,
            config.hidden_size,
            config.head_dim
        ),
        (2, 8, 4)
    );
    assert_eq!((config.num_key_value_heads, config.vocab_size), (2, 10));
    assert!(config.tie_word_embeddings);
    assert_eq!(model.num_layers(), 2);
}

#[test]
fn malformed_files_end_in_one_line_errors() {
    let good = tiny_llama().build();
    let truncated = load_error(&good[..good.len() - 100], "truncated.gguf");
    assert!(truncated.contains("truncated"), "{truncated}");
    let header_cut = load_error(&good[..40], "header-cut.gguf");
    assert!(header_cut.contains("truncated"), "{header_cut}");

    let unknown_type = tiny_llama().tensor("extra", &[32], 99, vec![0; 64]).build();
    let message = load_error(&unknown_type, "unknown-type.gguf");
    assert!(message.contains("unknown ggml type id 99"), "{message}");
    let unsupported_type = tiny_llama()
        .tensor("extra", &[256], 13, vec![0; 176])
        .build();
    let message = load_error(&unsupported_type, "q5k.gguf");
    assert!(message.contains("Q5_K"), "{message}");

    let mut gpt2 = tiny_llama();
    gpt2.metadata[0] = (
        "general.architecture".into(),
        8,
        GgufBuilder::string_bytes("gpt2"),
    );
    let message = load_error(&gpt2.build(), "gpt2.gguf");
    assert!(
        message.contains("unsupported architecture \"gpt2\""),
        "{message}"
    );

    // 8 rows of 4 bytes of Q8_0: a row shorter than one 32-value block.
    let partial_block = tiny_llama()
        .tensor("extra", &[8, 4], 8, vec![0; 34])
        .build();
    let message = load_error(&partial_block, "partial-block.gguf");
    assert!(
        message.contains("not a whole number of Q8_0 blocks"),
        "{message}"
    );

    // The metadata says hidden 8 but the embedding table is 10 x 6.
    let mut wrong_shape = tiny_llama();
    wrong_shape.tensors[0] = ("token_embd.weight".into(), vec![10, 6], 0, vec![0; 240]);
    let message = load_error(&wrong_shape.build(), "wrong-shape.gguf");
    assert!(
        message.contains("token_embd.weight") && message.contains("[10, 6]"),
        "{message}"
    );
}

#[test]
fn reads_versions_2_and_3_only() {
    let mut bytes = tiny_llama().build();
    for (version, readable) in [(1u32, false), (2, true), (3, true), (4, false)] {
        bytes[4..8].copy_from_slice(&version.to_le_bytes());
        match Header::parse(&bytes) {
            Ok(header) => {
                assert!(readable, "version {version} parsed");
                assert_eq!(header.version, version);
                assert_eq!(header.tensors.len(), 20);
            }
            Err(message) => {
                assert!(!readable, "version {version}: {message}");
                assert!(
                    message.contains(&format!("GGUF version {version}")),
                    "{message}"
                );
            }
        }
    }
}

/// Random bytes, and valid files with bytes overwritten, cut short or with counts made huge,
/// must parse or fail with an error; never panic or allocate what a count claims.
#[test]
fn random_and_mutated_headers_never_panic() {
    let valid = [
        tiny_llama().build(),
        std::fs::read(fixture("quant.gguf")).unwrap(),
    ];
    let mut rng = StdRng::seed_from_u64(7);
    let mut parsed = 0;
    let mut check = |bytes: &[u8]| {
        if let Ok(header) = Header::parse(bytes) {
            parsed += 1;
            for info in header.tensors.values() {
                let data = &bytes[info.start..info.start + info.len];
                assert_eq!(
                    info.ggml_type.dequantize(data).len(),
                    info.dims.iter().product::<usize>()
                );
            }
        }
    };
    for _ in 0..2000 {
        let len = rng.random_range(0..256);
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        if rng.random_bool(0.5) && bytes.len() >= 8 {
            bytes[..4].copy_from_slice(b"GGUF");
            bytes[4..8].copy_from_slice(&3u32.to_le_bytes());
        }
        check(&bytes);
    }
    for base in &valid {
        let header_len = base.len().min(2048);
        for _ in 0..3000 {
            let mut bytes = base.clone();
            match rng.random_range(0..3) {
                0 => {
                    for _ in 0..rng.random_range(1..8) {
                        let at = rng.random_range(0..header_len);
                        bytes[at] = rng.random();
                    }
                }
                1 => bytes.truncate(rng.random_range(0..base.len())),
                _ => {
                    let at = rng.random_range(4..header_len - 8);
                    let huge =
                        [u64::MAX, u64::MAX / 2, 1 << 40, u32::MAX as u64][rng.random_range(0..4)];
                    bytes[at..at + 8].copy_from_slice(&huge.to_le_bytes());
                }
            }
            check(&bytes);
        }
    }
    // The untouched files parse, and some mutations (of tensor data, say) still do.
    assert!(parsed >= 2, "only {parsed} inputs parsed");
}

#[test]
fn smollm2_config_comes_from_the_metadata() {
    let Some(path) = smollm2() else { return };
    let file = GgufFile::open(&path).unwrap();
    let config = file.llama_config().unwrap();
    assert_eq!(
        (
            config.num_hidden_layers,
            config.hidden_size,
            config.intermediate_size
        ),
        (30, 576, 1536)
    );
    assert_eq!(
        (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim
        ),
        (9, 3, 64)
    );
    assert_eq!(
        (config.max_position_embeddings, config.vocab_size),
        (8192, 49152)
    );
    assert_eq!(config.rope.theta, 100000.0);
    assert!((config.rms_norm_eps - 1e-5).abs() < 1e-9);
    assert!(config.tie_word_embeddings);
    assert_eq!(
        (config.bos_token_id, config.eos_token_id.as_slice()),
        (Some(1), &[2][..])
    );
}

#[test]
fn smollm2_token_ids_match_llama_cpp() {
    let Some(path) = smollm2() else { return };
    let tokenizer = Tokenizer::from_file(&path).unwrap();
    assert_eq!((tokenizer.bos_id(), tokenizer.eos_id()), (Some(1), Some(2)));
    let texts = read_json(&fixture("texts.json"));
    let expected = read_json(&fixture("smollm2.json"));
    for (name, text) in texts["tokenize"].as_object().unwrap() {
        let ids = tokenizer.encode(text.as_str().unwrap()).unwrap();
        let reference: Vec<u32> =
            serde_json::from_value(expected["tokenize"][name].clone()).unwrap();
        assert_eq!(ids, reference, "{name}");
        if name != "special" {
            assert_eq!(
                tokenizer.decode(&ids),
                text.as_str().unwrap(),
                "{name} round trip"
            );
        }
    }
}

/// Every text's ids under the tokenizer of `model` equal llama.cpp's in `ids`, and decode back.
fn check_token_ids(model: &str, texts: &Value, ids: &Value) {
    let tokenizer = Tokenizer::from_file(&fixture(model)).unwrap();
    for (name, text) in texts.as_object().unwrap() {
        let text = text.as_str().unwrap();
        let found = tokenizer.encode(text).unwrap();
        let reference: Vec<u32> = serde_json::from_value(ids[name].clone()).unwrap();
        assert_eq!(found, reference, "{model} {name}: {text:?}");
        if name != "control" {
            assert_eq!(tokenizer.decode(&found), text, "{model} {name} round trip");
        }
    }
}

/// A SentencePiece-style vocabulary (byte fallback, scored merges, BOS added by default).
#[test]
fn sentencepiece_token_ids_match_llama_cpp() {
    let expected = read_json(&fixture("spm.json"));
    check_token_ids("spm.gguf", &expected["texts"], &expected["ids"]);
}

/// Byte-level BPE under GPT-2's and Llama 3's pre-tokenizers (Llama 3 adds BOS).
#[test]
fn byte_level_bpe_token_ids_match_llama_cpp() {
    let expected = read_json(&fixture("bpe.json"));
    for pre in ["gpt-2", "llama-bpe"] {
        check_token_ids(
            &format!("bpe-{pre}.gguf"),
            &expected["texts"],
            &expected["ids"][pre],
        );
    }
}

fn token_tensor(ids: &[u32]) -> Tensor<B, 2, Int> {
    let ids: Vec<i32> = ids.iter().map(|&id| id as i32).collect();
    Tensor::from_data(
        TensorData::new(ids.clone(), [1, ids.len()]),
        &Default::default(),
    )
}

#[test]
fn smollm2_losses_and_greedy_continuation_match_llama_cpp() {
    let Some(path) = smollm2() else { return };
    let (model, _) = CausalLm::<B>::from_path(&path, &Default::default(), Precision::F32).unwrap();
    let expected = read_json(&fixture("smollm2.json"));
    for (name, case) in expected["eval"].as_object().unwrap() {
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let logits = model.forward(token_tensor(&ids), None);
        let [_, len, vocab] = logits.dims();
        let log_probs = log_softmax(logits.reshape([len, vocab]), 1).slice(0..len - 1);
        let targets = token_tensor(&ids[1..]).reshape([len - 1, 1]);
        let loss: f32 = log_probs
            .gather(1, targets)
            .neg()
            .mean()
            .into_scalar()
            .elem();
        let reference = case["loss"].as_f64().unwrap();
        let relative = (f64::from(loss) - reference).abs() / reference;
        // llama.cpp's Q4_1 kernels round activations to 8 bits: a looser, informative check.
        let kernels = expected["q4_1_kernels"]["eval"][name]["loss"]
            .as_f64()
            .unwrap();
        let kernels_relative = (f64::from(loss) - kernels).abs() / kernels;
        println!(
            "{name}: loss {loss:.6}; llama.cpp on the dequantized model {reference:.6} \
             (relative {relative:.1e}), with its Q4_1 kernels {kernels:.6} ({kernels_relative:.1e})"
        );
        assert!(relative < 1e-3, "{name}: {loss} vs llama.cpp's {reference}");
        assert!(
            kernels_relative < 2e-2,
            "{name}: {loss} vs llama.cpp's Q4_1 kernels' {kernels}"
        );
    }

    let prompt: Vec<u32> = serde_json::from_value(expected["prompt_ids"].clone()).unwrap();
    let reference: Vec<u32> = serde_json::from_value(expected["greedy_32"].clone()).unwrap();
    let mut cache = KvCache::new(model.num_layers());
    let mut input = prompt;
    let mut generated = Vec::new();
    while generated.len() < reference.len() {
        let logits = model.forward(token_tensor(&input), Some(&mut cache));
        let [_, len, vocab] = logits.dims();
        let last = logits.slice([0..1, len - 1..len]).reshape([vocab]);
        let next = last.argmax(0).into_scalar().elem::<i64>() as u32;
        generated.push(next);
        input = vec![next];
    }
    assert_eq!(generated, reference);
}
