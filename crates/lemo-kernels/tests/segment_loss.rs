//! The segment-based loss (wgpu, f32) against the plain full-logits cross-entropy under Burn's
//! autodiff: loss, hidden gradient, lm_head gradient; chunk sizes that do not divide the
//! sequence, ignored targets, and the fused per-row kernel on its own.

use burn::backend::Autodiff;
use burn::tensor::{Distribution, Int, Tensor, TensorData};
use lemo_kernels::WgpuBackend;
use lemo_kernels::loss::{self, IGNORE_INDEX, segment_cross_entropy};
use lemo_test_support::{HostRng, assert_close, exclusive_generator, seed_backend};

type B = Autodiff<WgpuBackend>;

/// Seeded inputs (the seed printed, `LEMO_TEST_SEED` overrides it), and the generator held for
/// the rest of the test.
fn inputs(
    rows: usize,
    width: usize,
    vocab: usize,
) -> (
    Tensor<B, 2>,
    Tensor<B, 2>,
    Tensor<B, 1, Int>,
    std::sync::MutexGuard<'static, ()>,
) {
    let generator = exclusive_generator();
    let device = Default::default();
    let seed = seed_backend::<B>(&device);
    let hidden = Tensor::random([rows, width], Distribution::Normal(0.0, 1.0), &device);
    let weight = Tensor::random([vocab, width], Distribution::Normal(0.0, 0.5), &device);
    let mut rng = HostRng::new(seed);
    let targets: Vec<i64> = (0..rows)
        .map(|i| {
            if i % 7 == 3 {
                IGNORE_INDEX
            } else {
                rng.below(vocab) as i64
            }
        })
        .collect();
    let targets = Tensor::from_data(TensorData::new(targets, [rows]), &device);
    (hidden, weight, targets, generator)
}

fn check(rows: usize, width: usize, vocab: usize, chunk: usize) {
    let (hidden, weight, targets, _generator) = inputs(rows, width, vocab);
    let (hidden, weight) = (hidden.require_grad(), weight.require_grad());

    let loss = segment_cross_entropy(hidden.clone(), weight.clone(), targets.clone(), chunk);
    // A non-unit upstream gradient, to check the rescaling.
    let grads = (loss.clone() * 0.37).backward();
    let (grad_hidden, grad_weight) = (hidden.grad(&grads).unwrap(), weight.grad(&grads).unwrap());

    let expected = loss::reference::cross_entropy(hidden.clone(), weight.clone(), targets);
    let grads = (expected.clone() * 0.37).backward();
    let grad_of = |grad| Tensor::<B, 2>::from_inner(grad);
    assert_close("loss", loss, expected, 1e-5);
    assert_close(
        "d hidden",
        grad_of(grad_hidden),
        grad_of(hidden.grad(&grads).unwrap()),
        1e-5,
    );
    assert_close(
        "d weight",
        grad_of(grad_weight),
        grad_of(weight.grad(&grads).unwrap()),
        1e-5,
    );
}

#[test]
fn chunks_not_dividing_the_sequence() {
    check(75, 24, 301, 16);
}

#[test]
fn one_chunk() {
    check(40, 16, 130, 1000);
}

#[test]
fn frozen_lm_head_gets_no_gradient() {
    let (hidden, weight, targets, _generator) = inputs(30, 16, 99);
    let hidden = hidden.require_grad();
    let loss = segment_cross_entropy(hidden.clone(), weight.clone(), targets, 8);
    let grads = loss.backward();
    assert!(hidden.grad(&grads).is_some());
    assert!(weight.grad(&grads).is_none());
}

#[test]
fn fused_rows_kernel() {
    let (hidden, weight, targets, _generator) = inputs(19, 8, 1003);
    let logits = hidden.matmul(weight.transpose()) * 4.0;
    let (losses, grad) = loss::cross_entropy_rows(logits.clone(), targets.clone(), true);
    let (expected, expected_grad) = loss::reference::cross_entropy_rows::<B>(
        logits.into_primitive().tensor(),
        targets.into_primitive(),
        true,
    );
    let expected = Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(expected));
    let expected_grad = Tensor::<B, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(
        expected_grad.unwrap(),
    ));
    assert_close("losses", losses, expected, 1e-5);
    assert_close("grad", grad.unwrap(), expected_grad, 1e-5);
}
