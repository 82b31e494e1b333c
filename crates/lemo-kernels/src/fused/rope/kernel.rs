use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::fused::{cube_count, vector_size};

const THREADS: usize = 256;

/// One thread per (row, vector of the first half): reads the vector and its partner in the
/// second half, the angle tables at the row's position, writes both rotated vectors.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_kernel<F: Float, I: Int, N: Size>(
    x: &Tensor<Vector<F, N>>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    positions: &Tensor<I>,
    out: &mut Tensor<Vector<F, N>>,
    sign: f32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let vector = x.vector_size();
    let heads = x.shape(1);
    let seq = x.shape(2);
    let head_dim = x.shape(3);
    let half = head_dim / 2;
    let half_vectors = half / vector;
    let work = x.shape(0) * heads * seq * half_vectors;
    let index = ABSOLUTE_POS;
    if index >= work {
        terminate!();
    }
    let j = index % half_vectors;
    let row = index / half_vectors;
    let s = row % seq;
    let b = row / (seq * heads);
    let h = (row / seq) % heads;

    let base = b * x.stride(0) + h * x.stride(1) + s * x.stride(2) + j * vector * x.stride(3);
    let first = Vector::<f32, N>::cast_from(x[base / vector]);
    let second = Vector::<f32, N>::cast_from(x[(base + half * x.stride(3)) / vector]);

    let position = usize::cast_from(positions[b * positions.stride(0) + s * positions.stride(1)]);
    let table = position * half + j * vector;
    let mut c = Vector::<f32, N>::empty();
    let mut t = Vector::<f32, N>::empty();
    #[unroll]
    for lane in 0..vector {
        c[lane] = cos[table + lane];
        t[lane] = sin[table + lane] * sign;
    }

    let out_base = (row * head_dim + j * vector) / vector;
    out[out_base] = Vector::cast_from(first * c - second * t);
    out[out_base + half_vectors] = Vector::cast_from(second * c + first * t);
}

/// RoPE (or its inverse) of `x [batch, heads, seq, head_dim]` at `positions [batch, seq]`: one
/// thread per pair of `N`-vectors, reads `x` once (any strides with a unit last one, so the
/// `[b, s, h, d] -> [b, h, s, d]` transpose comes free) and writes a contiguous output.
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
    let out = empty_device_contiguous_dtype(client.clone(), x.device.clone(), shape, x.dtype);
    let strides = x.meta.strides();
    let mut vector = vector_size(&x, head_dim / 2);
    while vector > 1 && strides[..3].iter().any(|s| !s.is_multiple_of(vector)) {
        vector /= 2;
    }
    let work = batch * heads * seq * (head_dim / 2 / vector);
    if work == 0 {
        return out;
    }
    let dtypes = [x.dtype.into(), positions.dtype.into()];
    // SAFETY: the kernel bounds its index by the work size; positions must be below the
    // tables' length (as for the reference's `select`).
    unsafe {
        rope_kernel::launch_unchecked::<R>(
            &client,
            cube_count(&client, work.div_ceil(THREADS)),
            CubeDim::new_1d(THREADS as u32),
            vector,
            x.into_tensor_arg(),
            cos.into_tensor_arg(),
            sin.into_tensor_arg(),
            positions.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            if inverse { -1.0 } else { 1.0 },
            dtypes,
        );
    }
    out
}
