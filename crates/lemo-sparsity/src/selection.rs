//! The kept set of one block of a layer: which token blocks of each sequence it processes.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

/// The kept rows of a batch, `kept` positions per sequence in increasing order (the same count
/// for every sequence, so the kept rows of a batch form one `[batch, kept]` tensor).
#[derive(Debug, Clone, PartialEq)]
pub struct KeptRows {
    /// Row-major `[batch, kept]` positions `0..seq`.
    pub rows: Vec<u32>,
    pub batch: usize,
    pub kept: usize,
    pub seq: usize,
}

impl KeptRows {
    /// Every row of every sequence.
    pub fn all(batch: usize, seq: usize) -> Self {
        Self {
            rows: (0..batch).flat_map(|_| 0..seq as u32).collect(),
            batch,
            kept: seq,
            seq,
        }
    }

    /// Selects from token-block scores `[batch, blocks]` (one host read): each sequence keeps
    /// its blocks scoring at least `threshold` times its own mean block score, its first and last
    /// block, and at least `min_keep` of its blocks (the best-scoring ones); then every sequence
    /// is topped up with its best remaining blocks to the largest count of the batch.
    ///
    /// Thresholds are relative to the sequence's mean so that they mean the same whatever the
    /// scale of the scores, which moves as an adapter trains and between layers (the paper's
    /// initial threshold, the layer's mean score, is the relative threshold 1).
    pub fn select<B: Backend>(
        scores: &Tensor<B, 2>,
        block_size: usize,
        seq: usize,
        threshold: f32,
        min_keep: f32,
    ) -> Self {
        let [batch, blocks] = scores.dims();
        let values = lemo_kernels::host_reads::read_f32(scores.clone());
        let per_sequence: Vec<&[f32]> = values.chunks(blocks.max(1)).take(batch).collect();
        Self::from_block_scores(&per_sequence, block_size, seq, threshold, min_keep)
    }

    /// [`Self::select`] on host scores, one slice of `blocks` scores per sequence.
    pub fn from_block_scores(
        scores: &[&[f32]],
        block_size: usize,
        seq: usize,
        threshold: f32,
        min_keep: f32,
    ) -> Self {
        Self::from_block_scores_aligned(scores, block_size, seq, threshold, min_keep, 1)
    }

    /// [`Self::from_block_scores`], with the kept row count then topped up (by each sequence's
    /// best remaining blocks) to the next multiple of `row_multiple` the sequence allows: fused
    /// attention kernels take only some lengths (cuDNN's: multiples of 128), and one more block
    /// costs less than falling back to a slower kernel. The count stays as selected where no
    /// larger count is a multiple.
    pub fn from_block_scores_aligned(
        scores: &[&[f32]],
        block_size: usize,
        seq: usize,
        threshold: f32,
        min_keep: f32,
        row_multiple: usize,
    ) -> Self {
        let blocks = seq.div_ceil(block_size);
        let floor = ((min_keep.clamp(0.0, 1.0) * blocks as f32).ceil() as usize).min(blocks);
        let mut chosen: Vec<Vec<usize>> = scores
            .iter()
            .map(|s| {
                assert_eq!(
                    s.len(),
                    blocks,
                    "one score per block of {block_size} tokens"
                );
                let mean = s.iter().map(|&v| v as f64).sum::<f64>() / s.len().max(1) as f64;
                let mut kept = kept_blocks(s, (threshold as f64 * mean) as f32);
                top_up(&mut kept, s, floor);
                kept
            })
            .collect();
        let most = chosen.iter().map(Vec::len).max().unwrap_or(0);
        let most = aligned_block_count(most, block_size, seq, row_multiple);
        for (kept, s) in chosen.iter_mut().zip(scores) {
            top_up(kept, s, most);
        }
        let rows: Vec<Vec<u32>> = chosen
            .iter()
            .map(|kept| block_rows(kept, block_size, seq))
            .collect();
        let kept = rows.first().map_or(0, Vec::len);
        Self {
            rows: rows.concat(),
            batch: scores.len(),
            kept,
            seq,
        }
    }

    /// One sequence's kept rows (a batch of one) with the groups of its blocks that `group`
    /// names (`group(block) < groups`: the ranks that hold them, under context parallelism)
    /// keeping as many blocks each: every group is topped up to the largest group's count with
    /// its best remaining blocks by `scores` (one per block), so no rank waits on another.
    pub fn balanced(
        &self,
        scores: &[f32],
        block_size: usize,
        groups: usize,
        group: impl Fn(usize) -> usize,
    ) -> Self {
        assert_eq!(self.batch, 1, "balancing splits one sequence's blocks");
        let blocks = self.seq.div_ceil(block_size);
        let kept: Vec<usize> = (0..blocks)
            .filter(|&n| self.rows.contains(&((n * block_size) as u32)))
            .collect();
        let mut by_group: Vec<Vec<usize>> = vec![Vec::new(); groups];
        let mut group_scores: Vec<Vec<(usize, f32)>> = vec![Vec::new(); groups];
        for n in 0..blocks {
            group_scores[group(n)].push((n, scores[n]));
        }
        kept.iter().for_each(|&n| by_group[group(n)].push(n));
        let most = by_group.iter().map(Vec::len).max().unwrap_or(0);
        for (kept, candidates) in by_group.iter_mut().zip(&group_scores) {
            let mut rest: Vec<&(usize, f32)> = candidates
                .iter()
                .filter(|(n, _)| !kept.contains(n))
                .collect();
            rest.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let missing = most - kept.len();
            kept.extend(rest.into_iter().take(missing).map(|&(n, _)| n));
        }
        let mut all: Vec<usize> = by_group.concat();
        all.sort_unstable();
        let rows = block_rows(&all, block_size, self.seq);
        Self {
            kept: rows.len(),
            rows,
            batch: 1,
            seq: self.seq,
        }
    }

    /// Whether every row is kept (the block can run dense).
    pub fn is_all(&self) -> bool {
        self.kept == self.seq
    }

    /// The rows each sequence does not keep, in the same layout (`kept` then counts them).
    pub fn complement(&self) -> Self {
        let mut rows = Vec::with_capacity(self.batch * (self.seq - self.kept));
        for sequence in 0..self.batch {
            let kept = &self.rows[sequence * self.kept..(sequence + 1) * self.kept];
            let mut next = kept.iter().peekable();
            for row in 0..self.seq as u32 {
                match next.peek() {
                    Some(&&k) if k == row => {
                        next.next();
                    }
                    _ => rows.push(row),
                }
            }
        }
        Self {
            rows,
            batch: self.batch,
            kept: self.seq - self.kept,
            seq: self.seq,
        }
    }

    /// Kept rows over all rows.
    pub fn fraction(&self) -> f64 {
        self.kept as f64 / self.seq.max(1) as f64
    }

    /// `[batch, kept]` positions on `device`.
    pub fn to_tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Int> {
        let rows: Vec<i32> = self.rows.iter().map(|&r| r as i32).collect();
        Tensor::from_data(TensorData::new(rows, [self.batch, self.kept]), device)
    }
}

/// Indices of the blocks scoring at least `threshold`, plus the first and the last block, in
/// increasing order (so causal attention over the kept tokens stays exact).
pub fn kept_blocks(token_block_scores: &[f32], threshold: f32) -> Vec<usize> {
    let last = token_block_scores.len().saturating_sub(1);
    (0..token_block_scores.len())
        .filter(|&n| n == 0 || n == last || token_block_scores[n] >= threshold)
        .collect()
}

/// Adds the best-scoring blocks not yet kept until `kept` holds `count` (or every block).
fn top_up(kept: &mut Vec<usize>, scores: &[f32], count: usize) {
    if kept.len() >= count {
        return;
    }
    let mut rest: Vec<usize> = (0..scores.len()).filter(|n| !kept.contains(n)).collect();
    rest.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    kept.extend(rest.into_iter().take(count - kept.len()));
    kept.sort_unstable();
}

/// The least block count from `count` whose rows are a multiple of `row_multiple` (the last
/// block, always kept, may be short), or `count` when none is.
pub(crate) fn aligned_block_count(
    count: usize,
    block_size: usize,
    seq: usize,
    row_multiple: usize,
) -> usize {
    let blocks = seq.div_ceil(block_size);
    if row_multiple <= 1 || count == 0 {
        return count;
    }
    let last = seq - (blocks - 1) * block_size;
    (count..=blocks)
        .find(|&n| ((n - 1) * block_size + last).is_multiple_of(row_multiple))
        .unwrap_or(count)
}

/// Positions of `blocks` of `block_size` tokens in a sequence of `seq` (the last may be short).
pub fn block_rows(blocks: &[usize], block_size: usize, seq: usize) -> Vec<u32> {
    blocks
        .iter()
        .flat_map(|&n| (n * block_size..((n + 1) * block_size).min(seq)).map(|r| r as u32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_keeps_sink_and_last_block_and_preserves_order() {
        let scores = [0.1, 5.0, 0.2, 3.0, 0.3];
        assert_eq!(kept_blocks(&scores, 1.0), vec![0, 1, 3, 4]);
        assert_eq!(kept_blocks(&scores, f32::INFINITY), vec![0, 4]);
    }

    #[test]
    fn the_complement_holds_each_sequence_s_other_rows() {
        let kept = KeptRows {
            rows: vec![0, 2, 3, 1, 2, 4],
            batch: 2,
            kept: 3,
            seq: 5,
        };
        let dropped = kept.complement();
        assert_eq!((dropped.kept, dropped.rows), (2, vec![1, 4, 0, 3]));
        assert!(KeptRows::all(2, 5).complement().rows.is_empty());
    }

    #[test]
    fn rows_cover_whole_blocks_and_a_short_tail() {
        assert_eq!(block_rows(&[0, 2], 4, 10), vec![0, 1, 2, 3, 8, 9]);
    }

    #[test]
    fn the_floor_adds_the_best_blocks_and_the_batch_is_equalized() {
        let first: &[f32] = &[0.0, 9.0, 1.0, 8.0, 0.0, 0.0];
        let second: &[f32] = &[0.0, 0.0, 0.0, 0.0, 7.0, 0.0];
        // 2.5 times each mean (3 and 7/6): the first keeps {0, 1, 3, 5}, the second {0, 4, 5},
        // topped up with its best remaining block (the lowest index among equals): {0, 1, 4, 5}.
        let kept = KeptRows::from_block_scores(&[first, second], 2, 12, 2.5, 0.0);
        assert_eq!(kept.kept, 8);
        assert_eq!(&kept.rows[..8], &[0, 1, 2, 3, 6, 7, 10, 11]);
        assert_eq!(&kept.rows[8..], &[0, 1, 2, 3, 8, 9, 10, 11]);
        // A floor of half the blocks: 3 blocks each at least, the best first.
        let kept = KeptRows::from_block_scores(&[second], 2, 12, f32::INFINITY, 0.5);
        assert_eq!(kept.rows, vec![0, 1, 8, 9, 10, 11]);
        assert!((kept.fraction() - 0.5).abs() < 1e-12);
    }

    #[test]
    fn aligned_selection_adds_the_best_blocks_up_to_a_row_multiple() {
        // 8 blocks of 64 rows: the threshold keeps {0, 3, 7} (192 rows); aligned to 128 rows the
        // best remaining block (5) joins; unaligned, or where no larger count fits, nothing does.
        let scores: &[f32] = &[0.0, 0.1, 0.2, 9.0, 0.3, 0.5, 0.4, 0.0];
        let blocks_of = |kept: &KeptRows| -> Vec<u32> {
            kept.rows.chunks(64).map(|rows| rows[0] / 64).collect()
        };
        let aligned = KeptRows::from_block_scores_aligned(&[scores], 64, 512, 2.0, 0.0, 128);
        assert_eq!(aligned.kept, 256);
        assert_eq!(blocks_of(&aligned), vec![0, 3, 5, 7]);
        let plain = KeptRows::from_block_scores(&[scores], 64, 512, 2.0, 0.0);
        assert_eq!(blocks_of(&plain), vec![0, 3, 7]);
        // 500 rows (the last block 52): no count of kept blocks reaches a multiple of 128.
        let short = KeptRows::from_block_scores_aligned(&[scores], 64, 500, 2.0, 0.0, 128);
        assert_eq!(short.kept, 2 * 64 + 52);
    }

    #[test]
    fn balancing_tops_each_group_up_to_the_largest_with_its_best_blocks() {
        // Blocks of 2 tokens; groups hold blocks {0, 3} and {1, 2}.
        let group = |n: usize| usize::from(n == 1 || n == 2);
        let kept = KeptRows {
            rows: vec![0, 1, 6, 7],
            batch: 1,
            kept: 4,
            seq: 8,
        };
        let balanced = kept.balanced(&[1.0, 0.2, 0.9, 1.0], 2, 2, group);
        // Group 0 keeps 2 blocks, so group 1 adds its best two: blocks 2 then 1.
        assert_eq!(balanced.rows, vec![0, 1, 2, 3, 4, 5, 6, 7]);
        let kept = KeptRows {
            rows: vec![0, 1, 2, 3, 6, 7],
            batch: 1,
            kept: 6,
            seq: 8,
        };
        let balanced = kept.balanced(&[1.0, 0.5, 0.9, 1.0], 2, 2, group);
        assert_eq!(balanced.rows, vec![0, 1, 2, 3, 4, 5, 6, 7]);
        // One block each: already balanced, unchanged.
        let kept = KeptRows {
            rows: vec![0, 1, 2, 3],
            batch: 1,
            kept: 4,
            seq: 8,
        };
        assert_eq!(kept.balanced(&[1.0, 0.5, 0.9, 1.0], 2, 2, group), kept);
    }

    #[test]
    fn a_zero_threshold_keeps_everything() {
        let scores: &[f32] = &[0.0, 0.5, 0.0];
        let kept = KeptRows::from_block_scores(&[scores], 4, 10, 0.0, 0.0);
        assert!(kept.is_all());
        assert_eq!(kept, KeptRows::all(1, 10));
    }
}
