//! Frozen projections kept quantized on the device (QLoRA-style training on a 4-bit base): the
//! layers' projection weights of a GGUF base stay in their ggml blocks (Q4_0, Q4_1, Q8_0, Q4_K,
//! Q6_K), or a dense base is quantized at load ([`QuantizeBase`]: NF4 with double quantization,
//! Q4_K or Q8_0). Every product with such a weight, forward (`x W^T`) and backward (`dy W`),
//! dequantizes it just in time into a buffer in the frozen dtype and runs the usual GEMM; the
//! buffer goes back to the memory pool once the product is done, so one layer's worth of dense
//! weights is live at a time (under autodiff, a layer whose graph is kept holds its dequantized
//! weights until its backward pass, as it holds its activations). Embeddings, the output
//! projection and norms are dense; LoRA adapters are f32 as always.

pub mod device;
pub mod nf4;
pub mod packed;
pub mod q4_k;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::str::FromStr;

use burn::tensor::backend::Backend;

pub use device::{FrozenWeight, QuantizedWeight};
pub use packed::{PackedField, PackedWeight, QuantFormat};

use crate::gguf::{GgmlType, GgufFile};
use crate::weights::Loader;
use crate::{ModelConfig, Result};
use nf4::Nf4;

/// `per_block` over `values` cut into whole blocks of `block` values, on every core, the outputs
/// concatenated in order: blocks are quantized independently, so the result is the serial one
/// (a 7B base has 6.5e9 values to quantize at load).
pub(crate) fn by_blocks<T: Send>(
    values: &[f32],
    block: usize,
    per_block: impl Fn(&[f32]) -> Vec<T> + Sync,
) -> Vec<T> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = values
        .len()
        .div_ceil(threads)
        .next_multiple_of(block)
        .max(block);
    if threads == 1 || values.len() <= chunk {
        return per_block(values);
    }
    std::thread::scope(|scope| {
        let parts: Vec<_> = values
            .chunks(chunk)
            .map(|part| scope.spawn(|| per_block(part)))
            .collect();
        parts
            .into_iter()
            .flat_map(|part| part.join().expect("a quantizer thread panicked"))
            .collect()
    })
}

/// `--quantize-base`: how the frozen projections of a base are stored on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum QuantizeBase {
    /// GGUF projections stay in their block types; every other weight is dense.
    #[default]
    #[serde(rename = "keep")]
    Keep,
    /// Every weight dense at the frozen precision (a GGUF base is dequantized at load).
    #[serde(rename = "none")]
    None,
    /// NF4 with double quantization (QLoRA, bitsandbytes).
    #[serde(rename = "nf4")]
    Nf4,
    /// ggml's Q4_K (a GGUF base's Q4_K projections are kept as they are).
    #[serde(rename = "q4_k")]
    Q4K,
    /// ggml's Q8_0 (a GGUF base's Q8_0 projections are kept as they are).
    #[serde(rename = "q8_0")]
    Q8_0,
}

impl QuantizeBase {
    pub fn name(self) -> &'static str {
        match self {
            QuantizeBase::Keep => "keep",
            QuantizeBase::None => "none",
            QuantizeBase::Nf4 => "nf4",
            QuantizeBase::Q4K => "q4_k",
            QuantizeBase::Q8_0 => "q8_0",
        }
    }

    /// The ggml type this quantizes to, if it is one.
    fn ggml_type(self) -> Option<GgmlType> {
        match self {
            QuantizeBase::Q4K => Some(GgmlType::Q4_K),
            QuantizeBase::Q8_0 => Some(GgmlType::Q8_0),
            _ => None,
        }
    }
}

impl FromStr for QuantizeBase {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        // `keep` is the default, spelled as runs report it.
        [
            QuantizeBase::Keep,
            QuantizeBase::Nf4,
            QuantizeBase::Q4K,
            QuantizeBase::Q8_0,
            QuantizeBase::None,
        ]
        .into_iter()
        .find(|q| q.name() == s)
        .ok_or_else(|| {
            format!("unknown base quantization {s:?}: expected keep, nf4, q4_k, q8_0 or none")
        })
    }
}

/// Bits a value of the projections of the model at `path` take on the device when loaded as
/// `quantize` says (what the memory plan counts); `None` where they load dense. For `q4_k` and
/// `q8_0`, a model whose projections are not all whole blocks is counted dense.
pub fn projection_bits(
    path: &Path,
    config: &ModelConfig,
    quantize: QuantizeBase,
) -> Result<Option<f64>> {
    let ggml_bits = |t: GgmlType| {
        let shape = [1, t.block_values()];
        let bytes = vec![0; t.byte_size(shape[1], shape[1]).expect("one block")];
        8.0 * PackedWeight::from_ggml(t, shape, &bytes).bytes() as f64 / shape[1] as f64
    };
    Ok(match quantize {
        QuantizeBase::None => None,
        QuantizeBase::Nf4 => Some(nf4::BITS),
        QuantizeBase::Q4K | QuantizeBase::Q8_0 => {
            let t = quantize.ggml_type().expect("a ggml type");
            // The projections' input widths: rows must be whole blocks.
            let widths = match config {
                ModelConfig::Llama(c) => vec![
                    c.hidden_size,
                    c.num_attention_heads * c.head_dim,
                    c.intermediate_size,
                ],
                ModelConfig::Opt(c) => vec![c.hidden_size, c.ffn_dim],
            };
            widths
                .iter()
                .all(|w| w.is_multiple_of(t.block_values()))
                .then(|| ggml_bits(t))
        }
        QuantizeBase::Keep => {
            if path.extension().is_none_or(|e| e != "gguf") {
                return Ok(None);
            }
            let file = GgufFile::open(path)?;
            // Layer matrices are the projections (norms are vectors).
            let (values, bits) = file
                .header
                .tensors
                .iter()
                .filter(|(name, info)| name.starts_with("blk.") && info.dims.len() == 2)
                .map(|(_, info)| {
                    let values = info.shape().iter().product::<usize>() as f64;
                    let bits = match info.ggml_type {
                        t if QuantFormat::keeps(t) => ggml_bits(t),
                        _ => return (values, f64::NAN),
                    };
                    (values, values * bits)
                })
                .fold((0.0, 0.0), |(v, b), (values, bits)| (v + values, b + bits));
            (values > 0.0 && bits.is_finite()).then(|| bits / values)
        }
    })
}

/// What a load kept quantized, and which weights it left dense that could have been quantized.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FrozenSummary {
    /// Per format: weights, their values and the device bytes they take.
    pub kept: BTreeMap<String, (usize, usize, usize)>,
    /// One line per kind of weight left dense, and why.
    pub notes: BTreeSet<String>,
}

impl FrozenSummary {
    /// Device bytes of the quantized weights.
    pub fn quantized_bytes(&self) -> usize {
        self.kept.values().map(|k| k.2).sum()
    }

    /// What to tell the user: one line per format, then the notes.
    pub fn lines(&self) -> Vec<String> {
        let kept = self.kept.iter().map(|(format, (weights, values, bytes))| {
            format!(
                "frozen projections: {weights} kept as {format} ({:.1} MiB, {:.2} bits a value)",
                *bytes as f64 / (1u64 << 20) as f64,
                8.0 * *bytes as f64 / *values as f64
            )
        });
        kept.chain(self.notes.iter().cloned()).collect()
    }
}

impl<B: Backend> Loader<'_, B> {
    /// The frozen weight `name: [out, in]` of a projection, stored as `self.quantize` says.
    pub fn frozen_weight(&mut self, name: &str, shape: [usize; 2]) -> Result<FrozenWeight<B>> {
        let asked = self.quantize;
        if asked != QuantizeBase::None
            && let Some((t, bytes)) = self.source.fetch_blocks(name, &shape)?
            && (asked == QuantizeBase::Keep || asked.ggml_type() == Some(t))
        {
            return Ok(self.keep_quantized(PackedWeight::from_ggml(t, shape, &bytes)));
        }
        if matches!(asked, QuantizeBase::Keep | QuantizeBase::None) {
            return Ok(self.required(name, shape)?.into());
        }
        let values = self.required_values(name, &shape)?;
        let packed = match asked.ggml_type() {
            None => Some(PackedWeight::from_nf4(shape, Nf4::quantize(&values))),
            Some(t) if shape[1].is_multiple_of(t.block_values()) => {
                let bytes = by_blocks(&values, t.block_values(), |part| match t {
                    GgmlType::Q4_K => q4_k::quantize(part),
                    _ => t.quantize(part).expect("lemo writes Q8_0"),
                });
                Some(PackedWeight::from_ggml(t, shape, &bytes))
            }
            Some(t) => {
                self.summary.notes.insert(format!(
                    "projections with rows of {} values are not whole {t:?} blocks of {}: kept dense",
                    shape[1],
                    t.block_values()
                ));
                None
            }
        };
        Ok(match packed {
            Some(packed) => self.keep_quantized(packed),
            None => self.upload(values, shape).into(),
        })
    }

    fn keep_quantized(&mut self, packed: PackedWeight) -> FrozenWeight<B> {
        let kept = self.summary.kept.entry(packed.format.name()).or_default();
        kept.0 += 1;
        kept.1 += packed.shape.iter().product::<usize>();
        kept.2 += packed.bytes();
        FrozenWeight::Quantized(QuantizedWeight::new(&packed, &self.device, self.dtype))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Split over threads or not, the blocks come back in order and whole.
    #[test]
    fn blocks_quantized_in_parallel_are_the_serial_result() {
        let values: Vec<f32> = (0..100_000).map(|i| (i as f32 * 0.37).sin()).collect();
        let block_sums = |part: &[f32]| -> Vec<(usize, f32)> {
            part.chunks(64).map(|b| (b.len(), b.iter().sum())).collect()
        };
        assert_eq!(by_blocks(&values, 64, block_sums), block_sums(&values));
        let nf4 = Nf4::quantize(&values);
        assert_eq!(nf4.codes.len(), values.len().next_multiple_of(64));
        assert_eq!(
            by_blocks(&values, 256, q4_k::quantize),
            q4_k::quantize(&values[..values.len() / 256 * 256])
        );
    }
}
