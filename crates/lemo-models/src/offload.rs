//! Layer inputs moved to host memory during the forward pass and brought back ahead of the
//! backward pass that needs them ([`crate::activation_plan::LayerActivations::Offloaded`]).
//!
//! Copies run on one transfer thread shared by the process. On CubeCL's CUDA runtime each thread
//! has its own stream, so the copies overlap the compute stream (CubeCL orders them after the
//! kernels that wrote the tensor with events, and reads to the host land in pinned memory where
//! its pinned pool can hold them); the compute thread never waits on a copy until it needs the
//! tensor. One thread also means one memory pool for the fetched inputs, which the memory plan
//! counts as two layer inputs. On the CPU backends the same code is a plain host copy.

use std::sync::OnceLock;
use std::sync::mpsc::{self, Receiver, Sender};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

type Job = Box<dyn FnOnce() + Send>;

/// Runs `job` on the transfer thread, in the order jobs were given.
fn on_transfer_thread(job: Job) {
    static TRANSFERS: OnceLock<Sender<Job>> = OnceLock::new();
    let sender = TRANSFERS.get_or_init(|| {
        let (sender, receiver) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("lemo-transfers".into())
            .spawn(move || receiver.into_iter().for_each(|job| job()))
            .expect("spawning the transfer thread");
        sender
    });
    sender
        .send(job)
        .expect("the transfer thread runs as long as the process");
}

/// A tensor on its way to host memory, there, or on its way back.
pub struct HostCopy<B: Backend> {
    state: State<B>,
    device: B::Device,
}

enum State<B: Backend> {
    Host(Receiver<TensorData>),
    Device(Receiver<Tensor<B, 3>>),
}

impl<B: Backend> HostCopy<B> {
    /// Starts copying `tensor` to host memory; its device memory is released once copied.
    pub fn new(tensor: Tensor<B, 3>) -> Self {
        let device = tensor.device();
        let (sender, receiver) = mpsc::channel();
        on_transfer_thread(Box::new(move || {
            // The receiver is gone only when the pass was abandoned: nothing to deliver.
            let _ = sender.send(tensor.into_data());
        }));
        Self {
            state: State::Host(receiver),
            device,
        }
    }

    /// Starts bringing the tensor back to its device (once; later calls do nothing).
    pub fn prefetch(&mut self) {
        if matches!(self.state, State::Device(_)) {
            return;
        }
        let (sender, receiver) = mpsc::channel();
        let State::Host(host) = std::mem::replace(&mut self.state, State::Device(receiver)) else {
            unreachable!("checked above: the tensor is still on its way to the host");
        };
        let device = self.device.clone();
        on_transfer_thread(Box::new(move || {
            // Jobs run in order: the copy to the host has finished by now.
            if let Ok(data) = host.recv() {
                let _ = sender.send(Tensor::from_data(data, &device));
            }
        }));
    }

    /// The tensor back on its device, waiting for the copies still under way (without a
    /// prefetch, it is uploaded from this thread).
    pub fn into_device(self) -> Tensor<B, 3> {
        const DELIVERED: &str = "the transfer thread delivers every copy it was given";
        match self.state {
            State::Host(host) => Tensor::from_data(host.recv().expect(DELIVERED), &self.device),
            State::Device(fetched) => fetched.recv().expect(DELIVERED),
        }
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
