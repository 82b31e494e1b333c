//! `train` on chat JSONL (the tiny random model with a small chat template in its
//! `tokenizer_config.json`): the first step's logged loss is the plain cross-entropy of the
//! untrained model over the assistant tokens only (`--loss-on assistant`), or over every token
//! but each document's first (`--loss-on all`), computed here from the model's logits; the same
//! holds with two data-parallel ranks and with `--method lemo`. Bad chat data gives one-line
//! errors.

use std::path::{Path, PathBuf};

use burn::tensor::{Int, Tensor, TensorData};
use lemo_kernels::CpuBackend;
use lemo_kernels::precision::Precision;
use lemo_models::CausalLm;
use lemo_models::chat::{ChatTemplate, LossOn, parse_record, tokenize_chat};
use lemo_models::tokenizer::Tokenizer;
use lemo_test_support::{assert_clean_error, assert_close_scalar, run};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_lemo-train");
const SEQ_LEN: usize = 48;

/// User turns as `U: ...`, assistant turns as `A: ...</s>` (EOS, a special token).
const TEMPLATE: &str = "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'A: ' + m['content'] + eos_token + '\n' }}{% else %}{{ m['role'][0] | upper + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}";

/// The tiny model in `dir/model`, with `template` as its chat template when given.
fn tiny_model(dir: &Path, template: Option<&str>) -> PathBuf {
    let model = dir.join("model");
    lemo_train::preset::write_tiny_model(&model, 3).unwrap();
    if let Some(template) = template {
        let config = json!({"chat_template": template, "eos_token": "</s>", "bos_token": "<s>"});
        std::fs::write(model.join("tokenizer_config.json"), config.to_string()).unwrap();
    }
    model
}

fn records() -> Vec<Value> {
    let mut records = Vec::new();
    for i in 0..8 {
        records.push(json!({"messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": format!("What is {i} plus {i}?")},
            {"role": "assistant", "content": format!("It is {}.", 2 * i)},
        ]}));
        records.push(json!({"prompt": format!("Name color {i}."), "completion": "Blue, I think."}));
    }
    // One more, so that the packed sequences split evenly over two ranks.
    records.push(json!({"prompt": "Name color 8.", "completion": "Blue, I think."}));
    records
}

fn write_jsonl(path: &Path, records: &[Value]) -> PathBuf {
    let text: Vec<String> = records.iter().map(Value::to_string).collect();
    std::fs::write(path, text.join("\n") + "\n").unwrap();
    path.to_path_buf()
}

/// Each record rendered and tokenized, with its tokens' targets under `loss_on`.
fn rendered_records(model: &Path, loss_on: LossOn) -> Vec<(Vec<u32>, Vec<bool>)> {
    let tokenizer = Tokenizer::from_file(&model.join("tokenizer.json")).unwrap();
    let template = ChatTemplate::for_model(model, &tokenizer).unwrap();
    records()
        .iter()
        .map(|record| {
            let chat = template
                .render_conversation(&parse_record(record).unwrap())
                .unwrap();
            tokenize_chat(&tokenizer, &chat, loss_on).unwrap()
        })
        .collect()
}

/// The packed sequences as the README describes them, with their prediction targets: records
/// rendered and concatenated, cut every `SEQ_LEN` tokens, a record that fits in one sequence
/// moved to the next rather than split (the rest padded); targets are assistant tokens (or all
/// tokens), never a record's first nor padding; sequences without a target are left out.
fn expected_sequences(model: &Path, loss_on: LossOn) -> Vec<(Vec<u32>, Vec<bool>)> {
    let (mut stream, mut targets) = (Vec::new(), Vec::new());
    for (tokens, trained) in rendered_records(model, loss_on) {
        let used = stream.len() % SEQ_LEN;
        if used > 0 && used + tokens.len() > SEQ_LEN && tokens.len() <= SEQ_LEN {
            // What the padding is does not matter: it ends its sequence and is never a target.
            stream.resize(stream.len() + SEQ_LEN - used, 0);
            targets.resize(stream.len(), false);
        }
        let first = targets.len();
        stream.extend(tokens);
        targets.extend(trained);
        targets[first] = false;
    }
    stream
        .chunks_exact(SEQ_LEN)
        .zip(targets.chunks_exact(SEQ_LEN))
        .map(|(s, t)| (s.to_vec(), t.to_vec()))
        .filter(|(_, t)| t[1..].iter().any(|&x| x))
        .collect()
}

/// Mean of `-log p(token[t] | tokens[..t])` over the targets, from the model's logits.
fn cross_entropy(model: &Path, sequences: &[(Vec<u32>, Vec<bool>)]) -> f64 {
    let device = Default::default();
    let (lm, _) = CausalLm::<CpuBackend>::from_path(model, &device, Precision::F32).unwrap();
    let (mut sum, mut count) = (0.0, 0usize);
    for (tokens, targets) in sequences {
        let len = tokens.len();
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let input =
            Tensor::<CpuBackend, 2, Int>::from_data(TensorData::new(ids, [1, len]), &device);
        let logits: Vec<f32> = lm.forward(input, None).into_data().to_vec().unwrap();
        let vocab = logits.len() / len;
        for t in 1..len {
            if !targets[t] {
                continue;
            }
            let row = &logits[(t - 1) * vocab..t * vocab];
            let max = row.iter().fold(f64::MIN, |m, &x| m.max(x as f64));
            let log_sum = row
                .iter()
                .map(|&x| (x as f64 - max).exp())
                .sum::<f64>()
                .ln()
                + max;
            sum += log_sum - row[tokens[t] as usize] as f64;
            count += 1;
        }
    }
    sum / count as f64
}

/// `train` for 2 steps on `data`, the whole data in each step's global batch; returns the first
/// step's logged loss.
fn first_loss(model: &Path, data: &Path, out: &Path, sequences: usize, extra: &[&str]) -> f64 {
    let ranks: usize = extra
        .iter()
        .position(|a| *a == "--gpus")
        .map_or(1, |i| extra[i + 1].parse().unwrap());
    let batch = (sequences / ranks).to_string();
    let seq_len = SEQ_LEN.to_string();
    let mut args = vec![
        "train",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ];
    args.extend([
        "--out",
        out.to_str().unwrap(),
        "--cache-dir",
        "none",
        "--device",
        "cpu",
    ]);
    args.extend([
        "--seq-len",
        &seq_len,
        "--steps",
        "2",
        "--batch-size",
        &batch,
    ]);
    args.extend(["--val-fraction", "0", "--lr", "1e-3"]);
    args.extend(extra);
    let output = run(BIN, &args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "train failed: {stderr}");
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let first: Value = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|v| v["kind"] == "train" && v["step"] == 1)
        .expect("a record of step 1");
    first["loss"].as_f64().unwrap()
}

#[test]
fn the_logged_loss_is_the_cross_entropy_of_the_scored_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), Some(TEMPLATE));
    let data = write_jsonl(&dir.path().join("chat.jsonl"), &records());
    let assistant = expected_sequences(&model, LossOn::Assistant);
    let all = expected_sequences(&model, LossOn::All);
    assert!(
        assistant.len() >= 4 && assistant.len().is_multiple_of(2),
        "{}",
        assistant.len()
    );
    let on_assistant = cross_entropy(&model, &assistant);
    let on_all = cross_entropy(&model, &all);
    assert!(
        (on_assistant - on_all).abs() > 1e-3,
        "the masks must matter"
    );

    let out = |name: &str| dir.path().join(name);
    let n = assistant.len();
    let logged = first_loss(
        &model,
        &data,
        &out("assistant"),
        n,
        &["--loss-on", "assistant"],
    );
    assert_close_scalar("--loss-on assistant", logged, on_assistant, 1e-4);
    let config = std::fs::read_to_string(out("assistant").join("config.toml")).unwrap();
    assert!(config.contains("loss_on = \"assistant\""), "{config}");
    let logged = first_loss(&model, &data, &out("default"), n, &["--gpus", "2"]);
    assert_close_scalar(
        "two ranks, the default --loss-on",
        logged,
        on_assistant,
        1e-4,
    );
    let logged = first_loss(&model, &data, &out("all"), all.len(), &["--loss-on", "all"]);
    assert_close_scalar("--loss-on all", logged, on_all, 1e-4);
    // Token elimination computes the loss of every row: the masked loss is the dense one.
    let lemo = [
        "--method",
        "lemo",
        "--keep-exactly",
        "--attention-keep",
        "0.5",
    ];
    let lemo = [&lemo[..], &["--mlp-keep", "0.5", "--block-size", "8"]].concat();
    let logged = first_loss(&model, &data, &out("lemo"), n, &lemo);
    assert_close_scalar("--method lemo", logged, on_assistant, 1e-4);

    // `eval` scores each record in a window of its own (all are shorter than 64 tokens).
    let eval = |loss_on: &str| {
        let args = ["eval", "--model", model.to_str().unwrap(), "--data"];
        let args = [
            &args[..],
            &[data.to_str().unwrap(), "--device", "cpu", "--json"],
        ]
        .concat();
        let args = [&args[..], &["--seq-len", "64", "--loss-on", loss_on]].concat();
        lemo_test_support::stdout_json(&run(BIN, &args))["loss"]
            .as_f64()
            .unwrap()
    };
    let alone = rendered_records(&model, LossOn::Assistant);
    assert!(alone.iter().all(|(tokens, _)| tokens.len() <= 64));
    let expected = cross_entropy(&model, &alone);
    assert_close_scalar(
        "eval --loss-on assistant",
        eval("assistant"),
        expected,
        1e-4,
    );
    let expected = cross_entropy(&model, &rendered_records(&model, LossOn::All));
    assert_close_scalar("eval --loss-on all", eval("all"), expected, 1e-4);

    let resumed = run(
        BIN,
        &[
            "train",
            "--resume",
            out("assistant").to_str().unwrap(),
            "--loss-on",
            "all",
        ],
    );
    assert_clean_error(&resumed, "--loss-on \"all\": the run in");
}

#[test]
fn bad_chat_data_is_a_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), Some(TEMPLATE));
    let train = |model: &Path, data: &Path, extra: &[&str]| {
        let mut args = vec!["train", "--model", model.to_str().unwrap(), "--data"];
        args.extend([
            data.to_str().unwrap(),
            "--cache-dir",
            "none",
            "--device",
            "cpu",
        ]);
        // One run folder per model and data: a failed run leaves its folder behind.
        let out = model.with_extension(data.file_stem().unwrap());
        args.extend([
            "--seq-len",
            "32",
            "--steps",
            "1",
            "--out",
            out.to_str().unwrap(),
        ]);
        args.extend(extra);
        run(BIN, &args)
    };
    let path = |name: &str| dir.path().join(name);
    let good = records()[0].to_string();

    let no_answer = json!({"messages": [{"role": "user", "content": "Hello?"}]}).to_string();
    let data = path("no_answer.jsonl");
    std::fs::write(&data, format!("{good}\n{no_answer}\n")).unwrap();
    assert_clean_error(
        &train(&model, &data, &[]),
        "line 2: the record has no assistant turn",
    );

    let data = path("malformed.jsonl");
    std::fs::write(&data, format!("{good}\n\n{{\"messages\": [\n")).unwrap();
    assert_clean_error(
        &train(&model, &data, &[]),
        "malformed.jsonl line 3: invalid JSON",
    );

    let data = path("empty.jsonl");
    std::fs::write(&data, "").unwrap();
    assert_clean_error(&train(&model, &data, &[]), "no tokens in this data");

    let data = path("plain.jsonl");
    std::fs::write(&data, "{\"text\": \"Once upon a time.\"}\n").unwrap();
    let refused = train(&model, &data, &["--loss-on", "assistant"]);
    assert_clean_error(&refused, "--loss-on assistant: ");
    assert_clean_error(&refused, "has no chat records");

    let chat = write_jsonl(&path("chat.jsonl"), &records());
    let bare = tiny_model(&path("bare"), None);
    let missing = train(&bare, &chat, &[]);
    assert_clean_error(&missing, "the model has no chat template");
    assert_clean_error(
        &missing,
        "add one (a chat_template.jinja file beside the model",
    );

    let broken = tiny_model(
        &path("broken"),
        Some("{% for m in messages %}{{ m['content'] }}"),
    );
    assert_clean_error(&train(&broken, &chat, &[]), "chat template:");
    let raising = "{{ raise_exception('Conversation roles must alternate user/assistant') }}";
    let raising = tiny_model(&path("raising"), Some(raising));
    assert_clean_error(
        &train(&raising, &chat, &[]),
        "chat.jsonl line 1: chat template:",
    );
}
