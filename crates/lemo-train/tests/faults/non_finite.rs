//! Non-finite numbers: a run whose loss or adapter diverges stops with an error and saves
//! nothing as final; NaN weights of an adapter are refused by the commands that read it.

use std::path::Path;

use crate::{case, check_all, id_documents, lemo, llama_fixture, path};

fn train_args<'a>(model: &'a str, data: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--model",
        model,
        "--data",
        data,
        "--seq-len",
        "16",
        "--steps",
        "3",
        "--warmup-steps",
        "0",
        "--val-every",
        "0",
        "--checkpoint-every",
        "0",
        "--cache-dir",
        "none",
        "--device",
        "cpu",
        "--out",
        out,
    ]
}

#[test]
fn diverging_training_stops_with_an_error_and_no_final_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let (fixture, tokens) = llama_fixture();
    for (index, extra) in [
        &["--lr", "1e30"][..],
        &["--lr", "1e38", "--max-grad-norm", "0"][..],
    ]
    .iter()
    .enumerate()
    {
        let out = dir.path().join(format!("run{index}"));
        let args = [
            &train_args(path(&fixture), path(&tokens), path(&out))[..],
            extra,
        ]
        .concat();
        println!("{args:?}");
        lemo_test_support::assert_error_line(&lemo(&args), "became");
        assert!(
            !out.join("adapter").exists(),
            "{extra:?}: a diverged run wrote a final adapter"
        );
    }
}

/// Every value of every tensor of `file` replaced by NaN.
fn poison(file: &Path) {
    let bytes = std::fs::read(file).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let poisoned: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32);
            let count = view.data().len() / 4;
            let values = f32::NAN.to_le_bytes().repeat(count);
            (name, values, view.shape().to_vec())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = poisoned
        .iter()
        .map(|(name, values, shape)| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                shape.clone(),
                values,
            )
            .unwrap();
            (name.clone(), view)
        })
        .collect();
    std::fs::write(file, safetensors::serialize(views, None).unwrap()).unwrap();
}

#[test]
fn an_adapter_with_nan_weights_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let (fixture, tokens) = llama_fixture();
    let run = dir.join("run");
    let mut args = train_args(path(&fixture), path(&tokens), path(&run));
    args[8] = "1"; // --steps 1
    let output = lemo(&args);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let adapter = run.join("adapter");
    poison(&adapter.join("adapter_model.safetensors"));
    let (model, adapter) = (path(&fixture), path(&adapter));
    let data = id_documents(dir, 2, 40);
    check_all([
        case(
            &[
                "merge",
                "--model",
                model,
                "--adapter",
                adapter,
                "--out",
                path(&dir.join("merged")),
            ],
            "diverged",
        )
        .watching(dir),
        case(
            &[
                "eval",
                "--model",
                model,
                "--adapter",
                adapter,
                "--data",
                tokens.to_str().unwrap(),
                "--device",
                "cpu",
            ],
            "diverged",
        )
        .watching(dir),
        case(
            &[
                "calibrate",
                "--model",
                model,
                "--adapter",
                adapter,
                "--data",
                path(&data),
                "--seq-len",
                "32",
                "--block-size",
                "8",
                "--device",
                "cpu",
                "--out",
                path(&dir.join("thresholds.json")),
            ],
            "diverged",
        )
        .watching(dir),
    ]);
}
