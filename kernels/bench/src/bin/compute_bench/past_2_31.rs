//! The kernels of a long sequence's step on tensors past 2^31 elements (a little over 512K
//! tokens of a 4096-wide model), where an index of 32 signed bits would wrap: RMSNorm and SwiGLU
//! forward and backward, RoPE, gathering and scattering rows, and the GEMMs of a projection (its
//! output, and its weight gradient, whose reduction runs over every row). Each output's last
//! rows, past the 2^31st element, against the reference on those rows alone; the weight gradient
//! against the sum of f32 products over slices of rows. About 35 GB of device memory at the most.

use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};
use lemo_kernels::{FusedBackend, fused, gemm, token_movement};
use serde_json::Value;

use crate::{B, back, device, gpu_relative, prim, random, record};

const WIDTH: usize = 4096;
/// The rows checked, at the end of each tensor.
const TAIL: usize = 256;
/// Rows of `WIDTH` values: 2^31 + 2^20 elements.
const ROWS: usize = (1 << 31) / WIDTH + TAIL;

/// The last `TAIL` rows of `[1, ROWS, width]`.
fn tail(t: Tensor<B, 3>) -> Tensor<B, 3> {
    t.narrow(1, ROWS - TAIL, TAIL)
}

pub fn parity() -> Vec<Value> {
    let mut results = Vec::new();
    let x = random([1, ROWS, WIDTH], DType::BF16);
    let g = random([1, ROWS, WIDTH], DType::BF16);
    rms_norm(&mut results, &x, &g);
    swiglu(&mut results, &x, &g);
    rows(&mut results, &x, g);
    projection(&mut results, x);
    rope(&mut results);
    results
}

fn rms_norm(results: &mut Vec<Value>, x: &Tensor<B, 3>, g: &Tensor<B, 3>) {
    let w = (random([WIDTH], DType::F32) * 0.1 + 1.0).cast(DType::BF16);
    let (out, rstd) =
        B::lemo_rms_norm_forward(prim(x.clone()), w.clone().into_primitive().tensor(), 1e-5);
    let (expected, _) = fused::rms_norm::reference::forward::<B>(
        prim(tail(x.clone())),
        w.clone().into_primitive().tensor(),
        1e-5,
    );
    let error = gpu_relative(tail(back(out)), back(expected));
    record(results, "past_2_31_rms_norm_forward", error);
    let rstd = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(rstd));
    let (dx, _) = B::lemo_rms_norm_backward(
        prim(x.clone()),
        w.clone().into_primitive().tensor(),
        rstd.clone().into_primitive().tensor(),
        prim(g.clone()),
        false,
        fused::NormSaves::Input,
    );
    let (expected, _) = fused::rms_norm::reference::backward::<B>(
        prim(tail(x.clone())),
        w.into_primitive().tensor(),
        rstd.narrow(0, ROWS - TAIL, TAIL).into_primitive().tensor(),
        prim(tail(g.clone())),
        false,
    );
    let error = gpu_relative(tail(back(dx)), back(expected));
    record(results, "past_2_31_rms_norm_backward", error);
}

/// SwiGLU of `gate = 3 x` and `up = g`, its backward pass from the gradient `x`.
fn swiglu(results: &mut Vec<Value>, x: &Tensor<B, 3>, g: &Tensor<B, 3>) {
    let gate = x.clone() * 3.0;
    let (dg, du) = B::lemo_swiglu_backward(prim(gate.clone()), prim(g.clone()), prim(x.clone()));
    let (edg, edu) = fused::swiglu::reference::backward::<B>(
        prim(tail(gate.clone())),
        prim(tail(g.clone())),
        prim(tail(x.clone())),
    );
    record(
        results,
        "past_2_31_swiglu_backward_gate",
        gpu_relative(tail(back(dg)), back(edg)),
    );
    record(
        results,
        "past_2_31_swiglu_backward_up",
        gpu_relative(tail(back(du)), back(edu)),
    );
    let expected =
        fused::swiglu::reference::forward::<B>(prim(tail(gate.clone())), prim(tail(g.clone())));
    let error = gpu_relative(tail(fused::swiglu(gate, g.clone())), back(expected));
    record(results, "past_2_31_swiglu_forward", error);
}

/// The last rows gathered by index, and added back into `g` at those rows.
fn rows(results: &mut Vec<Value>, x: &Tensor<B, 3>, g: Tensor<B, 3>) {
    let rows: Vec<i32> = (ROWS - TAIL..ROWS).map(|r| r as i32).collect();
    let rows = Tensor::<B, 2, Int>::from_data(TensorData::new(rows, [1, TAIL]), &device());
    let gathered = token_movement::gather_rows(x.clone(), rows.clone());
    let error = gpu_relative(gathered.clone(), tail(x.clone()));
    record(results, "past_2_31_gather_rows", error);
    let expected = tail(g.clone()) + tail(x.clone());
    let scattered = token_movement::scatter_add_rows(g, rows, gathered);
    record(
        results,
        "past_2_31_scatter_add_rows",
        gpu_relative(tail(scattered), expected),
    );
}

/// A projection's output and weight gradient: `y = x W^T`, `dW = x^T y`.
fn projection(results: &mut Vec<Value>, x: Tensor<B, 3>) {
    let weight = random([WIDTH, WIDTH], DType::BF16) * 0.02;
    let y = gemm::matmul(x.clone(), weight.clone().transpose().unsqueeze());
    let expected = tail(x.clone())
        .cast(DType::F32)
        .matmul(weight.cast(DType::F32).transpose().unsqueeze());
    let error = gpu_relative(tail(y.clone()), expected);
    record(results, "past_2_31_gemm_output", error);
    let dw = gemm::matmul(x.clone().swap_dims(1, 2), y.clone());
    let slice = 1 << 16;
    let expected = (0..ROWS.div_ceil(slice))
        .map(|i| {
            let rows = slice.min(ROWS - i * slice);
            let x = x.clone().narrow(1, i * slice, rows).cast(DType::F32);
            let y = y.clone().narrow(1, i * slice, rows).cast(DType::F32);
            x.swap_dims(1, 2).matmul(y)
        })
        .reduce(|a, b| a + b)
        .expect("rows");
    record(
        results,
        "past_2_31_gemm_weight_gradient",
        gpu_relative(dw, expected),
    );
}

/// RoPE on queries `[1, heads, ROWS, head_dim]` in the strided layout the projections give.
fn rope(results: &mut Vec<Value>) {
    let (heads, head_dim) = (WIDTH / 128, 128);
    let inv_freq: Vec<f32> = (0..head_dim / 2)
        .map(|i| 500000f32.powf(-2.0 * i as f32 / head_dim as f32))
        .collect();
    let (cos, sin) = fused::rope_tables::<B>(&inv_freq, 1.0, ROWS, &device());
    let positions = Tensor::<B, 1, Int>::arange(0..ROWS as i64, &device()).unsqueeze::<2>();
    let q = random([1, ROWS, heads, head_dim], DType::BF16).swap_dims(1, 2);
    let ours = fused::rope(q.clone(), cos.clone(), sin.clone(), positions.clone());
    let expected =
        Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(fused::rope::reference::rope::<B>(
            q.narrow(2, ROWS - TAIL, TAIL).into_primitive().tensor(),
            cos.into_primitive().tensor(),
            sin.into_primitive().tensor(),
            positions.narrow(1, ROWS - TAIL, TAIL).into_primitive(),
            false,
        )));
    let error = gpu_relative(ours.narrow(2, ROWS - TAIL, TAIL), expected);
    record(results, "past_2_31_rope_forward_strided", error);
}
