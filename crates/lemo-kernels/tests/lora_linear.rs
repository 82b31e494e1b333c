//! The LoRA linear op's own backward (which keeps `x` in its dtype and casts it again, and with
//! the frozen weight adds the adapter's part of `d x` onto `d y W` in one product) against the
//! same layer in Burn tensor operations differentiated by Burn: output and the gradients of `x`,
//! `A`, `B` and, without the weight, of the frozen output, on random inputs, with and without a
//! gradient for `x`.

use burn::backend::Autodiff;
use burn::tensor::{Distribution, Tensor};
use lemo_kernels::CpuBackend;
use lemo_kernels::precision::{Frozen, lora_linear, lora_linear_reference};

type B = Autodiff<CpuBackend>;

fn relative<const D: usize>(actual: Tensor<B, D>, expected: Tensor<B, D>) -> f32 {
    assert_eq!(actual.dims(), expected.dims());
    let scale: f32 = expected.clone().abs().max().into_scalar();
    let error: f32 = (actual - expected).abs().max().into_scalar();
    assert!(scale > 0.0, "the expected values are all zero");
    error / scale
}

/// How the frozen part is given to the op under test.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// A tensor of the graph, which must receive `d y`.
    Graph,
    /// The value `x W^T`, with `W`: `d x` includes `d y W`.
    Value,
    /// The whole output, with `W`: only `x A^T` is computed, the gradients are the same.
    Output,
}

fn check(x_needs_grad: bool, mode: Mode) {
    let device = Default::default();
    lemo_test_support::seed_backend::<B>(&device);
    let normal = Distribution::Normal(0.0, 1.0);
    let (batch, len, input, output, rank) = (2, 13, 24, 40, 4);
    let mut x = Tensor::<B, 3>::random([batch, len, input], normal, &device);
    if x_needs_grad {
        x = x.require_grad();
    }
    let weight = Tensor::<B, 2>::random([output, input], normal, &device);
    let a = Tensor::<B, 2>::random([rank, input], normal, &device).require_grad();
    let b = Tensor::<B, 2>::random([output, rank], normal, &device).require_grad();
    let scale = 2.5;
    // A value computed from `x` in the graph: the op must keep it out of the graph.
    let value = x
        .clone()
        .detach()
        .matmul(weight.clone().transpose().unsqueeze());
    let graph_frozen = Tensor::<B, 3>::random([batch, len, output], normal, &device).require_grad();
    let frozen = || match mode {
        Mode::Graph => Frozen::Graph(graph_frozen.clone()),
        Mode::Value => Frozen::Value(value.clone(), weight.clone()),
        Mode::Output => {
            let whole = lora_linear_reference(
                x.clone().detach(),
                Frozen::Value(value.clone().detach(), weight.clone()),
                a.clone().detach(),
                b.clone().detach(),
                scale,
            );
            Frozen::Output(whole, weight.clone())
        }
    };

    let out = lora_linear(x.clone(), frozen(), a.clone(), b.clone(), scale);
    let upstream = out.random_like(normal);
    let grads = (out.clone() * upstream.clone()).sum().backward();
    let expected = lora_linear_reference(x.clone(), frozen(), a.clone(), b.clone(), scale);
    let expected_grads = (expected.clone() * upstream).sum().backward();

    let grad_of = |t: &Tensor<B, 3>, grads| t.grad(grads);
    let mut errors = vec![("out", relative(out, expected))];
    for (name, param) in [("d a", &a), ("d b", &b)] {
        let actual = Tensor::from_inner(param.grad(&grads).unwrap());
        let expected = Tensor::from_inner(param.grad(&expected_grads).unwrap());
        errors.push((name, relative(actual, expected)));
    }
    let mut inputs = vec![("d x", &x, x_needs_grad)];
    if mode == Mode::Graph {
        inputs.push(("d frozen", &graph_frozen, true));
    }
    for (name, input, needs_grad) in inputs {
        let (actual, expected) = (grad_of(input, &grads), grad_of(input, &expected_grads));
        match (needs_grad, actual, expected) {
            (true, Some(actual), Some(expected)) => errors.push((
                name,
                relative(Tensor::from_inner(actual), Tensor::from_inner(expected)),
            )),
            (false, None, None) => {}
            (needs, actual, _) => panic!("{name}: wanted {needs}, got {}", actual.is_some()),
        }
    }
    for (name, error) in errors {
        println!("{name}: {error:.2e}");
        assert!(error < 1e-5, "{name}: relative error {error}");
    }
}

#[test]
fn lora_linear_matches_the_reference_forward_and_backward() {
    check(true, Mode::Graph);
}

#[test]
fn lora_linear_with_its_frozen_weight_gives_the_whole_input_gradient() {
    check(true, Mode::Value);
}

#[test]
fn lora_linear_given_its_output_computes_the_same_gradients() {
    check(true, Mode::Output);
}

#[test]
fn lora_linear_of_an_input_without_gradient() {
    for mode in [Mode::Graph, Mode::Value, Mode::Output] {
        check(false, mode);
    }
}
