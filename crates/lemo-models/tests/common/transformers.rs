//! Fixtures made with transformers (`fixtures/hf/make_fixtures.py`) and scoring against them.

use std::path::Path;

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use lemo_kernels::CpuBackend;
use lemo_kernels::precision::Precision;
use lemo_models::CausalLm;
use serde_json::Value;

type B = CpuBackend;

use lemo_test_support::{hf_fixture, read_json};

pub fn sequences(case: &str) -> Vec<Vec<i32>> {
    std::fs::read_to_string(hf_fixture(case).join("tokens.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_value(read_json_str(line)["input_ids"].clone()).unwrap())
        .collect()
}

pub fn read_json_str(text: &str) -> Value {
    serde_json::from_str(text).unwrap()
}

pub fn tokens(ids: &[i32]) -> Tensor<B, 2, Int> {
    Tensor::from_data(
        TensorData::new(ids.to_vec(), [1, ids.len()]),
        &Default::default(),
    )
}

/// `-log p(ids[t+1] | ids[..=t])` for every t.
pub fn per_token_nll(model: &CausalLm<B>, ids: &[i32]) -> Vec<f32> {
    let logits = model.forward(tokens(ids), None);
    let [_, len, vocab] = logits.dims();
    let log_probs = log_softmax(logits.reshape([len, vocab]), 1).slice(0..len - 1);
    let targets = tokens(&ids[1..]).reshape([len - 1, 1]);
    log_probs
        .gather(1, targets)
        .neg()
        .into_data()
        .to_vec()
        .unwrap()
}

/// Every next-token log-loss of every sequence of fixture `case`, scored by the model at
/// `model` (the fixture itself, or an export of it), within 1e-3 of transformers' (a much finer
/// check than the mean loss, in which per-token errors partly cancel).
pub fn assert_nll_matches_transformers(model: &Path, case: &str) {
    let (model, _) = CausalLm::<B>::from_path(model, &Default::default(), Precision::F32).unwrap();
    let expected = read_json(&hf_fixture(case).join("expected.json"));
    let expected_nll: Vec<Vec<f64>> =
        serde_json::from_value(expected["per_token_nll"].clone()).unwrap();
    let sequences = sequences(case);
    assert_eq!(sequences.len(), expected_nll.len());
    let (mut total, mut count) = (0.0f64, 0usize);
    for (ids, reference) in sequences.iter().zip(&expected_nll) {
        let ours = per_token_nll(&model, ids);
        assert_eq!(ours.len(), reference.len());
        for (t, (a, b)) in ours.iter().zip(reference).enumerate() {
            assert!(
                (*a as f64 - b).abs() < 1e-3,
                "{case}: token {t}: ours {a}, transformers {b}"
            );
        }
        total += ours.iter().map(|&v| v as f64).sum::<f64>();
        count += ours.len();
    }
    let loss = expected["loss"].as_f64().unwrap();
    assert!(
        ((total / count as f64) - loss).abs() / loss < 1e-4,
        "{case}: mean loss {} vs {loss}",
        total / count as f64
    );
}
