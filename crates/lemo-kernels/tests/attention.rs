//! Parity of the flash attention kernels (wgpu, f32) with the materialized reference: output,
//! logsumexp and the three gradients, on fresh random inputs every run (the seed is printed and
//! can be set with `LEMO_TEST_SEED`).

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use lemo_kernels::attention::{self, AttentionOptions, reference};
use lemo_kernels::{CpuBackend, LemoBackend, WgpuBackend};
use lemo_test_support::{random, seed_backend as seed};

const TOLERANCE: f32 = 1e-4;

#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    q_heads: usize,
    kv_heads: usize,
    q_len: usize,
    kv_len: usize,
    head_dim: usize,
}

impl Case {
    fn self_attention(
        batch: usize,
        q_heads: usize,
        kv_heads: usize,
        seq: usize,
        head_dim: usize,
    ) -> Self {
        Self {
            batch,
            q_heads,
            kv_heads,
            q_len: seq,
            kv_len: seq,
            head_dim,
        }
    }
}

fn assert_close<B: Backend, const D: usize>(
    what: &str,
    actual: Tensor<B, D>,
    expected: Tensor<B, D>,
) {
    lemo_test_support::assert_close(what, actual, expected, TOLERANCE);
}

/// Forward, lse and (when `gradients`) dq, dk, dv of `attention` on backend `B` against the
/// reference differentiated by Burn's autodiff.
fn check<B: LemoBackend>(case: Case, options: AttentionOptions, gradients: bool) {
    type A<B> = Autodiff<B>;
    let device = Default::default();
    seed::<B>(&device);
    let q = random::<B, 4>(
        [case.batch, case.q_heads, case.q_len, case.head_dim],
        &device,
    );
    let k = random::<B, 4>(
        [case.batch, case.kv_heads, case.kv_len, case.head_dim],
        &device,
    );
    let v = random::<B, 4>(
        [case.batch, case.kv_heads, case.kv_len, case.head_dim],
        &device,
    );
    let weights = random::<B, 4>(
        [case.batch, case.q_heads, case.q_len, case.head_dim],
        &device,
    );

    let (out, lse) = attention::attention_with_lse(q.clone(), k.clone(), v.clone(), options);
    let (expected_out, expected_lse) =
        reference::attention_with_lse(q.clone(), k.clone(), v.clone(), options);
    assert_close("output", out, expected_out.clone());
    assert_close("lse", lse, expected_lse.clone());
    if !gradients {
        return;
    }

    let grads_of = |flash: bool| {
        let q = Tensor::<A<B>, 4>::from_inner(q.clone()).require_grad();
        let k = Tensor::<A<B>, 4>::from_inner(k.clone()).require_grad();
        let v = Tensor::<A<B>, 4>::from_inner(v.clone()).require_grad();
        let out = if flash {
            attention::attention(q.clone(), k.clone(), v.clone(), options)
        } else {
            reference::attention(q.clone(), k.clone(), v.clone(), options)
        };
        let grads = (out * Tensor::from_inner(weights.clone())).sum().backward();
        [
            q.grad(&grads).unwrap(),
            k.grad(&grads).unwrap(),
            v.grad(&grads).unwrap(),
        ]
    };
    let [dq, dk, dv] = grads_of(true);
    let [expected_dq, expected_dk, expected_dv] = grads_of(false);
    assert_close("dq", dq, expected_dq);
    assert_close("dk", dk, expected_dk);
    assert_close("dv", dv, expected_dv);
}

#[test]
fn causal_batch2_dim64_ragged_tiles() {
    check::<WgpuBackend>(
        Case::self_attention(2, 2, 2, 45, 64),
        AttentionOptions::causal(64),
        true,
    );
}

#[test]
fn grouped_query_dim32() {
    check::<WgpuBackend>(
        Case::self_attention(1, 6, 2, 70, 32),
        AttentionOptions::causal(32),
        true,
    );
}

#[test]
fn head_dim_128() {
    check::<WgpuBackend>(
        Case::self_attention(1, 2, 1, 33, 128),
        AttentionOptions::causal(128),
        true,
    );
}

#[test]
fn sliding_window() {
    let options = AttentionOptions::causal(64).with_sliding_window(13);
    check::<WgpuBackend>(Case::self_attention(1, 4, 2, 81, 64), options, true);
}

#[test]
fn shifted_sparse_groups() {
    let options = AttentionOptions::causal(32).with_shifted_groups(16);
    check::<WgpuBackend>(Case::self_attention(2, 4, 2, 75, 32), options, true);
}

#[test]
fn shifted_sparse_groups_with_window() {
    let options = AttentionOptions::causal(32)
        .with_shifted_groups(20)
        .with_sliding_window(7);
    check::<WgpuBackend>(Case::self_attention(1, 2, 1, 50, 32), options, true);
}

#[test]
fn decode_with_kv_cache() {
    let case = Case {
        batch: 2,
        q_heads: 4,
        kv_heads: 2,
        q_len: 3,
        kv_len: 58,
        head_dim: 64,
    };
    check::<WgpuBackend>(case, AttentionOptions::causal(64), true);
    let single = Case { q_len: 1, ..case };
    check::<WgpuBackend>(
        single,
        AttentionOptions::causal(64).with_sliding_window(10),
        false,
    );
}

/// Backends without kernels differentiate through the materialized backward formulas.
#[test]
fn reference_backward_on_cpu() {
    let options = AttentionOptions::causal(16).with_shifted_groups(8);
    check::<CpuBackend>(Case::self_attention(2, 4, 2, 21, 16), options, true);
}

/// The models hand over `[batch, seq, heads, dim]` projections with heads and sequence swapped:
/// the kernels read through the strides instead of copying.
#[test]
fn strided_inputs() {
    let device = Default::default();
    seed::<WgpuBackend>(&device);
    let projection = |heads| random::<WgpuBackend, 4>([2, 40, heads, 32], &device).swap_dims(1, 2);
    let (q, k, v) = (projection(4), projection(2), projection(2));
    let options = AttentionOptions::causal(32);
    let out = attention::attention(q.clone(), k.clone(), v.clone(), options);
    assert_close("output", out, reference::attention(q, k, v, options));
}

/// Attention with a known output on kept rows, given the output and logsumexp of attention over
/// every row, back-propagates as the reference backward from those: dense attention's gradient
/// restricted to the kept queries and keys (what a token-sparse block trains with).
#[test]
fn known_output_of_kept_rows_back_propagates_with_the_full_logsumexp() {
    type B = WgpuBackend;
    let device = Default::default();
    seed::<B>(&device);
    let (heads, kv_heads, seq, dim) = (4, 2, 48, 32);
    let q = random::<B, 4>([1, heads, seq, dim], &device);
    let k = random::<B, 4>([1, kv_heads, seq, dim], &device);
    let v = random::<B, 4>([1, kv_heads, seq, dim], &device);
    let options = AttentionOptions::causal(dim);
    let (out, lse) = attention::attention_with_lse(q.clone(), k.clone(), v.clone(), options);
    let kept: Vec<i32> = (0..16).chain(32..48).collect();
    let rows = Tensor::<B, 1, burn::tensor::Int>::from_ints(kept.as_slice(), &device);
    let pick = |t: Tensor<B, 4>| t.select(2, rows.clone());
    let (q, k, v, out) = (pick(q), pick(k), pick(v), pick(out));
    let lse = lse.select(2, rows.clone());
    let weights = random::<B, 4>([1, heads, kept.len(), dim], &device);

    let leaf = |t: Tensor<B, 4>| Tensor::<Autodiff<B>, 4>::from_inner(t).require_grad();
    let (q_leaf, k_leaf, v_leaf) = (leaf(q.clone()), leaf(k.clone()), leaf(v.clone()));
    let known = (
        Tensor::from_inner(out.clone()),
        Tensor::from_inner(lse.clone()),
    );
    let value = attention::attention_with_value(
        q_leaf.clone(),
        k_leaf.clone(),
        v_leaf.clone(),
        known,
        options,
    );
    assert_close("value", value.clone().inner(), out.clone());
    let grads = (value * Tensor::from_inner(weights.clone()))
        .sum()
        .backward();
    let (dq, dk, dv) = reference::attention_backward(q, k, v, out, lse, weights, options);
    assert_close("dq", q_leaf.grad(&grads).unwrap(), dq);
    assert_close("dk", k_leaf.grad(&grads).unwrap(), dk);
    assert_close("dv", v_leaf.grad(&grads).unwrap(), dv);
}

/// Attention made of independent pieces, with its output known, back-propagates as the
/// reference attention of each piece on its slices, differentiated by autodiff; its value is
/// the known output itself. Pieces of two sequences, of both halves of the query heads (each
/// reading its own key/value head) and of runs of rows.
#[test]
fn attention_pieces_back_propagate_each_piece() {
    type B = CpuBackend;
    type A = Autodiff<B>;
    let device = Default::default();
    seed::<A>(&device);
    let (heads, kv_heads, rows, dim) = (4, 2, 12, 8);
    let options = AttentionOptions::causal(dim);
    let piece = |sequence, heads, rows| attention::AttentionPiece {
        sequence,
        heads,
        rows,
    };
    let pieces = vec![
        piece(0, 0..2, 0..5),
        piece(0, 0..2, 5..12),
        piece(0, 2..4, 0..8),
        piece(0, 2..4, 8..12),
        piece(1, 0..4, 0..12),
    ];
    let leaf = |heads| random::<A, 4>([2, heads, rows, dim], &device).require_grad();
    let (q, k, v) = (leaf(heads), leaf(kv_heads), leaf(kv_heads));
    let upstream = random::<A, 4>([2, heads, rows, dim], &device);
    let slices = |piece: &attention::AttentionPiece| {
        let sequence = piece.sequence..piece.sequence + 1;
        let kv = piece.heads.start / 2..piece.heads.end / 2;
        (
            [sequence.clone(), piece.heads.clone(), piece.rows.clone()],
            [sequence, kv, piece.rows.clone()],
        )
    };
    // The reference: each piece's attention on its slices, summed against the upstream slices.
    let mut expected_loss = Tensor::<A, 1>::zeros([1], &device);
    let mut out = q.zeros_like().inner();
    let mut lse = out.clone().sum_dim(3).squeeze_dim::<3>(3);
    for piece in &pieces {
        let (query, key) = slices(piece);
        let (q, k, v) = (
            q.clone().slice(query.clone()),
            k.clone().slice(key.clone()),
            v.clone().slice(key),
        );
        let (piece_out, piece_lse) = attention::attention_with_lse(
            q.clone().inner(),
            k.clone().inner(),
            v.clone().inner(),
            options,
        );
        out = out.slice_assign(query.clone(), piece_out);
        lse = lse.slice_assign(query.clone(), piece_lse);
        let value = reference::attention(q, k, v, options);
        expected_loss = expected_loss + (value * upstream.clone().slice(query)).sum();
    }
    let expected = expected_loss.backward();

    let tested = attention::attention_pieces_with_value(
        q.clone(),
        k.clone(),
        v.clone(),
        (Tensor::from_inner(out.clone()), Tensor::from_inner(lse)),
        pieces,
        options,
    );
    assert_close("value", tested.clone().inner(), out);
    let grads = (tested * upstream).sum().backward();
    for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
        let (actual, expected) = (x.grad(&grads), x.grad(&expected));
        assert_close(name, actual.unwrap(), expected.unwrap());
    }
}
