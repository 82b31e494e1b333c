//! Plain Burn AdamW update, in f32 whatever the storage dtype: the same ops, in the same order,
//! as `torch.optim.AdamW`'s single-tensor path.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorMetadata, TensorPrimitive};

use super::AdamWStep;

fn flat_f32<B: Backend>(tensor: FloatTensor<B>) -> Tensor<B, 1> {
    let elements = tensor.shape().num_elements();
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
        tensor,
        [elements].into(),
    )))
    .cast(DType::F32)
}

/// The new `(param, exp_avg, exp_avg_sq)` in `param`'s dtype and shape; see
/// [`super::adamw_step`].
pub fn adamw_step<B: Backend>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    exp_avg: Option<FloatTensor<B>>,
    exp_avg_sq: Option<FloatTensor<B>>,
    step: AdamWStep,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (shape, dtype) = (param.shape(), param.dtype());
    assert_eq!(
        grad.shape(),
        shape,
        "AdamW gradient and parameter shapes differ"
    );
    // PyTorch's scalars, written out here rather than shared with the kernel so that the parity
    // test checks them too: `bias_correction1 = 1 - beta1 ** step`, `step_size = lr /
    // bias_correction1`, `bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5`.
    let t = step.step as f64;
    let step_size = step.lr / (1.0 - step.beta1.powf(t));
    let bias2_sqrt = (1.0 - step.beta2.powf(t)).sqrt();
    let grad = flat_f32::<B>(grad);
    let m = grad.clone().mul_scalar(1.0 - step.beta1);
    let m = match exp_avg {
        Some(exp_avg) => flat_f32::<B>(exp_avg).mul_scalar(step.beta1) + m,
        None => m,
    };
    let v = grad.square().mul_scalar(1.0 - step.beta2);
    let v = match exp_avg_sq {
        Some(exp_avg_sq) => flat_f32::<B>(exp_avg_sq).mul_scalar(step.beta2) + v,
        None => v,
    };
    let mut param = flat_f32::<B>(param);
    if step.weight_decay != 0.0 {
        param = param.mul_scalar(1.0 - step.lr * step.weight_decay);
    }
    let denom = v.clone().sqrt().div_scalar(bias2_sqrt).add_scalar(step.eps);
    let param = param - m.clone().div(denom).mul_scalar(step_size);
    let back =
        |t: Tensor<B, 1>| B::float_reshape(t.cast(dtype).into_primitive().tensor(), shape.clone());
    (back(param), back(m), back(v))
}
