//! Per-layer activation checkpointing gives the loss and gradients of the plain backward pass.

use std::path::Path;

use burn::backend::Autodiff;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Int, Tensor};
use lemo_kernels::CpuBackend;
use lemo_kernels::precision::Precision;
use lemo_models::lora::LLAMA_PROJECTIONS;
use lemo_models::{CausalLm, LoraConfig};

type B = Autodiff<CpuBackend>;
type Inner = CpuBackend;

/// Every trainable parameter's gradient, flattened, in module order; a parameter a partial
/// backward pass did not reach adds nothing.
#[derive(Default)]
struct GradientSums {
    sums: Vec<Option<Tensor<Inner, 1>>>,
}

impl GradientSums {
    fn add(&mut self, model: &CausalLm<B>, gradients: &<B as AutodiffBackend>::Gradients) {
        struct Visitor<'a> {
            gradients: &'a <B as AutodiffBackend>::Gradients,
            sums: &'a mut Vec<Option<Tensor<Inner, 1>>>,
            index: usize,
        }
        impl ModuleVisitor<B> for Visitor<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let value = param.val();
                if !value.is_require_grad() {
                    return;
                }
                if self.sums.len() <= self.index {
                    self.sums.push(None);
                }
                if let Some(grad) = value.grad(self.gradients) {
                    let grad = grad.flatten::<1>(0, D - 1);
                    let slot = &mut self.sums[self.index];
                    *slot = Some(match slot.take() {
                        Some(sum) => sum + grad,
                        None => grad,
                    });
                }
                self.index += 1;
            }
        }
        model.visit(&mut Visitor {
            gradients,
            sums: &mut self.sums,
            index: 0,
        });
    }
}

/// `fixture`'s model with LoRA on `targets`, random `lora_B` (so that every LoRA factor has a
/// gradient), and LongLoRA's trainable embeddings and norms when `longlora`.
fn trainable_model(fixture: &str, targets: &[&str], longlora: bool) -> CausalLm<B> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(fixture);
    let (model, _) = CausalLm::<B>::from_path(&path, &Default::default(), Precision::F32).unwrap();
    let config = LoraConfig {
        target_modules: targets.iter().map(|t| t.to_string()).collect(),
        train_embeddings: longlora,
        train_norms: longlora,
        ..LoraConfig::default()
    };
    let mut model = model
        .with_new_lora(&config, 0)
        .unwrap()
        .set_extra_trainable(&config)
        .unwrap();
    for (_, linear) in model.projections_mut() {
        if let Some(lora) = linear.lora.as_mut() {
            let b = Tensor::random(
                lora.b.dims(),
                Distribution::Normal(0.0, 0.1),
                &lora.b.device(),
            );
            lora.b = Param::from_tensor(b);
        }
    }
    model
}

fn assert_recomputation_matches(model: &CausalLm<B>, len: usize) {
    let [vocab, _] = model.lm_head_weight().dims();
    let tokens = Tensor::<B, 2, Int>::random(
        [1, len],
        Distribution::Uniform(0.0, vocab as f64),
        &Default::default(),
    );
    let (chunk_rows, scale) = (7, 0.25);

    let (loss, predictions) = model.next_token_loss_sum(tokens.clone(), chunk_rows);
    let mut plain = GradientSums::default();
    plain.add(model, &loss.clone().mul_scalar(scale).backward());
    let plain_loss: f32 = loss.into_scalar();

    let mut recomputed = GradientSums::default();
    let (loss, recomputed_predictions) =
        model.next_token_loss_backward_recomputed(tokens, chunk_rows, scale, &mut |gradients| {
            recomputed.add(model, gradients)
        });
    let recomputed_loss: f32 = loss.into_scalar();

    assert_eq!(predictions, recomputed_predictions);
    assert!(
        (plain_loss - recomputed_loss).abs() <= 1e-5 * plain_loss.abs(),
        "loss {plain_loss} vs {recomputed_loss}"
    );
    assert!(!plain.sums.is_empty());
    assert_eq!(plain.sums.len(), recomputed.sums.len());
    for (index, (a, b)) in plain.sums.into_iter().zip(recomputed.sums).enumerate() {
        let (a, b) = (
            a.unwrap_or_else(|| panic!("parameter {index} got no gradient")),
            b.unwrap_or_else(|| panic!("parameter {index} got no recomputed gradient")),
        );
        let scale: f32 = a.clone().abs().max().into_scalar();
        let difference: f32 = (a - b).abs().max().into_scalar();
        assert!(scale > 0.0, "parameter {index} has a zero gradient");
        assert!(
            difference <= 1e-4 * scale,
            "parameter {index}: gradients differ by {difference} (largest {scale})"
        );
    }
}

#[test]
fn recomputed_lora_gradients_match_llama() {
    let model = trainable_model("llama_gqa_tied", &LLAMA_PROJECTIONS, false);
    assert_recomputation_matches(&model, 45);
}

#[test]
fn recomputed_longlora_gradients_match_with_tied_trainable_embeddings() {
    let mut model = trainable_model("llama_gqa_tied", &["q_proj", "v_proj"], true);
    model.set_shifted_group(Some(16));
    assert_recomputation_matches(&model, 64);
}

#[test]
fn recomputed_lora_gradients_match_opt() {
    for fixture in ["opt_prenorm_proj", "opt_postnorm_proj"] {
        let model = trainable_model(fixture, &["q_proj", "v_proj", "fc1"], false);
        assert_recomputation_matches(&model, 33);
    }
}
