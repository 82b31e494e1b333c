//! Reads of device tensors back to the host, counted.
//!
//! A read waits for everything queued before it: the device drains, and the work after it is
//! queued only once the host has the value. Inside a training step each such wait costs the
//! launch latency of the work queued behind it (on a small model, most of the step), so
//! the step's code reads through [`read`] and `bench` reports the count per step
//! ([`count`]); a test on the CPU backends holds the token-sparse step to its budget.

use std::cell::Cell;

use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Tensor, TensorData};

thread_local! {
    /// Per thread: a step runs on one thread (data-parallel replicas each on their own).
    static HOST_READS: Cell<usize> = const { Cell::new(0) };
}

/// `tensor`'s values on the host, counted as one host synchronization.
pub fn read<B: Backend, const D: usize, K: BasicOps<B>>(tensor: Tensor<B, D, K>) -> TensorData {
    HOST_READS.with(|reads| reads.set(reads.get() + 1));
    tensor.into_data()
}

/// [`read`] of `tensor` as f32 values.
pub fn read_f32<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    read(tensor)
        .convert::<f32>()
        .into_vec()
        .expect("f32 values after conversion")
}

/// Host reads made through [`read`] by this thread so far.
pub fn count() -> usize {
    HOST_READS.with(Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;

    #[test]
    fn each_read_counts_once() {
        let device = Default::default();
        let before = count();
        let values = read_f32(Tensor::<CpuBackend, 1>::from_floats([1.0, 2.0], &device));
        assert_eq!(values, vec![1.0, 2.0]);
        assert_eq!(count(), before + 1);
    }
}
