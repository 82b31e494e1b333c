//! The host-copy family of backend operations: plain reads and uploads by default, copies on a
//! copy stream of their own into page-locked host memory on CUDA.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::{HostTensor, Upload, read_to_host, upload_now};
use crate::ComputeBackend;
use crate::backend::CpuBackend;

/// Moving tensors to host memory and back; see [`super`].
pub trait HostCopyBackend: Backend {
    /// Starts copying `tensor` to host memory; see [`super::to_host`].
    fn lemo_to_host(tensor: FloatTensor<Self>) -> HostTensor {
        read_to_host::<Self>(tensor)
    }

    /// Starts bringing `host` back to `device`; see [`super::upload`].
    fn lemo_upload(host: &HostTensor, device: &Self::Device) -> Upload<Self> {
        upload_now(host, device)
    }

    /// The uploaded tensor, ordered after its copy; see [`Upload::arrived`].
    fn lemo_arrived(upload: Upload<Self>) -> FloatTensor<Self> {
        upload.tensor
    }

    /// See [`super::release_copied`].
    fn lemo_release_copied(_device: &Self::Device) {}
}

impl HostCopyBackend for CpuBackend {}

impl<R, F, I, BT> HostCopyBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn lemo_to_host(tensor: FloatTensor<Self>) -> HostTensor {
        #[cfg(feature = "cuda")]
        if let Some(copy) = super::cuda::try_to_host(&tensor) {
            return copy;
        }
        read_to_host::<Self>(tensor)
    }

    fn lemo_upload(host: &HostTensor, device: &Self::Device) -> Upload<Self> {
        #[cfg(feature = "cuda")]
        if let Some((tensor, arrival)) = super::cuda::try_upload::<R>(host, device) {
            return Upload {
                tensor,
                arrival: Some(arrival),
            };
        }
        upload_now(host, device)
    }

    fn lemo_arrived(upload: Upload<Self>) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(arrival) = upload.arrival {
            return super::cuda::arrived(upload.tensor, arrival);
        }
        upload.tensor
    }

    fn lemo_release_copied(_device: &Self::Device) {
        #[cfg(feature = "cuda")]
        super::cuda::release_copied::<R>(_device);
    }
}

impl<B: ComputeBackend, C: CheckpointStrategy> HostCopyBackend for Autodiff<B, C> {}
