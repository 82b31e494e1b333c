//! Causal attention through cuDNN's fused flash attention (the runtime-compiled SDPA engine that
//! PyTorch's default SDPA backend runs on Hopper), on buffers owned by cubecl.
//!
//! The graphs are built once per shape with cuDNN's backend API ([`graph`]) and run on a
//! [`SideStream`]. Forward: `O = softmax(Q K^T * scale + causal) V` and the natural-log
//! `logsumexp` of each query's scores (`Stats`); backward: `dQ, dK, dV` from `Q, K, V, O, dO` and
//! the `logsumexp`, so an `lse` over more keys than `K` holds gives that attention's gradient
//! restricted to `K` (the token-sparse backward), as with the CubeCL kernels. Work
//! O(batch * heads * len^2 / 2 * head_dim); memory O(inputs) plus cuDNN's workspace.
//!
//! Used for 16-bit inputs, causal masks (aligned at the bottom right where the queries are the
//! last of more keys) or LongLoRA's S2 groups (causal attention within each group, over strided
//! views: see [`segments`]; no sliding window), query and key lengths and S2 groups that are
//! multiples of 128, with head dims up to 128, where `libcudnn.so.9` loads; everything else (and
//! every shape whose graph cuDNN refuses, reported once) stays on the CubeCL kernels. The length
//! rule is measured: at other lengths the backward engine reads the rows past the end of its
//! inputs, up to the next multiple of 128, and its gradients come out wrong unless that memory
//! happens to hold zeros (cudnn-frontend builds a padding-masked graph for them).

mod descriptor;
mod graph;
mod sdpa;
mod segments;

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, empty_device_dtype};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::cudnn::sys::{self, cudnnDataType_t as DataType};
use cudarc::driver::sys::CUcontext;

use self::descriptor::check;
use self::graph::{TensorId, sequence_major};
use self::sdpa::{AttentionGraph, Direction, GraphKey, build};
use self::segments::{Segment, View, pieces, segments};
use super::AttentionOptions;
use crate::cuda_interop::{SideStream, current_context, downcast};

/// Whether `libcudnn.so.9` loads and is a version whose attention graphs we rely on: 9.6 or
/// later (it clears dQ's accumulator itself), not 9.10.0 or 9.10.1 (known attention bugs).
/// Checked once.
fn library_usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        // SAFETY: opens the library, then calls a function without arguments.
        let version = unsafe { sys::is_culib_present().then(|| sys::cudnnGetVersion()) };
        matches!(version, Some(v) if v >= 90600 && !(91000..91002).contains(&v))
    })
}

/// The graph calls of attention with these inputs and options, where cuDNN takes them (before
/// asking cuDNN itself).
fn applies(
    q: &CubeTensor<CudaRuntime>,
    k: &CubeTensor<CudaRuntime>,
    options: &AttentionOptions,
) -> Option<Vec<Segment>> {
    let dims: [usize; 4] = q.meta.shape().dims();
    let [_, kv_heads, kv_len, _] = k.meta.shape().dims();
    let takes = options.sliding_window.is_none() && takes_dtype_and_head_dim(q);
    takes.then(|| segments(dims, [kv_heads, kv_len], options))?
}

/// Whether cuDNN takes queries of `q`'s dtype and head dim (at the lengths [`applies`] names).
fn takes_dtype_and_head_dim(q: &CubeTensor<CudaRuntime>) -> bool {
    let head_dim = q.meta.shape()[3];
    matches!(q.dtype, DType::BF16 | DType::F16)
        && head_dim.is_multiple_of(8)
        && head_dim <= 128
        && library_usable()
}

fn data_type(dtype: DType) -> DataType {
    match dtype {
        DType::F16 => DataType::CUDNN_DATA_HALF,
        _ => DataType::CUDNN_DATA_BFLOAT16,
    }
}

/// A tensor with the dims and strides cuDNN is given.
type Operand = (CubeTensor<CudaRuntime>, [i64; 4], [i64; 4]);

/// A tensor as cuDNN reads it: dims, strides (unit stride on the head dim, else made contiguous).
fn operand(tensor: CubeTensor<CudaRuntime>) -> Operand {
    let tensor = if tensor.meta.strides()[3] == 1 {
        tensor
    } else {
        into_contiguous(tensor)
    };
    let dims: [usize; 4] = tensor.meta.shape().dims();
    let strides: [i64; 4] = [0, 1, 2, 3].map(|i| tensor.meta.strides()[i] as i64);
    (tensor, dims.map(|d| d as i64), strides)
}

fn empty(like: &CubeTensor<CudaRuntime>, dims: &[usize], dtype: DType) -> CubeTensor<CudaRuntime> {
    empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(dims.to_vec()),
        dtype,
    )
}

/// An output `[batch, heads, len, head_dim]` stored as `[batch, len, heads, head_dim]`, the
/// layout the model's projections write and read: merging the heads of the attention output, or
/// splitting the gradients of q, k and v back into projections, is then a view, not a copy.
fn empty_sequence_major(
    like: &CubeTensor<CudaRuntime>,
    [batch, heads, len, head_dim]: [i64; 4],
    dtype: DType,
) -> CubeTensor<CudaRuntime> {
    let dims = [batch, len, heads, head_dim].map(|d| d as usize);
    let mut tensor = empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(dims.to_vec()),
        dtype,
    );
    tensor.meta.swap(1, 2);
    tensor
}

/// `q, k, v` as cuDNN reads them and the graph calls that compute their attention, or `None`
/// where cuDNN does not take them.
fn operands<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    options: &AttentionOptions,
) -> Option<([Operand; 3], Vec<Segment>)> {
    let [q, k, v] = [q, k, v].map(|t| downcast::<_, CubeTensor<CudaRuntime>>(t.clone()));
    let (q, k, v) = (q?, k?, v?);
    let segments = applies(&q, &k, options)?;
    Some(([operand(q), operand(k), operand(v)], segments))
}

/// `tensor`'s buffer from `view`'s first element on (no copy: writing it writes `tensor`).
/// Burn's slice would copy where the offset is not aligned to the pool's alignment, and a
/// gradient written into such a copy would be lost without an error.
fn at(tensor: &CubeTensor<CudaRuntime>, view: View) -> CubeTensor<CudaRuntime> {
    let mut at = tensor.clone();
    at.handle = at
        .handle
        .offset_start((view.offset * tensor.dtype.size()) as u64);
    at
}

/// Strides of the `lse` rows `[batch, q_heads, len]` (contiguous), read as `[.., len, 1]`.
fn row_strides([_, q_heads, len, _]: [i64; 4]) -> [i64; 4] {
    [q_heads * len, len, 1, 1]
}

/// Forward: `(out, lse)` as [`crate::attention::attention_with_lse`], or `None` where cuDNN does
/// not apply (the caller runs the CubeCL kernels).
pub(crate) fn try_forward<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    options: &AttentionOptions,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let ([(q, q_dims, q_strides), (k, _, k_strides), (v, _, v_strides)], segments) =
        operands(q, k, v, options)?;
    let [batch, q_heads, len, head_dim] = q_dims.map(|d| d as usize);
    let out = empty_sequence_major(&q, q_dims, q.dtype);
    let lse = empty(&q, &[batch, q_heads, len], DType::F32);
    for segment in &segments {
        let queries = |strides| segment.queries(head_dim, strides);
        let keys = |strides| segment.keys(head_dim, strides);
        let [q_view, out_view] = [q_strides, sequence_major(q_dims)].map(queries);
        let [k_view, v_view] = [k_strides, v_strides].map(keys);
        let lse_view = segment.queries(1, row_strides(q_dims));
        let views = [
            q_view, k_view, v_view, out_view, out_view, out_view, out_view,
        ];
        let key = GraphKey::of(Direction::Forward, q.dtype, views, lse_view, options.scale);
        let tensors = [
            &at(&q, q_view),
            &at(&k, k_view),
            &at(&v, v_view),
            &at(&out, out_view),
            &at(&lse, lse_view),
        ];
        run(key, &tensors)?;
    }
    Some((downcast(out)?, downcast(lse)?))
}

/// The largest f32 dQ accumulator one backward graph gets, in bytes; 0: the pool's default.
static DQ_ACCUMULATOR_LIMIT: AtomicU64 = AtomicU64::new(0);

/// Caps the f32 dQ accumulator one cuDNN backward graph writes (`None`, the default: the largest
/// buffer the device pool cuts from its small pages, see [`crate::memory::pooled_buffer_limit`]).
/// A larger backward pass runs in [`pieces`] of whole key/value head groups, one sequence at a
/// time, so a long sequence never reserves a large page for that scratch. Any limit gives the
/// same gradients; benchmarks and the GPU parity checks set a small one to run the pieces.
pub fn set_cudnn_dq_accumulator_limit(bytes: Option<u64>) {
    DQ_ACCUMULATOR_LIMIT.store(bytes.unwrap_or(0), Ordering::Relaxed);
}

/// Backward: `(dq, dk, dv)` as [`crate::attention::attention_backward`], or `None` where cuDNN
/// does not apply. Each segment runs whole or in [`pieces`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn try_backward<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    out: &CubeTensor<R>,
    lse: &CubeTensor<R>,
    grad_out: &CubeTensor<R>,
    options: &AttentionOptions,
) -> Option<(CubeTensor<R>, CubeTensor<R>, CubeTensor<R>)> {
    if lse.dtype != DType::F32 {
        return None;
    }
    let (
        [
            (q, q_dims, q_strides),
            (k, k_dims, k_strides),
            (v, _, v_strides),
        ],
        segments,
    ) = operands(q, k, v, options)?;
    let dtype = q.dtype;
    let as_dtype = |t: &CubeTensor<R>| {
        let t = downcast::<_, CubeTensor<CudaRuntime>>(t.clone())?;
        Some(if t.dtype == dtype {
            t
        } else {
            burn_cubecl::kernel::cast(t, dtype)
        })
    };
    let (out, grad_out) = (as_dtype(out)?, as_dtype(grad_out)?);
    let lse = into_contiguous(downcast::<_, CubeTensor<CudaRuntime>>(lse.clone())?);
    let (out, _, out_strides) = operand(out);
    let (grad_out, _, grad_out_strides) = operand(grad_out);
    let grad_q = empty_sequence_major(&q, q_dims, dtype);
    let grad_k = empty_sequence_major(&q, k_dims, dtype);
    let grad_v = empty_sequence_major(&q, k_dims, dtype);
    let head_dim = q_dims[3] as usize;
    let limit = match DQ_ACCUMULATOR_LIMIT.load(Ordering::Relaxed) {
        0 => crate::memory::cube_pooled_buffer_limit::<CudaRuntime>(&q.device),
        bytes => Some(bytes),
    };
    let pieces = segments
        .into_iter()
        .flat_map(|segment| pieces(segment, head_dim, limit));
    for piece in pieces {
        let queries = |strides| piece.queries(head_dim, strides);
        let keys = |strides| piece.keys(head_dim, strides);
        let [q_view, out_view, grad_out_view, grad_q_view] = [
            q_strides,
            out_strides,
            grad_out_strides,
            sequence_major(q_dims),
        ]
        .map(queries);
        let [k_view, v_view, grad_kv_view] =
            [k_strides, v_strides, sequence_major(k_dims)].map(keys);
        let lse_view = piece.queries(1, row_strides(q_dims));
        let views = [
            q_view,
            k_view,
            v_view,
            out_view,
            grad_out_view,
            grad_q_view,
            grad_kv_view,
        ];
        let key = GraphKey::of(Direction::Backward, dtype, views, lse_view, options.scale);
        // Scratch the graph reads back: `rowsum(dO * O)` and dQ's f32 accumulator (cleared by
        // cuDNN).
        let piece_dims = q_view.dims.map(|d| d as usize);
        let softmax_sum = empty(&q, &piece_dims[..3], DType::F32);
        let dq_accum = empty(&q, &piece_dims, DType::F32);
        let tensors = [
            &at(&q, q_view),
            &at(&k, k_view),
            &at(&v, v_view),
            &at(&out, out_view),
            &at(&lse, lse_view),
            &at(&grad_out, grad_out_view),
            &at(&grad_q, grad_q_view),
            &at(&grad_k, grad_kv_view),
            &at(&grad_v, grad_kv_view),
            &softmax_sum,
            &dq_accum,
        ];
        run(key, &tensors)?;
    }
    Some((downcast(grad_q)?, downcast(grad_k)?, downcast(grad_v)?))
}

/// Per-context state: handle, side stream and graphs (`Err`: cuDNN refused that shape).
struct ContextState {
    handle: sys::cudnnHandle_t,
    side: SideStream,
    graphs: HashMap<GraphKey, Result<AttentionGraph, String>>,
}

// SAFETY: the raw handles are only used under the `STATES` lock, on cubecl's device thread of the
// context they belong to.
unsafe impl Send for ContextState {}

static STATES: Mutex<Option<HashMap<usize, ContextState>>> = Mutex::new(None);

impl ContextState {
    fn new() -> Result<Self, String> {
        let side = SideStream::new()?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: `handle` receives a fresh cuDNN handle bound to our stream.
        unsafe {
            check(sys::cudnnCreate(&mut handle), "create handle")?;
            check(
                sys::cudnnSetStream(handle, side.stream as sys::cudaStream_t),
                "set stream",
            )?;
        }
        Ok(Self {
            handle,
            side,
            graphs: HashMap::new(),
        })
    }
}

/// Builds (once) and runs the graph of `key` on `tensors`, `None` when cuDNN refuses it (said
/// once per shape on stderr). A failure to run a built graph is a bug and panics.
fn run(key: GraphKey, tensors: &[&CubeTensor<CudaRuntime>]) -> Option<()> {
    let client = tensors[0].client.clone();
    let resources: Vec<_> = tensors
        .iter()
        .map(|tensor| {
            client
                .get_resource(tensor.handle.clone())
                .expect("cubecl buffer of an attention operand")
        })
        .collect();
    let pointers: Vec<u64> = resources.iter().map(|r| r.resource().ptr).collect();
    let like = tensors[0].clone();
    let outcome = client
        .exclusive(move || -> Result<Option<usize>, String> {
            with_state(|state, _| {
                let handle = state.handle;
                let graph = state.graphs.entry(key).or_insert_with(|| {
                    build(handle, &key).inspect_err(|reason| {
                        eprintln!(
                            "cuDNN attention unavailable for {key:?} ({reason}); using the CubeCL kernels"
                        )
                    })
                });
                Ok(graph.as_ref().ok().map(|graph| graph.plan.workspace_bytes))
            })
        })
        .expect("cubecl device thread")
        .unwrap_or_else(|error| panic!("cuDNN attention {key:?}: {error}"))?;
    // The workspace comes from cubecl's pool, so it is counted and reused like any buffer (never
    // null, as cuDNN asks, even when the plan needs none).
    let workspace = empty(&like, &[outcome.max(16)], DType::U8);
    let workspace_resource = client
        .get_resource(workspace.handle.clone())
        .expect("cubecl buffer of the cuDNN workspace");
    let workspace_ptr = workspace_resource.resource().ptr;
    client
        .exclusive(move || -> Result<(), String> {
            with_state(|state, context| {
                let Some(Ok(graph)) = state.graphs.get(&key) else {
                    return Err("graph built above".into());
                };
                let mut scalars: Vec<u32> = graph.scalars.iter().map(|&(_, bits)| bits).collect();
                let mut bindings: Vec<(TensorId, *mut c_void)> = graph
                    .bound
                    .iter()
                    .map(|&(tensor, index)| (tensor, pointers[index] as *mut c_void))
                    .collect();
                for ((tensor, _), value) in graph.scalars.iter().zip(scalars.iter_mut()) {
                    bindings.push((*tensor, (value as *mut u32).cast()));
                }
                // SAFETY: the pointers are live cubecl buffers of the described sizes (kept alive by
                // `resources` until enqueued, and by the context-wide join afterwards).
                unsafe {
                    state.side.join_inputs(context)?;
                    graph
                        .plan
                        .execute(state.handle, &bindings, workspace_ptr as *mut c_void)?;
                    state.side.join_output(context)
                }
            })
        })
        .expect("cubecl device thread")
        .unwrap_or_else(|error| panic!("cuDNN attention {key:?}: {error}"));
    drop(workspace_resource);
    drop(resources);
    Some(())
}

/// `f` on the cuDNN state of the current context (made on first use), on cubecl's device thread.
fn with_state<T>(
    f: impl FnOnce(&mut ContextState, CUcontext) -> Result<T, String>,
) -> Result<T, String> {
    let context = current_context()?;
    let mut guard = STATES.lock().unwrap_or_else(|e| e.into_inner());
    let state = match guard
        .get_or_insert_with(HashMap::new)
        .entry(context as usize)
    {
        Entry::Occupied(entry) => entry.into_mut(),
        Entry::Vacant(entry) => entry.insert(ContextState::new()?),
    };
    f(state, context)
}
