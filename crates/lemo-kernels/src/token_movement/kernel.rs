//! CubeCL kernels of token movement. Gather-RMSNorm and its backward are the RMSNorm kernels
//! reading (writing) their rows through the row map (see [`crate::fused::rms_norm`]); the
//! scatter-add and the gather move `N`-vectors (16 bytes) of whole rows, one thread each.

use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use crate::fused::rms_norm::kernel::{RowMap, backward_rows, forward_rows};
use crate::fused::{NormSaves, vector_size};

/// `x[b, rows[b, i]] += values[b, i]` in f32, one thread per `N`-vector of `values [batch * kept,
/// vectors]`; `x` is `[batch * seq, vectors]`. Rows outside `0..seq` are skipped.
#[cube(launch_unchecked)]
fn scatter_add_kernel<F: Float, V: Float, I: Int, N: Size>(
    x: &mut Tensor<Vector<F, N>>,
    rows: &Tensor<I>,
    values: &Tensor<Vector<V, N>>,
    seq: usize,
    vectors: usize,
    #[define(F, V, I)] _dtypes: [StorageType; 3],
) {
    let position = ABSOLUTE_POS;
    if position >= values.len() {
        terminate!();
    }
    let kept_row = position / vectors;
    let row = usize::cast_from(rows[kept_row]);
    if row < seq {
        let target = ((kept_row / rows.shape(1)) * seq + row) * vectors + position % vectors;
        let sum = Vector::<f32, N>::cast_from(x[target]) + Vector::cast_from(values[position]);
        x[target] = Vector::cast_from(sum);
    }
}

/// `out[b, i] = x[b, rows[b, i]]`, one thread per `N`-vector of `out [batch * kept, vectors]`;
/// `x` is `[batch * seq, vectors]`.
#[cube(launch_unchecked)]
fn gather_kernel<F: Float, I: Int, N: Size>(
    x: &Tensor<Vector<F, N>>,
    rows: &Tensor<I>,
    out: &mut Tensor<Vector<F, N>>,
    seq: usize,
    vectors: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let position = ABSOLUTE_POS;
    if position >= out.len() {
        terminate!();
    }
    let kept_row = position / vectors;
    let row = usize::cast_from(rows[kept_row]);
    let source = ((kept_row / rows.shape(1)) * seq + row) * vectors + position % vectors;
    out[position] = x[source];
}

/// `tensor` itself when this handle is its only owner and it is contiguous (so a kernel may
/// write into it), else a contiguous copy.
fn exclusive<R: CubeRuntime>(tensor: CubeTensor<R>) -> CubeTensor<R> {
    match (tensor.can_mut(), tensor.is_contiguous()) {
        (true, true) => tensor,
        (false, true) => into_contiguous(tensor.copy()),
        (_, false) => into_contiguous(tensor),
    }
}

/// `[batch, kept]` and the width of `[batch, seq, width]` token-movement operands.
fn dims<R: CubeRuntime>(x: &CubeTensor<R>, rows: &CubeTensor<R>) -> ([usize; 3], usize) {
    let shape = x.meta.shape();
    assert_eq!(
        x.meta.num_dims(),
        3,
        "token rows must be [batch, seq, width]"
    );
    let kept = rows.meta.shape();
    assert_eq!(
        (kept.num_dims(), kept[0]),
        (2, shape[0]),
        "rows must be [batch, kept]"
    );
    ([shape[0], shape[1], shape[2]], kept[1])
}

/// Gather-RMSNorm forward: `(y [batch, kept, hidden], rstd [batch * kept], saved rows)`, the
/// kept input rows saved when `save_input`. One cube per kept row: reads the kept rows of `x`
/// once, writes `y` (and the copy) once: O(batch * kept * hidden) bytes, nothing of size `seq`.
pub(crate) fn gather_rms_norm<R: CubeRuntime>(
    x: CubeTensor<R>,
    rows: CubeTensor<R>,
    weight: CubeTensor<R>,
    eps: f32,
    save_input: bool,
) -> (CubeTensor<R>, CubeTensor<R>, Option<CubeTensor<R>>) {
    let ([_, seq, _], _) = dims(&x, &rows);
    forward_rows(x, Some(RowMap::new(rows, seq)), weight, eps, save_input)
}

/// Gather-RMSNorm backward for `x`: the RMSNorm gradient of the saved kept rows (or of the
/// output, see [`NormSaves`]), added into
/// their rows of `grad_x` (the gradient `x` already has; in place when it is exclusively owned)
/// or of zeros `[batch, seq, hidden]`. One cube per kept row: O(batch * kept * hidden) bytes,
/// plus writing the zeros when there is no gradient yet.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gather_rms_norm_backward<R: CubeRuntime>(
    saved: CubeTensor<R>,
    rows: CubeTensor<R>,
    weight: CubeTensor<R>,
    rstd: CubeTensor<R>,
    grad: CubeTensor<R>,
    grad_x: Option<CubeTensor<R>>,
    seq: usize,
    saves: NormSaves,
) -> CubeTensor<R> {
    let ([batch, _, hidden], _) = dims(&saved, &rows);
    let target = match grad_x {
        Some(grad_x) if grad_x.dtype == saved.dtype => exclusive(grad_x),
        Some(grad_x) => into_contiguous(cast(grad_x, saved.dtype)),
        // The pool may pitch a new tensor's rows (row widths it does not align); the row map
        // addresses rows contiguously.
        None => into_contiguous(zeros_client(
            saved.client.clone(),
            saved.device.clone(),
            Shape::from([batch, seq, hidden]),
            saved.dtype,
        )),
    };
    assert_eq!(
        target.meta.shape().as_slice(),
        &[batch, seq, hidden],
        "gradient of the gathered input"
    );
    backward_rows(
        saved,
        weight,
        rstd,
        grad,
        Some((RowMap::new(rows, seq), target)),
        saves,
    )
}

/// `x[b, rows[b, i]] += values[b, i]` (values cast to `x`'s dtype, the sum taken in f32), in
/// place when `x` is exclusively owned and contiguous, else on a copy. One thread per 16-byte
/// vector of `values`: reads `values` and the kept rows of `x` once and writes those rows once,
/// O(batch * kept * width) bytes (plus the copy of `x` when it is shared).
pub(crate) fn scatter_add_rows<R: CubeRuntime>(
    x: CubeTensor<R>,
    rows: CubeTensor<R>,
    values: CubeTensor<R>,
) -> CubeTensor<R> {
    let ([batch, seq, width], kept) = dims(&x, &rows);
    assert_eq!(
        values.meta.shape().as_slice(),
        &[batch, kept, width],
        "scatter-add values must be [batch, kept, width]"
    );
    let x = exclusive(x);
    let values = into_contiguous(values);
    let rows = into_contiguous(rows);
    let units = values.meta.num_elements();
    if units == 0 {
        return x;
    }
    let vector = vector_size(&x, width).min(vector_size(&values, width));
    let units = units / vector;
    let client = x.client.clone();
    let cube_dim = CubeDim::new(&client, units);
    let dtypes = [x.dtype.into(), values.dtype.into(), rows.dtype.into()];
    // SAFETY: threads past `values` stop; rows outside `0..seq` are skipped.
    unsafe {
        scatter_add_kernel::launch_unchecked::<R>(
            &client,
            calculate_cube_count_elemwise(&client, units, cube_dim),
            cube_dim,
            vector,
            x.clone().into_tensor_arg(),
            rows.into_tensor_arg(),
            values.into_tensor_arg(),
            seq,
            width / vector,
            dtypes,
        );
    }
    x
}

/// `x[b, rows[b, i]]`, `[batch, kept, width]`. One thread per 16-byte vector of the output: reads
/// the kept rows once and writes them once, O(batch * kept * width) bytes.
pub(crate) fn gather_rows<R: CubeRuntime>(x: CubeTensor<R>, rows: CubeTensor<R>) -> CubeTensor<R> {
    let ([batch, seq, width], kept) = dims(&x, &rows);
    let x = into_contiguous(x);
    let rows = into_contiguous(rows);
    let client = x.client.clone();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        Shape::from([batch, kept, width]),
        x.dtype,
    );
    let vector = vector_size(&x, width);
    let units = out.meta.num_elements() / vector;
    if units == 0 {
        return out;
    }
    let cube_dim = CubeDim::new(&client, units);
    let dtypes = [x.dtype.into(), rows.dtype.into()];
    // SAFETY: threads past `out` stop; rows must lie in `0..seq` (the contract of
    // `crate::token_movement`).
    unsafe {
        gather_kernel::launch_unchecked::<R>(
            &client,
            calculate_cube_count_elemwise(&client, units, cube_dim),
            cube_dim,
            vector,
            x.into_tensor_arg(),
            rows.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            seq,
            width / vector,
            dtypes,
        );
    }
    out
}
