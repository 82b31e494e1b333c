//! Tokenizer ids against references made outside this crate: the Python `tokenizers` package and
//! a Python port of llama2.c's run.c (tests/fixtures/tokenizer/make_reference.py), run.c's own
//! golden prompt, and swift-transformers' published Llama-2 ids. The real tokenizers are read from
//! ../shared/data; tests that need them skip when it is absent.

use lemo_models::tokenizer::Tokenizer;
use lemo_test_support::read_json;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const LLAMA2_JSON: &str = "tokenizers/llama2/tokenizer.json";
const LLAMA2_BIN: &str = "tokenizers/llama2/tokenizer.bin";
const TOK512_BIN: &str = "models/stories260K/tok512.bin";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(name)
}

fn load(path: &Path) -> Tokenizer {
    Tokenizer::from_file(path).unwrap_or_else(|e| panic!("{e}"))
}

fn ids(value: &Value) -> Vec<u32> {
    let list = value.as_array().expect("an id list");
    list.iter()
        .map(|id| u32::try_from(id.as_u64().expect("an id")).expect("a u32 id"))
        .collect()
}

/// Reference cases as (text, ids, decoded text) for one tokenizer column of a fixture.
fn cases(fixture_name: &str, column: Option<&str>) -> Vec<(String, Vec<u32>, String)> {
    let expected = read_json(&fixture(fixture_name));
    let cases = expected["cases"].as_array().expect("cases");
    assert!(
        cases.len() >= 10,
        "too few reference cases in {fixture_name}"
    );
    cases
        .iter()
        .map(|case| {
            let reference = column.map_or(case, |column| &case[column]);
            let text = case["text"].as_str().expect("text").to_owned();
            let decoded = reference["decoded"].as_str().expect("decoded").to_owned();
            (text, ids(&reference["ids"]), decoded)
        })
        .collect()
}

fn reference_texts() -> Vec<String> {
    let expected = read_json(&fixture("expected_llama2.json"));
    let cases = expected["cases"].as_array().expect("cases");
    cases
        .iter()
        .map(|case| case["text"].as_str().expect("text").to_owned())
        .collect()
}

fn assert_encodes_and_decodes_as(tokenizer: &Tokenizer, cases: &[(String, Vec<u32>, String)]) {
    for (text, expected_ids, expected_text) in cases {
        let encoded = tokenizer.encode(text).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&encoded, expected_ids, "ids of {text:?}");
        assert_eq!(
            &tokenizer.decode(expected_ids),
            expected_text,
            "decoding {expected_ids:?}"
        );
    }
}

#[test]
fn hugging_face_llama2_matches_python_tokenizers() {
    let Some(data) = lemo_test_support::shared_data() else {
        return;
    };
    let tokenizer = load(&data.join(LLAMA2_JSON));
    assert_encodes_and_decodes_as(
        &tokenizer,
        &cases("expected_llama2.json", Some("tokenizer_json")),
    );
}

#[test]
fn hugging_face_llama2_matches_swift_transformers_ids() {
    let Some(data) = lemo_test_support::shared_data() else {
        return;
    };
    let tokenizer = load(&data.join(LLAMA2_JSON));
    let reference = read_json(&data.join("tokenizers/llama2/llama_encoded.json"));
    let text = reference["text"].as_str().expect("text");
    assert_eq!(
        tokenizer.encode(text).unwrap(),
        ids(&reference["token_ids"])
    );
    assert_eq!(tokenizer.decode(&ids(&reference["token_ids"])), text);
}

#[test]
fn hugging_face_llama2_special_ids() {
    let Some(data) = lemo_test_support::shared_data() else {
        return;
    };
    let tokenizer = load(&data.join(LLAMA2_JSON));
    assert_eq!(tokenizer.bos_id(), Some(1));
    assert_eq!(tokenizer.eos_id(), Some(2));
    assert_eq!(tokenizer.vocab_size(), 32000);
    // The post-processor adds BOS, also to the empty text.
    assert_eq!(tokenizer.encode("").unwrap(), [1]);
}

#[test]
fn llama2c_llama2_matches_run_c_port() {
    let Some(data) = lemo_test_support::shared_data() else {
        return;
    };
    let tokenizer = load(&data.join(LLAMA2_BIN));
    assert_eq!(tokenizer.vocab_size(), 32000);
    assert_encodes_and_decodes_as(
        &tokenizer,
        &cases("expected_llama2.json", Some("llama2_bin")),
    );
}

#[test]
fn llama2c_tok512_matches_run_c_port() {
    let Some(data) = lemo_test_support::shared_data() else {
        return;
    };
    let tokenizer = load(&data.join(TOK512_BIN));
    assert_eq!(tokenizer.vocab_size(), 512);
    assert_encodes_and_decodes_as(
        &tokenizer,
        &cases("expected_llama2.json", Some("tok512_bin")),
    );
}

#[test]
fn llama2c_tok512_matches_run_c_golden_prompt() {
    let Some(data) = lemo_test_support::shared_data() else {
        return;
    };
    let tokenizer = load(&data.join(TOK512_BIN));
    let golden = read_json(&data.join("models/stories260K/golden_logits_once_upon_a_time.json"));
    let prompt = golden["prompt"].as_str().expect("prompt");
    assert_eq!(prompt, "Once upon a time");
    assert_eq!(ids(&golden["tokens"]), [1, 403, 407, 261, 378]);
    assert_eq!(tokenizer.encode(prompt).unwrap(), [1, 403, 407, 261, 378]);
    assert_eq!(tokenizer.decode(&[1, 403, 407, 261, 378]), prompt);
}

/// The llama2.c and Hugging Face files hold the same SentencePiece model, so on plain ASCII
/// their different merge rules (scores vs merge ranks) must give the same ids.
#[test]
fn llama2_bin_agrees_with_tokenizer_json_on_ascii() {
    let Some(data) = lemo_test_support::shared_data() else {
        return;
    };
    let from_json = load(&data.join(LLAMA2_JSON));
    let from_bin = load(&data.join(LLAMA2_BIN));
    let book = std::fs::read_to_string(data.join("corpora/gutenberg/pg11.txt")).unwrap();
    let paragraphs = book
        .split("\r\n\r\n")
        .filter(|p| p.is_ascii() && p.len() > 200)
        .take(20);
    for text in paragraphs.chain(["Once upon a time, there was a little girl."]) {
        assert_eq!(
            from_bin.encode(text).unwrap(),
            from_json.encode(text).unwrap(),
            "{text:?}"
        );
    }
}

/// run.c's merge loop as written (rescan all pairs, take the strictly best), to check the
/// heap-based merge against on long real text.
fn run_c_encode(tokenizer_bin: &[u8], text: &str) -> Vec<u32> {
    let mut pieces: Vec<&[u8]> = Vec::new();
    let mut scores = Vec::new();
    let mut offset = 4;
    while offset < tokenizer_bin.len() {
        let field = |at: usize| <[u8; 4]>::try_from(&tokenizer_bin[at..at + 4]).unwrap();
        scores.push(f32::from_le_bytes(field(offset)));
        let length = usize::try_from(i32::from_le_bytes(field(offset + 4))).unwrap();
        pieces.push(&tokenizer_bin[offset + 8..offset + 8 + length]);
        offset += 8 + length;
    }
    let mut ids_by_piece = HashMap::new();
    for (id, piece) in pieces.iter().enumerate().rev() {
        ids_by_piece.insert(*piece, id); // the first of equal pieces, as run.c's lookup usually finds
    }
    let lookup = |piece: &[u8]| ids_by_piece.get(piece).copied();
    let mut tokens = vec![1];
    if !text.is_empty() {
        tokens.push(lookup(b" ").unwrap());
    }
    for c in text.chars() {
        let mut utf8 = [0u8; 4];
        let bytes = c.encode_utf8(&mut utf8).as_bytes();
        match lookup(bytes) {
            Some(id) => tokens.push(id),
            None => tokens.extend(bytes.iter().map(|&b| usize::from(b) + 3)),
        }
    }
    loop {
        let mut best: Option<(f32, usize, usize)> = None;
        for i in 0..tokens.len() - 1 {
            let merged = [pieces[tokens[i]], pieces[tokens[i + 1]]].concat();
            if let Some(id) = lookup(&merged)
                && scores[id] > best.map_or(-1e10, |(score, _, _)| score)
            {
                best = Some((scores[id], id, i));
            }
        }
        let Some((_, id, i)) = best else { break };
        tokens[i] = id;
        tokens.remove(i + 1);
    }
    tokens
        .into_iter()
        .map(|id| u32::try_from(id).unwrap())
        .collect()
}

#[test]
fn llama2c_merges_match_run_c_loop_on_real_text() {
    let Some(data) = lemo_test_support::shared_data() else {
        return;
    };
    let samples = [
        "corpora/gutenberg/pg2701.txt",
        "corpora/gutenberg/pg5200.txt",
        "corpora/stacks-math/topology.tex",
        "corpora/code-sqlite/shell.c",
    ];
    for tokenizer_name in [TOK512_BIN, LLAMA2_BIN] {
        let tokenizer_bin = std::fs::read(data.join(tokenizer_name)).unwrap();
        let tokenizer = load(&data.join(tokenizer_name));
        for sample in samples {
            let text = std::fs::read_to_string(data.join(sample)).unwrap();
            let text: String = text.chars().skip(5000).take(1500).collect();
            let expected = run_c_encode(&tokenizer_bin, &text);
            assert_eq!(
                tokenizer.encode(&text).unwrap(),
                expected,
                "{tokenizer_name} on {sample}"
            );
        }
    }
}

/// The bytes printed when `ids` are streamed one piece at a time after token `start`.
fn streamed(tokenizer: &Tokenizer, start: u32, ids: &[u32]) -> String {
    let mut bytes = Vec::new();
    let mut prev = start;
    for &id in ids {
        bytes.extend(tokenizer.decode_piece(prev, id));
        prev = id;
    }
    String::from_utf8(bytes).expect("streamed pieces join into UTF-8")
}

/// Streaming after BOS prints what whole-sequence decoding gives, byte-fallback characters split
/// over several tokens included. Texts that spell special tokens are left out: Hugging Face
/// decoders drop a leading space after every special token, which streaming cannot see.
#[test]
fn streamed_pieces_join_into_the_decoded_text() {
    let Some(data) = lemo_test_support::shared_data() else {
        return;
    };
    for tokenizer_name in [LLAMA2_JSON, LLAMA2_BIN, TOK512_BIN] {
        let tokenizer = load(&data.join(tokenizer_name));
        for text in reference_texts() {
            if text.contains("<s>") {
                continue;
            }
            let ids = tokenizer.encode(&text).unwrap();
            assert_eq!(ids[0], 1, "{tokenizer_name} starts {text:?} with BOS");
            assert_eq!(
                streamed(&tokenizer, ids[0], &ids[1..]),
                text,
                "{tokenizer_name}"
            );
        }
    }
}

#[test]
fn llama2c_decode_piece_follows_run_c() {
    let Some(data) = lemo_test_support::shared_data() else {
        return;
    };
    let tokenizer = load(&data.join(LLAMA2_BIN));
    let once = 9038; // " Once"
    assert_eq!(tokenizer.decode_piece(1, once), b"Once");
    assert_eq!(tokenizer.decode_piece(13, once), b" Once");
    assert_eq!(tokenizer.decode_piece(1, 3 + 0xE6), [0xE6]); // the piece "<0xE6>"
    assert_eq!(tokenizer.decode_piece(1, 1_000_000), b"");
}

/// A GPT-2 style byte-level BPE (trained by make_reference.py): no BOS, and pieces that are
/// parts of UTF-8 characters written as byte-alphabet characters.
#[test]
fn hugging_face_byte_level_matches_python_and_streams_bytes() {
    let tokenizer = load(&fixture("byte_level_tokenizer.json"));
    let cases = cases("expected_byte_level.json", None);
    assert_encodes_and_decodes_as(&tokenizer, &cases);
    assert_eq!(tokenizer.bos_id(), None);
    let end_of_text = tokenizer.eos_id().expect("<|endoftext|> is EOS");
    for (text, ids, decoded) in &cases {
        assert!(ids.iter().all(|&id| id != end_of_text), "{text:?}");
        assert_eq!(&streamed(&tokenizer, end_of_text, ids), decoded, "{text:?}");
    }
    // A split emoji really is in the cases, so the byte mapping is exercised.
    assert!(
        cases.iter().any(|(_, ids, _)| ids
            .iter()
            .any(|&id| { std::str::from_utf8(&tokenizer.decode_piece(end_of_text, id)).is_err() }))
    );
}

fn scratch_dir(test_name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("tokenizer")
        .join(test_name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn hugging_face_special_ids_come_from_tokenizer_config() {
    let dir = scratch_dir("tokenizer_config");
    let path = dir.join("tokenizer.json");
    std::fs::copy(fixture("byte_level_tokenizer.json"), &path).unwrap();
    assert_eq!(load(&path).bos_id(), None, "no config and no BOS spelling");

    let config = r#"{"bos_token": {"content": "<|endoftext|>"}, "eos_token": "<|endoftext|>"}"#;
    std::fs::write(dir.join("tokenizer_config.json"), config).unwrap();
    let tokenizer = load(&path);
    assert_eq!(tokenizer.bos_id(), Some(0));
    assert_eq!(tokenizer.eos_id(), Some(0));

    std::fs::write(dir.join("tokenizer_config.json"), "{ not json").unwrap();
    let message = Tokenizer::from_file(&path).unwrap_err().to_string();
    assert!(message.contains("tokenizer_config.json"), "{message}");
}

/// A llama2.c tokenizer.bin with <unk>, BOS, EOS, the 256 byte pieces, " " and `extra`.
fn llama2c_bin(extra: &[(&str, f32)]) -> Vec<u8> {
    let byte_pieces: Vec<String> = (0..=255).map(|b| format!("<0x{b:02X}>")).collect();
    let pieces = ["<unk>", "\n<s>\n", "\n</s>\n"]
        .into_iter()
        .map(|piece| (piece, 0.0))
        .chain(byte_pieces.iter().map(|piece| (piece.as_str(), 0.0)))
        .chain([(" ", -100.0)])
        .chain(extra.iter().copied());
    let mut bytes = 8i32.to_le_bytes().to_vec();
    for (piece, score) in pieces {
        bytes.extend(f32::to_le_bytes(score));
        bytes.extend(i32::try_from(piece.len()).unwrap().to_le_bytes());
        bytes.extend(piece.as_bytes());
    }
    bytes
}

fn load_llama2c_bin(test_name: &str, extra: &[(&str, f32)]) -> Tokenizer {
    let path = scratch_dir(test_name).join("tokenizer.bin");
    std::fs::write(&path, llama2c_bin(extra)).unwrap();
    load(&path)
}

/// Ids of `extra` pieces start after the 259 fixed ones and " ".
const FIRST_EXTRA_ID: u32 = 260;

#[test]
fn llama2c_merge_ties_go_to_the_leftmost_pair() {
    let a = FIRST_EXTRA_ID;
    let tokenizer = load_llama2c_bin("ties", &[("a", 0.0), ("aa", -1.0)]);
    assert_eq!(tokenizer.encode("aaa").unwrap(), [1, 259, a + 1, a]);
    // run.c compares with `>`, so -0.0 ties with 0.0 and the left pair still wins.
    let (x, z, xy) = (a, a + 2, a + 3);
    let pieces = [
        ("x", 0.0),
        ("y", 0.0),
        ("z", 0.0),
        ("xy", -0.0),
        ("yz", 0.0),
    ];
    let tokenizer = load_llama2c_bin("signed_zero", &pieces);
    assert_eq!(tokenizer.encode("xyz").unwrap(), [1, 259, xy, z]);
    assert_eq!(tokenizer.encode("zx").unwrap(), [1, 259, z, x]);
}

#[test]
fn llama2c_merges_need_a_score_above_run_c_floor() {
    let a = FIRST_EXTRA_ID;
    let tokenizer = load_llama2c_bin(
        "floor",
        &[("a", 0.0), ("b", 0.0), ("ab", -1e10), ("ba", -9e9)],
    );
    assert_eq!(tokenizer.encode("ab").unwrap(), [1, 259, a, a + 1]);
    assert_eq!(tokenizer.encode("ba").unwrap(), [1, 259, a + 3]);
    // Characters that are not pieces fall back to their UTF-8 bytes.
    assert_eq!(tokenizer.encode("é").unwrap(), [1, 259, 3 + 0xC3, 3 + 0xA9]);
    assert_eq!(tokenizer.decode(&[1, 259, 3 + 0xC3, 3 + 0xA9]), "é");
    assert_eq!(tokenizer.encode("").unwrap(), [1]);
}

fn assert_error_names(result: lemo_models::Result<Tokenizer>, path: &Path, what: &str) {
    let message = result.expect_err("an error").to_string();
    assert!(
        message.contains(&path.display().to_string()),
        "{message:?} names {path:?}"
    );
    assert!(message.contains(what), "{message:?} says {what:?}");
    assert!(!message.contains('\n'), "{message:?} is one line");
}

#[test]
fn missing_files_are_errors_naming_the_file() {
    let dir = scratch_dir("missing");
    for name in ["tokenizer.json", "tokenizer.bin"] {
        let path = dir.join(name);
        assert_error_names(Tokenizer::from_file(&path), &path, "cannot read");
    }
}

#[test]
fn bad_files_are_errors_naming_the_file() {
    let dir = scratch_dir("bad");
    let garbage_json = dir.join("tokenizer.json");
    std::fs::write(&garbage_json, "{\"model\": [1, 2").unwrap();
    let what = "not a Hugging Face tokenizer.json";
    assert_error_names(Tokenizer::from_file(&garbage_json), &garbage_json, what);

    let unknown = dir.join("tokenizer.model");
    std::fs::write(&unknown, "x").unwrap();
    assert_error_names(
        Tokenizer::from_file(&unknown),
        &unknown,
        "unknown tokenizer format",
    );

    let complete = llama2c_bin(&[]);
    let bin = dir.join("tokenizer.bin");
    for (cut, what) in [
        (2, "no header"),
        (complete.len() - 1, "truncated"),
        (10, "truncated"),
    ] {
        std::fs::write(&bin, &complete[..cut]).unwrap();
        assert_error_names(Tokenizer::from_file(&bin), &bin, what);
    }

    let mut stray_bytes = complete.clone();
    stray_bytes.extend([0, 0]); // half of a next token's score
    std::fs::write(&bin, &stray_bytes).unwrap();
    assert_error_names(Tokenizer::from_file(&bin), &bin, "token 260 is cut off");

    let mut too_long = complete.clone();
    too_long[8..12].copy_from_slice(&9i32.to_le_bytes()); // <unk> claims 9 bytes, over the max 8
    std::fs::write(&bin, &too_long).unwrap();
    assert_error_names(Tokenizer::from_file(&bin), &bin, "corrupt");

    let mut no_space = complete.clone();
    no_space.truncate(complete.len() - 9); // drop the final " " piece
    std::fs::write(&bin, &no_space).unwrap();
    assert_error_names(Tokenizer::from_file(&bin), &bin, "no \" \" piece");

    let after_eos = 4 + (8 + 5) + (8 + 5) + (8 + 6); // header, <unk>, BOS, EOS
    std::fs::write(&bin, &complete[..after_eos]).unwrap();
    assert_error_names(
        Tokenizer::from_file(&bin),
        &bin,
        "is not the byte piece <0x00>",
    );
}
