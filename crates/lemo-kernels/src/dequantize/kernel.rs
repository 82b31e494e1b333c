//! CubeCL kernels of dequantization: one thread per vector of `N` consecutive output values
//! (16 bytes of output; `N` divides every block and sub-block, so the vector's values share their
//! scales) decodes its block's scales once, then each value's code, and writes the values in the
//! output dtype.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::{BlockFormat, NF4_ABSMAX_BLOCK};
use crate::fused::vector_size;

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
fn offset_kernel<I: Int, O: Float, N: Size>(
    codes: &Tensor<I>,
    scales: &Tensor<I>,
    out: &mut Tensor<Vector<O, N>>,
    #[comptime] bits: u32,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let first = i * out.vector_size();
    let offset = f32::cast_from(comptime!(1u32 << (bits - 1)));
    let d = f16_field::<I>(scales, first / 32);
    let mut values = Vector::<O, N>::empty();
    #[unroll]
    for k in 0..out.vector_size() {
        let q = f32::cast_from(unpacked::<I>(codes, first + k, bits));
        values[k] = O::cast_from((q - offset) * d);
    }
    out[i] = values;
}

/// Q4_1: `q * d + m`, one f16 `d` and `m` per block of 32.
#[cube(launch_unchecked)]
fn q4_1_kernel<I: Int, O: Float, N: Size>(
    codes: &Tensor<I>,
    scales: &Tensor<I>,
    minimums: &Tensor<I>,
    out: &mut Tensor<Vector<O, N>>,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let first = i * out.vector_size();
    let d = f16_field::<I>(scales, first / 32);
    let m = f16_field::<I>(minimums, first / 32);
    let mut values = Vector::<O, N>::empty();
    #[unroll]
    for k in 0..out.vector_size() {
        let q = f32::cast_from(unpacked::<I>(codes, first + k, 4u32));
        values[k] = O::cast_from(q * d + m);
    }
    out[i] = values;
}

/// Q4_K: `(scale * d) * q - min * dmin`, f16 `d` and `dmin` per super-block of 256, 8-bit
/// `scale` and `min` per sub-block of 32.
#[cube(launch_unchecked)]
fn q4_k_kernel<I: Int, O: Float, N: Size>(
    codes: &Tensor<I>,
    scales: &Tensor<I>,
    min_scales: &Tensor<I>,
    sub_scales: &Tensor<I>,
    sub_minimums: &Tensor<I>,
    out: &mut Tensor<Vector<O, N>>,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let first = i * out.vector_size();
    let (block, sub) = (first / 256, first / 32);
    let factor =
        f32::cast_from(unpacked::<I>(sub_scales, sub, 8u32)) * f16_field::<I>(scales, block);
    let offset =
        f32::cast_from(unpacked::<I>(sub_minimums, sub, 8u32)) * f16_field::<I>(min_scales, block);
    let mut values = Vector::<O, N>::empty();
    #[unroll]
    for k in 0..out.vector_size() {
        let q = f32::cast_from(unpacked::<I>(codes, first + k, 4u32));
        values[k] = O::cast_from(factor * q - offset);
    }
    out[i] = values;
}

/// Q6_K: `((scale - 128) * d) * (low + 16 high - 32)`, f16 `d` per super-block of 256, 8-bit
/// `scale` per sub-block of 16.
#[cube(launch_unchecked)]
fn q6_k_kernel<I: Int, O: Float, N: Size>(
    low: &Tensor<I>,
    high: &Tensor<I>,
    scales: &Tensor<I>,
    sub_scales: &Tensor<I>,
    out: &mut Tensor<Vector<O, N>>,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let first = i * out.vector_size();
    let sub_scale = f32::cast_from(unpacked::<I>(sub_scales, first / 16, 8u32)) - 128.0;
    let scale = sub_scale * f16_field::<I>(scales, first / 256);
    let mut values = Vector::<O, N>::empty();
    #[unroll]
    for k in 0..out.vector_size() {
        let q = unpacked::<I>(low, first + k, 4u32) + unpacked::<I>(high, first + k, 2u32) * 16;
        values[k] = O::cast_from(scale * (f32::cast_from(q) - 32.0));
    }
    out[i] = values;
}

/// NF4: `code[q4] * (map[q8] * absmax2 + mean)`, `q8` per block of 64, `absmax2` per block of
/// 256 of those.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn nf4_kernel<I: Int, O: Float, N: Size>(
    codes: &Tensor<I>,
    absmax_codes: &Tensor<I>,
    code: &Tensor<f32>,
    map: &Tensor<f32>,
    absmax_scales: &Tensor<f32>,
    mean: &Tensor<f32>,
    out: &mut Tensor<Vector<O, N>>,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let first = i * out.vector_size();
    let block = first / 64;
    let q8 = unpacked::<I>(absmax_codes, block, 8u32) as usize;
    let absmax = map[q8] * absmax_scales[block / NF4_ABSMAX_BLOCK] + mean[0];
    let mut values = Vector::<O, N>::empty();
    #[unroll]
    for k in 0..out.vector_size() {
        let q4 = unpacked::<I>(codes, first + k, 4u32) as usize;
        values[k] = O::cast_from(code[q4] * absmax);
    }
    out[i] = values;
}

/// The `[rows, cols]` weight of `format`'s `fields` (words as the backend's integers) and f32
/// `tables`, in `dtype`. One thread per 16-byte vector of output values decodes its block's
/// scales once (words shared by the threads of the block, so read from cache) and each value's
/// code: a pass reads the packed weight once and writes the dense one once, O(rows * cols *
/// (bits / 8 + dtype bytes)) bytes of memory traffic and no intermediate tensor.
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
    let values = rows * cols;
    if values == 0 {
        return out;
    }
    // At most 16 values a vector: every block and sub-block (16 values or more) holds whole ones.
    let vector = vector_size(&out, values).min(16);
    let units = values / vector;
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
                    vector,
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
                vector,
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
                vector,
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
                vector,
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
                vector,
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
