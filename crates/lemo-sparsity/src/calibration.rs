//! Layer-specific thresholds (the paper's Algorithm 1) with an objective that can be met.
//!
//! Each block of each layer (attention, MLP) has a threshold, relative to the mean token-block
//! score of the same sequence (see [`crate::selection::KeptRows::select`]); profiles therefore
//! hold scores divided by their sequence's mean. A threshold is parametrized by the fraction `d`
//! of the profiled scores it drops, `T = quantile(scores, d)`, so that one finite-difference step
//! means the same in every layer.
//!
//! 1. Initialization (as the paper): `T` is the mean profiled score of the block's layer.
//! 2. Refinement: the paper's objective, accuracy alone, is highest with nothing dropped and
//!    drives every threshold to zero. We minimize instead
//!    `J = (loss - dense_loss) / dense_loss + penalty * (keep - target)^2`,
//!    where `keep` is the mean kept fraction of the token-eliminating blocks and `target` the
//!    user's: each block's `d` moves against the central difference `(J(d+e) - J(d-e)) / 2e`.
//!    Blocks whose dropping costs loss move toward dense, cheap ones drop more.
//! 3. A common shift of the `d` of every attention block, and one of every MLP block (bisection),
//!    then put each kind's measured kept fraction on the target, so the refinement decides
//!    *where* tokens are dropped and the target decides *how many*.

pub use crate::thresholds::Block;
use crate::thresholds::{LayerThresholds, PerBlock};

/// Weight of the squared distance from the target kept fraction in the objective.
pub const KEEP_PENALTY: f64 = 4.0;

/// The profiled token-block scores of one layer, pooled over the calibration sequences.
#[derive(Debug, Clone, Default)]
pub struct LayerProfile {
    pub attention: Vec<f32>,
    pub mlp: Vec<f32>,
}

/// The objective `J` of the module docs.
pub fn objective(loss: f64, dense_loss: f64, keep: f64, target: f64) -> f64 {
    (loss - dense_loss) / dense_loss.abs().max(1e-12) + KEEP_PENALTY * (keep - target).powi(2)
}

/// Drop fractions of every block and the profiles they index.
#[derive(Debug, Clone)]
pub struct Calibrator {
    /// Sorted scores per layer and block.
    profiles: Vec<PerBlock<Vec<f32>>>,
    /// Drop fraction per layer and block; `None` for a block kept dense.
    drop: Vec<PerBlock<Option<f64>>>,
    pub target: f64,
    /// The largest drop fraction any block may reach.
    pub max_drop: f64,
}

fn sorted(mut scores: Vec<f32>) -> Vec<f32> {
    scores.retain(|s| s.is_finite());
    scores.sort_by(f32::total_cmp);
    scores
}

/// The score below which a fraction `drop` of `sorted_scores` lies (the threshold that drops it).
/// Always finite, so that a thresholds file holds every value: `f32::MIN` keeps everything and
/// `f32::MAX` drops everything the floor allows.
fn quantile(sorted_scores: &[f32], drop: f64) -> f32 {
    if sorted_scores.is_empty() || drop <= 0.0 {
        return f32::MIN;
    }
    let index = ((drop * sorted_scores.len() as f64).ceil() as usize).min(sorted_scores.len());
    if index >= sorted_scores.len() {
        return f32::MAX;
    }
    // Halfway between the last dropped score and the first kept one.
    let below = sorted_scores[index.saturating_sub(1)];
    0.5 * (below + sorted_scores[index])
}

impl Calibrator {
    /// Step 1: every block not in `dense_layers` starts at its layer's mean score.
    pub fn new(
        profiles: Vec<LayerProfile>,
        dense_layers: &[usize],
        target: f64,
        max_drop: f64,
    ) -> Self {
        let profiles: Vec<PerBlock<Vec<f32>>> = profiles
            .into_iter()
            .map(|p| PerBlock {
                attention: sorted(p.attention),
                mlp: sorted(p.mlp),
            })
            .collect();
        let drop = profiles
            .iter()
            .enumerate()
            .map(|(layer, blocks)| {
                let initial = |scores: &Vec<f32>| {
                    if dense_layers.contains(&layer) || scores.is_empty() {
                        return None;
                    }
                    let mean = scores.iter().map(|&s| s as f64).sum::<f64>() / scores.len() as f64;
                    let below = scores.iter().filter(|&&s| (s as f64) < mean).count();
                    Some((below as f64 / scores.len() as f64).min(max_drop))
                };
                PerBlock::from_fn(|block| initial(blocks.get(block)))
            })
            .collect();
        Self {
            profiles,
            drop,
            target,
            max_drop,
        }
    }

    pub fn num_layers(&self) -> usize {
        self.drop.len()
    }

    /// Whether this block eliminates tokens (is not kept dense).
    pub fn is_sparse(&self, layer: usize, block: Block) -> bool {
        self.drop[layer].get(block).is_some()
    }

    pub fn drop_fraction(&self, layer: usize, block: Block) -> Option<f64> {
        *self.drop[layer].get(block)
    }

    /// Thresholds of the current drop fractions.
    pub fn thresholds(&self) -> Vec<LayerThresholds> {
        self.thresholds_with(|_, _, d| d)
    }

    /// Thresholds with one block's drop fraction moved by `delta`.
    pub fn perturbed(&self, layer: usize, block: Block, delta: f64) -> Vec<LayerThresholds> {
        self.thresholds_with(|l, b, d| {
            if l == layer && b == block {
                d + delta
            } else {
                d
            }
        })
    }

    /// Thresholds with the drop fraction of every block of one kind moved by `delta`.
    pub fn shifted(&self, block: Block, delta: f64) -> Vec<LayerThresholds> {
        self.thresholds_with(|_, b, d| if b == block { d + delta } else { d })
    }

    fn thresholds_with(&self, drop: impl Fn(usize, Block, f64) -> f64) -> Vec<LayerThresholds> {
        self.drop
            .iter()
            .enumerate()
            .map(|(layer, blocks)| {
                let dropped = |b: Block| {
                    blocks
                        .get(b)
                        .map(|d| drop(layer, b, d).clamp(0.0, self.max_drop))
                };
                let threshold =
                    |b: Block| dropped(b).map(|d| quantile(self.profiles[layer].get(b), d));
                // Training keeps exactly the fraction the threshold keeps of the profiles: the
                // kept count is then known before the step's scores.
                let keep = |b: Block| dropped(b).map(|d| (1.0 - d) as f32);
                LayerThresholds {
                    attention: threshold(Block::Attention),
                    mlp: threshold(Block::Mlp),
                    attention_keep: keep(Block::Attention),
                    mlp_keep: keep(Block::Mlp),
                }
            })
            .collect()
    }

    /// Step 2 for one block: `d -= rate * gradient`, kept within `[0, max_drop]`.
    pub fn descend(&mut self, layer: usize, block: Block, gradient: f64, rate: f64) {
        if let Some(d) = self.drop[layer].get_mut(block) {
            *d = (*d - rate * gradient).clamp(0.0, self.max_drop);
        }
    }

    /// Mean kept fraction of the token-eliminating blocks of one kind, `1 - d` each (what
    /// training keeps: each block its best `1 - d` of the token blocks); `None` without any.
    pub fn keep(&self, block: Block) -> Option<f64> {
        let kept: Vec<f64> = self
            .drop
            .iter()
            .filter_map(|blocks| blocks.get(block).map(|d| 1.0 - d))
            .collect();
        (!kept.is_empty()).then(|| kept.iter().sum::<f64>() / kept.len() as f64)
    }

    /// Step 3 without passes over the data: the common shift of one kind's drop fractions that
    /// puts its mean kept fraction on `target` (bisection; the kept fraction falls as the shift
    /// grows), applied for good. Training keeps exactly each block's fraction, so the profile
    /// alone says what a shift keeps.
    pub fn meet_target(&mut self, block: Block, target: f64) {
        let (mut low, mut high) = (-1.0, 1.0);
        for _ in 0..40 {
            let middle = 0.5 * (low + high);
            let mut shifted = self.clone();
            shifted.shift(block, middle);
            match shifted.keep(block) {
                Some(keep) if keep > target => low = middle,
                _ => high = middle,
            }
        }
        self.shift(block, 0.5 * (low + high));
    }

    /// Step 3: moves the drop fraction of every block of one kind by `delta` for good.
    pub fn shift(&mut self, block: Block, delta: f64) {
        for blocks in &mut self.drop {
            if let Some(d) = blocks.get_mut(block) {
                *d = (*d + delta).clamp(0.0, self.max_drop);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(values: &[f32]) -> LayerProfile {
        LayerProfile {
            attention: values.to_vec(),
            mlp: values.to_vec(),
        }
    }

    #[test]
    fn initial_thresholds_drop_the_blocks_below_the_layer_mean() {
        let calibrator = Calibrator::new(
            vec![profile(&[1.0, 2.0, 3.0, 10.0]), profile(&[4.0; 4])],
            &[1],
            0.5,
            0.9,
        );
        // Mean 4: three of four scores lie below it.
        assert_eq!(calibrator.drop_fraction(0, Block::Attention), Some(0.75));
        assert!(!calibrator.is_sparse(1, Block::Mlp));
        let thresholds = calibrator.thresholds();
        assert_eq!(thresholds[0].attention, Some(6.5));
        // Training keeps exactly what the threshold keeps of the profile.
        assert_eq!(thresholds[0].attention_keep, Some(0.25));
        assert_eq!(thresholds[0].mlp_keep, Some(0.25));
        assert_eq!(thresholds[1], LayerThresholds::default());
    }

    #[test]
    fn descent_and_shift_stay_within_bounds() {
        let mut calibrator = Calibrator::new(vec![profile(&[1.0, 2.0, 3.0, 4.0])], &[], 0.5, 0.8);
        calibrator.descend(0, Block::Mlp, -10.0, 1.0);
        assert_eq!(calibrator.drop_fraction(0, Block::Mlp), Some(0.8));
        calibrator.shift(Block::Attention, -2.0);
        assert_eq!(calibrator.drop_fraction(0, Block::Attention), Some(0.0));
        assert_eq!(calibrator.drop_fraction(0, Block::Mlp), Some(0.8));
        assert_eq!(calibrator.thresholds()[0].attention, Some(f32::MIN));
        // Perturbing one block leaves the others alone.
        let moved = calibrator.perturbed(0, Block::Attention, 0.5);
        assert_eq!(moved[0].attention, Some(2.5));
        assert_eq!(moved[0].mlp, calibrator.thresholds()[0].mlp);
    }

    #[test]
    fn the_target_is_met_by_one_shift_of_each_kind_within_bounds() {
        let layers = vec![
            profile(&[1.0, 2.0, 3.0, 10.0]),
            profile(&[1.0, 1.0, 1.0, 5.0]),
            profile(&[4.0; 4]),
        ];
        let mut calibrator = Calibrator::new(layers, &[2], 0.5, 0.95);
        // Mean scores drop 3 of 4 in both sparse layers: 0.25 kept.
        assert_eq!(calibrator.keep(Block::Attention), Some(0.25));
        calibrator.meet_target(Block::Attention, 0.6);
        let keep = calibrator.keep(Block::Attention).unwrap();
        assert!((keep - 0.6).abs() < 1e-9, "{keep}");
        assert_eq!(calibrator.keep(Block::Mlp), Some(0.25));
        // Past what the bounds allow, every sparse block ends at the bound.
        calibrator.meet_target(Block::Mlp, 0.0);
        assert!((calibrator.keep(Block::Mlp).unwrap() - 0.05).abs() < 1e-9);
        let thresholds = calibrator.thresholds();
        assert!((thresholds[0].attention_keep.unwrap() - 0.6).abs() < 1e-6);
        assert_eq!(thresholds[2].attention_keep, None);
    }

    #[test]
    fn the_objective_prices_loss_and_distance_from_the_target() {
        assert_eq!(objective(2.0, 2.0, 0.5, 0.5), 0.0);
        assert!((objective(2.2, 2.0, 0.5, 0.5) - 0.1).abs() < 1e-12);
        assert!((objective(2.0, 2.0, 0.6, 0.5) - KEEP_PENALTY * 0.01).abs() < 1e-12);
    }
}
