//! AdamW with PyTorch's semantics, global-norm gradient clipping and gradient accumulation, over
//! the trainable parameters of a module, addressed by their module path so that the optimizer
//! state can be saved and restored across processes (Burn's `ParamId`s are random per process).
//!
//! Everything here runs on the inner (non-autodiff) backend in f32: gradients are summed over
//! micro-batches, then one AdamW step updates parameters and moments.

use std::collections::BTreeMap;

use anyhow::{Result, bail};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor, TensorData};
use lemo_kernels::ComputeBackend;
use lemo_kernels::fused::{AdamWStep, adamw_step};

/// `(beta1, beta2, eps, weight_decay)` defaults are PyTorch's `torch.optim.AdamW` minus its
/// weight decay of 0.01: LoRA recipes (PEFT, LongLoRA) train with 0.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamWSettings {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWSettings {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// Flattened f32 tensors keyed by module path.
pub type NamedTensors<B> = BTreeMap<String, Tensor<B, 1>>;

/// Keeps the module path of the parameter being visited.
#[derive(Default)]
struct PathTracker {
    stack: Vec<String>,
}

impl PathTracker {
    fn enter(&mut self, name: &str, container: &str) {
        // Enum variants add no useful segment beyond their name.
        let _ = container;
        self.stack.push(name.to_string());
    }
    fn exit(&mut self) {
        self.stack.pop();
    }
    fn path(&self) -> String {
        self.stack.join(".")
    }
}

/// Adds each trainable parameter's gradient (found in `grads`) into `into`.
struct GradCollector<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    into: &'a mut NamedTensors<B::InnerBackend>,
    path: PathTracker,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradCollector<'_, B> {
    fn enter_module(&mut self, name: &str, container: &str) {
        self.path.enter(name, container);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        if !value.is_require_grad() {
            return;
        }
        let Some(grad) = value.grad(self.grads) else {
            return;
        };
        let count = grad.shape().num_elements();
        let grad = grad.reshape([count]);
        let key = self.path.path();
        let sum = match self.into.remove(&key) {
            Some(previous) => previous + grad,
            None => grad,
        };
        self.into.insert(key, sum);
    }
}

/// Sums the gradients of `module`'s trainable parameters found in `grads` into `accumulated`.
pub fn accumulate_grads<B: AutodiffBackend, M: Module<B>>(
    module: &M,
    grads: &B::Gradients,
    accumulated: &mut NamedTensors<B::InnerBackend>,
) {
    module.visit(&mut GradCollector::<B> {
        grads,
        into: accumulated,
        path: PathTracker::default(),
    });
}

/// The trainable parameters' values, flattened, keyed by module path.
pub fn trainable_values<B: AutodiffBackend, M: Module<B>>(
    module: &M,
) -> NamedTensors<B::InnerBackend> {
    struct Values<'a, B: AutodiffBackend> {
        into: &'a mut NamedTensors<B::InnerBackend>,
        path: PathTracker,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Values<'_, B> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.path.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            if value.is_require_grad() {
                let inner = value.inner();
                let count = inner.shape().num_elements();
                self.into.insert(self.path.path(), inner.reshape([count]));
            }
        }
    }
    let mut out = BTreeMap::new();
    module.visit(&mut Values::<B> {
        into: &mut out,
        path: PathTracker::default(),
    });
    out
}

/// Number of trainable scalars.
pub fn trainable_count<B: AutodiffBackend, M: Module<B>>(module: &M) -> usize {
    trainable_values::<B, M>(module)
        .values()
        .map(|t| t.dims()[0])
        .sum()
}

/// Replaces each trainable parameter found in `updates` with its new value (same `ParamId`,
/// still trainable).
struct Updater<'a, B: AutodiffBackend> {
    updates: &'a mut NamedTensors<B::InnerBackend>,
    path: PathTracker,
    /// Trainable parameters `updates` had no value for, or one of another size.
    unmatched: Vec<String>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Updater<'_, B> {
    fn enter_module(&mut self, name: &str, container: &str) {
        self.path.enter(name, container);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, value, mapper) = param.consume();
        if !value.is_require_grad() {
            return Param::from_mapped_value(id, value, mapper);
        }
        let path = self.path.path();
        match self.updates.remove(&path) {
            Some(new) if new.shape().num_elements() == value.shape().num_elements() => {
                let shape = value.shape();
                let new = Tensor::<B, D>::from_inner(new.reshape(shape)).require_grad();
                Param::from_mapped_value(id, new, mapper)
            }
            _ => {
                self.unmatched.push(path);
                Param::from_mapped_value(id, value, mapper)
            }
        }
    }
}

/// Writes `values` into the module's trainable parameters of the same paths: every trainable
/// parameter gets a value of its size, and every value a parameter.
pub fn set_trainable<B: AutodiffBackend, M: Module<B>>(
    module: M,
    mut values: NamedTensors<B::InnerBackend>,
) -> Result<M> {
    let mut updater = Updater::<B> {
        updates: &mut values,
        path: PathTracker::default(),
        unmatched: Vec::new(),
    };
    let module = module.map(&mut updater);
    if let Some(name) = updater.unmatched.first() {
        bail!(
            "no value of the right size for the trainable parameter {name} ({} of them)",
            updater.unmatched.len()
        );
    }
    if let Some(name) = values.keys().next() {
        bail!("no trainable parameter {name} in this model");
    }
    Ok(module)
}

/// `sqrt(sum of squares)` over all gradients.
pub fn global_norm<B: burn::tensor::backend::Backend>(grads: &NamedTensors<B>) -> f64 {
    let Some(first) = grads.values().next() else {
        return 0.0;
    };
    let mut total = Tensor::<B, 1>::zeros([1], &first.device());
    for grad in grads.values() {
        total = total + grad.clone().square().sum();
    }
    total.into_scalar().elem::<f64>().sqrt()
}

/// Scales every gradient by `factor`.
pub fn scale_grads<B: burn::tensor::backend::Backend>(
    grads: NamedTensors<B>,
    factor: f64,
) -> NamedTensors<B> {
    grads
        .into_iter()
        .map(|(k, g)| (k, g.mul_scalar(factor)))
        .collect()
}

/// AdamW state: step count and the two moments of every trainable parameter.
pub struct AdamW<B: burn::tensor::backend::Backend> {
    pub settings: AdamWSettings,
    /// Updates applied so far (PyTorch's `state["step"]`).
    pub step: u64,
    pub exp_avg: NamedTensors<B>,
    pub exp_avg_sq: NamedTensors<B>,
}

impl<B: ComputeBackend> AdamW<B> {
    pub fn new(settings: AdamWSettings) -> Self {
        Self {
            settings,
            step: 0,
            exp_avg: BTreeMap::new(),
            exp_avg_sq: BTreeMap::new(),
        }
    }

    /// One update of `params` with `grads` at learning rate `lr`, as `torch.optim.AdamW` does it:
    /// decoupled weight decay, bias-corrected moments, `eps` added after the square root. One
    /// fused kernel per tensor on CubeCL backends (see [`adamw_step`]).
    pub fn step(
        &mut self,
        params: NamedTensors<B>,
        grads: &NamedTensors<B>,
        lr: f64,
    ) -> NamedTensors<B> {
        self.step += 1;
        let update = AdamWStep {
            lr,
            beta1: self.settings.beta1,
            beta2: self.settings.beta2,
            eps: self.settings.eps,
            weight_decay: self.settings.weight_decay,
            step: self.step,
        };
        let mut out = BTreeMap::new();
        for (name, param) in params {
            let Some(grad) = grads.get(&name) else {
                out.insert(name, param);
                continue;
            };
            let (param, m, v) = adamw_step(
                param,
                grad.clone(),
                self.exp_avg.remove(&name),
                self.exp_avg_sq.remove(&name),
                update,
            );
            self.exp_avg.insert(name.clone(), m);
            self.exp_avg_sq.insert(name.clone(), v);
            out.insert(name, param);
        }
        out
    }

    /// Moments as `(name, values)` for saving: `exp_avg/{path}` and `exp_avg_sq/{path}`.
    pub fn state_tensors(&self) -> Vec<(String, Vec<f32>)> {
        let dump = |prefix: &str, map: &NamedTensors<B>| -> Vec<(String, Vec<f32>)> {
            map.iter()
                .map(|(k, t)| {
                    (
                        format!("{prefix}/{k}"),
                        t.clone()
                            .into_data()
                            .convert::<f32>()
                            .into_vec()
                            .expect("f32"),
                    )
                })
                .collect()
        };
        let mut out = dump("exp_avg", &self.exp_avg);
        out.extend(dump("exp_avg_sq", &self.exp_avg_sq));
        out
    }

    /// Restores moments saved by [`Self::state_tensors`].
    pub fn load_state(
        &mut self,
        step: u64,
        tensors: Vec<(String, Vec<f32>)>,
        device: &B::Device,
    ) -> Result<()> {
        self.step = step;
        for (name, values) in tensors {
            let len = values.len();
            let tensor = Tensor::<B, 1>::from_data(TensorData::new(values, [len]), device);
            if let Some(path) = name.strip_prefix("exp_avg_sq/") {
                self.exp_avg_sq.insert(path.to_string(), tensor);
            } else if let Some(path) = name.strip_prefix("exp_avg/") {
                self.exp_avg.insert(path.to_string(), tensor);
            } else {
                bail!("unknown optimizer state tensor {name}");
            }
        }
        Ok(())
    }
}

/// Learning-rate schedule: linear warm-up from 0, then constant or cosine decay to
/// `min_lr_ratio * lr` at the last step.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    Constant,
    Cosine,
}

pub fn learning_rate(
    schedule: Schedule,
    lr: f64,
    min_lr_ratio: f64,
    warmup: usize,
    steps: usize,
    step: usize,
) -> f64 {
    // `step` counts from 0; the first update uses (step + 1) / warmup of the rate, as
    // transformers' `get_*_schedule_with_warmup` do after their first scheduler step.
    if warmup > 0 && step < warmup {
        return lr * (step + 1) as f64 / warmup as f64;
    }
    match schedule {
        Schedule::Constant => lr,
        Schedule::Cosine => {
            let span = steps.saturating_sub(warmup).max(1) as f64;
            let progress = ((step - warmup) as f64 / span).min(1.0);
            let floor = lr * min_lr_ratio;
            floor + (lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    #[test]
    fn adamw_matches_pytorch_first_steps() {
        // torch: p = tensor([1., -2.]); AdamW(lr=0.1, weight_decay=0.01); grads [0.5, -1.0] then [0.1, 0.2]
        // -> after step 1: [0.899, -1.898], after step 2: [0.8037, -1.8070] (computed by hand with
        // torch's formulas, see the module docs).
        type B = NdArray<f32>;
        let device = Default::default();
        let mut opt = AdamW::<B>::new(AdamWSettings {
            weight_decay: 0.01,
            ..Default::default()
        });
        let mut params = BTreeMap::from([(
            "p".to_string(),
            Tensor::<B, 1>::from_floats([1.0, -2.0], &device),
        )]);
        for g in [[0.5f32, -1.0], [0.1, 0.2]] {
            let grads =
                BTreeMap::from([("p".to_string(), Tensor::<B, 1>::from_floats(g, &device))]);
            params = opt.step(params, &grads, 0.1);
        }
        let p: Vec<f32> = params["p"].clone().into_data().into_vec().unwrap();
        // Step 1: m_hat/sqrt(v_hat) = sign(g) -> p = p*(1-0.001) - 0.1*sign(g).
        // Step 2 (p0 = 0.899): m = 0.9*0.05 + 0.1*0.1 = 0.055, v = 0.999*0.00025 + 0.001*0.01 = 0.00026;
        // m_hat = 0.055/0.19 = 0.289474, v_hat = 0.00026/0.001999 = 0.130065, sqrt = 0.360645
        // p = 0.899*(0.999) - 0.1*0.289474/0.360645 = 0.898101 - 0.080266 = 0.817835
        assert!((p[0] - 0.817835).abs() < 1e-4, "{p:?}");
        // second coordinate: m = 0.9*(-0.1) + 0.1*0.2 = -0.07, v = 0.999*0.001 + 0.001*0.04 = 0.001039
        // m_hat = -0.368421, v_hat = 0.519760, sqrt = 0.720944; p0 = -1.898*0.999 = -1.896102
        // p = -1.896102 + 0.1*0.368421/0.720944 = -1.896102 + 0.051103 = -1.844999
        assert!((p[1] + 1.844999).abs() < 1e-4, "{p:?}");
    }

    #[test]
    fn schedule_warms_up_then_decays() {
        assert!((learning_rate(Schedule::Cosine, 1.0, 0.0, 10, 110, 0) - 0.1).abs() < 1e-12);
        assert!((learning_rate(Schedule::Cosine, 1.0, 0.0, 10, 110, 10) - 1.0).abs() < 1e-12);
        assert!((learning_rate(Schedule::Cosine, 1.0, 0.0, 10, 110, 60) - 0.5).abs() < 1e-12);
        assert!((learning_rate(Schedule::Constant, 1.0, 0.0, 10, 110, 100) - 1.0).abs() < 1e-12);
    }
}
