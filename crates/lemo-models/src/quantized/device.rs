//! Quantized weights on the device and their dequantization there, in plain Burn tensor
//! operations (so every backend runs it: CPU and wgpu in tests, CUDA in training). Each field is
//! unpacked from its 32-bit words by shifts and masks, f16 scales are decoded from their bits,
//! and each format applies its own affine (or code-book) map in f32, in the same order of
//! operations as the host dequantizers ([`crate::gguf::GgmlType::dequantize`], [`Nf4::dequantize`]):
//! the device gives the host's values exactly (where the backend does not contract `a * b + c`).
//!
//! [`Nf4::dequantize`]: super::nf4::Nf4::dequantize

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, ElementConversion, Int, Tensor, TensorData};

use super::nf4::{ABSMAX_BLOCK, BLOCK as NF4_BLOCK, NF4_CODE, dynamic_map};
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
        let tables = packed
            .tables
            .iter()
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
                bytes: packed.bytes(),
            },
        }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn device(&self) -> B::Device {
        self.fields[0].device()
    }

    /// Field `index` unpacked, one integer per value.
    fn field(&self, index: usize) -> Tensor<B, 1, Int> {
        let (bits, count) = self.layout.fields[index];
        unpack(self.fields[index].clone(), bits, count)
    }

    fn float_field(&self, index: usize) -> Tensor<B, 1> {
        self.field(index).float()
    }

    fn f16_field(&self, index: usize) -> Tensor<B, 1> {
        f16_values(self.field(index))
    }

    /// The weight `[rows, cols]` in the frozen dtype.
    pub fn dequantize(&self) -> Tensor<B, 2> {
        let [rows, cols] = self.layout.shape;
        let values = match self.layout.format {
            QuantFormat::Ggml(t) => self.ggml(t),
            QuantFormat::Nf4 => self.nf4(),
        };
        let count: usize = values.dims().iter().product();
        values
            .reshape([count])
            .slice(0..rows * cols)
            .reshape([rows, cols])
            .cast(self.layout.dtype)
    }

    /// `[blocks, values per block]` as [`GgmlType::dequantize`] computes them.
    fn ggml(&self, t: GgmlType) -> Tensor<B, 2> {
        let per_group = |v: Tensor<B, 1>, group: usize| {
            let groups = v.dims()[0] / group;
            v.reshape([groups, group])
        };
        let column = |v: Tensor<B, 1>| {
            let n = v.dims()[0];
            v.reshape([n, 1])
        };
        match t {
            GgmlType::Q4_0 => {
                (per_group(self.float_field(0), 32) - 8.0) * column(self.f16_field(1))
            }
            GgmlType::Q4_1 => {
                per_group(self.float_field(0), 32) * column(self.f16_field(1))
                    + column(self.f16_field(2))
            }
            GgmlType::Q8_0 => {
                (per_group(self.float_field(0), 32) - 128.0) * column(self.f16_field(1))
            }
            GgmlType::Q4_K => {
                // Sub-block j of super-block s: d_s * scale_j * q - dmin_s * min_j.
                let sub = |super_scale: Tensor<B, 1>, field: usize| {
                    let per_super = per_group(self.float_field(field), 8) * column(super_scale);
                    let n = per_super.dims()[0] * 8;
                    per_super.reshape([n, 1])
                };
                let factor = sub(self.f16_field(1), 3);
                let offset = sub(self.f16_field(2), 4);
                factor * per_group(self.float_field(0), 32) - offset
            }
            GgmlType::Q6_K => {
                // d * scale_j * (q - 32), q = low | high << 4, signed scales stored + 128.
                let codes = self.field(0) + self.field(1).mul_scalar(16.elem::<B::IntElem>());
                let scales = per_group(self.float_field(3) - 128.0, 16) * column(self.f16_field(2));
                let n = scales.dims()[0] * 16;
                scales.reshape([n, 1]) * per_group(codes.float() - 32.0, 16)
            }
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                unreachable!("float types are loaded dense")
            }
        }
    }

    /// `[blocks, 64]`: `NF4_CODE[q4] * (map[q8] * absmax2 + mean)`.
    fn nf4(&self) -> Tensor<B, 2> {
        let device = self.device();
        let map = Tensor::<B, 1>::from_floats(dynamic_map().as_slice(), &device);
        let absmax_codes = self.field(1);
        let padded = absmax_codes.dims()[0];
        let scaled = map
            .select(0, absmax_codes)
            .reshape([padded / ABSMAX_BLOCK, ABSMAX_BLOCK])
            * self.tables[0].clone().reshape([padded / ABSMAX_BLOCK, 1]);
        let absmax = scaled + self.tables[1].clone().reshape([1, 1]);
        let code = Tensor::<B, 1>::from_floats(NF4_CODE.as_slice(), &device);
        let codes = self.field(0);
        let blocks = codes.dims()[0] / NF4_BLOCK;
        let absmax = absmax
            .reshape([padded])
            .slice(0..blocks)
            .reshape([blocks, 1]);
        code.select(0, codes).reshape([blocks, NF4_BLOCK]) * absmax
    }
}

/// `count` fields of `bits` bits from `words`, lowest bits first.
fn unpack<B: Backend>(words: Tensor<B, 1, Int>, bits: u32, count: usize) -> Tensor<B, 1, Int> {
    let per_word = 32 / bits;
    let mask = (1i64 << bits) - 1;
    let n = words.dims()[0];
    let parts = (0..per_word)
        .map(|k| {
            // An arithmetic shift brings copies of the sign bit down, which the mask drops.
            words
                .clone()
                .bitwise_right_shift_scalar((k * bits).elem())
                .bitwise_and_scalar(mask.elem())
        })
        .collect();
    Tensor::stack::<2>(parts, 1)
        .reshape([n * per_word as usize])
        .slice(0..count)
}

/// IEEE half-precision values from their bits: `(-1)^s * m * 2^(e - 25)` with the implicit
/// leading 1 (1024) for `e > 0`, `m * 2^-24` for subnormals; exact in f32 (scales are finite).
fn f16_values<B: Backend>(bits: Tensor<B, 1, Int>) -> Tensor<B, 1> {
    let field = |shift: i64, mask: i64| {
        bits.clone()
            .bitwise_right_shift_scalar(shift.elem())
            .bitwise_and_scalar(mask.elem())
    };
    let (exponent, mantissa, sign) = (field(10, 31), field(0, 1023), field(15, 1));
    let implicit = exponent
        .clone()
        .greater_elem(0)
        .int()
        .mul_scalar(1024.elem::<B::IntElem>());
    let powers: Vec<f32> = (0..32).map(|e: i32| 2f32.powi(e.max(1) - 25)).collect();
    let power = Tensor::<B, 1>::from_floats(powers.as_slice(), &bits.device()).select(0, exponent);
    let sign = sign.float().mul_scalar(-2.0).add_scalar(1.0);
    (mantissa + implicit).float() * power * sign
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

impl<B: Backend> FrozenWeight<B> {
    /// The weight as a tensor: a quantized one is dequantized into a fresh buffer each call,
    /// which the memory pool reuses once the product that reads it is done.
    pub fn val(&self) -> Tensor<B, 2> {
        match self {
            FrozenWeight::Dense(w) => w.val(),
            FrozenWeight::Quantized(q) => q.dequantize(),
        }
    }

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
