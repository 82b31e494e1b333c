//! Autodiff of the GEMM entry point (wgpu, f32; the cuBLASLt path is checked on the GPU by the
//! benchmark harness) against Burn's own matmul under autodiff: 2-D, batched, a weight shared
//! by the batch, and transposed views.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use lemo_kernels::{WgpuBackend, gemm};

type B = Autodiff<WgpuBackend>;

fn relative<const D: usize>(actual: Tensor<B, D>, expected: Tensor<B, D>) -> f32 {
    assert_eq!(actual.dims(), expected.dims());
    let scale: f32 = expected.clone().abs().max().into_scalar();
    let error: f32 = (actual - expected).abs().max().into_scalar();
    error / scale.max(1e-12)
}

fn check<const D: usize>(lhs: Tensor<B, D>, rhs: Tensor<B, D>) {
    let lhs = lhs.detach().require_grad();
    let rhs = rhs.detach().require_grad();
    let out = gemm::matmul(lhs.clone(), rhs.clone());
    let upstream = out.random_like(Distribution::Normal(0.0, 1.0));
    let grads = (out.clone() * upstream.clone()).sum().backward();
    let (grad_lhs, grad_rhs) = (lhs.grad(&grads).unwrap(), rhs.grad(&grads).unwrap());

    let expected = gemm::reference(lhs.clone(), rhs.clone());
    let grads = (expected.clone() * upstream).sum().backward();
    for (name, error) in [
        ("out", relative(out, expected)),
        (
            "d lhs",
            relative(
                Tensor::from_inner(grad_lhs),
                Tensor::from_inner(lhs.grad(&grads).unwrap()),
            ),
        ),
        (
            "d rhs",
            relative(
                Tensor::from_inner(grad_rhs),
                Tensor::from_inner(rhs.grad(&grads).unwrap()),
            ),
        ),
    ] {
        println!("{name}: {error:.2e}");
        assert!(error < 1e-5, "{name}: relative error {error}");
    }
}

fn random<const D: usize>(shape: [usize; D]) -> Tensor<B, D> {
    let device = Default::default();
    B::seed(
        &device,
        std::time::UNIX_EPOCH.elapsed().unwrap().as_nanos() as u64,
    );
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &device)
}

#[test]
fn two_dimensional() {
    check(random([33, 20]), random([20, 17]));
}

#[test]
fn batched() {
    check(random([3, 9, 20]), random([3, 20, 11]));
}

#[test]
fn shared_weight_as_one_tall_product() {
    check(random([4, 9, 20]), random([1, 20, 11]));
}

#[test]
fn transposed_views() {
    // `x W^T` with `W [out, in]`, and `x^T y` (the weight-gradient form).
    check(random([2, 9, 20]), random([1, 11, 20]).swap_dims(1, 2));
    check(random([20, 9]).transpose(), random([20, 13]));
}
