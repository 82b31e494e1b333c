//! Quantized weights on the host, laid out as the device holds them: each tensor is a few bit
//! fields (codes, scales, minimums) packed into 32-bit words, plus f32 tables. GGUF blocks are
//! split into those fields as they are (no value changes: the device decodes them to exactly what
//! [`GgmlType::dequantize`] gives), and NF4 comes from [`super::nf4`].

use super::nf4::{ABSMAX_BLOCK, Nf4, dynamic_map};
use crate::gguf::quant::GgmlType;

/// How a quantized weight encodes its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantFormat {
    /// One of ggml's block types (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K).
    Ggml(GgmlType),
    /// QLoRA's 4-bit NormalFloat with double quantization (see [`super::nf4`]).
    Nf4,
}

impl QuantFormat {
    pub fn name(self) -> String {
        match self {
            QuantFormat::Ggml(t) => format!("{t:?}"),
            QuantFormat::Nf4 => "NF4".into(),
        }
    }

    /// Whether ggml type `t` can stay in its blocks on the device.
    pub fn keeps(t: GgmlType) -> bool {
        matches!(
            t,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::Q4_K | GgmlType::Q6_K
        )
    }
}

/// `count` unsigned values of `bits` bits each, packed from the low bits of each word up.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedField {
    pub bits: u32,
    pub count: usize,
    pub words: Vec<u32>,
}

impl PackedField {
    pub fn pack(bits: u32, values: impl IntoIterator<Item = u32>) -> Self {
        let per_word = (32 / bits) as usize;
        let mut words = Vec::new();
        let mut count = 0;
        for value in values {
            debug_assert!(value < 1 << bits, "{value} does not fit {bits} bits");
            if count % per_word == 0 {
                words.push(0);
            }
            *words.last_mut().expect("pushed above") |= value << ((count % per_word) as u32 * bits);
            count += 1;
        }
        Self { bits, count, words }
    }

    /// The values back (the host mirror of the device's unpacking).
    pub fn unpack(&self) -> Vec<u32> {
        let per_word = (32 / self.bits) as usize;
        let mask = (1u64 << self.bits) as u32 - 1;
        (0..self.count)
            .map(|i| (self.words[i / per_word] >> ((i % per_word) as u32 * self.bits)) & mask)
            .collect()
    }
}

/// A quantized `[rows, cols]` weight as fields and tables, in the order its format's decoder
/// reads them (see [`super::device`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PackedWeight {
    pub format: QuantFormat,
    pub shape: [usize; 2],
    pub fields: Vec<PackedField>,
    pub tables: Vec<Vec<f32>>,
}

impl PackedWeight {
    /// Bytes the device holds for it.
    pub fn bytes(&self) -> usize {
        let fields: usize = self.fields.iter().map(|f| 4 * f.words.len()).sum();
        let tables: usize = self.tables.iter().map(|t| 4 * t.len()).sum();
        fields + tables
    }

    /// GGUF blocks of `t` holding `shape` row-major (rows a whole number of blocks).
    pub fn from_ggml(t: GgmlType, shape: [usize; 2], bytes: &[u8]) -> Self {
        let block_bytes = t
            .byte_size(shape[1], shape[1])
            .expect("rows are whole blocks")
            / (shape[1] / t.block_values());
        let blocks = bytes.chunks_exact(block_bytes);
        let f16_bits = |b: &[u8], at: usize| u32::from(u16::from_le_bytes([b[at], b[at + 1]]));
        let fields = match t {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let head = if t == GgmlType::Q4_0 { 2 } else { 4 };
                let mut out = vec![
                    PackedField::pack(4, blocks.clone().flat_map(|b| nibbles(&b[head..]))),
                    PackedField::pack(16, blocks.clone().map(|b| f16_bits(b, 0))),
                ];
                if t == GgmlType::Q4_1 {
                    out.push(PackedField::pack(16, blocks.map(|b| f16_bits(b, 2))));
                }
                out
            }
            GgmlType::Q8_0 => vec![
                PackedField::pack(
                    8,
                    blocks
                        .clone()
                        .flat_map(|b| b[2..].iter().map(|&q| u32::from(q ^ 0x80))),
                ),
                PackedField::pack(16, blocks.map(|b| f16_bits(b, 0))),
            ],
            GgmlType::Q4_K => {
                let scale_min = |b: &[u8]| {
                    (0..8)
                        .map(|j| crate::gguf::quant::q4_k_scale_min(j, &b[4..16]))
                        .collect::<Vec<_>>()
                };
                vec![
                    PackedField::pack(4, blocks.clone().flat_map(q4_k_codes)),
                    PackedField::pack(16, blocks.clone().map(|b| f16_bits(b, 0))),
                    PackedField::pack(16, blocks.clone().map(|b| f16_bits(b, 2))),
                    PackedField::pack(
                        8,
                        blocks
                            .clone()
                            .flat_map(|b| scale_min(b).into_iter().map(|(s, _)| u32::from(s))),
                    ),
                    PackedField::pack(
                        8,
                        blocks.flat_map(|b| scale_min(b).into_iter().map(|(_, m)| u32::from(m))),
                    ),
                ]
            }
            GgmlType::Q6_K => vec![
                PackedField::pack(
                    4,
                    blocks.clone().flat_map(|b| q6_k_codes(b).map(|q| q & 15)),
                ),
                PackedField::pack(
                    2,
                    blocks.clone().flat_map(|b| q6_k_codes(b).map(|q| q >> 4)),
                ),
                PackedField::pack(16, blocks.clone().map(|b| f16_bits(b, 208))),
                PackedField::pack(
                    8,
                    blocks.flat_map(|b| b[192..208].iter().map(|&s| u32::from(s ^ 0x80))),
                ),
            ],
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                panic!("{t:?} is not a block type")
            }
        };
        Self {
            format: QuantFormat::Ggml(t),
            shape,
            fields,
            tables: Vec::new(),
        }
    }

    /// NF4 with double quantization of `shape` row-major, flattened as bitsandbytes does; the
    /// block maxima's codes are padded to whole blocks of [`ABSMAX_BLOCK`] (with the code of 0).
    pub fn from_nf4(shape: [usize; 2], nf4: Nf4) -> Self {
        let zero = dynamic_map()
            .iter()
            .position(|&v| v == 0.0)
            .expect("the map holds 0") as u32;
        let padding =
            nf4.absmax_codes.len().next_multiple_of(ABSMAX_BLOCK) - nf4.absmax_codes.len();
        let absmax_codes = nf4.absmax_codes.iter().map(|&c| u32::from(c));
        Self {
            format: QuantFormat::Nf4,
            shape,
            fields: vec![
                PackedField::pack(4, nf4.codes.iter().map(|&c| u32::from(c))),
                PackedField::pack(8, absmax_codes.chain(std::iter::repeat_n(zero, padding))),
            ],
            tables: vec![nf4.absmax_scales, vec![nf4.absmax_mean]],
        }
    }
}

/// The 32 codes of a Q4_0/Q4_1 block in value order: byte `j` holds value `j` in its low half
/// and value `j + 16` in its high half.
fn nibbles(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    let low = bytes.iter().map(|&b| u32::from(b & 0x0f));
    low.chain(bytes.iter().map(|&b| u32::from(b >> 4)))
}

/// The 256 codes of a Q4_K block in value order: four runs of 32 bytes, each holding sub-block
/// `2i` in its low halves and `2i + 1` in its high halves.
fn q4_k_codes(block: &[u8]) -> impl Iterator<Item = u32> + '_ {
    block[16..]
        .chunks_exact(32)
        .flat_map(|run| [0, 4].map(|shift| run.iter().map(move |&b| u32::from((b >> shift) & 15))))
        .flatten()
}

/// The 256 six-bit codes of a Q6_K block in value order (the layout
/// [`GgmlType::dequantize`] documents).
fn q6_k_codes(block: &[u8]) -> impl Iterator<Item = u32> + '_ {
    let (low, high) = (&block[..128], &block[128..192]);
    (0..256).map(move |i| {
        let (half, k, l) = (i / 128, (i % 128) / 32, i % 32);
        let low_byte = low[64 * half + l + 32 * (k % 2)];
        let low_bits = if k < 2 { low_byte & 15 } else { low_byte >> 4 };
        let high_bits = (high[32 * half + l] >> (2 * k)) & 3;
        u32::from(low_bits | (high_bits << 4))
    })
}
