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

/// LongLoRA's shifted sparse attention (S2) while training: `train` and `bench` flags, and
/// `train`'s TOML keys.
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

    /// The S2 group size of `method` training on sequences of `seq_len` tokens, `None` for
    /// dense attention: longlora always, lemo with --s2 or --s2-group-size.
    pub fn group(&self, method: Method, seq_len: usize) -> Result<Option<usize>> {
        let s2 = match method {
            Method::Longlora => true,
            Method::Lemo => self.s2 || self.s2_group_size.is_some(),
            Method::Lora => false,
        };
        let group = self.s2_group_size.unwrap_or(seq_len / 4).max(2);
        if s2 && group > seq_len {
            bail!(
                "--s2-group-size {group} is longer than the {seq_len}-token sequences: S2 groups split a sequence; use at most --s2-group-size {seq_len}"
            );
        }
        Ok(s2.then_some(group))
    }
}
