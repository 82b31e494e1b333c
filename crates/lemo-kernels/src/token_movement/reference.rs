//! Token movement in plain Burn tensor ops (`select` / `select_assign` on the flattened rows):
//! what the kernels are checked against, and the path of backends without kernels.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorPrimitive};

/// Indices of `rows: [batch, kept]` into the flattened `[batch * seq, ..]` rows, `[batch * kept]`.
pub fn flat_rows<B: Backend>(rows: Tensor<B, 2, Int>, seq: usize) -> Tensor<B, 1, Int> {
    let [batch, kept] = rows.dims();
    let offsets = Tensor::<B, 1, Int>::arange(0..batch as i64, &rows.device())
        .mul_scalar(seq as i64)
        .reshape([batch, 1]);
    (rows + offsets).reshape([batch * kept])
}

/// See [`super::gather_rows`].
pub fn gather_rows<B: Backend>(x: Tensor<B, 3>, rows: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    let [batch, seq, width] = x.dims();
    let [_, kept] = rows.dims();
    x.reshape([batch * seq, width])
        .select(0, flat_rows(rows, seq))
        .reshape([batch, kept, width])
}

/// See [`super::scatter_add_rows`]; `values` are cast to `x`'s dtype.
pub fn scatter_add_rows<B: Backend>(
    x: Tensor<B, 3>,
    rows: Tensor<B, 2, Int>,
    values: Tensor<B, 3>,
) -> Tensor<B, 3> {
    let [batch, seq, width] = x.dims();
    let [_, kept] = rows.dims();
    let values = values.cast(x.dtype()).reshape([batch * kept, width]);
    x.reshape([batch * seq, width])
        .select_assign(0, flat_rows(rows, seq), values, IndexingUpdateOp::Add)
        .reshape([batch, seq, width])
}

/// See [`super::gather_rms_norm`]: the gather, then RMSNorm in f32 (the plain reference of
/// [`crate::fused::rms_norm`]).
pub fn gather_rms_norm<B: Backend>(
    x: Tensor<B, 3>,
    rows: Tensor<B, 2, Int>,
    weight: Tensor<B, 1>,
    eps: f32,
) -> Tensor<B, 3> {
    let kept = gather_rows(x, rows);
    let (y, _) = crate::fused::rms_norm::reference::forward::<B>(
        kept.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        eps,
    );
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn int<B: Backend, const D: usize>(t: IntTensor<B>) -> Tensor<B, D, Int> {
    Tensor::from_primitive(t)
}

pub(crate) fn gather_rms_norm_primitive<B: Backend>(
    x: FloatTensor<B>,
    rows: IntTensor<B>,
    weight: FloatTensor<B>,
    eps: f32,
) -> FloatTensor<B> {
    gather_rms_norm::<B>(float(x), int(rows), float(weight), eps)
        .into_primitive()
        .tensor()
}

pub(crate) fn scatter_add_rows_primitive<B: Backend>(
    x: FloatTensor<B>,
    rows: IntTensor<B>,
    values: FloatTensor<B>,
) -> FloatTensor<B> {
    scatter_add_rows::<B>(float(x), int(rows), float(values))
        .into_primitive()
        .tensor()
}

pub(crate) fn gather_rows_primitive<B: Backend>(
    x: FloatTensor<B>,
    rows: IntTensor<B>,
) -> FloatTensor<B> {
    gather_rows::<B>(float(x), int(rows))
        .into_primitive()
        .tensor()
}
