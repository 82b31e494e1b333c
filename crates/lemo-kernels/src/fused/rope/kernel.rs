use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::fused::{cube_count, vector_size};

const THREADS: usize = 256;

/// Cubes of `half / N` x `rows_per_cube` threads: `UNIT_POS_X` picks the vector of the first
/// half, the row is the cube's and `UNIT_POS_Y`'s. Each thread reads its vector and the partner
/// in the second half, the angle tables (f32 vectors) at the row's position, and writes both
/// rotated vectors.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_kernel<F: Float, I: Int, N: Size>(
    x: &Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    positions: &Tensor<I>,
    out: &mut Tensor<Vector<F, N>>,
    rows: usize,
    sign: f32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = CUBE_POS * CUBE_DIM_Y as usize + UNIT_POS_Y as usize;
    if row >= rows {
        terminate!();
    }
    let vector = x.vector_size();
    let j = UNIT_POS_X as usize;
    let half_vectors = CUBE_DIM_X as usize;
    let heads = x.shape(1);
    let seq = x.shape(2);
    let s = row % seq;
    let head_row = row / seq;
    let h = head_row % heads;
    let b = head_row / heads;

    let base = (b * x.stride(0) + h * x.stride(1) + s * x.stride(2)) / vector + j;
    let first = Vector::<f32, N>::cast_from(x[base]);
    let second = Vector::<f32, N>::cast_from(x[base + half_vectors]);

    let position = usize::cast_from(positions[b * positions.stride(0) + s * positions.stride(1)]);
    let table = position * half_vectors + j;
    let c = cos[table];
    let t = sin[table] * Vector::new(sign);

    let out_base = (b * out.stride(0) + h * out.stride(1) + s * out.stride(2)) / vector + j;
    out[out_base] = Vector::cast_from(first * c - second * t);
    out[out_base + half_vectors] = Vector::cast_from(second * c + first * t);
}

/// RoPE (or its inverse) of `x [batch, heads, seq, head_dim]` at `positions [batch, seq]`: one
/// thread per pair of `N`-vectors (16 bytes), reads `x` once (any strides with a unit last one, so the
/// `[b, s, h, d] -> [b, h, s, d]` transpose comes free) and writes an output laid out like `x`
/// when `x` is a sequence-major view (so the heads merge back into rows for free), else contiguous.
/// O(numel) bytes plus the table rows, which stay in cache.
pub(crate) fn rope<R: CubeRuntime>(
    x: CubeTensor<R>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    positions: CubeTensor<R>,
    inverse: bool,
) -> CubeTensor<R> {
    assert_eq!(
        x.meta.num_dims(),
        4,
        "RoPE input must be [batch, heads, seq, head_dim]"
    );
    let x = if x.meta.strides()[3] == 1 {
        x
    } else {
        into_contiguous(x)
    };
    let table = |t: CubeTensor<R>| into_contiguous(cast(t, DType::F32));
    let (cos, sin) = (table(cos), table(sin));
    let shape = x.meta.shape().clone();
    let [batch, heads, seq, head_dim] = [shape[0], shape[1], shape[2], shape[3]];
    assert!(head_dim.is_multiple_of(2), "RoPE needs an even head_dim");
    assert_eq!(
        cos.meta.shape()[1],
        head_dim / 2,
        "RoPE tables must be [positions, head_dim / 2]"
    );
    assert_eq!(
        positions.meta.shape().as_slice(),
        &[batch, seq],
        "RoPE positions must be [batch, seq]"
    );
    let client = x.client.clone();
    let sequence_major = [seq * heads * head_dim, head_dim, heads * head_dim, 1];
    let out = if batch * heads * seq > 0 && x.meta.strides()[..] == sequence_major[..] {
        let stored = Shape::new([batch, seq, heads, head_dim]);
        let mut out =
            empty_device_contiguous_dtype(client.clone(), x.device.clone(), stored, x.dtype);
        out.meta.swap(1, 2);
        out
    } else {
        empty_device_contiguous_dtype(client.clone(), x.device.clone(), shape, x.dtype)
    };
    let strides = x.meta.strides();
    let mut vector = vector_size(&x, head_dim / 2);
    while vector > 1 && strides[..3].iter().any(|s| !s.is_multiple_of(vector)) {
        vector /= 2;
    }
    let half_vectors = head_dim / 2 / vector;
    let rows = batch * heads * seq;
    if rows * half_vectors == 0 {
        return out;
    }
    let rows_per_cube = (THREADS / half_vectors).max(1);
    let dtypes = [x.dtype.into(), positions.dtype.into()];
    // SAFETY: the kernel bounds its rows; positions must be below the tables' length (as for
    // the reference's `select`).
    unsafe {
        rope_kernel::launch_unchecked::<R>(
            &client,
            cube_count(&client, rows.div_ceil(rows_per_cube)),
            CubeDim::new_2d(half_vectors as u32, rows_per_cube as u32),
            vector,
            x.into_tensor_arg(),
            cos.into_tensor_arg(),
            sin.into_tensor_arg(),
            positions.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rows,
            if inverse { -1.0 } else { 1.0 },
            dtypes,
        );
    }
    out
}
