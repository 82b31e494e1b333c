//! Plain Burn RMSNorm, forward and backward, in f32 whatever the storage dtype.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::fused::{rows_f32, vector_f32};

/// `(y, rstd)`: the output in `x`'s dtype and shape, and the f32 `1 / rms` of each row, `[rows]`.
pub fn forward<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    eps: f32,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (x, shape, dtype) = rows_f32::<B>(x);
    let rows = x.dims()[0];
    let rstd = x
        .clone()
        .powi_scalar(2)
        .mean_dim(1)
        .add_scalar(eps)
        .sqrt()
        .recip();
    let y = x * rstd.clone() * vector_f32::<B>(weight).unsqueeze::<2>();
    (
        B::float_reshape(y.cast(dtype).into_primitive().tensor(), shape),
        rstd.reshape([rows]).into_primitive().tensor(),
    )
}

/// `d x = r (w g) - x r^3 mean(w g x)` per row, in `x`'s dtype; the weight gradient
/// ([`weight_grad`]) when asked for.
pub fn backward<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    rstd: FloatTensor<B>,
    grad: FloatTensor<B>,
    weight_grad: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let grad_weight =
        weight_grad.then(|| self::weight_grad::<B>(x.clone(), rstd.clone(), grad.clone()));
    let (x, shape, dtype) = rows_f32::<B>(x);
    let (grad, _, _) = rows_f32::<B>(grad);
    let [rows, hidden] = x.dims();
    let rstd = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(rstd)).reshape([rows, 1]);
    let weighted = grad * vector_f32::<B>(weight).unsqueeze::<2>();
    let mean = (weighted.clone() * x.clone()).sum_dim(1) / hidden as f32;
    let grad_x = weighted * rstd.clone() - x * (rstd.powi_scalar(3) * mean);
    (
        B::float_reshape(grad_x.cast(dtype).into_primitive().tensor(), shape),
        grad_weight,
    )
}

/// `d weight = sum over rows of g x r`, in f32 accumulation, returned in `grad`'s dtype.
pub fn weight_grad<B: Backend>(
    x: FloatTensor<B>,
    rstd: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let (x, _, dtype) = rows_f32::<B>(x);
    let (grad, _, _) = rows_f32::<B>(grad);
    let rows = x.dims()[0];
    let rstd = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(rstd)).reshape([rows, 1]);
    let sum = (grad * x * rstd).sum_dim(0);
    let hidden = sum.dims()[1];
    sum.reshape([hidden]).cast(dtype).into_primitive().tensor()
}
