//! Attention split across simulated ranks as a ring computes it
//! (`lemo_kernels::attention::ring`) against causal attention over the whole sequence: each
//! rank's output rows, and the gradients of every query, key and value, on the CPU in f32 with
//! fresh random inputs every run (the seed is printed and can be set with `LEMO_TEST_SEED`).

use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor, TensorData};
use lemo_kernels::CpuBackend;
use lemo_kernels::attention::ring::{RankSlice, ring_attention, zigzag_positions};
use lemo_kernels::attention::{AttentionOptions, reference};
use lemo_test_support::{assert_close, random, seed_backend as seed};

type B = Autodiff<CpuBackend>;

const TOLERANCE: f32 = 1e-5;

fn rows(tensor: &Tensor<B, 4>, positions: &[usize]) -> Tensor<B, 4> {
    let indices: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
    let indices = Tensor::<B, 1, Int>::from_data(
        TensorData::new(indices, [positions.len()]),
        &tensor.device(),
    );
    tensor.clone().select(2, indices)
}

/// Context parallel 1, 2 and 4 with grouped-query heads: every rank's rows equal the whole
/// sequence's causal attention, and so do the gradients of the whole sequence's q, k and v.
#[test]
fn ring_attention_over_ranks_is_causal_attention_over_the_sequence() {
    let device = Default::default();
    seed::<B>(&device);
    let (batch, q_heads, kv_heads, seq, head_dim) = (2, 4, 2, 48, 8);
    let options = AttentionOptions::causal(head_dim);
    for ranks in [1, 2, 4] {
        let leaf = |heads| random::<B, 4>([batch, heads, seq, head_dim], &device).require_grad();
        let (q, k, v) = (leaf(q_heads), leaf(kv_heads), leaf(kv_heads));
        let grad_out = random::<B, 4>([batch, q_heads, seq, head_dim], &device);

        let whole = reference::attention(q.clone(), k.clone(), v.clone(), options);
        let positions = zigzag_positions(seq, ranks);
        let slices: Vec<RankSlice<B>> = positions
            .iter()
            .map(|p| RankSlice {
                q: rows(&q, p),
                k: rows(&k, p),
                v: rows(&v, p),
                positions: p.clone(),
            })
            .collect();
        let outputs = ring_attention(&slices, options.scale);
        let mut ring_loss = Tensor::<B, 1>::zeros([1], &device);
        for (rank, (out, p)) in outputs.into_iter().zip(&positions).enumerate() {
            assert_close(
                &format!("{ranks} ranks: rank {rank}'s output"),
                out.clone(),
                rows(&whole, p),
                TOLERANCE,
            );
            ring_loss = ring_loss + (out * rows(&grad_out, p)).sum();
        }
        let ring = ring_loss.backward();
        let plain = (whole * grad_out).sum().backward();
        for (name, leaf) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            assert_close(
                &format!("{ranks} ranks: {name}"),
                leaf.grad(&ring).unwrap(),
                leaf.grad(&plain).unwrap(),
                10.0 * TOLERANCE,
            );
        }
    }
}

/// The zig-zag split gives every rank every position once overall and as many causal
/// query-key pairs as any other rank.
#[test]
fn the_zigzag_split_balances_causal_work() {
    for ranks in [1, 2, 3, 4, 8] {
        let seq = 2 * ranks * 5;
        let positions = zigzag_positions(seq, ranks);
        let mut all: Vec<usize> = positions.concat();
        all.sort_unstable();
        assert_eq!(all, (0..seq).collect::<Vec<_>>());
        let pairs: Vec<usize> = positions
            .iter()
            .map(|p| p.iter().map(|&position| position + 1).sum())
            .collect();
        assert!(
            pairs.iter().all(|&n| n == pairs[0]),
            "{ranks} ranks: {pairs:?}"
        );
    }
}
