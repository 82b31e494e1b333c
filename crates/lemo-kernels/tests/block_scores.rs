//! Parity of the block-informativeness kernel (wgpu, f32) with the materialized reference.

use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use lemo_kernels::WgpuBackend;
use lemo_kernels::block_scores::{self, reference};

fn check(batch: usize, q_heads: usize, kv_heads: usize, seq: usize, head_dim: usize, block: usize) {
    let device = Default::default();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    println!("seed {seed}");
    WgpuBackend::seed(&device, seed);
    let q = Tensor::<WgpuBackend, 4>::random(
        [batch, q_heads, seq, head_dim],
        Distribution::Normal(0.0, 1.0),
        &device,
    );
    let k = Tensor::<WgpuBackend, 4>::random(
        [batch, kv_heads, seq, head_dim],
        Distribution::Normal(0.0, 1.0),
        &device,
    );
    let scores = block_scores::block_scores(q.clone(), k.clone(), block);
    let expected = reference::block_scores(q, k, block, (head_dim as f32).powf(-0.5));
    assert_eq!(scores.dims(), expected.dims());
    let blocks = seq.div_ceil(block);
    assert_eq!(scores.dims(), [batch, blocks, blocks]);
    let scale: f32 = expected.clone().max().into_scalar();
    let error: f32 = (scores.clone() - expected.clone())
        .abs()
        .max()
        .into_scalar();
    assert!(
        error <= 1e-5 * scale,
        "block scores: error {error} vs scale {scale}"
    );
    assert!(scale > 0.0);
}

#[test]
fn block_64_partial_last_block() {
    check(2, 2, 2, 150, 32, 64);
}

#[test]
fn block_128_grouped_query() {
    check(1, 4, 2, 200, 64, 128);
}
