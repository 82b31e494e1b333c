//! The attention graphs cuDNN's fused flash attention engine recognises: the forward and the
//! backward of causal softmax attention as matmul, pointwise and reduction nodes (the pattern
//! cudnn-frontend emits for its SDPA nodes), with dims and strides taken from the tensors.

use burn::tensor::DType;
use cudarc::cudnn::sys::{self, cudnnDataType_t as DataType, cudnnPointwiseMode_t as Pointwise};

use super::data_type;
use super::graph::{GraphBuilder, Plan, TensorId, contiguous};
use super::segments::View;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Direction {
    Forward,
    Backward,
}

/// Everything a graph depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct GraphKey {
    pub direction: Direction,
    pub dtype: DType,
    /// `[batch, q_heads, len, head_dim]` (S2: the groups folded into the batch).
    pub q_dims: [i64; 4],
    pub kv_heads: i64,
    /// Keys, at least `len`: the queries are the last `len` of them.
    pub kv_len: i64,
    /// Forward: q, k, v, out (then out again); backward: q, k, v, out, dO, dQ, and dK and dV
    /// (stored alike).
    pub strides: [[i64; 4]; 7],
    /// The `lse` rows, `[batch, q_heads, len, 1]`.
    pub row_strides: [i64; 4],
    pub scale_bits: u32,
}

impl GraphKey {
    /// The graph over these views of its bound tensors (in the order of [`Self::strides`]) and
    /// of the `lse` rows.
    pub fn of(
        direction: Direction,
        dtype: DType,
        views: [View; 7],
        rows: View,
        scale: f32,
    ) -> Self {
        Self {
            direction,
            dtype,
            q_dims: views[0].dims,
            kv_heads: views[1].dims[1],
            kv_len: views[1].dims[2],
            strides: views.map(|view| view.strides),
            row_strides: rows.strides,
            scale_bits: scale.to_bits(),
        }
    }
}

/// A built graph: its plan, which of the caller's tensors each bound graph tensor reads (a
/// transposed view reads the same buffer as its tensor), and its by-value scalars (the bits of an
/// f32 or an i32).
pub(super) struct AttentionGraph {
    pub plan: Plan,
    pub bound: Vec<(TensorId, usize)>,
    pub scalars: Vec<(TensorId, u32)>,
}

pub(super) fn build(handle: sys::cudnnHandle_t, key: &GraphKey) -> Result<AttentionGraph, String> {
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

/// `scale * Q K^T` (`[batch, q_heads, len, kv_len]`, f32 in the graph); query head `h` reads
/// key head `h / (q_heads / kv_heads)` through the matmul's batch broadcast.
fn scaled_scores(
    graph: &mut GraphBuilder,
    q: TensorId,
    k_transposed: TensorId,
    scale: TensorId,
) -> Result<TensorId, String> {
    let [batch, q_heads, len, _] = q.dims;
    let dims = [batch, q_heads, len, k_transposed.dims[3]];
    let products = graph.intermediate(dims, FLOAT)?;
    graph.matmul(q, k_transposed, products)?;
    let scaled = graph.intermediate(dims, FLOAT)?;
    graph.binary(Pointwise::CUDNN_POINTWISE_MUL, products, scale, scaled)?;
    Ok(scaled)
}

/// `scores` with `hidden` (`-inf`) above the diagonal, aligned at the bottom right.
fn causal(graph: &mut GraphBuilder, scores: TensorId, inputs: &Inputs) -> Result<TensorId, String> {
    let (visible, hidden) = (graph.causal_mask(scores, inputs.offset)?, inputs.hidden);
    let masked = graph.intermediate(scores.dims, FLOAT)?;
    graph.select(scores, hidden, visible, masked)?;
    Ok(masked)
}

/// The inputs both graphs read: q, K^T (over k's buffer), the scale and `-inf` scalars, and
/// the causal mask's offset where there are more keys than queries.
struct Inputs {
    q: TensorId,
    k_transposed: TensorId,
    scale: TensorId,
    hidden: TensorId,
    offset: Option<TensorId>,
}

fn inputs(graph: &mut GraphBuilder, key: &GraphKey) -> Result<(Inputs, [i64; 4]), String> {
    let dtype = data_type(key.dtype);
    let [batch, _, len, head_dim] = key.q_dims;
    let kv_dims = [batch, key.kv_heads, key.kv_len, head_dim];
    let q = graph.bound(key.q_dims, key.strides[0], dtype)?;
    let (kt_dims, kt_strides) = transposed(kv_dims, key.strides[1]);
    let k_transposed = graph.bound(kt_dims, kt_strides, dtype)?;
    let scale = graph.scalar(FLOAT)?;
    let hidden = graph.scalar(FLOAT)?;
    let offset = match key.kv_len == len {
        true => None,
        false => Some(graph.scalar(DataType::CUDNN_DATA_INT32)?),
    };
    Ok((
        Inputs {
            q,
            k_transposed,
            scale,
            hidden,
            offset,
        },
        kv_dims,
    ))
}

fn scalars(inputs: &Inputs, key: &GraphKey) -> Vec<(TensorId, u32)> {
    let mut scalars = vec![
        (inputs.scale, key.scale_bits),
        (inputs.hidden, f32::NEG_INFINITY.to_bits()),
    ];
    let offset = (key.kv_len - key.q_dims[2]) as i32;
    scalars.extend(inputs.offset.map(|tensor| (tensor, offset as u32)));
    scalars
}

/// Forward: `M = rowmax(S)`, `E = exp(S - M)`, `L = rowsum(E)`, `Stats = M + ln L`,
/// `O = (E / L) V` with `S` the scaled, causally masked scores. Bound: q, k (as K^T), v, out, lse.
fn forward_graph(handle: sys::cudnnHandle_t, key: &GraphKey) -> Result<AttentionGraph, String> {
    let mut graph = GraphBuilder::default();
    let dtype = data_type(key.dtype);
    let (inputs, kv_dims) = inputs(&mut graph, key)?;
    let v = graph.bound(kv_dims, key.strides[2], dtype)?;
    let scores = scaled_scores(&mut graph, inputs.q, inputs.k_transposed, inputs.scale)?;
    let masked = causal(&mut graph, scores, &inputs)?;

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
    let lse = graph.bound(row_dims, key.row_strides, FLOAT)?;
    graph.binary(Pointwise::CUDNN_POINTWISE_ADD, max, log_sum, lse)?;
    // The second product's left operand must have the inputs' dtype.
    let probabilities = graph.intermediate(masked.dims, dtype)?;
    graph.binary(
        Pointwise::CUDNN_POINTWISE_DIV,
        exponentials,
        sum,
        probabilities,
    )?;
    let out = graph.bound(key.q_dims, key.strides[3], dtype)?;
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
    let v_transposed = graph.bound(vt_dims, vt_strides, dtype)?;
    let out = graph.bound(key.q_dims, key.strides[3], dtype)?;
    let grad_out = graph.bound(key.q_dims, key.strides[4], dtype)?;
    let row_dims = [batch, q_heads, len, 1];
    let lse = graph.bound(row_dims, key.row_strides, FLOAT)?;
    let grad_q = graph.bound(key.q_dims, key.strides[5], dtype)?;
    let grad_k = graph.bound(kv_dims, key.strides[6], dtype)?;
    let grad_v = graph.bound(kv_dims, key.strides[6], dtype)?;
    let one = graph.scalar(FLOAT)?;
    let softmax_sum = graph.bound(row_dims, contiguous(row_dims), FLOAT)?;
    let dq_accum = graph.bound(key.q_dims, contiguous(key.q_dims), FLOAT)?;

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
    let masked = causal(&mut graph, centered, &inputs)?;
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
            let per_query_head =
                graph.intermediate([batch, q_heads, kv_dims[2], head_dim], dtype)?;
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
    scalars.push((one, 1f32.to_bits()));
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
