//! Per-layer thresholds and the JSON file that carries them between calibration and training.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Which block of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Block {
    Attention,
    Mlp,
}

/// One value for each block of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PerBlock<T> {
    pub attention: T,
    pub mlp: T,
}

impl<T> PerBlock<T> {
    /// `value` of each block.
    pub fn from_fn(value: impl Fn(Block) -> T) -> Self {
        Self {
            attention: value(Block::Attention),
            mlp: value(Block::Mlp),
        }
    }

    pub fn get(&self, block: Block) -> &T {
        match block {
            Block::Attention => &self.attention,
            Block::Mlp => &self.mlp,
        }
    }

    pub fn get_mut(&mut self, block: Block) -> &mut T {
        match block {
            Block::Attention => &mut self.attention,
            Block::Mlp => &mut self.mlp,
        }
    }
}

/// What a thresholds file cannot be used for, in one line.
#[derive(Debug, thiserror::Error)]
pub enum ThresholdsError {
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("thresholds file {path} is for {found}, not this model ({expected})")]
    WrongModel {
        path: String,
        found: String,
        expected: String,
    },
}

/// One layer's thresholds, relative to the mean token-block score of the same sequence (see
/// [`crate::selection::KeptRows::select`]); `None` keeps that block dense.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct LayerThresholds {
    pub attention: Option<f32>,
    pub mlp: Option<f32>,
    /// The fraction of each sequence's token blocks the attention block keeps, its best ones:
    /// calibration writes the fraction its threshold keeps on the calibration sequences, and
    /// `train-predictors` raises it where predictions need more blocks to find enough of the
    /// exactly kept ones. A count known ahead: the rows are selected on the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_keep: Option<f32>,
    /// The same for the MLP block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_keep: Option<f32>,
}

impl LayerThresholds {
    pub fn block(&self, block: Block) -> Option<f32> {
        match block {
            Block::Attention => self.attention,
            Block::Mlp => self.mlp,
        }
    }

    /// The kept fraction of `block`'s best token blocks, where one is set.
    pub fn keep(&self, block: Block) -> Option<f32> {
        match block {
            Block::Attention => self.attention_keep,
            Block::Mlp => self.mlp_keep,
        }
    }

    pub fn block_mut(&mut self, block: Block) -> &mut Option<f32> {
        match block {
            Block::Attention => &mut self.attention,
            Block::Mlp => &mut self.mlp,
        }
    }
}

/// What calibration measured with the thresholds it wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// Mean next-token loss of the calibration sequences, dense and with these thresholds.
    pub dense_loss: f64,
    pub loss: f64,
    /// Mean kept fraction of the attention blocks and of the MLP blocks over all layers.
    pub keep_attention: f64,
    pub keep_mlp: f64,
    pub sequences: usize,
    pub seq_len: usize,
}

/// How one block picks its kept token blocks (see [`crate::selection::KeptRows::select`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Selection {
    /// Its best blocks, this fraction of them (rounded up, the first and the last included): a
    /// count known before the scores ([`crate::best_blocks`]).
    Best(f32),
    /// The blocks scoring at least `threshold` times the sequence's mean block score, and at
    /// least `floor` of them: a count known only from the scores.
    Relative { threshold: f32, floor: f32 },
}

/// The thresholds of every layer of one model, with what they were calibrated for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Thresholds {
    /// The model they were calibrated on (its path or name), for the reader's information.
    pub model: String,
    pub architecture: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// The least fraction of a sequence's blocks any block keeps, whatever the scores.
    pub min_keep: f32,
    /// Floors of the attention and the MLP blocks that replace `min_keep` when they differ
    /// (fixed kept fractions per kind of block, as `bench` runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_min_keep: Option<[f32; 2]>,
    /// The kept fraction calibration aimed at.
    pub target_keep: Option<f64>,
    pub layers: Vec<LayerThresholds>,
    pub measured: Option<Measured>,
}

impl Thresholds {
    /// Thresholds that keep every token of every layer (the dense model, run through the
    /// token-sparse path).
    pub fn keep_all(architecture: &str, num_layers: usize, hidden_size: usize) -> Self {
        Self {
            model: String::new(),
            architecture: architecture.to_string(),
            num_layers,
            hidden_size,
            block_size: 64,
            min_keep: 1.0,
            block_min_keep: None,
            target_keep: None,
            layers: vec![LayerThresholds::default(); num_layers],
            measured: None,
        }
    }

    /// The least fraction of a sequence's blocks a `block` keeps.
    pub fn min_keep_of(&self, block: Block) -> f32 {
        match (self.block_min_keep, block) {
            (Some([attention, _]), Block::Attention) => attention,
            (Some([_, mlp]), Block::Mlp) => mlp,
            (None, _) => self.min_keep,
        }
    }

    /// How `block` of `layer` selects; `None`: it stays dense. The layer's kept fraction of
    /// the block (at least the floor), or a threshold no score reaches (`f32::MAX`, as
    /// `--keep-exactly` writes) with the floor alone, keeps the best blocks: a count known
    /// ahead. Otherwise the threshold is relative to the scores.
    pub fn selection(&self, layer: usize, block: Block) -> Option<Selection> {
        let thresholds = &self.layers[layer];
        let threshold = thresholds.block(block)?;
        let floor = self.min_keep_of(block);
        Some(match thresholds.keep(block) {
            Some(keep) => Selection::Best(keep.max(floor)),
            None if threshold == f32::MAX => Selection::Best(floor),
            None => Selection::Relative { threshold, floor },
        })
    }

    pub fn read(path: &Path) -> Result<Self, ThresholdsError> {
        let file_error = |message: String| ThresholdsError::File {
            path: path.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| file_error(e.to_string()))?;
        let thresholds: Self = serde_json::from_str(&text)
            .map_err(|e| file_error(format!("not a lemo thresholds file: {e}")))?;
        if thresholds.layers.len() != thresholds.num_layers {
            return Err(file_error(format!(
                "{} layer entries for {} layers",
                thresholds.layers.len(),
                thresholds.num_layers
            )));
        }
        if let Some(layer) = thresholds.layers.iter().position(|l| {
            [l.attention, l.mlp]
                .iter()
                .flatten()
                .any(|t| !t.is_finite())
        }) {
            return Err(file_error(format!(
                "layer {layer} has a threshold that is not a finite number"
            )));
        }
        if thresholds.block_size == 0 {
            return Err(file_error("block_size must be positive".into()));
        }
        Ok(thresholds)
    }

    /// Checks that these thresholds were made for a model of this shape.
    pub fn check_model(
        &self,
        path: &Path,
        architecture: &str,
        num_layers: usize,
        hidden_size: usize,
    ) -> Result<(), ThresholdsError> {
        if self.architecture != architecture
            || self.num_layers != num_layers
            || self.hidden_size != hidden_size
        {
            let describe =
                |a: &str, l: usize, h: usize| format!("{a} with {l} layers of width {h}");
            return Err(ThresholdsError::WrongModel {
                path: path.display().to_string(),
                found: describe(&self.architecture, self.num_layers, self.hidden_size),
                expected: describe(architecture, num_layers, hidden_size),
            });
        }
        Ok(())
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("thresholds serialize")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_round_trips_and_is_checked_against_the_model() {
        let dir = std::env::temp_dir().join(format!("lemo-thresholds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("thresholds.json");
        let mut thresholds = Thresholds::keep_all("llama", 2, 64);
        thresholds.layers[1].attention = Some(0.25);
        std::fs::write(&path, thresholds.to_json()).unwrap();
        let read = Thresholds::read(&path).unwrap();
        assert_eq!(read, thresholds);
        assert!(read.check_model(&path, "llama", 2, 64).is_ok());
        let error = read
            .check_model(&path, "llama", 3, 64)
            .unwrap_err()
            .to_string();
        assert!(error.contains("llama with 2 layers of width 64"), "{error}");
        std::fs::write(&path, "{").unwrap();
        let error = Thresholds::read(&path).unwrap_err().to_string();
        assert!(error.contains("not a lemo thresholds file"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
