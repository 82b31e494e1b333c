//! A model's trained predictors: safetensors (f32;
//! `layers.{l}.attention.{query|key}.{first|second|out}.{weight|bias}`, the `out` maps as wide
//! as the block matrix's rank, and `layers.{l}.attention.distance`, `[components, buckets]`; format 4
//! had one row for every component) with a JSON header under
//! the metadata key `lemo_predictors` ([`PredictorsHeader`]: the model, the block size, the
//! thresholds and kept fractions they select with, each layer's widths and recall).
//!
//! [`Predictors`] holds the weights on the host and builds them once per backend and device the
//! first time a forward pass asks for scores.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use lemo_kernels::ComputeBackend;
use lemo_sparsity::Thresholds;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde::{Deserialize, Serialize};

use crate::prediction::LayerPredictor;
use crate::predictor::{DISTANCE_BUCKETS, QueryKey};
use crate::scorer::{Dense, Scorer};

/// Metadata key of the JSON header.
const HEADER_KEY: &str = "lemo_predictors";
/// 5: distance weights per component of the block matrix (4: one set of distance weights,
/// read as every component's; 3: MLP sketches; 2: learned MLP scorers; 1: scored block means).
const FORMAT: u32 = 5;
/// The oldest format this build reads.
const OLDEST_FORMAT: u32 = 4;

/// What a predictors file cannot be used for, in one line.
#[derive(Debug, thiserror::Error)]
pub enum PredictorsError {
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("predictors file {path} is for {found}, not this model ({expected})")]
    WrongModel {
        path: String,
        found: String,
        expected: String,
    },
}

/// How well one layer's attention predictors find the blocks exact scores keep, and their size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockReport {
    /// Hidden widths: the query scorer's two then the key scorer's two.
    pub widths: Vec<usize>,
    /// Parameters before and after elastic size transformation.
    pub params_before: usize,
    pub params_after: usize,
    /// Kept token blocks on held-out sequences: found / exactly kept, and found / predicted.
    pub recall: f64,
    pub precision: f64,
    /// Fractions of the held-out blocks the predictions and the exact scores keep.
    pub kept: f64,
    pub exact_kept: f64,
    /// Exact informativeness the predicted kept blocks hold over the most as many blocks could
    /// (`lemo_predictor::agreement::Recall::captured`).
    pub captured: f64,
    /// Recall of the best predicted blocks, as many as the exact selection keeps
    /// (`lemo_predictor::agreement::Recall::ranked`).
    pub ranked: f64,
}

/// The JSON header of a predictors file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PredictorsHeader {
    pub format: u32,
    /// The model they were trained on (its path or name), for the reader's information.
    pub model: String,
    pub architecture: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub block_size: usize,
    /// The initial hidden width of the query and key scorers.
    pub rank: usize,
    /// The calibrated thresholds, with the fraction each token-sparse attention block keeps
    /// from predicted scores (`LayerThresholds::attention_keep`: what the exact scores keep
    /// there on the training sequences, raised to [`Self::recall_target`]). The MLP blocks
    /// select from their exact scores.
    pub thresholds: Thresholds,
    /// The recall of the exactly kept blocks each layer's predicted fraction was raised to
    /// reach on training sequences held out from fitting
    /// ([`crate::agreement::Selection::with_recall_target`]); `None`: the fraction exact scores
    /// keep.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recall_target: Option<f64>,
    /// Each layer's attention predictors' report; `None` where the block stays dense.
    pub layers: Vec<Option<BlockReport>>,
    /// Mean recall and precision over the token-sparse attention blocks, and the held-out data.
    pub recall: f64,
    pub precision: f64,
    /// Mean informativeness captured over the token-sparse attention blocks.
    pub captured: f64,
    pub held_out_sequences: usize,
    pub seq_len: usize,
    /// The linear RoPE position interpolation the model ran at (1: its own positions); a run
    /// at another one gives the predictors other embeddings than they learned from.
    pub position_interpolation: Option<f64>,
}

impl PredictorsHeader {
    pub fn new(thresholds: Thresholds, rank: usize) -> Self {
        Self {
            format: FORMAT,
            model: thresholds.model.clone(),
            architecture: thresholds.architecture.clone(),
            num_layers: thresholds.num_layers,
            hidden_size: thresholds.hidden_size,
            block_size: thresholds.block_size,
            rank,
            layers: vec![None; thresholds.num_layers],
            thresholds,
            recall_target: None,
            recall: 0.0,
            precision: 0.0,
            captured: 0.0,
            held_out_sequences: 0,
            seq_len: 0,
            position_interpolation: None,
        }
    }
}

type DeviceCopy = (TypeId, String, Arc<dyn Any + Send + Sync>);

/// Trained predictors of every layer, on the host, with their header.
pub struct Predictors {
    pub header: PredictorsHeader,
    /// `(shape, values)` by tensor name.
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    on_devices: Mutex<Vec<DeviceCopy>>,
}

const SCORER_MAPS: [&str; 3] = ["first", "second", "out"];

/// Where layer `layer`'s attention predictors' tensors are named.
fn layer_prefix(layer: usize) -> String {
    format!("layers.{layer}.attention")
}

/// `(name, tensor)` of every tensor of `predictor`, named under `prefix`.
fn predictor_tensors<B: Backend>(
    prefix: &str,
    predictor: &QueryKey<B>,
) -> Vec<(String, TensorData)> {
    let mut tensors = vec![(
        format!("{prefix}.distance"),
        predictor.distance.val().into_data(),
    )];
    for (role, scorer) in [("query", &predictor.query), ("key", &predictor.key)] {
        let maps = [&scorer.first, &scorer.second, &scorer.out];
        for (map, dense) in SCORER_MAPS.iter().zip(maps) {
            tensors.push((
                format!("{prefix}.{role}.{map}.weight"),
                dense.weight.val().into_data(),
            ));
            tensors.push((
                format!("{prefix}.{role}.{map}.bias"),
                dense.bias.val().into_data(),
            ));
        }
    }
    tensors
}

impl Predictors {
    /// The predictors `layers` (one per layer of the model, `None` where its attention block
    /// stays dense) with `header`.
    pub fn new<B: Backend>(header: PredictorsHeader, layers: &[Option<QueryKey<B>>]) -> Self {
        let mut tensors = HashMap::new();
        for (l, layer) in layers.iter().enumerate() {
            let Some(predictor) = layer else { continue };
            for (name, data) in predictor_tensors(&layer_prefix(l), predictor) {
                let shape = data.shape.to_vec();
                let values = data.convert::<f32>().into_vec().expect("f32 weights");
                tensors.insert(name, (shape, values));
            }
        }
        Self {
            header,
            tensors,
            on_devices: Mutex::new(Vec::new()),
        }
    }

    /// The safetensors file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut names: Vec<&String> = self.tensors.keys().collect();
        names.sort();
        let views: Vec<(String, TensorView)> = names
            .into_iter()
            .map(|name| {
                let (shape, values) = &self.tensors[name];
                let view = TensorView::new(Dtype::F32, shape.clone(), bytemuck::cast_slice(values))
                    .expect("consistent view");
                (name.clone(), view)
            })
            .collect();
        let header = serde_json::to_string(&self.header).expect("serializable header");
        let metadata = HashMap::from([(HEADER_KEY.to_string(), header)]);
        safetensors::serialize(views, Some(metadata)).expect("serializable predictors")
    }

    /// Reads a predictors file written by [`Self::to_bytes`].
    pub fn read(path: &Path) -> Result<Self, PredictorsError> {
        let error = |message: String| PredictorsError::File {
            path: path.display().to_string(),
            message,
        };
        let bytes = std::fs::read(path).map_err(|e| error(format!("cannot read: {e}")))?;
        let (_, metadata) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| error(format!("not a safetensors file ({e})")))?;
        let header = metadata
            .metadata()
            .as_ref()
            .and_then(|m| m.get(HEADER_KEY))
            .ok_or_else(|| error(format!("no `{HEADER_KEY}` header: not a predictors file")))?;
        let header: PredictorsHeader = serde_json::from_str(header)
            .map_err(|e| error(format!("unreadable predictors header ({e})")))?;
        if !(OLDEST_FORMAT..=FORMAT).contains(&header.format) {
            return Err(error(format!(
                "predictors format {} (this build reads {OLDEST_FORMAT} to {FORMAT})",
                header.format
            )));
        }
        if header.layers.len() != header.num_layers
            || header.thresholds.layers.len() != header.num_layers
        {
            return Err(error(format!(
                "the header lists {} layer reports and {} layer thresholds for {} layers",
                header.layers.len(),
                header.thresholds.layers.len(),
                header.num_layers
            )));
        }
        let file = SafeTensors::deserialize(&bytes)
            .map_err(|e| error(format!("not a safetensors file ({e})")))?;
        let mut tensors = HashMap::new();
        for (name, view) in file.tensors() {
            if view.dtype() != Dtype::F32 {
                return Err(error(format!("{name} is {:?}, not F32", view.dtype())));
            }
            let values: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            tensors.insert(name, (view.shape().to_vec(), values));
        }
        let predictors = Self {
            header,
            tensors,
            on_devices: Mutex::new(Vec::new()),
        };
        predictors.check_tensors().map_err(error)?;
        Ok(predictors)
    }

    /// The shape of tensor `name`, or what is missing.
    fn shape(&self, name: &str) -> Result<Vec<usize>, String> {
        self.tensors
            .get(name)
            .map(|(shape, _)| shape.clone())
            .ok_or_else(|| format!("missing tensor {name}"))
    }

    /// Every token-sparse attention block has its kept fraction and its predictors: distance
    /// weights, and scorers that are each a chain of consistent shapes.
    fn check_tensors(&self) -> Result<(), String> {
        let hidden = self.header.hidden_size;
        for (l, layer) in self.header.thresholds.layers.iter().enumerate() {
            if layer.attention.is_none() {
                continue;
            }
            let prefix = layer_prefix(l);
            if layer.attention_keep.is_none() {
                return Err(format!(
                    "layer {l}'s attention block is token-sparse but has no kept fraction"
                ));
            }
            // The query scorer's components, which the key scorer's must match.
            let mut components = None;
            for role in ["query", "key"] {
                let mut inputs = hidden;
                for map in SCORER_MAPS {
                    let name = format!("{prefix}.{role}.{map}");
                    let weight = self.shape(&format!("{name}.weight"))?;
                    let bias = self.shape(&format!("{name}.bias"))?;
                    let consistent = weight.len() == 2
                        && weight[0] == inputs
                        && bias == [weight[1]]
                        && (map != "out" || *components.get_or_insert(weight[1]) == weight[1]);
                    if !consistent {
                        return Err(format!(
                            "{name} has weight {weight:?} and bias {bias:?} after a width of {inputs} (and the query scorer's {} components)",
                            components.unwrap_or(0)
                        ));
                    }
                    inputs = weight[1];
                }
            }
            let distance = format!("{prefix}.distance");
            let shape = self.shape(&distance)?;
            let expected = match self.header.format {
                4 => vec![DISTANCE_BUCKETS],
                _ => vec![components.unwrap_or(0), DISTANCE_BUCKETS],
            };
            if shape != expected {
                return Err(format!("{distance} has shape {shape:?}, not {expected:?}"));
            }
        }
        Ok(())
    }

    /// Errors unless these predictors were trained for a model of this shape (the block size
    /// is checked against the thresholds they score for, by the caller).
    pub fn check_model(
        &self,
        path: &Path,
        architecture: &str,
        num_layers: usize,
        hidden_size: usize,
    ) -> Result<(), PredictorsError> {
        let h = &self.header;
        let describe = |arch: &str, layers: usize, hidden: usize| {
            format!("{arch}, {layers} layers, hidden size {hidden}")
        };
        if h.architecture != architecture
            || h.num_layers != num_layers
            || h.hidden_size != hidden_size
        {
            return Err(PredictorsError::WrongModel {
                path: path.display().to_string(),
                found: describe(&h.architecture, h.num_layers, h.hidden_size),
                expected: describe(architecture, num_layers, hidden_size),
            });
        }
        Ok(())
    }

    /// The predictors as modules on `device`, `None` where a layer's attention block stays
    /// dense.
    pub fn layers<B: Backend>(&self, device: &B::Device) -> Vec<Option<QueryKey<B>>> {
        let tensor = |name: &str| {
            let (shape, values) = &self.tensors[name];
            TensorData::new(values.clone(), shape.clone())
        };
        let dense = |name: &str| {
            Dense::from_tensors(
                Tensor::from_data(tensor(&format!("{name}.weight")), device),
                Tensor::from_data(tensor(&format!("{name}.bias")), device),
            )
        };
        let scorer = |prefix: &str| Scorer {
            first: dense(&format!("{prefix}.first")),
            second: dense(&format!("{prefix}.second")),
            out: dense(&format!("{prefix}.out")),
        };
        self.header
            .thresholds
            .layers
            .iter()
            .enumerate()
            .map(|(l, t)| {
                t.attention?;
                let prefix = layer_prefix(l);
                let query = scorer(&format!("{prefix}.query"));
                // Format 4 weighed every component's distances alike: one row for all.
                let (_, weights) = &self.tensors[&format!("{prefix}.distance")];
                let rows = weights.len() / DISTANCE_BUCKETS;
                let distance = Tensor::<B, 2>::from_data(
                    TensorData::new(weights.clone(), [rows, DISTANCE_BUCKETS]),
                    device,
                );
                let distance = match distance.dims()[0] {
                    1 => distance.repeat_dim(0, query.components()),
                    _ => distance,
                };
                let predictor = QueryKey {
                    query,
                    key: scorer(&format!("{prefix}.key")),
                    distance: Param::from_tensor(distance),
                };
                // Prediction is never differentiated, even on an autodiff backend.
                Some(predictor.no_grad())
            })
            .collect()
    }

    /// The predictors on `device` ready to score block inputs of `dtype`, built on the first
    /// call for each backend, device and dtype.
    pub fn on_device<B: Backend>(
        &self,
        device: &B::Device,
        dtype: DType,
    ) -> Arc<Vec<Option<LayerPredictor<B>>>> {
        let key = (TypeId::of::<B>(), format!("{device:?} {dtype:?}"));
        let mut copies = self.on_devices.lock().expect("no panic while building");
        if let Some((_, _, copy)) = copies.iter().find(|(t, d, _)| (*t, d) == (key.0, &key.1)) {
            return copy.clone().downcast().expect("keyed by backend type");
        }
        let layers: Vec<Option<LayerPredictor<B>>> = self
            .layers::<B>(device)
            .iter()
            .map(|layer| layer.as_ref().map(|p| LayerPredictor::new(p, dtype)))
            .collect();
        let layers = Arc::new(layers);
        copies.push((key.0, key.1, layers.clone()));
        layers
    }

    /// Predicted token-block scores `[batch, blocks]` of the attention block of `layer` from
    /// its input `x: [batch, seq, hidden]`; `None` when it has no predictor (it stays dense).
    pub fn token_block_scores<B: ComputeBackend>(
        &self,
        layer: usize,
        x: Tensor<B, 3>,
    ) -> Option<Tensor<B, 2>> {
        let layers = self.on_device::<B>(&x.device(), x.dtype());
        let predictor = layers.get(layer)?.as_ref()?;
        Some(predictor.token_block_scores(x, self.header.block_size))
    }

    /// Parameters of every predictor.
    pub fn num_params(&self) -> usize {
        self.tensors.values().map(|(_, v)| v.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::Distribution;
    use lemo_sparsity::LayerThresholds;

    type B = NdArray<f32>;

    fn header() -> PredictorsHeader {
        let mut thresholds = Thresholds::keep_all("llama", 2, 8);
        thresholds.block_size = 4;
        thresholds.layers[1] = LayerThresholds {
            attention: Some(1.0),
            mlp: Some(0.8),
            attention_keep: Some(0.5),
            mlp_keep: None,
        };
        PredictorsHeader::new(thresholds, 3)
    }

    fn layers(device: &burn::tensor::Device<B>) -> Vec<Option<QueryKey<B>>> {
        vec![None, Some(QueryKey::with_random_distances(8, 3, 2, device))]
    }

    #[test]
    fn a_written_file_reads_back_to_the_same_predictions() {
        let _generator = lemo_test_support::exclusive_generator();
        let device = Default::default();
        let layers = layers(&device);
        let predictors = Predictors::new(header(), &layers);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("predictors.safetensors");
        std::fs::write(&path, predictors.to_bytes()).unwrap();
        let read = Predictors::read(&path).unwrap();
        assert_eq!(read.header, predictors.header);
        let trained = layers[1].as_ref().unwrap();
        assert_eq!(read.num_params(), trained.num_params());
        let x = Tensor::<B, 3>::random([2, 16, 8], Distribution::Normal(0.0, 1.0), &device);
        let expected: Vec<f32> = LayerPredictor::new(trained, DType::F32)
            .token_block_scores(x.clone(), 4)
            .into_data()
            .to_vec()
            .unwrap();
        let got: Vec<f32> = read
            .token_block_scores(1, x.clone())
            .unwrap()
            .into_data()
            .to_vec()
            .unwrap();
        assert_eq!(got, expected);
        assert!(read.token_block_scores(0, x.clone()).is_none());
        read.check_model(&path, "llama", 2, 8).unwrap();
        let wrong = read.check_model(&path, "llama", 2, 16).unwrap_err();
        assert!(
            wrong
                .to_string()
                .contains("hidden size 8, not this model (llama, 2 layers, hidden size 16)"),
            "{wrong}"
        );
    }

    #[test]
    fn a_format_4_file_weighs_every_components_distances_by_its_one_row() {
        let _generator = lemo_test_support::exclusive_generator();
        let device = Default::default();
        let mut trained = QueryKey::<B>::with_random_distances(8, 3, 2, &device);
        let row = trained.distance.val().narrow(0, 0, 1);
        trained.distance = Param::from_tensor(row.clone().repeat_dim(0, 2));
        let mut old = header();
        old.format = 4;
        let mut predictors = Predictors::new(old, &[None, Some(trained.clone())]);
        let one_row: Vec<f32> = row.into_data().to_vec().unwrap();
        predictors.tensors.insert(
            format!("{}.distance", layer_prefix(1)),
            (vec![DISTANCE_BUCKETS], one_row),
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("format-4.safetensors");
        std::fs::write(&path, predictors.to_bytes()).unwrap();
        let read = Predictors::read(&path).unwrap();
        let x = Tensor::<B, 3>::random([1, 12, 8], Distribution::Normal(0.0, 1.0), &device);
        let expected: Vec<f32> = LayerPredictor::new(&trained, DType::F32)
            .token_block_scores(x.clone(), 4)
            .into_data()
            .to_vec()
            .unwrap();
        let got: Vec<f32> = read
            .token_block_scores(1, x)
            .unwrap()
            .into_data()
            .to_vec()
            .unwrap();
        assert_eq!(got, expected);
        // The same one row in a file of this format is a shape error.
        predictors.header.format = FORMAT;
        std::fs::write(&path, predictors.to_bytes()).unwrap();
        let message = Predictors::read(&path).err().unwrap().to_string();
        assert!(
            message.contains("layers.1.attention.distance has shape [10], not [2, 10]"),
            "{message}"
        );
    }

    #[test]
    fn a_damaged_file_is_a_one_line_error() {
        let _generator = lemo_test_support::exclusive_generator();
        let device = Default::default();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.safetensors");
        let bytes = Predictors::new(header(), &layers(&device)).to_bytes();
        for (bytes, expected) in [
            (bytes[..bytes.len() / 2].to_vec(), "not a safetensors file"),
            (b"junk".to_vec(), "not a safetensors file"),
        ] {
            std::fs::write(&path, bytes).unwrap();
            let message = Predictors::read(&path).err().unwrap().to_string();
            assert!(message.contains(expected), "{message}");
            assert!(!message.contains('\n'), "{message}");
        }
        // A file without its header: a safetensors file, but not one of ours.
        let plain = safetensors::serialize(Vec::<(String, TensorView)>::new(), None).unwrap();
        std::fs::write(&path, plain).unwrap();
        let message = Predictors::read(&path).err().unwrap().to_string();
        assert!(message.contains("not a predictors file"), "{message}");
        assert!(
            Predictors::read(&dir.path().join("absent"))
                .err()
                .unwrap()
                .to_string()
                .contains("cannot read")
        );
    }
}
