//! The exchange's collectives on cubecl's CUDA buffers, for groups with device collectives
//! (NCCL): the rows never pass through the host.
//!
//! Each collective runs on a stream of our own per context that first waits for everything
//! already submitted (the kernels that wrote the rows, see [`crate::cuda_interop`]), and the group
//! returns once it has finished: it waits against its deadline, so a rank that stopped answering
//! ends the wait rather than leaving a kernel that never finishes. Gradients are summed in f32
//! whatever their dtype, as the host path does.

use std::collections::HashMap;
use std::sync::Mutex;

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;

use super::Exchange;
use crate::cuda_interop::{SideStream, current_context, downcast};

/// The collectives' stream of each context, made at its first collective; taken out while a
/// collective runs, so that the ranks of one process (each on its own device thread) never wait
/// on each other for this lock while they wait on each other in the collective.
static STREAMS: Mutex<Option<HashMap<usize, SideStream>>> = Mutex::new(None);

#[derive(Clone, Copy)]
pub(super) enum Collective {
    /// `[rows, width]` from each rank to `[ranks * rows, width]`, in rank order.
    AllGather,
    /// `[ranks * rows, width]` on each rank to this rank's `[rows, width]` of their sum.
    ReduceScatter,
}

/// `collective` of `rows: [rows, width]` over `exchange`'s group on the device; `None` when
/// `rows` is not a CUDA tensor or the group has no device collectives. A collective that fails
/// gives zeros (the failure stays with the group, see [`super::RowExchange`]).
pub(super) fn on_device<R: CubeRuntime>(
    rows: &CubeTensor<R>,
    exchange: &Exchange,
    collective: Collective,
) -> Option<CubeTensor<R>> {
    exchange.0.device()?;
    let tensor = downcast::<_, CubeTensor<CudaRuntime>>(rows.clone())?;
    let dtype = tensor.dtype;
    let summed_in = match collective {
        Collective::AllGather => dtype,
        Collective::ReduceScatter => DType::F32,
    };
    let tensor = into_contiguous(cast(tensor, summed_in));
    let [rows_in, width] = tensor.meta.shape().dims::<2>();
    let ranks = exchange.ranks();
    let (rows_out, count) = match collective {
        Collective::AllGather => (rows_in * ranks, rows_in * width),
        Collective::ReduceScatter => (rows_in / ranks, rows_in / ranks * width),
    };
    let client = tensor.client.clone();
    let shape = Shape::new([rows_out, width]);
    let output = empty_device_contiguous_dtype(
        client.clone(),
        tensor.device.clone(),
        shape.clone(),
        summed_in,
    );
    let send = client
        .get_resource(tensor.handle.clone())
        .expect("cubecl buffer of exchanged rows");
    let recv = client
        .get_resource(output.handle.clone())
        .expect("cubecl buffer of exchanged rows");
    let (send_pointer, recv_pointer) = (send.resource().ptr, recv.resource().ptr);
    let group = exchange.clone();
    let outcome = client
        .exclusive(move || -> Result<(), String> {
            let context = current_context()?;
            let taken = STREAMS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert_with(HashMap::new)
                .remove(&(context as usize));
            let mut stream = match taken {
                Some(stream) => stream,
                None => SideStream::new()?,
            };
            let device = group.0.device().expect("checked above");
            // SAFETY: both buffers are live cubecl buffers of the current context with the
            // sizes the collective needs (held until it returns, and it returns once finished);
            // the stream waits for the kernels that wrote `send`.
            let outcome = unsafe {
                stream.join_inputs(context).and_then(|()| {
                    let on = stream.stream as usize;
                    match collective {
                        Collective::AllGather => {
                            device.all_gather(send_pointer, recv_pointer, count, summed_in, on)
                        }
                        Collective::ReduceScatter => {
                            device.reduce_scatter(send_pointer, recv_pointer, count, summed_in, on)
                        }
                    }
                })
            };
            STREAMS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert_with(HashMap::new)
                .insert(context as usize, stream);
            outcome
        })
        .map_err(|e| format!("{e:?}"))
        .and_then(|outcome| outcome);
    drop((send, recv));
    let output = match outcome {
        Ok(()) => output,
        Err(_) => zeros_client(client, tensor.device.clone(), shape, summed_in),
    };
    Some(downcast(cast(output, dtype)).expect("the runtime it came from"))
}
