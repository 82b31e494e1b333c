//! NCCL collectives on cubecl's CUDA buffers, through cudarc's bindings (NCCL is loaded at run
//! time as `libnccl.so`): the all-reduce of the gradient buckets, and the all-gather and
//! reduce-scatter of a sequence group's rows (context parallelism) on a communicator split from
//! the world's.
//!
//! cubecl's own communicator (Burn's `distributed` feature) shares its unique id through a
//! process-global map and initializes and waits without a deadline; here the unique id is a
//! value that can travel to other processes, and a sum that does not finish in time aborts
//! the communicator instead of hanging. The sum runs after the step's backward pass is done:
//! the device is synchronized, the bucket is reduced in place on a stream of our own, and the
//! host polls its completion event against the deadline and the group's liveness (so cubecl's
//! later kernels see the finished sum).

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use cubecl::Runtime;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cudarc::driver::result as driver;
use cudarc::driver::sys as driver_sys;
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys as nccl_sys;
use lemo_kernels::exchange::DeviceRowExchange;

use super::PeerFailure;
use super::local::LocalGroup;

/// The id every rank of a communicator initializes with (made by one rank, shared with all).
#[derive(Clone, Copy)]
pub struct UniqueId(nccl_sys::ncclUniqueId);

impl UniqueId {
    /// A fresh id (NCCL prepared: see [`prepare_nccl`]).
    pub fn new() -> Result<Self> {
        prepare_nccl()?;
        let id = nccl::get_uniqueid().map_err(|e| anyhow::anyhow!("ncclGetUniqueId: {e:?}"))?;
        Ok(Self(id))
    }

    /// The id as bytes, to send to ranks in other processes.
    pub fn to_bytes(self) -> [u8; super::launch::ID_BYTES] {
        self.0.internal.map(|c| c as u8)
    }

    /// The id rank 0 made in another process (NCCL prepared as [`Self::new`] does).
    pub fn from_bytes(bytes: [u8; super::launch::ID_BYTES]) -> Result<Self> {
        prepare_nccl()?;
        Ok(Self(nccl_sys::ncclUniqueId {
            internal: bytes.map(|b| b as std::ffi::c_char),
        }))
    }
}

/// Checks that NCCL can be loaded, and turns NVLink multicast (NVLS) off unless
/// `NCCL_NVLS_ENABLE` says otherwise: on shared hosts it can put every GPU of the machine out
/// of service.
fn prepare_nccl() -> Result<()> {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // SAFETY: called before the rank threads start and before NCCL reads its settings.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    }
    // SAFETY: only probes whether the library can be loaded.
    if !unsafe { nccl_sys::is_culib_present() } {
        bail!(
            "several GPUs need NCCL, and libnccl.so was not found: put the folder holding it on LD_LIBRARY_PATH (pip's nvidia-nccl ships libnccl.so.2; link it as libnccl.so)"
        );
    }
    Ok(())
}

/// A rank's NCCL communicator on its device, with the context, stream and event its sums use.
pub struct NcclComm {
    device: CudaDevice,
    handles: Handles,
}

// SAFETY: the handles are used by the rank that owns them, one call at a time, under cubecl's
// lock of their device.
unsafe impl Send for NcclComm {}

/// Raw handles crossing into cubecl's exclusive section and back.
#[derive(Clone, Copy)]
struct Handles {
    context: driver_sys::CUcontext,
    comm: nccl_sys::ncclComm_t,
    stream: driver_sys::CUstream,
    done: driver_sys::CUevent,
}
// SAFETY: see `NcclComm`.
unsafe impl Send for Handles {}

impl Handles {
    /// Sums the `count` values of `dtype` at `pointer` over the ranks, in place, on this rank's
    /// stream, and waits for it (see [`wait`]).
    ///
    /// # Safety
    /// `pointer` is a live buffer of `count` values of `dtype` in this rank's context.
    unsafe fn sum_in_place(
        self,
        pointer: u64,
        count: usize,
        dtype: nccl_sys::ncclDataType_t,
        deadline: Instant,
        group: &LocalGroup,
    ) -> Result<(), String> {
        // SAFETY: the handles are this context's; the buffer is the caller's promise.
        unsafe {
            driver::ctx::set_current(self.context).map_err(|e| e.to_string())?;
            nccl::all_reduce(
                pointer as *const c_void,
                pointer as *mut c_void,
                count,
                dtype,
                nccl_sys::ncclRedOp_t::ncclSum,
                self.comm,
                self.stream as nccl_sys::cudaStream_t,
            )
            .map_err(|e| format!("ncclAllReduce: {:?}", e.0))?;
            driver::event::record(self.done, self.stream).map_err(|e| e.to_string())?;
            wait(self.comm, self.done, deadline, group)
        }
    }
}

/// Makes the primary context of CUDA device `index` (the one cubecl uses) current and returns
/// it; it stays retained for the life of the process.
fn primary_context(index: usize) -> Result<driver_sys::CUcontext, String> {
    // SAFETY: plain driver calls on a device index the driver reported.
    unsafe {
        let device = driver::device::get(index as i32).map_err(|e| e.to_string())?;
        let context = driver::primary_ctx::retain(device).map_err(|e| e.to_string())?;
        driver::ctx::set_current(context).map_err(|e| e.to_string())?;
        Ok(context)
    }
}

impl NcclComm {
    /// Rank `rank` of `ranks` on CUDA device `index`; returns once every rank has joined.
    pub fn new(rank: usize, ranks: usize, index: usize, id: &UniqueId) -> Result<Self> {
        let id = id.0;
        Self::make(index, move || {
            let mut comm = MaybeUninit::uninit();
            // SAFETY: every rank calls this with the same id and its own rank.
            unsafe { nccl::comm_init_rank(comm.as_mut_ptr(), ranks as i32, id, rank as i32) }
                .map_err(|e| match e.0 {
                    nccl_sys::ncclResult_t::ncclInvalidUsage => format!(
                        "ncclCommInitRank: {:?} (two ranks on one GPU? each needs its own LOCAL_RANK)",
                        e.0
                    ),
                    _ => format!("ncclCommInitRank: {:?}", e.0),
                })?;
            // SAFETY: initialized by the successful call above.
            Ok(unsafe { comm.assume_init() })
        })
    }

    /// The communicator of the ranks that pass the same `color` (this one among them ordered by
    /// `key`); every rank of this communicator calls it, and it returns once all have.
    pub fn split(&mut self, color: usize, key: usize) -> Result<Self> {
        let parent = self.handles;
        Self::make(self.device.index, move || {
            let parent = parent;
            let mut comm = MaybeUninit::uninit();
            // SAFETY: every rank of the parent calls this, in the same order as its other
            // collectives; a null config inherits the parent's.
            unsafe {
                nccl_sys::ncclCommSplit(
                    parent.comm,
                    color as i32,
                    key as i32,
                    comm.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
            .map_err(|e| format!("ncclCommSplit: {:?}", e.0))?;
            // SAFETY: initialized by the successful call above.
            Ok(unsafe { comm.assume_init() })
        })
    }

    /// A communicator made by `join` on CUDA device `index`, on cubecl's device thread with the
    /// device's primary context current, with a stream and an event of its own.
    fn make(
        index: usize,
        join: impl FnOnce() -> Result<nccl_sys::ncclComm_t, String> + Send,
    ) -> Result<Self> {
        let device = CudaDevice::new(index);
        let client = CudaRuntime::client(&device);
        let handles = client
            .exclusive(move || -> Result<Handles, String> {
                let context = primary_context(index)?;
                let stream = driver::stream::create(driver::stream::StreamKind::NonBlocking)
                    .map_err(|e| e.to_string())?;
                let done =
                    driver::event::create(driver_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                        .map_err(|e| e.to_string())?;
                Ok(Handles {
                    context,
                    comm: join()?,
                    stream,
                    done,
                })
            })
            .map_err(|e| anyhow::anyhow!("{e:?}"))?
            .map_err(|e| anyhow::anyhow!("NCCL on CUDA device {index}: {e}"))?;
        Ok(Self { device, handles })
    }

    /// Sums `values` over the ranks, in place, through a device buffer of this rank (the host
    /// values of a step when the ranks are in several processes).
    pub fn sum_host(&mut self, values: &mut [f64], group: &LocalGroup) -> Result<()> {
        let client = CudaRuntime::client(&self.device);
        let handles = self.handles;
        let deadline = Instant::now() + group.timeout();
        let mut host = values.to_vec();
        let outcome = client
            .exclusive(move || -> Result<Vec<f64>, String> {
                // Moved whole: the handles are Send together, not field by field.
                let handles = handles;
                // SAFETY: a buffer of `host.len()` f64 of this context, freed before returning.
                unsafe {
                    driver::ctx::set_current(handles.context).map_err(|e| e.to_string())?;
                    let buffer = driver::malloc_sync(std::mem::size_of_val(host.as_slice()))
                        .map_err(|e| e.to_string())?;
                    let summed = (|| {
                        driver::memcpy_htod_sync(buffer, &host).map_err(|e| e.to_string())?;
                        handles.sum_in_place(
                            buffer,
                            host.len(),
                            nccl_sys::ncclDataType_t::ncclFloat64,
                            deadline,
                            group,
                        )?;
                        driver::memcpy_dtoh_sync(&mut host, buffer).map_err(|e| e.to_string())
                    })();
                    let _ = driver::free_sync(buffer);
                    summed.map(|()| host)
                }
            })
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let sum = self.abort_on_failure(outcome)?;
        values.copy_from_slice(&sum);
        Ok(())
    }

    /// The value of a finished sum; a sum that failed aborts the communicator and becomes a
    /// [`PeerFailure`].
    fn abort_on_failure<T>(&mut self, outcome: Result<T, String>) -> Result<T> {
        outcome.map_err(|why| {
            self.abort();
            PeerFailure(format!("sum on CUDA device {}: {why}", self.device.index)).into()
        })
    }

    /// Ends the communicator after a failed collective: NCCL cannot go on once a peer is lost.
    fn abort(&mut self) {
        if !self.handles.comm.is_null() {
            // SAFETY: the communicator is not used again after an abort.
            unsafe {
                let _ = nccl::comm_abort(self.handles.comm);
            }
            self.handles.comm = std::ptr::null_mut();
        }
    }

    /// Sums `bucket` (f32, on this rank's device) over the ranks, in place.
    pub fn sum<B: Backend>(
        &mut self,
        bucket: Tensor<B, 1>,
        group: &LocalGroup,
    ) -> Result<Tensor<B, 1>> {
        // Every kernel that writes the bucket is submitted and finished before NCCL reads it.
        B::sync(&bucket.device()).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let TensorPrimitive::Float(primitive) = bucket.into_primitive() else {
            bail!("NCCL sums float buckets only");
        };
        let tensor = downcast::<_, CubeTensor<CudaRuntime>>(primitive)
            .context("NCCL needs the CUDA backend")?;
        if tensor.dtype != DType::F32 {
            bail!("NCCL sums f32 buckets, not {:?}", tensor.dtype);
        }
        let count = tensor.meta.shape().iter().product::<usize>();
        let client = tensor.client.clone();
        let resource = client
            .get_resource(tensor.handle.clone())
            .map_err(|e| anyhow::anyhow!("the bucket's buffer: {e:?}"))?;
        let pointer = resource.resource().ptr;
        let handles = self.handles;
        let deadline = Instant::now() + group.timeout();
        let outcome = client
            .exclusive(move || -> Result<(), String> {
                // Moved whole: the handles are Send together, not field by field.
                let handles = handles;
                // SAFETY: the pointer is the live bucket (kept alive by `resource`) of `count`
                // f32 values.
                unsafe {
                    handles.sum_in_place(
                        pointer,
                        count,
                        nccl_sys::ncclDataType_t::ncclFloat32,
                        deadline,
                        group,
                    )
                }
            })
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        drop(resource);
        self.abort_on_failure(outcome)?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(
            downcast::<_, B::FloatTensorPrimitive>(tensor).expect("the type it came from"),
        )))
    }
}

/// One rank's communicator of its sequence group (split from the world's): the all-gather and
/// reduce-scatter of the group's rows on the device, for [`lemo_kernels::exchange`].
pub struct SequenceComm {
    comm: Mutex<NcclComm>,
    /// The process's ranks, whose stops end a wait.
    group: Arc<LocalGroup>,
    /// The rank, in the world: named when one of its collectives fails.
    rank: usize,
    /// Where the time the host waits for the collectives goes.
    clock: super::sequence::ExchangeClock,
}

impl SequenceComm {
    pub fn new(comm: NcclComm, group: Arc<LocalGroup>, rank: usize) -> Self {
        Self {
            comm: Mutex::new(comm),
            group,
            rank,
            clock: Default::default(),
        }
    }

    /// The communicator, its waits added to `clock`.
    pub fn timed_by(self, clock: super::sequence::ExchangeClock) -> Self {
        Self { clock, ..self }
    }

    /// Enqueues a collective on `stream` and waits for it. A collective that fails aborts the
    /// communicator and stops the group, so the step's next collective on the host reports it.
    ///
    /// # Safety
    /// `enqueue` is given a live communicator and a stream of the current context.
    unsafe fn run(
        &self,
        what: &str,
        stream: usize,
        enqueue: impl FnOnce(
            nccl_sys::ncclComm_t,
            nccl_sys::cudaStream_t,
        ) -> Result<nccl::NcclStatus, nccl::NcclError>,
    ) -> Result<(), String> {
        let mut comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let handles = comm.handles;
        if handles.comm.is_null() {
            return Err(format!(
                "{what}: the sequence group's NCCL communicator was aborted"
            ));
        }
        let deadline = Instant::now() + self.group.timeout();
        // SAFETY: the handles are live and of the current context (cubecl's primary one); the
        // stream is the caller's promise.
        let outcome = unsafe {
            enqueue(handles.comm, stream as nccl_sys::cudaStream_t)
                .map_err(|e| format!("{:?}", e.0))
                .and_then(|_| {
                    driver::event::record(handles.done, stream as driver_sys::CUstream)
                        .map_err(|e| e.to_string())
                })
                .and_then(|()| {
                    self.clock
                        .time(|| wait(handles.comm, handles.done, deadline, &self.group))
                })
        };
        outcome.map_err(|why| {
            comm.abort();
            let why = format!("{what} on CUDA device {}: {why}", comm.device.index);
            self.group.stop(self.rank, why.clone());
            why
        })
    }
}

impl SequenceComm {
    /// The sum of `values` over the group (host values of a group spanning processes).
    pub fn sum_host(&self, mut values: Vec<f64>) -> Result<Vec<f64>> {
        let mut comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        if comm.handles.comm.is_null() {
            bail!("the sequence group's NCCL communicator was aborted");
        }
        comm.sum_host(&mut values, &self.group)?;
        Ok(values)
    }
}

impl DeviceRowExchange for SequenceComm {
    unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: usize,
    ) -> Result<(), String> {
        let dtype = nccl_dtype(dtype)?;
        // SAFETY: the buffers and the stream are the caller's promise.
        unsafe {
            self.run("all-gather of a sequence group", stream, |comm, stream| {
                nccl::all_gather(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    dtype,
                    comm,
                    stream,
                )
            })
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
        let dtype = nccl_dtype(dtype)?;
        // SAFETY: the buffers and the stream are the caller's promise.
        unsafe {
            self.run(
                "reduce-scatter of a sequence group",
                stream,
                |comm, stream| {
                    nccl::reduce_scatter(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        dtype,
                        nccl_sys::ncclRedOp_t::ncclSum,
                        comm,
                        stream,
                    )
                },
            )
        }
    }
}

fn nccl_dtype(dtype: DType) -> Result<nccl_sys::ncclDataType_t, String> {
    use nccl_sys::ncclDataType_t::*;
    Ok(match dtype {
        DType::F64 => ncclFloat64,
        DType::F32 => ncclFloat32,
        DType::F16 => ncclFloat16,
        DType::BF16 => ncclBfloat16,
        other => return Err(format!("NCCL exchanges float rows, not {other:?}")),
    })
}

/// Polls `done` until it fires, the deadline passes, another rank stops, or NCCL reports an
/// error of its own.
///
/// # Safety
/// `comm` and `done` are live handles of the current context.
unsafe fn wait(
    comm: nccl_sys::ncclComm_t,
    done: driver_sys::CUevent,
    deadline: Instant,
    group: &LocalGroup,
) -> Result<(), String> {
    loop {
        // SAFETY: see the function's contract.
        match unsafe { driver_sys::cuEventQuery(done) } {
            driver_sys::CUresult::CUDA_SUCCESS => return Ok(()),
            driver_sys::CUresult::CUDA_ERROR_NOT_READY => {}
            error => return Err(format!("{error:?}")),
        }
        let mut state = nccl_sys::ncclResult_t::ncclSuccess;
        // SAFETY: see the function's contract.
        unsafe { nccl_sys::ncclCommGetAsyncError(comm, &mut state) };
        if !matches!(
            state,
            nccl_sys::ncclResult_t::ncclSuccess | nccl_sys::ncclResult_t::ncclInProgress
        ) {
            return Err(format!("NCCL reported {state:?}"));
        }
        if let Some((rank, why)) = group.stopped() {
            return Err(format!("rank {rank} stopped ({why})"));
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "not finished within {} s (--collective-timeout): a rank stopped answering",
                group.timeout().as_secs()
            ));
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

fn downcast<A: 'static, T: 'static>(value: A) -> Option<T> {
    (Box::new(value) as Box<dyn std::any::Any>)
        .downcast::<T>()
        .ok()
        .map(|boxed| *boxed)
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.handles.comm.is_null() {
            // SAFETY: no sum is in flight once the owner drops the communicator.
            unsafe {
                let _ = nccl::comm_destroy(self.handles.comm);
            }
        }
    }
}
