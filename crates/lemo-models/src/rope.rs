//! Rotary position embeddings in Hugging Face's rotate-half layout, through the fused RoPE kernel.
//! The kernel takes explicit positions (LeMo keeps the original positions of the tokens it keeps);
//! a dense forward pass rotates a contiguous range of them.

use std::ops::Range;

use burn::tensor::{Int, Tensor, backend::Backend};
use lemo_kernels::ComputeBackend;
use lemo_kernels::fused::{rope, rope_tables};

use crate::config::{RopeConfig, RopeScaling};

/// The per-pair rotation frequencies `theta^(-2i/d)`, adjusted by the scaling rule, computed as
/// transformers does (f32 arithmetic on the exponents, then scaling).
pub fn inverse_frequencies(config: &RopeConfig, head_dim: usize) -> Vec<f32> {
    let base: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / (config.theta as f32).powf((2 * i) as f32 / head_dim as f32))
        .collect();
    match config.scaling {
        RopeScaling::Default => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor as f32).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old_context = original_max_position_embeddings as f32;
            let (factor, low, high) = (
                factor as f32,
                low_freq_factor as f32,
                high_freq_factor as f32,
            );
            let low_freq_wavelen = old_context / low;
            let high_freq_wavelen = old_context / high;
            base.iter()
                .map(|&freq| {
                    let wavelen = 2.0 * std::f32::consts::PI / freq;
                    if wavelen < high_freq_wavelen {
                        freq
                    } else if wavelen > low_freq_wavelen {
                        freq / factor
                    } else {
                        let smooth = (old_context / wavelen - low) / (high - low);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    }
                })
                .collect()
        }
    }
}

/// The model's rotation frequencies and their f32 `cos`/`sin` tables for positions
/// `0..positions` (`[positions, head_dim / 2]` each, see [`lemo_kernels::fused::rope_tables`]),
/// built once for the context the model runs at.
#[derive(burn::module::Module, Debug)]
pub struct RotaryEmbedding<B: Backend> {
    pub inverse_frequencies: Vec<f32>,
    pub cos: Tensor<B, 2>,
    pub sin: Tensor<B, 2>,
}

/// Positions whose tables are built with the model.
const EAGER_POSITIONS: usize = 1 << 17;

/// The tables and positions `[batch, len]` one forward pass rotates its queries and keys by.
pub struct Rotation<B: Backend> {
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    positions: Tensor<B, 2, Int>,
}

impl<B: ComputeBackend> RotaryEmbedding<B> {
    pub fn new(config: &RopeConfig, head_dim: usize, positions: usize, device: &B::Device) -> Self {
        let inverse_frequencies = inverse_frequencies(config, head_dim);
        // Longer sequences get tables per call (see `rotation`): a config claiming millions of
        // positions does not cost gigabytes up front.
        let positions = positions.min(EAGER_POSITIONS);
        let (cos, sin) = rope_tables::<B>(&inverse_frequencies, positions, device);
        Self {
            inverse_frequencies,
            cos,
            sin,
        }
    }

    /// The rotation of `batch` sequences at `positions`; past the tables' end (a sequence longer
    /// than the context they were built for) tables are made for this call.
    pub fn rotation(&self, positions: Range<usize>, batch: usize) -> Rotation<B> {
        let device = self.cos.device();
        let (cos, sin) = if positions.end <= self.cos.dims()[0] {
            (self.cos.clone(), self.sin.clone())
        } else {
            rope_tables::<B>(&self.inverse_frequencies, positions.end, &device)
        };
        let len = positions.len();
        let positions =
            Tensor::<B, 1, Int>::arange(positions.start as i64..positions.end as i64, &device)
                .reshape([1, len])
                .repeat_dim(0, batch);
        Rotation {
            cos,
            sin,
            positions,
        }
    }
}

impl<B: Backend> Rotation<B> {
    /// The same tables at other positions, `[batch, len]` (the kept rows of a token-sparse block).
    pub fn at(&self, positions: Tensor<B, 2, Int>) -> Self {
        Self {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            positions,
        }
    }
}

impl<B: ComputeBackend> Rotation<B> {
    /// Rotates `x: [batch, heads, len, head_dim]` (rotate-half); contiguous, in `x`'s dtype.
    pub fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        rope(
            x,
            self.cos.clone(),
            self.sin.clone(),
            self.positions.clone(),
        )
    }
}
