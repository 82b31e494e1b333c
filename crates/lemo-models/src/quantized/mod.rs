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
mod load;
pub mod nf4;
pub mod packed;
pub mod q4_k;

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;

pub use device::{FrozenWeight, QuantizedWeight};
pub use load::projection_bits;
pub use packed::{PackedField, PackedWeight, QuantFormat};

use crate::gguf::quant::GgmlType;

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
    pub(crate) fn ggml_type(self) -> Option<GgmlType> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use nf4::Nf4;

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
