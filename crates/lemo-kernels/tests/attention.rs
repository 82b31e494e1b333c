//! Parity of the flash attention kernels (wgpu, f32) with the materialized reference: output,
//! logsumexp and the three gradients, on fresh random inputs every run (the seed is printed and
//! can be set with `LEMO_TEST_SEED`).

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use lemo_kernels::attention::{self, AttentionOptions, reference, shifted_fold};
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

/// The attention under test: the public entry points (the backend's kernels), or S2 attention
/// folded into causal attention over its groups (the way the fused path runs it).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    Dispatch,
    Folded,
}

impl Path {
    fn with_lse<B: LemoBackend>(
        self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        options: AttentionOptions,
    ) -> (Tensor<B, 4>, Tensor<B, 3>) {
        match self {
            Path::Dispatch => attention::attention_with_lse(q, k, v, options),
            Path::Folded => shifted_fold::attention_with_lse(q, k, v, options).expect("folds"),
        }
    }

    fn output<B: LemoBackend>(
        self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        options: AttentionOptions,
    ) -> Tensor<B, 4> {
        match self {
            Path::Dispatch => attention::attention(q, k, v, options),
            Path::Folded => shifted_fold::attention(q, k, v, options).expect("folds"),
        }
    }
}

/// Forward, lse and (when `gradients`) dq, dk, dv of `attention` on backend `B` against the
/// reference differentiated by Burn's autodiff.
fn check<B: LemoBackend>(case: Case, options: AttentionOptions, gradients: bool) {
    check_path::<B>(case, options, gradients, Path::Dispatch);
}

/// [`check`] of `path`; the folded path also back-propagates a known output (the reference's
/// output and lse), and computes the backward pass from it, as the reference backward does.
fn check_path<B: LemoBackend>(case: Case, options: AttentionOptions, gradients: bool, path: Path) {
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

    let (out, lse) = path.with_lse(q.clone(), k.clone(), v.clone(), options);
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
            path.output(q.clone(), k.clone(), v.clone(), options)
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
    if path == Path::Folded {
        let leaf = |t: &Tensor<B, 4>| Tensor::<A<B>, 4>::from_inner(t.clone()).require_grad();
        let (q_leaf, k_leaf, v_leaf) = (leaf(&q), leaf(&k), leaf(&v));
        let known = (
            Tensor::from_inner(expected_out.clone()),
            Tensor::from_inner(expected_lse.clone()),
        );
        let value = shifted_fold::attention_with_value(
            q_leaf.clone(),
            k_leaf.clone(),
            v_leaf.clone(),
            known,
            options,
        )
        .expect("folds");
        assert_close("known value", value.clone().inner(), expected_out.clone());
        let grads = (value * Tensor::from_inner(weights.clone()))
            .sum()
            .backward();
        let (dq, dk, dv) = reference::attention_backward(
            q.clone(),
            k.clone(),
            v.clone(),
            expected_out.clone(),
            expected_lse.clone(),
            weights.clone(),
            options,
        );
        assert_close("known dq", q_leaf.grad(&grads).unwrap(), dq.clone());
        assert_close("known dk", k_leaf.grad(&grads).unwrap(), dk.clone());
        assert_close("known dv", v_leaf.grad(&grads).unwrap(), dv.clone());
        let (out, lse) = (expected_out, expected_lse);
        let (fq, fk, fv) =
            shifted_fold::attention_backward(q, k, v, out, lse, weights, options).expect("folds");
        assert_close("folded backward dq", fq, dq);
        assert_close("folded backward dk", fk, dk);
        assert_close("folded backward dv", fv, dv);
    }
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

/// S2 folded into causal attention over its groups: MHA with short last groups in both halves
/// (46 tokens in groups of 8: the unshifted half ends with 6, the shifted one starts with 4 and
/// ends with 2), on the reference backend.
#[test]
fn folded_shifted_groups_mha_cpu() {
    let options = AttentionOptions::causal(16).with_shifted_groups(8);
    let case = Case::self_attention(2, 4, 4, 46, 16);
    check_path::<CpuBackend>(case, options, true, Path::Folded);
}

/// GQA (3 query heads per K/V head, one K/V head per half) on a length of whole groups, where
/// the shifted half's two partial groups run batched.
#[test]
fn folded_shifted_groups_gqa_cpu() {
    let options = AttentionOptions::causal(16).with_shifted_groups(8);
    let case = Case::self_attention(1, 6, 2, 40, 16);
    check_path::<CpuBackend>(case, options, true, Path::Folded);
}

/// The fold on the kernels of the wgpu backend, GQA with a short last group.
#[test]
fn folded_shifted_groups_wgpu() {
    let options = AttentionOptions::causal(32).with_shifted_groups(16);
    let case = Case::self_attention(1, 4, 2, 56, 32);
    check_path::<WgpuBackend>(case, options, true, Path::Folded);
}

/// Where a K/V head serves query heads of both halves, or with a sliding window, the fold does
/// not apply (the S2 kernels run instead).
#[test]
fn fold_declines_shared_kv_heads_and_windows() {
    type B = CpuBackend;
    let device = Default::default();
    let tensor = |heads| Tensor::<B, 4>::zeros([1, heads, 16, 8], &device);
    let options = AttentionOptions::causal(8).with_shifted_groups(8);
    let shared = shifted_fold::attention(tensor(3), tensor(1), tensor(1), options);
    assert!(shared.is_none(), "3 query heads on one K/V head");
    let windowed = options.with_sliding_window(4);
    assert!(shifted_fold::attention(tensor(2), tensor(2), tensor(2), windowed).is_none());
    assert!(
        shifted_fold::attention(tensor(2), tensor(1), tensor(1), options).is_none(),
        "2 query heads on one K/V head"
    );
    let folded = shifted_fold::attention(tensor(4), tensor(2), tensor(2), options);
    assert!(
        folded.is_some(),
        "4 query heads on 2 K/V heads: one per half"
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
