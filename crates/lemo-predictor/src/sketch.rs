//! The MLP predictor: the layer's own MLP input map evaluated for a few of its neurons.
//!
//! A token block's exact MLP score is the mean of `|a|` over its tokens and the MLP's `f`
//! intermediate channels, `a = silu(x G) * (x U)` (Llama, Mistral) or `relu(x U + b)` (OPT), `x`
//! the normalized block input. The sketch keeps `k << f` of those channels (their columns of
//! `G` and `U`, with the norm's weight folded in), chosen on training data for how much of the
//! variation of the exact scores between blocks they carry, and fits one non-negative weight
//! per channel: `score(block) = mean_t sum_j exp(w_j) |a_tj|`. Cost `O(s h k)`, `2k / 3f` of the
//! MLP's forward pass over every token. Its projections stay frozen (a few thousand training
//! blocks would overfit `2 h k` free values); the score is linear in the `k` weights, which are
//! solved by non-negative least squares ([`MlpSketch::fitted`]).

use burn::module::{Module, Param};
use burn::tensor::activation::{relu, silu};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor, TensorData};

/// An MLP's input side acting on RMS-normalized rows of the block input (what
/// [`crate::scorer::block_token_rows`] gives), every channel: `[hidden, ffn]` maps with the
/// norm's weight (and OPT's LayerNorm bias) folded in.
#[derive(Debug, Clone)]
pub struct MlpInputMap<B: Backend> {
    /// SwiGLU's gate; `None` for OPT's ReLU MLP, whose LayerNorm also centers the rows.
    pub gate: Option<Tensor<B, 2>>,
    pub up: Tensor<B, 2>,
    /// `[ffn]`.
    pub up_bias: Tensor<B, 1>,
}

/// `k` channels of an MLP's input map and their learned weights (see the module docs).
#[derive(Module, Debug)]
pub struct MlpSketch<B: Backend> {
    /// `[hidden, k]`, frozen.
    pub gate: Option<Param<Tensor<B, 2>>>,
    /// `[hidden, k]`, frozen.
    pub up: Param<Tensor<B, 2>>,
    /// `[k]`, frozen.
    pub up_bias: Param<Tensor<B, 1>>,
    /// `[k]`: the natural log of each channel's weight.
    pub log_weights: Param<Tensor<B, 1>>,
}

fn frozen<B: Backend, const D: usize>(t: Tensor<B, D>) -> Param<Tensor<B, D>> {
    Param::from_tensor(t.detach()).set_require_grad(false)
}

fn index<B: Backend>(ids: &[usize], device: &B::Device) -> Tensor<B, 1, Int> {
    let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    Tensor::from_data(TensorData::new(ids.clone(), [ids.len()]), device)
}

impl<B: Backend> MlpInputMap<B> {
    pub fn hidden(&self) -> usize {
        self.up.dims()[0]
    }

    pub fn channels(&self) -> usize {
        self.up.dims()[1]
    }

    /// The sketch of channels `neurons`, each weighted `f / k` so that its score starts as an
    /// estimate of the exact one.
    pub fn sketch(&self, neurons: &[usize]) -> MlpSketch<B> {
        let device = self.up.device();
        let ids = index::<B>(neurons, &device);
        let log_weight = (self.channels() as f32 / neurons.len() as f32).ln();
        MlpSketch::from_tensors(
            self.gate.as_ref().map(|g| g.clone().select(1, ids.clone())),
            self.up.clone().select(1, ids.clone()),
            self.up_bias.clone().select(0, ids),
            Tensor::full([neurons.len()], log_weight, &device),
        )
    }

    /// The `k` channels whose per-block mean `|a|` co-varies most with the exact scores,
    /// within each sequence, on `token_rows: [sequences, blocks, tokens, hidden]` and
    /// `scores: [sequences, blocks]`: the covariances of all channels sum to `f` times the
    /// scores' variance, so these carry most of what ranks one block above another. Sequences
    /// are read `chunk` at a time (a `[rows, ffn]` product of every row would not fit).
    pub fn select_neurons(
        &self,
        token_rows: Tensor<B, 4>,
        scores: Tensor<B, 2>,
        k: usize,
        chunk: usize,
    ) -> Vec<usize> {
        let [sequences, blocks, _, _] = token_rows.dims();
        let full = self.sketch(&(0..self.channels()).collect::<Vec<_>>());
        let block_means = full.block_channel_means(token_rows, chunk).reshape([
            sequences,
            blocks,
            self.channels(),
        ]);
        let target = (scores.clone() - scores.mean_dim(1)).reshape([sequences, blocks, 1]);
        let centered = block_means.clone() - block_means.mean_dim(1);
        let covariance = (centered * target).sum_dim(1).sum_dim(0).flatten::<1>(0, 2);
        let order: Vec<f32> = covariance
            .into_data()
            .convert::<f32>()
            .into_vec()
            .expect("f32 covariances");
        largest(&order, k)
    }
}

/// `argmin |M w - t|^2 + ridge |w - prior|^2` over `w >= floor`, from the normal equations
/// (`gram = M^T M`, `moment = M^T t`): channels whose weight comes out below the floor are held
/// at it and the rest solved again, until none is.
fn non_negative_ridge(
    gram: &[f64],
    moment: &[f64],
    prior: &[f64],
    ridge: f64,
    floor: f64,
) -> Vec<f64> {
    let k = moment.len();
    let mut held = vec![false; k];
    loop {
        let free: Vec<usize> = (0..k).filter(|&i| !held[i]).collect();
        let n = free.len();
        let mut system = vec![0.0f64; n * n];
        let mut right = vec![0.0f64; n];
        for (a, &i) in free.iter().enumerate() {
            right[a] = moment[i] + ridge * prior[i]
                - (0..k)
                    .filter(|&j| held[j])
                    .map(|j| gram[i * k + j] * floor)
                    .sum::<f64>();
            for (c, &j) in free.iter().enumerate() {
                system[a * n + c] = gram[i * k + j] + if i == j { ridge } else { 0.0 };
            }
        }
        let solution = cholesky_solve(&mut system, right);
        let mut weights = vec![floor; k];
        let mut newly_held = false;
        for (a, &i) in free.iter().enumerate() {
            if solution[a] < floor {
                held[i] = true;
                newly_held = true;
            } else {
                weights[i] = solution[a];
            }
        }
        if !newly_held {
            return weights;
        }
    }
}

/// Solves `A x = b` for a symmetric positive definite `A` (`n x n`, overwritten by its Cholesky
/// factor).
fn cholesky_solve(a: &mut [f64], mut b: Vec<f64>) -> Vec<f64> {
    let n = b.len();
    for j in 0..n {
        let diagonal = a[j * n + j] - (0..j).map(|p| a[j * n + p] * a[j * n + p]).sum::<f64>();
        let diagonal = diagonal.max(1e-300).sqrt();
        a[j * n + j] = diagonal;
        for i in j + 1..n {
            let sum = (0..j).map(|p| a[i * n + p] * a[j * n + p]).sum::<f64>();
            a[i * n + j] = (a[i * n + j] - sum) / diagonal;
        }
    }
    for i in 0..n {
        b[i] = (b[i] - (0..i).map(|p| a[i * n + p] * b[p]).sum::<f64>()) / a[i * n + i];
    }
    for i in (0..n).rev() {
        b[i] = (b[i] - (i + 1..n).map(|p| a[p * n + i] * b[p]).sum::<f64>()) / a[i * n + i];
    }
    b
}

/// Indices of the `k` largest values, in increasing index order.
fn largest(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(k.min(values.len()));
    order.sort_unstable();
    order
}

impl<B: Backend> MlpSketch<B> {
    /// A sketch of these values (detached; the maps frozen, the weights trainable).
    pub fn from_tensors(
        gate: Option<Tensor<B, 2>>,
        up: Tensor<B, 2>,
        up_bias: Tensor<B, 1>,
        log_weights: Tensor<B, 1>,
    ) -> Self {
        Self {
            gate: gate.map(frozen),
            up: frozen(up),
            up_bias: frozen(up_bias),
            log_weights: Param::from_tensor(log_weights.detach()),
        }
    }

    /// A sketch of `k` random channels of a random SwiGLU map: the size and cost of a trained
    /// one, for timing.
    pub fn random(hidden: usize, k: usize, device: &B::Device) -> Self {
        let normal = Distribution::Normal(0.0, 1.0 / (hidden as f64).sqrt());
        MlpInputMap {
            gate: Some(Tensor::random([hidden, k], normal, device)),
            up: Tensor::random([hidden, k], normal, device),
            up_bias: Tensor::zeros([k], device),
        }
        .sketch(&(0..k).collect::<Vec<_>>())
    }

    /// `|a|` of the sketch's channels for rows `[..., hidden]`: `[..., k]`.
    pub fn channel_activations(&self, rows: Tensor<B, 4>) -> Tensor<B, 4> {
        let [batch, blocks, tokens, hidden] = rows.dims();
        let k = self.width();
        let flat = rows.reshape([batch * blocks * tokens, hidden]);
        let activations = match &self.gate {
            Some(gate) => {
                silu(flat.clone().matmul(gate.val()))
                    * (flat.matmul(self.up.val()) + self.up_bias.val().unsqueeze())
            }
            None => {
                // OPT's LayerNorm: the RMS-normalized row, centered and rescaled to unit RMS.
                let centered = flat.clone() - flat.mean_dim(1);
                let rms = centered
                    .clone()
                    .powi_scalar(2)
                    .mean_dim(1)
                    .add_scalar(1e-6)
                    .sqrt();
                relu((centered / rms).matmul(self.up.val()) + self.up_bias.val().unsqueeze())
            }
        };
        activations.abs().reshape([batch, blocks, tokens, k])
    }

    /// Each channel's mean `|a|` over each block's tokens, `[batch * blocks, k]`, computed
    /// `chunk` sequences of `token_rows: [batch, blocks, tokens, hidden]` at a time.
    pub fn block_channel_means(&self, token_rows: Tensor<B, 4>, chunk: usize) -> Tensor<B, 2> {
        let [sequences, blocks, _, _] = token_rows.dims();
        let chunk = chunk.max(1);
        let parts: Vec<Tensor<B, 2>> = (0..sequences)
            .step_by(chunk)
            .map(|start| {
                let rows = token_rows
                    .clone()
                    .narrow(0, start, chunk.min(sequences - start));
                let count = rows.dims()[0];
                self.channel_activations(rows)
                    .mean_dim(2)
                    .reshape([count * blocks, self.width()])
            })
            .collect();
        Tensor::cat(parts, 0)
    }

    /// The sketch with the channel weights that best reproduce the exact `scores`
    /// (`[sequences * blocks]`, of the blocks of `token_rows`) relative to each sequence's mean,
    /// by least squares, the score being linear in the weights: non-negative (active set), with a small ridge toward the
    /// present weights, the target rescaled to the present scores' mean (only ratios matter).
    /// A closed form on the host, `O(blocks k^2 + k^3)`: no epochs, and no drift toward the
    /// training rows' noise that gradient steps on the selection loss show.
    pub fn fitted(&self, token_rows: Tensor<B, 4>, scores: &[f32], chunk: usize) -> Self {
        let k = self.width();
        let per_sequence = token_rows.dims()[1];
        let means: Vec<f64> = self
            .block_channel_means(token_rows, chunk)
            .into_data()
            .convert::<f64>()
            .into_vec()
            .expect("f64 means");
        let present: Vec<f64> = self
            .log_weights
            .val()
            .exp()
            .into_data()
            .convert::<f64>()
            .into_vec()
            .expect("f64 weights");
        let blocks = scores.len();
        assert_eq!(means.len(), blocks * k, "one score per block");
        let row = |b: usize| &means[b * k..(b + 1) * k];
        let predicted_mean = (0..blocks)
            .map(|b| row(b).iter().zip(&present).map(|(m, w)| m * w).sum::<f64>())
            .sum::<f64>()
            / blocks as f64;
        let score_mean = scores.iter().map(|&v| v as f64).sum::<f64>() / blocks as f64;
        let scale = predicted_mean / score_mean.max(1e-30);
        let mut gram = vec![0.0f64; k * k];
        let mut moment = vec![0.0f64; k];
        // Selection compares a block with its sequence's mean: each sequence's equations are
        // divided by its mean exact score, so that no sequence weighs by its overall scale.
        let sequence_means: Vec<f64> = scores
            .chunks(per_sequence)
            .map(|s| s.iter().map(|&v| v as f64).sum::<f64>() / s.len() as f64)
            .collect();
        for b in 0..blocks {
            let weight = 1.0 / (sequence_means[b / per_sequence] * scale).max(1e-30);
            let target = scores[b] as f64 * scale * weight;
            let m: Vec<f64> = row(b).iter().map(|v| v * weight).collect();
            for i in 0..k {
                moment[i] += m[i] * target;
                for j in 0..k {
                    gram[i * k + j] += m[i] * m[j];
                }
            }
        }
        let ridge = 1e-4 * (0..k).map(|i| gram[i * k + i]).sum::<f64>() / k as f64;
        let floor = 1e-6 * present.iter().sum::<f64>() / k as f64;
        let weights = non_negative_ridge(&gram, &moment, &present, ridge, floor);
        let log_weights: Vec<f32> = weights.iter().map(|w| w.ln() as f32).collect();
        Self::from_tensors(
            self.gate.as_ref().map(|g| g.val()),
            self.up.val(),
            self.up_bias.val(),
            Tensor::from_data(TensorData::new(log_weights, [k]), &self.up.device()),
        )
    }

    /// Token-block log-scores `[batch, blocks]` of token rows `[batch, blocks, tokens, hidden]`.
    pub fn forward(&self, rows: Tensor<B, 4>) -> Tensor<B, 2> {
        let [batch, blocks, tokens, _] = rows.dims();
        let k = self.width();
        // A broadcast product and a row sum rather than a matrix-vector product (see
        // `Dense::forward`).
        let weights = self.log_weights.val().exp().reshape([1, k]);
        let per_token = (self
            .channel_activations(rows)
            .reshape([batch * blocks * tokens, k])
            * weights)
            .sum_dim(1);
        per_token
            .reshape([batch, blocks, tokens])
            .mean_dim(2)
            .add_scalar(1e-30)
            .log()
            .reshape([batch, blocks])
    }

    /// Channels kept.
    pub fn width(&self) -> usize {
        self.up.dims()[1]
    }

    pub fn num_params(&self) -> usize {
        let [hidden, k] = self.up.dims();
        let maps = if self.gate.is_some() { 2 } else { 1 };
        maps * hidden * k + 2 * k
    }

    /// Each channel's share of the scores on `rows`: its weight times its mean `|a|`.
    pub fn contributions(&self, rows: Tensor<B, 4>) -> Vec<f32> {
        let k = self.width();
        let mean = self
            .channel_activations(rows)
            .reshape([-1, k as i32])
            .mean_dim(0);
        (mean.reshape([k]) * self.log_weights.val().exp())
            .into_data()
            .convert::<f32>()
            .into_vec()
            .expect("f32 contributions")
    }

    /// The sketch of channels `keep` (increasing) of this one, their learned weights kept.
    pub fn pruned(&self, keep: &[usize]) -> Self {
        let ids = index::<B>(keep, &self.up.device());
        let columns = |p: &Param<Tensor<B, 2>>| p.val().select(1, ids.clone());
        Self::from_tensors(
            self.gate.as_ref().map(columns),
            columns(&self.up),
            self.up_bias.val().select(0, ids.clone()),
            self.log_weights.val().select(0, ids),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    type B = NdArray<f32>;

    fn map(gated: bool, hidden: usize, ffn: usize) -> MlpInputMap<B> {
        let device = Default::default();
        let normal = Distribution::Normal(0.0, 1.0);
        MlpInputMap {
            gate: gated.then(|| Tensor::random([hidden, ffn], normal, &device)),
            up: Tensor::random([hidden, ffn], normal, &device),
            up_bias: Tensor::random([ffn], normal, &device),
        }
    }

    /// The exact MLP score of each block: mean over tokens and channels of `|a|`, written
    /// out from the MLP's definition.
    fn exact_scores(map: &MlpInputMap<B>, rows: Tensor<B, 4>) -> Vec<f32> {
        let [batch, blocks, tokens, hidden] = rows.dims();
        let flat = rows.reshape([batch * blocks * tokens, hidden]);
        let a = match &map.gate {
            Some(gate) => {
                let g = flat.clone().matmul(gate.clone());
                let u = flat.matmul(map.up.clone()) + map.up_bias.clone().unsqueeze();
                g.clone() * burn::tensor::activation::sigmoid(g) * u
            }
            None => {
                let centered = flat.clone() - flat.mean_dim(1);
                let std = centered
                    .clone()
                    .powi_scalar(2)
                    .mean_dim(1)
                    .add_scalar(1e-6)
                    .sqrt();
                relu((centered / std).matmul(map.up.clone()) + map.up_bias.clone().unsqueeze())
            }
        };
        a.abs()
            .reshape([batch, blocks, tokens * map.channels()])
            .mean_dim(2)
            .into_data()
            .to_vec()
            .unwrap()
    }

    #[test]
    fn a_sketch_of_every_channel_gives_the_exact_scores_up_to_the_channel_count() {
        let _generator = lemo_test_support::exclusive_generator();
        let device = Default::default();
        for gated in [true, false] {
            let map = map(gated, 6, 10);
            let rows =
                Tensor::<B, 4>::random([2, 3, 4, 6], Distribution::Normal(0.0, 1.0), &device);
            let exact = exact_scores(&map, rows.clone());
            let sketch = map.sketch(&(0..10).collect::<Vec<_>>());
            let logs: Vec<f32> = sketch.forward(rows).into_data().to_vec().unwrap();
            for (log, exact) in logs.iter().zip(&exact) {
                // Weights f / k = 1: the sum over channels is f times the channel mean.
                let expected = (exact * 10.0).ln();
                assert!(
                    (log - expected).abs() < 1e-4,
                    "gated {gated}: {log} vs {expected}"
                );
            }
        }
    }

    #[test]
    fn selection_picks_the_channels_that_drive_the_scores() {
        let _generator = lemo_test_support::exclusive_generator();
        let device = Default::default();
        // Channel 3's up column is large: it decides which blocks score high.
        let mut map = map(true, 5, 8);
        let mut up: Vec<f32> = map.up.clone().into_data().to_vec().unwrap();
        for row in 0..5 {
            up[row * 8 + 3] *= 20.0;
        }
        map.up = Tensor::from_data(TensorData::new(up, [5, 8]), &device);
        let rows = Tensor::<B, 4>::random([3, 6, 4, 5], Distribution::Normal(0.0, 1.0), &device);
        let exact = exact_scores(&map, rows.clone());
        let scores = Tensor::<B, 2>::from_data(TensorData::new(exact, [3, 6]), &device);
        let chosen = map.select_neurons(rows, scores, 2, 2);
        assert_eq!(chosen.len(), 2);
        assert!(chosen.contains(&3), "{chosen:?}");
        assert_eq!(largest(&[0.5, 2.0, -1.0, 3.0], 2), vec![1, 3]);
    }

    #[test]
    fn fitting_recovers_the_weights_that_made_the_scores() {
        let _generator = lemo_test_support::exclusive_generator();
        let device = Default::default();
        let sketch = map(true, 6, 5).sketch(&[0, 1, 2, 3, 4]);
        let rows = Tensor::<B, 4>::random([4, 8, 3, 6], Distribution::Normal(0.0, 1.0), &device);
        // Scores made by known weights, one of them zero (held at the floor by the fit).
        let truth = [2.0f32, 0.5, 0.0, 1.0, 3.0];
        let means: Vec<f32> = sketch
            .block_channel_means(rows.clone(), 3)
            .into_data()
            .to_vec()
            .unwrap();
        let scores: Vec<f32> = means
            .chunks(5)
            .map(|m| m.iter().zip(&truth).map(|(m, w)| m * w).sum())
            .collect();
        let fitted = sketch.fitted(rows, &scores, 3);
        let weights: Vec<f32> = fitted.log_weights.val().exp().into_data().to_vec().unwrap();
        // The target is rescaled to the present sketch's mean: compare ratios to weight 0.
        for (w, t) in weights.iter().zip(&truth) {
            let (got, expected) = (w / weights[0], t / truth[0]);
            assert!((got - expected).abs() < 1e-2, "{weights:?} vs {truth:?}");
        }
    }

    #[test]
    fn pruning_keeps_the_chosen_channels_and_their_weights() {
        let _generator = lemo_test_support::exclusive_generator();
        let device = Default::default();
        let sketch = map(true, 4, 6).sketch(&[0, 2, 3, 5]);
        let pruned = sketch.pruned(&[1, 3]);
        assert_eq!(pruned.width(), 2);
        assert_eq!(pruned.num_params(), 2 * 4 * 2 + 2 * 2);
        let rows = Tensor::<B, 4>::random([1, 2, 3, 4], Distribution::Normal(0.0, 1.0), &device);
        let full: Vec<f32> = sketch
            .channel_activations(rows.clone())
            .into_data()
            .to_vec()
            .unwrap();
        let kept: Vec<f32> = pruned
            .channel_activations(rows)
            .into_data()
            .to_vec()
            .unwrap();
        for token in 0..6 {
            assert_eq!(kept[token * 2], full[token * 4 + 1]);
            assert_eq!(kept[token * 2 + 1], full[token * 4 + 3]);
        }
    }
}
