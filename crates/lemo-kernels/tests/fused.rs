//! Parity of the fused RMSNorm, RoPE and SwiGLU kernels and the LayerNorm op (wgpu, f32) with
//! their plain Burn references, forward and backward (both through autodiff), on fresh random
//! inputs.

use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};
use lemo_kernels::WgpuBackend;
use lemo_kernels::fused::{self, NormSaves, layer_norm, rms_norm, rope, swiglu};
use lemo_test_support::seed_backend as seed;

type B = Autodiff<WgpuBackend>;

const TOLERANCE: f32 = 1e-4;

fn seeded() -> burn::tensor::Device<B> {
    let device = Default::default();
    seed::<B>(&device);
    device
}

fn random<const D: usize>(shape: [usize; D], device: &burn::tensor::Device<B>) -> Tensor<B, D> {
    lemo_test_support::random(shape, device)
}

fn assert_close<const D: usize>(name: &str, actual: Tensor<B, D>, expected: Tensor<B, D>) {
    lemo_test_support::assert_close(name, actual, expected, TOLERANCE);
}

/// Output, `d x` and `d weight` against the reference, whichever the norm saves.
fn rms_norm_case(shape: [usize; 3]) {
    let device = seeded();
    let x = random(shape, &device).require_grad();
    let weight = (random([shape[2]], &device) * 0.5 + 1.0).require_grad();
    let upstream = random(shape, &device);

    let (expected, _) = fused::rms_norm::reference::forward::<B>(
        x.clone().into_primitive().tensor(),
        weight.clone().into_primitive().tensor(),
        1e-5,
    );
    let expected = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(expected));
    let grads = (expected.clone() * upstream.clone()).sum().backward();
    let (expected_x, expected_w) = (x.grad(&grads).unwrap(), weight.grad(&grads).unwrap());

    for saves in [NormSaves::Input, NormSaves::Output] {
        let out = rms_norm(x.clone(), weight.clone(), 1e-5, saves);
        let grads = (out.clone() * upstream.clone()).sum().backward();
        let (grad_x, grad_w) = (x.grad(&grads).unwrap(), weight.grad(&grads).unwrap());
        let name = |what: &str| format!("rms_norm saving its {saves:?}: {what}");
        assert_close(&name("out"), out, expected.clone());
        assert_close(
            &name("d x"),
            Tensor::from_inner(grad_x),
            Tensor::from_inner(expected_x.clone()),
        );
        assert_close(
            &name("d weight"),
            Tensor::from_inner(grad_w),
            Tensor::from_inner(expected_w.clone()),
        );
    }
}

/// LayerNorm with constant parameters, `x`'s gradient, whichever the op saves, against the same
/// chain of plain tensor ops under autodiff (with and without a weight and a bias).
fn layer_norm_case(shape: [usize; 3], affine: bool) {
    let device = seeded();
    let x = random(shape, &device).require_grad();
    let weight = affine.then(|| random::<1>([shape[2]], &device) * 0.5 + 1.0);
    let bias = affine.then(|| random::<1>([shape[2]], &device) * 0.1);
    let upstream = random(shape, &device);

    let centered = x.clone() - x.clone().mean_dim(2);
    let variance = centered.clone().square().mean_dim(2);
    let mut expected = centered / variance.add_scalar(1e-5).sqrt();
    if let Some(weight) = &weight {
        expected = expected * weight.clone().unsqueeze();
    }
    if let Some(bias) = &bias {
        expected = expected + bias.clone().unsqueeze();
    }
    let grads = (expected.clone() * upstream.clone()).sum().backward();
    let expected_x = x.grad(&grads).unwrap();

    for saves in [NormSaves::Input, NormSaves::Output] {
        let out = layer_norm(x.clone(), weight.clone(), bias.clone(), 1e-5, saves);
        let grads = (out.clone() * upstream.clone()).sum().backward();
        let name = |what: &str| format!("layer_norm saving its {saves:?}: {what}");
        assert_close(&name("out"), out, expected.clone());
        assert_close(
            &name("d x"),
            Tensor::from_inner(x.grad(&grads).unwrap()),
            Tensor::from_inner(expected_x.clone()),
        );
    }
}

#[test]
fn layer_norm_with_weight_and_bias() {
    layer_norm_case([2, 5, 300], true);
}

#[test]
fn layer_norm_without_parameters() {
    layer_norm_case([3, 4, 64], false);
}

#[test]
fn rms_norm_rows_wider_than_a_cube() {
    rms_norm_case([2, 5, 1000]);
}

#[test]
fn rms_norm_vectorized_width() {
    rms_norm_case([3, 7, 256]);
}

fn rope_case(batch: usize, heads: usize, seq: usize, head_dim: usize, strided: bool) {
    let device = seeded();
    let half = head_dim / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / head_dim as f32))
        .collect();
    let max_position = 4 * seq;
    // A YaRN-like temperature on the tables: the backward pass rotates by the same scaled
    // tables' inverse, which is the gradient only because the scale multiplies cos and sin alike.
    let (cos, sin) = fused::rope_tables::<B>(&inv_freq, 1.25, max_position, &device);
    // Kept tokens: increasing, with gaps, different per batch row.
    let positions: Vec<i32> = (0..batch * seq)
        .map(|i| ((i % seq) * 3 + (i / seq) + (i % 5 == 0) as usize) as i32)
        .collect();
    let positions =
        Tensor::<B, 2, Int>::from_data(TensorData::new(positions, [batch, seq]), &device);
    let x = if strided {
        random([batch, seq, heads, head_dim], &device).swap_dims(1, 2)
    } else {
        random([batch, heads, seq, head_dim], &device)
    };
    let x = x.detach().require_grad();
    let upstream = random([batch, heads, seq, head_dim], &device);

    let out = rope(x.clone(), cos.clone(), sin.clone(), positions.clone());
    let grads = (out.clone() * upstream.clone()).sum().backward();
    let grad_x = x.grad(&grads).unwrap();

    let expected =
        Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(fused::rope::reference::rope::<B>(
            x.clone().into_primitive().tensor(),
            cos.into_primitive().tensor(),
            sin.into_primitive().tensor(),
            positions.into_primitive(),
            false,
        )));
    let grads = (expected.clone() * upstream).sum().backward();
    assert_close("rope out", out, expected);
    assert_close(
        "rope d x",
        Tensor::from_inner(grad_x),
        Tensor::from_inner(x.grad(&grads).unwrap()),
    );
}

#[test]
fn rope_contiguous() {
    rope_case(2, 3, 33, 64, false);
}

#[test]
fn rope_strided_heads() {
    rope_case(1, 4, 17, 32, true);
}

#[test]
fn rope_odd_half() {
    rope_case(1, 2, 9, 6, false);
}

#[test]
fn swiglu_forward_backward() {
    let device = seeded();
    let shape = [3, 37, 96];
    let gate = (random(shape, &device) * 3.0).require_grad();
    let up = random(shape, &device).require_grad();
    let upstream = random(shape, &device);

    let out = swiglu(gate.clone(), up.clone());
    let grads = (out.clone() * upstream.clone()).sum().backward();
    let (grad_gate, grad_up) = (gate.grad(&grads).unwrap(), up.grad(&grads).unwrap());

    let expected = burn::tensor::activation::silu(gate.clone()) * up.clone();
    let grads = (expected.clone() * upstream).sum().backward();
    assert_close("swiglu out", out, expected);
    assert_close(
        "swiglu d gate",
        Tensor::from_inner(grad_gate),
        Tensor::from_inner(gate.grad(&grads).unwrap()),
    );
    assert_close(
        "swiglu d up",
        Tensor::from_inner(grad_up),
        Tensor::from_inner(up.grad(&grads).unwrap()),
    );
}
