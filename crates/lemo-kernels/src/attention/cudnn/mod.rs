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
//! Used for 16-bit inputs, plain causal masks (no sliding window; S2 comes here folded into
//! causal groups, see [`super::shifted_fold`]) and equal query and key lengths that are a
//! multiple of 128, with head dims up to 128, where `libcudnn.so.9` loads; everything else (and
//! every shape whose graph cuDNN refuses, reported once) stays on the CubeCL kernels. The length
//! rule is measured: at other lengths the backward engine reads the rows past the end of its
//! inputs, up to the next multiple of 128, and its gradients come out wrong unless that memory
//! happens to hold zeros (cudnn-frontend builds a padding-masked graph for them).

mod descriptor;
mod graph;
mod sdpa;

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::c_void;
use std::ops::Range;
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

/// Whether cuDNN takes attention with these inputs and options (before asking cuDNN itself).
fn applies(
    q: &CubeTensor<CudaRuntime>,
    k: &CubeTensor<CudaRuntime>,
    options: &AttentionOptions,
) -> bool {
    options.sliding_window.is_none()
        && options.shifted_group.is_none()
        && q.meta.shape()[2] == k.meta.shape()[2]
        && q.meta.shape()[2].is_multiple_of(super::FUSED_ATTENTION_LENGTH_MULTIPLE)
        && takes_dtype_and_head_dim(q)
}

/// Whether cuDNN takes queries of `q`'s dtype and head dim (at the lengths [`applies`] names).
fn takes_dtype_and_head_dim(q: &CubeTensor<CudaRuntime>) -> bool {
    let head_dim = q.meta.shape()[3];
    matches!(q.dtype, DType::BF16 | DType::F16)
        && head_dim.is_multiple_of(8)
        && head_dim <= 128
        && library_usable()
}

/// The length multiple at which cuDNN takes plain causal attention of `q`'s dtype and head dim,
/// if it takes it at all (see [`crate::AttentionBackend::lemo_fused_attention_length_multiple`]).
pub(crate) fn causal_length_multiple<R: CubeRuntime>(q: &CubeTensor<R>) -> Option<usize> {
    let q = downcast::<_, CubeTensor<CudaRuntime>>(q.clone())?;
    takes_dtype_and_head_dim(&q).then_some(super::FUSED_ATTENTION_LENGTH_MULTIPLE)
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

/// `q, k, v` as cuDNN reads them, or `None` where cuDNN does not take them.
fn operands<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    options: &AttentionOptions,
) -> Option<[Operand; 3]> {
    let [q, k, v] = [q, k, v].map(|t| downcast::<_, CubeTensor<CudaRuntime>>(t.clone()));
    let (q, k, v) = (q?, k?, v?);
    applies(&q, &k, options).then(|| [operand(q), operand(k), operand(v)])
}

/// Forward: `(out, lse)` as [`crate::attention::attention_with_lse`], or `None` where cuDNN does
/// not apply (the caller runs the CubeCL kernels).
pub(crate) fn try_forward<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    options: &AttentionOptions,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let [
        (q, q_dims, q_strides),
        (k, k_dims, k_strides),
        (v, _, v_strides),
    ] = operands(q, k, v, options)?;
    let [batch, q_heads, len, _] = q_dims.map(|d| d as usize);
    let out = empty_sequence_major(&q, q_dims, q.dtype);
    let lse = empty(&q, &[batch, q_heads, len], DType::F32);
    let key = GraphKey {
        direction: Direction::Forward,
        dtype: q.dtype,
        q_dims,
        kv_heads: k_dims[1],
        strides: [
            q_strides,
            k_strides,
            v_strides,
            sequence_major(q_dims),
            sequence_major(q_dims),
            sequence_major(q_dims),
            sequence_major(q_dims),
        ],
        scale_bits: options.scale.to_bits(),
    };
    let tensors = [&q, &k, &v, &out, &lse];
    run(key, &tensors)?;
    Some((downcast(out)?, downcast(lse)?))
}

/// The largest f32 dQ accumulator one backward graph gets, in bytes; 0: the pool's default.
static DQ_ACCUMULATOR_LIMIT: AtomicU64 = AtomicU64::new(0);

/// Caps the f32 dQ accumulator one cuDNN backward graph writes (`None`, the default: the largest
/// buffer the device pool cuts from its small pages, see [`crate::memory::pooled_buffer_limit`]).
/// A larger backward pass runs in pieces of whole key/value head groups, one sequence at a time,
/// so a long sequence never reserves a large page for that scratch. Any limit gives the same
/// gradients; benchmarks and the GPU parity checks set a small one to run the pieces.
pub fn set_cudnn_dq_accumulator_limit(bytes: Option<u64>) {
    DQ_ACCUMULATOR_LIMIT.store(bytes.unwrap_or(0), Ordering::Relaxed);
}

/// One backward graph's share: these sequences, these key/value heads and their query heads.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Piece {
    batch: Range<usize>,
    kv_heads: Range<usize>,
}

/// The backward pass whole when its f32 dQ accumulator (`[batch, q_heads, len, head_dim]`) fits
/// `limit` bytes, else in pieces of one sequence and as many whole key/value head groups as fit
/// (at least one; split evenly). O(batch * kv_heads) pieces at most.
fn backward_pieces(
    [batch, q_heads, len, head_dim]: [usize; 4],
    kv_heads: usize,
    limit: Option<u64>,
) -> Vec<Piece> {
    let per_kv_head = (q_heads / kv_heads * len * head_dim * 4) as u64;
    let Some(limit) = limit.filter(|&limit| per_kv_head * (batch * kv_heads) as u64 > limit) else {
        return vec![Piece {
            batch: 0..batch,
            kv_heads: 0..kv_heads,
        }];
    };
    let fitting = (limit / per_kv_head).clamp(1, kv_heads as u64) as usize;
    let size = kv_heads.div_ceil(kv_heads.div_ceil(fitting));
    (0..batch)
        .flat_map(|sequence| {
            (0..kv_heads).step_by(size).map(move |head| Piece {
                batch: sequence..sequence + 1,
                kv_heads: head..(head + size).min(kv_heads),
            })
        })
        .collect()
}

/// `tensor` restricted to `ranges` of its leading dims: the same buffer at an offset, strides
/// unchanged (no copy, so writing the view writes `tensor`). Not Burn's slice, which copies
/// where the offset is not aligned to the pool's alignment: a gradient written into such a copy
/// would be lost without an error.
fn narrow(tensor: &CubeTensor<CudaRuntime>, ranges: &[Range<usize>]) -> CubeTensor<CudaRuntime> {
    let mut view = tensor.clone();
    let mut offset = 0;
    for (dim, range) in ranges.iter().enumerate() {
        offset += range.start * tensor.meta.strides()[dim];
        view.meta.shape_mut()[dim] = range.len();
    }
    view.handle = view
        .handle
        .offset_start((offset * tensor.dtype.size()) as u64);
    view
}

/// Backward: `(dq, dk, dv)` as [`crate::attention::attention_backward`], or `None` where cuDNN
/// does not apply. Run whole or in [`backward_pieces`].
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
    let [
        (q, q_dims, q_strides),
        (k, k_dims, k_strides),
        (v, _, v_strides),
    ] = operands(q, k, v, options)?;
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
    let [_, q_heads, len, head_dim] = q_dims.map(|d| d as usize);
    let group = q_heads / k_dims[1] as usize;
    let limit = match DQ_ACCUMULATOR_LIMIT.load(Ordering::Relaxed) {
        0 => crate::memory::cube_pooled_buffer_limit::<CudaRuntime>(&q.device),
        bytes => Some(bytes),
    };
    let strides = [
        q_strides,
        k_strides,
        v_strides,
        out_strides,
        grad_out_strides,
        sequence_major(q_dims),
        sequence_major(k_dims),
    ];
    for piece in backward_pieces(q_dims.map(|d| d as usize), k_dims[1] as usize, limit) {
        let (sequences, kv_heads) = (piece.batch.clone(), piece.kv_heads.clone());
        let q_heads = kv_heads.start * group..kv_heads.end * group;
        let queries =
            |t: &CubeTensor<CudaRuntime>| narrow(t, &[sequences.clone(), q_heads.clone()]);
        let keys = |t: &CubeTensor<CudaRuntime>| narrow(t, &[sequences.clone(), kv_heads.clone()]);
        let piece_q_dims = [sequences.len(), q_heads.len(), len, head_dim];
        let key = GraphKey {
            direction: Direction::Backward,
            dtype,
            q_dims: piece_q_dims.map(|d| d as i64),
            kv_heads: kv_heads.len() as i64,
            strides,
            scale_bits: options.scale.to_bits(),
        };
        // Scratch the graph reads back: `rowsum(dO * O)` and dQ's f32 accumulator (cleared by
        // cuDNN).
        let softmax_sum = empty(&q, &piece_q_dims[..3], DType::F32);
        let dq_accum = empty(&q, &piece_q_dims, DType::F32);
        let tensors = [
            &queries(&q),
            &keys(&k),
            &keys(&v),
            &queries(&out),
            &queries(&lse),
            &queries(&grad_out),
            &queries(&grad_q),
            &keys(&grad_k),
            &keys(&grad_v),
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
                let mut scalars: Vec<f32> = graph.scalars.iter().map(|&(_, value)| value).collect();
                let mut bindings: Vec<(TensorId, *mut c_void)> = graph
                    .bound
                    .iter()
                    .map(|&(tensor, index)| (tensor, pointers[index] as *mut c_void))
                    .collect();
                for ((tensor, _), value) in graph.scalars.iter().zip(scalars.iter_mut()) {
                    bindings.push((*tensor, (value as *mut f32).cast()));
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

#[cfg(test)]
mod tests {
    use super::{Piece, backward_pieces};

    fn pieces(batch: usize, q_heads: usize, kv_heads: usize, limit: Option<u64>) -> Vec<Piece> {
        backward_pieces([batch, q_heads, 1024, 128], kv_heads, limit)
    }

    #[test]
    fn a_backward_within_the_limit_runs_whole() {
        let whole = vec![Piece {
            batch: 0..2,
            kv_heads: 0..8,
        }];
        // 2 * 32 * 1024 * 128 f32: 32 MiB.
        assert_eq!(pieces(2, 32, 8, None), whole);
        assert_eq!(pieces(2, 32, 8, Some(32 << 20)), whole);
    }

    #[test]
    fn a_larger_backward_splits_per_sequence_into_even_head_groups() {
        // One key/value head with its 4 query heads: 2 MiB; 5 fit in 10 MiB, so 8 heads go in
        // two groups of 4, per sequence.
        let split = pieces(2, 32, 8, Some(10 << 20));
        let expected: Vec<Piece> = [(0, 0..4), (0, 4..8), (1, 0..4), (1, 4..8)]
            .into_iter()
            .map(|(sequence, kv_heads)| Piece {
                batch: sequence..sequence + 1,
                kv_heads,
            })
            .collect();
        assert_eq!(split, expected);
        // Uneven: 3 of 8 fit, so three groups of at most 3.
        let uneven: Vec<_> = pieces(1, 8, 8, Some(3 << 19))
            .into_iter()
            .map(|piece| piece.kv_heads)
            .collect();
        assert_eq!(uneven, [0..3, 3..6, 6..8]);
    }

    #[test]
    fn a_head_group_past_the_limit_still_runs_alone() {
        let single: Vec<_> = pieces(1, 32, 8, Some(1))
            .into_iter()
            .map(|piece| piece.kv_heads)
            .collect();
        assert_eq!(
            single,
            (0..8).map(|head| head..head + 1).collect::<Vec<_>>()
        );
    }
}
