//! Packed weights of every dequantize format for the parity checks of `compute_bench`: random
//! codes and finite f16 scales from a fixed generator, random tables.

use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor, TensorData};
use lemo_kernels::dequantize::{BlockFormat, FieldWords, PackedBlocks};

pub const FORMATS: [BlockFormat; 6] = [
    BlockFormat::Q4_0,
    BlockFormat::Q4_1,
    BlockFormat::Q8_0,
    BlockFormat::Q4_K,
    BlockFormat::Q6_K,
    BlockFormat::Nf4,
];

/// `format`'s fields and tables for a `shape` weight, the words drawn from `seed`.
pub fn random_blocks<B: Backend>(
    format: BlockFormat,
    shape: [usize; 2],
    seed: u64,
    device: &B::Device,
) -> PackedBlocks<B> {
    let mut state = seed;
    // SplitMix64.
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) as u32
    };
    let values = shape[0] * shape[1];
    let fields = format
        .field_bits()
        .iter()
        .zip(format.field_counts(values))
        .map(|(&bits, count)| {
            let len = count.div_ceil((32 / bits) as usize);
            let words: Vec<i32> = (0..len)
                .map(|_| {
                    // Bit 14 of each half cleared: f16 exponents below 16, finite scales.
                    let word = next();
                    (if bits == 16 {
                        word & !0x4000_4000
                    } else {
                        word
                    }) as i32
                })
                .collect();
            FieldWords {
                words: Tensor::<B, 1, Int>::from_data(TensorData::new(words, [len]), device),
                count,
            }
        })
        .collect();
    let tables = format
        .table_lens(values)
        .into_iter()
        .map(|len| Tensor::random([len], Distribution::Normal(0.0, 1.0), device))
        .collect();
    PackedBlocks {
        format,
        shape,
        fields,
        tables,
    }
}
