//! Plain Burn rotate-half RoPE (gather of the tables at the positions, then element-wise ops).

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorMetadata, TensorPrimitive};

/// See [`super::rope`]; `inverse` rotates by the opposite angles (the backward pass).
pub fn rope<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    positions: IntTensor<B>,
    inverse: bool,
) -> FloatTensor<B> {
    let dtype = x.dtype();
    let x = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(x)).cast(DType::F32);
    let [batch, _, seq, head_dim] = x.dims();
    let half = head_dim / 2;
    let positions = Tensor::<B, 2, Int>::from_primitive(positions).reshape([batch * seq]);
    let table = |table: FloatTensor<B>| {
        Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(table))
            .cast(DType::F32)
            .select(0, positions.clone())
            .reshape([batch, 1, seq, half])
    };
    let cos = table(cos);
    let mut sin = table(sin);
    if inverse {
        sin = sin.neg();
    }
    let first = x.clone().narrow(3, 0, half);
    let second = x.narrow(3, half, half);
    let out = Tensor::cat(
        vec![
            first.clone() * cos.clone() - second.clone() * sin.clone(),
            second * cos + first * sin,
        ],
        3,
    );
    out.cast(dtype).into_primitive().tensor()
}
