//! Plain Burn LayerNorm with constant parameters, forward and backward, in f32 whatever the
//! storage dtype.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};

use crate::fused::{NormSaves, rows_f32, vector_f32};

/// `[1, hidden]` f32 row of a parameter.
fn row_f32<B: Backend>(t: &FloatTensor<B>) -> Tensor<B, 2> {
    vector_f32::<B>(t.clone()).unsqueeze()
}

/// `(y, rstd)`: the output in `x`'s dtype and shape, and the f32 `1 / sqrt(var + eps)` of each
/// row, `[rows]`.
pub fn forward<B: Backend>(
    x: FloatTensor<B>,
    weight: Option<&FloatTensor<B>>,
    bias: Option<&FloatTensor<B>>,
    eps: f32,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (x, shape, dtype) = rows_f32::<B>(x);
    let rows = x.dims()[0];
    let centered = x.clone() - x.mean_dim(1);
    let rstd = centered
        .clone()
        .square()
        .mean_dim(1)
        .add_scalar(eps)
        .sqrt()
        .recip();
    let mut y = centered * rstd.clone();
    if let Some(weight) = weight {
        y = y * row_f32::<B>(weight);
    }
    if let Some(bias) = bias {
        y = y + row_f32::<B>(bias);
    }
    (
        B::float_reshape(y.cast(dtype).into_primitive().tensor(), shape),
        rstd.reshape([rows]).into_primitive().tensor(),
    )
}

/// `d x = r (g - mean(g) - x_hat mean(g x_hat))`, `g = w d y`, per row, in `grad`'s dtype and
/// shape; `x_hat` (the normalized input) from `saved`: the input, or the output
/// (`x_hat = (y - b) / w`) where `saves` says so.
pub fn backward<B: Backend>(
    saved: FloatTensor<B>,
    weight: Option<&FloatTensor<B>>,
    bias: Option<&FloatTensor<B>>,
    rstd: FloatTensor<B>,
    grad: FloatTensor<B>,
    saves: NormSaves,
) -> FloatTensor<B> {
    let (shape, dtype) = (grad.shape(), grad.dtype());
    let (saved, _, _) = rows_f32::<B>(saved);
    let [rows, hidden] = saved.dims();
    let rstd = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(rstd)).reshape([rows, 1]);
    let normalized = match saves {
        NormSaves::Input => (saved.clone() - saved.mean_dim(1)) * rstd.clone(),
        NormSaves::Output => {
            let mut shifted = saved;
            if let Some(bias) = bias {
                shifted = shifted - row_f32::<B>(bias);
            }
            match weight {
                Some(weight) => shifted / row_f32::<B>(weight),
                None => shifted,
            }
        }
    };
    let (mut g, _, _) = rows_f32::<B>(grad);
    if let Some(weight) = weight {
        g = g * row_f32::<B>(weight);
    }
    let mean_g = g.clone().sum_dim(1) / hidden as f32;
    let mean_gx = (g.clone() * normalized.clone()).sum_dim(1) / hidden as f32;
    let grad_x = (g - mean_g - normalized * mean_gx) * rstd;
    B::float_reshape(grad_x.cast(dtype).into_primitive().tensor(), shape)
}
