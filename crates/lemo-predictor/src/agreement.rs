//! How the blocks a predictor keeps compare with the blocks exact scores keep: recall and
//! precision, and the threshold at which predicted scores keep as many blocks as exact ones.

use burn::tensor::backend::Backend;
use lemo_sparsity::KeptRows;

use crate::predictor::BlockPredictor;
use crate::training::BlockSamples;

/// How a block selects its kept token blocks from exact and from predicted scores (see
/// `KeptRows::from_block_scores`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Selection {
    /// The layer's threshold for exact scores.
    pub threshold: f32,
    /// The threshold predicted scores select with: the exact one while the predictors train,
    /// then the one matched to their spread ([`matched_threshold`]).
    pub predicted_threshold: f32,
    pub min_keep: f32,
}

impl Selection {
    /// The same threshold for exact and predicted scores.
    pub const fn new(threshold: f32, min_keep: f32) -> Self {
        Self {
            threshold,
            predicted_threshold: threshold,
            min_keep,
        }
    }

    pub fn with_predicted_threshold(self, predicted_threshold: f32) -> Self {
        Self {
            predicted_threshold,
            ..self
        }
    }

    /// Kept token-block indices of each sequence of `scores` `[sequences, blocks]` at
    /// `threshold`.
    fn kept_blocks(&self, scores: &[f32], blocks: usize, threshold: f32) -> Vec<Vec<u32>> {
        scores
            .chunks(blocks)
            .map(|s| {
                // Blocks of one token: the kept rows are the kept block indices.
                KeptRows::from_block_scores(&[s], 1, blocks, threshold, self.min_keep).rows
            })
            .collect()
    }

    pub(crate) fn exact_kept_blocks(&self, scores: &[f32], blocks: usize) -> Vec<Vec<u32>> {
        self.kept_blocks(scores, blocks, self.threshold)
    }

    pub(crate) fn predicted_kept_blocks(&self, scores: &[f32], blocks: usize) -> Vec<Vec<u32>> {
        self.kept_blocks(scores, blocks, self.predicted_threshold)
    }
}

/// Kept-block agreement of predicted with exact scores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Recall {
    /// Exactly kept blocks the prediction keeps, over the exactly kept blocks.
    pub recall: f64,
    /// Predicted blocks exactly kept, over the predicted blocks.
    pub precision: f64,
    /// Fractions of the blocks the prediction and the exact scores keep.
    pub kept: f64,
    pub exact_kept: f64,
    /// Exact informativeness the predicted kept blocks hold, over the most that as many blocks
    /// (the first and last among them, as selection always keeps) could hold: 1 when they are
    /// the best ones, and near 1 when the blocks missed score about as well as those taken in
    /// their place, which recall does not tell apart from missing the most informative ones.
    pub captured: f64,
}

/// Natural-log token-block scores `[sequences, blocks]` that `predictor` gives `samples`.
pub fn predicted_log_scores<B: Backend>(
    predictor: &BlockPredictor<B>,
    samples: &BlockSamples,
    device: &B::Device,
) -> Vec<f32> {
    predictor
        .log_scores(samples.token_rows::<B>(device))
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 scores")
}

/// Recall and precision of `predictor`'s kept blocks against the exact ones on `samples`.
pub fn recall<B: Backend>(
    predictor: &BlockPredictor<B>,
    samples: &BlockSamples,
    selection: Selection,
    device: &B::Device,
) -> Recall {
    agreement(
        &predicted_log_scores(predictor, samples, device),
        samples,
        selection,
    )
}

/// Recall and precision of the kept blocks of `predicted_log_scores` (`[sequences, blocks]`,
/// natural log) against the exact ones of `samples`.
pub(crate) fn agreement(
    predicted_log_scores: &[f32],
    samples: &BlockSamples,
    selection: Selection,
) -> Recall {
    let predicted = relative_scores(predicted_log_scores, samples.blocks);
    let predicted = selection.predicted_kept_blocks(&predicted, samples.blocks);
    let exact = selection.exact_kept_blocks(&samples.scores, samples.blocks);
    let (mut found, mut exact_count, mut predicted_count) = (0usize, 0usize, 0usize);
    let (mut held, mut most) = (0.0f64, 0.0f64);
    let exact_scores = samples.scores.chunks(samples.blocks);
    for ((p, e), scores) in predicted.iter().zip(&exact).zip(exact_scores) {
        found += p.iter().filter(|b| e.contains(b)).count();
        exact_count += e.len();
        predicted_count += p.len();
        // Relative to the sequence's mean, so that every sequence weighs the same.
        let mean = scores.iter().map(|&v| v as f64).sum::<f64>() / scores.len().max(1) as f64;
        let relative = |block: usize| scores[block] as f64 / mean.max(f64::MIN_POSITIVE);
        held += p.iter().map(|&b| relative(b as usize)).sum::<f64>();
        most += best_blocks(scores, p.len())
            .into_iter()
            .map(relative)
            .sum::<f64>();
    }
    let all_blocks = (samples.sequences() * samples.blocks).max(1) as f64;
    Recall {
        recall: found as f64 / exact_count.max(1) as f64,
        precision: found as f64 / predicted_count.max(1) as f64,
        kept: predicted_count as f64 / all_blocks,
        exact_kept: exact_count as f64 / all_blocks,
        captured: if most > 0.0 { held / most } else { 1.0 },
    }
}

/// The `count` blocks of the highest `scores` among those holding the first and the last block.
fn best_blocks(scores: &[f32], count: usize) -> Vec<usize> {
    let last = scores.len().saturating_sub(1);
    let mut rest: Vec<usize> = (1..last).collect();
    rest.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    let ends: Vec<usize> = if last > 0 { vec![0, last] } else { vec![0] };
    let take = count.saturating_sub(ends.len());
    ends.into_iter()
        .chain(rest.into_iter().take(take))
        .take(count)
        .collect()
}

/// Scores `exp(l - max)` of natural-log scores, per sequence of `blocks`: the ratios selection
/// reads, without overflow.
fn relative_scores(log_scores: &[f32], blocks: usize) -> Vec<f32> {
    log_scores
        .chunks(blocks)
        .flat_map(|sequence| {
            let largest = sequence.iter().copied().fold(f32::MIN, f32::max);
            sequence.iter().map(move |&l| (l - largest).exp())
        })
        .collect()
}

/// The threshold at which `predicted_log_scores` (`[sequences, blocks]`, natural log) keep as
/// many blocks over the sequences as `exact_scores` keep at `selection`'s threshold.
/// A predictor fitted by regression spreads its scores less than the exact ones (it shrinks
/// toward the mean where it is unsure), so at the exact threshold it keeps more blocks than the
/// exact selection; at the matched threshold a token-sparse pass keeps the fraction its
/// thresholds were calibrated for. Bisection on the log of the threshold: the kept count falls
/// as the threshold rises.
pub fn matched_threshold(
    predicted_log_scores: &[f32],
    exact_scores: &[f32],
    blocks: usize,
    selection: Selection,
) -> f32 {
    let predicted = relative_scores(predicted_log_scores, blocks);
    let kept = |threshold: f32| -> usize {
        selection
            .kept_blocks(&predicted, blocks, threshold)
            .iter()
            .map(Vec::len)
            .sum()
    };
    let target: usize = selection
        .exact_kept_blocks(exact_scores, blocks)
        .iter()
        .map(Vec::len)
        .sum();
    // Below e^-30 every block passes; above `blocks` times the mean none does.
    let (mut low, mut high) = (-30.0f32, (blocks as f32).ln() + 1.0);
    for _ in 0..60 {
        let middle = 0.5 * (low + high);
        if kept(middle.exp()) > target {
            low = middle;
        } else {
            high = middle;
        }
    }
    // The closer of the two counts, the smaller kept set on a tie.
    if target - kept(high.exp()).min(target) <= kept(low.exp()).saturating_sub(target) {
        high.exp()
    } else {
        low.exp()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    #[test]
    fn kept_blocks_are_block_indices_with_the_first_and_last_always_kept() {
        let selection = Selection::new(1.0, 0.0).with_predicted_threshold(0.9);
        // Exact keeps blocks 0, 1, 3 (the first and last always); a prediction that keeps 0, 2, 3.
        let exact = [0.1, 5.0, 0.2, 0.3];
        assert_eq!(selection.exact_kept_blocks(&exact, 4), vec![vec![0, 1, 3]]);
        let predicted = [0.1, 0.2, 5.0, 0.3];
        assert_eq!(
            selection.predicted_kept_blocks(&predicted, 4),
            vec![vec![0, 2, 3]]
        );
        // Each kind selects with its own threshold: block 2 (1.4, the mean 1.5) is under the
        // exact bar (1.0 x 1.5) and over the predicted one (0.9 x 1.5).
        let scores = [0.1, 0.3, 1.4, 4.2];
        assert_eq!(selection.exact_kept_blocks(&scores, 4), vec![vec![0, 3]]);
        assert_eq!(
            selection.predicted_kept_blocks(&scores, 4),
            vec![vec![0, 2, 3]]
        );
    }

    #[test]
    fn captured_informativeness_tells_near_ties_from_misses() {
        // Exact scores alternate between the even and the odd blocks; the exact selection keeps
        // the higher-scoring even ones and the last block, {0, 2, 4, 6, 7}. The prediction keeps
        // {0, 1, 3, 5, 7}: recall 2/5 whatever the scores. Against even blocks scoring 3 and odd
        // ones 1 it holds 7 of the 13 the best five blocks hold; against 1.01 and 1 it holds
        // nearly all of it, as the blocks it swapped are as informative.
        let predicted = [0.0f32, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0];
        let measure = |even: f32, odd: f32| {
            let exact: Vec<f32> = (0..8)
                .map(|b| if b % 2 == 0 { even } else { odd })
                .collect();
            let mut samples = BlockSamples::new(8, 1, 1);
            samples.push(&[0.0; 8], &exact);
            agreement(&predicted, &samples, Selection::new(1.0, 0.0))
        };
        let (miss, tie) = (measure(3.0, 1.0), measure(1.01, 1.0));
        println!("clear miss {miss:?}; near tie {tie:?}");
        assert_eq!((miss.recall, tie.recall), (0.4, 0.4));
        assert!((miss.captured - 7.0 / 13.0).abs() < 1e-6, "{miss:?}");
        assert!(tie.captured > 0.99, "{tie:?}");
    }

    #[test]
    fn a_matched_threshold_keeps_as_many_blocks_as_the_exact_scores() {
        let _generator = lemo_test_support::exclusive_generator();
        // Predicted log-scores half as spread as the exact ones, in the same order: at the exact
        // threshold the prediction keeps extra blocks; at the matched one it keeps as many as
        // the exact selection (so recall equals precision), and more of them are right.
        let device = Default::default();
        lemo_test_support::seed_backend::<NdArray<f32>>(&device);
        let (sequences, blocks) = (6, 40);
        let logs: Vec<f32> =
            lemo_test_support::random::<NdArray<f32>, 1>([sequences * blocks], &device)
                .mul_scalar(1.5)
                .into_data()
                .to_vec()
                .unwrap();
        let mut samples = BlockSamples::new(blocks, 1, 1);
        let exact: Vec<f32> = logs.iter().map(|l| l.exp()).collect();
        samples.push(&vec![0.0; sequences * blocks], &exact);
        let predicted: Vec<f32> = logs.iter().map(|l| 0.5 * l).collect();
        let selection = Selection::new(1.0, 0.1);
        let at_exact = agreement(&predicted, &samples, selection);
        let threshold = matched_threshold(&predicted, &exact, blocks, selection);
        let matched = agreement(
            &predicted,
            &samples,
            selection.with_predicted_threshold(threshold),
        );
        println!("exact threshold {at_exact:?}; matched threshold {threshold}: {matched:?}");
        assert!(at_exact.precision < at_exact.recall - 0.05, "{at_exact:?}");
        assert_eq!(matched.kept, matched.exact_kept, "equal kept counts");
        assert_eq!(matched.recall, matched.precision);
        // Predictions in the exact order keep the best blocks for their count.
        assert!((matched.captured - 1.0).abs() < 1e-9, "{matched:?}");
        assert!(matched.precision > at_exact.precision + 0.05, "{matched:?}");
    }
}
