//! Each sequence's best token blocks, a count fixed ahead, selected on the device.
//!
//! A block that keeps a fixed fraction of its token blocks (the best-scoring ones, as
//! `--keep-exactly` and predicted scores select) knows how many rows it keeps before its scores
//! exist, so the kept rows' shapes are known without reading the scores back: the selection is
//! a handful of device ops on `[batch, blocks]` scores, and the step never waits for the device.
//! It chooses exactly what [`KeptRows::from_block_scores_aligned`] chooses for a threshold no
//! block reaches (the first and the last block, then the best by score, the lower index first
//! among equals).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor};

#[cfg(doc)]
use crate::selection::KeptRows;
use crate::selection::aligned_block_count;

/// Token blocks a sequence of `seq` tokens keeps when it keeps its best `fraction` of blocks of
/// `block_size`: at least that fraction (rounded up), the first and the last block, raised to
/// the next count whose rows are a multiple of `row_multiple` where one is reachable.
pub fn best_block_count(
    fraction: f32,
    block_size: usize,
    seq: usize,
    row_multiple: usize,
) -> usize {
    let blocks = seq.div_ceil(block_size);
    let floor = ((fraction.clamp(0.0, 1.0) * blocks as f32).ceil() as usize).min(blocks);
    let count = floor.max(blocks.min(2));
    aligned_block_count(count, block_size, seq, row_multiple)
}

/// Rows of `count` blocks of `block_size` kept from `seq` tokens, the last (short) one among
/// them.
pub fn kept_row_count(count: usize, block_size: usize, seq: usize) -> usize {
    let blocks = seq.div_ceil(block_size);
    if count >= blocks {
        return seq;
    }
    (count - 1) * block_size + (seq - (blocks - 1) * block_size)
}

/// The rows of each sequence's `count` best blocks by `scores: [batch, blocks]` in increasing
/// order, `[batch, kept]` ([`kept_row_count`]), and, with `dropped`, the rows of its other
/// blocks, `[batch, seq - kept]` (`None` when there are none). Every op runs on the scores'
/// device; nothing is read back.
pub fn best_block_rows<B: Backend>(
    scores: Tensor<B, 2>,
    count: usize,
    block_size: usize,
    seq: usize,
    dropped: bool,
) -> (Tensor<B, 2, Int>, Option<Tensor<B, 2, Int>>) {
    let [batch, blocks] = scores.dims();
    assert_eq!(
        blocks,
        seq.div_ceil(block_size),
        "one score per block of {block_size} tokens"
    );
    assert!(
        (1..=blocks).contains(&count),
        "{count} kept blocks of {blocks}"
    );
    let kept = ranks(scores).lower_elem(count as i64).int();
    let kept_rows = block_rows(kept.clone(), count, block_size)
        .slice([0..batch, 0..kept_row_count(count, block_size, seq)]);
    // The last block, always kept, is the only one that can be short: dropped blocks are whole.
    let dropped_rows = (dropped && count < blocks)
        .then(|| block_rows(kept.neg().add_scalar(1), blocks - count, block_size));
    (kept_rows, dropped_rows)
}

/// `segment` where segments of it cut a sequence of `seq` tokens into whole blocks of
/// `block_size` (what [`best_block_rows_by_segment`] selects by), else `seq`: the whole
/// sequence as one segment.
pub fn segment_or_whole(seq: usize, segment: usize, block_size: usize) -> usize {
    if segment.is_multiple_of(block_size) && seq.is_multiple_of(segment) {
        segment
    } else {
        seq
    }
}

/// [`best_block_rows`] over each `segment` of a sequence apart: every segment of `segment`
/// tokens (the whole sequence, or a whole number of segments of whole blocks) keeps its own best
/// `count` blocks, its first and last among them, so the kept rows of every segment are
/// `count * block_size`: S2 attention's groups and half groups are whole segments, and each run
/// of kept rows in a group is a length the fused kernels take when the segment's share is one.
/// `[batch, segments * count * block_size]` kept rows, and the dropped ones with `dropped`.
pub fn best_block_rows_by_segment<B: Backend>(
    scores: Tensor<B, 2>,
    count: usize,
    block_size: usize,
    (seq, segment): (usize, usize),
    dropped: bool,
) -> (Tensor<B, 2, Int>, Option<Tensor<B, 2, Int>>) {
    assert_eq!(
        segment_or_whole(seq, segment, block_size),
        segment,
        "segments of {segment} tokens cut {seq} tokens into whole blocks of {block_size}"
    );
    let [batch, _] = scores.dims();
    let segments = seq / segment;
    let (kept, rest) = best_block_rows(
        scores.reshape([batch * segments, segment.div_ceil(block_size)]),
        count,
        block_size,
        segment,
        dropped,
    );
    // Each segment's rows from its own start, back in one row per sequence.
    let device = kept.device();
    let in_sequence = |rows: Tensor<B, 2, Int>| {
        let per_segment = rows.dims()[1];
        let starts = Tensor::<B, 1, Int>::arange(0..segments as i64, &device)
            .mul_scalar(segment as i64)
            .reshape([1, segments, 1]);
        (rows.reshape([batch, segments, per_segment]) + starts)
            .reshape([batch, segments * per_segment])
    };
    (in_sequence(kept), rest.map(in_sequence))
}

/// Each block's place in its sequence's order of selection, `[batch, blocks]`: 0 and 1 for the
/// first and the last block, then by score (descending), the lower index first among equals.
/// One `[batch, blocks, blocks]` comparison: blocks are few (1,024 at 64K tokens).
fn ranks<B: Backend>(scores: Tensor<B, 2>) -> Tensor<B, 2, Int> {
    let [batch, blocks] = scores.dims();
    let device = scores.device();
    let index = Tensor::<B, 1, Int>::arange(0..blocks as i64, &device);
    let ends = index
        .clone()
        .equal_elem(0)
        .bool_or(index.clone().equal_elem(blocks as i64 - 1))
        .unsqueeze_dim::<2>(0)
        .expand([batch, blocks]);
    let scores = scores.cast(DType::F32).mask_fill(ends, f32::INFINITY);
    let shape = [batch, blocks, blocks];
    // At [b, i, j]: block j's score against block i's.
    let other = scores.clone().unsqueeze_dim::<3>(1).expand(shape);
    let own = scores.unsqueeze_dim::<3>(2).expand(shape);
    let earlier = index
        .clone()
        .unsqueeze_dim::<2>(0)
        .lower(index.unsqueeze_dim::<2>(1))
        .int()
        .unsqueeze_dim::<3>(0)
        .expand(shape);
    let ahead = other.clone().greater(own.clone()).int() + other.equal(own).int() * earlier;
    ahead.sum_dim(2).reshape([batch, blocks])
}

/// The rows of the `count` blocks flagged 1 in `chosen: [batch, blocks]` (0 elsewhere), in
/// increasing order, `[batch, count * block_size]` as if every block were whole.
fn block_rows<B: Backend>(
    chosen: Tensor<B, 2, Int>,
    count: usize,
    block_size: usize,
) -> Tensor<B, 2, Int> {
    let [batch, blocks] = chosen.dims();
    let device = chosen.device();
    let index = Tensor::<B, 1, Int>::arange(0..blocks as i64, &device)
        .unsqueeze_dim::<2>(0)
        .expand([batch, blocks]);
    // A chosen block's slot is the number of chosen blocks before it; the others all go to the
    // spare slot `count`, cut off below.
    let slot = chosen.clone().cumsum(1) - chosen.clone();
    let slot = slot * chosen.clone() + chosen.neg().add_scalar(1).mul_scalar(count as i64);
    let slots = Tensor::<B, 2, Int>::zeros([batch, count + 1], &device)
        .scatter(1, slot, index, IndexingUpdateOp::Add)
        .slice([0..batch, 0..count]);
    let offsets =
        Tensor::<B, 1, Int>::arange(0..block_size as i64, &device).reshape([1, 1, block_size]);
    (slots.mul_scalar(block_size as i64).unsqueeze_dim::<3>(2) + offsets)
        .reshape([batch, count * block_size])
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    use super::*;
    use crate::selection::KeptRows;

    type B = NdArray<f32>;

    /// Seed of the random scores; `LEMO_TEST_SEED` overrides it.
    fn seed() -> u64 {
        let seed = std::env::var("LEMO_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(38);
        eprintln!("best_blocks tests: seed {seed} (LEMO_TEST_SEED overrides)");
        seed
    }

    /// Scores in a few levels, so that ties are common.
    fn scores(seed: u64, count: usize) -> Vec<f32> {
        let mut state = seed | 1;
        (0..count)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % 5) as f32
            })
            .collect()
    }

    #[test]
    fn device_selection_is_the_host_selection_of_the_best_blocks() {
        let seed = seed();
        let device = Default::default();
        let mut case = 0;
        let shapes: [(usize, usize); 6] = [(4, 40), (4, 37), (8, 8), (8, 13), (2, 3), (64, 1000)];
        for (block_size, seq) in shapes {
            for fraction in [0.0, 0.3, 0.5, 0.9, 1.0] {
                for row_multiple in [1, 16] {
                    case += 1;
                    let batch = 2;
                    let blocks = seq.div_ceil(block_size);
                    let values = scores(seed + case, batch * blocks);
                    let per_sequence: Vec<&[f32]> = values.chunks(blocks).collect();
                    let host = KeptRows::from_block_scores_aligned(
                        &per_sequence,
                        block_size,
                        seq,
                        f32::MAX,
                        fraction,
                        row_multiple,
                    );
                    let count = best_block_count(fraction, block_size, seq, row_multiple);
                    assert_eq!(kept_row_count(count, block_size, seq), host.kept);
                    let tensor = Tensor::<B, 2>::from_data(
                        TensorData::new(values.clone(), [batch, blocks]),
                        &device,
                    );
                    // One segment, the whole sequence (its last block may be short).
                    let (rows, dropped) =
                        best_block_rows_by_segment(tensor, count, block_size, (seq, seq), true);
                    let read = |t: Tensor<B, 2, Int>| -> Vec<u32> {
                        let values: Vec<i64> = t.into_data().convert::<i64>().into_vec().unwrap();
                        values.into_iter().map(|v| v as u32).collect()
                    };
                    let what = format!(
                        "block {block_size}, seq {seq}, keep {fraction}, multiple {row_multiple}"
                    );
                    assert_eq!(read(rows), host.rows, "{what}");
                    match dropped {
                        Some(dropped) => {
                            assert_eq!(read(dropped), host.complement().rows, "{what}")
                        }
                        None => assert!(host.is_all(), "{what}"),
                    }
                }
            }
        }
    }

    /// Each segment selects on its own scores as a sequence of its own would, the rows placed at
    /// the segment's start; the dropped rows are the rest.
    #[test]
    fn segments_select_their_own_best_blocks() {
        let seed = seed();
        let device = Default::default();
        let (batch, block_size, segment, seq) = (2, 4, 16, 64);
        let (blocks, per_segment) = (seq / block_size, segment / block_size);
        let values = scores(seed, batch * blocks);
        let tensor =
            Tensor::<B, 2>::from_data(TensorData::new(values.clone(), [batch, blocks]), &device);
        let count = best_block_count(0.5, block_size, segment, 8);
        assert_eq!(count, 2);
        let (rows, dropped) =
            best_block_rows_by_segment(tensor, count, block_size, (seq, segment), true);
        let read = |t: Tensor<B, 2, Int>| -> Vec<u32> {
            let values: Vec<i64> = t.into_data().convert::<i64>().into_vec().unwrap();
            values.into_iter().map(|v| v as u32).collect()
        };
        let mut kept = Vec::new();
        let mut rest = Vec::new();
        for sequence in values.chunks(blocks) {
            for (index, segment_scores) in sequence.chunks(per_segment).enumerate() {
                let host = KeptRows::from_block_scores(
                    &[segment_scores],
                    block_size,
                    segment,
                    f32::MAX,
                    0.5,
                );
                let start = (index * segment) as u32;
                kept.extend(host.rows.iter().map(|r| r + start));
                rest.extend(host.complement().rows.iter().map(|r| r + start));
            }
        }
        assert_eq!(read(rows), kept);
        assert_eq!(read(dropped.expect("half the blocks are dropped")), rest);
    }
}
