//! Loss and gradients against PyTorch autograd through transformers + PEFT
//! (`fixtures/gradients`, written by `make_gradients.py`): LoRA on the attention projections and
//! on all seven, LeMo's token-sparse graph replaying fixed kept rows, and LongLoRA (S2 attention,
//! trainable embeddings and norms). Each case loads the adapter PEFT saved onto the transformers
//! fixture it was made on, and checks the plain backward pass and the recomputing one
//! (per-layer activation checkpointing), in f32, within 1e-4 of each gradient's largest value;
//! the GQA case also split over sequence groups of 2 and 4 ranks (context parallelism, ranks on
//! threads), whose loss and gradients summed over the ranks are the whole sequence's, and whose
//! attention token-block scores assembled from the ranks are the whole sequence's.
//! Every trainable tensor must have an expected gradient and every expected gradient must be
//! found, so a parameter trained on one side only fails too.

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier, Mutex};

use burn::backend::Autodiff;
use burn::module::Param;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use lemo_kernels::exchange::{Exchange, RowExchange};
use lemo_kernels::precision::Precision;
use lemo_kernels::{CpuBackend, LemoBackend, WgpuBackend};
use lemo_models::CausalLm;
use lemo_models::activation_plan::{ActivationPlan, LayerActivations};
use lemo_models::loss::Batch;
use lemo_models::sequence_split::SequenceSplit;
use lemo_models::token_plan::{BlockRows, LayerPlan, TokenPlan, TokenSparsity};
use lemo_sparsity::calibration::Block;
use lemo_sparsity::informativeness::{self, BlockScoring};
use lemo_sparsity::{KeptRows, LayerThresholds, Thresholds};
use lemo_test_support::files::HostTensor;
use lemo_test_support::{
    assert_close, assert_close_scalar, assert_close_values, gradient_fixture, hf_fixture, random,
    read_json, read_safetensors, seed_backend,
};

/// f32 on both sides, summed in different orders.
const TOLERANCE: f64 = 1e-4;
/// Rows per chunk of the segment-based loss (no divisor of the cases' lengths).
const CHUNK_ROWS: usize = 7;
/// The prefix of PEFT's saved names.
const PEFT: &str = "base_model.model";

/// What PyTorch computed for one case.
struct Expected {
    tokens: HostTensor,
    /// The kept rows of the token-sparse case.
    plan: Option<TokenPlan>,
    loss_sum: f64,
    /// By PEFT name (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`).
    gradients: BTreeMap<String, HostTensor>,
}

/// The fixture model with the case's adapter, trainable extras and attention, and what PyTorch
/// computed.
fn load<B: LemoBackend>(case: &str, device: &B::Device) -> (CausalLm<B>, Expected) {
    let dir = gradient_fixture(case);
    let description = read_json(&dir.join("case.json"));
    let base = hf_fixture(description["base"].as_str().unwrap());
    let (model, _) = CausalLm::<B>::from_path(&base, device, Precision::F32).unwrap();
    let (model, mut config) = model.load_adapter(&dir).unwrap();
    // LongLoRA's extras train from the base weights: the adapter holds only LoRA.
    config.train_embeddings = description["train_embeddings"].as_bool().unwrap();
    config.train_norms = description["train_norms"].as_bool().unwrap();
    let mut model = model.set_extra_trainable(&config).unwrap();
    model.set_shifted_group(description["s2_group"].as_u64().map(|g| g as usize));

    let mut tensors = read_safetensors(&dir.join("expected.safetensors"));
    let plan = token_plan::<B>(&tensors, model.num_layers(), device);
    let expected = Expected {
        tokens: tensors.remove("input_ids").expect("input_ids"),
        plan,
        loss_sum: tensors["loss_sum"].values[0],
        gradients: tensors
            .into_iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("grad.")?.to_string(), v)))
            .collect(),
    };
    (model, expected)
}

/// The fixture's kept rows (`kept.{layer}.{attention|mlp}`, `[batch, kept]`), if any: a block
/// without them is dense. An MLP block's dropped rows pass back their exact input gradient, as
/// in the fixture.
fn token_plan<B: LemoBackend>(
    tensors: &BTreeMap<String, HostTensor>,
    layers: usize,
    device: &B::Device,
) -> Option<TokenPlan> {
    let seq = tensors["input_ids"].shape[1];
    let kept = |layer: usize, block: &str| {
        tensors.get(&format!("kept.{layer}.{block}")).map(|t| {
            let rows = KeptRows {
                rows: t.to_i64().into_iter().map(|r| r as u32).collect(),
                batch: t.shape[0],
                kept: t.shape[1],
                seq,
            };
            BlockRows::from_host::<B>(rows, block == "mlp", device)
        })
    };
    let layers: Vec<LayerPlan> = (0..layers)
        .map(|l| LayerPlan {
            attention: kept(l, "attention"),
            mlp: kept(l, "mlp"),
        })
        .collect();
    let sparse = layers
        .iter()
        .any(|l| l.attention.is_some() || l.mlp.is_some());
    sparse.then(|| TokenPlan {
        layers,
        ..TokenPlan::default()
    })
}

/// The gradient in `gradients` of a trainable `param`, if the backward pass reached it.
fn gradient<B: AutodiffBackend, const D: usize>(
    param: &Param<Tensor<B, D>>,
    gradients: &B::Gradients,
) -> Option<Vec<f32>> {
    let value = param.val();
    if !value.is_require_grad() {
        return None;
    }
    let grad = value.grad(gradients)?;
    Some(grad.into_data().convert::<f32>().into_vec().unwrap())
}

/// Adds the gradient in `gradients` of every trainable tensor of `model` to `into`, by PEFT
/// name (a partial backward pass reaches some of them).
fn add_gradients<B: AutodiffBackend + LemoBackend>(
    model: &CausalLm<B>,
    gradients: &B::Gradients,
    into: &mut BTreeMap<String, Vec<f32>>,
) {
    let mut add = |name: String, grad: Option<Vec<f32>>| {
        if let Some(grad) = grad {
            let sum = into
                .entry(format!("{PEFT}.{name}"))
                .or_insert_with(|| vec![0.0; grad.len()]);
            sum.iter_mut().zip(grad).for_each(|(s, g)| *s += g);
        }
    };
    let mut model = model.clone();
    for (name, linear) in model.projections_mut() {
        if let Some(lora) = &linear.lora {
            add(
                format!("{name}.lora_A.weight"),
                gradient(&lora.a, gradients),
            );
            add(
                format!("{name}.lora_B.weight"),
                gradient(&lora.b, gradients),
            );
        }
    }
    let CausalLm::Llama(llama) = &model else {
        return;
    };
    let embedding = gradient(&llama.embed_tokens, gradients);
    add("model.embed_tokens.weight".into(), embedding);
    for (i, layer) in llama.layers.iter().enumerate() {
        let input = gradient(&layer.input_layernorm.weight, gradients);
        add(format!("model.layers.{i}.input_layernorm.weight"), input);
        let post = gradient(&layer.post_attention_layernorm.weight, gradients);
        add(
            format!("model.layers.{i}.post_attention_layernorm.weight"),
            post,
        );
    }
    add(
        "model.norm.weight".into(),
        gradient(&llama.norm.weight, gradients),
    );
}

fn compare(pass: &str, loss_sum: f64, found: &BTreeMap<String, Vec<f32>>, expected: &Expected) {
    assert_close_scalar(
        &format!("{pass}: loss sum"),
        loss_sum,
        expected.loss_sum,
        1e-5,
    );
    let names = |m: Vec<&String>| m.into_iter().cloned().collect::<Vec<_>>();
    assert_eq!(
        names(found.keys().collect()),
        names(expected.gradients.keys().collect()),
        "{pass}: the tensors that got a gradient differ from PyTorch's trainable ones"
    );
    for (name, gradient) in found {
        let reference = &expected.gradients[name];
        assert_close_values(
            &format!("{pass}: d {name}"),
            gradient,
            &reference.to_f32(),
            TOLERANCE,
        );
    }
}

fn check<B: AutodiffBackend + LemoBackend>(case: &str, device: &B::Device)
where
    B::InnerBackend: LemoBackend,
{
    let (model, expected) = load::<B>(case, device);
    let tokens = Tensor::<B, 2, Int>::from_data(
        TensorData::new(expected.tokens.to_i64(), expected.tokens.shape.clone()),
        device,
    );
    let sparsity = || match &expected.plan {
        Some(plan) => TokenSparsity::Replay(plan),
        None => TokenSparsity::Dense,
    };

    let (loss, _) = model.next_token_loss_sum(tokens.clone(), None, CHUNK_ROWS, &mut sparsity());
    let mut found = BTreeMap::new();
    add_gradients(&model, &loss.clone().backward(), &mut found);
    let loss_sum: f32 = loss.into_scalar().elem();
    compare("plain", loss_sum as f64, &found, &expected);

    let mut found = BTreeMap::new();
    let recompute_every_layer =
        ActivationPlan::uniform(LayerActivations::Recomputed, model.num_layers());
    let (loss, _) = model.next_token_loss_backward_planned(
        Batch::new(tokens, None),
        CHUNK_ROWS,
        1.0,
        &mut sparsity(),
        &recompute_every_layer,
        &mut |gradients| add_gradients(&model, gradients, &mut found),
    );
    let loss_sum: f32 = loss.into_scalar().elem();
    compare("recomputed", loss_sum as f64, &found, &expected);
}

#[test]
fn lora_on_attention_with_grouped_query_heads_matches_pytorch() {
    check::<Autodiff<CpuBackend>>("lora_gqa", &Default::default());
}

#[test]
fn lora_on_every_projection_with_biases_and_f16_weights_matches_pytorch() {
    check::<Autodiff<CpuBackend>>("lora_all_bias_f16", &Default::default());
}

#[test]
fn token_sparse_kept_rows_graph_matches_pytorch() {
    check::<Autodiff<CpuBackend>>("token_sparse", &Default::default());
}

#[test]
fn longlora_s2_with_trainable_embeddings_and_norms_matches_pytorch() {
    check::<Autodiff<CpuBackend>>("longlora_s2", &Default::default());
}

/// The kernels' path (flash attention, fused norms, gather and scatter-add) on wgpu.
#[test]
fn token_sparse_kept_rows_graph_matches_pytorch_on_wgpu() {
    check::<Autodiff<WgpuBackend>>("token_sparse", &Default::default());
}

/// A sequence group whose ranks are threads: each collective is a rendezvous on shared slots.
struct ThreadGroup {
    barrier: Barrier,
    slots: Mutex<Vec<Vec<f32>>>,
}

struct ThreadRank {
    group: Arc<ThreadGroup>,
    rank: usize,
    ranks: usize,
}

impl ThreadRank {
    /// Every rank's `values`, in rank order.
    fn exchange(&self, values: Vec<f32>) -> Vec<Vec<f32>> {
        self.group.slots.lock().unwrap()[self.rank] = values;
        self.group.barrier.wait();
        let all = self.group.slots.lock().unwrap().clone();
        self.group.barrier.wait();
        all
    }
}

impl RowExchange for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn ranks(&self) -> usize {
        self.ranks
    }

    fn all_gather(&self, local: Vec<f32>) -> Vec<f32> {
        self.exchange(local).concat()
    }

    fn reduce_scatter(&self, full: Vec<f32>) -> Vec<f32> {
        let share = full.len() / self.ranks;
        let all = self.exchange(full);
        (self.rank * share..(self.rank + 1) * share)
            .map(|i| all.iter().map(|values| values[i]).sum())
            .collect()
    }

    fn barrier(&self) {
        self.group.barrier.wait();
    }
}

/// What one rank of a split pass found: its loss sum, its gradients by PEFT name, and the plan
/// its token sparsity chose.
type RankResult = (f64, BTreeMap<String, Vec<f32>>, Option<TokenPlan>);

/// The GQA case's `tokens` split zig-zag over `ranks` threads, each with its own copy of the
/// model, every layer `mode`, each block on the rows `thresholds` select (dense without):
/// each rank's loss sum, gradients and plan.
fn run_split(
    ranks: usize,
    tokens: &HostTensor,
    mode: LayerActivations,
    thresholds: Option<&Thresholds>,
) -> Vec<RankResult> {
    type B = Autodiff<CpuBackend>;
    let group = Arc::new(ThreadGroup {
        barrier: Barrier::new(ranks),
        slots: Mutex::new(vec![Vec::new(); ranks]),
    });
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..ranks)
            .map(|rank| {
                let group = group.clone();
                scope.spawn(move || {
                    let device = Default::default();
                    let (model, _) = load::<B>("lora_gqa", &device);
                    let tokens = Tensor::<B, 2, Int>::from_data(
                        TensorData::new(tokens.to_i64(), tokens.shape.clone()),
                        &device,
                    );
                    let exchange = Exchange(Arc::new(ThreadRank { group, rank, ranks }));
                    let split = SequenceSplit::zigzag(tokens.dims()[1], exchange).unwrap();
                    let batch = Batch {
                        split: Some(split),
                        ..Batch::new(tokens, None)
                    };
                    let mut sparsity =
                        thresholds.map_or(TokenSparsity::Dense, TokenSparsity::select);
                    let plan = ActivationPlan::uniform(mode, model.num_layers());
                    let mut found = BTreeMap::new();
                    let (loss, _) = model.next_token_loss_backward_planned(
                        batch,
                        CHUNK_ROWS,
                        1.0,
                        &mut sparsity,
                        &plan,
                        &mut |gradients| add_gradients(&model, gradients, &mut found),
                    );
                    let loss_sum: f32 = loss.into_scalar().elem();
                    (loss_sum as f64, found, sparsity.into_plan())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The loss sums and gradients of the ranks, summed.
fn summed(results: &[RankResult]) -> (f64, BTreeMap<String, Vec<f32>>) {
    let mut loss_sum = 0.0;
    let mut summed = BTreeMap::<String, Vec<f32>>::new();
    for (loss, found, _) in results {
        loss_sum += loss;
        for (name, gradient) in found {
            let sum = summed
                .entry(name.clone())
                .or_insert_with(|| vec![0.0; gradient.len()]);
            sum.iter_mut().zip(gradient).for_each(|(s, g)| *s += g);
        }
    }
    (loss_sum, summed)
}

/// The GQA case's sequences split over `ranks`, every layer kept or every layer recomputed: the
/// loss sums and gradients summed over the ranks against PyTorch's over the whole sequences.
fn check_split(ranks: usize, mode: LayerActivations) {
    let (_, expected) = load::<CpuBackend>("lora_gqa", &Default::default());
    let (loss_sum, gradients) = summed(&run_split(ranks, &expected.tokens, mode, None));
    compare(
        &format!("{ranks} ranks, {mode:?}"),
        loss_sum,
        &gradients,
        &expected,
    );
}

#[test]
fn lora_with_grouped_query_heads_split_over_ranks_matches_pytorch() {
    for ranks in [1, 2, 4] {
        check_split(ranks, LayerActivations::Kept);
    }
    check_split(2, LayerActivations::Recomputed);
}

/// Token elimination over a sequence split over two ranks: every rank selects the same kept
/// blocks from the whole sequence's scores, with the ranks' shares balanced. One rank replaying
/// that plan over the whole sequence gets the loss and gradients the two ranks sum to.
#[test]
fn token_elimination_split_over_ranks_matches_one_rank_on_its_plan() {
    type B = Autodiff<CpuBackend>;
    let device = Default::default();
    let (model, expected) = load::<B>("lora_gqa", &device);
    // The first sequence: 40 tokens, 8 blocks of 5, two blocks per chunk of the split.
    let first = HostTensor {
        shape: vec![1, 40],
        values: expected.tokens.values[..40].to_vec(),
    };
    let layers = model.num_layers();
    let thresholds = Thresholds {
        block_size: 5,
        min_keep: 0.25,
        layers: vec![
            LayerThresholds {
                attention: Some(1.0),
                mlp: Some(1.0),
                ..LayerThresholds::default()
            };
            layers
        ],
        ..Thresholds::keep_all("llama", layers, 64)
    };
    for mode in [LayerActivations::Kept, LayerActivations::Recomputed] {
        let results = run_split(2, &first, mode, Some(&thresholds));
        let plan = results[0]
            .2
            .clone()
            .expect("a selecting pass records its plan");
        let kept = plan.keep_fraction(Block::Attention) + plan.keep_fraction(Block::Mlp);
        assert!(kept < 2.0, "some blocks are dropped: {kept}");
        let (loss_sum, split_gradients) = summed(&results);

        let tokens = Tensor::<B, 2, Int>::from_data(
            TensorData::new(first.to_i64(), first.shape.clone()),
            &device,
        );
        let mut gradients = BTreeMap::new();
        let (loss, _) = model.next_token_loss_backward_planned(
            Batch::new(tokens, None),
            CHUNK_ROWS,
            1.0,
            &mut TokenSparsity::Replay(&plan),
            &ActivationPlan::uniform(mode, layers),
            &mut |g| add_gradients(&model, g, &mut gradients),
        );
        let one: f32 = loss.into_scalar().elem();
        assert_close_scalar(&format!("{mode:?}: loss sum"), loss_sum, one as f64, 1e-5);
        for (name, gradient) in &gradients {
            assert_close_values(
                &format!("{mode:?}: d {name}"),
                &split_gradients[name],
                gradient,
                TOLERANCE,
            );
        }
    }
}

/// The attention blocks' token-block scores of a sequence split over ranks, assembled from every
/// rank's share (each of its two chunks scored as the last rows of the keys up to the chunk's
/// end), are one rank's scores of the whole sequence, exact and sampled.
#[test]
fn attention_block_scores_split_over_ranks_are_the_whole_sequences() {
    type B = CpuBackend;
    let device = Default::default();
    seed_backend::<B>(&device);
    let seq = 64;
    let q = random::<B, 4>([1, 4, seq, 8], &device);
    let k = random::<B, 4>([1, 2, seq, 8], &device);
    for (ranks, query_stride) in [(2, 1), (2, 2), (4, 1), (4, 4)] {
        let scoring = BlockScoring {
            block_size: 4,
            query_stride,
            s2_group: None,
        };
        let expected = informativeness::attention(q.clone(), k.clone(), scoring);
        let group = Arc::new(ThreadGroup {
            barrier: Barrier::new(ranks),
            slots: Mutex::new(vec![Vec::new(); ranks]),
        });
        let assembled: Vec<Tensor<B, 2>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..ranks)
                .map(|rank| {
                    let (group, q, k) = (group.clone(), q.clone(), k.clone());
                    scope.spawn(move || {
                        let exchange = Exchange(Arc::new(ThreadRank { group, rank, ranks }));
                        let split = SequenceSplit::zigzag(seq, exchange).unwrap();
                        let positions: Vec<i64> =
                            split.positions().iter().map(|&p| p as i64).collect();
                        let len = positions.len();
                        let rows = Tensor::<B, 1, Int>::from_data(
                            TensorData::new(positions, [len]),
                            &q.device(),
                        );
                        let sums = split.attention_column_sums(q.select(2, rows), k, scoring);
                        split.whole_scores(Block::Attention, sums, scoring.block_size)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, scores) in assembled.into_iter().enumerate() {
            let what = format!("{ranks} ranks, query stride {query_stride}: rank {rank}'s scores");
            assert_close(&what, scores, expected.clone(), 1e-5);
        }
    }
}
