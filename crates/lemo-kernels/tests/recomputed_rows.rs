//! Parity of the recomputed backward pass of dropped MLP rows (wgpu, f32) with its plain Burn
//! reference (`recomputed_rows::reference`, differentiated by Burn on every row): the value is
//! `x` unchanged, and `d x` is the upstream gradient plus, on the given rows only, the MLP block's
//! input gradient. SwiGLU after RMSNorm (Llama, Mistral) and ReLU after LayerNorm (OPT), with
//! biases and LoRA adapters on some projections.

use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor};
use lemo_kernels::WgpuBackend;
use lemo_kernels::recomputed_rows::{
    self, FrozenLinear, FrozenMlp, FrozenNorm, MlpActivation, with_recomputed_rows,
};
use lemo_test_support::{HostRng, assert_close, random, random_rows, seed_backend as seed};

type B = Autodiff<WgpuBackend>;

/// f32 GEMMs and reductions in another order than the reference's.
const TOLERANCE: f32 = 1e-4;

fn primitive<const D: usize>(tensor: Tensor<B, D>) -> burn::tensor::ops::FloatTensor<B> {
    tensor.into_primitive().tensor()
}

/// A random projection `[out, input]`, with a bias and a LoRA adapter of rank 2 when asked.
fn linear(out: usize, input: usize, bias: bool, lora: bool) -> FrozenLinear<B> {
    let device = Default::default();
    let scaled = |shape: [usize; 2]| random::<B, 2>(shape, &device) / (shape[1] as f32).sqrt();
    FrozenLinear {
        weight: primitive(scaled([out, input])),
        bias: bias.then(|| primitive(random::<B, 1>([out], &device))),
        lora: lora.then(|| {
            (
                primitive(scaled([2, input])),
                primitive(scaled([out, 2])),
                2.0,
            )
        }),
    }
}

fn near_one(hidden: usize) -> burn::tensor::ops::FloatTensor<B> {
    primitive(random::<B, 1>([hidden], &Default::default()) * 0.5 + 1.0)
}

/// `d x` of `sum(with_recomputed_rows(x) * g)` against the reference's: `g`, plus on `rows`
/// the gradient of `sum(mlp(norm(x)) * g)` there.
fn check(name: &str, mlp: FrozenMlp<B>, batch: usize, seq: usize, hidden: usize, dropped: usize) {
    let device = Default::default();
    let mut rng = HostRng::new(seed::<B>(&device));
    let rows: Tensor<B, 2, Int> = random_rows(&mut rng, batch, seq, dropped, &device);
    let x: Tensor<B, 3> = random([batch, seq, hidden], &device);
    let upstream: Tensor<B, 3> = random([batch, seq, hidden], &device);

    let input = x.clone().require_grad();
    let out = with_recomputed_rows(input.clone() * 1.0, rows.clone(), mlp.clone());
    assert_close(
        &format!("{name} value"),
        out.clone().inner(),
        x.clone().inner(),
        0.0,
    );
    let grads = (out * upstream.clone()).sum().backward();
    let actual = input.grad(&grads).expect("d x");

    let input = x.require_grad();
    let on_rows = Tensor::<B, 3>::zeros([batch, seq, 1], &device)
        .scatter(
            1,
            rows.unsqueeze_dim::<3>(2),
            Tensor::ones([batch, dropped, 1], &device),
            burn::tensor::IndexingUpdateOp::Add,
        )
        .detach();
    let block = recomputed_rows::reference(input.clone(), &mlp);
    let loss = (input.clone() * upstream.clone()).sum() + (block * upstream * on_rows).sum();
    let expected = input.grad(&loss.backward()).expect("d x");
    assert_close(&format!("{name} d x"), actual, expected, TOLERANCE);
}

#[test]
fn swiglu_after_rms_norm_back_propagates_its_dropped_rows_exactly() {
    let (hidden, ffn) = (16, 40);
    let mlp = FrozenMlp {
        norm: FrozenNorm::Rms {
            weight: near_one(hidden),
            eps: 1e-5,
        },
        activation: MlpActivation::SwiGlu,
        inputs: vec![
            linear(ffn, hidden, true, false),
            linear(ffn, hidden, false, true),
        ],
        output: linear(hidden, ffn, false, true),
    };
    check("swiglu", mlp, 2, 24, hidden, 9);
}

#[test]
fn relu_after_layer_norm_back_propagates_its_dropped_rows_exactly() {
    let hidden = 16;
    let mlp = FrozenMlp {
        norm: FrozenNorm::Layer {
            weight: Some(near_one(hidden)),
            bias: Some(primitive(random::<B, 1>([hidden], &Default::default()))),
            eps: 1e-5,
        },
        activation: MlpActivation::Relu,
        inputs: vec![linear(48, hidden, true, true)],
        output: linear(hidden, 48, true, false),
    };
    check("relu", mlp, 3, 20, hidden, 7);
}
