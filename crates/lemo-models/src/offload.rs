//! Layer inputs moved to host memory during the forward pass and brought back ahead of the
//! backward pass that needs them ([`crate::activation_plan::LayerActivations::Offloaded`]).
//!
//! The copies are [`lemo_kernels::host_copy`]'s: on CUDA they run on a copy stream into
//! page-locked host memory and overlap the compute both ways (the device, not the host, waits
//! for a fetched input where it is used); on the CPU backends they are plain host copies.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use lemo_kernels::HostCopyBackend;
use lemo_kernels::host_copy::{self, HostTensor, Upload};

/// A layer input in host memory, or on its way there or back.
pub struct HostCopy<B: Backend> {
    host: HostTensor,
    device: B::Device,
    fetched: Option<Upload<B>>,
}

impl<B: HostCopyBackend> HostCopy<B> {
    /// Starts copying `tensor` to host memory; its device memory is released once copied.
    pub fn new(tensor: Tensor<B, 3>) -> Self {
        let device = tensor.device();
        Self {
            host: host_copy::to_host(tensor),
            device,
            fetched: None,
        }
    }

    /// Starts bringing the tensor back to its device (once; later calls do nothing).
    pub fn prefetch(&mut self) {
        if self.fetched.is_none() {
            self.fetched = Some(host_copy::upload(&self.host, &self.device));
        }
    }

    /// The tensor back on its device, ordered after its copy (without a prefetch, the copy
    /// starts now).
    pub fn into_device(mut self) -> Tensor<B, 3> {
        self.prefetch();
        self.fetched
            .take()
            .expect("prefetched just above")
            .arrived()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    #[test]
    fn a_tensor_comes_back_from_the_host_unchanged() {
        let device = Default::default();
        let tensor = lemo_test_support::random::<NdArray<f32>, 3>([2, 5, 3], &device);
        let copies: Vec<_> = (0..3).map(|_| HostCopy::new(tensor.clone())).collect();
        for (i, mut copy) in copies.into_iter().enumerate() {
            if i == 1 {
                copy.prefetch();
                copy.prefetch();
            }
            copy.into_device()
                .into_data()
                .assert_eq(&tensor.to_data(), true);
        }
    }
}
