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
//! Used for 16-bit inputs, plain causal masks (no sliding window, no S2) and equal query and key
//! lengths that are a multiple of 128, with head dims up to 128, where `libcudnn.so.9` loads;
//! everything else (and every shape whose graph cuDNN refuses, reported once) stays on the CubeCL
//! kernels. The length rule is measured: at other lengths the backward engine reads the rows past
//! the end of its inputs, up to the next multiple of 128, and its gradients come out wrong unless
//! that memory happens to hold zeros (cudnn-frontend builds a padding-masked graph for them).

mod descriptor;
mod graph;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::cudnn::sys::{self, cudnnDataType_t as DataType, cudnnPointwiseMode_t as Pointwise};

use self::descriptor::check;
use self::graph::{GraphBuilder, Plan, TensorId, contiguous};
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
    let head_dim = q.meta.shape()[3];
    matches!(q.dtype, DType::BF16 | DType::F16)
        && options.sliding_window.is_none()
        && options.shifted_group.is_none()
        && q.meta.shape()[2] == k.meta.shape()[2]
        && q.meta.shape()[2].is_multiple_of(128)
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

/// A tensor as cuDNN reads it: dims, strides (unit stride on the head dim, else made contiguous).
fn operand(tensor: CubeTensor<CudaRuntime>) -> (CubeTensor<CudaRuntime>, [i64; 4], [i64; 4]) {
    let tensor = if tensor.meta.strides()[3] == 1 {
        tensor
    } else {
        into_contiguous(tensor)
    };
    let dims: [usize; 4] = tensor.meta.shape().dims();
    let strides = tensor.meta.strides();
    (
        tensor.clone(),
        dims.map(|d| d as i64),
        [0, 1, 2, 3].map(|i| strides[i] as i64),
    )
}

fn empty(like: &CubeTensor<CudaRuntime>, dims: &[usize], dtype: DType) -> CubeTensor<CudaRuntime> {
    empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(dims.to_vec()),
        dtype,
    )
}

/// Forward: `(out, lse)` as [`crate::attention::attention_with_lse`], or `None` where cuDNN does
/// not apply (the caller runs the CubeCL kernels).
pub(crate) fn try_forward<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    options: &AttentionOptions,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let q = downcast::<_, CubeTensor<CudaRuntime>>(q.clone())?;
    let k = downcast::<_, CubeTensor<CudaRuntime>>(k.clone())?;
    let v = downcast::<_, CubeTensor<CudaRuntime>>(v.clone())?;
    if !applies(&q, &k, options) {
        return None;
    }
    let (q, q_dims, q_strides) = operand(q);
    let (k, k_dims, k_strides) = operand(k);
    let (v, _, v_strides) = operand(v);
    let [batch, q_heads, len, head_dim] = q_dims.map(|d| d as usize);
    let out = empty(&q, &[batch, q_heads, len, head_dim], q.dtype);
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
            contiguous(q_dims),
            contiguous(q_dims),
        ],
        scale_bits: options.scale.to_bits(),
    };
    let tensors = [&q, &k, &v, &out, &lse];
    run(key, &tensors)?;
    Some((downcast(out)?, downcast(lse)?))
}

/// Backward: `(dq, dk, dv)` as [`crate::attention::attention_backward`], or `None` where cuDNN
/// does not apply.
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
    let q = downcast::<_, CubeTensor<CudaRuntime>>(q.clone())?;
    let k = downcast::<_, CubeTensor<CudaRuntime>>(k.clone())?;
    let v = downcast::<_, CubeTensor<CudaRuntime>>(v.clone())?;
    if !applies(&q, &k, options) || lse.dtype != DType::F32 {
        return None;
    }
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
    let (q, q_dims, q_strides) = operand(q);
    let (k, k_dims, k_strides) = operand(k);
    let (v, _, v_strides) = operand(v);
    let (out, _, out_strides) = operand(out);
    let (grad_out, _, grad_out_strides) = operand(grad_out);
    let [batch, q_heads, len, head_dim] = q_dims.map(|d| d as usize);
    let grad_q = empty(&q, &q_dims.map(|d| d as usize), dtype);
    let grad_k = empty(&q, &k_dims.map(|d| d as usize), dtype);
    let grad_v = empty(&q, &k_dims.map(|d| d as usize), dtype);
    let key = GraphKey {
        direction: Direction::Backward,
        dtype,
        q_dims,
        kv_heads: k_dims[1],
        strides: [
            q_strides,
            k_strides,
            v_strides,
            out_strides,
            grad_out_strides,
        ],
        scale_bits: options.scale.to_bits(),
    };
    // Scratch the graph reads back: `rowsum(dO * O)` and dQ's f32 accumulator (cleared by cuDNN).
    let softmax_sum = empty(&q, &[batch, q_heads, len], DType::F32);
    let dq_accum = empty(&q, &[batch, q_heads, len, head_dim], DType::F32);
    let tensors = [
        &q,
        &k,
        &v,
        &out,
        &lse,
        &grad_out,
        &grad_q,
        &grad_k,
        &grad_v,
        &softmax_sum,
        &dq_accum,
    ];
    run(key, &tensors)?;
    Some((downcast(grad_q)?, downcast(grad_k)?, downcast(grad_v)?))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Direction {
    Forward,
    Backward,
}

/// Everything a graph depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GraphKey {
    direction: Direction,
    dtype: DType,
    /// `[batch, q_heads, len, head_dim]`.
    q_dims: [i64; 4],
    kv_heads: i64,
    /// Forward: q, k, v, out, (out again); backward: q, k, v, out, dO.
    strides: [[i64; 4]; 5],
    scale_bits: u32,
}

/// A built graph: its plan, which of the caller's tensors each bound graph tensor reads (a
/// transposed view reads the same buffer as its tensor), and its by-value scalars.
struct AttentionGraph {
    plan: Plan,
    bound: Vec<(TensorId, usize)>,
    scalars: Vec<(TensorId, f32)>,
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
            let context = current_context()?;
            let mut guard = STATES.lock().unwrap_or_else(|e| e.into_inner());
            let states = guard.get_or_insert_with(HashMap::new);
            if !states.contains_key(&(context as usize)) {
                states.insert(context as usize, ContextState::new()?);
            }
            let state = states.get_mut(&(context as usize)).expect("inserted");
            let handle = state.handle;
            let graph = state
                .graphs
                .entry(key)
                .or_insert_with(|| build(handle, &key).inspect_err(|reason| {
                    eprintln!(
                        "cuDNN attention unavailable for {key:?} ({reason}); using the CubeCL kernels"
                    )
                }));
            let Ok(graph) = graph else {
                return Ok(None);
            };
            Ok(Some(graph.plan.workspace_bytes))
        })
        .expect("cubecl device thread")
        .unwrap_or_else(|error| panic!("cuDNN attention {key:?}: {error}"))?;
    // The workspace comes from cubecl's pool, so it is counted and reused like any buffer.
    let workspace = (outcome > 0).then(|| empty(&like, &[outcome], DType::U8));
    let workspace_resource = workspace.as_ref().map(|w| {
        client
            .get_resource(w.handle.clone())
            .expect("cubecl buffer of the cuDNN workspace")
    });
    let workspace_ptr = workspace_resource.as_ref().map_or(0, |r| r.resource().ptr);
    client
        .exclusive(move || -> Result<(), String> {
            let context = current_context()?;
            let mut guard = STATES.lock().unwrap_or_else(|e| e.into_inner());
            let state = guard
                .as_mut()
                .and_then(|states| states.get_mut(&(context as usize)))
                .ok_or("cuDNN state of the context")?;
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
        .expect("cubecl device thread")
        .unwrap_or_else(|error| panic!("cuDNN attention {key:?}: {error}"));
    drop(workspace_resource);
    drop(resources);
    Some(())
}

fn build(handle: sys::cudnnHandle_t, key: &GraphKey) -> Result<AttentionGraph, String> {
    match key.direction {
        Direction::Forward => forward_graph(handle, key),
        Direction::Backward => backward_graph(handle, key),
    }
}

/// Dims and strides of `[.., rows, cols]` read as `[.., cols, rows]`.
fn transposed(dims: [i64; 4], strides: [i64; 4]) -> ([i64; 4], [i64; 4]) {
    (
        [dims[0], dims[1], dims[3], dims[2]],
        [strides[0], strides[1], strides[3], strides[2]],
    )
}

const FLOAT: DataType = DataType::CUDNN_DATA_FLOAT;

/// `scale * Q K^T` (`[batch, q_heads, len, len]`, f32 in the graph); query head `h` reads key
/// head `h / (q_heads / kv_heads)` through the matmul's batch broadcast.
fn scaled_scores(
    graph: &mut GraphBuilder,
    q: TensorId,
    k_transposed: TensorId,
    scale: TensorId,
) -> Result<TensorId, String> {
    let [batch, q_heads, len, _] = q.dims;
    let dims = [batch, q_heads, len, len];
    let products = graph.intermediate(dims, FLOAT)?;
    graph.matmul(q, k_transposed, products)?;
    let scaled = graph.intermediate(dims, FLOAT)?;
    graph.binary(Pointwise::CUDNN_POINTWISE_MUL, products, scale, scaled)?;
    Ok(scaled)
}

/// `scores` with `hidden` (`-inf`) above the diagonal.
fn causal(
    graph: &mut GraphBuilder,
    scores: TensorId,
    hidden: TensorId,
) -> Result<TensorId, String> {
    let visible = graph.causal_mask(scores)?;
    let masked = graph.intermediate(scores.dims, FLOAT)?;
    graph.select(scores, hidden, visible, masked)?;
    Ok(masked)
}

/// The inputs both graphs read: q, K^T (over k's buffer), and the scale and `-inf` scalars.
struct Inputs {
    q: TensorId,
    k_transposed: TensorId,
    scale: TensorId,
    hidden: TensorId,
}

fn inputs(graph: &mut GraphBuilder, key: &GraphKey) -> Result<(Inputs, [i64; 4]), String> {
    let dtype = data_type(key.dtype);
    let [batch, _, len, head_dim] = key.q_dims;
    let kv_dims = [batch, key.kv_heads, len, head_dim];
    let q = graph.input(key.q_dims, key.strides[0], dtype)?;
    let (kt_dims, kt_strides) = transposed(kv_dims, key.strides[1]);
    let k_transposed = graph.input(kt_dims, kt_strides, dtype)?;
    let scale = graph.scalar(FLOAT)?;
    let hidden = graph.scalar(FLOAT)?;
    Ok((
        Inputs {
            q,
            k_transposed,
            scale,
            hidden,
        },
        kv_dims,
    ))
}

fn scalars(inputs: &Inputs, key: &GraphKey) -> Vec<(TensorId, f32)> {
    vec![
        (inputs.scale, f32::from_bits(key.scale_bits)),
        (inputs.hidden, f32::NEG_INFINITY),
    ]
}

/// Forward: `M = rowmax(S)`, `E = exp(S - M)`, `L = rowsum(E)`, `Stats = M + ln L`,
/// `O = (E / L) V` with `S` the scaled, causally masked scores. Bound: q, k (as K^T), v, out, lse.
fn forward_graph(handle: sys::cudnnHandle_t, key: &GraphKey) -> Result<AttentionGraph, String> {
    let mut graph = GraphBuilder::default();
    let dtype = data_type(key.dtype);
    let (inputs, kv_dims) = inputs(&mut graph, key)?;
    let v = graph.input(kv_dims, key.strides[2], dtype)?;
    let scores = scaled_scores(&mut graph, inputs.q, inputs.k_transposed, inputs.scale)?;
    let masked = causal(&mut graph, scores, inputs.hidden)?;

    let [batch, q_heads, len, _] = key.q_dims;
    let row_dims = [batch, q_heads, len, 1];
    let max = graph.intermediate(row_dims, FLOAT)?;
    graph.reduction(
        sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_MAX,
        masked,
        max,
    )?;
    let shifted = graph.intermediate(masked.dims, FLOAT)?;
    graph.binary(Pointwise::CUDNN_POINTWISE_SUB, masked, max, shifted)?;
    let exponentials = graph.intermediate(masked.dims, FLOAT)?;
    graph.unary(Pointwise::CUDNN_POINTWISE_EXP, shifted, exponentials)?;
    let sum = graph.intermediate(row_dims, FLOAT)?;
    graph.reduction(
        sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD,
        exponentials,
        sum,
    )?;
    let log_sum = graph.intermediate(row_dims, FLOAT)?;
    graph.unary(Pointwise::CUDNN_POINTWISE_LOG, sum, log_sum)?;
    let lse = graph.input(row_dims, contiguous(row_dims), FLOAT)?;
    graph.binary(Pointwise::CUDNN_POINTWISE_ADD, max, log_sum, lse)?;
    // The second product's left operand must have the inputs' dtype.
    let probabilities = graph.intermediate(masked.dims, dtype)?;
    graph.binary(
        Pointwise::CUDNN_POINTWISE_DIV,
        exponentials,
        sum,
        probabilities,
    )?;
    let out = graph.input(key.q_dims, key.strides[3], dtype)?;
    graph.matmul(probabilities, v, out)?;

    Ok(AttentionGraph {
        plan: graph.plan(handle)?,
        bound: vec![
            (inputs.q, 0),
            (inputs.k_transposed, 1),
            (v, 2),
            (out, 3),
            (lse, 4),
        ],
        scalars: scalars(&inputs, key),
    })
}

/// Backward, FlashAttention-2's equations: `D = rowsum(dO * O)` (into `softmax_sum`),
/// `P = exp(S - Stats)` (masked), `dV = P^T dO`, `dS = P * (dO V^T - D) * scale`, `dK = dS^T Q`,
/// `dQ = dS K` (accumulated in f32 in `dq_accum`, then cast). With fewer key/value heads, dK and
/// dV are computed per query head and summed over each group. Bound: q, k (as K^T), v (as V^T),
/// out, lse, dO, dQ, dK, dV, softmax_sum, dq_accum.
fn backward_graph(handle: sys::cudnnHandle_t, key: &GraphKey) -> Result<AttentionGraph, String> {
    let mut graph = GraphBuilder::default();
    let dtype = data_type(key.dtype);
    let (inputs, kv_dims) = inputs(&mut graph, key)?;
    let [batch, q_heads, len, head_dim] = key.q_dims;
    let (vt_dims, vt_strides) = transposed(kv_dims, key.strides[2]);
    let v_transposed = graph.input(vt_dims, vt_strides, dtype)?;
    let out = graph.input(key.q_dims, key.strides[3], dtype)?;
    let grad_out = graph.input(key.q_dims, key.strides[4], dtype)?;
    let row_dims = [batch, q_heads, len, 1];
    let lse = graph.input(row_dims, contiguous(row_dims), FLOAT)?;
    let grad_q = graph.input(key.q_dims, contiguous(key.q_dims), dtype)?;
    let grad_k = graph.input(kv_dims, contiguous(kv_dims), dtype)?;
    let grad_v = graph.input(kv_dims, contiguous(kv_dims), dtype)?;
    let one = graph.scalar(FLOAT)?;
    let softmax_sum = graph.input(row_dims, contiguous(row_dims), FLOAT)?;
    let dq_accum = graph.input(key.q_dims, contiguous(key.q_dims), FLOAT)?;

    // D = rowsum(dO * O), through the (dropout) scale of one the engine's pattern expects.
    let products = graph.intermediate(key.q_dims, FLOAT)?;
    graph.binary(Pointwise::CUDNN_POINTWISE_MUL, grad_out, out, products)?;
    let row_sums = graph.intermediate(row_dims, FLOAT)?;
    graph.reduction(
        sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD,
        products,
        row_sums,
    )?;
    graph.binary(Pointwise::CUDNN_POINTWISE_MUL, row_sums, one, softmax_sum)?;

    let scores = scaled_scores(&mut graph, inputs.q, inputs.k_transposed, inputs.scale)?;
    let scores_dims = scores.dims;
    let centered = graph.intermediate(scores_dims, FLOAT)?;
    graph.binary(Pointwise::CUDNN_POINTWISE_SUB, scores, lse, centered)?;
    let masked = causal(&mut graph, centered, inputs.hidden)?;
    let probabilities = graph.intermediate(scores_dims, FLOAT)?;
    graph.unary(Pointwise::CUDNN_POINTWISE_EXP, masked, probabilities)?;
    let (transposed_dims, transposed_strides) = transposed(scores_dims, contiguous(scores_dims));
    let probabilities_t = graph.intermediate_view(transposed_dims, transposed_strides, dtype)?;
    graph.reshape(probabilities, probabilities_t)?;

    // Per query head, then summed over each group of query heads sharing a key/value head.
    let grouped = key.kv_heads != q_heads;
    let kv_gradient = |graph: &mut GraphBuilder,
                       lhs: TensorId,
                       rhs: TensorId,
                       target: TensorId|
     -> Result<(), String> {
        if grouped {
            let per_query_head = graph.intermediate([batch, q_heads, len, head_dim], dtype)?;
            graph.matmul(lhs, rhs, per_query_head)?;
            graph.reduction(
                sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD,
                per_query_head,
                target,
            )
        } else {
            graph.matmul(lhs, rhs, target)
        }
    };
    kv_gradient(&mut graph, probabilities_t, grad_out, grad_v)?;

    let grad_probabilities = graph.intermediate(scores_dims, FLOAT)?;
    graph.matmul(grad_out, v_transposed, grad_probabilities)?;
    let centered_grad = graph.intermediate(scores_dims, FLOAT)?;
    graph.binary(
        Pointwise::CUDNN_POINTWISE_SUB,
        grad_probabilities,
        softmax_sum,
        centered_grad,
    )?;
    let grad_exponent = graph.intermediate(scores_dims, FLOAT)?;
    graph.binary(
        Pointwise::CUDNN_POINTWISE_MUL,
        centered_grad,
        probabilities,
        grad_exponent,
    )?;
    let grad_scores = graph.intermediate(scores_dims, FLOAT)?;
    graph.binary(
        Pointwise::CUDNN_POINTWISE_MUL,
        grad_exponent,
        inputs.scale,
        grad_scores,
    )?;
    let grad_scores_t = graph.intermediate_view(transposed_dims, transposed_strides, dtype)?;
    graph.reshape(grad_scores, grad_scores_t)?;
    kv_gradient(&mut graph, grad_scores_t, inputs.q, grad_k)?;

    let k = graph.intermediate(kv_dims, FLOAT)?;
    graph.reshape(inputs.k_transposed, k)?;
    graph.matmul(grad_scores, k, dq_accum)?;
    graph.unary(Pointwise::CUDNN_POINTWISE_IDENTITY, dq_accum, grad_q)?;

    let mut scalars = scalars(&inputs, key);
    scalars.push((one, 1.0));
    Ok(AttentionGraph {
        plan: graph.plan(handle)?,
        bound: vec![
            (inputs.q, 0),
            (inputs.k_transposed, 1),
            (v_transposed, 2),
            (out, 3),
            (lse, 4),
            (grad_out, 5),
            (grad_q, 6),
            (grad_k, 7),
            (grad_v, 8),
            (softmax_sum, 9),
            (dq_accum, 10),
        ],
        scalars,
    })
}
