//! The attention predictors of every layer trained as one model.
//!
//! One layer's query and key scorers are a few small GEMMs: trained one layer at a time, an
//! Adam step is bound by kernel launches, and a 30-layer model needs minutes on any GPU. Here
//! each weight gains a leading layer dimension, so one step trains every layer. Adam is
//! element-wise and the loss is a sum of the layers' losses, so this is the same training as
//! layer by layer, with each layer's own threshold. Elastic size transformation masks neurons
//! rather than removing them (each layer prunes at its own pace and stops on its own recall),
//! and each layer's scorers are cut to their surviving neurons at the end.

use burn::module::{AutodiffModule, Module, Param};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::activation::relu;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

use crate::agreement::{Recall, Selection, agreement};
use crate::predictor::{DISTANCE_BUCKETS, QueryKey, attention_log_scores};
use crate::scorer::{Dense, Scorer, ScorerShape, initial_distribution};
use crate::training::{
    BlockSamples, TrainOptions, TrainedBlock, log_thresholds, selection_loss, surviving_count,
    survivors,
};

/// `x W_l + b_l` for every layer `l` at once.
#[derive(Module, Debug)]
struct StackedDense<B: Backend> {
    /// `[layers, inputs, outputs]`.
    weight: Param<Tensor<B, 3>>,
    /// `[layers, 1, outputs]`.
    bias: Param<Tensor<B, 3>>,
}

impl<B: Backend> StackedDense<B> {
    /// Each layer's map initialized as [`Dense::new`].
    fn new(layers: usize, inputs: usize, outputs: usize, device: &B::Device) -> Self {
        let uniform = initial_distribution(inputs);
        Self {
            weight: Param::from_tensor(Tensor::random([layers, inputs, outputs], uniform, device)),
            bias: Param::from_tensor(Tensor::random([layers, 1, outputs], uniform, device)),
        }
    }

    /// `[layers, rows, inputs]` to `[layers, rows, outputs]`.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [layers, inputs, outputs] = self.weight.dims();
        let y = if outputs == 1 {
            // As in `Dense::forward`: no CubeCL vector matmul.
            (x * self.weight.val().reshape([layers, 1, inputs])).sum_dim(2)
        } else {
            x.matmul(self.weight.val())
        };
        y + self.bias.val()
    }

    /// This map where `take[l]` is 0 and `other`'s where it is 1 (`take: [layers, 1, 1]`).
    fn blend(&self, other: &Self, take: Tensor<B, 3>) -> Self {
        let mix = |a: Tensor<B, 3>, b: Tensor<B, 3>| {
            Param::from_tensor((a.clone() + (b - a) * take.clone()).detach())
        };
        Self {
            weight: mix(self.weight.val(), other.weight.val()),
            bias: mix(self.bias.val(), other.bias.val()),
        }
    }

    /// Layer `layer`'s map.
    fn layer(&self, layer: usize) -> Dense<B> {
        let [_, inputs, outputs] = self.weight.dims();
        Dense::from_tensors(
            self.weight
                .val()
                .narrow(0, layer, 1)
                .reshape([inputs, outputs]),
            self.bias.val().narrow(0, layer, 1).reshape([outputs]),
        )
    }
}

/// [`Scorer`]s of every layer; hidden neurons are switched off by masks `[layers, 1, width]`.
#[derive(Module, Debug)]
struct StackedScorer<B: Backend> {
    first: StackedDense<B>,
    second: StackedDense<B>,
    out: StackedDense<B>,
}

impl<B: Backend> StackedScorer<B> {
    fn new(
        layers: usize,
        hidden: usize,
        rank: usize,
        components: usize,
        device: &B::Device,
    ) -> Self {
        Self {
            first: StackedDense::new(layers, hidden, rank, device),
            second: StackedDense::new(layers, rank, rank, device),
            out: StackedDense::new(layers, rank, components, device),
        }
    }

    /// The two masked hidden activations and the per-token log-scores `[layers, rows,
    /// components]` of `x: [layers, rows, hidden]`.
    fn forward_with_activations(
        &self,
        x: Tensor<B, 3>,
        masks: [Tensor<B, 3>; 2],
    ) -> (Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 3>) {
        let [first_mask, second_mask] = masks;
        let first = relu(self.first.forward(x)) * first_mask;
        let second = relu(self.second.forward(first.clone())) * second_mask;
        let out = self.out.forward(second.clone());
        (first, second, out)
    }

    fn blend(&self, other: &Self, take: Tensor<B, 3>) -> Self {
        Self {
            first: self.first.blend(&other.first, take.clone()),
            second: self.second.blend(&other.second, take.clone()),
            out: self.out.blend(&other.out, take),
        }
    }

    /// Layer `layer`'s scorer cut to its surviving neurons.
    fn layer(&self, layer: usize, alive: [&[usize]; 2]) -> Scorer<B> {
        Scorer {
            first: self.first.layer(layer),
            second: self.second.layer(layer),
            out: self.out.layer(layer),
        }
        .pruned(alive)
    }
}

/// Adam moves each parameter by about the learning rate per step: the distance log-weights,
/// which need a range of a few nats within a few hundred steps, are trained as this fraction
/// of their value.
const DISTANCE_STEP: f32 = 0.1;

#[derive(Module, Debug)]
struct StackedQueryKey<B: Backend> {
    query: StackedScorer<B>,
    key: StackedScorer<B>,
    /// Every layer's distance log-weights times [`DISTANCE_STEP`],
    /// `[layers, components, DISTANCE_BUCKETS]`.
    distance: Param<Tensor<B, 3>>,
}

/// Training rows of every layer: `[layers, sequences * blocks * tokens, hidden]` and the shape
/// they stand for.
struct StackedRows<B: Backend> {
    rows: Tensor<B, 3>,
    sequences: usize,
    blocks: usize,
    tokens: usize,
}

impl<B: Backend> StackedRows<B> {
    fn new(samples: &[&BlockSamples], device: &B::Device) -> Self {
        let first = samples[0];
        let (sequences, blocks, tokens, hidden) =
            (first.sequences(), first.blocks, first.tokens, first.hidden);
        let mut values = Vec::with_capacity(samples.len() * first.token_rows.len());
        for s in samples {
            assert_eq!(
                (s.sequences(), s.blocks, s.tokens, s.hidden),
                (sequences, blocks, tokens, hidden),
                "every layer's samples cover the same sequences"
            );
            values.extend_from_slice(&s.token_rows);
        }
        let shape = [samples.len(), sequences * blocks * tokens, hidden];
        Self {
            rows: Tensor::from_data(TensorData::new(values, shape), device),
            sequences,
            blocks,
            tokens,
        }
    }
}

impl<B: AutodiffBackend> StackedRows<B> {
    fn inner(&self) -> StackedRows<B::InnerBackend> {
        StackedRows {
            rows: self.rows.clone().inner(),
            sequences: self.sequences,
            blocks: self.blocks,
            tokens: self.tokens,
        }
    }
}

/// Neuron masks `[layers, 1, rank]`, `[query, key][first, second]`.
type Masks<B> = [[Tensor<B, 3>; 2]; 2];

/// Which hidden neurons of each layer's scorers survive: `[query, key][first, second][layer]`.
#[derive(Debug, Clone, PartialEq)]
struct Alive([[Vec<Vec<usize>>; 2]; 2]);

impl Alive {
    fn all(layers: usize, rank: usize) -> Self {
        let every = vec![(0..rank).collect::<Vec<_>>(); layers];
        Self([
            [every.clone(), every.clone()],
            [every.clone(), every.clone()],
        ])
    }

    /// `[layers, 1, rank]` per scorer and hidden layer: 1 on the surviving neurons (built once
    /// per round, not per step: an upload per step would cost more than the step's arithmetic).
    fn masks<B: Backend>(&self, rank: usize, device: &B::Device) -> Masks<B> {
        self.0.clone().map(|scorer| {
            scorer.map(|layers| {
                let count = layers.len();
                let mut values = vec![0.0f32; count * rank];
                for (layer, alive) in layers.iter().enumerate() {
                    alive.iter().for_each(|&n| values[layer * rank + n] = 1.0);
                }
                Tensor::from_data(TensorData::new(values, [count, 1, rank]), device)
            })
        })
    }

    fn of_layer(&self, scorer: usize, layer: usize) -> [&[usize]; 2] {
        [&self.0[scorer][0][layer], &self.0[scorer][1][layer]]
    }

    /// One round of elastic size transformation: in each layer still `pruning`, each hidden
    /// layer of each scorer loses the `fraction` of its surviving neurons most often zero (by
    /// `frequencies`); a layer that loses none stops pruning.
    fn pruned(&self, frequencies: &Frequencies, pruning: &mut [bool], fraction: f64) -> Alive {
        let mut proposed = self.clone();
        for (layer, prunes) in pruning.iter_mut().enumerate() {
            if !*prunes {
                continue;
            }
            let mut changed = false;
            for (scorer, scorer_frequencies) in proposed.0.iter_mut().zip(frequencies) {
                for (hidden_layer, layer_frequencies) in scorer.iter_mut().zip(scorer_frequencies) {
                    let neurons = &mut hidden_layer[layer];
                    let frequency = &layer_frequencies[layer];
                    let uselessness: Vec<f32> = neurons.iter().map(|&n| frequency[n]).collect();
                    let keep = survivors(&uselessness, fraction);
                    changed |= keep.len() < neurons.len();
                    *neurons = keep.iter().map(|&i| neurons[i]).collect();
                }
            }
            *prunes = changed;
        }
        proposed
    }

    /// Layer `layer`'s neurons as `other` has them.
    fn take_layer(&mut self, layer: usize, other: &Alive) {
        for scorer in 0..2 {
            for hidden_layer in 0..2 {
                self.0[scorer][hidden_layer][layer] = other.0[scorer][hidden_layer][layer].clone();
            }
        }
    }
}

impl<B: Backend> StackedQueryKey<B> {
    /// Natural-log token-block scores `[layers * sequences, blocks]` (as
    /// [`QueryKey::log_scores`], every layer at once).
    fn log_scores(&self, data: &StackedRows<B>, masks: &Masks<B>) -> Tensor<B, 2> {
        let layers = data.rows.dims()[0];
        let per_token = |scorer: &StackedScorer<B>, index: usize| {
            let (_, _, out) =
                scorer.forward_with_activations(data.rows.clone(), masks[index].clone());
            let components = out.dims()[2];
            out.reshape([
                layers * data.sequences,
                data.blocks,
                data.tokens,
                components,
            ])
        };
        attention_log_scores(
            per_token(&self.query, 0),
            per_token(&self.key, 1),
            self.distance_log_weights(),
        )
    }

    /// `[layers, components, DISTANCE_BUCKETS]`.
    fn distance_log_weights(&self) -> Tensor<B, 3> {
        self.distance.val().div_scalar(DISTANCE_STEP)
    }

    /// How often each hidden neuron is zero on `data` (the full width; masked neurons always
    /// are), per scorer and hidden layer of every layer.
    fn zero_frequencies(&self, data: &StackedRows<B>, masks: &Masks<B>) -> Frequencies {
        let [layers, _, _] = data.rows.dims();
        let rank = masks[0][0].dims()[2];
        let frequencies = |activation: Tensor<B, 3>| -> Vec<f32> {
            activation
                .equal_elem(0.0)
                .float()
                .mean_dim(1)
                .into_data()
                .convert::<f32>()
                .into_vec()
                .expect("f32 frequencies")
        };
        [&self.query, &self.key]
            .into_iter()
            .enumerate()
            .map(|(index, scorer)| {
                let (first, second, _) =
                    scorer.forward_with_activations(data.rows.clone(), masks[index].clone());
                [first, second].map(|activation| {
                    let all = frequencies(activation);
                    (0..layers)
                        .map(|layer| all[layer * rank..(layer + 1) * rank].to_vec())
                        .collect()
                })
            })
            .collect()
    }

    fn blend(&self, other: &Self, take: Tensor<B, 3>) -> Self {
        let [layers, _, _] = take.dims();
        let (mine, theirs) = (self.distance.val(), other.distance.val());
        let distance = mine.clone() + (theirs - mine) * take.clone().reshape([layers, 1, 1]);
        Self {
            query: self.query.blend(&other.query, take.clone()),
            key: self.key.blend(&other.key, take),
            distance: Param::from_tensor(distance.detach()),
        }
    }
}

/// Zero frequencies of every neuron (the full width), `[query, key][first, second][layer]`.
type Frequencies = Vec<[Vec<Vec<f32>>; 2]>;

/// The recall of every layer's predicted kept blocks on `validation`.
fn recalls<B: Backend>(
    model: &StackedQueryKey<B>,
    data: &StackedRows<B>,
    masks: &Masks<B>,
    validation: &[&BlockSamples],
    selections: &[Selection],
) -> Vec<Recall> {
    let scores: Vec<f32> = model
        .log_scores(data, masks)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 scores");
    let per_layer = data.sequences * data.blocks;
    validation
        .iter()
        .zip(selections)
        .enumerate()
        .map(|(layer, (samples, &selection))| {
            agreement(
                &scores[layer * per_layer..(layer + 1) * per_layer],
                samples,
                selection,
            )
        })
        .collect()
}

/// Epochs [`train_attention_layers`] runs at most (for a progress bar).
pub fn max_attention_epochs(rank: usize, options: &TrainOptions) -> usize {
    let mut rounds = 0;
    let mut width = rank;
    if options.prune_every > 0 && options.prune_fraction > 0.0 {
        while surviving_count(width, options.prune_fraction) < width {
            (width, rounds) = (surviving_count(width, options.prune_fraction), rounds + 1);
        }
    }
    options.epochs + rounds * options.prune_every
}

/// Trains the attention predictors (query and key scorers of `shape`) of several layers at
/// once: `train[l]`, `validation[l]` and `selections[l]` are layer `l`'s samples (the same
/// sequences for every layer) and kept-set rule. `options.epochs` full-batch Adam steps on the
/// sum of the layers' selection losses; then rounds of elastic size transformation: in each
/// layer still pruning, each hidden layer of each scorer loses the `options.prune_fraction` of
/// its surviving neurons most often zero, every layer trains `options.prune_every` more epochs,
/// and a layer keeps the round while its validation recall stays within
/// `options.recall_tolerance` of its unpruned recall (else the round is undone for that layer,
/// which stops pruning). `on_epoch` is called after every epoch.
pub fn train_attention_layers<B: AutodiffBackend>(
    train: &[&BlockSamples],
    validation: &[&BlockSamples],
    selections: &[Selection],
    shape: ScorerShape,
    options: &TrainOptions,
    device: &B::Device,
    on_epoch: &mut dyn FnMut(),
) -> Vec<TrainedBlock<B::InnerBackend>> {
    let ScorerShape { rank, components } = shape;
    let layers = train.len();
    assert!(layers > 0 && validation.len() == layers && selections.len() == layers);
    B::seed(device, options.seed);
    let hidden = train[0].hidden;
    let data = StackedRows::<B>::new(train, device);
    let validation_data = StackedRows::<B::InnerBackend>::new(validation, device);
    let (mut exact, mut labels, mut log_threshold) = (Vec::new(), Vec::new(), Vec::new());
    for (samples, selection) in train.iter().zip(selections) {
        let (e, l) = samples.targets::<B>(selection.threshold, device);
        exact.push(e);
        labels.push(l);
        log_threshold.push(log_thresholds(selection.threshold, data.sequences, device));
    }
    let (exact, labels, log_threshold) = (
        Tensor::cat(exact, 0),
        Tensor::cat(labels, 0),
        Tensor::cat(log_threshold, 0),
    );
    // Per layer: the mean over its sequences.
    let layer_losses = |model: &StackedQueryKey<B>, masks: &Masks<B>| {
        selection_loss(
            model.log_scores(&data, masks),
            exact.clone(),
            labels.clone(),
            log_threshold.clone(),
        )
        .reshape([layers, data.sequences])
        .mean_dim(1)
    };
    let mut fit = |mut model: StackedQueryKey<B>, alive: &Alive, epochs: usize| {
        let mut optimizer = AdamConfig::new().init::<B, StackedQueryKey<B>>();
        let masks = alive.masks(rank, device);
        for _ in 0..epochs {
            let loss = layer_losses(&model, &masks).sum();
            let gradients = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(options.learning_rate, model, gradients);
            on_epoch();
        }
        model
    };
    let validation_recalls = |model: &StackedQueryKey<B>, alive: &Alive| {
        recalls(
            &model.valid(),
            &validation_data,
            &alive.masks(rank, device),
            validation,
            selections,
        )
    };

    let mut alive = Alive::all(layers, rank);
    let initial = StackedQueryKey {
        query: StackedScorer::new(layers, hidden, rank, components, device),
        key: StackedScorer::new(layers, hidden, rank, components, device),
        distance: Param::from_tensor(Tensor::zeros(
            [layers, components, DISTANCE_BUCKETS],
            device,
        )),
    };
    let mut model = fit(initial, &alive, options.epochs);
    let unpruned = validation_recalls(&model, &alive);
    let mut kept = unpruned.clone();
    let mut pruning = vec![options.prune_every > 0 && options.prune_fraction > 0.0; layers];
    while pruning.iter().any(|&p| p) {
        let frequencies = model
            .valid()
            .zero_frequencies(&data.inner(), &alive.masks(rank, device));
        let proposed = alive.pruned(&frequencies, &mut pruning, options.prune_fraction);
        if !pruning.iter().any(|&p| p) {
            break;
        }
        let trained = fit(model.clone(), &proposed, options.prune_every);
        let now = validation_recalls(&trained, &proposed);
        let mut take = vec![0.0f32; layers];
        for layer in 0..layers {
            if !pruning[layer] {
                continue;
            }
            if now[layer].recall + options.recall_tolerance < unpruned[layer].recall {
                // Undone for this layer: it keeps its weights and neurons, and stops pruning.
                pruning[layer] = false;
            } else {
                take[layer] = 1.0;
                kept[layer] = now[layer];
                alive.take_layer(layer, &proposed);
            }
        }
        let take = Tensor::from_data(TensorData::new(take, [layers, 1, 1]), device);
        model = model.blend(&trained, take);
    }

    let final_losses: Vec<f64> = layer_losses(&model, &alive.masks(rank, device))
        .into_data()
        .convert::<f64>()
        .into_vec()
        .expect("f64 losses");
    let validation = Validation {
        before: unpruned,
        after: kept,
    };
    trained_blocks(
        &model.valid(),
        &alive,
        hidden,
        shape,
        &validation,
        &final_losses,
    )
}

/// Validation recalls of each layer before pruning and with its final neurons.
struct Validation {
    before: Vec<Recall>,
    after: Vec<Recall>,
}

/// Each layer's predictor cut out of the trained stack, with its surviving neurons.
fn trained_blocks<B: Backend>(
    model: &StackedQueryKey<B>,
    alive: &Alive,
    hidden: usize,
    shape: ScorerShape,
    validation: &Validation,
    final_losses: &[f64],
) -> Vec<TrainedBlock<B>> {
    let ScorerShape { rank, components } = shape;
    let distance = model.distance_log_weights();
    let params_before = 2 * Scorer::<B>::params_of(hidden, [rank, rank], components)
        + components * DISTANCE_BUCKETS;
    (0..final_losses.len())
        .map(|layer| TrainedBlock {
            predictor: QueryKey {
                query: model.query.layer(layer, alive.of_layer(0, layer)),
                key: model.key.layer(layer, alive.of_layer(1, layer)),
                distance: Param::from_tensor(
                    distance
                        .clone()
                        .narrow(0, layer, 1)
                        .reshape([components, DISTANCE_BUCKETS]),
                ),
            },
            params_before,
            validation_before: validation.before[layer],
            validation: validation.after[layer],
            final_loss: final_losses[layer],
        })
        .collect()
}
