//! Helpers shared by the model tests: trainable fixture models and gradient collection.

pub mod transformers;

use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, ElementConversion, Tensor};
use lemo_kernels::LemoBackend;
use lemo_kernels::precision::Precision;
use lemo_models::{CausalLm, LoraConfig};
use lemo_sparsity::{LayerThresholds, Thresholds};

/// Every trainable parameter's gradient, flattened, in module order; a parameter a partial
/// backward pass did not reach adds nothing.
pub struct GradientSums<B: AutodiffBackend> {
    pub sums: Vec<Option<Tensor<B::InnerBackend, 1>>>,
}

impl<B: AutodiffBackend> Clone for GradientSums<B> {
    fn clone(&self) -> Self {
        Self {
            sums: self.sums.clone(),
        }
    }
}

impl<B: AutodiffBackend> Default for GradientSums<B> {
    fn default() -> Self {
        Self { sums: Vec::new() }
    }
}

impl<B: AutodiffBackend + LemoBackend> GradientSums<B> {
    /// Whether no parameter got a non-zero gradient.
    pub fn is_zero(&self) -> bool {
        self.sums.iter().flatten().all(|sum| {
            let largest: f32 = sum.clone().abs().max().into_scalar().elem();
            largest == 0.0
        })
    }

    pub fn add(&mut self, model: &CausalLm<B>, gradients: &B::Gradients) {
        struct Visitor<'a, B: AutodiffBackend> {
            gradients: &'a B::Gradients,
            sums: &'a mut Vec<Option<Tensor<B::InnerBackend, 1>>>,
            index: usize,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Visitor<'_, B> {
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
/// gradient), and LongLoRA's trainable embeddings and norms when `longlora`. Seeds the backend
/// with the test seed first, so that the adapters and whatever the test draws next repeat.
pub fn trainable_model<B: AutodiffBackend + LemoBackend>(
    fixture: &str,
    targets: &[&str],
    longlora: bool,
    device: &B::Device,
) -> CausalLm<B> {
    lemo_test_support::seed_backend::<B>(device);
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(fixture);
    let (model, _) = CausalLm::<B>::from_path(&path, device, Precision::F32).unwrap();
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

/// Asserts that two sets of gradients agree within `tolerance` of each parameter's largest.
pub fn assert_same_gradients<B: AutodiffBackend>(
    expected: GradientSums<B>,
    actual: GradientSums<B>,
    tolerance: f32,
) {
    assert!(!expected.sums.is_empty());
    assert_eq!(expected.sums.len(), actual.sums.len());
    for (index, (a, b)) in expected.sums.into_iter().zip(actual.sums).enumerate() {
        let (a, b) = (
            a.unwrap_or_else(|| panic!("parameter {index} got no gradient")),
            b.unwrap_or_else(|| panic!("parameter {index} got no gradient in the second pass")),
        );
        let scale: f32 = a.clone().abs().max().into_scalar().elem();
        let difference: f32 = (a - b).abs().max().into_scalar().elem();
        assert!(scale > 0.0, "parameter {index} has a zero gradient");
        assert!(
            difference <= tolerance * scale,
            "parameter {index}: gradients differ by {difference} (largest {scale})"
        );
    }
}

/// Thresholds under which every block keeps the best half of its token blocks of `block_size`
/// (the first and the last always among them): the largest threshold and a floor of one half.
pub fn half_kept<B: LemoBackend>(model: &CausalLm<B>, block_size: usize) -> Thresholds {
    let all = LayerThresholds {
        attention: Some(f32::MAX),
        mlp: Some(f32::MAX),
        attention_keep: None,
        mlp_keep: None,
    };
    Thresholds {
        block_size,
        min_keep: 0.5,
        layers: vec![all; model.num_layers()],
        ..Thresholds::keep_all("llama", model.num_layers(), 0)
    }
}

/// Thresholds that run every block through the token-sparse path but keep every token.
pub fn every_token_kept<B: LemoBackend>(model: &CausalLm<B>, block_size: usize) -> Thresholds {
    let all = LayerThresholds {
        attention: Some(f32::MIN),
        mlp: Some(f32::MIN),
        attention_keep: None,
        mlp_keep: None,
    };
    Thresholds {
        block_size,
        min_keep: 0.0,
        layers: vec![all; model.num_layers()],
        ..Thresholds::keep_all("llama", model.num_layers(), 0)
    }
}
