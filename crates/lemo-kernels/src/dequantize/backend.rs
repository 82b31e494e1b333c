//! The dequantization family of backend operations: the default body is the plain Burn
//! reference, CubeCL backends run the kernel of this module, and `Autodiff<B>` runs its inner
//! backend's (quantized weights are frozen: the result has no gradient).

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::DType;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::{FieldWords, PackedBlocks, kernel, reference};
use crate::backend::CpuBackend;

/// Dequantizing frozen weights kept quantized on the device.
pub trait DequantizeBackend: Backend {
    /// The weight `blocks` holds, `[rows, cols]` in `dtype`; see [`super::dequantize`].
    fn lemo_dequantize(blocks: PackedBlocks<Self>, dtype: DType) -> FloatTensor<Self> {
        reference::dequantize(&blocks, dtype)
            .into_primitive()
            .tensor()
    }
}

impl DequantizeBackend for CpuBackend {}

impl<R, F, I, BT> DequantizeBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn lemo_dequantize(blocks: PackedBlocks<Self>, dtype: DType) -> FloatTensor<Self> {
        let fields = blocks
            .fields
            .into_iter()
            .map(|f| f.words.into_primitive())
            .collect();
        let tables = blocks
            .tables
            .into_iter()
            .map(|t| t.into_primitive().tensor())
            .collect();
        kernel::dequantize(blocks.format, blocks.shape, fields, tables, dtype)
    }
}

impl<B: DequantizeBackend, C: CheckpointStrategy> DequantizeBackend for Autodiff<B, C> {
    fn lemo_dequantize(blocks: PackedBlocks<Self>, dtype: DType) -> FloatTensor<Self> {
        let inner = PackedBlocks::<B> {
            format: blocks.format,
            shape: blocks.shape,
            fields: blocks
                .fields
                .into_iter()
                .map(|f| FieldWords {
                    words: f.words.inner(),
                    count: f.count,
                })
                .collect(),
            tables: blocks.tables.into_iter().map(|t| t.inner()).collect(),
        };
        Self::from_inner(B::lemo_dequantize(inner, dtype))
    }
}
