//! CubeCL kernels of dequantization: one thread per output value decodes the fields of its
//! value and block from their words and writes the value in the output dtype.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::{BlockFormat, NF4_ABSMAX_BLOCK};

/// Value `index` of a field of `bits`-bit values packed from the low bits of each word up.
#[cube]
fn unpacked<I: Int>(words: &Tensor<I>, index: usize, #[comptime] bits: u32) -> u32 {
    let per_word = comptime!((32 / bits) as usize);
    // The words are bit patterns: the cast keeps their low 32 bits.
    let word = u32::cast_from(words[index / per_word]);
    let shift = u32::cast_from(index % per_word) * bits;
    (word >> shift) & comptime!((1u32 << bits) - 1)
}

/// An IEEE half-precision value from its bits, as the reference computes it:
/// `(m + 1024 [e > 0]) * 2^(max(e, 1) - 25) * (1 - 2 s)`, exact in f32 (the power of two is
/// built from its exponent bits).
#[cube]
fn f16_value(bits: u32) -> f32 {
    let exponent = (bits >> 10) & 31;
    let mut significand = bits & 1023;
    let mut scale_exponent = 1u32;
    if exponent > 0 {
        significand += 1024;
        scale_exponent = exponent;
    }
    // 2^(x - 25) has the f32 exponent field x - 25 + 127.
    let power = f32::reinterpret((scale_exponent + 102) << 23);
    let sign = 1.0 - 2.0 * f32::cast_from((bits >> 15) & 1);
    f32::cast_from(significand) * power * sign
}

/// The f16 field `index` of a field of 16-bit values.
#[cube]
fn f16_field<I: Int>(words: &Tensor<I>, index: usize) -> f32 {
    f16_value(unpacked::<I>(words, index, 16u32))
}

/// Q4_0 and Q8_0: `(q - 2^(bits - 1)) * d`, one f16 `d` per block of 32.
#[cube(launch_unchecked)]
fn offset_kernel<I: Int, O: Float>(
    codes: &Tensor<I>,
    scales: &Tensor<I>,
    out: &mut Tensor<O>,
    #[comptime] bits: u32,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let offset = f32::cast_from(comptime!(1u32 << (bits - 1)));
    let q = f32::cast_from(unpacked::<I>(codes, i, bits));
    out[i] = O::cast_from((q - offset) * f16_field::<I>(scales, i / 32));
}

/// Q4_1: `q * d + m`, one f16 `d` and `m` per block of 32.
#[cube(launch_unchecked)]
fn q4_1_kernel<I: Int, O: Float>(
    codes: &Tensor<I>,
    scales: &Tensor<I>,
    minimums: &Tensor<I>,
    out: &mut Tensor<O>,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let q = f32::cast_from(unpacked::<I>(codes, i, 4u32));
    let block = i / 32;
    out[i] = O::cast_from(q * f16_field::<I>(scales, block) + f16_field::<I>(minimums, block));
}

/// Q4_K: `(scale * d) * q - min * dmin`, f16 `d` and `dmin` per super-block of 256, 8-bit
/// `scale` and `min` per sub-block of 32.
#[cube(launch_unchecked)]
fn q4_k_kernel<I: Int, O: Float>(
    codes: &Tensor<I>,
    scales: &Tensor<I>,
    min_scales: &Tensor<I>,
    sub_scales: &Tensor<I>,
    sub_minimums: &Tensor<I>,
    out: &mut Tensor<O>,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let (block, sub) = (i / 256, i / 32);
    let factor =
        f32::cast_from(unpacked::<I>(sub_scales, sub, 8u32)) * f16_field::<I>(scales, block);
    let offset =
        f32::cast_from(unpacked::<I>(sub_minimums, sub, 8u32)) * f16_field::<I>(min_scales, block);
    let q = f32::cast_from(unpacked::<I>(codes, i, 4u32));
    out[i] = O::cast_from(factor * q - offset);
}

/// Q6_K: `((scale - 128) * d) * (low + 16 high - 32)`, f16 `d` per super-block of 256, 8-bit
/// `scale` per sub-block of 16.
#[cube(launch_unchecked)]
fn q6_k_kernel<I: Int, O: Float>(
    low: &Tensor<I>,
    high: &Tensor<I>,
    scales: &Tensor<I>,
    sub_scales: &Tensor<I>,
    out: &mut Tensor<O>,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let q = unpacked::<I>(low, i, 4u32) + unpacked::<I>(high, i, 2u32) * 16;
    let sub_scale = f32::cast_from(unpacked::<I>(sub_scales, i / 16, 8u32)) - 128.0;
    let scale = sub_scale * f16_field::<I>(scales, i / 256);
    out[i] = O::cast_from(scale * (f32::cast_from(q) - 32.0));
}

/// NF4: `code[q4] * (map[q8] * absmax2 + mean)`, `q8` per block of 64, `absmax2` per block of
/// 256 of those.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn nf4_kernel<I: Int, O: Float>(
    codes: &Tensor<I>,
    absmax_codes: &Tensor<I>,
    code: &Tensor<f32>,
    map: &Tensor<f32>,
    absmax_scales: &Tensor<f32>,
    mean: &Tensor<f32>,
    out: &mut Tensor<O>,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let block = i / 64;
    let q8 = unpacked::<I>(absmax_codes, block, 8u32) as usize;
    let absmax = map[q8] * absmax_scales[block / NF4_ABSMAX_BLOCK] + mean[0];
    let q4 = unpacked::<I>(codes, i, 4u32) as usize;
    out[i] = O::cast_from(code[q4] * absmax);
}

/// The `[rows, cols]` weight of `format`'s `fields` (words as the backend's integers) and f32
/// `tables`, in `dtype`. One thread per value decodes its code and its block's scales (a few
/// words, each shared by the threads of its block, so read from cache) and writes the value:
/// a pass reads the packed weight once and writes the dense one once, O(rows * cols * (bits / 8
/// + dtype bytes)) bytes of memory traffic and no intermediate tensor.
pub(crate) fn dequantize<R: CubeRuntime>(
    format: BlockFormat,
    [rows, cols]: [usize; 2],
    fields: Vec<CubeTensor<R>>,
    tables: Vec<CubeTensor<R>>,
    dtype: DType,
) -> CubeTensor<R> {
    let fields: Vec<_> = fields.into_iter().map(into_contiguous).collect();
    let tables: Vec<_> = tables
        .into_iter()
        .map(|t| match t.dtype {
            DType::F32 => into_contiguous(t),
            _ => into_contiguous(cast(t, DType::F32)),
        })
        .collect();
    let client = fields[0].client.clone();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        fields[0].device.clone(),
        Shape::from([rows, cols]),
        dtype,
    );
    let units = rows * cols;
    if units == 0 {
        return out;
    }
    let cube_dim = CubeDim::new(&client, units);
    let count = calculate_cube_count_elemwise(&client, units, cube_dim);
    let dtypes = [fields[0].dtype.into(), dtype.into()];
    let field = |i: usize| fields[i].clone().into_tensor_arg();
    let table = |i: usize| tables[i].clone().into_tensor_arg();
    let out_arg = out.clone().into_tensor_arg();
    // SAFETY: threads past the output stop; `PackedBlocks::check` (run by the public entry point)
    // sized every field and table for the weight's blocks.
    unsafe {
        match format {
            BlockFormat::Q4_0 | BlockFormat::Q8_0 => {
                let bits = format.field_bits()[0];
                offset_kernel::launch_unchecked::<R>(
                    &client,
                    count,
                    cube_dim,
                    field(0),
                    field(1),
                    out_arg,
                    bits,
                    dtypes,
                )
            }
            BlockFormat::Q4_1 => q4_1_kernel::launch_unchecked::<R>(
                &client,
                count,
                cube_dim,
                field(0),
                field(1),
                field(2),
                out_arg,
                dtypes,
            ),
            BlockFormat::Q4_K => q4_k_kernel::launch_unchecked::<R>(
                &client,
                count,
                cube_dim,
                field(0),
                field(1),
                field(2),
                field(3),
                field(4),
                out_arg,
                dtypes,
            ),
            BlockFormat::Q6_K => q6_k_kernel::launch_unchecked::<R>(
                &client,
                count,
                cube_dim,
                field(0),
                field(1),
                field(2),
                field(3),
                out_arg,
                dtypes,
            ),
            BlockFormat::Nf4 => nf4_kernel::launch_unchecked::<R>(
                &client,
                count,
                cube_dim,
                field(0),
                field(1),
                table(0),
                table(1),
                table(2),
                table(3),
                out_arg,
                dtypes,
            ),
        }
    }
    out
}
