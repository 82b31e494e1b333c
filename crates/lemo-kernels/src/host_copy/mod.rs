//! Tensors moved to host memory and back without stalling the device: the layer inputs that an
//! activation plan offloads ([`HostCopyBackend`]).
//!
//! [`to_host`] starts the copy and returns at once; [`Upload`] brings the values back ahead of
//! their use, and [`Upload::arrived`] hands the tensor over, ordered after the copy. On CUDA the
//! copies run on a copy stream of their own between cubecl's buffers and page-locked host
//! memory, ordered with the compute by events: a copy to the host waits for the kernels that
//! wrote the tensor, the tensor's device memory goes back to the pool once the copy is done
//! ([`release_copied`]), and a tensor on its way back is waited for by the device, not the host,
//! when it is used, so both directions overlap the compute. Other backends read the tensor into
//! host memory and upload it again, synchronously.

pub mod backend;
#[cfg(feature = "cuda")]
mod cuda;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorData, TensorPrimitive};

use backend::HostCopyBackend;

/// A float tensor's values in host memory, or on their way there.
pub struct HostTensor {
    storage: Storage,
}

enum Storage {
    Data(TensorData),
    #[cfg(feature = "cuda")]
    Pinned(cuda::PinnedCopy),
}

impl HostTensor {
    fn from_data(data: TensorData) -> Self {
        Self {
            storage: Storage::Data(data),
        }
    }

    /// The tensor's shape.
    pub fn shape(&self) -> Shape {
        match &self.storage {
            Storage::Data(data) => data.shape.clone(),
            #[cfg(feature = "cuda")]
            Storage::Pinned(copy) => copy.shape(),
        }
    }

    /// The values, once the copy to the host is done (this waits for it).
    pub fn to_data(&self) -> TensorData {
        match &self.storage {
            Storage::Data(data) => data.clone(),
            #[cfg(feature = "cuda")]
            Storage::Pinned(copy) => copy.to_data(),
        }
    }
}

/// A tensor on its way back to its device.
pub struct Upload<B: Backend> {
    tensor: FloatTensor<B>,
    #[cfg(feature = "cuda")]
    arrival: Option<cuda::Arrival>,
}

impl<B: Backend> Upload<B> {
    /// A tensor already on the device.
    fn done(tensor: FloatTensor<B>) -> Self {
        Self {
            tensor,
            #[cfg(feature = "cuda")]
            arrival: None,
        }
    }
}

impl<B: HostCopyBackend> Upload<B> {
    /// The tensor, ordered after its copy: work queued from now on waits for it on the device.
    pub fn arrived<const D: usize>(self) -> Tensor<B, D> {
        Tensor::from_primitive(TensorPrimitive::Float(B::lemo_arrived(self)))
    }
}

/// Starts copying `tensor` to host memory and returns without waiting for it; see the module
/// docs.
pub fn to_host<B: HostCopyBackend, const D: usize>(tensor: Tensor<B, D>) -> HostTensor {
    B::lemo_to_host(tensor.into_primitive().tensor())
}

/// Starts bringing `host` back to `device`; [`Upload::arrived`] hands the tensor over.
pub fn upload<B: HostCopyBackend>(host: &HostTensor, device: &B::Device) -> Upload<B> {
    B::lemo_upload(host, device)
}

/// Returns to `device`'s memory pool the tensors whose copies to the host are done (they are
/// held until then, since the pool would hand their memory to the next kernel). Each copy
/// releases what is done before it starts; a pass that copies nothing more for a while (the
/// layers above the last offloaded one) calls this between layers.
pub fn release_copied<B: HostCopyBackend>(device: &B::Device) {
    B::lemo_release_copied(device)
}

/// The plain path: the values read into host memory now.
fn read_to_host<B: Backend>(tensor: FloatTensor<B>) -> HostTensor {
    HostTensor::from_data(
        burn::tensor::read_sync(B::float_into_data(tensor)).expect("reading a tensor to the host"),
    )
}

/// The plain path: the values uploaded now.
fn upload_now<B: Backend>(host: &HostTensor, device: &B::Device) -> Upload<B> {
    Upload::done(B::float_from_data(host.to_data(), device))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;

    #[test]
    fn a_tensor_comes_back_from_the_host_unchanged() {
        let device = Default::default();
        let tensor = lemo_test_support::random::<CpuBackend, 3>([2, 5, 3], &device);
        let host = to_host(tensor.clone());
        assert_eq!(host.shape(), Shape::new([2, 5, 3]));
        let back: Tensor<CpuBackend, 3> = upload(&host, &device).arrived();
        back.into_data().assert_eq(&tensor.to_data(), true);
    }
}
