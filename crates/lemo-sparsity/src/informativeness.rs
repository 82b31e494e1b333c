//! Token-block informativeness of a layer's attention block and MLP block, `[batch, blocks]`.
//! Computed outside autodiff on the tensors of every token; cost O(S^2 h) for attention (the
//! causal half of `Q K^T`, no softmax, no `V`) and O(S f) for the MLP.

use std::collections::BTreeSet;
use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use lemo_kernels::block_scores::block_scores;
use lemo_kernels::{AttentionOptions, LemoBackend};

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
    /// Attention blocks that attend in S2 groups of this many tokens are scored by the pairs
    /// their groups see ([`attention_in_s2_groups`]); `None`: causal.
    pub s2_group: Option<usize>,
}

impl BlockScoring {
    /// Exact scores of blocks of `block_size` tokens, causal.
    pub fn exact(block_size: usize) -> Self {
        Self {
            block_size,
            query_stride: 1,
            s2_group: None,
        }
    }
}

/// Attention token-block informativeness from the rotated queries and keys of every token,
/// `q: [batch, q_heads, seq, head_dim]`, `k: [batch, kv_heads, seq, head_dim]` (GQA allowed):
/// the block scores of [`lemo_kernels::block_scores`] (exact, or over sampled query rows)
/// reduced by [`token_block_informativeness`], or under S2 [`attention_in_s2_groups`]. f32
/// `[batch, blocks]`.
pub fn attention<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    scoring: BlockScoring,
) -> Tensor<B, 2> {
    match scoring.s2_group {
        Some(group) => attention_in_s2_groups(q, k, scoring, group),
        None => causal_attention(q, k, scoring),
    }
}

/// [`attention`] under plain causal attention.
fn causal_attention<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    scoring: BlockScoring,
) -> Tensor<B, 2> {
    token_block_informativeness(block_scores(q, k, scoring.block_size, scoring.query_stride))
}

/// Attention token-block informativeness under S2 attention in groups of `group` tokens
/// ([`AttentionOptions::shifted_group`]), from the same `q, k` as [`attention`]: each half of
/// the query heads scores only the pairs of its own groups (the second half's shifted by half a
/// group), its block scores averaged over its heads and weighted by its share of them, and a
/// key block's informativeness is the mean over the (head half, query block) pairs that see it.
/// A pair both halves see counts each half's largest entry (an upper bound of the largest
/// sum). Work: one group's blocks per query block, `group / seq` of [`attention`]'s (each group's
/// rows are copied into the batch). Where the half groups do not cut into whole blocks, or half
/// of the query heads would split a key/value head's queries, these are the causal scores.
pub fn attention_in_s2_groups<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    scoring: BlockScoring,
    group: usize,
) -> Tensor<B, 2> {
    let [batch, q_heads, seq, head_dim] = q.dims();
    let per_kv = q_heads / k.dims()[1];
    let (half, block_size) = (q_heads / 2, scoring.block_size);
    if half == 0 || !half.is_multiple_of(per_kv) || !(group / 2).is_multiple_of(block_size) {
        return causal_attention(q, k, scoring);
    }
    let blocks = seq.div_ceil(block_size);
    let mut seen = vec![0.0f32; blocks];
    let mut sums = None;
    for (heads, shift) in [(0..half, 0), (half..q_heads, group / 2)] {
        let weight = heads.len() as f32 / q_heads as f32;
        let kv_heads = heads.start / per_kv..heads.end / per_kv;
        let q = q.clone().slice([0..batch, heads, 0..seq, 0..head_dim]);
        let k = k.clone().slice([0..batch, kv_heads, 0..seq, 0..head_dim]);
        let groups: Vec<Range<usize>> =
            AttentionOptions::shifted_groups(seq, group, shift).collect();
        let half_sums = group_column_sums(q, k, &groups, scoring).mul_scalar(weight);
        sums = Some(match sums {
            Some(sums) => sums + half_sums,
            None => half_sums,
        });
        for positions in &groups {
            let (first, count) = (
                positions.start / block_size,
                positions.len().div_ceil(block_size),
            );
            for n in 0..count {
                seen[first + n] += weight * (count - n) as f32;
            }
        }
    }
    let sums = sums.expect("two halves of heads");
    let seen = Tensor::<B, 1>::from_data(TensorData::new(seen, [blocks]), &sums.device());
    sums / seen.reshape([1, blocks])
}

/// Column sums `[batch, blocks]` of the block scores of each of `groups` (consecutive ranges of
/// positions that start on block boundaries) alone, the groups of one length folded into the
/// batch for one call each.
fn group_column_sums<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    groups: &[Range<usize>],
    scoring: BlockScoring,
) -> Tensor<B, 2> {
    let batch = q.dims()[0];
    let mut columns: Vec<Option<Tensor<B, 2>>> = vec![None; groups.len()];
    let lengths: BTreeSet<usize> = groups.iter().map(|positions| positions.len()).collect();
    for len in lengths {
        let same: Vec<usize> = (0..groups.len())
            .filter(|&i| groups[i].len() == len)
            .collect();
        let fold = |t: &Tensor<B, 4>| {
            let [_, heads, _, head_dim] = t.dims();
            let slices = same.iter().map(|&i| {
                t.clone()
                    .slice([0..batch, 0..heads, groups[i].clone(), 0..head_dim])
            });
            Tensor::cat(slices.collect(), 0)
        };
        let group_blocks = len.div_ceil(scoring.block_size);
        let sums = block_scores(fold(&q), fold(&k), scoring.block_size, scoring.query_stride)
            .sum_dim(1)
            .reshape([same.len(), batch, group_blocks]);
        for (j, &i) in same.iter().enumerate() {
            columns[i] = Some(
                sums.clone()
                    .slice([j..j + 1, 0..batch, 0..group_blocks])
                    .reshape([batch, group_blocks]),
            );
        }
    }
    Tensor::cat(
        columns
            .into_iter()
            .map(|c| c.expect("every group has a length"))
            .collect(),
        1,
    )
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

    /// [`attention_in_s2_groups`] spelled out on the host: for each half of the heads, the
    /// mean over its heads of `relu(q . k * scale)` on the pairs its groups let see (causal, one
    /// group), block maxima over the sampled query rows, weighted by the half's share of the
    /// heads; per key block, the sum over halves and query blocks divided by the weighted count
    /// of query blocks of its group at or after it.
    #[allow(clippy::too_many_arguments)]
    fn s2_reference(
        q: &[f32],
        k: &[f32],
        [batch, q_heads, kv_heads, seq, head_dim]: [usize; 5],
        group: usize,
        block_size: usize,
        query_stride: usize,
    ) -> Vec<f32> {
        let per_kv = q_heads / kv_heads;
        let scale = (head_dim as f64).powf(-0.5);
        let blocks = seq.div_ceil(block_size);
        let mut expected = vec![0.0f32; batch * blocks];
        for b in 0..batch {
            let (mut sums, mut seen) = (vec![0.0f64; blocks], vec![0.0f64; blocks]);
            for (heads, shift) in [(0..q_heads / 2, 0), (q_heads / 2..q_heads, group / 2)] {
                let weight = heads.len() as f64 / q_heads as f64;
                let group_of = |p: usize| (p + shift) / group;
                for m in 0..blocks {
                    for n in 0..=m {
                        let query_rows = m * block_size..((m + 1) * block_size).min(seq);
                        if group_of(m * block_size) != group_of(n * block_size) {
                            continue;
                        }
                        seen[n] += weight;
                        let mut largest = 0.0f64;
                        for i in query_rows.filter(|i| (i + 1) % query_stride == 0) {
                            for j in n * block_size..((n + 1) * block_size).min(i + 1) {
                                let mean = heads
                                    .clone()
                                    .map(|h| {
                                        let q_row = &q[((b * q_heads + h) * seq + i) * head_dim..];
                                        let kv_head = h / per_kv;
                                        let k_row =
                                            &k[((b * kv_heads + kv_head) * seq + j) * head_dim..];
                                        let dot: f64 = (0..head_dim)
                                            .map(|d| q_row[d] as f64 * k_row[d] as f64)
                                            .sum();
                                        (dot * scale).max(0.0)
                                    })
                                    .sum::<f64>()
                                    / heads.len() as f64;
                                largest = largest.max(mean);
                            }
                        }
                        sums[n] += weight * largest;
                    }
                }
            }
            for n in 0..blocks {
                expected[b * blocks + n] = (sums[n] / seen[n]) as f32;
            }
        }
        expected
    }

    /// [`attention_in_s2_groups`] on backend `S` against [`s2_reference`].
    fn s2_scores_count_only_the_pairs_each_half_of_the_heads_sees<S: LemoBackend>() {
        // 120 positions in groups of 32, blocks of 8 (the CubeCL kernel's least): the groups'
        // lengths are 32 and 24, the shifted ones' 16, 32 and 8 (every length a separate fold).
        // GQA, two heads per K/V head.
        let dims @ [batch, q_heads, kv_heads, seq, head_dim] = [2, 4, 2, 120, 8];
        let (group, block_size) = (32, 8);
        let random = |count: usize, seed: usize| -> Vec<f32> {
            (0..count)
                .map(|i| ((i * 7919 + seed * 104729) % 1000) as f32 / 500.0 - 1.0)
                .collect()
        };
        let (qs, ks) = (
            random(batch * q_heads * seq * head_dim, 1),
            random(batch * kv_heads * seq * head_dim, 2),
        );
        let device = Default::default();
        let tensor = |values: &[f32], heads| {
            Tensor::<S, 1>::from_floats(values, &device).reshape([batch, heads, seq, head_dim])
        };
        for query_stride in [1, 2] {
            let scoring = BlockScoring {
                block_size,
                query_stride,
                s2_group: None,
            };
            let got: Vec<f32> =
                attention_in_s2_groups(tensor(&qs, q_heads), tensor(&ks, kv_heads), scoring, group)
                    .into_data()
                    .to_vec()
                    .unwrap();
            let expected = s2_reference(&qs, &ks, dims, group, block_size, query_stride);
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert!(
                    (g - e).abs() <= 1e-5 * e.abs().max(1e-3),
                    "stride {query_stride}, [{i}]: {g} vs {e}"
                );
            }
        }
        // Half groups of 12 do not cut into blocks of 8: the causal scores.
        let causal = attention(
            tensor(&qs, q_heads),
            tensor(&ks, kv_heads),
            BlockScoring::exact(8),
        );
        let fallback = attention_in_s2_groups(
            tensor(&qs, q_heads),
            tensor(&ks, kv_heads),
            BlockScoring::exact(8),
            24,
        );
        assert_eq!(causal.into_data(), fallback.into_data());
    }

    #[test]
    fn s2_scores_on_the_cpu_reference() {
        s2_scores_count_only_the_pairs_each_half_of_the_heads_sees::<B>();
    }

    #[test]
    fn s2_scores_on_the_cubecl_kernels() {
        s2_scores_count_only_the_pairs_each_half_of_the_heads_sees::<lemo_kernels::WgpuBackend>();
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
