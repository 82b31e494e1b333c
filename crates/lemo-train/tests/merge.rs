//! `lemo-train merge`: a merged model scores as its base does through the adapter (`eval
//! --adapter`), as a Hugging Face folder and as GGUF, for a Hugging Face base (LongLoRA adapter:
//! embeddings and norms trained too, RoPE scaling recorded) and for stories260K (llama2.c); bad
//! input ends in one line.

use std::path::{Path, PathBuf};
use std::process::Output;

use lemo_test_support::{
    SHORT_TRAINING, assert_clean_error, assert_close_scalar, hf_fixture, path, stdout_json,
};
use serde_json::Value;

fn lemo(args: &[&str]) -> Output {
    lemo_test_support::run(env!("CARGO_BIN_EXE_lemo-train"), args)
}

fn succeed(args: &[&str]) -> Output {
    lemo_test_support::run_ok(env!("CARGO_BIN_EXE_lemo-train"), args)
}

/// `eval --json` loss of `model` on `data` (windows of `seq_len`), with `extra` options.
fn loss(model: &Path, data: &Path, seq_len: &str, extra: &[&str]) -> f64 {
    let args = [
        &["eval", "--model", path(model), "--data", path(data)][..],
        &[
            "--seq-len",
            seq_len,
            "--stride",
            seq_len,
            "--device",
            "cpu",
            "--json",
        ],
        extra,
    ]
    .concat();
    stdout_json(&lemo(&args))["loss"].as_f64().unwrap()
}

/// Trains a LongLoRA adapter (LoRA plus embeddings and norms) on the Llama fixture for a context
/// twice its trained one; returns the adapter folder.
fn train_fixture_adapter(dir: &Path) -> PathBuf {
    let fixture = hf_fixture("llama_gqa_tied");
    let run = dir.join("run");
    let tokens = fixture.join("tokens.jsonl");
    let head = [
        "train",
        "--model",
        path(&fixture),
        "--data",
        path(&tokens),
        "--method",
        "longlora",
        "--target-context",
        "256",
        "--seq-len",
        "32",
    ];
    let tail = ["--device", "cpu", "--out", path(&run)];
    succeed(&[&head[..], &SHORT_TRAINING, &tail].concat());
    run.join("adapter")
}

#[test]
fn a_merged_fixture_scores_as_eval_with_the_adapter_in_safetensors_and_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = hf_fixture("llama_gqa_tied");
    let data = fixture.join("tokens.jsonl");
    let adapter = train_fixture_adapter(dir.path());
    let out = dir.path().join("merged");
    let output = succeed(&[
        "merge",
        "--model",
        path(&fixture),
        "--adapter",
        path(&adapter),
        "--out",
        path(&out),
        "--gguf",
        "f16",
        "--max-shard-mb",
        "0.05",
    ]);
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), path(&out));
    // 0.05 MB shards: the fixture's 0.2 MB of weights is sharded, with an index.
    assert!(out.join("model.safetensors.index.json").exists());
    assert!(!out.join("model.safetensors").exists());
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["rope_parameters"]["rope_type"], "linear");
    assert_eq!(config["rope_parameters"]["factor"], 2.0);

    let with_adapter = loss(&fixture, &data, "64", &["--adapter", path(&adapter)]);
    let base = loss(&fixture, &data, "64", &["--target-context", "256"]);
    let merged = loss(&out, &data, "64", &[]);
    let gguf = loss(&out.join("model-f16.gguf"), &data, "64", &[]);
    println!("base {base}, adapter {with_adapter}, merged {merged}, gguf f16 {gguf}");
    assert!(
        (with_adapter - base).abs() > 1e-3,
        "the adapter changes the model"
    );
    assert_close_scalar("merged", merged, with_adapter, 1e-5);
    assert_close_scalar("gguf f16", gguf, with_adapter, 2e-3);

    // Refused: an --out that holds files, unless --overwrite.
    let again = [
        "merge",
        "--model",
        path(&fixture),
        "--adapter",
        path(&adapter),
        "--out",
        path(&out),
    ];
    assert_clean_error(&lemo(&again), "--overwrite");
    succeed(&[&again[..], &["--overwrite"]].concat());
    assert!(out.join("model.safetensors").exists());
    assert!(
        !out.join("model.safetensors.index.json").exists() && !out.join("model-f16.gguf").exists(),
        "--overwrite removes the earlier merged files"
    );
}

#[test]
fn bad_merges_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let adapter = train_fixture_adapter(dir.path());
    let fixture = hf_fixture("llama_gqa_tied");
    let merge = |model: &Path, adapter: &Path, out: &Path, extra: &[&str]| {
        let args = [
            &["merge", "--model", path(model), "--adapter", path(adapter)][..],
            &["--out", path(out)],
            extra,
        ]
        .concat();
        lemo(&args)
    };
    let out = dir.path().join("out");
    assert_clean_error(
        &merge(&fixture, &dir.path().join("none"), &out, &[]),
        "no such adapter folder",
    );
    assert_clean_error(
        &merge(&dir.path().join("none"), &adapter, &out, &[]),
        "no such file or folder",
    );
    // Trained on another model: the projections' shapes differ.
    assert_clean_error(
        &merge(&hf_fixture("llama_rope_linear"), &adapter, &out, &[]),
        "an adapter for another model?",
    );
    assert_clean_error(
        &merge(&hf_fixture("opt_prenorm_proj"), &adapter, &out, &[]),
        "an adapter for another model?",
    );
    assert!(
        !out.exists(),
        "nothing is written before the inputs check out"
    );
    let file = dir.path().join("file");
    std::fs::write(&file, "").unwrap();
    assert_clean_error(
        &merge(&fixture, &adapter, &file.join("sub"), &[]),
        "file/sub",
    );
    let not_an_adapter = dir.path().join("empty");
    std::fs::create_dir_all(&not_an_adapter).unwrap();
    assert_clean_error(
        &merge(&fixture, &not_an_adapter, &out, &[]),
        "adapter_config.json",
    );
}

#[test]
fn merged_stories260k_scores_as_eval_with_the_adapter_and_keeps_its_tokenizer() {
    let Some(data) = lemo_test_support::shared_data() else {
        return;
    };
    let stories = data.join("models/stories260K");
    let model = stories.join("stories260K.bin");
    let book = data.join("corpora/gutenberg/pg11.txt");
    let dir = tempfile::tempdir().unwrap();
    // The first 40 KB of the book keeps the test fast.
    let text: String = std::fs::read_to_string(&book)
        .unwrap()
        .chars()
        .take(40_000)
        .collect();
    let sample = dir.path().join("sample.txt");
    std::fs::write(&sample, &text).unwrap();
    let run = dir.path().join("run");
    succeed(&[
        "train",
        "--model",
        path(&model),
        "--data",
        path(&sample),
        "--seq-len",
        "1024",
        "--target-context",
        "1024",
        "--steps",
        "4",
        "--lr",
        "5e-3",
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
        path(&run),
    ]);
    let adapter = run.join("adapter");
    let out = dir.path().join("merged");
    succeed(&[
        "merge",
        "--model",
        path(&model),
        "--adapter",
        path(&adapter),
        "--out",
        path(&out),
        "--gguf",
        "q8_0",
    ]);
    let with_adapter = loss(&model, &sample, "1024", &["--adapter", path(&adapter)]);
    let merged = loss(&out, &sample, "1024", &[]);
    let gguf = loss(&out.join("model-q8_0.gguf"), &sample, "1024", &[]);
    println!("adapter {with_adapter}, merged {merged}, gguf q8_0 {gguf}");
    assert_close_scalar("merged", merged, with_adapter, 1e-5);
    assert_close_scalar("gguf q8_0", gguf, with_adapter, 1e-2);

    // The merged folder's tokenizer.json and the GGUF's metadata encode as llama2.c does.
    let paragraph: String = text.chars().skip(2000).take(1000).collect();
    let ids = |tokenizer: &Path| {
        stdout_json(&lemo(&[
            "tokenize",
            "--tokenizer",
            path(tokenizer),
            "--text",
            &paragraph,
            "--json",
        ]))
    };
    let expected = ids(&stories.join("tok512.bin"));
    assert_eq!(ids(&out.join("tokenizer.json")), expected);
    assert_eq!(ids(&out.join("model-q8_0.gguf")), expected);
}
