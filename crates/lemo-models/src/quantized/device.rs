//! Quantized weights on the device. Their dequantization is `lemo_kernels::dequantize`: one
//! kernel on CubeCL backends, plain Burn tensor operations elsewhere, both giving exactly what the
//! host dequantizers ([`crate::gguf::GgmlType::dequantize`], [`Nf4::dequantize`]) give (NF4's
//! block maxima within an f32 rounding where the backend contracts `a * b + c`).
//!
//! [`Nf4::dequantize`]: super::nf4::Nf4::dequantize

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use lemo_kernels::DequantizeBackend;
use lemo_kernels::dequantize::{BlockFormat, FieldWords, PackedBlocks, dequantize};

use super::nf4::{NF4_CODE, dynamic_map};
use super::packed::{PackedWeight, QuantFormat};
use crate::gguf::quant::GgmlType;

/// What a quantized weight's tensors hold, kept beside them.
#[derive(Debug, Clone)]
pub struct Layout {
    pub format: QuantFormat,
    pub shape: [usize; 2],
    /// Bits and count of each field.
    pub fields: Vec<(u32, usize)>,
    /// The dtype it dequantizes to (the frozen precision).
    pub dtype: DType,
    /// Device bytes of its fields and tables.
    pub bytes: usize,
}

/// A frozen weight kept quantized on the device; [`Self::dequantize`] gives it back whole.
#[derive(Module, Debug)]
pub struct QuantizedWeight<B: Backend> {
    /// Each field's 32-bit words (as the backend's integers).
    fields: Vec<Tensor<B, 1, Int>>,
    tables: Vec<Tensor<B, 1>>,
    #[module(skip)]
    layout: Layout,
}

impl<B: Backend> QuantizedWeight<B> {
    /// `packed` on `device`, dequantizing to `dtype`.
    pub fn new(packed: &PackedWeight, device: &B::Device, dtype: DType) -> Self {
        // Allocated once for the model's lifetime, in the pool's persistent part (as weights are).
        let fields = packed
            .fields
            .iter()
            .map(|f| {
                // Words are bit patterns: the backend's integers hold them as i32 (or wider).
                let words: Vec<i32> = f.words.iter().map(|&w| w as i32).collect();
                let data = TensorData::new(words, [f.words.len()]);
                B::memory_persistent_allocations(device, data, |data| {
                    Tensor::from_data(data, device)
                })
            })
            .collect();
        // NF4's code book and dynamic map lead its tables: the kernel reads them from the device.
        let constants = match packed.format {
            QuantFormat::Nf4 => vec![NF4_CODE.to_vec(), dynamic_map().to_vec()],
            QuantFormat::Ggml(_) => Vec::new(),
        };
        let constant_bytes: usize = constants.iter().map(|t| 4 * t.len()).sum();
        let tables = constants
            .iter()
            .chain(&packed.tables)
            .map(|t| {
                let data = TensorData::new(t.clone(), [t.len()]);
                B::memory_persistent_allocations(device, data, |data| {
                    Tensor::from_data(data, device)
                })
            })
            .collect();
        Self {
            fields,
            tables,
            layout: Layout {
                format: packed.format,
                shape: packed.shape,
                fields: packed.fields.iter().map(|f| (f.bits, f.count)).collect(),
                dtype,
                bytes: packed.bytes() + constant_bytes,
            },
        }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn device(&self) -> B::Device {
        self.fields[0].device()
    }

    /// The fields and tables as the dequantize kernel reads them.
    fn blocks(&self) -> PackedBlocks<B> {
        let format = match self.layout.format {
            QuantFormat::Ggml(GgmlType::Q4_0) => BlockFormat::Q4_0,
            QuantFormat::Ggml(GgmlType::Q4_1) => BlockFormat::Q4_1,
            QuantFormat::Ggml(GgmlType::Q8_0) => BlockFormat::Q8_0,
            QuantFormat::Ggml(GgmlType::Q4_K) => BlockFormat::Q4_K,
            QuantFormat::Ggml(GgmlType::Q6_K) => BlockFormat::Q6_K,
            QuantFormat::Nf4 => BlockFormat::Nf4,
            QuantFormat::Ggml(t) => unreachable!("{t:?} is loaded dense"),
        };
        let bits = self.layout.fields.iter().map(|&(bits, _)| bits);
        debug_assert!(bits.eq(format.field_bits().iter().copied()));
        let fields = self
            .fields
            .iter()
            .zip(&self.layout.fields)
            .map(|(words, &(_, count))| FieldWords {
                words: words.clone(),
                count,
            })
            .collect();
        PackedBlocks {
            format,
            shape: self.layout.shape,
            fields,
            tables: self.tables.clone(),
        }
    }
}

impl<B: DequantizeBackend> QuantizedWeight<B> {
    /// The weight `[rows, cols]` in the frozen dtype, in one kernel where the backend has it.
    pub fn dequantize(&self) -> Tensor<B, 2> {
        dequantize(self.blocks(), self.layout.dtype)
    }
}

/// A projection's frozen weight `[out, in]`: dense in the frozen dtype, or kept quantized and
/// dequantized where it is used.
#[derive(Module, Debug)]
pub enum FrozenWeight<B: Backend> {
    Dense(Param<Tensor<B, 2>>),
    Quantized(QuantizedWeight<B>),
}

impl<B: Backend> From<Tensor<B, 2>> for FrozenWeight<B> {
    fn from(weight: Tensor<B, 2>) -> Self {
        FrozenWeight::Dense(Param::from_tensor(weight).set_require_grad(false))
    }
}

impl<B: DequantizeBackend> FrozenWeight<B> {
    /// The weight as a tensor: a quantized one is dequantized into a fresh buffer each call,
    /// which the memory pool reuses once the product that reads it is done.
    pub fn val(&self) -> Tensor<B, 2> {
        match self {
            FrozenWeight::Dense(w) => w.val(),
            FrozenWeight::Quantized(q) => q.dequantize(),
        }
    }
}

impl<B: Backend> FrozenWeight<B> {
    pub fn dims(&self) -> [usize; 2] {
        match self {
            FrozenWeight::Dense(w) => w.dims(),
            FrozenWeight::Quantized(q) => q.layout.shape,
        }
    }

    pub fn device(&self) -> B::Device {
        match self {
            FrozenWeight::Dense(w) => w.device(),
            FrozenWeight::Quantized(q) => q.device(),
        }
    }

    pub fn quantized(&self) -> Option<&QuantizedWeight<B>> {
        match self {
            FrozenWeight::Dense(_) => None,
            FrozenWeight::Quantized(q) => Some(q),
        }
    }
}
