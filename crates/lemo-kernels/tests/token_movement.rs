//! Parity of the token-movement kernels (wgpu, f32) with their plain Burn references
//! (`token_movement::reference`), forward and backward through autodiff, on random inputs and
//! random kept rows per sequence, with the norm saving its input or its output; and the
//! in-place update of the residual stream.

use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor};
use lemo_kernels::WgpuBackend;
use lemo_kernels::fused::NormSaves;
use lemo_kernels::token_movement::{self, reference};
use lemo_test_support::{HostRng, assert_close, random, random_rows, seed_backend as seed};

type B = Autodiff<WgpuBackend>;

/// RMSNorm's tolerance (f32, reductions in another order); moved rows must match exactly.
const NORM_TOLERANCE: f32 = 1e-4;
const EXACT: f32 = 0.0;

/// Inputs of one case: `x [batch, seq, hidden]`, kept rows, a weight near 1.
struct Case {
    x: Tensor<B, 3>,
    rows: Tensor<B, 2, Int>,
    weight: Tensor<B, 1>,
    device: burn::tensor::Device<B>,
}

impl Case {
    fn new(batch: usize, seq: usize, hidden: usize, kept: usize) -> Self {
        let device = Default::default();
        let mut rng = HostRng::new(seed::<B>(&device));
        let rows = random_rows(&mut rng, batch, seq, kept, &device);
        Self {
            x: random([batch, seq, hidden], &device).require_grad(),
            rows,
            weight: (random([hidden], &device) * 0.5 + 1.0).require_grad(),
            device,
        }
    }

    fn kept_shape(&self) -> [usize; 3] {
        let [batch, _, hidden] = self.x.dims();
        [batch, self.rows.dims()[1], hidden]
    }
}

fn grad<const D: usize>(
    tensor: &Tensor<B, D>,
    grads: &<B as burn::tensor::backend::AutodiffBackend>::Gradients,
) -> Tensor<WgpuBackend, D> {
    tensor.grad(grads).expect("gradient")
}

/// Output, `d x` and `d weight` of a case: `None` runs the reference, `Some` the kernels with the
/// norm saving what it says.
type NormRun<'a> =
    &'a dyn Fn(Option<NormSaves>) -> (Tensor<B, 3>, Tensor<WgpuBackend, 3>, Tensor<WgpuBackend, 1>);

/// The kernels, the norm saving its input and then its output, against the reference.
fn compare_with_reference(what: &str, run: NormRun) {
    let (expected, expected_x, expected_weight) = run(None);
    for saves in [NormSaves::Input, NormSaves::Output] {
        let (out, grad_x, grad_weight) = run(Some(saves));
        let name = |value: &str| format!("{what} saving its {saves:?}: {value}");
        assert_close(&name("out"), out, expected.clone(), NORM_TOLERANCE);
        assert_close(&name("d x"), grad_x, expected_x.clone(), NORM_TOLERANCE);
        assert_close(
            &name("d weight"),
            grad_weight,
            expected_weight.clone(),
            NORM_TOLERANCE,
        );
    }
}

/// Gather-RMSNorm alone: output, `d x` (no gradient of `x` before it: the zero-filled path) and
/// `d weight`, whichever the norm saves.
fn gather_rms_norm_alone(batch: usize, seq: usize, hidden: usize, kept: usize) {
    let case = Case::new(batch, seq, hidden, kept);
    let upstream = random(case.kept_shape(), &case.device);
    let run = |fused: Option<NormSaves>| {
        let (x, rows, weight) = (case.x.clone(), case.rows.clone(), case.weight.clone());
        let out = match fused {
            Some(saves) => token_movement::gather_rms_norm(x, rows, weight, 1e-5, saves),
            None => reference::gather_rms_norm(x, rows, weight, 1e-5),
        };
        let grads = (out.clone() * upstream.clone()).sum().backward();
        (out, grad(&case.x, &grads), grad(&case.weight, &grads))
    };
    compare_with_reference("gather_rms_norm", &run);
}

/// A residual block on the kept rows, `h + scatter(f(gather_rms_norm(h)))` with `f` a product
/// with random values, as the models run it: `d x` of the gather is added into the gradient
/// the scatter-add passed through, `d values` is gathered from it.
fn residual_block(batch: usize, seq: usize, hidden: usize, kept: usize) {
    let case = Case::new(batch, seq, hidden, kept);
    let scale = random(case.kept_shape(), &case.device);
    let upstream = random(case.x.dims(), &case.device);
    let run = |fused: Option<NormSaves>| {
        // A tracked intermediate, as the residual stream is inside a model.
        let h = case.x.clone() * 1.0;
        let (rows, weight) = (case.rows.clone(), case.weight.clone());
        let out = match fused {
            Some(saves) => {
                let y =
                    token_movement::gather_rms_norm(h.clone(), rows.clone(), weight, 1e-5, saves);
                token_movement::scatter_add_rows(h, rows, y * scale.clone())
            }
            None => {
                let y = reference::gather_rms_norm(h.clone(), rows.clone(), weight, 1e-5);
                reference::scatter_add_rows(h, rows, y * scale.clone())
            }
        };
        let grads = (out.clone() * upstream.clone()).sum().backward();
        (out, grad(&case.x, &grads), grad(&case.weight, &grads))
    };
    compare_with_reference("residual block", &run);
}

/// Scatter-add and gather on their own: outputs, `d x` and `d values` (exact: rows only move,
/// and the sums are the same f32 additions).
fn move_rows(batch: usize, seq: usize, width: usize, kept: usize) {
    let case = Case::new(batch, seq, width, kept);
    let values = random(case.kept_shape(), &case.device).require_grad();
    let upstream = random(case.x.dims(), &case.device);
    let gathered_upstream = random(case.kept_shape(), &case.device);
    let run = |fused: bool| {
        let (x, rows) = (case.x.clone(), case.rows.clone());
        let (scattered, gathered) = if fused {
            (
                token_movement::scatter_add_rows(x.clone(), rows.clone(), values.clone()),
                token_movement::gather_rows(x, rows),
            )
        } else {
            (
                reference::scatter_add_rows(x.clone(), rows.clone(), values.clone()),
                reference::gather_rows(x, rows),
            )
        };
        let loss = (scattered.clone() * upstream.clone()).sum()
            + (gathered.clone() * gathered_upstream.clone()).sum();
        let grads = loss.backward();
        (
            scattered,
            gathered,
            grad(&case.x, &grads),
            grad(&values, &grads),
        )
    };
    let (scattered, gathered, grad_x, grad_values) = run(true);
    let (expected_scattered, expected_gathered, expected_x, expected_values) = run(false);
    assert_close("scatter_add_rows out", scattered, expected_scattered, EXACT);
    assert_close("gather_rows out", gathered, expected_gathered, EXACT);
    assert_close("scatter/gather d x", grad_x, expected_x, EXACT);
    assert_close(
        "scatter_add_rows d values",
        grad_values,
        expected_values,
        EXACT,
    );

    // The gather's backward on its own (into zeros), and the rows the scatter-add skips.
    let grads = (token_movement::gather_rows(case.x.clone(), case.rows.clone())
        * gathered_upstream.clone())
    .sum()
    .backward();
    let expected =
        reference::scatter_add_rows(case.x.zeros_like(), case.rows.clone(), gathered_upstream)
            .inner();
    assert_close("gather_rows d x", grad(&case.x, &grads), expected, EXACT);
}

#[test]
fn gather_rms_norm_rows_wider_than_a_cube() {
    gather_rms_norm_alone(2, 40, 2052, 17);
}

#[test]
fn gather_rms_norm_odd_hidden() {
    gather_rms_norm_alone(2, 33, 37, 20);
}

#[test]
fn gather_rms_norm_all_rows() {
    gather_rms_norm_alone(2, 29, 64, 29);
}

#[test]
fn residual_block_vectorized() {
    residual_block(2, 50, 256, 23);
}

#[test]
fn residual_block_hidden_not_divisible_by_the_vector() {
    residual_block(2, 31, 1002, 14);
}

#[test]
fn residual_block_all_rows() {
    residual_block(2, 24, 96, 24);
}

#[test]
fn move_rows_odd_width() {
    move_rows(2, 45, 37, 21);
}

#[test]
fn move_rows_width_not_divisible_by_the_vector() {
    move_rows(2, 38, 6, 19);
}

#[test]
fn move_rows_wide_and_all_rows() {
    move_rows(2, 26, 2048, 26);
}

/// Identity of the buffer behind a tensor (the memory handle's id and offset).
fn buffer(tensor: Tensor<WgpuBackend, 3>) -> String {
    let handle = tensor.into_primitive().tensor().handle;
    let memory = format!("{:?}", handle.memory);
    let id_start = memory.find("value: ").expect("memory id");
    let id = &memory[id_start..];
    let id = &id[..id.find('}').expect("memory id end")];
    format!("{id} at {:?}", handle.offset_start)
}

#[test]
fn scatter_add_is_in_place_only_when_unshared() {
    let case = Case::new(2, 30, 64, 12);
    let x = case.x.clone().inner();
    let rows = case.rows.clone().inner();
    let values = random::<WgpuBackend, 3>(case.kept_shape(), &Default::default());
    let expected = reference::scatter_add_rows(x.clone(), rows.clone(), values.clone());

    // Shared: the other owner keeps its data, the result is a new buffer.
    let before = x.clone().into_data();
    let out = token_movement::scatter_add_rows(x.clone(), rows.clone(), values.clone());
    assert_ne!(
        buffer(out.clone()),
        buffer(x.clone()),
        "shared x was written"
    );
    x.clone().into_data().assert_eq(&before, true);
    assert_close("shared scatter-add", out, expected.clone(), EXACT);

    // Unshared: the result is x's own buffer.
    let copy = x.clone() * 1.0;
    let buffer_before = buffer(copy.clone());
    let out = token_movement::scatter_add_rows(copy, rows, values);
    assert_eq!(buffer(out.clone()), buffer_before, "unshared x was copied");
    assert_close("in-place scatter-add", out, expected, EXACT);
}

/// Under autodiff the gather keeps only the kept rows (or its output), so the residual stream
/// stays unshared and the scatter-add that ends the block writes into it.
#[test]
fn residual_stream_updated_in_place_under_autodiff() {
    let case = Case::new(2, 30, 64, 12);
    for saves in [NormSaves::Input, NormSaves::Output] {
        let h = case.x.clone() * 1.0;
        let (rows, weight) = (case.rows.clone(), case.weight.clone());
        let y = token_movement::gather_rms_norm(h.clone(), rows.clone(), weight, 1e-5, saves);
        let buffer_before = buffer(h.clone().inner());
        let out = token_movement::scatter_add_rows(h, rows, y);
        assert_eq!(
            buffer(out.inner()),
            buffer_before,
            "the residual stream was copied (the norm saving its {saves:?})"
        );
    }
}
