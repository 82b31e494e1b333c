//! `lemo-train` on GGUF files: SmolLM2-135M from the model cache (`cargo xtask fetch-model
//! smollm2-135m`) answers as llama.cpp does, and a damaged file ends in a one-line error.

use std::process::Output;

use lemo_test_support::{read_json, repo_root, smollm2_gguf};
use serde_json::Value;

fn lemo(args: &[&str]) -> Output {
    lemo_test_support::run(env!("CARGO_BIN_EXE_lemo-train"), args)
}

fn reference() -> Value {
    read_json(&repo_root().join("crates/lemo-models/tests/fixtures/gguf/smollm2.json"))
}

#[test]
fn generate_continues_a_chat_prompt_as_llama_cpp_does() {
    let Some(model) = smollm2_gguf() else { return };
    let prompt =
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
    let output = lemo(&[
        "generate",
        "--device",
        "cpu",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        prompt,
        "--max-new-tokens",
        "32",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).unwrap();
    // The prompt is echoed without its control tokens; generation stops at EOS (<|im_end|>).
    let expected = format!(
        "user\nWhat is the capital of France?\nassistant\n{}\n",
        reference()["greedy_text"].as_str().unwrap()
    );
    assert_eq!(stdout, expected);
}

#[test]
fn tokenize_reads_the_tokenizer_from_the_gguf_file() {
    let Some(model) = smollm2_gguf() else { return };
    let texts = read_json(&repo_root().join("crates/lemo-models/tests/fixtures/gguf/texts.json"));
    let text = texts["tokenize"]["code"].as_str().unwrap();
    let output = lemo(&[
        "tokenize",
        "--tokenizer",
        model.to_str().unwrap(),
        "--text",
        text,
        "--json",
    ]);
    let ids: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(ids, reference()["tokenize"]["code"]);
}

#[test]
fn a_truncated_gguf_file_is_a_one_line_error() {
    let dir = std::env::temp_dir().join(format!("lemo-gguf-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cut.gguf");
    // A GGUF v3 header that promises one tensor and one metadata entry, then ends.
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend(1u64.to_le_bytes());
    bytes.extend(1u64.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let data = dir.join("text.txt");
    std::fs::write(&data, "hello").unwrap();
    let output = lemo(&[
        "eval",
        "--device",
        "cpu",
        "--model",
        path.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    let last = stderr.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: ") && last.contains("cut.gguf") && last.contains("truncated"),
        "{stderr}"
    );
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
}
