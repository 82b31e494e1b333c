//! Parity of the dequantize kernel (wgpu, f32) with its plain Burn reference
//! (`dequantize::reference`) for every format, on random packed words and tables: weights of
//! whole blocks, and weights whose last block is partial (padding past the values, as NF4's
//! layout has), through the backend and through `Autodiff`.

use burn::backend::Autodiff;
use burn::tensor::{DType, Int, Tensor, TensorData};
use lemo_kernels::WgpuBackend;
use lemo_kernels::dequantize::{self, BlockFormat, FieldWords, PackedBlocks, reference};
use lemo_test_support::{HostRng, assert_close, random, seed_backend as seed};

type B = WgpuBackend;

const FORMATS: [BlockFormat; 6] = [
    BlockFormat::Q4_0,
    BlockFormat::Q4_1,
    BlockFormat::Q8_0,
    BlockFormat::Q4_K,
    BlockFormat::Q6_K,
    BlockFormat::Nf4,
];

/// The kernel may contract `a * b + c` into one rounding (Q4_1, Q4_K, NF4's block maxima); the
/// reference's separate operations round twice.
const TOLERANCE: f32 = 1e-6;

/// Random bits of a finite IEEE half (the f16 scales of real blocks are finite).
fn finite_f16(rng: &mut HostRng) -> u32 {
    let bits = rng.next_u64() as u32 & 0xffff;
    // Exponent 31 is infinity or NaN: clear its top bit.
    if (bits >> 10) & 31 == 31 {
        bits & !(1 << 14)
    } else {
        bits
    }
}

/// `count` values of `bits` bits packed from the low bits of each word up, the rest of the last
/// word random (what the decoder must ignore).
fn pack(bits: u32, count: usize, mut value: impl FnMut() -> u32, rng: &mut HostRng) -> Vec<i32> {
    let per_word = (32 / bits) as usize;
    let mask = ((1u64 << bits) - 1) as u32;
    let mut words: Vec<u32> = (0..count.div_ceil(per_word))
        .map(|_| rng.next_u64() as u32)
        .collect();
    for i in 0..count {
        let shift = (i % per_word) as u32 * bits;
        let word = &mut words[i / per_word];
        *word = (*word & !(mask << shift)) | ((value() & mask) << shift);
    }
    words.into_iter().map(|w| w as i32).collect()
}

/// A random `[rows, cols]` weight of `format`: random codes, finite f16 scales, random tables.
fn random_blocks(format: BlockFormat, shape: [usize; 2], rng: &mut HostRng) -> PackedBlocks<B> {
    let device = Default::default();
    let values = shape[0] * shape[1];
    let fields = format
        .field_bits()
        .iter()
        .zip(format.field_counts(values))
        .map(|(&bits, count)| {
            let words = if bits == 16 {
                let mut halves = HostRng::new(rng.next_u64());
                pack(bits, count, || finite_f16(&mut halves), rng)
            } else {
                let mut codes = HostRng::new(rng.next_u64());
                pack(bits, count, || codes.next_u64() as u32, rng)
            };
            let len = words.len();
            FieldWords {
                words: Tensor::<B, 1, Int>::from_data(TensorData::new(words, [len]), &device),
                count,
            }
        })
        .collect();
    let tables = format
        .table_lens(values)
        .into_iter()
        .map(|len| random([len], &device))
        .collect();
    PackedBlocks {
        format,
        shape,
        fields,
        tables,
    }
}

/// The kernel against the reference for every format on `shape`, directly and under autodiff.
fn kernel_matches_reference(shape: [usize; 2]) {
    let device = Default::default();
    let mut rng = HostRng::new(seed::<B>(&device));
    for format in FORMATS {
        let blocks = random_blocks(format, shape, &mut rng);
        let expected = reference::dequantize(&blocks, DType::F32);
        let name = format!("{format:?} {shape:?}");
        let ours = dequantize::dequantize(blocks.clone(), DType::F32);
        assert_eq!(ours.dtype(), DType::F32);
        assert_close(&name, ours, expected.clone(), TOLERANCE);
        let tracked = PackedBlocks::<Autodiff<B>> {
            format,
            shape,
            fields: blocks
                .fields
                .iter()
                .map(|f| FieldWords {
                    words: Tensor::from_inner(f.words.clone()),
                    count: f.count,
                })
                .collect(),
            tables: blocks
                .tables
                .iter()
                .cloned()
                .map(Tensor::from_inner)
                .collect(),
        };
        let through_autodiff = dequantize::dequantize(tracked, DType::F32).inner();
        assert_close(
            &format!("{name} under autodiff"),
            through_autodiff,
            expected,
            TOLERANCE,
        );
    }
}

/// Whole blocks of every format (512 values a row: two super-blocks, eight NF4 blocks).
#[test]
fn dequantize_whole_blocks_matches_reference() {
    kernel_matches_reference([6, 512]);
}

/// 3 x 100 values: the last block of every format is partial, so the fields hold codes past
/// the weight (and NF4's block maxima are padded to a whole block of 256); 45 values: an odd
/// count, one value a thread.
#[test]
fn dequantize_partial_last_block_matches_reference() {
    kernel_matches_reference([3, 100]);
    kernel_matches_reference([1, 45]);
}

/// More NF4 block maxima than one second-level block: several `absmax2` scales.
#[test]
fn dequantize_nf4_several_second_level_blocks_matches_reference() {
    let device = Default::default();
    let mut rng = HostRng::new(seed::<B>(&device));
    let shape = [130, 300];
    let blocks = random_blocks(BlockFormat::Nf4, shape, &mut rng);
    assert!(blocks.tables[2].dims()[0] > 1);
    let expected = reference::dequantize(&blocks, DType::F32);
    let ours = dequantize::dequantize(blocks, DType::F32);
    assert_close("NF4 [130, 300]", ours, expected, TOLERANCE);
}

/// A weight without the fields its format needs is refused before any kernel runs.
#[test]
#[should_panic(expected = "fields")]
fn dequantize_rejects_missing_fields() {
    let device = Default::default();
    let mut rng = HostRng::new(seed::<B>(&device));
    let mut blocks = random_blocks(BlockFormat::Q4_1, [2, 64], &mut rng);
    blocks.fields.pop();
    dequantize::dequantize(blocks, DType::F32);
}
