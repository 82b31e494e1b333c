//! Parity of the dequantize kernel (wgpu, f32) with its plain Burn reference
//! (`dequantize::reference`) for every format, on random packed words and tables: weights of
//! whole blocks, and weights whose last block is partial (padding past the values, as NF4's
//! layout has), through the backend and through `Autodiff`.

use burn::backend::Autodiff;
use burn::tensor::{DType, Tensor};
use lemo_kernels::WgpuBackend;
use lemo_kernels::dequantize::{self, BlockFormat, FieldWords, PackedBlocks, reference};
use lemo_test_support::{HostRng, assert_close, seed_backend as seed};

type B = WgpuBackend;

/// The kernel may contract `a * b + c` into one rounding (Q4_1, Q4_K, NF4's block maxima); the
/// reference's separate operations round twice.
const TOLERANCE: f32 = 1e-6;

/// The kernel against the reference for every format on `shape`, directly and under autodiff.
fn kernel_matches_reference(shape: [usize; 2]) {
    let device = Default::default();
    let mut rng = HostRng::new(seed::<B>(&device));
    for format in BlockFormat::ALL {
        let blocks = PackedBlocks::<B>::random(format, shape, || rng.next_u64(), &device);
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
    let blocks = PackedBlocks::<B>::random(BlockFormat::Nf4, shape, || rng.next_u64(), &device);
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
    let mut blocks =
        PackedBlocks::<B>::random(BlockFormat::Q4_1, [2, 64], || rng.next_u64(), &device);
    blocks.fields.pop();
    dequantize::dequantize(blocks, DType::F32);
}
