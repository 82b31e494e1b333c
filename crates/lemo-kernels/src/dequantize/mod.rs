//! Dequantization of frozen weights kept quantized on the device: a `[rows, cols]` weight stored
//! as its format's bit fields (codes, scales, minimums) packed into 32-bit words, plus f32
//! tables, back to a dense tensor in the frozen dtype.
//!
//! Each field holds `count` unsigned values of its format's bits, packed from the low bits of
//! each word up, in value order (the weight flattened row-major, blocks one after another). The
//! formats are ggml's block types and QLoRA's NF4; each value is computed in f32 in the same order
//! of operations as the host dequantizers (ggml's reference code, bitsandbytes' NF4 algorithm), so
//! the device gives the host's values exactly. A compiler that contracts `a * b + c` into one
//! rounding (CUDA does by default) changes nothing for the ggml types: only Q4_1 and Q4_K add,
//! and the products they add are of codes and f16 scales, exact in f32 (at most 23 significant
//! bits). NF4's block maximum `map[q8] * absmax2 + mean` is the one sum it can round differently
//! (by one f32 rounding):
//!
//! | format | fields (bits) | value |
//! |---|---|---|
//! | Q4_0 | q (4), d (16) | `(q - 8) * d` |
//! | Q4_1 | q (4), d (16), m (16) | `q * d + m` |
//! | Q8_0 | q (8), d (16) | `(q - 128) * d` |
//! | Q4_K | q (4), d (16), dmin (16), scale (8), min (8) | `(scale * d) * q - min * dmin` |
//! | Q6_K | low (4), high (2), d (16), scale (8) | `((scale - 128) * d) * (low + 16 high - 32)` |
//! | NF4 | q4 (4), q8 (8) | `code[q4] * (map[q8] * absmax2 + mean)` |
//!
//! 16-bit fields are IEEE half-precision bits. Scales belong to blocks of 32 values (Q4_0, Q4_1,
//! Q8_0), super-blocks of 256 (Q4_K, Q6_K; their 8-bit scales to sub-blocks of 32 and 16), or
//! blocks of 64 (NF4's q8, whose `absmax2` scales blocks of 256 of them). NF4's tables are its
//! code book (16), the dynamic map (256), the `absmax2` of each block of 256 maxima and the mean of
//! the maxima (1).

pub mod backend;
pub(crate) mod kernel;
pub mod reference;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Int, Tensor, TensorData, TensorPrimitive};

pub use backend::DequantizeBackend;

/// How a quantized weight encodes its values (see the module's table).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    Q4_0,
    Q4_1,
    Q8_0,
    Q4_K,
    Q6_K,
    Nf4,
}

/// NF4 blocks of its second quantization: block maxima per `absmax2`.
pub const NF4_ABSMAX_BLOCK: usize = 256;

impl BlockFormat {
    /// Every format, in the module table's order.
    pub const ALL: [BlockFormat; 6] = [
        BlockFormat::Q4_0,
        BlockFormat::Q4_1,
        BlockFormat::Q8_0,
        BlockFormat::Q4_K,
        BlockFormat::Q6_K,
        BlockFormat::Nf4,
    ];

    /// The bits of each field, in the order the fields are passed.
    pub fn field_bits(self) -> &'static [u32] {
        match self {
            BlockFormat::Q4_0 => &[4, 16],
            BlockFormat::Q8_0 => &[8, 16],
            BlockFormat::Q4_1 => &[4, 16, 16],
            BlockFormat::Q4_K => &[4, 16, 16, 8, 8],
            BlockFormat::Q6_K => &[4, 2, 16, 8],
            BlockFormat::Nf4 => &[4, 8],
        }
    }

    /// Values per block (the unit its largest scale covers).
    pub fn block_values(self) -> usize {
        match self {
            BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q8_0 => 32,
            BlockFormat::Q4_K | BlockFormat::Q6_K => 256,
            BlockFormat::Nf4 => 64,
        }
    }

    /// Each field's value count for a weight of `values` values: whole blocks, and NF4's block
    /// maxima padded to whole blocks of [`NF4_ABSMAX_BLOCK`].
    pub fn field_counts(self, values: usize) -> Vec<usize> {
        let blocks = values.div_ceil(self.block_values());
        let per_block: &[usize] = match self {
            BlockFormat::Q4_0 | BlockFormat::Q8_0 => &[32, 1],
            BlockFormat::Q4_1 => &[32, 1, 1],
            BlockFormat::Q4_K => &[256, 1, 1, 8, 8],
            BlockFormat::Q6_K => &[256, 256, 1, 16],
            BlockFormat::Nf4 => {
                return vec![64 * blocks, blocks.next_multiple_of(NF4_ABSMAX_BLOCK)];
            }
        };
        per_block.iter().map(|n| n * blocks).collect()
    }

    /// Each table's length for a weight of `values` values (NF4's code book, dynamic map,
    /// second-level scales and mean; none for the ggml types).
    pub fn table_lens(self, values: usize) -> Vec<usize> {
        match self {
            BlockFormat::Nf4 => {
                let maxima = self.field_counts(values)[1];
                vec![16, 256, maxima / NF4_ABSMAX_BLOCK, 1]
            }
            _ => Vec::new(),
        }
    }
}

/// One field on the device: `count` values of the format's bits in 32-bit words (held as the
/// backend's integers: bit patterns, so negative where the top bit is set).
#[derive(Debug, Clone)]
pub struct FieldWords<B: Backend> {
    pub words: Tensor<B, 1, Int>,
    pub count: usize,
}

/// A quantized `[rows, cols]` weight on the device: its fields and f32 tables in the order of
/// [`BlockFormat::field_bits`] and [`BlockFormat::table_lens`].
#[derive(Debug, Clone)]
pub struct PackedBlocks<B: Backend> {
    pub format: BlockFormat,
    pub shape: [usize; 2],
    pub fields: Vec<FieldWords<B>>,
    pub tables: Vec<Tensor<B, 1>>,
}

impl<B: Backend> PackedBlocks<B> {
    /// A `[rows, cols]` weight of `format` for parity checks and benchmarks: every word drawn
    /// from `next_word` (codes, and the bits past the last value the decoder must ignore), the
    /// f16 scales kept finite (bit 14 of each half cleared: exponents below 16), standard normal
    /// tables.
    pub fn random(
        format: BlockFormat,
        shape: [usize; 2],
        mut next_word: impl FnMut() -> u64,
        device: &B::Device,
    ) -> Self {
        let values = shape[0] * shape[1];
        let fields = format
            .field_bits()
            .iter()
            .zip(format.field_counts(values))
            .map(|(&bits, count)| {
                let len = count.div_ceil((32 / bits) as usize);
                let words: Vec<i32> = (0..len)
                    .map(|_| {
                        let word = next_word() as u32;
                        match bits {
                            16 => (word & !0x4000_4000) as i32,
                            _ => word as i32,
                        }
                    })
                    .collect();
                FieldWords {
                    words: Tensor::from_data(TensorData::new(words, [len]), device),
                    count,
                }
            })
            .collect();
        let tables = format
            .table_lens(values)
            .into_iter()
            .map(|len| Tensor::random([len], Distribution::Normal(0.0, 1.0), device))
            .collect();
        Self {
            format,
            shape,
            fields,
            tables,
        }
    }

    /// Panics unless the fields and tables are what the format needs for the shape.
    pub fn check(&self) {
        let values = self.shape[0] * self.shape[1];
        let format = self.format;
        let counts: Vec<usize> = self.fields.iter().map(|f| f.count).collect();
        assert_eq!(
            counts,
            format.field_counts(values),
            "{format:?} fields for {:?}",
            self.shape
        );
        for (field, bits) in self.fields.iter().zip(format.field_bits()) {
            let words = field.count.div_ceil((32 / bits) as usize);
            assert_eq!(field.words.dims()[0], words, "{format:?} words of a field");
        }
        let lens: Vec<usize> = self.tables.iter().map(|t| t.dims()[0]).collect();
        assert_eq!(lens, format.table_lens(values), "{format:?} tables");
    }
}

/// The weight `[rows, cols]` in `dtype` (no gradient: quantized weights are frozen). Panics
/// unless `blocks` holds what its format needs ([`PackedBlocks::check`]).
pub fn dequantize<B: DequantizeBackend>(blocks: PackedBlocks<B>, dtype: DType) -> Tensor<B, 2> {
    blocks.check();
    Tensor::from_primitive(TensorPrimitive::Float(B::lemo_dequantize(blocks, dtype)))
}
