//! Rotary position embedding in Hugging Face's rotate-half convention, at explicit positions:
//! for `i < d/2`, `out_i = x_i cos - x_{i+d/2} sin` and `out_{i+d/2} = x_{i+d/2} cos + x_i sin`
//! with the angle `position * inv_freq[i]`. Positions are passed per token because LeMo keeps
//! the original positions of the tokens a layer retains.

pub(crate) mod autodiff;
pub(crate) mod kernel;
pub mod reference;

use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};

use crate::ComputeBackend;

/// Rotates `x [batch, heads, seq, head_dim]` (any strides) by the angles of `positions
/// [batch, seq]`, read from the f32 tables `cos, sin [max_position, head_dim / 2]` of
/// [`rope_tables`]. Returns a contiguous tensor in `x`'s dtype; differentiable in `x`.
pub fn rope<B: ComputeBackend>(
    x: Tensor<B, 4>,
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    positions: Tensor<B, 2, Int>,
) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_rope(
        x.into_primitive().tensor(),
        cos.into_primitive().tensor(),
        sin.into_primitive().tensor(),
        positions.into_primitive(),
        false,
    )))
}

/// f32 `scale * cos` and `scale * sin` of `position * inv_freq[i]`, `[max_position,
/// inv_freq.len()]` each: per-pair frequencies carry the model's rope scaling (linear, NTK,
/// YaRN, Llama-3 style, GGUF factors) and `scale` YaRN's attention temperature, which
/// transformers applies to cos and sin alike (1 for the other kinds). Angles are computed in
/// f64 on the host, so long positions lose no precision.
pub fn rope_tables<B: ComputeBackend>(
    inv_freq: &[f32],
    scale: f32,
    max_position: usize,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(max_position * half);
    let mut sin = Vec::with_capacity(max_position * half);
    for position in 0..max_position {
        for &freq in inv_freq {
            let angle = position as f64 * freq as f64;
            cos.push(angle.cos() as f32 * scale);
            sin.push(angle.sin() as f32 * scale);
        }
    }
    let table = |values: Vec<f32>| {
        Tensor::<B, 2>::from_data(TensorData::new(values, [max_position, half]), device)
            .cast(DType::F32)
    };
    (table(cos), table(sin))
}
