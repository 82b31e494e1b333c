//! Settings out of range for the numeric flags of every subcommand (negative, zero where zero
//! is meaningless, NaN, infinite, huge), and combinations that cannot work.

use std::path::Path;

use crate::{Case, case, check_all, id_documents, llama_fixture, path};

/// `flag value` pairs that must each be refused with an error naming `flag`.
fn out_of_range(base: &[&str], dir: &Path, pairs: &[(&str, &str)]) -> Vec<Case> {
    pairs
        .iter()
        .map(|(flag, value)| {
            let args = [base, &[flag, value]].concat();
            case(&args, flag).watching(dir)
        })
        .collect()
}

#[test]
fn train_settings_out_of_range_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let (fixture, tokens) = llama_fixture();
    let out = dir.join("run");
    let base = [
        "train",
        "--model",
        path(&fixture),
        "--data",
        path(&tokens),
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
    ];
    let mut cases = out_of_range(
        &base,
        dir,
        &[
            ("--steps", "0"),
            ("--steps", "-1"),
            ("--steps", "1e3"),
            ("--batch-size", "0"),
            ("--grad-accum", "0"),
            ("--seq-len", "1"),
            ("--seq-len", "18446744073709551615"),
            ("--target-context", "0"),
            ("--lr", "0"),
            ("--lr", "-1"),
            ("--lr", "nan"),
            ("--lr", "inf"),
            ("--min-lr-ratio", "2"),
            ("--beta1", "2"),
            ("--beta1", "nan"),
            ("--beta2", "-1"),
            ("--eps", "0"),
            ("--eps", "nan"),
            ("--weight-decay", "-1"),
            ("--max-grad-norm", "nan"),
            ("--lora-rank", "0"),
            ("--lora-alpha", "0"),
            ("--lora-dropout", "2"),
            ("--lora-dropout", "1"),
            ("--s2-group-size", "0"),
            ("--loss-segment", "0"),
            ("--val-fraction", "2"),
            ("--val-fraction", "-0.5"),
            ("--rope-theta", "nan"),
            ("--rope-theta", "-1"),
            ("--token-width", "3"),
            ("--save-every", "soon"),
            ("--collective-timeout", "5x"),
            ("--gpus", "0"),
        ],
    );
    let lemo = [&base[..], &["--method", "lemo"]].concat();
    cases.extend(out_of_range(
        &lemo,
        dir,
        &[
            ("--target-keep", "0"),
            ("--target-keep", "2"),
            ("--target-keep", "nan"),
            ("--attention-keep", "-0.5"),
            ("--block-size", "0"),
            ("--block-size", "100000"),
            ("--min-keep", "2"),
            ("--calibration-sequences", "0"),
            // S2 groups longer than the 16-token sequence.
            ("--s2-group-size", "17"),
        ],
    ));
    // S2 is a setting of lemo and longlora.
    cases.push(
        case(
            &[&base[..], &["--s2"]].concat(),
            "--s2 applies to --method lemo",
        )
        .watching(dir),
    );
    check_all(cases);
}

#[test]
fn settings_of_the_other_commands_out_of_range_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let (fixture, tokens) = llama_fixture();
    let (model, tokens) = (path(&fixture), path(&tokens));
    let data = id_documents(dir, 2, 40);
    let (thresholds, merged) = (dir.join("thresholds.json"), dir.join("merged"));
    let eval = [
        "eval", "--model", model, "--data", tokens, "--device", "cpu",
    ];
    let mut cases = out_of_range(
        &eval,
        dir,
        &[
            ("--seq-len", "0"),
            ("--seq-len", "-3"),
            ("--stride", "nan"),
            ("--target-context", "0"),
            ("--token-width", "0"),
            ("--stride", "-1"),
        ],
    );
    let eval_lemo = [&eval[..], &["--method", "lemo", "--seq-len", "32"]].concat();
    cases.extend(out_of_range(
        &eval_lemo,
        dir,
        &[
            ("--block-size", "0"),
            ("--block-size", "64"),
            ("--target-keep", "inf"),
        ],
    ));
    let generate = [
        "generate", "--model", model, "--prompt", "hi", "--device", "cpu",
    ];
    cases.extend(out_of_range(
        &generate,
        dir,
        &[
            ("--temperature", "nan"),
            ("--temperature", "-1"),
            ("--temperature", "inf"),
            ("--top-p", "0"),
            ("--top-p", "nan"),
            ("--top-k", "0"),
            ("--target-context", "0"),
        ],
    ));
    let calibrate = [
        "calibrate",
        "--model",
        model,
        "--data",
        path(&data),
        "--seq-len",
        "32",
        "--device",
        "cpu",
        "--out",
        path(&thresholds),
    ];
    cases.extend(out_of_range(
        &calibrate,
        dir,
        &[
            ("--target-keep", "0"),
            ("--target-keep", "1.5"),
            ("--block-size", "0"),
            ("--calibration-sequences", "0"),
            ("--min-keep", "-1"),
            ("--seq-len", "1"),
        ],
    ));
    let bench = ["bench", "--model", model, "--device", "cpu"];
    cases.extend(out_of_range(
        &bench,
        dir,
        &[
            ("--steps", "0"),
            ("--seq-lens", "0"),
            ("--seq-lens", "1,-2"),
            ("--lora-rank", "0"),
        ],
    ));
    let merge = [
        "merge",
        "--model",
        model,
        "--adapter",
        path(dir),
        "--out",
        path(&merged),
    ];
    cases.extend(out_of_range(
        &merge,
        dir,
        &[("--max-shard-mb", "0"), ("--target-context", "0")],
    ));
    if let Some(data) = lemo_test_support::shared_data() {
        let tokenizer = data.join("models/stories260K/tok512.bin");
        let passkey = ["passkey", "--tokenizer", path(&tokenizer)];
        cases.extend(out_of_range(
            &passkey,
            dir,
            &[
                ("--trials", "0"),
                ("--lengths", "0"),
                ("--lengths", "1024,-1"),
            ],
        ));
    }
    check_all(cases);
}

/// Each setting valid alone, impossible together with the model or the others.
#[test]
fn combinations_that_cannot_work_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let (fixture, tokens) = llama_fixture();
    let (model, tokens) = (path(&fixture), path(&tokens));
    let data = id_documents(dir, 3, 40);
    let thresholds = dir.join("thresholds.json");
    let calibrated = crate::lemo(&[
        "calibrate",
        "--model",
        model,
        "--data",
        path(&data),
        "--seq-len",
        "32",
        "--block-size",
        "8",
        "--dense-layers",
        "0",
        "--calibration-sequences",
        "1",
        "--device",
        "cpu",
        "--out",
        path(&thresholds),
    ]);
    assert!(
        calibrated.status.success(),
        "{}",
        String::from_utf8_lossy(&calibrated.stderr)
    );
    let out = dir.join("run");
    let train = |extra: &[&str], needle: &str| {
        let args = [
            &[
                "train",
                "--model",
                model,
                "--data",
                path(&data),
                "--steps",
                "1",
                "--cache-dir",
                "none",
                "--device",
                "cpu",
                "--out",
                path(&out),
            ][..],
            extra,
        ]
        .concat();
        case(&args, needle).watching(dir)
    };
    let cases = vec![
        // Blocks longer than the sequence.
        train(
            &["--method", "lemo", "--seq-len", "16", "--block-size", "64"],
            "--block-size",
        ),
        // A rank past the model's width; LeMo's thresholds with another method.
        train(&["--lora-rank", "100000000"], "--lora-rank 100000000"),
        train(
            &["--method", "lora", "--thresholds", path(&thresholds)],
            "--thresholds applies to --method lemo",
        ),
        // Past the 128 positions the model addresses without --target-context.
        train(&["--seq-len", "4096"], "--target-context"),
        case(
            &[
                "eval",
                "--model",
                model,
                "--data",
                tokens,
                "--seq-len",
                "4096",
                "--device",
                "cpu",
            ],
            "4096",
        )
        .watching(dir),
        // Thresholds calibrated with blocks of 8 tokens.
        train(
            &[
                "--method",
                "lemo",
                "--seq-len",
                "32",
                "--block-size",
                "16",
                "--thresholds",
                path(&thresholds),
            ],
            "--block-size 16",
        ),
    ];
    check_all(cases);
}
