use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::fused::{cube_count, vector_size};

/// Threads of the cube that handles one row.
const THREADS: usize = 256;

/// Sum of `value` over the cube, returned to every thread (tree in shared memory).
#[cube]
fn cube_sum(value: f32, #[comptime] threads: usize) -> f32 {
    let mut partial = SharedMemory::<f32>::new(threads);
    let unit = UNIT_POS as usize;
    partial[unit] = value;
    sync_cube();
    let mut stride = comptime!(threads / 2).runtime();
    while stride > 0 {
        if unit < stride {
            partial[unit] = partial[unit] + partial[unit + stride];
        }
        sync_cube();
        stride /= 2;
    }
    partial[0]
}

/// Sum of the lanes of an f32 vector.
#[cube]
fn lane_sum<N: Size>(value: Vector<f32, N>) -> f32 {
    let mut sum = 0.0f32;
    #[unroll]
    for lane in 0..value.vector_size() {
        sum += value[lane];
    }
    sum
}

/// One cube per row of `x [rows, hidden / N]` (vectors of `N`): the sum of squares is reduced
/// over the cube, then each thread writes its vectors of the normalized row.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_forward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    weight: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    rstd: &mut Tensor<f32>,
    rows: usize,
    eps: f32,
    #[comptime] threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let vectors = weight.len();
    let hidden = vectors * weight.vector_size();
    let start = row * vectors;
    let unit = UNIT_POS as usize;
    let steps = vectors.div_ceil(threads);

    let mut squares = 0.0f32;
    for step in 0..steps {
        let i = unit + step * threads;
        if i < vectors {
            let value = Vector::<f32, N>::cast_from(x[start + i]);
            squares += lane_sum::<N>(value * value);
        }
    }
    let total = cube_sum(squares, threads);
    let r = 1.0f32 / (total / f32::cast_from(hidden) + eps).sqrt();
    for step in 0..steps {
        let i = unit + step * threads;
        if i < vectors {
            let value = Vector::<f32, N>::cast_from(x[start + i]);
            let scale = Vector::<f32, N>::cast_from(weight[i]);
            out[start + i] = Vector::cast_from(value * scale * Vector::new(r));
        }
    }
    if unit == 0 {
        rstd[row] = r;
    }
}

/// `d x = r (w g) - x r^3 mean(w g x)`, one cube per row like the forward.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_backward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    weight: &Tensor<Vector<F, N>>,
    rstd: &Tensor<f32>,
    grad: &Tensor<Vector<F, N>>,
    grad_x: &mut Tensor<Vector<F, N>>,
    rows: usize,
    #[comptime] threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let vectors = weight.len();
    let hidden = vectors * weight.vector_size();
    let start = row * vectors;
    let unit = UNIT_POS as usize;
    let steps = vectors.div_ceil(threads);

    let mut dot = 0.0f32;
    for step in 0..steps {
        let i = unit + step * threads;
        if i < vectors {
            let weighted =
                Vector::<f32, N>::cast_from(grad[start + i]) * Vector::cast_from(weight[i]);
            dot += lane_sum::<N>(weighted * Vector::cast_from(x[start + i]));
        }
    }
    let total = cube_sum(dot, threads);
    let r = rstd[row];
    let correction = r * r * r * total / f32::cast_from(hidden);
    for step in 0..steps {
        let i = unit + step * threads;
        if i < vectors {
            let weighted =
                Vector::<f32, N>::cast_from(grad[start + i]) * Vector::cast_from(weight[i]);
            let value = Vector::<f32, N>::cast_from(x[start + i]);
            grad_x[start + i] =
                Vector::cast_from(weighted * Vector::new(r) - value * Vector::new(correction));
        }
    }
}

fn rows_of<R: CubeRuntime>(x: &CubeTensor<R>) -> (usize, usize) {
    let hidden = x.meta.shape()[x.meta.num_dims() - 1];
    (x.meta.num_elements() / hidden.max(1), hidden)
}

/// RMSNorm forward: one cube of 256 threads per row, two passes over the row (the second from
/// cache). Reads `x` once and writes `y` once: O(rows * hidden) bytes, no intermediate tensor.
pub(crate) fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    eps: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let x = into_contiguous(x);
    let weight = into_contiguous(weight);
    let (rows, hidden) = rows_of(&x);
    assert_eq!(weight.meta.num_elements(), hidden, "RMSNorm weight size");
    let client = x.client.clone();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        x.meta.shape().clone(),
        x.dtype,
    );
    let rstd = empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        Shape::from([rows]),
        DType::F32,
    );
    if rows == 0 {
        return (out, rstd);
    }
    let vector = vector_size(&x, hidden);
    let dtype = x.dtype;
    // SAFETY: every index is bounded by `rows` and the weight's length.
    unsafe {
        rms_norm_forward_kernel::launch_unchecked::<R>(
            &client,
            cube_count(&client, rows),
            CubeDim::new_1d(THREADS as u32),
            vector,
            x.into_tensor_arg(),
            weight.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rstd.clone().into_tensor_arg(),
            rows,
            eps,
            THREADS,
            dtype.into(),
        );
    }
    (out, rstd)
}

/// RMSNorm backward for `x`: one cube per row, reads `x` and `d y` once (twice from cache) and
/// writes `d x`: O(rows * hidden) bytes.
pub(crate) fn backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    rstd: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> CubeTensor<R> {
    let x = into_contiguous(x);
    let grad = into_contiguous(grad);
    let weight = into_contiguous(weight);
    let (rows, hidden) = rows_of(&x);
    let client = x.client.clone();
    let grad_x = empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        x.meta.shape().clone(),
        x.dtype,
    );
    if rows == 0 {
        return grad_x;
    }
    let vector = vector_size(&x, hidden);
    let dtype = x.dtype;
    // SAFETY: every index is bounded by `rows` and the weight's length.
    unsafe {
        rms_norm_backward_kernel::launch_unchecked::<R>(
            &client,
            cube_count(&client, rows),
            CubeDim::new_1d(THREADS as u32),
            vector,
            x.into_tensor_arg(),
            weight.into_tensor_arg(),
            rstd.into_tensor_arg(),
            grad.into_tensor_arg(),
            grad_x.clone().into_tensor_arg(),
            rows,
            THREADS,
            dtype.into(),
        );
    }
    grad_x
}
