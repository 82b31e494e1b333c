use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::fused::{ELEMENTWISE_THREADS, elementwise_grid, empty_like};

#[cube]
fn sigmoid<N: Size>(x: Vector<f32, N>) -> Vector<f32, N> {
    // (CUDA C++ has no unary minus on cubecl's vector types.)
    Vector::new(1.0f32) / (Vector::new(1.0f32) + (Vector::new(0.0f32) - x).exp())
}

/// One thread per `N`-vector: `out = silu(gate) * up`.
#[cube(launch_unchecked)]
fn swiglu_forward_kernel<F: Float, N: Size>(
    gate: &Tensor<Vector<F, N>>,
    up: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let g = Vector::<f32, N>::cast_from(gate[i]);
    out[i] = Vector::cast_from(g * sigmoid::<N>(g) * Vector::cast_from(up[i]));
}

/// One thread per `N`-vector: both gradients from `gate`, `up` and `d out`.
#[cube(launch_unchecked)]
fn swiglu_backward_kernel<F: Float, N: Size>(
    gate: &Tensor<Vector<F, N>>,
    up: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    grad_gate: &mut Tensor<Vector<F, N>>,
    grad_up: &mut Tensor<Vector<F, N>>,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= grad_up.len() {
        terminate!();
    }
    let g = Vector::<f32, N>::cast_from(gate[i]);
    let u = Vector::<f32, N>::cast_from(up[i]);
    let d = Vector::<f32, N>::cast_from(grad[i]);
    let s = sigmoid::<N>(g);
    let one = Vector::new(1.0f32);
    grad_gate[i] = Vector::cast_from(d * u * s * (one + g * (one - s)));
    grad_up[i] = Vector::cast_from(d * g * s);
}

/// SwiGLU forward: one thread per 16-byte vector, reads `gate` and `up` once, writes `out` once
/// (3 x numel x dtype bytes).
pub(crate) fn forward<R: CubeRuntime>(gate: CubeTensor<R>, up: CubeTensor<R>) -> CubeTensor<R> {
    assert_eq!(
        gate.meta.shape(),
        up.meta.shape(),
        "SwiGLU gate and up shapes differ"
    );
    let (gate, up) = (into_contiguous(gate), into_contiguous(up));
    let out = empty_like(&gate);
    let elements = out.meta.num_elements();
    if elements == 0 {
        return out;
    }
    let (vector, count) = elementwise_grid(&gate, elements);
    let (client, dtype) = (gate.client.clone(), gate.dtype);
    // SAFETY: the kernel bounds its index by the output length.
    unsafe {
        swiglu_forward_kernel::launch_unchecked::<R>(
            &client,
            count,
            CubeDim::new_1d(ELEMENTWISE_THREADS as u32),
            vector,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            dtype.into(),
        );
    }
    out
}

/// SwiGLU backward: one thread per 16-byte vector, reads `gate`, `up`, `d out` once and writes
/// both gradients once (5 x numel x dtype bytes).
pub(crate) fn backward<R: CubeRuntime>(
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (gate, up, grad) = (
        into_contiguous(gate),
        into_contiguous(up),
        into_contiguous(grad),
    );
    let (grad_gate, grad_up) = (empty_like(&gate), empty_like(&gate));
    let elements = gate.meta.num_elements();
    if elements == 0 {
        return (grad_gate, grad_up);
    }
    let (vector, count) = elementwise_grid(&gate, elements);
    let (client, dtype) = (gate.client.clone(), gate.dtype);
    // SAFETY: the kernel bounds its index by the output length.
    unsafe {
        swiglu_backward_kernel::launch_unchecked::<R>(
            &client,
            count,
            CubeDim::new_1d(ELEMENTWISE_THREADS as u32),
            vector,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            grad.into_tensor_arg(),
            grad_gate.clone().into_tensor_arg(),
            grad_up.clone().into_tensor_arg(),
            dtype.into(),
        );
    }
    (grad_gate, grad_up)
}
