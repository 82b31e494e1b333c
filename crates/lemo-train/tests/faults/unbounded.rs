//! Requests past what the model or the machine can serve are refused up front, in seconds, not
//! after minutes of work or tens of gigabytes.

use std::time::Duration;

use crate::{case, check_all, llama_fixture, path, write};

/// A refusal made before any work: loading a fixture and checking.
const UP_FRONT: Duration = Duration::from_secs(15);

#[test]
fn unbounded_requests_are_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let (fixture, _) = llama_fixture();
    let model = path(&fixture);
    // One document of 80,000 ids: the whole of it fits one --seq-len 80000 window.
    let ids: Vec<u64> = (0..80_000u64).map(|i| (i * 104_729) % 128).collect();
    let long = write(
        dir,
        "long.jsonl",
        serde_json::json!({ "input_ids": ids }).to_string(),
    );
    let long = path(&long);
    let mut cases = vec![
        // Past the model's 128 positions.
        case(
            &[
                "eval",
                "--model",
                model,
                "--data",
                long,
                "--seq-len",
                "80000",
                "--device",
                "cpu",
            ],
            "--seq-len 80000",
        ),
        // Interpolated to reach them, but a CPU cannot hold the attention of 80,000 tokens.
        case(
            &[
                "eval",
                "--model",
                model,
                "--data",
                long,
                "--seq-len",
                "80000",
                "--target-context",
                "80000",
                "--device",
                "cpu",
            ],
            "memory",
        ),
    ];
    if let Some(data) = lemo_test_support::shared_data() {
        let stories = data.join("models/stories260K");
        let (bin, tok) = (stories.join("stories260K.bin"), stories.join("tok512.bin"));
        // About 20 times the 512 positions of stories260K.
        let prompt = "Once upon a time, there was a little girl. ".repeat(1000);
        let generate = |extra: &[&str]| -> Vec<String> {
            [
                &["generate", "--model", path(&bin), "--tokenizer", path(&tok)][..],
                &["--device", "cpu"],
                extra,
            ]
            .concat()
            .into_iter()
            .map(String::from)
            .collect()
        };
        cases.extend([
            case(&generate(&["--prompt", &prompt]), "positions"),
            case(
                &generate(&["--prompt", "hi", "--max-new-tokens", "100000000"]),
                "positions",
            ),
            case(
                &[
                    "passkey",
                    "--tokenizer",
                    path(&tok),
                    "--lengths",
                    "100000000",
                ],
                "100000000",
            ),
            case(
                &[
                    "eval",
                    "--model",
                    path(&bin),
                    "--tokenizer",
                    path(&tok),
                    "--passkey",
                    "--lengths",
                    "100000000",
                    "--device",
                    "cpu",
                ],
                "100000000",
            ),
        ]);
    }
    check_all(cases.into_iter().map(|c| c.watching(dir).within(UP_FRONT)));
}
