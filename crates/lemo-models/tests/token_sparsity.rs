//! Token elimination (`--method lemo`) in the models: exact when every token is kept; a sparse
//! block computes the dense values but back-propagates through its kept rows only (the MLP's
//! dropped rows through a linear stand-in); kept sets are per sequence of a batch.

mod common;

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, ElementConversion, Int, Tensor};
use common::{GradientSums, assert_same_gradients, every_token_kept, half_kept, trainable_model};
use lemo_kernels::{CpuBackend, LemoBackend, WgpuBackend};
use lemo_models::CausalLm;
use lemo_models::lora::LLAMA_PROJECTIONS;
use lemo_models::token_plan::{LayerPlan, TokenPlan, TokenSparsity};
use lemo_sparsity::KeptRows;
use lemo_sparsity::calibration::Block;

fn random_tokens<B: Backend>(
    model_vocab: usize,
    shape: [usize; 2],
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    Tensor::random(
        shape,
        Distribution::Uniform(0.0, model_vocab as f64),
        device,
    )
}

/// Loss sum and gradients of `tokens` under `sparsity`.
fn loss_and_gradients<B: burn::tensor::backend::AutodiffBackend + LemoBackend>(
    model: &CausalLm<B>,
    tokens: Tensor<B, 2, Int>,
    sparsity: &mut TokenSparsity,
) -> (f32, GradientSums<B>) {
    let (loss, _) = model.next_token_loss_sum(tokens, 5, sparsity);
    let mut sums = GradientSums::default();
    sums.add(model, &loss.clone().backward());
    (loss.into_scalar().elem(), sums)
}

fn keep_all_equals_dense<B: burn::tensor::backend::AutodiffBackend + LemoBackend>(
    fixture: &str,
    targets: &[&str],
    device: &B::Device,
) {
    let model = trainable_model::<B>(fixture, targets, false, device);
    let [vocab, _] = model.lm_head_weight().dims();
    let tokens = random_tokens::<B>(vocab, [2, 50], device);
    let (dense_loss, dense) = loss_and_gradients(&model, tokens.clone(), &mut TokenSparsity::Dense);
    let thresholds = every_token_kept(&model, 16);
    let mut sparsity = TokenSparsity::select(&thresholds);
    let (sparse_loss, sparse) = loss_and_gradients(&model, tokens, &mut sparsity);
    let plan = sparsity.into_plan().unwrap();
    assert_eq!(plan.keep_fraction(Block::Attention), 1.0);
    assert!(
        plan.layers
            .iter()
            .all(|l| l.attention.is_some() && l.mlp.is_some())
    );
    assert!(
        (dense_loss - sparse_loss).abs() <= 1e-5 * dense_loss.abs(),
        "loss {dense_loss} (lora) vs {sparse_loss} (lemo keeping every token)"
    );
    assert_same_gradients(dense, sparse, 1e-4);
}

#[test]
fn keeping_every_token_gives_the_lora_loss_and_gradients_on_the_cpu() {
    keep_all_equals_dense::<Autodiff<CpuBackend>>(
        "llama_gqa_tied",
        &LLAMA_PROJECTIONS,
        &Default::default(),
    );
    keep_all_equals_dense::<Autodiff<CpuBackend>>(
        "opt_prenorm_proj",
        &["q_proj", "v_proj", "fc1"],
        &Default::default(),
    );
}

#[test]
fn keeping_every_token_gives_the_lora_loss_and_gradients_on_wgpu() {
    keep_all_equals_dense::<Autodiff<WgpuBackend>>(
        "llama_gqa_tied",
        &LLAMA_PROJECTIONS,
        &Default::default(),
    );
}

#[test]
fn a_sparse_layer_computes_the_dense_values_and_back_propagates_through_its_kept_rows() {
    type B = Autodiff<CpuBackend>;
    let device = Default::default();
    let model = trainable_model::<B>("llama_gqa_tied", &LLAMA_PROJECTIONS, false, &device);
    let [vocab, _] = model.lm_head_weight().dims();
    let tokens = random_tokens::<B>(vocab, [1, 40], &device);
    // Layer 0 keeps rows 0..8 and 24..40 in attention, 0..8 and 32..40 in the MLP. Rows 8..24
    // are kept by neither block.
    let mut plan = TokenPlan::default();
    let rows = |ranges: &[std::ops::Range<u32>]| KeptRows {
        rows: ranges.iter().flat_map(|r| r.clone()).collect(),
        batch: 1,
        kept: ranges.iter().map(|r| r.len()).sum(),
        seq: 40,
    };
    plan.layers.push(LayerPlan {
        attention: Some(rows(&[0..8, 24..40])),
        mlp: Some(rows(&[0..8, 32..40])),
    });
    let CausalLm::Llama(llama) = &model else {
        unreachable!()
    };
    use lemo_models::decoder::{Decoder, layer};
    let shared = llama.shared(0..40, 1);
    let h = llama.embed(tokens, 0..40).detach().require_grad();
    let run = |sparsity: &mut TokenSparsity| layer(llama, 0, h.clone(), &shared, None, sparsity);
    let sparse = run(&mut TokenSparsity::Replay(&plan));
    let dense = run(&mut TokenSparsity::Dense);
    let scale: f32 = dense.clone().abs().max().into_scalar().elem();
    let difference: f32 = (sparse.clone() - dense).abs().max().into_scalar().elem();
    assert!(difference <= 1e-5 * scale, "values differ by {difference}");

    // A loss on rows 8..24 reaches no adapter, and no other row of h: the attention block
    // passes those rows through the residual, the MLP block through the residual and its
    // row-wise stand-in for the dropped rows' Jacobian.
    let gradients = sparse.clone().slice([0..1, 8..24]).sum().backward();
    let grad_h = h.grad(&gradients).expect("h is a leaf of the graph");
    let outside: f32 = (grad_h.clone().slice([0..1, 0..8]).abs().max()
        + grad_h.slice([0..1, 24..40]).abs().max())
    .into_scalar()
    .elem();
    assert_eq!(outside, 0.0, "a dropped row's gradient reached another row");
    let mut sums = GradientSums::default();
    sums.add(&model, &gradients);
    assert!(
        sums.is_zero(),
        "an adapter got a gradient from dropped rows"
    );

    // A loss on rows 24..32 (kept by the attention block only) reaches the adapters (a fresh
    // graph: a backward pass consumes its graph).
    let sparse = run(&mut TokenSparsity::Replay(&plan));
    let gradients = sparse.slice([0..1, 24..32]).sum().backward();
    let mut sums = GradientSums::default();
    sums.add(&model, &gradients);
    assert!(
        !sums.is_zero(),
        "a kept row's loss did not reach the adapters"
    );
}

type Ad = Autodiff<CpuBackend>;

/// `x W^T + bias` of a model's projection, written out.
fn project(x: Tensor<Ad, 3>, linear: &lemo_models::lora::Linear<Ad>) -> Tensor<Ad, 3> {
    let y = x.matmul(linear.weight.val().transpose().unsqueeze());
    match &linear.bias {
        Some(bias) => y + bias.val().unsqueeze::<3>(),
        None => y,
    }
}

/// `1 / sqrt(mean(x^2) + eps)` of each row, outside the graph.
fn held_inverse_rms(x: Tensor<Ad, 3>, eps: f64) -> Tensor<Ad, 3> {
    x.detach()
        .square()
        .mean_dim(2)
        .add_scalar(eps)
        .sqrt()
        .recip()
}

/// With one row dropped, the mean activation slopes over the dropped rows are that row's own, so
/// the MLP block's stand-in there must equal the block's Jacobian with the norm's scale held
/// (`held_scale_block`, the block written out with its norm's `1/rms` or `1/std` outside the
/// graph); the kept rows' gradients must equal the dense block's.
fn check_lone_dropped_row<D: lemo_models::decoder::Decoder<Ad>>(
    decoder: &D,
    hidden: usize,
    held_scale_block: impl Fn(Tensor<Ad, 3>) -> Tensor<Ad, 3>,
) {
    use lemo_models::decoder::SparseBlock;
    let device = Default::default();
    let (seq, dropped) = (40, 21);
    let a = Tensor::<Ad, 3>::random([1, seq, hidden], Distribution::Normal(0.0, 1.0), &device);
    let upstream =
        Tensor::<Ad, 3>::random([1, seq, hidden], Distribution::Normal(0.0, 1.0), &device);
    let kept: Vec<i64> = (0..seq as i64).filter(|&r| r != dropped as i64).collect();
    let rows = Tensor::<Ad, 1, Int>::from_data(kept.as_slice(), &device).reshape([1, seq - 1]);
    let gradient_of = |block: &dyn Fn(Tensor<Ad, 3>) -> Tensor<Ad, 3>| {
        let input = a.clone().require_grad();
        let gradients = (block(input.clone()) * upstream.clone()).sum().backward();
        input.grad(&gradients).expect("the block reads its input")
    };
    let sparse_gradient = gradient_of(&|input| {
        let pass = decoder.mlp_pass(0, input.clone(), None);
        let sparse = SparseBlock {
            rows: rows.clone(),
            pass,
            dropped_rows: Default::default(),
        };
        decoder.mlp_block(0, input, Some(sparse))
    });
    let dense_gradient = gradient_of(&|input| decoder.mlp_block(0, input, None));
    let held_gradient = gradient_of(&held_scale_block);

    let max = |t: Tensor<CpuBackend, 3>| -> f32 { t.abs().max().into_scalar().elem() };
    let rows_of =
        |t: &Tensor<CpuBackend, 3>, range: std::ops::Range<usize>| t.clone().slice([0..1, range]);
    let kept_error = [0..dropped, dropped + 1..seq]
        .map(
            |range| max(rows_of(&sparse_gradient, range.clone()) - rows_of(&dense_gradient, range)),
        )
        .into_iter()
        .fold(0.0, f32::max);
    let scale = max(dense_gradient.clone());
    assert!(
        kept_error <= 1e-5 * scale,
        "kept rows' gradients differ by {kept_error}"
    );
    let lone = dropped..dropped + 1;
    let through_mlp =
        max(rows_of(&held_gradient, lone.clone()) - rows_of(&upstream.inner(), lone.clone()));
    assert!(
        through_mlp > 1e-2 * scale,
        "the MLP's Jacobian is too small to test ({through_mlp})"
    );
    let stand_in_error =
        max(rows_of(&sparse_gradient, lone.clone()) - rows_of(&held_gradient, lone));
    assert!(
        stand_in_error <= 1e-4 * through_mlp,
        "the dropped row's gradient differs from the held-scale Jacobian by {stand_in_error} (of {through_mlp})"
    );
}

#[test]
fn the_mlp_stand_in_on_a_lone_dropped_row_is_its_jacobian_with_the_norm_scale_held() {
    use burn::tensor::activation::{relu, silu};
    let device = Default::default();
    let model = trainable_model::<Ad>("llama_gqa_tied", &LLAMA_PROJECTIONS, false, &device);
    let CausalLm::Llama(llama) = &model else {
        unreachable!()
    };
    let layer = &llama.layers[0];
    let (norm, mlp) = (&layer.post_attention_layernorm, &layer.mlp);
    check_lone_dropped_row(llama, norm.weight.dims()[0], |a| {
        let x =
            a.clone() * held_inverse_rms(a.clone(), norm.eps) * norm.weight.val().unsqueeze::<3>();
        let activations = silu(project(x.clone(), &mlp.gate_proj)) * project(x, &mlp.up_proj);
        a + project(activations, &mlp.down_proj)
    });

    let model = trainable_model::<Ad>("opt_prenorm_proj", &LLAMA_PROJECTIONS, false, &device);
    let CausalLm::Opt(opt) = &model else {
        unreachable!()
    };
    let layer = &opt.layers[0];
    let norm = &layer.final_layer_norm;
    let hidden = layer.fc2.weight.dims()[0];
    check_lone_dropped_row(opt, hidden, |a| {
        let centered = a.clone() - a.clone().mean_dim(2);
        let mut x = centered.clone() * held_inverse_rms(centered, norm.eps);
        if let Some(weight) = &norm.weight {
            x = x * weight.val().unsqueeze::<3>();
        }
        if let Some(bias) = &norm.bias {
            x = x + bias.val().unsqueeze::<3>();
        }
        a + project(relu(project(x, &layer.fc1)), &layer.fc2)
    });
}

#[test]
fn each_sequence_of_a_batch_keeps_its_own_rows() {
    type B = CpuBackend;
    let device = Default::default();
    let model =
        trainable_model::<Autodiff<B>>("llama_gqa_tied", &LLAMA_PROJECTIONS, false, &device);
    let model = burn::module::AutodiffModule::valid(&model);
    let [vocab, _] = model.lm_head_weight().dims();
    // Twelve token blocks per sequence: each block keeps the first, the last and four of the
    // ten between, so two sequences keep the same rows everywhere only by a rare accident.
    let tokens = random_tokens::<B>(vocab, [2, 96], &device);
    let thresholds = half_kept(&model, 8);
    let mut sparsity = TokenSparsity::select(&thresholds);
    let hidden = model.hidden_states(tokens.clone(), None, &mut sparsity);
    let plan = sparsity.into_plan().unwrap();
    assert!((plan.keep_fraction(Block::Mlp) - 0.5).abs() < 1e-9);
    // Each sequence alone, replaying its own rows of the batch's plan.
    for sequence in 0..2 {
        let own = TokenPlan {
            layers: plan
                .layers
                .iter()
                .map(|l| {
                    let pick = |kept: &Option<KeptRows>| {
                        kept.as_ref().map(|k| KeptRows {
                            rows: k.rows[sequence * k.kept..(sequence + 1) * k.kept].to_vec(),
                            batch: 1,
                            ..k.clone()
                        })
                    };
                    LayerPlan {
                        attention: pick(&l.attention),
                        mlp: pick(&l.mlp),
                    }
                })
                .collect(),
            ..TokenPlan::default()
        };
        let alone = model.hidden_states(
            tokens.clone().narrow(0, sequence, 1),
            None,
            &mut TokenSparsity::Replay(&own),
        );
        let batched = hidden.clone().narrow(0, sequence, 1);
        let scale: f32 = alone.clone().abs().max().into_scalar();
        let difference: f32 = (alone - batched).abs().max().into_scalar();
        assert!(
            difference <= 1e-5 * scale,
            "sequence {sequence}: {difference}"
        );
    }
    // The two sequences' token blocks differ, so at least one block keeps different rows.
    let differs = |kept: &Option<KeptRows>| {
        let kept = kept.as_ref().unwrap();
        kept.rows[..kept.kept] != kept.rows[kept.kept..]
    };
    assert!(
        plan.layers
            .iter()
            .any(|l| differs(&l.attention) || differs(&l.mlp)),
        "both sequences kept the same rows in every block"
    );
}

#[test]
fn predicted_scores_choose_the_kept_rows_and_the_pass_stays_exact() {
    use lemo_models::token_plan::Record;
    use lemo_predictor::{BlockPredictor, LayerPredictors, Predictors, PredictorsHeader};
    type B = CpuBackend;
    let device = Default::default();
    let model =
        trainable_model::<Autodiff<B>>("llama_gqa_tied", &LLAMA_PROJECTIONS, false, &device);
    let model = burn::module::AutodiffModule::valid(&model);
    let [vocab, hidden] = model.lm_head_weight().dims();
    let tokens = random_tokens::<B>(vocab, [1, 96], &device);
    let thresholds = half_kept(&model, 8);
    let layers: Vec<LayerPredictors<B>> = (0..model.num_layers())
        .map(|_| LayerPredictors {
            attention: Some(BlockPredictor::untrained(
                Block::Attention,
                hidden,
                8,
                &device,
            )),
            mlp: Some(BlockPredictor::untrained(Block::Mlp, hidden, 8, &device)),
        })
        .collect();
    let predictors = Predictors::new(PredictorsHeader::new(thresholds.clone(), 8), &layers);

    let mut predicted = TokenSparsity::predicted(&thresholds, &predictors);
    let sparse = model.hidden_states(tokens.clone(), None, &mut predicted);
    let plan = predicted.into_plan().unwrap();
    let mut recording = TokenSparsity::recording(
        &thresholds,
        Record::ScoresAndTokenRows {
            tokens_per_block: 8,
        },
    );
    let dense = model.hidden_states(tokens, None, &mut recording);
    let recorded = recording.into_plan().unwrap();

    // The forward pass is exact whatever the scores.
    let scale: f32 = dense.clone().abs().max().into_scalar();
    let difference: f32 = (sparse - dense).abs().max().into_scalar();
    assert!(difference <= 1e-5 * scale, "{difference}");
    // Each block kept what its predictor's scores of the block input select.
    let mut differs_from_exact = false;
    for (layer, predictor) in layers.iter().enumerate() {
        for block in [Block::Attention, Block::Mlp] {
            let record = recorded.scores[layer].block(block).unwrap();
            let token_rows = Tensor::<B, 1>::from_floats(
                record.token_rows.as_ref().unwrap().as_slice(),
                &device,
            )
            .reshape([1, 12, 8, hidden]);
            let scores = predictor.block(block).unwrap().log_scores(token_rows).exp();
            let expected = KeptRows::select(&scores, 8, 96, f32::MAX, 0.5);
            let kept = plan.layers[layer].block(block).unwrap();
            assert_eq!(kept, &expected, "layer {layer} {block:?}");
            differs_from_exact |= recorded.layers[layer].block(block) != Some(kept);
        }
    }
    assert!(
        differs_from_exact,
        "the predictors chose the exact rows everywhere"
    );
}

/// The predictors' MLP sketch reads the MLP through `mlp_input_map` (norm folded into the
/// projections); over every channel it must give the scores the MLP pass itself computes.
#[test]
fn the_mlp_input_map_over_every_channel_gives_the_exact_mlp_scores() {
    use lemo_models::token_plan::Record;
    type B = CpuBackend;
    let device = Default::default();
    for fixture in ["llama_gqa_tied", "opt_prenorm_proj"] {
        let model = trainable_model::<Autodiff<B>>(fixture, &["q_proj"], false, &device);
        let model = burn::module::AutodiffModule::valid(&model);
        let [vocab, _] = model.lm_head_weight().dims();
        let tokens = random_tokens::<B>(vocab, [1, 64], &device);
        let thresholds = half_kept(&model, 8);
        let mut recording = TokenSparsity::recording(
            &thresholds,
            Record::ScoresAndTokenRows {
                tokens_per_block: 8,
            },
        );
        model.hidden_states(tokens, None, &mut recording);
        let recorded = recording.into_plan().unwrap();
        for layer in 0..model.num_layers() {
            let record = recorded.scores[layer].block(Block::Mlp).unwrap();
            // The MLP's width, not the output projection's (OPT may project out).
            let map = model.mlp_input_map(layer).unwrap();
            let hidden = map.hidden();
            let token_rows = record.token_rows.as_ref().unwrap();
            let blocks = record.scores.len();
            let tokens = token_rows.len() / (blocks * hidden);
            let rows = Tensor::<B, 1>::from_floats(token_rows.as_slice(), &device)
                .reshape([1, blocks, tokens, hidden]);
            let channels = map.channels();
            let sketch = map.sketch(&(0..channels).collect::<Vec<_>>());
            // The sketch weighs every channel 1: its score is `channels` times the mean.
            let sketched: Vec<f32> = (sketch.forward(rows).exp() / channels as f32)
                .into_data()
                .to_vec()
                .unwrap();
            for (got, exact) in sketched.iter().zip(&record.scores) {
                assert!(
                    (got - exact).abs() <= 1e-3 * exact.abs(),
                    "{fixture} layer {layer}: {got} vs {exact} ({sketched:?} vs {:?})",
                    record.scores
                );
            }
        }
    }
}
