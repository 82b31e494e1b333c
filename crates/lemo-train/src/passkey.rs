//! Passkey retrieval (Landmark Attention / LongLoRA format): a task description, filler
//! sentences, one line "The pass key is N. Remember it. N is the pass key." at a random depth,
//! more filler, and the question "What is the pass key? The pass key is" at the end. A model
//! that uses its whole context continues with N. With `--chat` the prompt up to the question is
//! a user turn of the model's chat template, and the model answers as its assistant.

use std::path::PathBuf;

use anyhow::{Result, anyhow, bail};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use lemo_kernels::LemoBackend;
use lemo_models::KvCache;
use lemo_models::chat::{ChatTemplate, Message};
use lemo_models::tokenizer::Tokenizer;
use rand::{RngExt, SeedableRng, rngs::StdRng};
use serde::Serialize;

use crate::data::chat::LazyChatTemplate;
use crate::device::BackendJob;
use crate::modelio::ModelSetup;

const TASK: &str = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. \
                    I will quiz you about the important information there.";
const FILLER: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
const QUESTION: &str = "What is the pass key? The pass key is";
/// The end of [`QUESTION`] that cues a plain model's answer; a chat prompt asks without it.
const CUE: &str = " The pass key is";

/// One prompt.
#[derive(Debug, Clone, Serialize)]
pub struct PasskeyPrompt {
    pub text: String,
    pub passkey: u32,
    /// Where the key sits, as a fraction of the filler (0 = right after the task description).
    pub depth: f64,
    /// Tokens in `text` with this tokenizer (BOS included where it adds one).
    pub tokens: usize,
}

fn assemble(prefix_units: usize, suffix_units: usize, passkey: u32) -> String {
    let filler = |n: usize| vec![FILLER; n].join(" ");
    format!(
        "{TASK}\n{}\nThe pass key is {passkey}. Remember it. {passkey} is the pass key.\n{}\n{QUESTION}",
        filler(prefix_units),
        filler(suffix_units)
    )
}

/// A prompt of at most `length - reserve` tokens (as close as whole filler sentences allow), the
/// key at a random depth, a key of 1 to 50000 as LongLoRA draws it.
pub fn make_prompt(
    tokenizer: &Tokenizer,
    (length, reserve): (usize, usize),
    rng: &mut StdRng,
) -> Result<PasskeyPrompt> {
    let passkey = rng.random_range(1..=50000u32);
    let count = |units: usize| -> Result<usize> {
        Ok(tokenizer.encode(&assemble(units, 0, passkey))?.len())
    };
    let base = count(0)?;
    if base + reserve > length {
        let with = if reserve > 0 {
            " and chat template"
        } else {
            ""
        };
        bail!(
            "--lengths {length}: a passkey prompt needs at least {} tokens with this tokenizer{with}",
            base + reserve
        );
    }
    let length = length - reserve;
    let per_unit = (count(8)? - base) as f64 / 8.0;
    let mut units = ((length - base) as f64 / per_unit) as usize;
    while units > 0 && count(units)? > length {
        units -= 1;
    }
    while count(units + 1)? <= length {
        units += 1;
    }
    let depth: f64 = rng.random_range(0.0..1.0);
    let prefix = (units as f64 * depth).round() as usize;
    let text = assemble(prefix, units - prefix, passkey);
    let tokens = tokenizer.encode(&text)?.len();
    Ok(PasskeyPrompt {
        text,
        passkey,
        depth: prefix as f64 / units.max(1) as f64,
        tokens,
    })
}

/// The longest prompt made: past it the filler text alone is gigabytes.
pub const MAX_PROMPT_TOKENS: usize = 1 << 22;

/// `trials` prompts per length, seeded, each `reserve` tokens shorter than its length (room for
/// a chat template's markup).
pub fn make_prompts(
    tokenizer: &Tokenizer,
    lengths: &[usize],
    trials: usize,
    seed: u64,
    reserve: usize,
) -> Result<Vec<(usize, PasskeyPrompt)>> {
    if trials == 0 {
        bail!("--trials must be at least 1");
    }
    if let Some(length) = lengths.iter().find(|&&l| l > MAX_PROMPT_TOKENS) {
        bail!("--lengths {length}: passkey prompts are at most {MAX_PROMPT_TOKENS} tokens");
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    for &length in lengths {
        for _ in 0..trials {
            out.push((length, make_prompt(tokenizer, (length, reserve), &mut rng)?));
        }
    }
    Ok(out)
}

/// The prompts of [`make_prompts`] as JSONL, each record with its `length`.
pub fn prompts_jsonl(
    tokenizer: &Tokenizer,
    lengths: &[usize],
    trials: usize,
    seed: u64,
) -> Result<String> {
    let mut text = String::new();
    for (length, prompt) in make_prompts(tokenizer, lengths, trials, seed, 0)? {
        let mut record = serde_json::to_value(&prompt)?;
        record["length"] = length.into();
        text.push_str(&record.to_string());
        text.push('\n');
    }
    Ok(text)
}

#[derive(Debug, Clone, Serialize)]
pub struct LengthResult {
    pub length: usize,
    pub trials: usize,
    pub correct: usize,
    pub accuracy: f64,
}

/// Retrieval accuracy at every length, as `eval --passkey` reports it (a JSON array).
#[derive(Debug, Clone, Serialize)]
#[serde(transparent)]
pub struct PasskeyReport(pub Vec<LengthResult>);

impl std::fmt::Display for PasskeyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for r in &self.0 {
            writeln!(
                f,
                "passkey length {:>6}: {}/{} correct, accuracy {:.2}",
                r.length, r.correct, r.trials, r.accuracy
            )?;
        }
        Ok(())
    }
}

pub struct PasskeyJob {
    pub model: PathBuf,
    pub setup: ModelSetup,
    pub tokenizer: Tokenizer,
    pub lengths: Vec<usize>,
    pub trials: usize,
    pub seed: u64,
    /// Each prompt as a user turn of the model's chat template.
    pub chat: bool,
}

/// How a prompt reaches the model.
enum PromptForm<'a> {
    /// As written: the model continues "The pass key is".
    Plain,
    /// The prompt up to the question as a user turn of this template, the model answering as
    /// its assistant.
    Chat(&'a ChatTemplate),
}

impl PromptForm<'_> {
    /// The text the model reads for a prompt's `text`.
    fn text(&self, text: &str) -> Result<String> {
        match self {
            PromptForm::Plain => Ok(text.to_string()),
            PromptForm::Chat(template) => {
                let question = text.strip_suffix(CUE).unwrap_or(text);
                template
                    .render(&[Message::new("user", question)], true)
                    .map_err(|e| anyhow!("{e}"))
            }
        }
    }

    /// Tokens the form adds around a prompt, at most.
    fn markup_tokens(&self, tokenizer: &Tokenizer) -> Result<usize> {
        let probe = format!("x{CUE}");
        let bare = tokenizer.encode(&probe)?.len();
        Ok(tokenizer
            .encode(&self.text(&probe)?)?
            .len()
            .saturating_sub(bare))
    }

    /// Tokens generated for an answer: a chat answer may repeat the question first.
    fn answer_tokens(&self) -> usize {
        match self {
            PromptForm::Plain => 8,
            PromptForm::Chat(_) => 16,
        }
    }
}

/// The first run of digits in `text`.
fn first_number(text: &str) -> Option<u32> {
    let digits: String = text
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

impl BackendJob for PasskeyJob {
    type Output = Vec<LengthResult>;

    fn run<B: LemoBackend>(self, device: B::Device) -> Result<Vec<LengthResult>> {
        let mut template = LazyChatTemplate::new(&self.model);
        let form = match self.chat {
            true => PromptForm::Chat(template.get(&self.tokenizer)?),
            false => PromptForm::Plain,
        };
        let reserve = form.markup_tokens(&self.tokenizer)?;
        let prompts = make_prompts(
            &self.tokenizer,
            &self.lengths,
            self.trials,
            self.seed,
            reserve,
        )?;
        let (model, config) = crate::modelio::load::<B>(&self.model, &self.setup, &device)?;
        let mut results: Vec<LengthResult> = self
            .lengths
            .iter()
            .map(|&length| LengthResult {
                length,
                trials: 0,
                correct: 0,
                accuracy: 0.0,
            })
            .collect();
        for (index, (length, prompt)) in prompts.iter().enumerate() {
            let ids = self.tokenizer.encode(&form.text(&prompt.text)?)?;
            if let Some(limit) = config.max_sequence_length().filter(|&l| ids.len() + 8 > l) {
                bail!(
                    "passkey prompts of {length} tokens are longer than this model supports ({limit})"
                );
            }
            let mut cache = KvCache::new(model.num_layers());
            let mut input = ids.clone();
            let mut generated = Vec::new();
            // Enough tokens for a five-digit key however the tokenizer splits it.
            for _ in 0..form.answer_tokens() {
                let data: Vec<i32> = input.iter().map(|&t| t as i32).collect();
                let tokens = Tensor::<B, 2, Int>::from_data(
                    TensorData::new(data, [1, input.len()]),
                    &device,
                );
                let logits = model.forward(tokens, Some(&mut cache));
                let [_, len, vocab] = logits.dims();
                let next = logits
                    .slice([0..1, len - 1..len])
                    .reshape([vocab])
                    .argmax(0)
                    .into_scalar()
                    .elem::<i64>() as u32;
                generated.push(next);
                input = vec![next];
            }
            let answer = self.tokenizer.decode(&generated);
            let correct = first_number(&answer) == Some(prompt.passkey);
            let slot = results
                .iter_mut()
                .find(|r| r.length == *length)
                .expect("length listed");
            slot.trials += 1;
            slot.correct += correct as usize;
            eprintln!(
                "passkey {}/{}: length {length} ({} tokens), depth {:.2}, key {} -> {:?} {}",
                index + 1,
                prompts.len(),
                ids.len(),
                prompt.depth,
                prompt.passkey,
                answer.trim(),
                if correct { "ok" } else { "wrong" }
            );
        }
        for r in &mut results {
            r.accuracy = r.correct as f64 / r.trials.max(1) as f64;
        }
        Ok(results)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_read_from_the_continuation() {
        assert_eq!(first_number(" 12345. Remember"), Some(12345));
        assert_eq!(first_number(" is what"), None);
    }

    #[test]
    fn chat_prompts_ask_in_a_user_turn_within_their_length() {
        let dir = tempfile::tempdir().unwrap();
        crate::preset::write_tiny_model(dir.path(), 3).unwrap();
        let tokenizer = Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
        let source = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
        let template = ChatTemplate::new(source, "<s>", "</s>").unwrap();
        let form = PromptForm::Chat(&template);
        let reserve = form.markup_tokens(&tokenizer).unwrap();
        assert!(reserve > 0);
        let prompts = make_prompts(&tokenizer, &[600, 900], 3, 0, reserve).unwrap();
        assert_eq!(prompts.len(), 6);
        for (length, prompt) in &prompts {
            let text = form.text(&prompt.text).unwrap();
            assert!(text.starts_with(&format!("<|user|>{TASK}")), "{text}");
            assert!(
                text.ends_with("What is the pass key?<|end|><|assistant|>"),
                "{text}"
            );
            assert!(text.contains(&format!("The pass key is {}.", prompt.passkey)));
            let tokens = tokenizer.encode(&text).unwrap().len();
            // Whole filler sentences (89 bytes, as many tokens here) fill the rest.
            assert!(
                tokens <= *length && tokens + 89 > *length,
                "{tokens} of {length}"
            );
        }
        let error = make_prompts(&tokenizer, &[200], 1, 0, reserve)
            .unwrap_err()
            .to_string();
        assert!(
            error.starts_with("--lengths 200:") && error.ends_with("and chat template"),
            "{error}"
        );
    }

    #[test]
    fn prompt_layout() {
        let text = assemble(2, 1, 77);
        assert!(text.starts_with(TASK));
        assert!(text.ends_with(QUESTION));
        assert!(text.contains("The pass key is 77. Remember it. 77 is the pass key."));
        assert_eq!(text.matches(FILLER).count(), 3);
    }
}
