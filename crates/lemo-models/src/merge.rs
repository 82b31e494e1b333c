//! Folding a PEFT adapter into the checkpoint it was trained on, on the host and one tensor at a
//! time, so a model of any size merges in the memory of its largest tensor: each adapted
//! projection's weight becomes `W + (alpha / r) * B A` (summed in f32, as PEFT's `merge` does), and
//! each weight the adapter trained whole (LongLoRA's embeddings and norms, PEFT's
//! `modules_to_save`) is replaced by the adapter's value.
//!
//! Names and row orders are Hugging Face's on both sides: adapters are written that way whatever
//! the base's format, and checkpoints serve their tensors that way (llama2.c and GGUF q/k rows are
//! put back in rotate-half order by their readers).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::adapter::{CONFIG_FILE, PREFIX, WEIGHTS_FILE, check_finite, read_peft_config};
use crate::lora::LoraConfig;
use crate::weights::{Checkpoint, SafetensorsWeights, StoredTensor, WeightSource};
use crate::{Error, Result};

/// A tensor's shape and row-major values.
type Shaped = (Vec<usize>, Vec<f32>);

/// One adapted projection: `lora_A` `[rank, in]` and `lora_B` `[out, rank]`.
struct LowRank {
    a: Vec<f32>,
    b: Vec<f32>,
    rank: usize,
    inputs: usize,
    outputs: usize,
}

/// A PEFT adapter's weights on the host, keyed by the checkpoint tensor they change.
pub struct AdapterWeights {
    dir: PathBuf,
    pub config: LoraConfig,
    /// Projection weight name (`model.layers.0.self_attn.q_proj.weight`) -> its adapter.
    low_rank: HashMap<String, LowRank>,
    /// Weights trained whole: name -> (shape, values).
    replaced: HashMap<String, Shaped>,
}

/// A tensor name without the `model.` prefix, which OPT checkpoints have or lack: how an adapter
/// name and a checkpoint name are matched.
fn canonical(name: &str) -> &str {
    name.strip_prefix("model.").unwrap_or(name)
}

impl AdapterWeights {
    /// Reads `adapter_config.json` and `adapter_model.safetensors` of a PEFT folder.
    pub fn read(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::io(
                dir,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such adapter folder"),
            ));
        }
        let config = read_peft_config(dir)?;
        let path = dir.join(WEIGHTS_FILE);
        let mut file = SafetensorsWeights::open(&path)?;
        let bad = |message: String| Error::format(&path, message);
        let mut halves: HashMap<String, [Option<Shaped>; 2]> = HashMap::new();
        let mut replaced = HashMap::new();
        for tensor in file.tensors() {
            let name = tensor
                .name
                .strip_prefix(PREFIX)
                .and_then(|rest| rest.strip_prefix('.'))
                .ok_or_else(|| bad(format!("{} is not a PEFT key ({PREFIX}.*)", tensor.name)))?;
            let values = file
                .fetch(&tensor.name, &tensor.shape)?
                .expect("listed tensors are present");
            check_finite(&path, &tensor.name, &values)?;
            let half = [".lora_A.weight", ".lora_B.weight"]
                .iter()
                .position(|suffix| name.ends_with(suffix));
            match half {
                Some(index) => {
                    let module = &name[..name.len() - ".lora_A.weight".len()];
                    halves.entry(format!("{module}.weight")).or_default()[index] =
                        Some((tensor.shape, values));
                }
                None => {
                    replaced.insert(canonical(name).to_string(), (tensor.shape, values));
                }
            }
        }
        let mut low_rank = HashMap::new();
        for (weight, pair) in halves {
            let [Some((a_shape, a)), Some((b_shape, b))] = pair else {
                return Err(bad(format!("{weight} has only one of lora_A/lora_B")));
            };
            let consistent = a_shape.len() == 2
                && b_shape.len() == 2
                && a_shape[0] == config.rank
                && b_shape[1] == config.rank;
            if !consistent {
                return Err(bad(format!(
                    "{weight}: lora_A {a_shape:?} and lora_B {b_shape:?} are not [{r}, in] and [out, {r}] (r = {r} in {})",
                    CONFIG_FILE,
                    r = config.rank
                )));
            }
            let adapter = LowRank {
                a,
                b,
                rank: config.rank,
                inputs: a_shape[1],
                outputs: b_shape[0],
            };
            low_rank.insert(canonical(&weight).to_string(), adapter);
        }
        if low_rank.is_empty() {
            return Err(bad("holds no LoRA weights (lora_A/lora_B)".into()));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            low_rank,
            replaced,
        })
    }

    /// Checks, before anything is written, that every tensor of the adapter changes a tensor of
    /// `checkpoint` of the same shape: an adapter trained on another model fails here.
    pub fn check_against(&self, checkpoint: &[StoredTensor]) -> Result<()> {
        let shapes: HashMap<&str, &[usize]> = checkpoint
            .iter()
            .map(|t| (canonical(&t.name), t.shape.as_slice()))
            .collect();
        let expected = self
            .low_rank
            .iter()
            .map(|(name, l)| (name, vec![l.outputs, l.inputs]))
            .chain(self.replaced.iter().map(|(name, (s, _))| (name, s.clone())));
        for (name, shape) in expected {
            match shapes.get(name.as_str()) {
                None => {
                    return Err(self.error(format!(
                        "changes {name}, which the model does not have: an adapter for another model?"
                    )));
                }
                Some(&found) if found != shape.as_slice() => {
                    return Err(self.error(format!(
                        "changes {name} as a {shape:?} tensor, but the model's is {found:?}: an adapter for another model?"
                    )));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Folds the adapter into the checkpoint tensor `name` (row-major `values` of `shape`, checked
    /// by [`Self::check_against`]); says whether it changed it.
    pub fn apply(&self, name: &str, values: &mut Vec<f32>) -> bool {
        let name = canonical(name);
        let mut changed = false;
        if let Some((_, replacement)) = self.replaced.get(name) {
            values.clone_from(replacement);
            changed = true;
        }
        if let Some(adapter) = self.low_rank.get(name) {
            adapter.add_to(values, self.config.scaling() as f32);
            changed = true;
        }
        changed
    }

    fn error(&self, message: String) -> Error {
        Error::format(&self.dir, message)
    }
}

impl LowRank {
    /// `weight += scaling * B A`, row by row: `B A` in f32, then scaled and added, as PEFT's
    /// `W + (B @ A) * scaling`.
    fn add_to(&self, weight: &mut [f32], scaling: f32) {
        let mut delta = vec![0.0f32; self.inputs];
        for (row, out) in weight.chunks_exact_mut(self.inputs).enumerate() {
            delta.fill(0.0);
            for k in 0..self.rank {
                let b = self.b[row * self.rank + k];
                let a = &self.a[k * self.inputs..(k + 1) * self.inputs];
                delta.iter_mut().zip(a).for_each(|(d, &a)| *d += b * a);
            }
            out.iter_mut()
                .zip(&delta)
                .for_each(|(w, &d)| *w += scaling * d);
        }
        debug_assert_eq!(weight.len(), self.outputs * self.inputs);
    }
}
