//! Contextual token sparsity (LeMo): which token blocks a layer keeps.
//!
//! Inputs are block informativeness scores `I(B_mn)` of a layer (query block `m`, key block `n`,
//! causal so `m >= n`), computed exactly by `lemo-kernels` or approximated by `lemo-predictor`.
//! A key block's informativeness is the sum of its column over the query blocks that see it,
//! `I(B^T_n) = sum_{m >= n} I(B_mn)`; blocks below the layer's threshold are eliminated, except
//! the first (the attention sink) and the last (the tokens being predicted next).

/// Column sums `I(B^T_n) = sum_{m >= n} I(B_mn)` of a row-major `[blocks, blocks]` matrix of
/// causal block scores (entries above the diagonal are ignored).
pub fn token_block_informativeness(block_scores: &[f32], blocks: usize) -> Vec<f32> {
    assert_eq!(
        block_scores.len(),
        blocks * blocks,
        "block_scores must be [blocks, blocks]"
    );
    (0..blocks)
        .map(|n| (n..blocks).map(|m| block_scores[m * blocks + n]).sum())
        .collect()
}

/// The starting threshold of a layer: the mean token-block informativeness over profiling
/// inputs (step 1 of the paper's layer-specific threshold algorithm).
pub fn initial_threshold(token_block_scores: &[f32]) -> f32 {
    assert!(!token_block_scores.is_empty(), "no token blocks to average");
    token_block_scores.iter().sum::<f32>() / token_block_scores.len() as f32
}

/// Indices of the token blocks a layer keeps: those at or above `threshold`, plus the first and
/// last block, in increasing order (so causal attention over the kept tokens stays exact).
pub fn kept_blocks(token_block_scores: &[f32], threshold: f32) -> Vec<usize> {
    let last = token_block_scores.len().saturating_sub(1);
    (0..token_block_scores.len())
        .filter(|&n| n == 0 || n == last || token_block_scores[n] >= threshold)
        .collect()
}

/// Token positions of the kept blocks of a sequence of `seq_len` tokens cut into blocks of
/// `block_size` (the last block may be shorter).
pub fn kept_token_positions(
    kept_blocks: &[usize],
    block_size: usize,
    seq_len: usize,
) -> Vec<usize> {
    kept_blocks
        .iter()
        .flat_map(|&n| n * block_size..((n + 1) * block_size).min(seq_len))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_sums_count_only_query_blocks_at_or_after_the_key_block() {
        // 3 blocks; the value 100 above the diagonal must be ignored.
        let scores = [1.0, 100.0, 100.0, 2.0, 3.0, 100.0, 4.0, 5.0, 6.0];
        assert_eq!(
            token_block_informativeness(&scores, 3),
            vec![1.0 + 2.0 + 4.0, 3.0 + 5.0, 6.0]
        );
    }

    #[test]
    fn selection_keeps_sink_and_last_block_and_preserves_order() {
        let scores = [0.1, 5.0, 0.2, 3.0, 0.3];
        let threshold = initial_threshold(&scores);
        assert!((threshold - 1.72).abs() < 1e-6);
        assert_eq!(kept_blocks(&scores, threshold), vec![0, 1, 3, 4]);
        assert_eq!(kept_blocks(&scores, f32::INFINITY), vec![0, 4]);
    }

    #[test]
    fn kept_positions_cover_whole_blocks_and_a_short_tail() {
        assert_eq!(kept_token_positions(&[0, 2], 4, 10), vec![0, 1, 2, 3, 8, 9]);
    }
}
