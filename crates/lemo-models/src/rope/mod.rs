//! Rotary position embeddings in Hugging Face's rotate-half layout, through the fused RoPE kernel.
//! The kernel takes explicit positions (LeMo keeps the original positions of the tokens it keeps);
//! a dense forward pass rotates a contiguous range of them.

use std::ops::Range;

use burn::tensor::{Int, Tensor, backend::Backend};
use lemo_kernels::ComputeBackend;
use lemo_kernels::fused::{rope, rope_tables};

pub mod scaling;

pub use scaling::{EXTENSION_KINDS, RopeConfig, RopeScaling, YarnScaling};

/// The model's rotation frequencies and their f32 `cos`/`sin` tables for positions
/// `0..positions` (`[positions, head_dim / 2]` each, scaled by the attention factor, see
/// [`lemo_kernels::fused::rope_tables`]), built once for the context the model runs at.
#[derive(burn::module::Module, Debug)]
pub struct RotaryEmbedding<B: Backend> {
    pub config: RopeConfig,
    pub head_dim: usize,
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
    pub fn new(
        config: &RopeConfig,
        head_dim: usize,
        positions: usize,
        device: &B::Device,
    ) -> crate::Result<Self> {
        // Longer sequences get tables per call (see `rotation`): a config claiming millions of
        // positions does not cost gigabytes up front. Dynamic NTK's frequencies change past
        // its threshold, so only the positions below it share one table.
        let mut positions = positions.min(EAGER_POSITIONS);
        if let RopeScaling::Dynamic {
            original_max_position_embeddings,
            ..
        } = config.scaling
        {
            positions = positions.min(original_max_position_embeddings);
        }
        let (cos, sin) = Self::tables(config, head_dim, positions, device)?;
        Ok(Self {
            config: config.clone(),
            head_dim,
            cos,
            sin,
        })
    }

    fn tables(
        config: &RopeConfig,
        head_dim: usize,
        positions: usize,
        device: &B::Device,
    ) -> crate::Result<(Tensor<B, 2>, Tensor<B, 2>)> {
        let frequencies = config.inverse_frequencies(head_dim, positions)?;
        Ok(rope_tables::<B>(
            &frequencies,
            config.attention_scaling(),
            positions,
            device,
        ))
    }

    /// The rotation of `batch` sequences at `positions`; past the tables' end (a sequence longer
    /// than the context they were built for, or past dynamic NTK's threshold, where the
    /// frequencies follow the sequence's length as transformers' do) tables are made for this
    /// call.
    pub fn rotation(&self, positions: Range<usize>, batch: usize) -> Rotation<B> {
        let device = self.cos.device();
        let (cos, sin) = if positions.end <= self.cos.dims()[0] {
            (self.cos.clone(), self.sin.clone())
        } else {
            Self::tables(&self.config, self.head_dim, positions.end, &device)
                .expect("the frequencies were computed once when the model was built")
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
    /// The same tables at other positions, `[batch, len]`.
    pub fn at(&self, positions: Tensor<B, 2, Int>) -> Self {
        Self {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            positions,
        }
    }

    /// The rotation of some of its rows, `rows: [batch, len]` (the kept rows of a token-sparse
    /// block): at their positions.
    pub fn of_rows(&self, rows: Tensor<B, 2, Int>) -> Self {
        self.at(self.positions.clone().gather(1, rows))
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
