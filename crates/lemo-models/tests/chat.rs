//! Chat templates against transformers' `apply_chat_template` (fixture made by
//! `fixtures/chat/make_chat_fixtures.py`): the SmolLM2 template (from its GGUF) and Llama-2-chat's,
//! rendered text and, where the tokenizers are at hand, token ids; and the loss mask covering
//! exactly the assistant turns.

use lemo_models::chat::{ChatTemplate, LossOn, Message, tokenize_chat};
use lemo_models::tokenizer::Tokenizer;
use serde_json::Value;

fn fixture() -> Value {
    let path =
        lemo_test_support::repo_root().join("crates/lemo-models/tests/fixtures/chat/chat.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn template(entry: &Value) -> ChatTemplate {
    let text = |key: &str| entry[key].as_str().unwrap_or_default();
    ChatTemplate::new(text("template"), text("bos_token"), text("eos_token")).unwrap()
}

fn messages(case: &Value) -> Vec<Message> {
    serde_json::from_value(case["messages"].clone()).unwrap()
}

#[test]
fn rendering_matches_transformers() {
    let fixture = fixture();
    for (name, entry) in fixture["templates"].as_object().unwrap() {
        let template = template(entry);
        for case in entry["cases"].as_array().unwrap() {
            let messages = messages(case);
            assert_eq!(
                template.render(&messages, false).unwrap(),
                case["text"].as_str().unwrap(),
                "{name}"
            );
            assert_eq!(
                template
                    .render(&messages[..messages.len() - 1], true)
                    .unwrap(),
                case["prompt_text"].as_str().unwrap(),
                "{name}: with the generation prompt"
            );
        }
    }
}

/// The tokenizer each template's ids were made with, when it is on this machine.
fn tokenizer(name: &str) -> Option<Tokenizer> {
    let path = match name {
        "smollm2" => lemo_test_support::smollm2_gguf()?,
        "llama2" => lemo_test_support::shared_data()?.join("tokenizers/llama2/tokenizer.json"),
        other => panic!("no tokenizer for {other}"),
    };
    Some(Tokenizer::from_file(&path).unwrap())
}

/// Token ids as `apply_chat_template(tokenize=True)` gives them, and the loss mask: the tokens
/// trained on under `--loss-on assistant` spell the assistant turns (with the template's
/// end-of-turn markup) and nothing else.
#[test]
fn token_ids_and_assistant_mask_match_transformers() {
    let fixture = fixture();
    for (name, entry) in fixture["templates"].as_object().unwrap() {
        let Some(tokenizer) = tokenizer(name) else {
            continue;
        };
        let template = template(entry);
        for case in entry["cases"].as_array().unwrap() {
            let messages = messages(case);
            let chat = template.render_conversation(&messages).unwrap();
            let (ids, trained) = tokenize_chat(&tokenizer, &chat, LossOn::Assistant).unwrap();
            let expected: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
            assert_eq!(ids, expected, "{name}");
            let (_, all) = tokenize_chat(&tokenizer, &chat, LossOn::All).unwrap();
            assert!(all.iter().all(|&t| t));

            // The text the trained tokens cover holds every answer and no question.
            let pieces = tokenizer.encode_with_offsets(&chat.text).unwrap();
            let covered: String = pieces
                .iter()
                .zip(&trained)
                .filter(|(_, t)| **t)
                .map(|((_, span), _)| &chat.text[span.clone()])
                .collect();
            for message in &messages {
                let content = message.content.trim();
                let inside = covered.contains(content);
                assert_eq!(
                    inside,
                    message.role == "assistant",
                    "{name}: {content:?} in {covered:?}"
                );
            }
            assert!(trained.iter().any(|&t| !t), "{name}: the prompt is masked");
        }
    }
}

#[test]
fn llama2_template_refuses_turns_out_of_order() {
    let fixture = fixture();
    let template = template(&fixture["templates"]["llama2"]);
    let error = template
        .render(
            &[Message::new("user", "a"), Message::new("user", "b")],
            false,
        )
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("Conversation roles must alternate"),
        "{error}"
    );
    assert!(!error.contains('\n'));
}
