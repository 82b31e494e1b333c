//! ggml tensor types and their dequantization to f32. Quantized types store a row as blocks of
//! a fixed number of values, each block with its own scale (and minimum); a row's length must be
//! a whole number of blocks, which [`GgmlType::byte_size`] checks.

use half::{bf16, f16};

/// The tensor types lemo can dequantize, with their ggml type ids (and ggml's names).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q4_K,
    Q6_K,
}

/// Values per block of the legacy quantizations (Q4_0, Q4_1, Q8_0).
const LEGACY_BLOCK: usize = 32;
/// Values per super-block of the K-quantizations.
const K_BLOCK: usize = 256;

impl GgmlType {
    /// The type with ggml id `id`; `Err` carries a name for the ids ggml defines that lemo does
    /// not dequantize, so the error can say which one a file used.
    pub fn from_id(id: u32) -> Result<Self, String> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            12 => Self::Q4_K,
            14 => Self::Q6_K,
            30 => Self::BF16,
            other => {
                let known = match other {
                    6 => "Q5_0",
                    7 => "Q5_1",
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    13 => "Q5_K",
                    15 => "Q8_K",
                    16..=23 | 29 => "an IQ quantization",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    34 | 35 => "a ternary quantization",
                    _ => return Err(format!("unknown ggml type id {other}")),
                };
                return Err(format!(
                    "ggml type {known} (id {other}), which lemo does not dequantize \
                     (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)"
                ));
            }
        })
    }

    /// The type's ggml id ([`Self::from_id`] backwards).
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
            Self::Q4_K => 12,
            Self::Q6_K => 14,
            Self::BF16 => 30,
        }
    }

    /// Values per block (1 for the float types).
    pub fn block_values(self) -> usize {
        self.block().0
    }

    /// Values per block and bytes per block.
    fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            // f16 scale + 16 bytes of nibbles
            Self::Q4_0 => (LEGACY_BLOCK, 2 + LEGACY_BLOCK / 2),
            // f16 scale + f16 minimum + 16 bytes of nibbles
            Self::Q4_1 => (LEGACY_BLOCK, 4 + LEGACY_BLOCK / 2),
            // f16 scale + 32 signed bytes
            Self::Q8_0 => (LEGACY_BLOCK, 2 + LEGACY_BLOCK),
            // f16 scale, f16 minimum scale, 12 bytes of packed 6-bit scales/minimums, nibbles
            Self::Q4_K => (K_BLOCK, 4 + 12 + K_BLOCK / 2),
            // low nibbles, high 2-bit pairs, 16 signed sub-block scales, f16 scale
            Self::Q6_K => (K_BLOCK, K_BLOCK / 2 + K_BLOCK / 4 + 16 + 2),
        }
    }

    /// Bytes of a tensor whose innermost dimension is `row` values and which has `count`
    /// values in all; `Err` if a row is not a whole number of blocks or the size overflows.
    pub fn byte_size(self, row: usize, count: usize) -> Result<usize, String> {
        let (values, bytes) = self.block();
        if !row.is_multiple_of(values) {
            return Err(format!(
                "a row of {row} values is not a whole number of {self:?} blocks of {values}"
            ));
        }
        (count / values)
            .checked_mul(bytes)
            .ok_or_else(|| format!("{count} values of {self:?} overflow the address space"))
    }

    /// Decodes `bytes` (a whole number of blocks, as [`Self::byte_size`] computed) to f32.
    pub fn dequantize(self, bytes: &[u8]) -> Vec<f32> {
        let (values, block_bytes) = self.block();
        let mut out = Vec::with_capacity(bytes.len() / block_bytes * values);
        for block in bytes.chunks_exact(block_bytes) {
            match self {
                Self::F32 => out.push(f32::from_le_bytes([block[0], block[1], block[2], block[3]])),
                Self::F16 => out.push(f16_at(block, 0)),
                Self::BF16 => out.push(bf16::from_le_bytes([block[0], block[1]]).to_f32()),
                Self::Q4_0 => q4_0(block, &mut out),
                Self::Q4_1 => q4_1(block, &mut out),
                Self::Q8_0 => q8_0(block, &mut out),
                Self::Q4_K => q4_k(block, &mut out),
                Self::Q6_K => q6_k(block, &mut out),
            }
        }
        out
    }
}

impl GgmlType {
    /// Encodes row-major `values` (rows a whole number of blocks) as this type, as ggml's
    /// reference quantizers do; `None` for the types lemo does not write (K-quantizations, Q4).
    pub fn quantize(self, values: &[f32]) -> Option<Vec<u8>> {
        Some(match self {
            Self::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Self::F16 => values
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
            Self::BF16 => values
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect(),
            Self::Q8_0 => values
                .chunks_exact(LEGACY_BLOCK)
                .flat_map(quantize_q8_0)
                .collect(),
            Self::Q4_0 | Self::Q4_1 | Self::Q4_K | Self::Q6_K => return None,
        })
    }
}

/// ggml's `quantize_row_q8_0_ref`: `d = max |x| / 127`, `q = round(x / d)` (halves away from
/// zero), `d` stored as f16.
fn quantize_q8_0(block: &[f32]) -> Vec<u8> {
    let max = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = max / 127.0;
    let inverse = if scale == 0.0 { 0.0 } else { 1.0 / scale };
    let mut out = f16::from_f32(scale).to_le_bytes().to_vec();
    out.extend(block.iter().map(|&v| (v * inverse).round() as i8 as u8));
    out
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Byte `j` of the nibbles holds value `j` in its low half and value `j + 16` in its high half.
fn push_nibbles(nibbles: &[u8], value: impl Fn(u8) -> f32, out: &mut Vec<f32>) {
    out.extend(nibbles.iter().map(|&b| value(b & 0x0f)));
    out.extend(nibbles.iter().map(|&b| value(b >> 4)));
}

/// `x = (q - 8) * d` with 4-bit `q`.
fn q4_0(block: &[u8], out: &mut Vec<f32>) {
    let scale = f16_at(block, 0);
    push_nibbles(&block[2..], |q| (f32::from(q) - 8.0) * scale, out);
}

/// `x = q * d + m` with 4-bit `q`.
fn q4_1(block: &[u8], out: &mut Vec<f32>) {
    let (scale, minimum) = (f16_at(block, 0), f16_at(block, 2));
    push_nibbles(&block[4..], |q| f32::from(q) * scale + minimum, out);
}

/// `x = q * d` with signed 8-bit `q`.
fn q8_0(block: &[u8], out: &mut Vec<f32>) {
    let scale = f16_at(block, 0);
    out.extend(block[2..].iter().map(|&q| f32::from(q as i8) * scale));
}

/// Scale and minimum (6 bits each) of sub-block `j` of a Q4_K super-block: the first four
/// are stored plainly in the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); the last four
/// take their low 4 bits from bytes 8-11 and their top 2 bits from the spare top bits of bytes 0-7.
pub(crate) fn q4_k_scale_min(j: usize, packed: &[u8]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        (
            (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    }
}

/// Eight sub-blocks of 32: `x = d * scale_j * q - dmin * min_j`. The nibbles come as four runs of
/// 32 bytes; each run holds sub-block `2i` in its low halves and `2i + 1` in its high halves.
fn q4_k(block: &[u8], out: &mut Vec<f32>) {
    let (scale, min_scale) = (f16_at(block, 0), f16_at(block, 2));
    let packed = &block[4..16];
    for (run, nibbles) in block[16..].chunks_exact(32).enumerate() {
        for (sub, shift) in [(2 * run, 0), (2 * run + 1, 4)] {
            let (sub_scale, sub_min) = q4_k_scale_min(sub, packed);
            let factor = scale * f32::from(sub_scale);
            let offset = min_scale * f32::from(sub_min);
            out.extend(
                nibbles
                    .iter()
                    .map(|&b| factor * f32::from((b >> shift) & 0x0f) - offset),
            );
        }
    }
}

/// Sixteen sub-blocks of 16 with signed 8-bit scales: `x = d * scale * (q - 32)`, `q` 6 bits: its
/// low 4 bits in `low` (two values per byte), its top 2 bits in `high` (four values per byte).
/// Each half of 128 values uses 64 low bytes and 32 high bytes; within a half, value
/// `l + 32 * k` (k = 0..4) takes nibble `k / 2` of low byte `l + 32 * (k % 2)` and bits `2k..2k+2`
/// of high byte `l`.
fn q6_k(block: &[u8], out: &mut Vec<f32>) {
    let (low, rest) = block.split_at(K_BLOCK / 2);
    let (high, rest) = rest.split_at(K_BLOCK / 4);
    let (scales, scale_bytes) = rest.split_at(16);
    let scale = f16_at(scale_bytes, 0);
    for half in 0..2 {
        let low = &low[64 * half..64 * (half + 1)];
        let high = &high[32 * half..32 * (half + 1)];
        let scales = &scales[8 * half..8 * (half + 1)];
        for k in 0..4 {
            for l in 0..32 {
                let low_byte = low[l + 32 * (k % 2)];
                let low_bits = if k < 2 {
                    low_byte & 0x0f
                } else {
                    low_byte >> 4
                };
                let high_bits = (high[l] >> (2 * k)) & 3;
                let q = i32::from(low_bits | (high_bits << 4)) - 32;
                let sub_scale = f32::from(scales[l / 16 + 2 * k] as i8);
                out.push(scale * sub_scale * q as f32);
            }
        }
    }
}
