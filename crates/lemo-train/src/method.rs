//! `--method`: which training method a run uses.

use clap::ValueEnum;
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
