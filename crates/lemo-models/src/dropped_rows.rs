//! The backward pass of the rows a token-sparse MLP block drops.
//!
//! A sparse block computes every row exactly but keeps only its kept rows in the graph, so on a
//! dropped row the gradient would reach the block's input through the residual alone: the MLP's
//! input Jacobian `J_t` is lost there, and with it most of what sparsity costs in accuracy (held-out
//! perplexity, stories260K and SmolLM2-135M at keep 0.5). Storing the dropped rows' activations
//! would give the memory back, so this module stands in a linear map for them instead: the MLP's
//! Jacobian with each channel's activation slopes replaced by their mean over the dropped rows,
//! and the norm in front as a per-row scale (its projection term left out),
//!
//! ```text
//! J_t ~ s_t diag(w) (sum_i W_i diag(c_i)) W_out,    c_i = mean over dropped rows of slope_i,
//! ```
//!
//! `W_i` the input projections (`gate`, `up` for SwiGLU; `fc1` for ReLU), `W_out` the output one,
//! `w` the norm's weight and `s_t` its inverse scale (`1 / rms` or `1 / std`). It costs one
//! `[hidden, hidden]` map per layer (built by a `hidden x ffn x hidden` GEMM) and, in the backward
//! pass, one `rows x hidden x hidden` GEMM; its forward value is never computed. The slopes are
//! averaged over an evenly spaced sample of rows.

use burn::tensor::{DType, Int, Tensor, TensorData};
use lemo_kernels::LemoBackend;
use lemo_kernels::gemm::matmul;
use lemo_kernels::known_value::matmul_with_value;

use crate::decoder::SparseBlock;

/// Rows read to average the dropped rows' activation slopes: a mean over a few hundred rows
/// estimates the one over all of them well, at a small part of the cost.
const SLOPE_SAMPLE_ROWS: usize = 256;

/// What the backward pass of a token-sparse MLP block does on the rows it drops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DroppedRows {
    /// Goes through [`DroppedRowsJacobian`] and the residual.
    #[default]
    StandIn,
    /// Goes through the residual alone: cheaper, further from the dense gradient.
    Residual,
}

/// The stand-in for a block's input Jacobian on its dropped rows.
pub struct DroppedRowsJacobian<B: LemoBackend> {
    /// `[hidden, hidden]`, as a projection weight (`y = x map^T`).
    map: Tensor<B, 2>,
    /// `[batch, seq, 1]`: the norm's inverse scale on dropped rows, 0 on kept ones.
    row_scale: Tensor<B, 3>,
}

impl<B: LemoBackend> DroppedRowsJacobian<B> {
    /// The stand-in of an MLP block, or `None` when the block drops nothing or its dropped rows
    /// go through the residual alone.
    ///
    /// - `inverse_scale`: the norm's `1 / rms` or `1 / std` of each row, `[batch, seq, 1]`
    ///   (called only when there is a stand-in to build);
    /// - `norm_weight`: `[hidden]` (`None`: no weight);
    /// - `slopes`: at the given rows of the sequence (`[rows]`), the activation slope of each
    ///   input projection `[batch, rows, ffn]` (from the pass's products), paired with that
    ///   projection's weight `[ffn, hidden]`;
    /// - `output_weight`: `[hidden, ffn]`;
    /// - `centered`: the norm subtracts the row mean (LayerNorm), so does the stand-in's gradient.
    pub fn mlp<S>(
        sparse: &SparseBlock<B>,
        inverse_scale: impl FnOnce() -> Tensor<B, 3>,
        norm_weight: Option<Tensor<B, 1>>,
        slopes: S,
        output_weight: Tensor<B, 2>,
        centered: bool,
    ) -> Option<Self>
    where
        S: FnOnce(Tensor<B, 1, Int>) -> Vec<(Tensor<B, 3>, Tensor<B, 2>)>,
    {
        let [_, seq, _] = sparse.pass.output.dims();
        let [_, kept] = sparse.rows.dims();
        if kept >= seq || sparse.dropped_rows == DroppedRows::Residual {
            return None;
        }
        let device = output_weight.device();
        let dropped = sparse.dropped_mask(seq);
        let sample_rows = SLOPE_SAMPLE_ROWS.min(seq);
        let sample: Vec<i64> = (0..sample_rows)
            .map(|i| (i * seq / sample_rows) as i64)
            .collect();
        let sample =
            Tensor::<B, 1, Int>::from_data(TensorData::new(sample, [sample_rows]), &device);
        // Mean weights over the sampled dropped rows; a sample with none of them weighs nothing.
        let sampled_dropped = dropped.clone().select(1, sample.clone());
        let weights =
            sampled_dropped.clone() / sampled_dropped.sum().clamp_min(1.0).unsqueeze::<3>();
        let dtype = output_weight.dtype();
        let mut combined: Option<Tensor<B, 2>> = None;
        for (slope, weight) in slopes(sample) {
            let [_, _, ffn] = slope.dims();
            let mean = (slope.cast(DType::F32) * weights.clone())
                .sum_dim(1)
                .sum_dim(0)
                .reshape([ffn, 1]);
            let term = weight * mean.cast(dtype);
            combined = Some(match combined {
                Some(sum) => sum + term,
                None => term,
            });
        }
        let combined = combined.expect("an MLP has an input projection");
        let mut map = matmul(output_weight, combined);
        if let Some(norm_weight) = norm_weight {
            map = map * norm_weight.cast(dtype).unsqueeze_dim(0);
        }
        if centered {
            map = map.clone() - map.mean_dim(1);
        }
        Some(Self {
            map,
            row_scale: (inverse_scale().cast(DType::F32) * dropped).cast(dtype),
        })
    }

    /// A graph of `x` (`[batch, seq, hidden]`, the block's input) whose backward pass is the
    /// stand-in's on the dropped rows; its value is never read (the block's residual replaces
    /// it), so the product is not computed.
    pub fn graph(self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, hidden] = x.dims();
        let scaled = (x * self.row_scale).reshape([batch * seq, hidden]);
        matmul_with_value(scaled.clone(), self.map.transpose(), scaled.detach())
            .reshape([batch, seq, hidden])
    }
}
