//! A layer's attention predictors and what they predict: token-block log-scores
//! `log sum_c I_c(K_n) mean_{m >= n} D_c(m - n) I_c(Q_m)`, the column mean of the block matrix
//! `I(B_mn) = sum_c D_c(m - n) I_c(Q_m) I_c(K_n)`, of rank `c`, over the query blocks that see
//! key block `n`.
//!
//! `D_c` is a learned weight per component and bucket of block distance
//! ([`DISTANCE_BUCKETS`]). A product of query and key scores alone cannot say that a query
//! block attends most to the key blocks next to it (rotary positions make scores fall with
//! distance, and many heads attend locally), so without it every key block would seem to be
//! seen alike by near and far queries, and a late block, which only near queries see, would be
//! scored like an early one. Each component weighs distances its own way, so that one can
//! stand for attention to whatever is near and another for attention to what a key holds,
//! wherever it is: a single weighting would scale the near part by the key's content too.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use lemo_sparsity::informativeness::seen_by;

use crate::scorer::{Scorer, log_mean_exp_over_tokens};

/// Initial hidden width of the query and key scorers.
pub const DEFAULT_RANK: usize = 64;
/// Rank of the block matrix the query and key scorers approximate (their log-scores per token).
pub const DEFAULT_COMPONENTS: usize = 1;

/// Buckets of the block distance `m - n` between a query block and a key block that the
/// attention predictors weigh apart: 0, 1, 2, 3-4, 5-8, ..., 65-128, and 129 or more.
pub const DISTANCE_BUCKETS: usize = 10;

/// A layer's attention predictors: token-block log-scores of queries and of keys, and the
/// log-weights of block distances.
#[derive(Module, Debug)]
pub struct QueryKey<B: Backend> {
    pub query: Scorer<B>,
    pub key: Scorer<B>,
    /// `log D_c` per component and distance bucket, `[components, DISTANCE_BUCKETS]`.
    pub distance: Param<Tensor<B, 2>>,
}

impl<B: Backend> QueryKey<B> {
    /// Untrained scorers, every distance weighed alike.
    pub fn new(hidden: usize, rank: usize, components: usize, device: &B::Device) -> Self {
        Self {
            query: Scorer::new(hidden, rank, components, device),
            key: Scorer::new(hidden, rank, components, device),
            distance: Param::from_tensor(Tensor::zeros([components, DISTANCE_BUCKETS], device)),
        }
    }

    pub fn num_params(&self) -> usize {
        self.query.num_params() + self.key.num_params() + self.distance.val().shape().num_elements()
    }

    /// Natural-log token-block scores `[batch, blocks]` from the block input's token rows
    /// `[batch, blocks, tokens, hidden]` ([`crate::scorer::block_token_rows`]), up to a
    /// constant per sequence (selection is relative to the sequence's mean, so only ratios
    /// matter).
    pub fn log_scores(&self, rows: Tensor<B, 4>) -> Tensor<B, 2> {
        attention_log_scores(
            self.query.forward(rows.clone()),
            self.key.forward(rows),
            self.distance.val().unsqueeze(),
        )
    }

    /// Untrained scorers with normally distributed distance log-weights (for tests).
    #[cfg(test)]
    pub(crate) fn with_random_distances(
        hidden: usize,
        rank: usize,
        components: usize,
        device: &B::Device,
    ) -> Self {
        let normal = burn::tensor::Distribution::Normal(0.0, 1.0);
        Self {
            distance: Param::from_tensor(Tensor::random(
                [components, DISTANCE_BUCKETS],
                normal,
                device,
            )),
            ..Self::new(hidden, rank, components, device)
        }
    }

    /// Hidden widths: the query scorer's two and the key scorer's two.
    pub fn widths(&self) -> Vec<usize> {
        [self.query.widths(), self.key.widths()].concat()
    }
}

/// The bucket of each block distance `d` of `offsets` (as floats): 0 for `d <= 0`, else
/// `1 + ceil(log2 d)`, capped at `buckets - 1`. Read a hair below each integer so that powers
/// of two stay in their bucket.
fn distance_buckets<B: Backend>(offsets: Tensor<B, 2>, buckets: usize) -> Tensor<B, 2> {
    offsets
        .clone()
        .clamp_min(1.0)
        .log()
        .div_scalar(std::f32::consts::LN_2)
        .sub_scalar(1e-3)
        .ceil()
        .add_scalar(1.0)
        .clamp_max((buckets - 1) as f32)
        .mask_fill(offsets.lower_equal_elem(0.0), 0.0)
}

/// `[groups, blocks, blocks]`: entry `(n, m)` is group `g`'s log-weight of the distance
/// `m - n` (`distance: [groups, DISTANCE_BUCKETS]`) where query block `m` sees key block `n`,
/// and `-1e30` (no weight) where it does not (`m < n`). Built on the device from the block
/// indices: training builds it every epoch, and a host-built `blocks^2` index would be an
/// upload each time.
pub(crate) fn distance_log_weights<B: Backend>(
    distance: Tensor<B, 2>,
    blocks: usize,
) -> Tensor<B, 3> {
    let [groups, buckets] = distance.dims();
    let index = Tensor::<B, 1, Int>::arange(0..blocks as i64, &distance.device()).float();
    // `m - n` at `(n, m)`.
    let offsets = index.clone().reshape([1, blocks]) - index.reshape([blocks, 1]);
    let bucket = distance_buckets(offsets.clone(), buckets);
    let unseen = offsets
        .lower_elem(0.0)
        .unsqueeze::<3>()
        .expand([groups, blocks, blocks]);
    distance
        .select(1, bucket.int().reshape([blocks * blocks]))
        .reshape([groups, blocks, blocks])
        .mask_fill(unseen, -1e30)
}

/// Token-block log-scores `[batch, blocks]` from the query and key scorers' per-token
/// log-scores `[batch, blocks, tokens, components]` and the distance log-weights
/// `[groups, components, DISTANCE_BUCKETS]` of `groups` consecutive runs of sequences (the
/// layers of a stacked batch; one group for one layer): each scorer pooled over its block's
/// tokens, then `log sum_c exp(k_nc + log mean_{m >= n} exp(q_mc + log D_c(m - n)))`. Every
/// reduction runs over the last dimension (one component at a time), the layout CubeCL's fused
/// reductions handle on every backend.
pub(crate) fn attention_log_scores<B: Backend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    distance: Tensor<B, 3>,
) -> Tensor<B, 2> {
    let [batch, blocks, tokens, components] = key.dims();
    let [groups, _, buckets] = distance.dims();
    // Every group's and component's weights from one build of the distance buckets.
    let weights = distance_log_weights(distance.reshape([groups * components, buckets]), blocks)
        .reshape([groups, components, blocks, blocks]);
    let weights = |component: usize| {
        weights
            .clone()
            .narrow(1, component, 1)
            .reshape([groups, blocks, blocks])
    };
    let pooled = |per_token: &Tensor<B, 4>, component: usize| {
        log_mean_exp_over_tokens(
            per_token
                .clone()
                .narrow(3, component, 1)
                .reshape([batch, blocks, tokens]),
        )
    };
    let terms: Vec<Tensor<B, 2>> = (0..components)
        .map(|c| pooled(&key, c) + column_log_mean_exp(pooled(&query, c), weights(c)))
        .collect();
    if components == 1 {
        return terms.into_iter().next().expect("one component");
    }
    let terms = Tensor::stack::<3>(terms, 2);
    let largest = terms.clone().max_dim(2).detach();
    ((terms - largest.clone()).exp().sum_dim(2).log() + largest).reshape([batch, blocks])
}

/// `log(mean_{m >= n} exp(v_m + w_nm))` for every `n`, of `v: [batch, blocks]` and the
/// weights `w: [groups, blocks, blocks]` of `groups` consecutive runs of sequences
/// ([`distance_log_weights`]), stably: the log of the weighted mean query score over the query
/// blocks that see key block `n`. O(batch * blocks^2).
fn column_log_mean_exp<B: Backend>(v: Tensor<B, 2>, weights: Tensor<B, 3>) -> Tensor<B, 2> {
    let [batch, blocks] = v.dims();
    let [groups, _, _] = weights.dims();
    let device = v.device();
    let terms = v.reshape([groups, batch / groups, 1, blocks])
        + weights.reshape([groups, 1, blocks, blocks]);
    let largest = terms.clone().max_dim(3).detach();
    let log_sum = (terms - largest.clone()).exp().sum_dim(3).log() + largest;
    let log_count = seen_by::<B>(blocks, &device).log().reshape([1, blocks]);
    log_sum.reshape([batch, blocks]) - log_count
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::Distribution;

    type B = NdArray<f32>;

    #[test]
    fn attention_scores_are_column_means_of_the_distance_weighted_causal_block_matrix() {
        let _generator = lemo_test_support::exclusive_generator();
        let device = Default::default();
        let (blocks, components) = (6, 2);
        let scorers = QueryKey::<B>::with_random_distances(8, 4, components, &device);
        let log_weights: Vec<f32> = scorers.distance.val().into_data().to_vec().unwrap();
        let rows =
            Tensor::<B, 4>::random([2, blocks, 3, 8], Distribution::Normal(0.0, 1.0), &device);
        let predictor = scorers.clone();
        let scores: Vec<f32> = predictor
            .log_scores(rows.clone())
            .exp()
            .into_data()
            .to_vec()
            .unwrap();
        // Each scorer's block scores `[sequence][block][component]`: token scores averaged.
        let block_scores = |scorer: &Scorer<B>| -> Vec<f32> {
            scorer
                .forward(rows.clone())
                .exp()
                .mean_dim(2)
                .into_data()
                .to_vec()
                .unwrap()
        };
        let (query, key) = (block_scores(&scorers.query), block_scores(&scorers.key));
        let at = |v: &[f32], sequence: usize, block: usize, component: usize| {
            v[(sequence * blocks + block) * components + component]
        };
        for sequence in 0..2 {
            for n in 0..blocks {
                // Block matrix I(B_mn) = sum_c D_c(m - n) q_mc k_nc for m >= n; key block n's
                // score is its column mean over the blocks - n query blocks that see it.
                let column: f32 = (n..blocks)
                    .flat_map(|m| (0..components).map(move |c| (m, c)))
                    .map(|(m, c)| {
                        let weight =
                            log_weights[c * DISTANCE_BUCKETS + distance_bucket(m - n)].exp();
                        weight * at(&query, sequence, m, c) * at(&key, sequence, n, c)
                    })
                    .sum::<f32>()
                    / (blocks - n) as f32;
                let got = scores[sequence * blocks + n];
                assert!(
                    (got - column).abs() <= 1e-4 * column.abs(),
                    "{got} vs {column}"
                );
            }
        }
    }

    /// The bucket of block distance `distance`: 0, then `1 + ceil(log2 d)`, capped.
    fn distance_bucket(distance: usize) -> usize {
        match distance {
            0 => 0,
            d => (1 + (usize::BITS - (d - 1).leading_zeros()) as usize).min(DISTANCE_BUCKETS - 1),
        }
    }

    #[test]
    fn distance_buckets_double_in_width_up_to_the_last() {
        let device = Default::default();
        let buckets_of = |distances: Vec<usize>| -> Vec<usize> {
            let count = distances.len();
            let offsets: Vec<f32> = distances.iter().map(|&d| d as f32).collect();
            let offsets = Tensor::<B, 1>::from_floats(offsets.as_slice(), &device);
            distance_buckets(offsets.reshape([1, count]), DISTANCE_BUCKETS)
                .into_data()
                .to_vec::<f32>()
                .unwrap()
                .into_iter()
                .map(|b| b as usize)
                .collect()
        };
        let buckets = buckets_of(vec![
            0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 65, 128, 129, 10_000,
        ]);
        assert_eq!(buckets, [0, 1, 2, 3, 3, 4, 4, 5, 5, 6, 7, 8, 8, 9, 9]);
        // Every distance of a 16K-token sequence of 64-token blocks, against integer arithmetic.
        let distances: Vec<usize> = (0..256).collect();
        for (d, bucket) in buckets_of(distances).into_iter().enumerate() {
            assert_eq!(bucket, distance_bucket(d), "distance {d}");
        }
        // Pairs where the query block comes before the key block carry no weight.
        let weights: Vec<f32> =
            distance_log_weights(Tensor::<B, 2>::zeros([1, DISTANCE_BUCKETS], &device), 4)
                .into_data()
                .to_vec()
                .unwrap();
        assert_eq!(
            weights[4], -1e30,
            "key block 1 is not seen by query block 0"
        );
        assert_eq!(weights[1], 0.0, "key block 0 is seen by query block 1");
    }
}
