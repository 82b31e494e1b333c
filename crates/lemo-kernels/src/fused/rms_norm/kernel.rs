use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::fused::{NormSaves, cube_count, vector_size};

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

/// Offset of the first vector of row `row` of a `[rows, hidden / N]` tensor, or, with `map`,
/// of row `map[b, i]` of sequence `b` of a `[batch, seq, hidden / N]` tensor for `row = b * kept
/// + i` (token movement: the rows a block of a token-sparse layer keeps).
#[cube]
fn row_start<I: Int>(
    row: usize,
    map: &ComptimeOption<Tensor<I>>,
    seq: usize,
    vectors: usize,
) -> usize {
    #[comptime]
    let row = match map {
        ComptimeOption::Some(map) => (row / map.shape(1)) * seq + usize::cast_from(map[row]),
        ComptimeOption::None => row,
    };
    row * vectors
}

/// One cube per output row of `out [rows, hidden / N]` (vectors of `N`), reading row `rows` of
/// `x` through `gather` (see [`row_start`]): the sum of squares is reduced over the cube, then
/// each thread writes its vectors of the normalized row, and of the input row to `saved`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_forward_kernel<F: Float, I: Int, N: Size>(
    x: &Tensor<Vector<F, N>>,
    gather: &ComptimeOption<Tensor<I>>,
    weight: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    saved: &mut ComptimeOption<Tensor<Vector<F, N>>>,
    rstd: &mut Tensor<f32>,
    rows: usize,
    seq: usize,
    eps: f32,
    #[comptime] threads: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let vectors = weight.len();
    let hidden = vectors * weight.vector_size();
    let source = row_start::<I>(row, gather, seq, vectors);
    let start = row * vectors;
    let unit = UNIT_POS as usize;
    let steps = vectors.div_ceil(threads);

    let mut squares = 0.0f32;
    for step in 0..steps {
        let i = unit + step * threads;
        if i < vectors {
            let value = Vector::<f32, N>::cast_from(x[source + i]);
            squares += lane_sum::<N>(value * value);
        }
    }
    let total = cube_sum(squares, threads);
    let r = 1.0f32 / (total / f32::cast_from(hidden) + eps).sqrt();
    for step in 0..steps {
        let i = unit + step * threads;
        if i < vectors {
            let raw = x[source + i];
            #[comptime]
            if let ComptimeOption::Some(saved) = saved {
                saved[start + i] = raw;
            }
            let value = Vector::<f32, N>::cast_from(raw);
            let scale = Vector::<f32, N>::cast_from(weight[i]);
            out[start + i] = Vector::cast_from(value * scale * Vector::new(r));
        }
    }
    if unit == 0 {
        rstd[row] = r;
    }
}

/// `d x = r (w g) - x r^3 mean(w g x)`, one cube per row of `x [rows, hidden / N]` like the
/// forward. With `from_output`, `x` holds the norm's output `y` and each input value is
/// recovered as `y / (w r)` where it is read. The row is written to row `CUBE_POS` of `grad_x`,
/// or, with `scatter`, added into its row through the map (see [`row_start`]).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_backward_kernel<F: Float, I: Int, N: Size>(
    x: &Tensor<Vector<F, N>>,
    weight: &Tensor<Vector<F, N>>,
    rstd: &Tensor<f32>,
    grad: &Tensor<Vector<F, N>>,
    grad_x: &mut Tensor<Vector<F, N>>,
    scatter: &ComptimeOption<Tensor<I>>,
    rows: usize,
    seq: usize,
    #[comptime] threads: usize,
    #[comptime] from_output: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let vectors = weight.len();
    let hidden = vectors * weight.vector_size();
    let start = row * vectors;
    let target = row_start::<I>(row, scatter, seq, vectors);
    let unit = UNIT_POS as usize;
    let steps = vectors.div_ceil(threads);
    let r = rstd[row];

    let mut dot = 0.0f32;
    for step in 0..steps {
        let i = unit + step * threads;
        if i < vectors {
            let weighted =
                Vector::<f32, N>::cast_from(grad[start + i]) * Vector::cast_from(weight[i]);
            let value = input_value::<F, N>(x[start + i], weight[i], r, from_output);
            dot += lane_sum::<N>(weighted * value);
        }
    }
    let total = cube_sum(dot, threads);
    let correction = r * r * r * total / f32::cast_from(hidden);
    for step in 0..steps {
        let i = unit + step * threads;
        if i < vectors {
            let weighted =
                Vector::<f32, N>::cast_from(grad[start + i]) * Vector::cast_from(weight[i]);
            let value = input_value::<F, N>(x[start + i], weight[i], r, from_output);
            let mut grad_row = weighted * Vector::new(r) - value * Vector::new(correction);
            #[comptime]
            if let ComptimeOption::Some(_) = scatter {
                grad_row += Vector::cast_from(grad_x[target + i]);
            }
            grad_x[target + i] = Vector::cast_from(grad_row);
        }
    }
}

/// The norm's input value, in f32, from what its forward pass saved: the input itself, or,
/// `from_output`, the output `y = x w r`.
#[cube]
fn input_value<F: Float, N: Size>(
    saved: Vector<F, N>,
    weight: Vector<F, N>,
    r: f32,
    #[comptime] from_output: bool,
) -> Vector<f32, N> {
    let value = Vector::<f32, N>::cast_from(saved);
    if from_output {
        value / (Vector::<f32, N>::cast_from(weight) * Vector::new(r))
    } else {
        value
    }
}

fn rows_of<R: CubeRuntime>(x: &CubeTensor<R>) -> (usize, usize) {
    let hidden = x.meta.shape()[x.meta.num_dims() - 1];
    (x.meta.num_elements() / hidden.max(1), hidden)
}

/// Rows of `[batch, seq, hidden]` tensors that a token-sparse block reads or writes:
/// `rows [batch, kept]` (integers in `0..seq`, see [`crate::token_movement`]).
pub(crate) struct RowMap<R: CubeRuntime> {
    pub rows: CubeTensor<R>,
    pub seq: usize,
}

impl<R: CubeRuntime> RowMap<R> {
    pub(crate) fn new(rows: CubeTensor<R>, seq: usize) -> Self {
        Self {
            rows: into_contiguous(rows),
            seq,
        }
    }

    fn arg(map: &Option<Self>) -> (Option<TensorArg<R>>, usize, StorageType) {
        match map {
            Some(map) => (
                Some(map.rows.clone().into_tensor_arg()),
                map.seq,
                map.rows.dtype.into(),
            ),
            None => (None, 0, DType::I32.into()),
        }
    }
}

/// RMSNorm forward `(y, rstd, saved)` of the rows of `x` that `gather` selects (`y [batch, kept,
/// hidden]`), or of every row of `x` without it (`y` shaped like `x`), with a copy of the input
/// rows it read when `save_input`. One cube of 256 threads per output row, two passes over the
/// row (the second from cache): reads each selected row once and writes `y` (and the copy) once,
/// O(output rows * hidden) bytes, no intermediate tensor.
pub(crate) fn forward_rows<R: CubeRuntime>(
    x: CubeTensor<R>,
    gather: Option<RowMap<R>>,
    weight: CubeTensor<R>,
    eps: f32,
    save_input: bool,
) -> (CubeTensor<R>, CubeTensor<R>, Option<CubeTensor<R>>) {
    let x = into_contiguous(x);
    let weight = into_contiguous(weight);
    let hidden = rows_of(&x).1;
    assert_eq!(weight.meta.num_elements(), hidden, "RMSNorm weight size");
    let shape = match &gather {
        Some(map) => {
            let rows = map.rows.meta.shape();
            assert_eq!(
                x.meta.num_dims(),
                3,
                "gathered RMSNorm input must be [batch, seq, hidden]"
            );
            assert_eq!(rows[0], x.meta.shape()[0], "one row set per sequence");
            Shape::from([rows[0], rows[1], hidden])
        }
        None => x.meta.shape().clone(),
    };
    let rows = shape.num_elements() / hidden.max(1);
    let client = x.client.clone();
    let empty = |shape: Shape, dtype| {
        empty_device_contiguous_dtype(client.clone(), x.device.clone(), shape, dtype)
    };
    let out = empty(shape.clone(), x.dtype);
    let saved = save_input.then(|| empty(shape, x.dtype));
    let rstd = empty(Shape::from([rows]), DType::F32);
    if rows == 0 {
        return (out, rstd, saved);
    }
    let vector = vector_size(&x, hidden);
    let (gather_arg, seq, index_dtype) = RowMap::arg(&gather);
    let dtypes = [x.dtype.into(), index_dtype];
    // SAFETY: every index is bounded by `rows` and the weight's length; gathered rows must lie
    // in `0..seq` (the contract of `crate::token_movement`).
    unsafe {
        rms_norm_forward_kernel::launch_unchecked::<R>(
            &client,
            cube_count(&client, rows),
            CubeDim::new_1d(THREADS as u32),
            vector,
            x.into_tensor_arg(),
            gather_arg.into(),
            weight.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            saved.clone().map(|saved| saved.into_tensor_arg()).into(),
            rstd.clone().into_tensor_arg(),
            rows,
            seq,
            eps,
            THREADS,
            dtypes,
        );
    }
    (out, rstd, saved)
}

/// RMSNorm forward of every row of `x`: `(y, rstd)`, see [`forward_rows`].
pub(crate) fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    eps: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (out, rstd, _) = forward_rows(x, None, weight, eps, false);
    (out, rstd)
}

/// RMSNorm backward for `x` (the rows the forward read; the output there where `saves` says
/// so): one cube per row, reads `x` and `d y` once (twice from cache). Without `scatter` it
/// writes `d x` shaped like `x`; with it, `d x` is added into the mapped rows of `target`
/// (contiguous, `x`'s dtype, written in place and returned). O(rows * hidden) bytes either way.
pub(crate) fn backward_rows<R: CubeRuntime>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    rstd: CubeTensor<R>,
    grad: CubeTensor<R>,
    scatter: Option<(RowMap<R>, CubeTensor<R>)>,
    saves: NormSaves,
) -> CubeTensor<R> {
    let x = into_contiguous(x);
    let grad = into_contiguous(grad);
    let weight = into_contiguous(weight);
    let (rows, hidden) = rows_of(&x);
    let client = x.client.clone();
    let (map, grad_x) = match scatter {
        Some((map, target)) => {
            assert!(
                target.is_contiguous() && target.dtype == x.dtype,
                "RMSNorm gradient target must be contiguous in the input's dtype ({:?}, {}contiguous; input {:?})",
                target.dtype,
                if target.is_contiguous() { "" } else { "not " },
                x.dtype
            );
            (Some(map), target)
        }
        None => (
            None,
            empty_device_contiguous_dtype(
                client.clone(),
                x.device.clone(),
                x.meta.shape().clone(),
                x.dtype,
            ),
        ),
    };
    if rows == 0 {
        return grad_x;
    }
    let vector = vector_size(&x, hidden);
    let (map_arg, seq, index_dtype) = RowMap::arg(&map);
    let dtypes = [x.dtype.into(), index_dtype];
    // SAFETY: every index is bounded by `rows` and the weight's length; mapped rows must lie in
    // `0..seq` (the contract of `crate::token_movement`).
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
            map_arg.into(),
            rows,
            seq,
            THREADS,
            saves == NormSaves::Output,
            dtypes,
        );
    }
    grad_x
}

/// RMSNorm backward for `x`: `d x` shaped like `x`, see [`backward_rows`].
pub(crate) fn backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    rstd: CubeTensor<R>,
    grad: CubeTensor<R>,
    saves: NormSaves,
) -> CubeTensor<R> {
    backward_rows(x, weight, rstd, grad, None, saves)
}
