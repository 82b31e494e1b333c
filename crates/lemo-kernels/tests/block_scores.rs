//! Parity of the block-informativeness kernel (wgpu, f32) with the materialized reference, exact
//! and over sampled query rows, for queries over as many keys and for the last rows of more.

use burn::tensor::Tensor;
use lemo_kernels::WgpuBackend;
use lemo_kernels::block_scores::{self, reference};
use lemo_test_support::{assert_close, random, seed_backend as seed};

type B = WgpuBackend;

fn inputs(
    batch: usize,
    q_heads: usize,
    kv_heads: usize,
    seq: usize,
    head_dim: usize,
) -> [Tensor<B, 4>; 2] {
    let device = Default::default();
    seed::<B>(&device);
    [
        random::<B, 4>([batch, q_heads, seq, head_dim], &device),
        random::<B, 4>([batch, kv_heads, seq, head_dim], &device),
    ]
}

fn check(batch: usize, q_heads: usize, kv_heads: usize, seq: usize, head_dim: usize, block: usize) {
    let [q, k] = inputs(batch, q_heads, kv_heads, seq, head_dim);
    let scores = block_scores::block_scores(q.clone(), k.clone(), block, 1);
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

/// Sampled scores against their definition, reduced here from the reference's per-pair head
/// means (blocks of one token): the largest visible pair of each block pair among the query
/// rows `s - 1, 2 s - 1, ...` alone.
#[test]
fn sampled_query_rows_give_the_largest_pair_among_the_rows_read() {
    let (batch, seq, block, stride) = (2, 150, 32, 4);
    let [q, k] = inputs(batch, 4, 2, seq, 32);
    let scale = 32f32.powf(-0.5);
    let pairs: Vec<f32> = reference::block_scores(q.clone(), k.clone(), 1, scale)
        .into_data()
        .to_vec()
        .unwrap();
    let blocks = seq.div_ceil(block);
    let mut expected = vec![0.0f32; batch * blocks * blocks];
    for b in 0..batch {
        for row in block_scores::sampled_query_rows(seq, stride) {
            for key in 0..=row {
                let entry = &mut expected[(b * blocks + row / block) * blocks + key / block];
                *entry = entry.max(pairs[(b * seq + row) * seq + key]);
            }
        }
    }
    let expected = Tensor::<B, 1>::from_floats(expected.as_slice(), &q.device())
        .reshape([batch, blocks, blocks]);
    let sampled = block_scores::block_scores(q, k, block, stride);
    assert_close("sampled block scores", sampled, expected, 1e-5);
}

/// Queries that are the last rows of the keys, from a block boundary (a rank's chunk of a split
/// sequence): their rows of the whole sequence's scores, from the kernel, the GEMM strips and
/// the reference alike, exact and sampled.
#[test]
fn queries_after_an_offset_score_their_rows_of_the_whole_matrix() {
    let (batch, block) = (2, 32);
    let [q, k] = inputs(batch, 4, 2, 192, 32);
    let scale = 32f32.powf(-0.5);
    for (from, to) in [(64, 192), (96, 170), (0, 100)] {
        let (queries, keys) = (
            q.clone().narrow(2, from, to - from),
            k.clone().narrow(2, 0, to),
        );
        let rows = from / block..(to - from).div_ceil(block) + from / block;
        let whole_rows = |q: Tensor<B, 4>| {
            reference::block_scores(q.narrow(2, 0, to), keys.clone(), block, scale)
                .slice([0..batch, rows.clone()])
        };
        let expected = whole_rows(q.clone());
        let name = |what: &str| format!("{what}, queries {from}..{to}");
        let kernel = block_scores::block_scores(queries.clone(), keys.clone(), block, 1);
        assert_close(&name("kernel"), kernel, expected.clone(), 1e-5);
        let strip_bytes = batch * 4 * to * 4 * block;
        let strips = block_scores::chunked::block_scores_in_strips(
            queries.clone(),
            keys.clone(),
            block,
            scale,
            strip_bytes,
        );
        assert_close(&name("GEMM strips"), strips, expected.clone(), 1e-5);
        let direct = reference::block_scores(queries.clone(), keys.clone(), block, scale);
        assert_close(&name("reference"), direct, expected, 1e-5);
        let sampled = block_scores::block_scores(queries, keys.clone(), block, 4);
        let expected = whole_rows(block_scores::only_sampled_query_rows(q.clone(), 4));
        assert_close(&name("sampled"), sampled, expected, 1e-5);
    }
}

#[test]
fn sampled_query_rows_end_every_group_of_the_stride() {
    let rows: Vec<usize> = block_scores::sampled_query_rows(10, 4).collect();
    assert_eq!(rows, [3, 7]);
    let every: Vec<usize> = block_scores::sampled_query_rows(3, 1).collect();
    assert_eq!(every, [0, 1, 2]);
}
