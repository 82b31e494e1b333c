//! Models against outside references: Hugging Face transformers (fixtures made by
//! `fixtures/hf/make_fixtures.py`) and llama2.c's `run.c` (reference files in ../shared/data).

use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::tensor::{Distribution, Tensor};
use lemo_kernels::CpuBackend;
use lemo_kernels::precision::Precision;
use lemo_models::lora::LLAMA_PROJECTIONS;
use lemo_models::{CausalLm, KvCache, LoraConfig};
use serde_json::Value;

use crate::common::transformers::{sequences, tokens};
use lemo_test_support::{hf_fixture, read_json};

type B = CpuBackend;

fn check_against_transformers(case: &str) {
    crate::common::transformers::assert_nll_matches_transformers(&hf_fixture(case), case);
}

/// The inverse frequencies and cos/sin multiplier each scaling kind gives at load time equal
/// the ones transformers' rotary embedding held (`expected.json`'s `reference`).
#[test]
fn rope_frequencies_match_transformers() {
    for case in [
        "llama_rope_linear",
        "llama_rope_llama3_bf16",
        "llama_rope_llama3_old_config",
        "llama_rope_yarn",
        "llama_rope_dynamic_old_config",
    ] {
        let lemo_models::ModelConfig::Llama(config) =
            lemo_models::ModelConfig::from_file(&hf_fixture(case)).unwrap()
        else {
            panic!("{case}: a Llama fixture");
        };
        let reference = &read_json(&hf_fixture(case).join("expected.json"))["reference"];
        let expected: Vec<f32> = serde_json::from_value(reference["inv_freq"].clone()).unwrap();
        let ours = config.rope.inverse_frequencies(config.head_dim, 0).unwrap();
        assert_eq!(ours.len(), expected.len(), "{case}");
        for (i, (a, b)) in ours.iter().zip(&expected).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "{case}: pair {i}: {a} vs {b}"
            );
        }
        let scaling = reference["attention_scaling"].as_f64().unwrap_or(1.0) as f32;
        assert!(
            (config.rope.attention_scaling() - scaling).abs() < 1e-6,
            "{case}"
        );
    }
}

#[test]
fn llama_gqa_tied_matches_transformers() {
    check_against_transformers("llama_gqa_tied");
}

#[test]
fn llama3_rope_scaling_bf16_sharded_matches_transformers() {
    check_against_transformers("llama_rope_llama3_bf16");
}

#[test]
fn llama3_rope_scaling_in_the_older_spelling_matches_transformers() {
    check_against_transformers("llama_rope_llama3_old_config");
}

#[test]
fn yarn_rope_scaling_matches_transformers() {
    check_against_transformers("llama_rope_yarn");
}

/// Two of the three sequences are longer than the model's 32 positions, so dynamic NTK grows
/// the base for each by its own length.
#[test]
fn dynamic_ntk_rope_scaling_matches_transformers() {
    check_against_transformers("llama_rope_dynamic_old_config");
}

#[test]
fn linear_rope_head_dim_bias_f16_matches_transformers() {
    check_against_transformers("llama_rope_linear");
}

#[test]
fn mistral_sliding_window_matches_transformers() {
    check_against_transformers("mistral_sliding_window");
}

#[test]
fn opt_pre_norm_with_projections_matches_transformers() {
    check_against_transformers("opt_prenorm_proj");
}

#[test]
fn opt_post_norm_with_projections_matches_transformers() {
    check_against_transformers("opt_postnorm_proj");
}

#[test]
fn pre_v5_llama_config_matches_transformers() {
    check_against_transformers("llama_old_config");
}

/// Greedy decoding token by token through the KV cache.
fn greedy(model: &CausalLm<B>, prompt: &[i32], new_tokens: usize) -> Vec<i32> {
    let mut cache = KvCache::new(model.num_layers());
    let mut input = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..new_tokens {
        let logits = model.forward(tokens(&input), Some(&mut cache));
        let [_, len, vocab] = logits.dims();
        let next = logits
            .slice([0..1, len - 1..len])
            .reshape([vocab])
            .argmax(0)
            .into_scalar() as i32;
        out.push(next);
        input = vec![next];
    }
    out
}

#[test]
fn greedy_decoding_with_kv_cache_matches_transformers() {
    let case = "llama_gqa_tied";
    let (model, _) =
        CausalLm::<B>::from_path(&hf_fixture(case), &Default::default(), Precision::F32).unwrap();
    let reference = &read_json(&hf_fixture(case).join("expected.json"))["greedy"];
    let prompt: Vec<i32> = serde_json::from_value(reference["prompt"].clone()).unwrap();
    let expected: Vec<i32> = serde_json::from_value(reference["new_tokens"].clone()).unwrap();
    assert_eq!(greedy(&model, &prompt, expected.len()), expected);
}

#[test]
fn stories260k_logits_match_llama2c() {
    let Some(data) = lemo_test_support::shared_data() else {
        return;
    };
    let dir = data.join("models/stories260K");
    let (model, _) = CausalLm::<B>::from_path(
        &dir.join("stories260K.bin"),
        &Default::default(),
        Precision::F32,
    )
    .unwrap();
    let golden = read_json(&dir.join("golden_logits_once_upon_a_time.json"));
    let ids: Vec<i32> = serde_json::from_value(golden["tokens"].clone()).unwrap();
    let expected: Vec<Vec<f32>> = serde_json::from_value(golden["logits"].clone()).unwrap();
    let logits = model.forward(tokens(&ids), None);
    let [_, len, vocab] = logits.dims();
    let ours: Vec<f32> = logits.reshape([len * vocab]).into_data().to_vec().unwrap();
    for (position, row) in expected.iter().enumerate() {
        for (id, &reference) in row.iter().enumerate() {
            let value = ours[position * vocab + id];
            assert!(
                (value - reference).abs() < 1e-3,
                "position {position}, token {id}: {value} vs {reference}"
            );
        }
    }
}

#[test]
fn stories260k_greedy_text_matches_llama2c() {
    let Some(data) = lemo_test_support::shared_data() else {
        return;
    };
    let dir = data.join("models/stories260K");
    let (model, _) = CausalLm::<B>::from_path(
        &dir.join("stories260K.bin"),
        &Default::default(),
        Precision::F32,
    )
    .unwrap();
    let tokenizer = lemo_models::tokenizer::Tokenizer::from_file(&dir.join("tok512.bin")).unwrap();
    let expected = std::fs::read_to_string(dir.join("expected_greedy_once_upon.txt")).unwrap();
    let generated = greedy(&model, &[1], 80);
    let ids: Vec<u32> = std::iter::once(1)
        .chain(generated.iter().map(|&id| id as u32))
        .collect();
    let text = tokenizer.decode(&ids);
    let common = text.len().min(expected.trim_end().len());
    assert!(common > 200, "generated only {text:?}");
    assert_eq!(&text[..common], &expected.trim_end()[..common]);
}

/// A model with LoRA on every Llama projection and a random (non-zero) `lora_B`.
fn model_with_random_lora(config: &LoraConfig) -> CausalLm<B> {
    lemo_test_support::seed_backend::<B>(&Default::default());
    let (model, _) = CausalLm::<B>::from_path(
        &hf_fixture("llama_gqa_tied"),
        &Default::default(),
        Precision::F32,
    )
    .unwrap();
    let mut model = model.with_new_lora(config, 0).unwrap();
    for lora in model
        .projections_mut()
        .into_iter()
        .filter_map(|(_, linear)| linear.lora.as_mut())
    {
        let shape = lora.b.dims();
        lora.b = Param::from_tensor(Tensor::random(
            shape,
            Distribution::Normal(0.0, 0.1),
            &Default::default(),
        ));
    }
    model
}

fn all_projections() -> LoraConfig {
    LoraConfig {
        target_modules: LLAMA_PROJECTIONS.map(String::from).to_vec(),
        ..LoraConfig::default()
    }
}

fn max_difference(a: Tensor<B, 3>, b: Tensor<B, 3>) -> f32 {
    (a - b).abs().max().into_scalar()
}

#[test]
fn fresh_lora_starts_at_the_base_model_and_merging_preserves_outputs() {
    let ids = &sequences("llama_gqa_tied")[0];
    let (base, _) = CausalLm::<B>::from_path(
        &hf_fixture("llama_gqa_tied"),
        &Default::default(),
        Precision::F32,
    )
    .unwrap();
    let fresh = base.clone().with_new_lora(&all_projections(), 0).unwrap();
    assert!(
        max_difference(
            base.forward(tokens(ids), None),
            fresh.forward(tokens(ids), None)
        ) < 1e-5
    );

    let adapted = model_with_random_lora(&all_projections());
    let with_adapter = adapted.forward(tokens(ids), None);
    assert!(
        max_difference(with_adapter.clone(), base.forward(tokens(ids), None)) > 1e-2,
        "adapter had no effect"
    );
    let merged = adapted.merge_lora().forward(tokens(ids), None);
    assert!(max_difference(with_adapter, merged) < 1e-4);
}

#[test]
fn adapters_round_trip_through_the_peft_layout() {
    let config = LoraConfig {
        rank: 4,
        alpha: 8.0,
        ..LoraConfig::default()
    };
    let adapted = model_with_random_lora(&config);
    let dir = std::env::temp_dir().join(format!("lemo-adapter-test-{}", std::process::id()));
    adapted.save_adapter(&dir, &config, "fixture").unwrap();

    let saved = read_json(&dir.join("adapter_config.json"));
    assert_eq!(saved["peft_type"], "LORA");
    assert_eq!(saved["r"], 4);
    let bytes = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let a = tensors
        .tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
        .unwrap();
    assert_eq!(a.shape(), [4, 48]);
    assert_eq!(tensors.len(), 2 * 2 * 4, "A and B for q/k/v/o in 2 layers");

    let (base, _) = CausalLm::<B>::from_path(
        &hf_fixture("llama_gqa_tied"),
        &Default::default(),
        Precision::F32,
    )
    .unwrap();
    let (loaded, loaded_config) = base.load_adapter(&dir).unwrap();
    assert_eq!(loaded_config.rank, 4);
    let ids = &sequences("llama_gqa_tied")[1];
    assert!(
        max_difference(
            adapted.forward(tokens(ids), None),
            loaded.forward(tokens(ids), None)
        ) < 1e-6
    );
    std::fs::remove_dir_all(dir).unwrap();
}

fn copy_hf_fixture(case: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lemo-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(hf_fixture(case)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    dir
}

fn load_error(path: &Path) -> String {
    CausalLm::<B>::from_path(path, &Default::default(), Precision::F32)
        .expect_err("loading should fail")
        .to_string()
}

#[test]
fn bf16_on_a_backend_without_it_is_an_error() {
    let error = CausalLm::<B>::from_path(
        &hf_fixture("llama_gqa_tied"),
        &Default::default(),
        Precision::MIXED_BF16,
    )
    .expect_err("ndarray has no bf16");
    assert!(error.to_string().contains("BF16"), "{error}");
}

#[test]
fn bad_checkpoints_give_one_line_errors_naming_the_problem() {
    let truncated = copy_hf_fixture("llama_gqa_tied", "truncated");
    let weights = truncated.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let message = load_error(&truncated);
    assert!(
        message.contains("truncated or corrupt") && message.contains("model.safetensors"),
        "{message}"
    );

    let mismatched = copy_hf_fixture("llama_gqa_tied", "mismatch");
    let config_path = mismatched.join("config.json");
    let mut config = read_json(&config_path);
    config["intermediate_size"] = Value::from(999);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let message = load_error(&mismatched);
    assert!(
        message.contains("mismatch") && message.contains("gate_proj"),
        "{message}"
    );

    config["model_type"] = Value::from("gpt2");
    config["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    std::fs::write(&config_path, config.to_string()).unwrap();
    assert!(load_error(&mismatched).contains("unsupported architecture"));

    assert!(load_error(Path::new("/nonexistent/model")).contains("/nonexistent/model"));
    for message in [load_error(&truncated), load_error(&mismatched)] {
        assert_eq!(message.lines().count(), 1, "{message}");
    }
    std::fs::remove_dir_all(truncated).unwrap();
    std::fs::remove_dir_all(mismatched).unwrap();
}
