//! cuBLASLt matrix products on buffers owned by cubecl (CUDA runtime only), on a
//! [`SideStream`] ordered with cubecl's work by context-wide events: no host synchronization.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::result as driver;
use cudarc::driver::sys as driver_sys;

use crate::cuda_interop::{SideStream, current_context, downcast};

/// Workspace handed to cuBLASLt (NVIDIA recommends 32 MiB on Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// `lhs [.., M, K] x rhs [.., K, N]` through cuBLASLt when `R` is the CUDA runtime and both
/// operands are bf16, f16 or f32 with equal batch dimensions (or one side without batch); `None`
/// otherwise, so the caller falls back to Burn's matmul. Inputs with a unit stride in either of
/// their last two dimensions are read in place (transposed views cost nothing); others are made
/// contiguous first. bf16/f16 accumulate in f32; f32 computes in full f32 (no TF32).
pub(crate) fn try_matmul<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
) -> Option<CubeTensor<R>> {
    try_matmul_scaled(lhs, rhs, 1.0, lhs.dtype)
}

/// [`try_matmul`] times `alpha` (applied in the product's epilogue), written in `out_dtype`: the
/// operands' dtype, or f32 for bf16/f16 operands (the f32 accumulator as it is).
pub(crate) fn try_matmul_scaled<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    alpha: f32,
    out_dtype: DType,
) -> Option<CubeTensor<R>> {
    let lhs = downcast::<_, CubeTensor<CudaRuntime>>(lhs.clone())?;
    let rhs = downcast::<_, CubeTensor<CudaRuntime>>(rhs.clone())?;
    let out = matmul_cuda(lhs, rhs, alpha, out_dtype, None).ok()?;
    downcast::<_, CubeTensor<R>>(out)
}

/// `onto + alpha * lhs x rhs` in `onto`'s dtype, with the addition in the product's epilogue
/// (`beta = 1`): one pass instead of a product and an addition. `onto` must be contiguous and of
/// the product's shape; it is written in place when nothing else holds it. `Err(onto)` where
/// [`try_matmul_scaled`] would decline.
#[allow(clippy::result_large_err)] // the error hands the caller's own tensor back, unmoved
pub(crate) fn try_matmul_onto<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    alpha: f32,
    onto: CubeTensor<R>,
) -> Result<CubeTensor<R>, CubeTensor<R>> {
    let cuda = |t: &CubeTensor<R>| downcast::<_, CubeTensor<CudaRuntime>>(t.clone());
    let (Some(lhs), Some(rhs), Some(target)) = (cuda(lhs), cuda(rhs), cuda(&onto)) else {
        return Err(onto);
    };
    if !target.is_contiguous() {
        return Err(onto);
    }
    let dtype = target.dtype;
    // `target` shares `onto`'s handle: drop `onto` so that an exclusive one stays writable.
    drop(onto);
    let back = |t: CubeTensor<CudaRuntime>| downcast::<_, CubeTensor<R>>(t).expect("CUDA runtime");
    match matmul_cuda(lhs, rhs, alpha, dtype, Some(target)) {
        Ok(out) => Ok(back(out)),
        Err(onto) => Err(back(onto.expect("onto handed back"))),
    }
}

fn data_type(dtype: DType) -> Option<lt_sys::cudaDataType> {
    match dtype {
        DType::BF16 => Some(lt_sys::cudaDataType::CUDA_R_16BF),
        DType::F16 => Some(lt_sys::cudaDataType::CUDA_R_16F),
        DType::F32 => Some(lt_sys::cudaDataType::CUDA_R_32F),
        _ => None,
    }
}

/// How one operand's last two dimensions `[rows, cols]` sit in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct MatrixLayout {
    /// Row-major (unit column stride) rather than column-major (unit row stride).
    row_major: bool,
    /// Leading dimension, in elements.
    ld: i64,
    /// Distance between consecutive matrices of the batch, in elements (0: shared by all).
    batch_stride: i64,
}

impl MatrixLayout {
    fn of(shape: &[usize], strides: &[usize]) -> Option<Self> {
        let rank = shape.len();
        let (rows, cols) = (shape[rank - 2], shape[rank - 1]);
        let (row_stride, col_stride) = (strides[rank - 2], strides[rank - 1]);
        let (row_major, ld) = if col_stride == 1 || cols == 1 {
            (true, if rows == 1 { cols } else { row_stride })
        } else if row_stride == 1 || rows == 1 {
            (false, if cols == 1 { rows } else { col_stride })
        } else {
            return None;
        };
        if ld < if row_major { cols } else { rows } || ld == 0 {
            return None;
        }
        // The batch dimensions must collapse into one with a single stride.
        let mut batch_stride = None::<usize>;
        let mut expected = None::<usize>;
        for dim in (0..rank - 2).rev() {
            if shape[dim] == 1 {
                continue;
            }
            match expected {
                None => batch_stride = Some(strides[dim]),
                Some(stride) if stride != strides[dim] => return None,
                Some(_) => {}
            }
            expected = Some(strides[dim] * shape[dim]);
        }
        Some(Self {
            row_major,
            ld: ld as i64,
            batch_stride: batch_stride.unwrap_or(0) as i64,
        })
    }

    fn of_tensor(tensor: &CubeTensor<CudaRuntime>) -> Option<Self> {
        Self::of(tensor.meta.shape(), tensor.meta.strides())
    }
}

/// Everything the heuristic's choice depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    dtype: DType,
    out_dtype: DType,
    m: u64,
    n: u64,
    k: u64,
    batch: i32,
    lhs: MatrixLayout,
    rhs: MatrixLayout,
    /// Largest power of two (at most 256) dividing each pointer: lhs, rhs, and the smaller of
    /// the output's and the added source's.
    alignments: [u32; 3],
}

/// Descriptors and the chosen algorithm of one problem, reused across calls.
#[derive(Clone, Copy)]
struct Plan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    /// Column-major layouts as cuBLASLt sees them: `a` is our rhs, `b` our lhs, `d` the output.
    a: lt_sys::cublasLtMatrixLayout_t,
    b: lt_sys::cublasLtMatrixLayout_t,
    d: lt_sys::cublasLtMatrixLayout_t,
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

/// Per-context state: handle, side stream, workspace and plans.
struct ContextState {
    handle: lt_sys::cublasLtHandle_t,
    side: SideStream,
    workspace: driver_sys::CUdeviceptr,
    plans: HashMap<PlanKey, Plan>,
}

// SAFETY: the raw handles are only used under the `STATES` lock, on cubecl's device thread of the
// context they belong to.
unsafe impl Send for ContextState {}

static STATES: Mutex<Option<HashMap<usize, ContextState>>> = Mutex::new(None);

/// The product, or `onto` handed back where cuBLASLt cannot take the operands.
#[allow(clippy::result_large_err)] // the error hands the caller's own tensor back, unmoved
fn matmul_cuda(
    lhs: CubeTensor<CudaRuntime>,
    rhs: CubeTensor<CudaRuntime>,
    alpha: f32,
    out_dtype: DType,
    onto: Option<CubeTensor<CudaRuntime>>,
) -> Result<CubeTensor<CudaRuntime>, Option<CubeTensor<CudaRuntime>>> {
    let dtype = lhs.dtype;
    if dtype != rhs.dtype || data_type(dtype).is_none() {
        return Err(onto);
    }
    let widened = matches!(dtype, DType::BF16 | DType::F16) && out_dtype == DType::F32;
    if out_dtype != dtype && !widened {
        return Err(onto);
    }
    let rank = lhs.meta.num_dims();
    if rank < 2 || rhs.meta.num_dims() != rank {
        return Err(onto);
    }
    let lhs_shape = lhs.meta.shape().to_vec();
    let rhs_shape = rhs.meta.shape().to_vec();
    let (m, k, n) = (
        lhs_shape[rank - 2],
        lhs_shape[rank - 1],
        rhs_shape[rank - 1],
    );
    if rhs_shape[rank - 2] != k || k == 0 {
        return Err(onto);
    }
    let lhs_batch: usize = lhs_shape[..rank - 2].iter().product();
    let rhs_batch: usize = rhs_shape[..rank - 2].iter().product();
    let batch_dims = if lhs_shape[..rank - 2] == rhs_shape[..rank - 2] || rhs_batch == 1 {
        &lhs_shape[..rank - 2]
    } else if lhs_batch == 1 {
        &rhs_shape[..rank - 2]
    } else {
        return Err(onto);
    };
    let batch = batch_dims.iter().product::<usize>();
    let mut out_shape = batch_dims.to_vec();
    out_shape.extend([m, n]);

    let operand = |tensor: CubeTensor<CudaRuntime>| match MatrixLayout::of_tensor(&tensor) {
        Some(layout) => (tensor, layout),
        None => {
            let tensor = into_contiguous(tensor);
            let layout = MatrixLayout::of_tensor(&tensor).expect("contiguous layout");
            (tensor, layout)
        }
    };
    let (lhs, mut lhs_layout) = operand(lhs);
    let (rhs, mut rhs_layout) = operand(rhs);
    if lhs_batch == 1 {
        lhs_layout.batch_stride = 0;
    }
    if rhs_batch == 1 {
        rhs_layout.batch_stride = 0;
    }
    // A shared rhs against stacked row-major lhs matrices is one tall product.
    let (rows, batch) = if rhs_batch == 1
        && lhs_layout.row_major
        && lhs_layout.batch_stride == (m as i64) * lhs_layout.ld
    {
        lhs_layout.batch_stride = 0;
        (m * batch, 1)
    } else {
        (m, batch)
    };

    if onto
        .as_ref()
        .is_some_and(|onto| onto.meta.shape().to_vec() != out_shape || onto.dtype != out_dtype)
    {
        return Err(onto);
    }
    // In place when `onto` is ours alone (cuBLASLt's `C` is then `D`); otherwise `onto` is read
    // as `C` and the sum written to a new buffer.
    let beta = if onto.is_some() { 1.0 } else { 0.0 };
    let (out, source) = match onto {
        Some(onto) if onto.can_mut() => (onto, None),
        onto => (
            empty_device_contiguous_dtype(
                lhs.client.clone(),
                lhs.device.clone(),
                Shape::from(out_shape),
                out_dtype,
            ),
            onto,
        ),
    };
    if rows * n * batch == 0 {
        return Ok(out);
    }

    let client = lhs.client.clone();
    // Resolving the resources orders cubecl's own streams and keeps the buffers alive until the
    // product is enqueued; cuCtxWaitEvent protects them afterwards.
    let source = source.as_ref().unwrap_or(&out);
    let resources = [&lhs, &rhs, source, &out].map(|tensor| {
        client
            .get_resource(tensor.handle.clone())
            .expect("cubecl buffer of a GEMM operand")
    });
    let [lhs_ptr, rhs_ptr, source_ptr, out_ptr] = [0, 1, 2, 3].map(|i| resources[i].resource().ptr);
    let alignment = |ptr: u64| 1u32 << ptr.trailing_zeros().min(8);
    let key = PlanKey {
        dtype,
        out_dtype,
        m: rows as u64,
        n: n as u64,
        k: k as u64,
        batch: batch as i32,
        lhs: lhs_layout,
        rhs: rhs_layout,
        alignments: [
            alignment(lhs_ptr),
            alignment(rhs_ptr),
            alignment(out_ptr).min(alignment(source_ptr)),
        ],
    };
    let pointers = [lhs_ptr, rhs_ptr, source_ptr, out_ptr];
    client
        .exclusive(move || run(key, [alpha, beta], pointers))
        .expect("cubecl device thread")
        .unwrap_or_else(|error| panic!("cuBLASLt matmul {key:?}: {error}"));
    drop(resources);
    Ok(out)
}

/// Enqueues `out = alpha * lhs x rhs + beta * source` on our stream, between the two
/// context-wide joins (`source` may be `out`).
fn run(
    key: PlanKey,
    [alpha, beta]: [f32; 2],
    [lhs, rhs, source, out]: [u64; 4],
) -> Result<(), String> {
    let context = current_context()?;
    let mut guard = STATES.lock().unwrap_or_else(|e| e.into_inner());
    let states = guard.get_or_insert_with(HashMap::new);
    let state = match states.entry(context as usize) {
        std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
        std::collections::hash_map::Entry::Vacant(entry) => entry.insert(ContextState::new()?),
    };
    let plan = match state.plans.entry(key) {
        std::collections::hash_map::Entry::Occupied(entry) => *entry.get(),
        std::collections::hash_map::Entry::Vacant(entry) => {
            *entry.insert(Plan::new(state.handle, &key)?)
        }
    };
    // SAFETY: the pointers are live cubecl buffers of the sizes the plan describes; the handle,
    // stream, events and workspace belong to the current context.
    unsafe {
        state.side.join_inputs(context)?;
        lt::matmul(
            state.handle,
            plan.desc,
            (&alpha as *const f32).cast(),
            (&beta as *const f32).cast(),
            rhs as *const c_void,
            plan.a,
            lhs as *const c_void,
            plan.b,
            source as *const c_void,
            plan.d,
            out as *mut c_void,
            plan.d,
            &plan.algo,
            state.workspace as *mut c_void,
            WORKSPACE_BYTES,
            state.side.stream as lt_sys::cudaStream_t,
        )
        .map_err(|e| e.to_string())?;
        state.side.join_output(context)
    }
}

impl ContextState {
    fn new() -> Result<Self, String> {
        let handle = lt::create_handle().map_err(|e| e.to_string())?;
        let side = SideStream::new()?;
        // SAFETY: plain device allocation in the current context, never freed (one per context).
        let workspace =
            unsafe { driver::malloc_sync(WORKSPACE_BYTES) }.map_err(|e| e.to_string())?;
        Ok(Self {
            handle,
            side,
            workspace,
            plans: HashMap::new(),
        })
    }
}

impl Plan {
    /// Row-major `out[M, N] = lhs[M, K] rhs[K, N]` is column-major `out^T = rhs^T lhs^T`: cuBLASLt's
    /// `A` is our rhs (`N x K` after its op), `B` our lhs (`K x M`), `D` the `N x M` output.
    fn new(handle: lt_sys::cublasLtHandle_t, key: &PlanKey) -> Result<Self, String> {
        let err = |e: lt::CublasError| e.to_string();
        let data = data_type(key.dtype).expect("checked dtype");
        let out_data = data_type(key.out_dtype).expect("checked dtype");
        let desc = lt::create_matmul_desc(
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt_sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(err)?;
        // A row-major operand is, read column-major, already the transpose we need.
        let op = |layout: &MatrixLayout| -> i32 { if layout.row_major { 0 } else { 1 } };
        let typed_layout = |data, rows: u64, cols: u64, ld: i64, batch_stride: i64| {
            let layout = lt::create_matrix_layout(data, rows, cols, ld).map_err(err)?;
            // SAFETY: fresh layout; attribute sizes match their C types.
            unsafe {
                lt::set_matrix_layout_attribute(
                    layout,
                    lt_sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                    (&key.batch as *const i32).cast(),
                    4,
                )
                .map_err(err)?;
                lt::set_matrix_layout_attribute(
                    layout,
                    lt_sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    (&batch_stride as *const i64).cast(),
                    8,
                )
                .map_err(err)?;
            }
            Ok::<_, String>(layout)
        };
        let layout =
            |rows, cols, ld, batch_stride| typed_layout(data, rows, cols, ld, batch_stride);
        let output_layout =
            |rows, cols, ld, batch_stride| typed_layout(out_data, rows, cols, ld, batch_stride);
        let stored = |row_major: bool, rows: u64, cols: u64| {
            if row_major {
                (cols, rows)
            } else {
                (rows, cols)
            }
        };
        let (a_rows, a_cols) = stored(key.rhs.row_major, key.k, key.n);
        let (b_rows, b_cols) = stored(key.lhs.row_major, key.m, key.k);
        let a = layout(a_rows, a_cols, key.rhs.ld, key.rhs.batch_stride)?;
        let b = layout(b_rows, b_cols, key.lhs.ld, key.lhs.batch_stride)?;
        let d = output_layout(key.n, key.m, key.n as i64, (key.m * key.n) as i64)?;
        let preference = lt::create_matmul_pref().map_err(err)?;
        // SAFETY: fresh descriptors; attribute sizes match their C types.
        let heuristic = unsafe {
            for (attribute, value) in [
                (
                    lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    op(&key.rhs),
                ),
                (
                    lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                    op(&key.lhs),
                ),
            ] {
                lt::set_matmul_desc_attribute(desc, attribute, (&value as *const i32).cast(), 4)
                    .map_err(err)?;
            }
            let workspace = WORKSPACE_BYTES as u64;
            lt::set_matmul_pref_attribute(
                preference,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace as *const u64).cast(),
                8,
            )
            .map_err(err)?;
            let [lhs_align, rhs_align, out_align] = key.alignments;
            for (attribute, value) in [
                (
                    lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    rhs_align,
                ),
                (
                    lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    lhs_align,
                ),
                (
                    lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    out_align,
                ),
                (
                    lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                    out_align,
                ),
            ] {
                lt::set_matmul_pref_attribute(
                    preference,
                    attribute,
                    (&value as *const u32).cast(),
                    4,
                )
                .map_err(err)?;
            }
            let heuristic =
                lt::get_matmul_algo_heuristic(handle, desc, a, b, d, d, preference).map_err(err);
            lt::destroy_matmul_pref(preference).map_err(err)?;
            heuristic?
        };
        Ok(Self {
            desc,
            a,
            b,
            d,
            algo: heuristic.algo,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::MatrixLayout;

    #[test]
    fn layouts() {
        let row = MatrixLayout::of(&[2, 3, 5], &[15, 5, 1]).unwrap();
        assert_eq!((row.row_major, row.ld, row.batch_stride), (true, 5, 15));
        // A transposed view of a contiguous [5, 3] matrix.
        let col = MatrixLayout::of(&[3, 5], &[1, 3]).unwrap();
        assert_eq!((col.row_major, col.ld, col.batch_stride), (false, 3, 0));
        // Two batch dims that collapse, and two that do not.
        assert!(MatrixLayout::of(&[2, 4, 3, 5], &[60, 15, 5, 1]).is_some());
        assert!(MatrixLayout::of(&[2, 4, 3, 5], &[128, 15, 5, 1]).is_none());
        // Neither dimension unit-strided.
        assert!(MatrixLayout::of(&[3, 5], &[10, 2]).is_none());
    }
}
