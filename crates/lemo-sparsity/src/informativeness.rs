//! Token-block informativeness of a layer's attention block and MLP block, `[batch, blocks]`.
//! Computed outside autodiff on the tensors of every token; cost O(S^2 h) for attention (the
//! causal half of `Q K^T`, no softmax, no `V`) and O(S f) for the MLP.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use lemo_kernels::LemoBackend;
use lemo_kernels::block_scores::block_scores;

/// Causal column means of block scores `[batch, q_blocks, k_blocks]`: key block `n` is seen by
/// query blocks `m >= n`, and its informativeness is the mean of those `blocks - n` entries.
///
/// The paper sums the column; a sum counts `blocks - n` terms and so ranks early blocks above
/// late ones by position alone, and makes a threshold depend on the sequence length. The mean
/// keeps the score a property of the block's content.
pub fn token_block_informativeness<B: Backend>(block_scores: Tensor<B, 3>) -> Tensor<B, 2> {
    column_means(block_scores.sum_dim(1).squeeze_dim::<2>(1))
}

/// Token-block informativeness from the column sums of block scores `[batch, blocks]` (summed
/// over every query block; see [`token_block_informativeness`]): each divided by the number of
/// query blocks that see the key block.
pub fn column_means<B: Backend>(column_sums: Tensor<B, 2>) -> Tensor<B, 2> {
    let [_, blocks] = column_sums.dims();
    let seen_by = seen_by::<B>(blocks, &column_sums.device()).reshape([1, blocks]);
    column_sums / seen_by
}

/// `[blocks]`: how many query blocks see key block `n` under the causal mask, `blocks - n`
/// (f32, built on the device).
pub fn seen_by<B: Backend>(blocks: usize, device: &B::Device) -> Tensor<B, 1> {
    Tensor::<B, 1, Int>::arange(0..blocks as i64, device)
        .float()
        .neg()
        .add_scalar(blocks as f32)
}

/// How a block's pass scores its token blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockScoring {
    /// Tokens per block.
    pub block_size: usize,
    /// Attention blocks' scores read every `query_stride`-th query row
    /// ([`lemo_kernels::block_scores::sampled_query_rows`]); 1 reads every row, the exact scores.
    pub query_stride: usize,
}

impl BlockScoring {
    /// Exact scores of blocks of `block_size` tokens.
    pub fn exact(block_size: usize) -> Self {
        Self {
            block_size,
            query_stride: 1,
        }
    }
}

/// Attention token-block informativeness from the rotated queries and keys of every token,
/// `q: [batch, q_heads, seq, head_dim]`, `k: [batch, kv_heads, seq, head_dim]` (GQA allowed):
/// the block scores of [`lemo_kernels::block_scores`] (exact, or over sampled query rows)
/// reduced by [`token_block_informativeness`]. f32 `[batch, blocks]`.
pub fn attention<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    scoring: BlockScoring,
) -> Tensor<B, 2> {
    token_block_informativeness(block_scores(q, k, scoring.block_size, scoring.query_stride))
}

/// Rows whose absolute activations are summed at once by [`mlp`].
const ABS_SUM_ROWS: usize = 2048;

/// MLP token-block informativeness from the MLP's intermediate activations of every token,
/// `activations: [batch, seq, ffn]` (`silu(gate) * up` for Llama/Mistral, the ReLU output for
/// OPT): the mean absolute activation over the block's tokens and channels. f32
/// `[batch, blocks]`; a last partial block averages its own tokens.
pub fn mlp<B: Backend>(activations: Tensor<B, 3>, block_size: usize) -> Tensor<B, 2> {
    let [batch, seq, ffn] = activations.dims();
    let blocks = seq.div_ceil(block_size);
    // Each row's sum in f32, a slice of rows at a time: the f32 copy of the whole
    // `[seq, ffn]` activation (1.4 GiB per layer for Llama-2-7B at 32K) is never held.
    let per_token = Tensor::cat(
        (0..seq)
            .step_by(ABS_SUM_ROWS)
            .map(|start| {
                activations
                    .clone()
                    .slice([0..batch, start..(start + ABS_SUM_ROWS).min(seq), 0..ffn])
                    .cast(burn::tensor::DType::F32)
                    .abs()
                    .sum_dim(2)
            })
            .collect(),
        1,
    )
    .reshape([batch, seq]);
    let padded = blocks * block_size;
    let per_token = if padded > seq {
        per_token.pad((0, padded - seq, 0, 0), 0.0)
    } else {
        per_token
    };
    // Values per block, built on the device: the last block may be short.
    let device = per_token.device();
    let starts =
        Tensor::<B, 1, Int>::arange(0..blocks as i64, &device).mul_scalar(block_size as i64);
    let counts = (starts
        .clone()
        .add_scalar(block_size as i64)
        .clamp_max(seq as i64)
        - starts)
        .float()
        .mul_scalar(ffn as f32)
        .reshape([1, blocks]);
    per_token
        .reshape([batch, blocks, block_size])
        .sum_dim(2)
        .reshape([batch, blocks])
        / counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    type B = NdArray<f32>;

    #[test]
    fn column_means_count_only_the_query_blocks_that_see_the_key_block() {
        // 3 blocks; the value 100 above the diagonal is ignored by the kernel (it writes 0 there).
        let scores = [1.0, 0.0, 0.0, 2.0, 3.0, 0.0, 4.0, 5.0, 6.0];
        let scores = Tensor::<B, 1>::from_floats(scores, &Default::default()).reshape([1, 3, 3]);
        let columns: Vec<f32> = token_block_informativeness(scores)
            .into_data()
            .to_vec()
            .unwrap();
        assert_eq!(
            columns,
            vec![(1.0 + 2.0 + 4.0) / 3.0, (3.0 + 5.0) / 2.0, 6.0]
        );
    }

    #[test]
    fn mlp_scores_over_several_row_slices_are_the_block_means() {
        // Two sequences crossing two slice boundaries, with a short last block.
        let (batch, seq, ffn, block_size) = (2, 2 * ABS_SUM_ROWS + 5, 3, 64);
        let values: Vec<f32> = (0..batch * seq * ffn)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let activations = Tensor::<B, 1>::from_floats(values.as_slice(), &Default::default())
            .reshape([batch, seq, ffn]);
        let scores: Vec<f32> = mlp(activations, block_size).into_data().to_vec().unwrap();
        let blocks = seq.div_ceil(block_size);
        for b in 0..batch {
            for n in 0..blocks {
                let rows = n * block_size..((n + 1) * block_size).min(seq);
                let count = (rows.len() * ffn) as f64;
                let sum: f64 = rows
                    .flat_map(|t| (0..ffn).map(move |c| (b * seq + t) * ffn + c))
                    .map(|i| values[i].abs() as f64)
                    .sum();
                let expected = (sum / count) as f32;
                let got = scores[b * blocks + n];
                assert!(
                    (got - expected).abs() <= 1e-5 * expected,
                    "{b} {n}: {got} vs {expected}"
                );
            }
        }
    }

    #[test]
    fn mlp_scores_average_each_block_including_a_short_tail() {
        // 5 tokens of 2 channels, blocks of 2: [0,1], [2,3], [4].
        let values = [1.0, -1.0, 3.0, 3.0, -2.0, 0.0, 0.0, 2.0, 5.0, -5.0];
        let activations =
            Tensor::<B, 1>::from_floats(values, &Default::default()).reshape([1, 5, 2]);
        let scores: Vec<f32> = mlp(activations, 2).into_data().to_vec().unwrap();
        assert_eq!(
            scores,
            vec![(1.0 + 1.0 + 3.0 + 3.0) / 4.0, (2.0 + 2.0) / 4.0, 10.0 / 2.0]
        );
    }
}
