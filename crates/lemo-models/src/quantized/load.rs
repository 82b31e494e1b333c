//! Loading a base's frozen projections as `--quantize-base` asks: kept in their GGUF blocks,
//! quantized at load, or dense; and the bits a value that takes on the device, for the memory
//! plan before anything is loaded.

use std::path::Path;

use burn::tensor::backend::Backend;

use super::nf4::{self, Nf4};
use super::{
    FrozenWeight, PackedWeight, QuantFormat, QuantizeBase, QuantizedWeight, by_blocks, q4_k,
};
use crate::gguf::GgufFile;
use crate::gguf::quant::GgmlType;
use crate::weights::Loader;
use crate::{ModelConfig, Result};

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
