//! A layer's attention predictors in the form prediction runs them, once per layer and step.
//!
//! The query and key scorers sit side by side as one scorer (their first maps concatenated,
//! their second and output maps block-diagonal), so the block input is read once, by one GEMM
//! in its own dtype, instead of being widened to f32 and read by each scorer. The pooling runs
//! on scores relative to each sequence's largest token score, where the distance-weighted
//! column means are one product with a `blocks x blocks` matrix kept between calls. About 20
//! kernel launches a layer where the training form ([`QueryKey::log_scores`]) takes some 65:
//! at 16K tokens it is the launches, not the arithmetic, that prediction costs.

use std::sync::Mutex;

use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use lemo_kernels::ComputeBackend;
use lemo_kernels::fused::{NormSaves, rms_norm};
use lemo_kernels::gemm::{matmul, matmul_scaled};
use lemo_sparsity::informativeness::seen_by;

use crate::predictor::{QueryKey, distance_log_weights};

/// A layer's attention predictors ready to score block inputs of one dtype.
#[derive(Debug)]
pub struct LayerPredictor<B: Backend> {
    /// `[hidden, query width + key width]`, in the block input's dtype.
    first: Tensor<B, 2>,
    /// The second map, block-diagonal `[widths, widths]`, and the output map,
    /// `[widths, 2 * components]` (the query's log-scores, then the key's). f32.
    second: Tensor<B, 2>,
    out: Tensor<B, 2>,
    /// Biases of the three maps, f32 `[1, outputs]`.
    biases: [Tensor<B, 2>; 3],
    /// The unit RMSNorm weight, in the block input's dtype.
    unit: Tensor<B, 1>,
    /// `log D_c` per component and distance bucket, `[components, DISTANCE_BUCKETS]`.
    distance: Tensor<B, 2>,
    components: usize,
    /// The column-mean matrix ([`Self::column_means`]) of the last block count scored.
    column_means: Mutex<Option<(usize, Tensor<B, 3>)>>,
}

/// `[[a, 0], [0, b]]`.
fn block_diagonal<B: Backend>(a: Tensor<B, 2>, b: Tensor<B, 2>) -> Tensor<B, 2> {
    let ([a_rows, a_cols], [b_rows, b_cols]) = (a.dims(), b.dims());
    let device = a.device();
    Tensor::cat(
        vec![
            Tensor::cat(vec![a, Tensor::zeros([a_rows, b_cols], &device)], 1),
            Tensor::cat(vec![Tensor::zeros([b_rows, a_cols], &device), b], 1),
        ],
        0,
    )
}

impl<B: Backend> LayerPredictor<B> {
    /// `predictor` arranged to score block inputs of `dtype`.
    pub fn new(predictor: &QueryKey<B>, dtype: DType) -> Self {
        let (query, key) = (&predictor.query, &predictor.key);
        let side_by_side =
            |q: Tensor<B, 1>, k: Tensor<B, 1>| Tensor::cat(vec![q, k], 0).unsqueeze();
        let device = predictor.distance.device();
        Self {
            first: Tensor::cat(vec![query.first.weight.val(), key.first.weight.val()], 1)
                .cast(dtype),
            second: block_diagonal(query.second.weight.val(), key.second.weight.val()),
            out: block_diagonal(query.out.weight.val(), key.out.weight.val()),
            biases: [
                side_by_side(query.first.bias.val(), key.first.bias.val()),
                side_by_side(query.second.bias.val(), key.second.bias.val()),
                side_by_side(query.out.bias.val(), key.out.bias.val()),
            ],
            unit: Tensor::ones([query.first.weight.dims()[0]], (&device, dtype)),
            distance: predictor.distance.val(),
            components: query.components(),
            column_means: Mutex::new(None),
        }
    }

    /// `[components, blocks (n), blocks (m)]`: `D_c(m - n) / (blocks - n)` where query block `m`
    /// sees key block `n`, else 0, so that this times a component's query block scores is each
    /// key block's distance-weighted mean query score over the blocks that see it. Built once
    /// per block count.
    fn column_means(&self, blocks: usize) -> Tensor<B, 3> {
        let mut kept = self.column_means.lock().expect("no panic while building");
        if let Some((count, matrix)) = kept.as_ref()
            && *count == blocks
        {
            return matrix.clone();
        }
        // Unseen pairs carry log-weight -1e30: their weight is 0.
        let weights = distance_log_weights(self.distance.clone(), blocks).exp();
        let matrix =
            weights / seen_by::<B>(blocks, &self.distance.device()).reshape([1, blocks, 1]);
        *kept = Some((blocks, matrix.clone()));
        matrix
    }
}

impl<B: ComputeBackend> LayerPredictor<B> {
    /// Token-block scores `[batch, blocks]` (f32, each sequence's largest 1) of the block input
    /// `x: [batch, seq, hidden]`: those of [`QueryKey::log_scores`] on its
    /// [`crate::scorer::block_token_rows`], up to rounding (the normalized rows are rounded to
    /// `x`'s dtype here). Three GEMMs over the tokens (O(seq * hidden * width)) and the pooling
    /// (O(batch * blocks^2)).
    pub fn token_block_scores(&self, x: Tensor<B, 3>, block_size: usize) -> Tensor<B, 2> {
        let [batch, seq, hidden] = x.dims();
        let blocks = seq.div_ceil(block_size);
        let padded = blocks * block_size;
        let outputs = 2 * self.components;
        let normalized = rms_norm(x, self.unit.clone(), 1e-6, NormSaves::Input);
        // A last partial block is padded with zero rows, as the training form pads it.
        let normalized = if padded > seq {
            normalized.pad((0, 0, 0, padded - seq), 0.0)
        } else {
            normalized
        };
        let [first_bias, second_bias, out_bias] = self.biases.clone();
        let rows = normalized.reshape([batch * padded, hidden]);
        let first = relu(matmul_scaled(rows, self.first.clone(), 1.0, DType::F32) + first_bias);
        let second = relu(matmul(first, self.second.clone()) + second_bias);
        let log_scores =
            (matmul(second, self.out.clone()) + out_bias).reshape([batch, padded, outputs]);
        // Token scores relative to the sequence's largest of their column, in (0, 1]; a block's
        // score is their sum (its mean, up to the block size every block shares).
        let largest = log_scores.clone().max_dim(1);
        let pooled = (log_scores - largest.clone())
            .exp()
            .reshape([batch, blocks, block_size, outputs])
            .sum_dim(2)
            .reshape([batch, blocks, outputs]);
        let components = self.components;
        let query = pooled.clone().narrow(2, 0, components);
        let key = pooled.narrow(2, components, components);
        // Each component's column means: `[components, n, m]` times `[batch, components, m, 1]`.
        let columns = matmul(
            self.column_means(blocks).unsqueeze::<4>(),
            query.swap_dims(1, 2).unsqueeze_dim::<4>(3),
        )
        .reshape([batch, components, blocks])
        .swap_dims(1, 2);
        let scores = key * columns;
        let scores = if components == 1 {
            scores.reshape([batch, blocks])
        } else {
            // Component `c` came out scaled by `exp(-(largest query + largest key of c))`:
            // weigh the components back to one common scale before their sum.
            let offsets = largest.clone().narrow(2, 0, components)
                + largest.narrow(2, components, components);
            let weights = (offsets.clone() - offsets.max_dim(2)).exp();
            (scores * weights).sum_dim(2).reshape([batch, blocks])
        };
        // Every score may underflow only where the log-scores span more than f32's range.
        let largest = scores.clone().max_dim(1).clamp_min(f32::MIN_POSITIVE);
        scores / largest
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::Distribution;

    use crate::scorer::block_token_rows;

    type B = NdArray<f32>;

    #[test]
    fn prediction_scores_are_the_training_form_scores_relative_to_the_largest() {
        let _generator = lemo_test_support::exclusive_generator();
        check_against_the_training_form::<B>(&Default::default());
    }

    /// On CubeCL's wgpu runtime, the runtime of the CUDA backend's kernels.
    #[test]
    fn prediction_scores_are_the_training_form_scores_on_wgpu() {
        let _generator = lemo_test_support::exclusive_generator();
        check_against_the_training_form::<lemo_kernels::WgpuBackend>(&Default::default());
    }

    /// Two components with their own random distance weights, batch 2, two block counts.
    fn check_against_the_training_form<B: ComputeBackend>(device: &B::Device) {
        let (hidden, block_size) = (8, 4);
        let trained = QueryKey::<B>::with_random_distances(hidden, 5, 2, device);
        let predictor = LayerPredictor::new(&trained, DType::F32);
        // Two block counts (the second reuses nothing of the first's column means), the
        // first with a partial last block.
        for seq in [22, 36] {
            let x =
                Tensor::<B, 3>::random([2, seq, hidden], Distribution::Normal(0.0, 3.0), device);
            let got: Vec<f32> = predictor
                .token_block_scores(x.clone(), block_size)
                .into_data()
                .to_vec()
                .unwrap();
            let log_scores = trained.log_scores(block_token_rows(x, block_size, block_size));
            let expected: Vec<f32> = (log_scores.clone() - log_scores.max_dim(1))
                .exp()
                .into_data()
                .to_vec()
                .unwrap();
            assert_eq!(got.len(), 2 * seq.div_ceil(block_size));
            for (g, e) in got.iter().zip(&expected) {
                assert!(
                    (g - e).abs() <= 1e-4 * e.max(1e-3),
                    "seq {seq}: {got:?} vs {expected:?}"
                );
            }
            for sequence in got.chunks(seq.div_ceil(block_size)) {
                let largest = sequence.iter().cloned().fold(f32::MIN, f32::max);
                assert!((largest - 1.0).abs() < 1e-6, "{sequence:?}");
            }
        }
    }
}
