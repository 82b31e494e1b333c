//! Missing, unreadable, corrupt, truncated and wrong-format inputs: models (Hugging Face
//! folders, safetensors, GGUF, llama2.c checkpoints), tokenizers and data.

use std::path::Path;

use crate::gguf::{self, Meta};
use crate::{case, check_all, id_documents, lemo, llama_fixture, path, write};

/// A FIFO at `dir/name`: reading it would block until a writer came.
fn fifo(dir: &Path, name: &str) -> std::path::PathBuf {
    let file = dir.join(name);
    let status = std::process::Command::new("mkfifo")
        .arg(&file)
        .status()
        .expect("mkfifo runs");
    assert!(status.success());
    file
}

/// Bytes no format starts with.
fn garbage(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 167 + 13) as u8).collect()
}

/// An HF folder in `dir/name`: the fixture's weights under `config` (the fixture's, edited).
fn hf_folder(dir: &Path, name: &str, edit: impl Fn(&mut serde_json::Value)) -> String {
    let (fixture, _) = llama_fixture();
    let folder = dir.join(name);
    std::fs::create_dir_all(&folder).unwrap();
    let mut config = lemo_test_support::read_json(&fixture.join("config.json"));
    edit(&mut config);
    write(&folder, "config.json", config.to_string());
    std::fs::copy(
        fixture.join("model.safetensors"),
        folder.join("model.safetensors"),
    )
    .unwrap();
    path(&folder).to_string()
}

/// `eval` of `model` on the fixture's tokens refused with a line naming `needle`, changing
/// nothing in `dir`.
fn eval_refuses(dir: &Path, tokens: &str, model: &str, needle: &str) -> crate::Case {
    case(
        &[
            "eval", "--model", model, "--data", tokens, "--device", "cpu",
        ],
        needle,
    )
    .watching(dir)
}

/// GGUF files with one thing broken, absurd counts, wrong magic, nothing at all.
#[test]
fn broken_gguf_models_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let (_, tokens) = llama_fixture();
    let tokens = path(&tokens);
    let eval = |model: &str, needle: &str| eval_refuses(dir, tokens, model, needle);

    // The well-formed GGUF model scores: each case below breaks one thing of it.
    let good = dir.join("good.gguf");
    gguf::write_model(&good, &gguf::metadata(&[]));
    lemo_test_support::stdout_json(&lemo(&[
        "eval",
        "--model",
        path(&good),
        "--data",
        tokens,
        "--seq-len",
        "32",
        "--device",
        "cpu",
        "--json",
    ]));
    let gguf_with = |name: &str, overrides: &[(&'static str, Meta)]| {
        let file = dir.join(name);
        gguf::write_model(&file, &gguf::metadata(overrides));
        path(&file).to_string()
    };
    let mut cases = vec![
        eval(
            &gguf_with("context0.gguf", &[("llama.context_length", Meta::U32(0))]),
            "context_length",
        ),
        eval(
            &gguf_with(
                "heads0.gguf",
                &[("llama.attention.head_count", Meta::U32(0))],
            ),
            "head_count",
        ),
        eval(
            &gguf_with("layers.gguf", &[("llama.block_count", Meta::U32(1 << 30))]),
            "block_count",
        ),
        eval(
            &gguf_with("width.gguf", &[("llama.embedding_length", Meta::U32(16))]),
            "metadata implies",
        ),
        eval(
            &gguf_with("bert.gguf", &[("general.architecture", Meta::Str("bert"))]),
            "unsupported architecture",
        ),
        eval(
            &gguf_with(
                "epsilon.gguf",
                &[(
                    "llama.attention.layer_norm_rms_epsilon",
                    Meta::F32(f32::NAN),
                )],
            ),
            "layer_norm_rms_epsilon",
        ),
    ];
    let absurd_tensors = write(dir, "tensors.gguf", gguf::header_only(1 << 62, 0));
    let absurd_entries = write(dir, "entries.gguf", gguf::header_only(0, u64::MAX));
    let wrong_magic = write(dir, "magic.gguf", garbage(4096));
    let empty_gguf = write(dir, "empty.gguf", "");
    cases.extend([
        eval(path(&absurd_tensors), "tensors.gguf"),
        eval(path(&absurd_entries), "entries.gguf"),
        eval(path(&wrong_magic), "magic.gguf"),
        eval(path(&empty_gguf), "empty.gguf"),
    ]);
    check_all(cases);
}

/// Hugging Face folders missing or corrupting a file, configs out of range or unlike the weights.
#[test]
fn broken_hugging_face_folders_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let (fixture, tokens) = llama_fixture();
    let tokens = path(&tokens);
    let eval = |model: &str, needle: &str| eval_refuses(dir, tokens, model, needle);
    std::fs::create_dir_all(dir.join("no-config")).unwrap();
    let no_weights = dir.join("no-weights");
    write(
        &no_weights,
        "config.json",
        std::fs::read(fixture.join("config.json")).unwrap(),
    );
    let bad_json = dir.join("bad-json");
    write(&bad_json, "config.json", "{\"model_type\": \"llama\",");
    let garbage_weights = dir.join("garbage-weights");
    write(
        &garbage_weights,
        "config.json",
        std::fs::read(fixture.join("config.json")).unwrap(),
    );
    write(&garbage_weights, "model.safetensors", garbage(4096));
    let huge_header = dir.join("huge-header");
    write(
        &huge_header,
        "config.json",
        std::fs::read(fixture.join("config.json")).unwrap(),
    );
    write(
        &huge_header,
        "model.safetensors",
        (1u64 << 60).to_le_bytes(),
    );
    let cases = [
        eval(path(&dir.join("no-config")), "config.json"),
        eval(path(&no_weights), "safetensors"),
        eval(path(&bad_json), "config.json"),
        eval(path(&garbage_weights), "model.safetensors"),
        eval(path(&huge_header), "model.safetensors"),
        eval(
            &hf_folder(dir, "hidden0", |c| c["hidden_size"] = 0.into()),
            "config/weights mismatch",
        ),
        eval(
            &hf_folder(dir, "heads0", |c| c["num_attention_heads"] = 0.into()),
            "num_attention_heads",
        ),
        eval(
            &hf_folder(dir, "positions0", |c| {
                c["max_position_embeddings"] = 0.into()
            }),
            "max_position_embeddings",
        ),
        eval(
            &hf_folder(dir, "vocab-string", |c| c["vocab_size"] = "many".into()),
            "config.json",
        ),
        eval(
            &hf_folder(dir, "other-shapes", |c| c["intermediate_size"] = 64.into()),
            "mlp",
        ),
        eval(
            path(&write(dir, "model.txt", "hello")),
            "expected a Hugging Face model folder",
        ),
        eval(path(&fifo(dir, "fifo.gguf")), "fifo.gguf"),
    ];
    check_all(cases);
}

/// llama.c checkpoints with bad headers or cut short.
#[test]
fn broken_llama2c_checkpoints_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let (_, tokens) = llama_fixture();
    let tokens = path(&tokens);
    let eval = |model: &str, needle: &str| eval_refuses(dir, tokens, model, needle);
    // llama.c checkpoints: a header of seven i32 (dim, hidden, layers, heads, kv heads, vocab,
    // positions), then the weights.
    let header =
        |values: [i32; 7]| -> Vec<u8> { values.iter().flat_map(|v| v.to_le_bytes()).collect() };
    let mut cases = vec![
        eval(path(&write(dir, "empty.bin", "")), "empty.bin"),
        eval(
            path(&write(
                dir,
                "negative.bin",
                header([-8, 16, 1, 2, 2, 128, 64]),
            )),
            "negative.bin",
        ),
        eval(
            path(&write(
                dir,
                "context0.bin",
                header([8, 16, 1, 2, 2, 128, 0]),
            )),
            "context0.bin",
        ),
        eval(
            path(&write(
                dir,
                "absurd.bin",
                header([1 << 30, 1 << 30, 1 << 20, 2, 2, 128, 64]),
            )),
            "absurd.bin",
        ),
    ];
    if let Some(data) = lemo_test_support::shared_data() {
        let stories = std::fs::read(data.join("models/stories260K/stories260K.bin")).unwrap();
        let cut = write(dir, "cut.bin", &stories[..stories.len() / 2]);
        cases.push(eval(path(&cut), "cut.bin"));
    }
    check_all(cases);
}

#[test]
fn broken_tokenizers_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let tokenize = |tokenizer: &Path, needle: &str| {
        case(
            &["tokenize", "--tokenizer", path(tokenizer), "--text", "hi"],
            needle,
        )
        .watching(dir)
    };
    std::fs::create_dir_all(dir.join("empty-folder")).unwrap();
    let mut cases = vec![
        tokenize(&dir.join("missing.json"), "missing.json"),
        tokenize(&write(dir, "empty/tokenizer.json", ""), "tokenizer.json"),
        tokenize(
            &write(
                dir,
                "shape/tokenizer.json",
                "{\"model\": {\"type\": \"Unigram\"}}",
            ),
            "tokenizer.json",
        ),
        tokenize(&write(dir, "garbage.bin", garbage(1000)), "garbage.bin"),
        tokenize(&dir.join("empty-folder"), "empty-folder"),
        tokenize(&fifo(dir, "fifo.json"), "fifo.json"),
    ];
    if let Some(data) = lemo_test_support::shared_data() {
        let stories = data.join("models/stories260K");
        let tok = std::fs::read(stories.join("tok512.bin")).unwrap();
        cases.push(tokenize(
            &write(dir, "tok-cut.bin", &tok[..tok.len() / 2]),
            "tok-cut.bin",
        ));
        // The llama.c tokenizer has 512 tokens, the fixture's vocabulary 128.
        let (fixture, _) = llama_fixture();
        cases.push(
            case(
                &[
                    "generate",
                    "--model",
                    path(&fixture),
                    "--tokenizer",
                    path(&stories.join("tok512.bin")),
                    "--prompt",
                    "hi",
                    "--device",
                    "cpu",
                ],
                "wrong --tokenizer",
            )
            .watching(dir),
        );
    }
    check_all(cases);
}

#[test]
fn broken_data_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let (fixture, _) = llama_fixture();
    let model = path(&fixture);
    let eval = |data: &Path, needle: &str| {
        case(
            &[
                "eval",
                "--model",
                model,
                "--data",
                path(data),
                "--device",
                "cpu",
            ],
            needle,
        )
        .watching(dir)
    };
    let train = |data: &Path, needle: &str| {
        let out = dir.join("runs/never");
        case(
            &[
                "train",
                "--model",
                model,
                "--data",
                path(data),
                "--seq-len",
                "16",
                "--steps",
                "1",
                "--cache-dir",
                "none",
                "--device",
                "cpu",
                "--out",
                path(&out),
            ],
            needle,
        )
        .watching(dir)
    };
    std::fs::create_dir_all(dir.join("empty-folder")).unwrap();
    let cases = vec![
        train(&write(dir, "empty.jsonl", ""), "no tokens"),
        train(&dir.join("empty-folder"), "empty-folder"),
        eval(&dir.join("empty-folder"), "empty-folder"),
        eval(&write(dir, "garbage.jsonl", garbage(3000)), "garbage.jsonl"),
        eval(&write(dir, "garbage.txt", garbage(3000)), "tokenizer"),
        eval(
            &write(dir, "negative.jsonl", "{\"input_ids\": [1, -2, 3]}\n"),
            "negative.jsonl",
        ),
        eval(
            &write(dir, "text.jsonl", "{\"text\": \"no tokenizer here\"}\n"),
            "tokenizer",
        ),
        eval(&fifo(dir, "fifo.jsonl"), "fifo.jsonl"),
        train(&fifo(dir, "train-fifo.jsonl"), "train-fifo.jsonl"),
        // A folder where a file is expected.
        case(
            &[
                "train",
                "--config",
                path(&dir.join("empty-folder")),
                "--preset",
                "tiny",
            ],
            "empty-folder",
        )
        .watching(dir),
        case(
            &[
                "tokenize",
                "--tokenizer",
                path(&dir.join("empty-folder")),
                "--file",
                path(dir),
            ],
            "empty-folder",
        )
        .watching(dir),
    ];
    check_all(cases);
}

/// A byte-order mark before the first line is not data: the file scores as without it.
#[test]
fn a_jsonl_file_with_a_byte_order_mark_reads_as_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let (fixture, _) = llama_fixture();
    let data = id_documents(dir.path(), 3, 40);
    let text = std::fs::read(&data).unwrap();
    let marked = write(
        dir.path(),
        "bom.jsonl",
        [&b"\xEF\xBB\xBF"[..], &text].concat(),
    );
    let loss = |data: &Path| {
        lemo_test_support::stdout_json(&lemo(&[
            "eval",
            "--model",
            path(&fixture),
            "--data",
            path(data),
            "--seq-len",
            "32",
            "--device",
            "cpu",
            "--json",
        ]))["loss"]
            .as_f64()
            .unwrap()
    };
    assert_eq!(loss(&data), loss(&marked));
}
