//! Nothing a user had is lost: outputs naming an input are refused, a failed resume leaves the
//! run folder as it was, `--overwrite` removes only what the run wrote, and a run folder in use
//! is locked.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::{case, check_all, id_documents, lemo, lemo_binary, llama_fixture, path, write};

/// The Llama fixture copied into `dir/model`: a model the user owns.
fn own_model(dir: &Path) -> PathBuf {
    let (fixture, _) = llama_fixture();
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(file), model.join(file)).unwrap();
    }
    model
}

/// `train` on `model` for `steps` steps with a checkpoint every step, into `out`.
fn train_args<'a>(model: &'a str, data: &'a str, out: &'a str, steps: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--model",
        model,
        "--data",
        data,
        "--seq-len",
        "16",
        "--steps",
        steps,
        "--checkpoint-every",
        "1",
        "--val-every",
        "0",
        "--cache-dir",
        "none",
        "--device",
        "cpu",
        "--out",
        out,
    ]
}

fn succeed(args: &[&str]) {
    lemo_test_support::run_ok(crate::lemo_binary(), args);
}

#[test]
fn outputs_naming_an_input_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let model = own_model(dir);
    let weights = model.join("model.safetensors");
    let data = id_documents(dir, 3, 40);
    let (m, d) = (path(&model), path(&data));
    let lemo_flags = ["--seq-len", "32", "--block-size", "8", "--device", "cpu"];
    let with = |head: &[&str], out: &Path| -> Vec<String> {
        [head, &lemo_flags[..], &["--out", path(out)]]
            .concat()
            .into_iter()
            .map(String::from)
            .collect()
    };
    let refused = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        case(&args, "--out").watching(dir)
    };
    let mut cases = vec![
        refused(with(&["calibrate", "--model", m, "--data", d], &weights)),
        refused(with(&["calibrate", "--model", m, "--data", d], &data)),
        refused(with(
            &["calibrate", "--model", m, "--data", d],
            &model.join("config.json"),
        )),
        refused(with(
            &["train-predictors", "--model", m, "--data", d],
            &weights,
        )),
        refused(with(&["profile", "--model", m, "--data", d], &model)),
        refused(with(
            &["train", "--model", m, "--data", d, "--steps", "1"],
            &model,
        )),
        case(
            &[
                "bench",
                "--model",
                m,
                "--device",
                "cpu",
                "--out",
                path(&weights),
            ],
            "--out",
        )
        .watching(dir),
    ];
    if let Some(shared) = lemo_test_support::shared_data() {
        let tokenizer = dir.join("tok512.bin");
        std::fs::copy(shared.join("models/stories260K/tok512.bin"), &tokenizer).unwrap();
        let t = path(&tokenizer);
        cases.push(
            case(
                &["passkey", "--tokenizer", t, "--lengths", "200", "--out", t],
                "--out",
            )
            .watching(dir),
        );
    }
    check_all(cases);
}

/// A resume the checkpoint cannot serve fails before touching the run folder; so does a
/// checkpoint whose files were cut.
#[test]
fn a_failed_resume_leaves_the_run_folder_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let (fixture, tokens) = llama_fixture();
    let run = dir.join("run");
    succeed(&train_args(path(&fixture), path(&tokens), path(&run), "2"));
    let resume = |extra: &[&str], needle: &str| {
        case(
            &[&["train", "--resume", path(&run)][..], extra].concat(),
            needle,
        )
        .watching(dir)
    };
    let other = lemo_test_support::hf_fixture("llama_rope_linear");
    let mut cases = vec![
        resume(&["--lora-rank", "4"], "--lora-rank"),
        resume(&["--method", "longlora"], "--method"),
        resume(&["--model", path(&other)], "--model"),
        resume(&["--lr", "nan"], "--lr"),
    ];
    // A copy of the run whose latest checkpoint lost its contents.
    let cut = dir.join("cut");
    copy_tree(&run, &cut);
    let checkpoints = cut.join("checkpoints");
    let latest = std::fs::read_dir(&checkpoints)
        .unwrap()
        .map(|e| e.unwrap().path())
        .max()
        .expect("a checkpoint");
    for entry in std::fs::read_dir(&latest).unwrap() {
        let file = entry.unwrap().path();
        if file.extension().is_some_and(|e| e == "safetensors") {
            std::fs::write(&file, "").unwrap();
        }
    }
    cases.push(case(&["train", "--resume", path(&cut)], "safetensors").watching(dir));
    check_all(cases);
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// `--overwrite` replaces the earlier run's outputs and nothing else in the folder, also inside
/// the folders the run writes.
#[test]
fn overwrite_removes_only_what_the_run_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let (fixture, tokens) = llama_fixture();
    let run = dir.path().join("run");
    let args = train_args(path(&fixture), path(&tokens), path(&run), "1");
    succeed(&args);
    let notes = write(&run, "notes.txt", "mine");
    let readme = write(&run.join("adapter"), "README.md", "model card");
    succeed(&[&args[..], &["--overwrite"]].concat());
    assert_eq!(std::fs::read_to_string(notes).unwrap(), "mine");
    assert_eq!(std::fs::read_to_string(readme).unwrap(), "model card");
    assert!(run.join("adapter/adapter_model.safetensors").exists());
}

/// A second run into the folder of a running one is refused, with `--overwrite` or `--resume`,
/// and the running one keeps its files.
#[test]
fn a_run_folder_in_use_is_locked() {
    let dir = tempfile::tempdir().unwrap();
    let (fixture, tokens) = llama_fixture();
    let run = dir.path().join("run");
    let args = train_args(path(&fixture), path(&tokens), path(&run), "1000000");
    let mut first = std::process::Command::new(lemo_binary())
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !run.join("metrics.jsonl").exists() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the first run never started"
        );
        assert!(first.try_wait().unwrap().is_none(), "the first run ended");
        std::thread::sleep(Duration::from_millis(50));
    }
    let cases = vec![
        case(&[&args[..], &["--overwrite"]].concat(), "another run"),
        case(&["train", "--resume", path(&run)], "another run"),
    ];
    let outcome = std::panic::catch_unwind(|| check_all(cases));
    let still_running = first.try_wait().unwrap().is_none();
    first.kill().ok();
    first.wait().ok();
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    assert!(still_running, "the first run was stopped by the second");
    assert!(run.join("config.toml").exists());
}

/// A token cache cut short or overwritten is rebuilt or named, never a panic.
#[test]
fn a_corrupted_token_cache_is_rebuilt_or_named() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let train = |out: &str| {
        lemo(&[
            "train",
            "--preset",
            "tiny",
            "--steps",
            "1",
            "--val-every",
            "0",
            "--checkpoint-every",
            "0",
            "--cache-dir",
            path(&cache),
            "--out",
            path(&dir.path().join(out)),
        ])
    };
    let first = train("first");
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let files: Vec<PathBuf> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(!files.is_empty(), "the run cached its tokens");
    for (index, corruption) in [&b""[..], &b"\x01\x02\x03"[..], &[0xff; 4096][..]]
        .iter()
        .enumerate()
    {
        for file in &files {
            std::fs::write(file, corruption).unwrap();
        }
        let output = train(&format!("run{index}"));
        if !output.status.success() {
            lemo_test_support::assert_clean_error(&output, "cache");
        }
    }
}
