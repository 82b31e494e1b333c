//! `--method`: which training method a run uses, and its S2 attention settings.

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Dense LoRA: the plain baseline.
    Lora,
    /// LongLoRA: shifted sparse attention (S2) while training, dense attention at evaluation,
    /// embeddings and normalization weights train with the adapters.
    Longlora,
    /// LeMo's token elimination: each layer's attention and MLP blocks process only their
    /// informative token blocks; the others ride the residual stream unchanged.
    Lemo,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Method::Lora => "lora",
            Method::Longlora => "longlora",
            Method::Lemo => "lemo",
        }
    }
}

/// LongLoRA's recipe while training: shifted sparse attention (S2), with the embeddings and
/// norms trained beside the adapters; `train` and `bench` flags, and `train`'s TOML keys.
#[derive(Debug, Clone, Default, PartialEq, Eq, Args, Serialize, Deserialize)]
#[serde(default)]
pub struct S2Settings {
    /// Shifted sparse attention (LongLoRA's S2) while training with --method lemo: the forward
    /// pass is S2 attention over every row, and the kept rows back-propagate it at their
    /// original positions (longlora always trains with S2; evaluation is dense either way)
    /// [implied by --s2-group-size].
    #[arg(long)]
    pub s2: bool,
    /// S2 attention group size in tokens [default: seq-len / 4].
    #[arg(long)]
    pub s2_group_size: Option<usize>,
    /// Train the token embeddings too [default: true with S2 attention: longlora, lemo --s2].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub train_embeddings: Option<bool>,
    /// Train the normalization weights too [default: true with S2 attention: longlora, lemo
    /// --s2].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub train_norms: Option<bool>,
}

impl S2Settings {
    /// The flag given that `method` cannot use, if any.
    pub fn validate(&self, method: Method) -> Result<()> {
        if self.s2_group_size.is_some_and(|g| g < 2) {
            bail!("--s2-group-size must be at least 2 tokens");
        }
        if method == Method::Lora && (self.s2 || self.s2_group_size.is_some()) {
            let flag = if self.s2 { "--s2" } else { "--s2-group-size" };
            bail!(
                "{flag} applies to --method lemo and longlora; this run trains with --method lora"
            );
        }
        Ok(())
    }

    /// Whether `method` trains with S2 attention: longlora always, lemo with --s2 or
    /// --s2-group-size.
    pub fn on(&self, method: Method) -> bool {
        match method {
            Method::Longlora => true,
            Method::Lemo => self.s2 || self.s2_group_size.is_some(),
            Method::Lora => false,
        }
    }

    /// Whether `method` trains the embeddings: as told, else with S2 attention. The model adapts
    /// to S2's groups through its embeddings and norms (without them, `lemo --s2` was 5% worse
    /// in held-out perplexity than `longlora`, whose forward pass it shares; with them, within
    /// 1.4% of `lora`).
    pub fn train_embeddings(&self, method: Method) -> bool {
        self.train_embeddings.unwrap_or(self.on(method))
    }

    /// Whether `method` trains the norms: as told, else with S2 attention (see
    /// [`Self::train_embeddings`]).
    pub fn train_norms(&self, method: Method) -> bool {
        self.train_norms.unwrap_or(self.on(method))
    }

    /// The S2 group size of `method` training on sequences of `seq_len` tokens, `None` for
    /// dense attention ([`Self::on`]).
    pub fn group(&self, method: Method, seq_len: usize) -> Result<Option<usize>> {
        let s2 = self.on(method);
        let group = self.s2_group_size.unwrap_or(seq_len / 4).max(2);
        if s2 && group > seq_len {
            bail!(
                "--s2-group-size {group} is longer than the {seq_len}-token sequences: S2 groups split a sequence; use at most --s2-group-size {seq_len}"
            );
        }
        Ok(s2.then_some(group))
    }
}
