//! One AdamW update of one parameter tensor, as `torch.optim.AdamW` computes it: decoupled
//! weight decay `p *= 1 - lr wd`, moments `m = b1 m + (1 - b1) g` and `v = b2 v + (1 - b2) g^2`,
//! then `p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`. Arithmetic is f32
//! whatever the storage dtype; on CubeCL backends it is one kernel launch per tensor instead of
//! a dozen element-wise ones.

pub mod backend;
pub(crate) mod kernel;
pub mod reference;

use burn::tensor::{Tensor, TensorPrimitive};

use crate::ComputeBackend;

/// The hyperparameters of one AdamW update; `step` counts updates from 1, this one included
/// (PyTorch's `state["step"]` after its increment).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub step: u64,
}

impl AdamWStep {
    /// `(1 - lr wd, lr / (1 - b1^t), sqrt(1 - b2^t))`, computed in f64 on the host as PyTorch
    /// does, before the kernel rounds them to f32 (the reference computes its own).
    pub(crate) fn corrections(&self) -> (f64, f64, f64) {
        let t = self.step as f64;
        let bias1 = 1.0 - self.beta1.powf(t);
        let bias2 = 1.0 - self.beta2.powf(t);
        (
            1.0 - self.lr * self.weight_decay,
            self.lr / bias1,
            bias2.sqrt(),
        )
    }
}

/// One AdamW update of `param` with `grad`, from the moments `exp_avg` and `exp_avg_sq` (absent
/// before the first update: zeros). Returns the new `(param, exp_avg, exp_avg_sq)`, shaped and
/// typed like `param`. Costs one pass: reads four tensors and writes three.
pub fn adamw_step<B: ComputeBackend, const D: usize>(
    param: Tensor<B, D>,
    grad: Tensor<B, D>,
    exp_avg: Option<Tensor<B, D>>,
    exp_avg_sq: Option<Tensor<B, D>>,
    step: AdamWStep,
) -> (Tensor<B, D>, Tensor<B, D>, Tensor<B, D>) {
    let primitive = |t: Tensor<B, D>| t.into_primitive().tensor();
    let (param, exp_avg, exp_avg_sq) = B::lemo_adamw_step(
        primitive(param),
        primitive(grad),
        exp_avg.map(primitive),
        exp_avg_sq.map(primitive),
        step,
    );
    let tensor = |t| Tensor::from_primitive(TensorPrimitive::Float(t));
    (tensor(param), tensor(exp_avg), tensor(exp_avg_sq))
}
