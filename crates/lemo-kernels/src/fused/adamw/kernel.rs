use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::AdamWStep;
use crate::fused::{ELEMENTWISE_THREADS, elementwise_grid, empty_like};

/// The f32 scalars of one update, rounded from [`AdamWStep`] as Burn rounds a scalar operand.
#[derive(CubeLaunch, CubeType)]
struct AdamWFactors {
    /// `1 - lr wd`.
    decay: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    /// `sqrt(1 - b2^t)`.
    bias2_sqrt: f32,
    eps: f32,
    /// `lr / (1 - b1^t)`.
    step_size: f32,
}

/// One thread per `N`-vector: the new parameter and moments from the old ones and the gradient
/// (moments absent: zeros), in the order of operations of `torch.optim.AdamW`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn adamw_kernel<F: Float, N: Size>(
    param: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    exp_avg: &ComptimeOption<Tensor<Vector<F, N>>>,
    exp_avg_sq: &ComptimeOption<Tensor<Vector<F, N>>>,
    param_out: &mut Tensor<Vector<F, N>>,
    exp_avg_out: &mut Tensor<Vector<F, N>>,
    exp_avg_sq_out: &mut Tensor<Vector<F, N>>,
    factors: &AdamWFactors,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= param_out.len() {
        terminate!();
    }
    let g = Vector::<f32, N>::cast_from(grad[i]);
    let mut m = g * Vector::new(factors.one_minus_beta1);
    #[comptime]
    if let ComptimeOption::Some(exp_avg) = exp_avg {
        m = Vector::<f32, N>::cast_from(exp_avg[i]) * Vector::new(factors.beta1) + m;
    }
    let mut v = g * g * Vector::new(factors.one_minus_beta2);
    #[comptime]
    if let ComptimeOption::Some(exp_avg_sq) = exp_avg_sq {
        v = Vector::<f32, N>::cast_from(exp_avg_sq[i]) * Vector::new(factors.beta2) + v;
    }
    let p = Vector::<f32, N>::cast_from(param[i]) * Vector::new(factors.decay);
    let denom = v.sqrt() / Vector::new(factors.bias2_sqrt) + Vector::new(factors.eps);
    param_out[i] = Vector::cast_from(p - m / denom * Vector::new(factors.step_size));
    exp_avg_out[i] = Vector::cast_from(m);
    exp_avg_sq_out[i] = Vector::cast_from(v);
}

/// One AdamW update (see [`super::adamw_step`]): one thread per 16-byte vector reads `param`,
/// `grad` and the moments once and writes the three results once (7 x numel x dtype bytes,
/// 5 on the first update).
pub(crate) fn adamw_step<R: CubeRuntime>(
    param: CubeTensor<R>,
    grad: CubeTensor<R>,
    exp_avg: Option<CubeTensor<R>>,
    exp_avg_sq: Option<CubeTensor<R>>,
    step: AdamWStep,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let state = [Some(&grad), exp_avg.as_ref(), exp_avg_sq.as_ref()];
    for tensor in state.into_iter().flatten() {
        assert_eq!(
            tensor.meta.shape(),
            param.meta.shape(),
            "AdamW gradient or moment shape differs from the parameter's"
        );
        assert_eq!(tensor.dtype, param.dtype, "AdamW dtypes differ");
    }
    let (param, grad) = (into_contiguous(param), into_contiguous(grad));
    let (exp_avg, exp_avg_sq) = (
        exp_avg.map(into_contiguous),
        exp_avg_sq.map(into_contiguous),
    );
    let (param_out, exp_avg_out, exp_avg_sq_out) =
        (empty_like(&param), empty_like(&param), empty_like(&param));
    let elements = param.meta.num_elements();
    if elements == 0 {
        return (param_out, exp_avg_out, exp_avg_sq_out);
    }
    let (vector, count) = elementwise_grid(&param, elements);
    let (decay, step_size, bias2_sqrt) = step.corrections();
    let factors = AdamWFactorsLaunch::new(
        decay as f32,
        step.beta1 as f32,
        (1.0 - step.beta1) as f32,
        step.beta2 as f32,
        (1.0 - step.beta2) as f32,
        bias2_sqrt as f32,
        step.eps as f32,
        step_size as f32,
    );
    let (client, dtype) = (param.client.clone(), param.dtype);
    // SAFETY: the kernel bounds its index by the output length, which every input shares.
    unsafe {
        adamw_kernel::launch_unchecked::<R>(
            &client,
            count,
            CubeDim::new_1d(ELEMENTWISE_THREADS as u32),
            vector,
            param.into_tensor_arg(),
            grad.into_tensor_arg(),
            exp_avg.map(|t| t.into_tensor_arg()).into(),
            exp_avg_sq.map(|t| t.into_tensor_arg()).into(),
            param_out.clone().into_tensor_arg(),
            exp_avg_out.clone().into_tensor_arg(),
            exp_avg_sq_out.clone().into_tensor_arg(),
            factors,
            dtype.into(),
        );
    }
    (param_out, exp_avg_out, exp_avg_sq_out)
}
