//! Row-wise blocks on long sequences, a slice of rows at a time, so that no intermediate
//! outgrows the device pool's small pages (see [`lemo_kernels::memory::pooled_buffer_limit`]):
//! at 32K tokens a Llama-2-7B MLP activation is 688 MiB, and buffers of that size would each
//! reserve a page of a quarter of the pool's largest (9.4 GB on the H200).

use burn::tensor::{DType, Tensor};
use lemo_kernels::LemoBackend;
use lemo_kernels::memory::pooled_buffer_limit;

/// `block(x)` for a `block` that treats every row (token) of `x [batch, seq, _]` on its own and
/// whose widest intermediate has `width` values per row in `x`'s dtype: in one piece where that
/// intermediate fits the pool's small pages, else over slices of [`slice_len`] rows,
/// concatenated. The result is the same either way; gradients flow through the slices.
pub fn by_row_slices<B: LemoBackend>(
    x: Tensor<B, 3>,
    width: usize,
    block: impl Fn(Tensor<B, 3>) -> Tensor<B, 3>,
) -> Tensor<B, 3> {
    let [batch, seq, _] = x.dims();
    let rows = slice_len::<B>(&x.device(), x.dtype(), [batch, seq], width);
    if rows >= seq {
        return block(x);
    }
    Tensor::cat(x.split(rows, 1).into_iter().map(block).collect(), 1)
}

/// Rows per slice of [`by_row_slices`] over `[batch, seq, _]` for an intermediate of `width`
/// values per row in `dtype` (`seq` when it runs in one piece).
pub fn slice_len<B: LemoBackend>(
    device: &B::Device,
    dtype: DType,
    [batch, seq]: [usize; 2],
    width: usize,
) -> usize {
    let bytes = (batch * seq * width * dtype.size()) as u64;
    let slices = pooled_buffer_limit::<B>(device).map_or(1, |limit| slice_count(bytes, limit));
    seq.div_ceil(slices.clamp(1, seq.max(1)))
}

/// Slices for an intermediate of `bytes`: each at most half the pool's limit, so four share a
/// small page (on the H200 at 32K tokens, Llama-2-7B with checkpointing peaked at 29.6 GiB
/// that way against 30.0 GiB with slices up to the limit).
fn slice_count(bytes: u64, limit: u64) -> usize {
    bytes.div_ceil((limit / 2).max(1)) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Autodiff;
    use lemo_kernels::WgpuBackend;
    use lemo_test_support::{assert_close, random};

    type B = Autodiff<WgpuBackend>;

    #[test]
    fn slices_give_the_whole_block_and_its_gradient() {
        let device = Default::default();
        lemo_test_support::seed_backend::<B>(&device);
        let limit = pooled_buffer_limit::<B>(&device).expect("wgpu has paged pools");
        let [batch, seq, hidden] = [2, 48, 8];
        // An intermediate of three times the half-limit: three slices of 16 rows.
        let width = (3 * limit / 2) as usize / (batch * seq * 4);
        assert_eq!(slice_count((batch * seq * width * 4) as u64, limit), 3);
        let x = random::<B, 3>([batch, seq, hidden], &device).require_grad();
        let weight = random::<B, 2>([hidden, hidden], &device);
        let block = |x: Tensor<B, 3>| x.clone().matmul(weight.clone().unsqueeze()).tanh() * x;

        let sliced = by_row_slices(x.clone(), width, block);
        let whole = block(x.clone());
        assert_close("sliced output", sliced.clone(), whole.clone(), 1e-6);
        let sliced_grad = x
            .grad(&(sliced * whole.clone().detach()).sum().backward())
            .unwrap();
        let whole_grad = x
            .grad(&(whole.clone() * whole.detach()).sum().backward())
            .unwrap();
        assert_close("sliced gradient", sliced_grad, whole_grad, 1e-6);
    }
}
