//! One predictor: three low-rank matrices with ReLU between them, from each token's normalized
//! embedding to its log-scores (one per component), pooled per token block; and the token rows
//! it reads.

use burn::module::{Module, Param};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Tensor, TensorData};
use lemo_kernels::ComputeBackend;
use lemo_kernels::fused::{NormSaves, rms_norm};

/// A dense map's initial values: uniform `U(-k, k)`, `k = 1 / sqrt(inputs)`.
pub(crate) fn initial_distribution(inputs: usize) -> Distribution {
    let k = 1.0 / (inputs as f64).sqrt();
    Distribution::Uniform(-k, k)
}

fn dense_params(inputs: usize, outputs: usize) -> usize {
    inputs * outputs + outputs
}

/// A dense map `x W + b` with `W: [inputs, outputs]`; its own type rather than `burn::nn::Linear`
/// so that pruning can rebuild it from selected rows and columns.
#[derive(Module, Debug)]
pub struct Dense<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Param<Tensor<B, 1>>,
}

impl<B: Backend> Dense<B> {
    /// Uniform `U(-k, k)`, `k = 1 / sqrt(inputs)` (PyTorch's default for a linear layer).
    pub fn new(inputs: usize, outputs: usize, device: &B::Device) -> Self {
        let uniform = initial_distribution(inputs);
        Self {
            weight: Param::from_tensor(Tensor::random([inputs, outputs], uniform, device)),
            bias: Param::from_tensor(Tensor::random([outputs], uniform, device)),
        }
    }

    /// A map with these values as new parameters (detached from any graph they came from).
    pub fn from_tensors(weight: Tensor<B, 2>, bias: Tensor<B, 1>) -> Self {
        Self {
            weight: Param::from_tensor(weight.detach()),
            bias: Param::from_tensor(bias.detach()),
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let [inputs, outputs] = self.weight.dims();
        let mut rows_shape = x.dims();
        rows_shape[D - 1] = outputs;
        let rows = x.shape().num_elements() / inputs;
        let x = x.reshape([rows, inputs]);
        let y = if outputs == 1 {
            // A matrix-vector product as a broadcast product and a row sum: CubeCL's vector
            // kernels require `inputs` to be a multiple of the plane size, which pruned widths
            // are not.
            (x * self.weight.val().reshape([1, inputs])).sum_dim(1)
        } else {
            x.matmul(self.weight.val())
        };
        (y + self.bias.val().unsqueeze()).reshape(rows_shape)
    }

    pub fn num_params(&self) -> usize {
        let [inputs, outputs] = self.weight.dims();
        dense_params(inputs, outputs)
    }
}

/// The size of a query or key scorer before pruning.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScorerShape {
    /// Width of both hidden layers.
    pub rank: usize,
    /// Log-scores per token: the rank of the block matrix a query and key pair approximates.
    pub components: usize,
}

/// `hidden -> width[0] -> width[1] -> components` with ReLU after the first two maps: log-scores
/// per token and component, and a token block's log-score the log of its tokens' mean score
/// ([`log_mean_exp_over_tokens`]).
#[derive(Module, Debug)]
pub struct Scorer<B: Backend> {
    pub first: Dense<B>,
    pub second: Dense<B>,
    pub out: Dense<B>,
}

impl<B: Backend> Scorer<B> {
    pub fn new(hidden: usize, rank: usize, components: usize, device: &B::Device) -> Self {
        Self {
            first: Dense::new(hidden, rank, device),
            second: Dense::new(rank, rank, device),
            out: Dense::new(rank, components, device),
        }
    }

    /// The two hidden activations (after ReLU) of `x: [..., hidden]`, and the log-scores
    /// `[..., components]`.
    pub fn forward_with_activations<const D: usize>(
        &self,
        x: Tensor<B, D>,
    ) -> (Tensor<B, D>, Tensor<B, D>, Tensor<B, D>) {
        let first = relu(self.first.forward(x));
        let second = relu(self.second.forward(first.clone()));
        let out = self.out.forward(second.clone());
        (first, second, out)
    }

    /// Per-token log-scores `[batch, blocks, tokens, components]` of token rows
    /// `[batch, blocks, tokens, hidden]` ([`block_token_rows`]). A block's exact score pools
    /// its tokens (a mean for the MLP, a maximum for attention, which large per-token
    /// log-scores approach), so the scorer reads tokens, not a block average.
    pub fn forward(&self, rows: Tensor<B, 4>) -> Tensor<B, 4> {
        self.forward_with_activations(rows).2
    }

    /// Widths of the two hidden layers.
    pub fn widths(&self) -> [usize; 2] {
        [self.first.weight.dims()[1], self.second.weight.dims()[1]]
    }

    /// Log-scores per token: the rank of the block matrix the scorer pair approximates.
    pub fn components(&self) -> usize {
        self.out.weight.dims()[1]
    }

    pub fn num_params(&self) -> usize {
        self.first.num_params() + self.second.num_params() + self.out.num_params()
    }

    /// Parameters of a scorer of `hidden` inputs, hidden widths `widths` and `components`
    /// outputs.
    pub fn params_of(hidden: usize, widths: [usize; 2], components: usize) -> usize {
        dense_params(hidden, widths[0])
            + dense_params(widths[0], widths[1])
            + dense_params(widths[1], components)
    }

    /// The scorer with only the hidden neurons `keep[0]` of the first layer and `keep[1]` of
    /// the second (each in increasing order): a neuron is a column of the map into its layer
    /// and a row of the map out of it.
    pub fn pruned(&self, keep: [&[usize]; 2]) -> Self {
        let device = self.first.weight.device();
        let index = |ids: &[usize]| {
            let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
            Tensor::<B, 1, burn::tensor::Int>::from_data(
                TensorData::new(ids.clone(), [ids.len()]),
                &device,
            )
        };
        let (first_keep, second_keep) = (index(keep[0]), index(keep[1]));
        let first = Dense::from_tensors(
            self.first.weight.val().select(1, first_keep.clone()),
            self.first.bias.val().select(0, first_keep.clone()),
        );
        let second = Dense::from_tensors(
            self.second
                .weight
                .val()
                .select(0, first_keep)
                .select(1, second_keep.clone()),
            self.second.bias.val().select(0, second_keep.clone()),
        );
        let out = Dense::from_tensors(
            self.out.weight.val().select(0, second_keep),
            self.out.bias.val(),
        );
        Self { first, second, out }
    }
}

/// `log mean_t exp(s_t)` over the last dimension of per-token log-scores `[batch, blocks,
/// tokens]`, stably: `[batch, blocks]`.
pub(crate) fn log_mean_exp_over_tokens<B: Backend>(per_token: Tensor<B, 3>) -> Tensor<B, 2> {
    let [batch, blocks, tokens] = per_token.dims();
    let largest = per_token.clone().max_dim(2).detach();
    let log_sum = (per_token - largest.clone()).exp().sum_dim(2).log() + largest;
    log_sum.reshape([batch, blocks]) - (tokens as f32).ln()
}

/// The RMS-normalized rows of `x: [batch, seq, hidden]` grouped by token block, f32
/// `[batch, blocks, tokens_per_block, hidden]`: every token (`tokens_per_block == block_size`),
/// or an evenly spaced subset of each block (what training data keeps of large models). The
/// scale of the residual stream varies by orders of magnitude between tokens; its direction is
/// what the layer's projections read. A last partial block is padded with zero rows (it is
/// always kept, so its score only enters the sequence's mean). O(seq * hidden): the cast and one
/// fused RMSNorm pass (unit weight, f32).
pub fn block_token_rows<B: ComputeBackend>(
    x: Tensor<B, 3>,
    block_size: usize,
    tokens_per_block: usize,
) -> Tensor<B, 4> {
    assert!(
        tokens_per_block > 0 && block_size.is_multiple_of(tokens_per_block),
        "{tokens_per_block} tokens per block must divide the block size {block_size}"
    );
    let [batch, seq, hidden] = x.dims();
    let blocks = seq.div_ceil(block_size);
    let unit = Tensor::ones([hidden], (&x.device(), DType::F32));
    let normalized = rms_norm(x.cast(DType::F32), unit, 1e-6, NormSaves::Input);
    let padded = blocks * block_size;
    let normalized = if padded > seq {
        normalized.pad((0, 0, 0, padded - seq), 0.0)
    } else {
        normalized
    };
    let stride = block_size / tokens_per_block;
    let grouped = normalized.reshape([batch * blocks * tokens_per_block, stride, hidden]);
    let grouped = if stride > 1 {
        grouped.narrow(1, 0, 1)
    } else {
        grouped
    };
    grouped.reshape([batch, blocks, tokens_per_block, hidden])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    type B = NdArray<f32>;

    #[test]
    fn token_rows_are_normalized_grouped_by_block_and_subsampled_evenly() {
        let device = Default::default();
        // Five rows of two channels, blocks of two: [0, 1], [2, 3], [4, pad].
        let rows = [3.0, 4.0, 6.0, 8.0, 1.0, 0.0, 0.0, -2.0, 5.0, 5.0];
        let x = Tensor::<B, 1>::from_floats(rows, &device).reshape([1, 5, 2]);
        let normalized = |a: f32, b: f32| {
            let rms = ((a * a + b * b) / 2.0 + 1e-6).sqrt();
            [a / rms, b / rms]
        };
        let all: Vec<f32> = block_token_rows(x.clone(), 2, 2)
            .into_data()
            .to_vec()
            .unwrap();
        let expected = [
            normalized(3.0, 4.0),
            normalized(6.0, 8.0),
            normalized(1.0, 0.0),
            normalized(0.0, -2.0),
            normalized(5.0, 5.0),
            [0.0, 0.0],
        ]
        .concat();
        let close = |got: &[f32], expected: &[f32]| {
            got.len() == expected.len()
                && got.iter().zip(expected).all(|(g, e)| (g - e).abs() < 1e-5)
        };
        assert!(close(&all, &expected), "{all:?} vs {expected:?}");
        let first_of_each: Vec<f32> = block_token_rows(x, 2, 1).into_data().to_vec().unwrap();
        let expected = [
            normalized(3.0, 4.0),
            normalized(1.0, 0.0),
            normalized(5.0, 5.0),
        ]
        .concat();
        assert!(close(&first_of_each, &expected), "{first_of_each:?}");
    }

    #[test]
    fn a_block_log_score_is_the_log_mean_of_its_token_scores() {
        let _generator = lemo_test_support::exclusive_generator();
        let device = Default::default();
        // Two sequences of three blocks of four tokens.
        let per_token = Tensor::<B, 3>::random([2, 3, 4], Distribution::Normal(0.0, 3.0), &device);
        let values: Vec<f32> = per_token.clone().into_data().to_vec().unwrap();
        let pooled: Vec<f32> = log_mean_exp_over_tokens(per_token)
            .into_data()
            .to_vec()
            .unwrap();
        for (block, got) in pooled.iter().enumerate() {
            let mean = values[block * 4..(block + 1) * 4]
                .iter()
                .map(|v| v.exp())
                .sum::<f32>()
                / 4.0;
            assert!((got - mean.ln()).abs() < 1e-4, "{got} vs {}", mean.ln());
        }
    }

    #[test]
    fn a_pruned_scorer_equals_the_full_one_when_the_removed_neurons_are_silent() {
        let _generator = lemo_test_support::exclusive_generator();
        let device = Default::default();
        let scorer = Scorer::<B>::new(6, 4, 2, &device);
        // Silence neuron 1 of the first layer and neuron 2 of the second: their pre-activations
        // are forced negative by a large negative bias.
        let silence = |dense: &Dense<B>, neuron: usize| {
            let mut bias: Vec<f32> = dense.bias.val().into_data().to_vec().unwrap();
            bias[neuron] = -1e6;
            let bias = Tensor::<B, 1>::from_floats(bias.as_slice(), &device);
            Dense::from_tensors(dense.weight.val(), bias)
        };
        let scorer = Scorer {
            first: silence(&scorer.first, 1),
            second: silence(&scorer.second, 2),
            out: scorer.out,
        };
        let pruned = scorer.pruned([&[0, 2, 3], &[0, 1, 3]]);
        assert_eq!(pruned.widths(), [3, 3]);
        assert_eq!(pruned.num_params(), 6 * 3 + 3 + 3 * 3 + 3 + 3 * 2 + 2);
        assert_eq!(pruned.num_params(), Scorer::<B>::params_of(6, [3, 3], 2));
        let x = Tensor::<B, 4>::random([2, 5, 3, 6], Distribution::Normal(0.0, 1.0), &device);
        let full: Vec<f32> = scorer.forward(x.clone()).into_data().to_vec().unwrap();
        let small: Vec<f32> = pruned.forward(x).into_data().to_vec().unwrap();
        for (f, s) in full.iter().zip(&small) {
            assert!((f - s).abs() < 1e-4, "{full:?} vs {small:?}");
        }
    }
}
