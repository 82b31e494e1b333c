//! Conversations rendered with a model's own chat template (a Jinja template, from
//! `tokenizer_config.json`, `chat_template.jinja` or a GGUF's `tokenizer.chat_template`), run
//! the way transformers' `apply_chat_template` runs it: `trim_blocks` and `lstrip_blocks`, loop
//! controls, Python string methods, `raise_exception`, and the special tokens as variables.
//!
//! What the loss is taken on is found from the template itself: an assistant turn is the text
//! that rendering the conversation up to and including that turn adds to rendering the turns
//! before it with the generation prompt, so the mask covers the answer and whatever the
//! template closes it with (an end-of-turn token), never the prompt's markup.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, ErrorKind, Value as JinjaValue, context};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    /// `{"role": ..., "content": ...}` as the template sees a message.
    fn to_value(&self) -> JinjaValue {
        JinjaValue::from(BTreeMap::from([
            ("role", JinjaValue::from(self.role.as_str())),
            ("content", JinjaValue::from(self.content.as_str())),
        ]))
    }
}

/// The turns of one chat record: `{"messages": [{"role", "content"}, ...]}`, or
/// `{"prompt": ..., "completion": ...}` where each side is a text (a user turn and an assistant
/// turn) or a list of messages. A record without an assistant turn is an error: it has nothing
/// to learn from.
pub fn parse_record(record: &Value) -> std::result::Result<Vec<Message>, String> {
    let messages = |value: &Value, what: &str| -> std::result::Result<Vec<Message>, String> {
        serde_json::from_value(value.clone())
            .map_err(|e| format!("{what} is not a list of {{\"role\", \"content\"}} messages: {e}"))
    };
    let side = |key: &str, role: &str| -> std::result::Result<Vec<Message>, String> {
        match record.get(key) {
            Some(Value::String(text)) => Ok(vec![Message::new(role, text)]),
            Some(list @ Value::Array(_)) => messages(list, &format!("\"{key}\"")),
            Some(_) => Err(format!(
                "\"{key}\" is neither a text nor a list of messages"
            )),
            None => Err(format!("no \"{key}\"")),
        }
    };
    let turns = if let Some(list) = record.get("messages") {
        messages(list, "\"messages\"")?
    } else if record.get("prompt").is_some() || record.get("completion").is_some() {
        let mut turns = side("prompt", "user")?;
        turns.extend(side("completion", "assistant")?);
        turns
    } else {
        return Err("a chat record has \"messages\", or \"prompt\" and \"completion\"".into());
    };
    if !turns.iter().any(|m| m.role == "assistant") {
        return Err("the record has no assistant turn: there is nothing to train on".into());
    }
    Ok(turns)
}

/// A conversation's text and the byte ranges of its assistant turns.
#[derive(Debug, Clone, PartialEq)]
pub struct RenderedChat {
    pub text: String,
    pub assistant: Vec<Range<usize>>,
}

/// A compiled chat template and the special tokens it is given.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const TEMPLATE_NAME: &str = "chat_template";

fn template_error(e: &minijinja::Error) -> Error {
    // One line: the engine's message names the problem and the template line.
    let message = e.to_string().replace('\n', " ");
    Error::Config(format!("chat template: {message}"))
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error(&e))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<JinjaValue, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| template_error(&e))?;
        Ok(Self {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The template a model comes with ([`Self::source_for_model`]), BOS and EOS being the
    /// tokenizer's.
    pub fn for_model(model: &Path, tokenizer: &Tokenizer) -> Result<Self> {
        let token = |id: Option<u32>| id.map(|id| tokenizer.token_text(id)).unwrap_or_default();
        let (bos, eos) = (token(tokenizer.bos_id()), token(tokenizer.eos_id()));
        Self::new(&Self::source_for_model(model)?, &bos, &eos)
    }

    /// The Jinja source of a model's template: a GGUF's `tokenizer.chat_template`, or in a
    /// Hugging Face folder `chat_template.jinja` or `tokenizer_config.json`'s `chat_template` (a
    /// text, or a list of named templates of which `default` is taken).
    pub fn source_for_model(model: &Path) -> Result<String> {
        let missing = || {
            Error::format(
                model,
                "the model has no chat template (tokenizer_config.json chat_template, chat_template.jinja or GGUF tokenizer.chat_template)",
            )
        };
        if model.extension().is_some_and(|e| e == "gguf") {
            let file = crate::gguf::GgufFile::open(model)?;
            return file
                .metadata("tokenizer.chat_template")
                .and_then(crate::gguf::Value::as_str)
                .map(str::to_string)
                .ok_or_else(missing);
        }
        let folder = if model.is_dir() {
            model
        } else {
            model.parent().unwrap_or(Path::new("."))
        };
        let jinja = folder.join("chat_template.jinja");
        if jinja.is_file() {
            return std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e));
        }
        let config_path = folder.join("tokenizer_config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|_| missing())?;
        let config: Value = serde_json::from_str(&text)
            .map_err(|e| Error::format(&config_path, format!("invalid JSON: {e}")))?;
        match config.get("chat_template") {
            Some(Value::String(source)) => Ok(source.clone()),
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .map(str::to_string)
                .ok_or_else(missing),
            _ => Err(missing()),
        }
    }

    /// The template's text for `messages`, with the assistant's opening when
    /// `add_generation_prompt` (what transformers' `apply_chat_template(tokenize=False)` gives).
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_error(&e))?;
        template
            .render(context! {
                messages => messages.iter().map(Message::to_value).collect::<Vec<_>>(),
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| template_error(&e))
    }

    /// The whole conversation and where each assistant turn's text lies in it (see the module
    /// docs). Fails with one line when a template renders a conversation so that its earlier
    /// turns are not a prefix of it (the turns cannot be told apart then).
    pub fn render_conversation(&self, messages: &[Message]) -> Result<RenderedChat> {
        let text = self.render(messages, false)?;
        let mut assistant = Vec::new();
        for (index, message) in messages.iter().enumerate() {
            if message.role != "assistant" {
                continue;
            }
            let before = self.render(&messages[..index], true)?;
            let through = self.render(&messages[..=index], false)?;
            if !through.starts_with(&before) || !text.starts_with(&through) {
                return Err(Error::Config(format!(
                    "chat template: rendering the turns before assistant turn {index} does not give a prefix of the conversation, so the assistant's text cannot be located"
                )));
            }
            assistant.push(before.len()..through.len());
        }
        Ok(RenderedChat { text, assistant })
    }
}

/// Which tokens of a chat record the loss is taken on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossOn {
    /// Every token, the prompt's included.
    All,
    /// The assistant turns' tokens only.
    Assistant,
}

/// A rendered conversation's token ids (no special tokens added beyond the template's own, as
/// `apply_chat_template(tokenize=True)` does) and, per token, whether it is trained on: every
/// token under [`LossOn::All`], else those whose text overlaps an assistant turn (a token that
/// straddles the turn's start, such as a newline merged with the answer's first space, is the
/// answer's, as transformers' assistant masks count it).
pub fn tokenize_chat(
    tokenizer: &Tokenizer,
    chat: &RenderedChat,
    loss_on: LossOn,
) -> Result<(Vec<u32>, Vec<bool>)> {
    let pieces = tokenizer.encode_with_offsets(&chat.text)?;
    let trained = pieces
        .iter()
        .map(|(_, span)| {
            loss_on == LossOn::All
                || chat
                    .assistant
                    .iter()
                    .any(|turn| span.start < turn.end && turn.start < span.end)
        })
        .collect();
    Ok((pieces.into_iter().map(|(id, _)| id).collect(), trained))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn assistant_turns_are_located_from_the_template() {
        let template = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let messages = [
            Message::new("user", "Hi"),
            Message::new("assistant", "Hello!"),
            Message::new("user", "Bye"),
            Message::new("assistant", "Bye."),
        ];
        let chat = template.render_conversation(&messages).unwrap();
        let turns: Vec<&str> = chat
            .assistant
            .iter()
            .map(|r| &chat.text[r.clone()])
            .collect();
        assert_eq!(turns, ["Hello!<|im_end|>\n", "Bye.<|im_end|>\n"]);
    }

    #[test]
    fn records_in_both_shapes_and_their_errors() {
        let turns = parse_record(&json!({"prompt": "Q", "completion": "A"})).unwrap();
        assert_eq!(
            turns,
            [Message::new("user", "Q"), Message::new("assistant", "A")]
        );
        let error = parse_record(&json!({"messages": [{"role": "user", "content": "Q"}]}));
        assert!(error.unwrap_err().contains("no assistant turn"));
        assert!(parse_record(&json!({"text": "plain"})).is_err());
        assert!(parse_record(&json!({"messages": [{"role": "user"}]})).is_err());
    }

    #[test]
    fn templates_that_fail_are_one_line_errors() {
        let unparsable = ChatTemplate::new("{% for m in messages %}", "", "")
            .err()
            .unwrap();
        assert!(unparsable.to_string().starts_with("chat template:"));
        let raising = "{{ raise_exception('Conversation roles must alternate') }}";
        let error = ChatTemplate::new(raising, "", "")
            .unwrap()
            .render(&[], false)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("Conversation roles must alternate"),
            "{error}"
        );
        assert!(!error.contains('\n'));
    }
}
