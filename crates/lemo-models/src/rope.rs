//! Rotary position embeddings in Hugging Face's rotate-half layout, at explicit positions (LeMo
//! keeps the original positions of the tokens it keeps, so positions need not be contiguous).

use burn::tensor::{Int, Tensor, backend::Backend};

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

/// Cached inverse frequencies; produces `cos`/`sin` for any positions.
#[derive(burn::module::Module, Debug)]
pub struct RotaryEmbedding<B: Backend> {
    /// `[head_dim / 2]`
    pub inverse_frequencies: Tensor<B, 1>,
}

impl<B: Backend> RotaryEmbedding<B> {
    pub fn new(config: &RopeConfig, head_dim: usize, device: &B::Device) -> Self {
        let freqs = inverse_frequencies(config, head_dim);
        Self {
            inverse_frequencies: Tensor::from_floats(freqs.as_slice(), device),
        }
    }

    /// `(cos, sin)`, each `[len, head_dim]`, for `positions: [len]`.
    pub fn cos_sin(&self, positions: Tensor<B, 1, Int>) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let [len] = positions.dims();
        let [half] = self.inverse_frequencies.dims();
        let angles = positions.float().reshape([len, 1])
            * self.inverse_frequencies.clone().reshape([1, half]);
        let angles = Tensor::cat(vec![angles.clone(), angles], 1);
        (angles.clone().cos(), angles.sin())
    }

    /// Rotates `x: [batch, heads, len, head_dim]`: `x * cos + rotate_half(x) * sin`, where
    /// `rotate_half([x1, x2]) = [-x2, x1]` over the two halves of the head dimension.
    pub fn apply(x: Tensor<B, 4>, cos: &Tensor<B, 2>, sin: &Tensor<B, 2>) -> Tensor<B, 4> {
        let [batch, heads, len, head_dim] = x.dims();
        let half = head_dim / 2;
        let x1 = x.clone().slice([0..batch, 0..heads, 0..len, 0..half]);
        let x2 = x
            .clone()
            .slice([0..batch, 0..heads, 0..len, half..head_dim]);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        x * cos.clone().unsqueeze::<4>() + rotated * sin.clone().unsqueeze::<4>()
    }
}
