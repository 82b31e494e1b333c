//! The LoRA update's own backward (which keeps `x` in its dtype and casts it again) against the
//! same update in Burn tensor operations differentiated by Burn: output and the gradients of
//! `x`, `A` and `B`, on random inputs, with and without a gradient for `x`.

use burn::backend::Autodiff;
use burn::tensor::{Distribution, Tensor};
use lemo_kernels::CpuBackend;
use lemo_kernels::precision::{lora_delta, lora_delta_reference};

type B = Autodiff<CpuBackend>;

fn relative<const D: usize>(actual: Tensor<B, D>, expected: Tensor<B, D>) -> f32 {
    assert_eq!(actual.dims(), expected.dims());
    let scale: f32 = expected.clone().abs().max().into_scalar();
    let error: f32 = (actual - expected).abs().max().into_scalar();
    assert!(scale > 0.0, "the expected values are all zero");
    error / scale
}

fn check(x_needs_grad: bool) {
    let device = Default::default();
    lemo_test_support::seed_backend::<B>(&device);
    let normal = Distribution::Normal(0.0, 1.0);
    let (batch, len, input, output, rank) = (2, 13, 24, 40, 4);
    let mut x = Tensor::<B, 3>::random([batch, len, input], normal, &device);
    if x_needs_grad {
        x = x.require_grad();
    }
    let a = Tensor::<B, 2>::random([rank, input], normal, &device).require_grad();
    let b = Tensor::<B, 2>::random([output, rank], normal, &device).require_grad();
    let scale = 2.5;

    let out = lora_delta(x.clone(), a.clone(), b.clone(), scale);
    let upstream = out.random_like(normal);
    let grads = (out.clone() * upstream.clone()).sum().backward();
    let expected = lora_delta_reference(x.clone(), a.clone(), b.clone(), scale);
    let expected_grads = (expected.clone() * upstream).sum().backward();

    let mut errors = vec![
        ("out", relative(out, expected)),
        (
            "d a",
            relative(
                Tensor::from_inner(a.grad(&grads).unwrap()),
                Tensor::from_inner(a.grad(&expected_grads).unwrap()),
            ),
        ),
        (
            "d b",
            relative(
                Tensor::from_inner(b.grad(&grads).unwrap()),
                Tensor::from_inner(b.grad(&expected_grads).unwrap()),
            ),
        ),
    ];
    if x_needs_grad {
        errors.push((
            "d x",
            relative(
                Tensor::from_inner(x.grad(&grads).unwrap()),
                Tensor::from_inner(x.grad(&expected_grads).unwrap()),
            ),
        ));
    } else {
        assert!(x.grad(&grads).is_none());
    }
    for (name, error) in errors {
        println!("{name}: {error:.2e}");
        assert!(error < 1e-5, "{name}: relative error {error}");
    }
}

#[test]
fn lora_delta_matches_the_reference_forward_and_backward() {
    check(true);
}

#[test]
fn lora_delta_of_an_input_without_gradient() {
    check(false);
}
