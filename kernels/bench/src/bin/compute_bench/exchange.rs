//! The exchange's collectives on the device (`lemo_kernels::exchange`, as NCCL runs them for a
//! sequence group) against the same collectives through the host, on one GPU: a group of two
//! ranks whose second rank is a stand-in, [`Mirror`], that holds the first one's rows and has
//! no gradient of its own. The forward all-gather and the backward reduce-scatter of a
//! dependent chain (rows written by a kernel just before, read by one just after) give the same
//! values both ways, exactly: any difference is a wrong pointer, offset, dtype or stream join.

use std::sync::Arc;

use burn::tensor::{DType, Tensor};
use cudarc::driver::sys as driver_sys;
use lemo_kernels::exchange::{DeviceRowExchange, Exchange, RowExchange, all_gather_rows};
use serde_json::{Value, json};

use super::{AD, B, random, relative, to_cpu};

/// Rank 0 of two; rank 1 holds rank 0's rows and contributes zeros to every sum.
struct Mirror {
    on_device: bool,
}

impl RowExchange for Mirror {
    fn rank(&self) -> usize {
        0
    }

    fn ranks(&self) -> usize {
        2
    }

    fn all_gather(&self, local: Vec<f32>) -> Vec<f32> {
        [local.clone(), local].concat()
    }

    fn reduce_scatter(&self, full: Vec<f32>) -> Vec<f32> {
        full[..full.len() / 2].to_vec()
    }

    fn barrier(&self) {}

    fn device(&self) -> Option<&dyn DeviceRowExchange> {
        self.on_device.then_some(self as &dyn DeviceRowExchange)
    }
}

/// Copies `bytes` from `from` to `to` on `stream`.
///
/// # Safety
/// Live device buffers of the current context; `stream` belongs to it.
unsafe fn copy(to: u64, from: u64, bytes: usize, stream: usize) -> Result<(), String> {
    unsafe {
        driver_sys::cuMemcpyDtoDAsync_v2(to, from, bytes, stream as driver_sys::CUstream)
            .result()
            .map_err(|e| e.to_string())
    }
}

impl DeviceRowExchange for Mirror {
    unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: usize,
    ) -> Result<(), String> {
        let bytes = count * dtype.size();
        // SAFETY: `recv` has room for both ranks' rows (the caller's promise).
        unsafe {
            copy(recv, send, bytes, stream)?;
            copy(recv + bytes as u64, send, bytes, stream)?;
            driver_sys::cuStreamSynchronize(stream as driver_sys::CUstream)
                .result()
                .map_err(|e| e.to_string())
        }
    }

    unsafe fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: usize,
    ) -> Result<(), String> {
        // SAFETY: as above; rank 0's share is the first `count` values.
        unsafe {
            copy(recv, send, count * dtype.size(), stream)?;
            driver_sys::cuStreamSynchronize(stream as driver_sys::CUstream)
                .result()
                .map_err(|e| e.to_string())
        }
    }
}

/// The gathered rows and the gradient of the local rows, with the collectives on the device or
/// through the host.
fn gather_chain(
    start: &Tensor<AD, 2>,
    weights: &Tensor<AD, 2>,
    on_device: bool,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let exchange = Exchange(Arc::new(Mirror { on_device }));
    let local = start.clone().require_grad();
    // Written by a kernel just before the gather, read by one just after.
    let gathered = all_gather_rows(local.clone() * 0.5 + 0.25, &exchange) * 2.0;
    let _scratch = random::<2>([4096, 4096], DType::BF16);
    let grads = (gathered.clone().cast(DType::F32) * weights.clone())
        .sum()
        .backward();
    let grad = local.grad(&grads).expect("the local rows' gradient");
    (gathered.inner(), grad)
}

pub fn parity() -> Vec<Value> {
    let start = Tensor::<AD, 2>::from_inner(random([4096, 1024], DType::BF16));
    let weights = Tensor::<AD, 2>::from_inner(random([8192, 1024], DType::F32));
    let (host_rows, host_grad) = gather_chain(&start, &weights, false);
    let (device_rows, device_grad) = gather_chain(&start, &weights, true);
    let mut results = Vec::new();
    for (name, device, host) in [
        ("exchange_all_gather_rows_bf16", device_rows, host_rows),
        ("exchange_reduce_scatter_rows_bf16", device_grad, host_grad),
    ] {
        let error = relative(to_cpu(device), to_cpu(host));
        let ok = error == 0.0;
        println!(
            "parity {name} (device vs host): {error:.2e} {}",
            if ok { "ok" } else { "FAIL" }
        );
        results.push(json!({"check": name, "relative_error": error, "tolerance": 0.0, "ok": ok}));
    }
    results
}
