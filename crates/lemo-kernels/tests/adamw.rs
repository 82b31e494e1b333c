//! Parity of the fused AdamW kernel (wgpu, f32) with its plain Burn reference on the CPU: three
//! updates from no moments, with and without weight decay, on vectorized and odd lengths and on
//! wide and tall matrices. Each side carries its own parameter and moments from update to update.
//!
//! The learning rate is large enough that the update is a sizable part of each parameter, so a
//! wrong update shows in the parameters, not only in the moments. One regime has gradients so
//! small that `eps` is as large as `sqrt(v_hat)`, where misplacing `eps` (under the square root,
//! or before the bias correction) changes the update by about as much as the update itself.

use burn::tensor::Tensor;
use lemo_kernels::fused::{AdamWStep, adamw_step};
use lemo_kernels::{CpuBackend, WgpuBackend};
use lemo_test_support::{assert_close, exclusive_generator, random, seed_backend};

/// f32 arithmetic in the same order on both sides; the roundings left (fused multiply-adds,
/// three updates) stay near the f32 epsilon.
const TOLERANCE: f32 = 1e-6;

fn to_wgpu<const D: usize>(tensor: &Tensor<CpuBackend, D>) -> Tensor<WgpuBackend, D> {
    Tensor::from_data(tensor.to_data(), &Default::default())
}

/// `(lr, eps, gradient scale)` of the two regimes: gradients dominate `eps`, or match it.
const REGIMES: [(f64, f64, f32); 2] = [(0.1, 1e-8, 1.0), (0.1, 1e-6, 1e-6)];

fn case<const D: usize>(shape: [usize; D]) {
    let _generator = exclusive_generator();
    let device = Default::default();
    seed_backend::<CpuBackend>(&device);
    for (lr, eps, grad_scale) in REGIMES {
        for weight_decay in [0.0, 0.1] {
            let start = random::<CpuBackend, D>(shape, &device);
            let mut cpu = (start.clone(), None, None);
            let mut gpu = (to_wgpu(&start), None, None);
            for step in 1..=3 {
                let grad = random::<CpuBackend, D>(shape, &device) * grad_scale;
                let update = AdamWStep {
                    lr,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps,
                    weight_decay,
                    step,
                };
                let (p, m, v) = adamw_step(cpu.0, grad.clone(), cpu.1, cpu.2, update);
                cpu = (p, Some(m), Some(v));
                let (p, m, v) = adamw_step(gpu.0, to_wgpu(&grad), gpu.1, gpu.2, update);
                gpu = (p, Some(m), Some(v));

                let what = format!("{shape:?} lr {lr} eps {eps} wd {weight_decay} step {step}");
                let on_cpu = |t: &Tensor<WgpuBackend, D>| {
                    Tensor::<CpuBackend, D>::from_data(t.to_data(), &device)
                };
                assert_close(
                    &format!("param, {what}"),
                    on_cpu(&gpu.0),
                    cpu.0.clone(),
                    TOLERANCE,
                );
                for (name, kernel, reference) in
                    [("exp_avg", &gpu.1, &cpu.1), ("exp_avg_sq", &gpu.2, &cpu.2)]
                {
                    assert_close(
                        &format!("{name}, {what}"),
                        on_cpu(kernel.as_ref().unwrap()),
                        reference.clone().unwrap(),
                        TOLERANCE,
                    );
                }
            }
        }
    }
}

#[test]
fn adamw_vectorized_length() {
    case([1000]);
}

#[test]
fn adamw_odd_length() {
    case([8 * 4096 + 3]);
}

#[test]
fn adamw_wide_matrix() {
    case([8, 4096]);
}

#[test]
fn adamw_tall_matrix() {
    case([4096, 8]);
}
