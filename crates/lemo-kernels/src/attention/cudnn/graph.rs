//! A small builder of cuDNN operation graphs (tensors, matmuls, pointwise and reduction nodes)
//! and their execution plans, over the backend API.

use std::ffi::c_void;

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as Attribute, cudnnBackendDescriptorType_t as Kind,
    cudnnDataType_t as DataType, cudnnPointwiseMode_t as Pointwise,
};

use super::descriptor::{Descriptor, check};

/// A tensor of a graph: its unique id (what the variant pack binds a pointer to) and its dims.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TensorId {
    pub uid: i64,
    pub dims: [i64; 4],
}

/// Contiguous strides of `dims`.
pub(crate) fn contiguous(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
}

/// Strides of `[batch, heads, len, head_dim]` stored as `[batch, len, heads, head_dim]`.
pub(crate) fn sequence_major(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[3], dims[1] * dims[3], 1]
}

#[derive(Default)]
pub(crate) struct GraphBuilder {
    tensors: Vec<Descriptor>,
    operations: Vec<Descriptor>,
}

impl GraphBuilder {
    fn tensor(
        &mut self,
        dims: [i64; 4],
        strides: [i64; 4],
        data_type: DataType,
        is_virtual: bool,
        by_value: bool,
    ) -> Result<TensorId, String> {
        let uid = self.tensors.len() as i64 + 1;
        let mut tensor = Descriptor::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        tensor
            .data_type(Attribute::CUDNN_ATTR_TENSOR_DATA_TYPE, data_type)?
            .int64s(Attribute::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?
            .int64s(Attribute::CUDNN_ATTR_TENSOR_STRIDES, &strides)?
            .int64(Attribute::CUDNN_ATTR_TENSOR_UNIQUE_ID, uid)?
            .int64(Attribute::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16)?
            .boolean(Attribute::CUDNN_ATTR_TENSOR_IS_VIRTUAL, is_virtual)?;
        if by_value {
            tensor.boolean(Attribute::CUDNN_ATTR_TENSOR_IS_BY_VALUE, true)?;
        }
        tensor.finalize()?;
        self.tensors.push(tensor);
        Ok(TensorId { uid, dims })
    }

    /// A tensor the caller binds memory to (an input or an output), with the given strides.
    pub fn bound(
        &mut self,
        dims: [i64; 4],
        strides: [i64; 4],
        data_type: DataType,
    ) -> Result<TensorId, String> {
        self.tensor(dims, strides, data_type, false, false)
    }

    /// A scalar passed by value at execution (a host pointer to the value).
    pub fn scalar(&mut self, data_type: DataType) -> Result<TensorId, String> {
        self.tensor([1; 4], [1; 4], data_type, false, true)
    }

    /// An intermediate that never reaches memory, contiguous.
    pub fn intermediate(
        &mut self,
        dims: [i64; 4],
        data_type: DataType,
    ) -> Result<TensorId, String> {
        self.tensor(dims, contiguous(dims), data_type, true, false)
    }

    /// An intermediate with the given strides (a transposed view of another).
    pub fn intermediate_view(
        &mut self,
        dims: [i64; 4],
        strides: [i64; 4],
        data_type: DataType,
    ) -> Result<TensorId, String> {
        self.tensor(dims, strides, data_type, true, false)
    }

    /// The descriptor of a tensor of this graph (uids count from 1 in creation order).
    fn tensor_descriptor(&self, tensor: TensorId) -> &Descriptor {
        &self.tensors[tensor.uid as usize - 1]
    }

    /// An operation of `kind` reading and writing `tensors` and with the node `descriptor`
    /// (`None`: the kind has none), with `extra` attributes set before it is finalized and added.
    fn operation(
        &mut self,
        kind: Kind,
        tensors: &[(Attribute, TensorId)],
        descriptor: Option<(Attribute, Descriptor)>,
        extra: impl FnOnce(&mut Descriptor) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut operation = Descriptor::new(kind)?;
        for &(attribute, tensor) in tensors {
            operation.descriptor(attribute, self.tensor_descriptor(tensor))?;
        }
        if let Some((attribute, node)) = &descriptor {
            operation.descriptor(*attribute, node)?;
        }
        extra(&mut operation)?;
        operation.finalize()?;
        self.operations.push(operation);
        Ok(())
    }

    /// `c = a b` over the last two dims, batched over the first two (f32 accumulation).
    pub fn matmul(&mut self, a: TensorId, b: TensorId, c: TensorId) -> Result<(), String> {
        let mut matmul = Descriptor::new(Kind::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        matmul.data_type(
            Attribute::CUDNN_ATTR_MATMUL_COMP_TYPE,
            DataType::CUDNN_DATA_FLOAT,
        )?;
        matmul.finalize()?;
        self.operation(
            Kind::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR,
            &[
                (Attribute::CUDNN_ATTR_OPERATION_MATMUL_ADESC, a),
                (Attribute::CUDNN_ATTR_OPERATION_MATMUL_BDESC, b),
                (Attribute::CUDNN_ATTR_OPERATION_MATMUL_CDESC, c),
            ],
            Some((Attribute::CUDNN_ATTR_OPERATION_MATMUL_DESC, matmul)),
            |_| Ok(()),
        )
    }

    /// `y = mode(x[, b][, t])` element-wise with broadcasting, computed in `precision` (f32, or
    /// boolean for comparisons); `axis` is `GEN_INDEX`'s.
    #[allow(clippy::too_many_arguments)]
    fn pointwise_in(
        &mut self,
        mode: Pointwise,
        precision: DataType,
        x: TensorId,
        b: Option<TensorId>,
        t: Option<TensorId>,
        y: TensorId,
        axis: Option<i64>,
    ) -> Result<(), String> {
        let mut pointwise = Descriptor::new(Kind::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        pointwise
            .pointwise_mode(mode)?
            .data_type(Attribute::CUDNN_ATTR_POINTWISE_MATH_PREC, precision)?;
        if let Some(axis) = axis {
            pointwise.int64(Attribute::CUDNN_ATTR_POINTWISE_AXIS, axis)?;
        }
        pointwise.finalize()?;
        let mut tensors = vec![(Attribute::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)];
        tensors.extend(b.map(|b| (Attribute::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b)));
        tensors.extend(t.map(|t| (Attribute::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t)));
        tensors.push((Attribute::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y));
        self.operation(
            Kind::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR,
            &tensors,
            Some((
                Attribute::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR,
                pointwise,
            )),
            |operation| {
                operation
                    .float(Attribute::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, 1.0)?
                    .float(Attribute::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, 1.0)?;
                Ok(())
            },
        )
    }

    /// `y = mode(x)`.
    pub fn unary(&mut self, mode: Pointwise, x: TensorId, y: TensorId) -> Result<(), String> {
        self.pointwise_in(mode, DataType::CUDNN_DATA_FLOAT, x, None, None, y, None)
    }

    /// `y = mode(x, b)`, broadcasting `b`.
    pub fn binary(
        &mut self,
        mode: Pointwise,
        x: TensorId,
        b: TensorId,
        y: TensorId,
    ) -> Result<(), String> {
        self.pointwise_in(mode, DataType::CUDNN_DATA_FLOAT, x, Some(b), None, y, None)
    }

    /// `visible = row + offset >= column` over the last two dims of `scores` (`[.., rows,
    /// cols]`): the causal mask of queries that are the last `rows` of `cols` positions, with
    /// `offset` (`cols - rows`, an INT32 scalar passed by value) aligning it at the bottom right;
    /// `None`: equal lengths.
    pub fn causal_mask(
        &mut self,
        scores: TensorId,
        offset: Option<TensorId>,
    ) -> Result<TensorId, String> {
        let dims = scores.dims;
        let mut index = |axis| {
            let index = self.intermediate(dims, DataType::CUDNN_DATA_INT32)?;
            self.pointwise_in(
                Pointwise::CUDNN_POINTWISE_GEN_INDEX,
                DataType::CUDNN_DATA_FLOAT,
                scores,
                None,
                None,
                index,
                Some(axis),
            )?;
            Ok::<_, String>(index)
        };
        let (mut rows, columns) = (index(2)?, index(3)?);
        if let Some(offset) = offset {
            let shifted = self.intermediate(dims, DataType::CUDNN_DATA_INT32)?;
            self.pointwise_in(
                Pointwise::CUDNN_POINTWISE_ADD,
                DataType::CUDNN_DATA_INT32,
                rows,
                Some(offset),
                None,
                shifted,
                None,
            )?;
            rows = shifted;
        }
        let visible = self.intermediate(dims, DataType::CUDNN_DATA_BOOLEAN)?;
        self.pointwise_in(
            Pointwise::CUDNN_POINTWISE_CMP_GE,
            DataType::CUDNN_DATA_BOOLEAN,
            rows,
            Some(columns),
            None,
            visible,
            None,
        )?;
        Ok(visible)
    }

    /// `y = mask ? x : hidden`.
    pub fn select(
        &mut self,
        x: TensorId,
        hidden: TensorId,
        mask: TensorId,
        y: TensorId,
    ) -> Result<(), String> {
        self.pointwise_in(
            Pointwise::CUDNN_POINTWISE_BINARY_SELECT,
            DataType::CUDNN_DATA_FLOAT,
            x,
            Some(hidden),
            Some(mask),
            y,
            None,
        )
    }

    /// `y`: `x` seen through `y`'s dims, strides and dtype (a transposed view, a cast).
    pub fn reshape(&mut self, x: TensorId, y: TensorId) -> Result<(), String> {
        self.operation(
            Kind::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR,
            &[
                (Attribute::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x),
                (Attribute::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y),
            ],
            None,
            |_| Ok(()),
        )
    }

    /// `y = reduce(x)` over the dims where `y` has extent 1 (f32).
    pub fn reduction(
        &mut self,
        operator: sys::cudnnReduceTensorOp_t,
        x: TensorId,
        y: TensorId,
    ) -> Result<(), String> {
        let mut reduction = Descriptor::new(Kind::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        reduction.reduction_operator(operator)?.data_type(
            Attribute::CUDNN_ATTR_REDUCTION_COMP_TYPE,
            DataType::CUDNN_DATA_FLOAT,
        )?;
        reduction.finalize()?;
        self.operation(
            Kind::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR,
            &[
                (Attribute::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x),
                (Attribute::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y),
            ],
            Some((Attribute::CUDNN_ATTR_OPERATION_REDUCTION_DESC, reduction)),
            |_| Ok(()),
        )
    }

    /// The graph's execution plan: the first engine configuration cuDNN's heuristics offer that
    /// finalizes.
    pub fn plan(self, handle: sys::cudnnHandle_t) -> Result<Plan, String> {
        let mut graph = Descriptor::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        let operations: Vec<&Descriptor> = self.operations.iter().collect();
        graph
            .handle(Attribute::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, handle)?
            .descriptors(Attribute::CUDNN_ATTR_OPERATIONGRAPH_OPS, &operations)?;
        graph.finalize()?;
        let mut heuristics = Descriptor::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
        heuristics
            .descriptor(Attribute::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &graph)?
            .heuristic_mode(sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A)?;
        heuristics.finalize()?;
        let configs = heuristics.get_descriptors(
            Attribute::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR,
            8,
        )?;
        let mut reasons = Vec::new();
        for config in &configs {
            let attempt = (|| {
                let mut plan = Descriptor::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
                plan.handle(Attribute::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle)?
                    .descriptor(Attribute::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config)?;
                plan.finalize()?;
                let workspace =
                    plan.get_int64(Attribute::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?;
                Ok::<_, String>(Plan {
                    plan,
                    workspace_bytes: workspace.max(0) as usize,
                })
            })();
            match attempt {
                Ok(plan) => return Ok(plan),
                Err(reason) => reasons.push(reason),
            }
        }
        Err(if configs.is_empty() {
            "cuDNN's heuristics offer no engine for the graph".to_string()
        } else {
            reasons.join("; ")
        })
    }
}

/// A finalized execution plan and the workspace it needs.
pub(crate) struct Plan {
    plan: Descriptor,
    pub workspace_bytes: usize,
}

impl Plan {
    /// Enqueues the plan on the handle's stream with `bindings` (uid, device or host pointer).
    ///
    /// # Safety
    /// Every pointer is live and sized as its tensor describes; the workspace holds
    /// `workspace_bytes`.
    pub unsafe fn execute(
        &self,
        handle: sys::cudnnHandle_t,
        bindings: &[(TensorId, *mut c_void)],
        workspace: *mut c_void,
    ) -> Result<(), String> {
        let uids: Vec<i64> = bindings.iter().map(|(tensor, _)| tensor.uid).collect();
        let pointers: Vec<*mut c_void> = bindings.iter().map(|&(_, pointer)| pointer).collect();
        let mut pack = Descriptor::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        pack.int64s(Attribute::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &uids)?
            .pointers(Attribute::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, &pointers)?
            .pointers(Attribute::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, &[workspace])?;
        pack.finalize()?;
        // SAFETY: per the caller's contract.
        check(
            unsafe { sys::cudnnBackendExecute(handle, self.plan.raw(), pack.raw()) },
            "execute",
        )
    }
}
