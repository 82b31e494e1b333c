//! Parity of the block-informativeness kernel (wgpu, f32) with the materialized reference.

use lemo_kernels::WgpuBackend;
use lemo_kernels::block_scores::{self, reference};
use lemo_test_support::{assert_close, random, seed_backend as seed};

fn check(batch: usize, q_heads: usize, kv_heads: usize, seq: usize, head_dim: usize, block: usize) {
    let device = Default::default();
    seed::<WgpuBackend>(&device);
    let q = random::<WgpuBackend, 4>([batch, q_heads, seq, head_dim], &device);
    let k = random::<WgpuBackend, 4>([batch, kv_heads, seq, head_dim], &device);
    let scores = block_scores::block_scores(q.clone(), k.clone(), block);
    let scale = (head_dim as f32).powf(-0.5);
    let expected = reference::block_scores(q.clone(), k.clone(), block, scale);
    let blocks = seq.div_ceil(block);
    assert_eq!(scores.dims(), [batch, blocks, blocks]);
    assert_close("block scores", scores, expected.clone(), 1e-5);
    // The GEMM strips of the tensor-core path, forced into strips of one or two blocks.
    let strip_bytes = batch * q_heads * seq * 4 * block;
    let strips = block_scores::chunked::block_scores_in_strips(
        q.clone(),
        k.clone(),
        block,
        scale,
        strip_bytes,
    );
    assert_close("block scores in GEMM strips", strips, expected, 1e-5);
}

#[test]
fn block_64_partial_last_block() {
    check(2, 2, 2, 150, 32, 64);
}

#[test]
fn block_128_grouped_query() {
    check(1, 4, 2, 200, 64, 128);
}
