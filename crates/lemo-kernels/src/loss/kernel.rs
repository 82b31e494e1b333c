use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::fused::{cube_count, vector_size};

const THREADS: usize = 256;
/// Start of a running maximum (finite: WGSL has no infinity literal).
const LOWEST: f32 = -3.0e38;

/// One cube per row of `logits [rows, V / N]`: each thread keeps a running max and sum of
/// exponentials over its vectors (online softmax), the cube merges them into the row's
/// `logsumexp`; thread 0 writes the loss, and with `with_grad` every thread writes
/// `softmax - one_hot` for its vectors (zero for ignored rows).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn cross_entropy_kernel<F: Float, I: Int, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    targets: &Tensor<I>,
    losses: &mut Tensor<f32>,
    grad: &mut Tensor<Vector<F, N>>,
    rows: usize,
    #[comptime] threads: usize,
    #[comptime] with_grad: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let vector = logits.vector_size();
    let vectors = logits.shape(1) / vector;
    let start = row * vectors;
    let unit = UNIT_POS as usize;
    let steps = vectors.div_ceil(threads);

    let mut running_max = f32::new(LOWEST);
    let mut sum = 0.0f32;
    for step in 0..steps {
        let i = unit + step * threads;
        if i < vectors {
            let values = Vector::<f32, N>::cast_from(logits[start + i]);
            let mut local = f32::new(LOWEST);
            #[unroll]
            for lane in 0..vector {
                local = max(local, values[lane]);
            }
            let new_max = max(running_max, local);
            let mut part = 0.0f32;
            #[unroll]
            for lane in 0..vector {
                part += (values[lane] - new_max).exp();
            }
            sum = sum * (running_max - new_max).exp() + part;
            running_max = new_max;
        }
    }

    let mut maxima = SharedMemory::<f32>::new(threads);
    let mut sums = SharedMemory::<f32>::new(threads);
    maxima[unit] = running_max;
    sums[unit] = sum;
    sync_cube();
    let mut stride = comptime!(threads / 2).runtime();
    while stride > 0 {
        if unit < stride {
            let (m1, m2) = (maxima[unit], maxima[unit + stride]);
            let m = max(m1, m2);
            sums[unit] = sums[unit] * (m1 - m).exp() + sums[unit + stride] * (m2 - m).exp();
            maxima[unit] = m;
        }
        sync_cube();
        stride /= 2;
    }
    let lse = maxima[0] + sums[0].ln();

    let target = i32::cast_from(targets[row]);
    let valid = target >= 0;
    let target = usize::cast_from(max(target, 0i32));
    if unit == 0 {
        let mut loss = 0.0f32;
        if valid {
            let picked = logits[start + target / vector];
            loss = lse - f32::cast_from(picked[target % vector]);
        }
        losses[row] = loss;
    }
    if with_grad {
        for step in 0..steps {
            let i = unit + step * threads;
            if i < vectors {
                let values = Vector::<f32, N>::cast_from(logits[start + i]);
                let mut probs = (values - Vector::new(lse)).exp();
                if !valid {
                    probs = Vector::new(0.0f32);
                } else if i == target / vector {
                    let lane = target % vector;
                    probs[lane] = probs[lane] - 1.0;
                }
                grad[start + i] = Vector::cast_from(probs);
            }
        }
    }
}

/// Per-row cross-entropy of `logits [rows, V]` (and its gradient with `with_grad`): one cube of
/// 256 threads per row, one read of the row for the online `logsumexp` and, for the gradient,
/// a second read (from L2) and one write. O(rows * V) bytes, O(rows * V) exponentials.
pub(crate) fn cross_entropy_rows<R: CubeRuntime>(
    logits: CubeTensor<R>,
    targets: CubeTensor<R>,
    with_grad: bool,
) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
    let logits = into_contiguous(logits);
    let targets = into_contiguous(targets);
    let [rows, vocab] = [logits.meta.shape()[0], logits.meta.shape()[1]];
    let client = logits.client.clone();
    let device = logits.device.clone();
    let losses = empty_device_contiguous_dtype(
        client.clone(),
        device.clone(),
        Shape::from([rows]),
        DType::F32,
    );
    let vector = vector_size(&logits, vocab);
    // Without a gradient the kernel writes nothing there: a one-vector stand-in.
    let grad_shape = if with_grad {
        [rows, vocab]
    } else {
        [1, vector]
    };
    let grad = empty_device_contiguous_dtype(
        client.clone(),
        device,
        Shape::from(grad_shape),
        logits.dtype,
    );
    if rows == 0 {
        return (losses, with_grad.then_some(grad));
    }
    let dtypes = [logits.dtype.into(), targets.dtype.into()];
    // SAFETY: rows are bounded by `rows`; targets must be below the vocabulary size (as for the
    // reference's `gather`).
    unsafe {
        cross_entropy_kernel::launch_unchecked::<R>(
            &client,
            cube_count(&client, rows),
            CubeDim::new_1d(THREADS as u32),
            vector,
            logits.into_tensor_arg(),
            targets.into_tensor_arg(),
            losses.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            rows,
            THREADS,
            with_grad,
            dtypes,
        );
    }
    (losses, with_grad.then_some(grad))
}
