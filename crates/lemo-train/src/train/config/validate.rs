//! The checks of a resolved training configuration: every setting in its range, named by its
//! flag when it is not.

use anyhow::{Result, bail};

use super::TrainConfig;
use crate::lemo::ScoreSource;
use crate::method::Method;
use crate::modelio;

impl TrainConfig {
    pub fn validate(&self) -> Result<()> {
        if self.preset.is_none() && self.model.is_none() {
            bail!("no model: pass --model PATH (or --preset tiny)");
        }
        if let Some(model) = self.model.as_ref().filter(|m| !m.exists()) {
            bail!("--model {}: no such file or folder", model.display());
        }
        if self.preset.is_none() && self.data.is_none() {
            bail!("no training data: pass --data FILE_OR_DIR");
        }
        let inputs = [
            ("--model", &self.model),
            ("--data", &self.data),
            ("--tokenizer", &self.tokenizer),
        ];
        for (flag, input) in inputs {
            if let Some(input) = input.as_ref().filter(|i| modelio::same_path(&self.out, i)) {
                bail!(
                    "--out {} is the {flag} path itself: give the run a folder of its own (its \
                     adapter, checkpoints and metrics would mix with the files there)",
                    input.display()
                );
            }
        }
        if !lemo_models::rope::EXTENSION_KINDS.contains(&self.rope_scaling.as_str()) {
            bail!(
                "--rope-scaling {:?}: unknown kind, choose one of {}",
                self.rope_scaling,
                lemo_models::rope::EXTENSION_KINDS.join(", ")
            );
        }
        if let Some(theta) = self.rope_theta.filter(|t| !(t.is_finite() && *t > 1.0)) {
            bail!("--rope-theta {theta}: the RoPE base must be a finite number above 1");
        }
        if self.method == Method::Lemo {
            self.lemo.validate()?;
        } else if let Some(flag) = self.lemo_files_given() {
            bail!(
                "{flag} applies to --method lemo; this run trains with --method {}",
                self.method.name()
            );
        }
        if self.steps == 0 || self.batch_size == 0 || self.grad_accum == 0 {
            bail!("--steps, --batch-size and --grad-accum must be positive");
        }
        if self.seq_len.is_some_and(|s| s < 2) {
            bail!("--seq-len must be at least 2");
        }
        crate::modelio::check_target_context(self.target_context)?;
        if self.lora_rank == 0 {
            bail!("--lora-rank must be positive");
        }
        if self.loss_segment == 0 {
            bail!("--loss-segment must be positive");
        }
        self.s2.validate(self.method)?;
        self.check_context_parallel()?;
        let in_range = |flag: &str, value: f64, range: Range| -> Result<()> {
            if !range.contains(value) {
                bail!("--{flag} {value} is outside {}", range.describe());
            }
            Ok(())
        };
        in_range("lr", self.lr, Range::Positive)?;
        in_range("lora-alpha", self.lora_alpha, Range::Positive)?;
        in_range("lora-dropout", self.lora_dropout, Range::Fraction)?;
        in_range("beta1", self.beta1, Range::Fraction)?;
        in_range("beta2", self.beta2, Range::Fraction)?;
        in_range("eps", self.eps, Range::Positive)?;
        in_range("weight-decay", self.weight_decay, Range::NonNegative)?;
        in_range("max-grad-norm", self.max_grad_norm, Range::NonNegative)?;
        in_range("min-lr-ratio", self.min_lr_ratio, Range::Probability)?;
        in_range("val-fraction", self.val_fraction, Range::Fraction)?;
        self.save_interval()?;
        self.collective_timeout()?;
        Ok(())
    }
}

impl TrainConfig {
    /// What a sequence split over ranks trains: `lora`, and `lemo` one sequence at a time with
    /// scores computed from the sequence (predictors read whole sequences).
    fn check_context_parallel(&self) -> Result<()> {
        let group = self.context_parallel;
        if group == 0 {
            bail!("--context-parallel must be at least 1");
        }
        if group == 1 {
            return Ok(());
        }
        match self.method {
            Method::Lora => Ok(()),
            Method::Longlora => bail!(
                "--context-parallel {group}: the S2 groups of --method longlora do not split over ranks; use --method lora or lemo"
            ),
            Method::Lemo if self.s2.on(self.method) => bail!(
                "--context-parallel {group}: the S2 groups of --method lemo --s2 do not split over ranks; leave out --s2 (or --context-parallel)"
            ),
            Method::Lemo if self.batch_size != 1 => bail!(
                "--context-parallel {group} with --method lemo trains one sequence per micro-batch (each rank keeps its share of that sequence's rows): use --batch-size 1 and --grad-accum for more"
            ),
            Method::Lemo
                if self.lemo.predictors.is_some()
                    || matches!(self.lemo.scores, Some(ScoreSource::Predicted)) =>
            {
                bail!(
                    "--context-parallel {group} with --method lemo scores each rank's blocks from the sequence itself: predictors read whole sequences, so leave --predictors out (--scores sampled or exact)"
                )
            }
            Method::Lemo => Ok(()),
        }
    }

    /// The first of the LeMo-only files given (they would be ignored by another method).
    fn lemo_files_given(&self) -> Option<&'static str> {
        [
            ("--thresholds", self.lemo.thresholds.is_some()),
            ("--predictors", self.lemo.predictors.is_some()),
        ]
        .into_iter()
        .find_map(|(flag, given)| given.then_some(flag))
    }
}

/// The ranges a real-valued setting may take.
#[derive(Clone, Copy)]
enum Range {
    /// (0, inf)
    Positive,
    /// [0, inf)
    NonNegative,
    /// [0, 1)
    Fraction,
    /// [0, 1]
    Probability,
}

impl Range {
    fn contains(self, value: f64) -> bool {
        value.is_finite()
            && match self {
                Range::Positive => value > 0.0,
                Range::NonNegative => value >= 0.0,
                Range::Fraction => (0.0..1.0).contains(&value),
                Range::Probability => (0.0..=1.0).contains(&value),
            }
    }

    fn describe(self) -> &'static str {
        match self {
            Range::Positive => "(0, inf): it must be a positive number",
            Range::NonNegative => "[0, inf): it must be a finite number, 0 or more",
            Range::Fraction => "[0, 1)",
            Range::Probability => "[0, 1]",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Preset;
    use super::*;
    use crate::method::S2Settings;

    #[test]
    fn settings_out_of_range_are_refused_naming_the_flag() {
        let base = TrainConfig::preset(Preset::Tiny);
        for (change, flag) in [
            (
                TrainConfig {
                    lora_dropout: 2.0,
                    ..base.clone()
                },
                "--lora-dropout",
            ),
            (
                TrainConfig {
                    beta1: 2.0,
                    ..base.clone()
                },
                "--beta1",
            ),
            (
                TrainConfig {
                    beta2: -1.0,
                    ..base.clone()
                },
                "--beta2",
            ),
            (
                TrainConfig {
                    eps: 0.0,
                    ..base.clone()
                },
                "--eps",
            ),
            (
                TrainConfig {
                    val_fraction: 2.0,
                    ..base.clone()
                },
                "--val-fraction",
            ),
            (
                TrainConfig {
                    lr: f64::NAN,
                    ..base.clone()
                },
                "--lr",
            ),
            (
                TrainConfig {
                    s2: S2Settings {
                        s2_group_size: Some(0),
                        ..S2Settings::default()
                    },
                    ..base.clone()
                },
                "--s2-group-size",
            ),
            (
                TrainConfig {
                    s2: S2Settings {
                        s2: true,
                        ..S2Settings::default()
                    },
                    ..base.clone()
                },
                "--s2 applies to --method lemo",
            ),
            (
                TrainConfig {
                    method: Method::Lemo,
                    s2: S2Settings {
                        s2: true,
                        ..S2Settings::default()
                    },
                    context_parallel: 2,
                    ..base.clone()
                },
                "--method lemo --s2 do not split over ranks",
            ),
        ] {
            let error = change.validate().unwrap_err().to_string();
            assert!(error.contains(flag), "{flag}: {error}");
        }
        base.validate().expect("the preset is valid");
    }
}
