//! The layers of a training configuration: a TOML file's keys, the flags given on the command
//! line, and a resumed run's saved configuration with what may not change on resume.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{ArgMatches, Args, parser::ValueSource};

use super::{Preset, TrainConfig};
use crate::train::run_dir::Start;

impl TrainConfig {
    /// The keys a TOML file may set: the flags' names in snake_case, and `preset`.
    fn keys() -> Vec<String> {
        let command = Self::augment_args(clap::Command::new("train"));
        let mut keys: Vec<String> = command
            .get_arguments()
            .map(|arg| arg.get_id().to_string())
            .filter(|id| id != "help")
            .collect();
        keys.push("preset".to_string());
        keys
    }

    /// A TOML configuration file as a table of overrides, its keys checked.
    pub fn from_toml_file(path: &Path) -> Result<toml::Table> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let table: toml::Table =
            toml::from_str(&text).with_context(|| format!("{}: invalid TOML", path.display()))?;
        let keys = Self::keys();
        if let Some(unknown) = table.keys().find(|key| !keys.contains(key)) {
            bail!(
                "{}: unknown key `{unknown}` (the keys are the train flags in snake_case, e.g. seq_len)",
                path.display()
            );
        }
        Ok(table)
    }

    /// The settings given on the command line (`matches` are the `train` subcommand's), as a
    /// table of overrides: a flag left at its default overrides nothing.
    pub fn given_on_command_line(&self, matches: &ArgMatches) -> Result<toml::Table> {
        let given =
            |id: &&clap::Id| matches.value_source(id.as_str()) == Some(ValueSource::CommandLine);
        // TOML integers are i64: a larger count is refused rather than wrapped around.
        for id in matches.ids().filter(given) {
            let too_large = matches
                .get_raw(id.as_str())
                .into_iter()
                .flatten()
                .filter_map(|raw| raw.to_str()?.parse::<u128>().ok())
                .find(|&value| value > i64::MAX as u128);
            if let Some(value) = too_large {
                bail!("--{} {value} is too large", id.as_str().replace('_', "-"));
            }
        }
        let all = toml::Table::try_from(self).context("a flag's value is out of range")?;
        Ok(all
            .into_iter()
            .filter(|(key, _)| matches.value_source(key) == Some(ValueSource::CommandLine))
            .collect())
    }

    /// `self` with the keys of `table` replaced.
    pub fn merged(self, table: &toml::Table) -> Result<Self> {
        let mut base = toml::Table::try_from(&self).context("serializing the configuration")?;
        for (key, value) in table {
            base.insert(key.clone(), value.clone());
        }
        base.try_into().context("invalid training configuration")
    }

    /// The configuration a resumed run continues with, and the checkpoint it resumes from:
    /// the run's saved `config.toml`, `overrides` over it. Settings that make the adapter or the
    /// run what it is cannot change on resume: those overrides are refused before anything is
    /// read or written.
    /// A run folder whose run stopped before its first checkpoint has none to resume from:
    /// it starts over (checkpoint `None`) with its saved configuration.
    pub fn resumed(path: &Path, overrides: &toml::Table) -> Result<(Self, Option<PathBuf>)> {
        let checkpoint = match crate::train::checkpoint::resolve(path) {
            Err(_) if path.join("config.toml").is_file() => None,
            found => Some(found?),
        };
        let run_dir = checkpoint
            .as_deref()
            .and_then(crate::train::checkpoint::run_dir_of)
            .unwrap_or_else(|| path.into());
        let saved = Self::from_toml_file(&run_dir.join("config.toml"))?;
        for key in FIXED_ON_RESUME {
            if let Some(value) = overrides.get(*key)
                && saved.get(*key) != Some(value)
            {
                let was = saved
                    .get(*key)
                    .map_or("unset".to_string(), |v| v.to_string());
                bail!(
                    "--{} {value}: the run in {} was trained with {was}, and a resumed run keeps it (start a new run with --out to change it)",
                    key.replace('_', "-"),
                    run_dir.display()
                );
            }
        }
        let mut config = Self::default().merged(&saved)?;
        config.out = run_dir;
        Ok((config.merged(overrides)?, checkpoint))
    }

    /// What a `train` command asks for: with `resume`, the resumed run's saved configuration
    /// under the flags' `overrides` and its checkpoint (none when the run stopped before its
    /// first); else the defaults under `preset`, the TOML `file` and `overrides`, in a new run
    /// folder (`overwrite`: replacing the run there).
    pub fn requested(
        preset: Option<Preset>,
        file: Option<&Path>,
        resume: Option<&Path>,
        overwrite: bool,
        overrides: &toml::Table,
    ) -> Result<(Self, Option<PathBuf>, Start)> {
        if let Some(path) = resume {
            let (config, checkpoint) = Self::resumed(path, overrides)?;
            if checkpoint.is_none() {
                eprintln!(
                    "train: {} holds no checkpoint yet: the run starts over from step 0 with its saved configuration",
                    path.display()
                );
            }
            let start = match checkpoint {
                Some(_) => Start::Resume,
                None => Start::Overwrite,
            };
            return Ok((config, checkpoint, start));
        }
        let mut config = preset.map(Self::preset).unwrap_or_default();
        if let Some(file) = file {
            config = config.merged(&Self::from_toml_file(file)?)?;
        }
        let start = match overwrite {
            true => Start::Overwrite,
            false => Start::Fresh,
        };
        Ok((config.merged(overrides)?, None, start))
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("the configuration serializes")
    }
}

/// Settings a resumed run must keep: the model, the method (S2 included) and the adapter's shape.
const FIXED_ON_RESUME: &[&str] = &[
    "model",
    "method",
    "s2",
    "s2_group_size",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "train_embeddings",
    "train_norms",
    "target_context",
    "rope_scaling",
    "rope_theta",
    "block_size",
    "loss_on",
];

#[cfg(test)]
mod tests {
    use super::super::Preset;
    use super::*;

    /// `train` as the binary parses it: its options and the configuration flattened.
    #[derive(clap::Parser)]
    struct Train {
        #[command(flatten)]
        config: TrainConfig,
    }

    fn parse(flags: &[&str]) -> (TrainConfig, ArgMatches) {
        let matches = <Train as clap::CommandFactory>::command()
            .try_get_matches_from(std::iter::once("train").chain(flags.iter().copied()))
            .expect("flags parse");
        let config = <Train as clap::FromArgMatches>::from_arg_matches(&matches)
            .expect("matches convert")
            .config;
        (config, matches)
    }

    #[test]
    fn only_flags_given_override_a_file_and_a_preset() {
        let (flags, matches) = parse(&["--lr", "1e-3", "--target-keep", "0.3", "--device", "cpu"]);
        let overrides = flags.given_on_command_line(&matches).unwrap();
        let mut keys: Vec<&str> = overrides.keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(keys, ["device", "lr", "target_keep"]);

        let file: toml::Table = toml::from_str("steps = 7\nlr = 0.5\nblock_size = 32").unwrap();
        let config = TrainConfig::preset(Preset::Tiny)
            .merged(&file)
            .unwrap()
            .merged(&overrides)
            .unwrap();
        assert_eq!(config.steps, 7, "the file's key");
        assert_eq!(config.lr, 1e-3, "the flag over the file");
        assert_eq!(config.lemo.block_size, 32, "a flattened key from the file");
        assert_eq!(config.lemo.target_keep, 0.3, "a flattened flag");
        assert_eq!(
            config.lora_rank, 16,
            "the preset's, untouched by defaults of flags"
        );
        assert_eq!(config.preset, Some(Preset::Tiny));
    }

    #[test]
    fn the_defaults_are_the_flags_defaults_and_round_trip_through_toml() {
        let (flags, _) = parse(&[]);
        assert_eq!(flags, TrainConfig::default());
        let config = TrainConfig::default();
        assert_eq!(config.steps, 1000);
        assert_eq!(config.lemo.dense_layers, vec![0]);
        let table: toml::Table = toml::from_str(&config.to_toml()).unwrap();
        assert_eq!(TrainConfig::default().merged(&table).unwrap(), config);
    }

    #[test]
    fn a_file_with_an_unknown_key_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.toml");
        std::fs::write(&path, "seq_len = 64\nlearning_rate = 0.1\n").unwrap();
        let error = TrainConfig::from_toml_file(&path).unwrap_err().to_string();
        assert!(error.contains("unknown key `learning_rate`"), "{error}");
        std::fs::write(&path, "seq_len = 64\ntarget_keep = 0.4\ndevice = \"cpu\"\n").unwrap();
        TrainConfig::from_toml_file(&path).expect("flattened keys are known");
    }
}
