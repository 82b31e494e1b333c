//! Token elimination (`--method lemo`) in the models: exact when every token is kept; a sparse
//! block computes the dense values but back-propagates through its kept rows only (the MLP's
//! dropped rows by recomputing its exact input gradient there); kept sets are per sequence of a
//! batch; with S2, keeping every row is LongLoRA's S2 attention.

use crate::common::{
    GradientSums, assert_same_gradients, every_token_kept, half_kept, trainable_model,
};
use burn::backend::Autodiff;
use burn::tensor::{Distribution, ElementConversion, Int, Tensor};
use lemo_kernels::{CpuBackend, LemoBackend, WgpuBackend};
use lemo_models::CausalLm;
use lemo_models::lora::LLAMA_PROJECTIONS;
use lemo_models::token_plan::{BlockRows, LayerPlan, TokenPlan, TokenSparsity};
use lemo_sparsity::KeptRows;
use lemo_sparsity::calibration::Block;
use lemo_test_support::random_tokens;

/// Loss sum and gradients of `tokens` under `sparsity`.
fn loss_and_gradients<B: burn::tensor::backend::AutodiffBackend + LemoBackend>(
    model: &CausalLm<B>,
    tokens: Tensor<B, 2, Int>,
    sparsity: &mut TokenSparsity,
) -> (f32, GradientSums<B>) {
    let (loss, _) = model.next_token_loss_sum(tokens, None, 5, sparsity);
    let mut sums = GradientSums::default();
    sums.add(model, &loss.clone().backward());
    (loss.into_scalar().elem(), sums)
}

/// The tied GQA Llama fixture with adapters, outside autodiff.
fn gqa_model<B: LemoBackend>(device: &B::Device) -> CausalLm<B> {
    let model = trainable_model::<Autodiff<B>>("llama_gqa_tied", &LLAMA_PROJECTIONS, false, device);
    burn::module::AutodiffModule::valid(&model)
}

/// With `shifted_group`, S2 attention (`longlora`) against token elimination with S2 at the kept
/// rows' positions (`lemo --s2`), which are then every position; both train the embeddings and
/// norms too, as LongLoRA's recipe does.
fn keep_all_equals_dense<B: burn::tensor::backend::AutodiffBackend + LemoBackend>(
    fixture: &str,
    targets: &[&str],
    shifted_group: Option<usize>,
    device: &B::Device,
) {
    let longlora = shifted_group.is_some();
    let mut model = trainable_model::<B>(fixture, targets, longlora, device);
    model.set_shifted_group(shifted_group);
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
        None,
        &Default::default(),
    );
    keep_all_equals_dense::<Autodiff<CpuBackend>>(
        "opt_prenorm_proj",
        &["q_proj", "v_proj", "fc1"],
        None,
        &Default::default(),
    );
}

/// `lemo --s2` keeping every row: `longlora`'s loss and gradients, the embeddings' and norms'
/// included (groups of 16 over 50 tokens: both halves end with a short group).
#[test]
fn keeping_every_token_with_s2_gives_the_longlora_loss_and_gradients() {
    keep_all_equals_dense::<Autodiff<CpuBackend>>(
        "llama_gqa_tied",
        &LLAMA_PROJECTIONS,
        Some(16),
        &Default::default(),
    );
}

/// `lemo --s2` dropping half of the blocks: the forward pass is still `longlora`'s (the kept
/// rows take the pass's S2 values at their positions), so the loss is, and gradients reach the
/// adapters through the kept rows. Groups of 32 over 64 tokens: attention blocks select within
/// half groups of four blocks of 4, two in each.
#[test]
fn dropping_tokens_with_s2_keeps_the_longlora_loss() {
    type B = Autodiff<CpuBackend>;
    let device = Default::default();
    let mut model = trainable_model::<B>("llama_gqa_tied", &LLAMA_PROJECTIONS, false, &device);
    model.set_shifted_group(Some(32));
    let [vocab, _] = model.lm_head_weight().dims();
    let tokens = random_tokens::<B>(vocab, [2, 64], &device);
    let (dense_loss, _) = loss_and_gradients(&model, tokens.clone(), &mut TokenSparsity::Dense);
    let thresholds = half_kept(&model, 4);
    let mut sparsity = TokenSparsity::select(&thresholds);
    let (sparse_loss, sparse) = loss_and_gradients(&model, tokens, &mut sparsity);
    let plan = sparsity.into_plan().unwrap();
    assert!(
        plan.keep_fraction(Block::Attention) < 1.0,
        "no block dropped"
    );
    assert!(
        (dense_loss - sparse_loss).abs() <= 1e-5 * dense_loss.abs(),
        "loss {dense_loss} (longlora) vs {sparse_loss} (lemo --s2)"
    );
    assert!(!sparse.is_zero(), "no gradient reached the adapters");
}

#[test]
fn keeping_every_token_gives_the_lora_loss_and_gradients_on_wgpu() {
    keep_all_equals_dense::<Autodiff<WgpuBackend>>(
        "llama_gqa_tied",
        &LLAMA_PROJECTIONS,
        None,
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
        attention: Some(BlockRows::from_host::<B>(
            rows(&[0..8, 24..40]),
            false,
            &device,
        )),
        mlp: Some(BlockRows::from_host::<B>(
            rows(&[0..8, 32..40]),
            true,
            &device,
        )),
    });
    let CausalLm::Llama(llama) = &model else {
        unreachable!()
    };
    use lemo_models::decoder::{Decoder, LayerRun, layer};
    let shared = llama.shared(0..40, 1, None);
    let h = llama.embed(tokens, 0..40).detach().require_grad();
    let run = |sparsity: &mut TokenSparsity| {
        layer(
            llama,
            0,
            h.clone(),
            &shared,
            None,
            sparsity,
            LayerRun::Graph,
        )
    };
    let sparse = run(&mut TokenSparsity::Replay(&plan));
    let dense = run(&mut TokenSparsity::Dense);
    let scale: f32 = dense.clone().abs().max().into_scalar().elem();
    let difference: f32 = (sparse.clone() - dense).abs().max().into_scalar().elem();
    assert!(difference <= 1e-5 * scale, "values differ by {difference}");

    // A loss on rows 8..24 reaches no adapter, and no other row of h: the attention block
    // passes those rows through the residual, the MLP block through the residual and its
    // row-wise input gradient recomputed there (which leaves its own adapters to the kept rows).
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

/// A sparse MLP block whose dropped rows are recomputed back-propagates the dense block's input
/// gradient on every row: the kept rows through its graph, the dropped rows by recomputation
/// (with the MLP's own adapters in the input gradient). The MLP must contribute measurably on
/// the dropped rows, or the residual alone would pass.
fn check_exact_dropped_rows<D: lemo_models::decoder::Decoder<Ad>>(decoder: &D, hidden: usize) {
    use lemo_models::decoder::SparseBlock;
    let device = Default::default();
    let seq = 40;
    let kept = KeptRows {
        rows: (0..8).chain(17..25).chain(33..40).collect(),
        batch: 2,
        kept: 23,
        seq,
    };
    let kept = KeptRows {
        rows: [kept.rows.clone(), (0..16).chain(33..40).collect()].concat(),
        ..kept
    };
    let a = Tensor::<Ad, 3>::random([2, seq, hidden], Distribution::Normal(0.0, 1.0), &device);
    let upstream =
        Tensor::<Ad, 3>::random([2, seq, hidden], Distribution::Normal(0.0, 1.0), &device);
    let gradient_of = |block: &dyn Fn(Tensor<Ad, 3>) -> Tensor<Ad, 3>| {
        let input = a.clone().require_grad();
        let gradients = (block(input.clone()) * upstream.clone()).sum().backward();
        input.grad(&gradients).expect("the block reads its input")
    };
    let sparse = gradient_of(&|input| {
        let pass = decoder.mlp_pass(0, input.clone(), None);
        let kept = BlockRows::from_host::<Ad>(kept.clone(), true, &device);
        decoder.mlp_block(0, input, Some(SparseBlock::new(&kept, Some(pass))))
    });
    let dense = gradient_of(&|input| decoder.mlp_block(0, input, None));
    let max = |t: Tensor<CpuBackend, 3>| -> f32 { t.abs().max().into_scalar().elem() };
    let scale = max(dense.clone());
    let through_mlp = max(dense.clone() - upstream.inner());
    assert!(
        through_mlp > 1e-2 * scale,
        "the MLP's Jacobian is too small to test ({through_mlp})"
    );
    let error = max(sparse - dense);
    assert!(
        error <= 1e-5 * scale,
        "the sparse block's input gradient differs from the dense one by {error} (of {scale})"
    );
}

#[test]
fn a_sparse_mlp_block_back_propagates_the_dense_input_gradient_on_every_row() {
    let device = Default::default();
    let model = trainable_model::<Ad>("llama_gqa_tied", &LLAMA_PROJECTIONS, false, &device);
    let CausalLm::Llama(llama) = &model else {
        unreachable!()
    };
    check_exact_dropped_rows(
        llama,
        llama.layers[0].post_attention_layernorm.weight.dims()[0],
    );

    let model = trainable_model::<Ad>("opt_prenorm_proj", &LLAMA_PROJECTIONS, false, &device);
    let CausalLm::Opt(opt) = &model else {
        unreachable!()
    };
    check_exact_dropped_rows(opt, opt.layers[0].fc2.weight.dims()[0]);
}

#[test]
fn each_sequence_of_a_batch_keeps_its_own_rows() {
    type B = CpuBackend;
    let device = Default::default();
    let model = gqa_model::<B>(&device);
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
                    let pick = |kept: &Option<BlockRows>, dropped: bool| {
                        kept.as_ref().map(|k| {
                            let k = k.to_host::<B>();
                            let own = KeptRows {
                                rows: k.rows[sequence * k.kept..(sequence + 1) * k.kept].to_vec(),
                                batch: 1,
                                ..k.clone()
                            };
                            BlockRows::from_host::<B>(own, dropped, &device)
                        })
                    };
                    LayerPlan {
                        attention: pick(&l.attention, false),
                        mlp: pick(&l.mlp, true),
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
    let differs = |kept: &Option<BlockRows>| {
        let kept = kept.as_ref().unwrap().to_host::<B>();
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
fn predicted_attention_scores_choose_a_fixed_fraction_and_the_pass_stays_exact() {
    use lemo_models::token_plan::Record;
    use lemo_predictor::{Predictors, PredictorsHeader, QueryKey};
    type B = CpuBackend;
    let device = Default::default();
    let model = gqa_model::<B>(&device);
    let [vocab, hidden] = model.lm_head_weight().dims();
    let tokens = random_tokens::<B>(vocab, [1, 96], &device);
    // Exact scores select at the mean score; predicted attention scores keep a quarter.
    let mut thresholds = half_kept(&model, 8);
    thresholds.min_keep = 0.1;
    for layer in &mut thresholds.layers {
        (layer.attention, layer.mlp, layer.attention_keep) = (Some(1.0), Some(1.0), Some(0.25));
    }
    let layers: Vec<Option<QueryKey<B>>> = (0..model.num_layers())
        .map(|_| Some(QueryKey::new(hidden, 8, 1, &device)))
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
    let mut differs_from_exact = false;
    for (layer, predictor) in layers.iter().enumerate() {
        // Each attention block kept a quarter of its blocks, the best by its predictor's
        // scores of the block input.
        let record = recorded.scores[layer].attention.as_ref().unwrap();
        let token_rows =
            Tensor::<B, 1>::from_floats(record.token_rows.as_ref().unwrap().as_slice(), &device)
                .reshape([1, 12, 8, hidden]);
        let scores = predictor.as_ref().unwrap().log_scores(token_rows).exp();
        let expected = KeptRows::select(&scores, 8, 96, f32::MAX, 0.25);
        let host = |kept: &Option<BlockRows>| kept.as_ref().map(BlockRows::to_host::<B>);
        let kept = host(&plan.layers[layer].attention).unwrap();
        assert_eq!(kept, expected, "layer {layer}");
        assert_eq!(kept.kept, 3 * 8, "layer {layer}");
        differs_from_exact |= host(&recorded.layers[layer].attention) != Some(kept);
        // The MLP blocks selected from their exact scores, and recorded no token rows.
        assert_eq!(
            host(&plan.layers[layer].mlp),
            host(&recorded.layers[layer].mlp)
        );
        let mlp = recorded.scores[layer].mlp.as_ref().unwrap();
        assert!(mlp.token_rows.is_none(), "layer {layer}");
    }
    assert!(
        differs_from_exact,
        "the predictors chose the exact rows everywhere"
    );
}

#[test]
fn a_query_stride_scores_attention_blocks_over_the_sampled_rows_alone() {
    use lemo_models::token_plan::Record;
    type B = CpuBackend;
    let device = Default::default();
    let model = gqa_model::<B>(&device);
    let [vocab, _] = model.lm_head_weight().dims();
    let tokens = random_tokens::<B>(vocab, [1, 96], &device);
    let thresholds = half_kept(&model, 8);
    let scores = |query_stride| {
        let mut recording =
            TokenSparsity::recording(&thresholds, Record::Scores).with_query_stride(query_stride);
        model.hidden_states(tokens.clone(), None, &mut recording);
        recording.into_plan().unwrap().scores
    };
    let (exact, sampled) = (scores(1), scores(4));
    // A block pair's largest score among a quarter of its query rows is at most its largest
    // among all of them, and a key block averages over the same query blocks either way.
    let mut lower_somewhere = false;
    for (layer, (exact, sampled)) in exact.iter().zip(&sampled).enumerate() {
        let attention =
            |s: &lemo_models::token_plan::LayerScores| s.attention.as_ref().unwrap().scores.clone();
        for (e, s) in attention(exact).iter().zip(attention(sampled)) {
            assert!(
                s <= e + 1e-6 * e.abs(),
                "layer {layer}: sampled {s} over exact {e}"
            );
            lower_somewhere |= s < e - 1e-6 * e.abs();
        }
        // The MLP blocks' scores read no queries.
        let mlp = |s: &lemo_models::token_plan::LayerScores| s.mlp.as_ref().unwrap().scores.clone();
        assert_eq!(mlp(exact), mlp(sampled), "layer {layer}");
    }
    assert!(lower_somewhere, "the sampled scores equal the exact ones");
}

/// The MLP pass of a layer whose graph is rebuilt later runs over slices of whole token blocks:
/// its output and scores are the whole pass's. 45 rows in blocks of 8 with slices of 20 rows:
/// slices of two blocks, the last one partial.
fn check_pass_by_slices<D: lemo_models::decoder::Decoder<CpuBackend>>(decoder: &D, hidden: usize) {
    use lemo_models::decoder::mlp_pass_by_slices;
    use lemo_sparsity::informativeness::BlockScoring;
    let a = Tensor::<CpuBackend, 3>::random(
        [2, 45, hidden],
        Distribution::Normal(0.0, 1.0),
        &Default::default(),
    );
    let scoring = Some(BlockScoring::exact(8));
    let sliced = mlp_pass_by_slices(decoder, 0, a.clone(), scoring, 20);
    let whole = decoder.mlp_pass(0, a, scoring);
    let max = |t: Tensor<CpuBackend, 3>| -> f32 { t.abs().max().into_scalar().elem() };
    let difference = max(sliced.output - whole.output.clone());
    assert!(
        difference <= 1e-5 * max(whole.output),
        "outputs differ by {difference}"
    );
    let [sliced, whole] = [sliced.scores, whole.scores].map(|s| s.expect("scored").unsqueeze());
    assert_eq!(sliced.dims(), [1, 2, 6]);
    let difference = max(sliced - whole.clone());
    assert!(
        difference <= 1e-5 * max(whole),
        "scores differ by {difference}"
    );
}

#[test]
fn an_mlp_pass_by_slices_gives_the_whole_pass() {
    let device = Default::default();
    let CausalLm::Llama(llama) = gqa_model::<CpuBackend>(&device) else {
        unreachable!()
    };
    check_pass_by_slices(
        &llama,
        llama.layers[0].post_attention_layernorm.weight.dims()[0],
    );
    let model = trainable_model::<Ad>("opt_prenorm_proj", &["q_proj", "fc1"], false, &device);
    let CausalLm::Opt(opt) = burn::module::AutodiffModule::valid(&model) else {
        unreachable!()
    };
    check_pass_by_slices(&opt, opt.layers[0].fc2.weight.dims()[0]);
}
