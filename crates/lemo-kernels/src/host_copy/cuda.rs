//! Copies between cubecl's CUDA buffers and page-locked host memory on a copy stream of our own
//! per context, ordered with cubecl's work by events and no host synchronization (see
//! [`crate::cuda_interop`]).
//!
//! Why it is safe without waiting:
//! - a copy to the host starts after everything submitted before it (the kernels that wrote the
//!   tensor); the tensor itself is held ([`release_copied`]) until the copy's event has
//!   completed, since the pool would otherwise give its memory to the next kernel;
//! - a copy back goes into a fresh buffer after everything submitted before it (that buffer's
//!   earlier users), and the work queued after [`arrived`] waits for it on the device;
//! - all copies of a context run on its one copy stream, in order, so a host buffer handed back
//!   to the pool can be written by a later copy only after the earlier ones that read it.
//!
//! Host buffers are pooled per context by byte size and kept for the process: a training step
//! offloads the same inputs every step, and page-locking is slow.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use burn::tensor::{DType, Shape, TensorData};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::driver::result as driver;
use cudarc::driver::sys as driver_sys;

use super::{HostTensor, Storage};
use crate::cuda_interop::{SideStream, current_context, downcast};

/// Per context: its copy stream, and free host buffers by byte size.
struct ContextCopies {
    stream: SideStream,
    free: HashMap<usize, Vec<usize>>,
}

// SAFETY: the raw handles are only used under the `CONTEXTS` lock, on cubecl's device thread of
// the context they belong to; the host buffers are plain addresses.
unsafe impl Send for ContextCopies {}

static CONTEXTS: Mutex<Option<HashMap<usize, ContextCopies>>> = Mutex::new(None);

/// A copy's completion event, destroyed once waited for or seen complete.
struct CopyEvent(driver_sys::CUevent);

// SAFETY: an event handle is used by one owner at a time, on the device thread of its context.
unsafe impl Send for CopyEvent {}

/// A tensor whose copy to the host is under way, held until the copy is done.
struct Copying {
    tensor: CubeTensor<CudaRuntime>,
    done: CopyEvent,
}

static COPYING: Mutex<Vec<Copying>> = Mutex::new(Vec::new());

/// Runs `task` with the current context's copy state, on the device thread of `client`.
fn with_context<R: CubeRuntime, T: Send + 'static>(
    client: &cubecl::prelude::ComputeClient<R>,
    task: impl FnOnce(driver_sys::CUcontext, &mut ContextCopies) -> Result<T, String> + Send + 'static,
) -> T {
    client
        .exclusive(move || {
            let context = current_context()?;
            let mut guard = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
            let contexts = guard.get_or_insert_with(HashMap::new);
            let copies = match contexts.entry(context as usize) {
                std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
                std::collections::hash_map::Entry::Vacant(entry) => entry.insert(ContextCopies {
                    stream: SideStream::new()?,
                    free: HashMap::new(),
                }),
            };
            task(context, copies)
        })
        .expect("cubecl device thread")
        .unwrap_or_else(|error| panic!("host copy: {error}"))
}

/// A page-locked host buffer of one context, back to that context's pool when dropped.
pub(super) struct PinnedCopy {
    address: usize,
    bytes: usize,
    context: usize,
    shape: Shape,
    dtype: DType,
    client: cubecl::prelude::ComputeClient<CudaRuntime>,
}

impl PinnedCopy {
    pub(super) fn shape(&self) -> Shape {
        self.shape.clone()
    }

    /// The values, after the copy stream has finished what it was given.
    pub(super) fn to_data(&self) -> TensorData {
        let (address, bytes) = (self.address, self.bytes);
        let values = with_context(&self.client, move |_, copies| {
            // SAFETY: the stream belongs to the current context; the buffer holds `bytes`
            // bytes and nothing writes it once the stream is idle.
            unsafe {
                driver::stream::synchronize(copies.stream.stream).map_err(|e| e.to_string())?;
                Ok(std::slice::from_raw_parts(address as *const u8, bytes).to_vec())
            }
        });
        TensorData::from_bytes_vec(values, self.shape.clone(), self.dtype)
    }
}

impl Drop for PinnedCopy {
    fn drop(&mut self) {
        let mut guard = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(copies) = guard.as_mut().and_then(|c| c.get_mut(&self.context)) {
            copies
                .free
                .entry(self.bytes)
                .or_default()
                .push(self.address);
        }
    }
}

/// A free host buffer of `bytes` in the current context, page-locked now if none is free.
fn host_buffer(copies: &mut ContextCopies, bytes: usize) -> Result<usize, String> {
    if let Some(address) = copies.free.get_mut(&bytes).and_then(Vec::pop) {
        return Ok(address);
    }
    // SAFETY: a plain host allocation in the current context, kept for the process.
    unsafe { driver::malloc_host(bytes, 0) }
        .map(|pointer| pointer as usize)
        .map_err(|e| format!("page-locking {bytes} bytes of host memory: {e}"))
}

fn record(stream: driver_sys::CUstream) -> Result<CopyEvent, String> {
    let event = driver::event::create(driver_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .map_err(|e| e.to_string())?;
    // SAFETY: the event and the stream belong to the current context.
    unsafe { driver::event::record(event, stream) }.map_err(|e| e.to_string())?;
    Ok(CopyEvent(event))
}

/// Starts copying `tensor` to page-locked host memory when it is a CUDA tensor; `None` otherwise.
pub(super) fn try_to_host<R: CubeRuntime>(tensor: &CubeTensor<R>) -> Option<HostTensor> {
    let tensor = downcast::<_, CubeTensor<CudaRuntime>>(tensor.clone())?;
    release_finished(|copying| copying.tensor.device == tensor.device);
    let tensor = if tensor.is_contiguous() && tensor.is_contiguous_buffer() {
        tensor
    } else {
        into_contiguous(tensor)
    };
    let bytes = tensor.meta.shape().num_elements() * tensor.dtype.size();
    let client = tensor.client.clone();
    let resource = client
        .get_resource(tensor.handle.clone())
        .expect("cubecl buffer of a tensor copied to the host");
    let source = resource.resource().ptr;
    let (address, context, done) = with_context(&client, move |context, copies| {
        let address = host_buffer(copies, bytes)?;
        // SAFETY: `source` is a live cubecl buffer of `bytes` bytes (held until `done`), the
        // host buffer is ours, and the stream belongs to the current context.
        unsafe {
            copies.stream.join_inputs(context)?;
            driver_sys::cuMemcpyDtoHAsync_v2(
                address as *mut c_void,
                source,
                bytes,
                copies.stream.stream,
            )
            .result()
            .map_err(|e| e.to_string())?;
        }
        Ok((address, context as usize, record(copies.stream.stream)?))
    });
    drop(resource);
    let copy = PinnedCopy {
        address,
        bytes,
        context,
        shape: tensor.meta.shape().clone(),
        dtype: tensor.dtype,
        client,
    };
    COPYING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Copying { tensor, done });
    Some(HostTensor {
        storage: Storage::Pinned(copy),
    })
}

/// The completion event of a copy back to the device, waited for by [`arrived`].
pub(super) struct Arrival(CopyEvent);

/// Starts copying a page-locked `host` tensor into a new buffer on `device` when `R` is the CUDA
/// runtime; `None` otherwise (the caller uploads it plainly).
pub(super) fn try_upload<R: CubeRuntime>(
    host: &HostTensor,
    device: &R::Device,
) -> Option<(CubeTensor<R>, Arrival)> {
    let Storage::Pinned(copy) = &host.storage else {
        return None;
    };
    let device = downcast::<_, <CudaRuntime as cubecl::Runtime>::Device>(device.clone())?;
    release_finished(|copying| copying.tensor.device == device);
    let client = <CudaRuntime as cubecl::Runtime>::client(&device);
    let tensor = empty_device_contiguous_dtype(client.clone(), device, copy.shape(), copy.dtype);
    let resource = client
        .get_resource(tensor.handle.clone())
        .expect("cubecl buffer of a tensor copied from the host");
    let target = resource.resource().ptr;
    let (address, bytes) = (copy.address, copy.bytes);
    let done = with_context(&client, move |context, copies| {
        // SAFETY: `target` is a new cubecl buffer of `bytes` bytes, not read before `arrived`;
        // the host buffer is held by `host` and written only by earlier copies of this stream.
        unsafe {
            copies.stream.join_inputs(context)?;
            driver_sys::cuMemcpyHtoDAsync_v2(
                target,
                address as *const c_void,
                bytes,
                copies.stream.stream,
            )
            .result()
            .map_err(|e| e.to_string())?;
        }
        record(copies.stream.stream)
    });
    drop(resource);
    Some((downcast(tensor)?, Arrival(done)))
}

/// `tensor`, with the work queued from now on waiting on the device for its copy.
pub(super) fn arrived<R: CubeRuntime>(tensor: CubeTensor<R>, arrival: Arrival) -> CubeTensor<R> {
    let event = arrival.0.0 as usize;
    with_context(&tensor.client.clone(), move |context, copies| {
        // SAFETY: the event belongs to the current context and is not used after this.
        unsafe {
            copies
                .stream
                .context_waits(context, event as driver_sys::CUevent)?;
            driver::event::destroy(event as driver_sys::CUevent).map_err(|e| e.to_string())
        }
    });
    tensor
}

/// Returns the tensors on `device` whose copies to the host are done to the pool.
pub(super) fn release_copied<R: CubeRuntime>(device: &R::Device) {
    let Some(device) = downcast::<_, <CudaRuntime as cubecl::Runtime>::Device>(device.clone())
    else {
        return;
    };
    release_finished(|copying| copying.tensor.device == device);
}

/// Drops the held tensors among those `selected` whose copies have completed.
fn release_finished(selected: impl Fn(&Copying) -> bool) {
    let mut copying = COPYING.lock().unwrap_or_else(|e| e.into_inner());
    let mut released = Vec::new();
    let mut index = 0;
    while index < copying.len() {
        let entry = &copying[index];
        if !selected(entry) {
            index += 1;
            continue;
        }
        let event = entry.done.0 as usize;
        let complete = entry
            .tensor
            .client
            .exclusive(move || {
                // SAFETY: the event is live (destroyed only below, once complete).
                match unsafe { driver_sys::cuEventQuery(event as driver_sys::CUevent) } {
                    driver_sys::CUresult::CUDA_SUCCESS => {
                        // SAFETY: complete, and never used again.
                        let _ = unsafe { driver::event::destroy(event as driver_sys::CUevent) };
                        true
                    }
                    _ => false,
                }
            })
            .expect("cubecl device thread");
        if complete {
            released.push(copying.swap_remove(index));
        } else {
            index += 1;
        }
    }
    drop(copying);
    // Dropped outside the lock and the device thread: the pool takes the memory back.
    drop(released);
}
