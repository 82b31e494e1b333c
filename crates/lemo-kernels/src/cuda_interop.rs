//! What library calls (cuBLASLt, cuDNN) on buffers owned by cubecl need: the CUDA tensor behind
//! a generic one, and a stream of our own.
//!
//! cubecl does not expose its CUDA streams, so library work runs on a side stream and is ordered
//! with cubecl's work through context-wide events (CUDA 12.5+ drivers): `cuCtxRecordEvent`
//! captures everything already submitted to the context (the kernels that wrote the inputs, on
//! whichever cubecl stream), the side stream waits for it, and after the library call
//! `cuCtxWaitEvent` makes all work submitted to the context afterwards (the consumers of the
//! outputs, and any kernel that reuses the inputs' memory once they are dropped) wait for it. No
//! host synchronization happens. Callers run on cubecl's device thread (through
//! `ComputeClient::exclusive`), after every submission made before them, with its context
//! current. Drivers without context events fall back to synchronizing around the call.

use std::any::Any;

use cudarc::driver::result as driver;
use cudarc::driver::sys as driver_sys;

/// `value` as a `T` when it is one (a generic `CubeTensor<R>` as `CubeTensor<CudaRuntime>` and
/// back).
pub(crate) fn downcast<A: 'static, T: 'static>(value: A) -> Option<T> {
    (Box::new(value) as Box<dyn Any>)
        .downcast::<T>()
        .ok()
        .map(|boxed| *boxed)
}

pub(crate) struct SideStream {
    pub stream: driver_sys::CUstream,
    inputs_ready: driver_sys::CUevent,
    work_done: driver_sys::CUevent,
    context_events: bool,
}

// SAFETY: the raw handles are only used by their owners under a lock, on cubecl's device thread of
// the context they belong to.
unsafe impl Send for SideStream {}

/// The CUDA context current on this thread (cubecl's, inside `exclusive`).
pub(crate) fn current_context() -> Result<driver_sys::CUcontext, String> {
    driver::ctx::get_current()
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "no CUDA context current on cubecl's device thread".to_string())
}

impl SideStream {
    /// A non-blocking stream and its two join events, in the current context.
    pub fn new() -> Result<Self, String> {
        let stream = driver::stream::create(driver::stream::StreamKind::NonBlocking)
            .map_err(|e| e.to_string())?;
        let event = || {
            driver::event::create(driver_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| e.to_string())
        };
        Ok(Self {
            stream,
            inputs_ready: event()?,
            work_done: event()?,
            context_events: true,
        })
    }

    /// The side stream waits for all work submitted to `context` so far.
    ///
    /// # Safety
    /// `context` is current and owns the stream and events.
    pub unsafe fn join_inputs(&mut self, context: driver_sys::CUcontext) -> Result<(), String> {
        unsafe {
            if self.context_events {
                match driver_sys::cuCtxRecordEvent(context, self.inputs_ready).result() {
                    Ok(()) => {
                        return driver::stream::wait_event(
                            self.stream,
                            self.inputs_ready,
                            driver_sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                        )
                        .map_err(|e| e.to_string());
                    }
                    Err(_) => self.context_events = false,
                }
            }
            driver::ctx::synchronize().map_err(|e| e.to_string())
        }
    }

    /// All work submitted to `context` from now on waits for the side stream.
    ///
    /// # Safety
    /// As [`Self::join_inputs`].
    pub unsafe fn join_output(&mut self, context: driver_sys::CUcontext) -> Result<(), String> {
        unsafe {
            driver::event::record(self.work_done, self.stream).map_err(|e| e.to_string())?;
            self.context_waits(context, self.work_done)
        }
    }

    /// All work submitted to `context` from now on waits for `event` (recorded on this stream).
    ///
    /// # Safety
    /// As [`Self::join_inputs`]; `event` belongs to `context`.
    pub unsafe fn context_waits(
        &mut self,
        context: driver_sys::CUcontext,
        event: driver_sys::CUevent,
    ) -> Result<(), String> {
        unsafe {
            if self.context_events {
                return driver_sys::cuCtxWaitEvent(context, event)
                    .result()
                    .map_err(|e| e.to_string());
            }
            driver::event::synchronize(event).map_err(|e| e.to_string())
        }
    }
}
