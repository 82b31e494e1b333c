//! Dequantization in plain Burn tensor ops, so every backend runs it: each field unpacked from
//! its words by shifts and masks, f16 scales decoded from their bits, and each format's affine
//! (or code-book) map applied in f32 in the order of the module's table. What the kernels are
//! checked against, and the path of backends without kernels.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, ElementConversion, Int, Tensor};

use super::{BlockFormat, NF4_ABSMAX_BLOCK, PackedBlocks};

/// See [`super::dequantize`] (without its checks).
pub fn dequantize<B: Backend>(blocks: &PackedBlocks<B>, dtype: DType) -> Tensor<B, 2> {
    let [rows, cols] = blocks.shape;
    let values = match blocks.format {
        BlockFormat::Nf4 => nf4(blocks),
        format => ggml(blocks, format),
    };
    let count: usize = values.dims().iter().product();
    values
        .reshape([count])
        .slice(0..rows * cols)
        .reshape([rows, cols])
        .cast(dtype)
}

/// Field `index` unpacked, one integer per value.
fn field<B: Backend>(blocks: &PackedBlocks<B>, index: usize) -> Tensor<B, 1, Int> {
    let field = &blocks.fields[index];
    let bits = blocks.format.field_bits()[index];
    unpack(field.words.clone(), bits, field.count)
}

fn float_field<B: Backend>(blocks: &PackedBlocks<B>, index: usize) -> Tensor<B, 1> {
    field(blocks, index).float()
}

fn f16_field<B: Backend>(blocks: &PackedBlocks<B>, index: usize) -> Tensor<B, 1> {
    f16_values(field(blocks, index))
}

fn per_group<B: Backend>(v: Tensor<B, 1>, group: usize) -> Tensor<B, 2> {
    let groups = v.dims()[0] / group;
    v.reshape([groups, group])
}

fn column<B: Backend>(v: Tensor<B, 1>) -> Tensor<B, 2> {
    let n = v.dims()[0];
    v.reshape([n, 1])
}

/// `[blocks, values per block]` of a ggml block type.
fn ggml<B: Backend>(blocks: &PackedBlocks<B>, format: BlockFormat) -> Tensor<B, 2> {
    let codes = |group| per_group(float_field(blocks, 0), group);
    let scale = |index| column(f16_field(blocks, index));
    match format {
        BlockFormat::Q4_0 => (codes(32) - 8.0) * scale(1),
        BlockFormat::Q4_1 => codes(32) * scale(1) + scale(2),
        BlockFormat::Q8_0 => (codes(32) - 128.0) * scale(1),
        BlockFormat::Q4_K => {
            // Sub-block j of super-block s: d_s * scale_j * q - dmin_s * min_j.
            let sub = |super_scale: Tensor<B, 2>, index: usize| {
                let per_super = per_group(float_field(blocks, index), 8) * super_scale;
                let n = per_super.dims()[0] * 8;
                per_super.reshape([n, 1])
            };
            let factor = sub(scale(1), 3);
            let offset = sub(scale(2), 4);
            factor * codes(32) - offset
        }
        BlockFormat::Q6_K => {
            // d * scale_j * (q - 32), q = low | high << 4, signed scales stored + 128.
            let q = field(blocks, 0) + field(blocks, 1).mul_scalar(16.elem::<B::IntElem>());
            let scales = per_group(float_field(blocks, 3) - 128.0, 16) * scale(2);
            let n = scales.dims()[0] * 16;
            scales.reshape([n, 1]) * per_group(q.float() - 32.0, 16)
        }
        BlockFormat::Nf4 => unreachable!("NF4 is not a ggml type"),
    }
}

/// `[blocks, 64]`: `code[q4] * (map[q8] * absmax2 + mean)`.
fn nf4<B: Backend>(blocks: &PackedBlocks<B>) -> Tensor<B, 2> {
    let [code, map, absmax_scales, mean] = [0, 1, 2, 3].map(|i| blocks.tables[i].clone());
    let absmax_codes = field(blocks, 1);
    let padded = absmax_codes.dims()[0];
    let scaled = map
        .select(0, absmax_codes)
        .reshape([padded / NF4_ABSMAX_BLOCK, NF4_ABSMAX_BLOCK])
        * absmax_scales.reshape([padded / NF4_ABSMAX_BLOCK, 1]);
    let absmax = scaled + mean.reshape([1, 1]);
    let codes = field(blocks, 0);
    let block = BlockFormat::Nf4.block_values();
    let count = codes.dims()[0] / block;
    let absmax = absmax.reshape([padded]).slice(0..count).reshape([count, 1]);
    code.select(0, codes).reshape([count, block]) * absmax
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
