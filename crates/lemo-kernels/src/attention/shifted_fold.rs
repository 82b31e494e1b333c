//! LongLoRA's S2 attention ([`AttentionOptions::shifted_group`]) as plain causal attention over
//! its groups folded into the batch dimension, so a backend's fused causal attention (cuDNN on
//! CUDA) computes it, forward and backward (the folds are Burn tensor ops: autodiff
//! back-propagates through them).
//!
//! Each half of the query heads (with its half of the K/V heads) is cut into its groups: the
//! unshifted half at multiples of the group size `g`, the shifted half at `g/2 + multiples of
//! g`, so its first group holds `g/2` tokens, and either half's last group may be short.
//! Consecutive groups of one length are one run, `[batch, heads, count * len, dim] ->
//! [batch * count, heads, len, dim]`; runs of equal length (the shifted half's two partial
//! groups when the length is a multiple of `g`) are batched into one call. Causal attention over
//! a group is S2 attention there, since S2 never looks across a group boundary.
//!
//! Work: that of the groups, `O(batch * heads * len * g / 2 * head_dim)`, in two to four fused
//! calls instead of the S2 kernel's one; extra memory: the folded copies of q, k, v (those that
//! are not views), the output and, in the backward pass, their gradients, each the size of the
//! input once.

use burn::tensor::Tensor;

use super::AttentionOptions;
use crate::LemoBackend;

/// `count` consecutive groups of `len` positions from `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    start: usize,
    count: usize,
    len: usize,
}

/// The runs of groups of `len` positions cut where `(position + shift) % group == 0`.
fn runs(len: usize, group: usize, shift: usize) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    let mut start = 0;
    while start < len {
        let end = (((start + shift) / group + 1) * group - shift).min(len);
        match runs.last_mut() {
            Some(run) if run.len == end - start => run.count += 1,
            _ => runs.push(Run {
                start,
                count: 1,
                len: end - start,
            }),
        }
        start = end;
    }
    runs
}

/// One half of the heads: query heads `q_heads`, the K/V heads they read, and their S2 shift.
struct Half {
    q_heads: std::ops::Range<usize>,
    kv_heads: std::ops::Range<usize>,
    shift: usize,
}

/// The halves of `q_heads` query heads reading `kv_heads` K/V heads under S2 groups of `group`,
/// or `None` when a K/V head serves query heads of both halves (e.g. 9 query heads on 3).
fn halves(q_heads: usize, kv_heads: usize, group: usize) -> Option<Vec<Half>> {
    let per_kv = q_heads / kv_heads;
    let split = q_heads / 2;
    if !split.is_multiple_of(per_kv) {
        return None;
    }
    let kv_split = split / per_kv;
    let halves = [
        Half {
            q_heads: 0..split,
            kv_heads: 0..kv_split,
            shift: 0,
        },
        Half {
            q_heads: split..q_heads,
            kv_heads: kv_split..kv_heads,
            shift: group / 2,
        },
    ];
    Some(
        halves
            .into_iter()
            .filter(|h| !h.q_heads.is_empty())
            .collect(),
    )
}

/// Lengths of the groups the fold runs causal attention over, for a sequence of `len` tokens
/// and S2 groups of `group` (what decides whether a fused path takes every one of them).
pub fn group_lengths(len: usize, group: usize) -> Vec<usize> {
    [0, group / 2]
        .into_iter()
        .flat_map(|shift| runs(len, group, shift))
        .map(|run| run.len)
        .collect()
}

/// `[batch, heads, len, x]` -> the groups of `run`, `[batch * count, heads, run.len, x]`.
fn fold<B: LemoBackend>(t: &Tensor<B, 4>, run: Run) -> Tensor<B, 4> {
    let [batch, heads, _, x] = t.dims();
    let end = run.start + run.count * run.len;
    t.clone()
        .slice([0..batch, 0..heads, run.start..end, 0..x])
        .reshape([batch, heads, run.count, run.len, x])
        .swap_dims(1, 2)
        .reshape([batch * run.count, heads, run.len, x])
}

/// Inverse of [`fold`] for a sequence batch of `batch`.
fn unfold<B: LemoBackend>(t: Tensor<B, 4>, batch: usize) -> Tensor<B, 4> {
    let [folded, heads, len, x] = t.dims();
    let count = folded / batch;
    t.reshape([batch, count, heads, len, x])
        .swap_dims(1, 2)
        .reshape([batch, heads, count * len, x])
}

/// `f` over the groups of `runs` of every input (`[batch, heads, len, x]`, same batch and
/// length), with the groups of one length batched into one call; its outputs put back in
/// sequence order.
fn over_groups<B: LemoBackend>(
    inputs: &[Tensor<B, 4>],
    runs: &[Run],
    f: &dyn Fn(Vec<Tensor<B, 4>>) -> Vec<Tensor<B, 4>>,
) -> Vec<Tensor<B, 4>> {
    let batch = inputs[0].dims()[0];
    let mut lengths: Vec<usize> = runs.iter().map(|run| run.len).collect();
    lengths.sort_unstable();
    lengths.dedup();
    let mut pieces: Vec<Option<Vec<Tensor<B, 4>>>> = vec![None; runs.len()];
    for len in lengths {
        let members: Vec<usize> = (0..runs.len()).filter(|&i| runs[i].len == len).collect();
        let folded = inputs
            .iter()
            .map(|input| Tensor::cat(members.iter().map(|&i| fold(input, runs[i])).collect(), 0))
            .collect();
        let outputs = f(folded);
        let mut offset = 0;
        for &i in &members {
            let rows = batch * runs[i].count;
            pieces[i] = Some(
                outputs
                    .iter()
                    .map(|out| unfold(out.clone().narrow(0, offset, rows), batch))
                    .collect(),
            );
            offset += rows;
        }
    }
    let pieces: Vec<Vec<Tensor<B, 4>>> = pieces.into_iter().flatten().collect();
    (0..pieces[0].len())
        .map(|output| Tensor::cat(pieces.iter().map(|p| p[output].clone()).collect(), 2))
        .collect()
}

/// `f` (plain causal attention on `[q, k, v, extra...]`) over the S2 groups of `q: [batch,
/// q_heads, len, dim]` and `k, v: [batch, kv_heads, len, dim]`, and of `extra` (per query head,
/// `[batch, q_heads, len, x]`), or `None` where the fold does not apply: no S2 groups, a sliding
/// window, queries and keys of different lengths, or K/V heads shared across the halves.
fn fold_attention<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    extra: Vec<Tensor<B, 4>>,
    options: &AttentionOptions,
    f: &dyn Fn(Vec<Tensor<B, 4>>) -> Vec<Tensor<B, 4>>,
) -> Option<Vec<Tensor<B, 4>>> {
    let group = options.shifted_group?;
    let [_, q_heads, len, _] = q.dims();
    let kv_heads = k.dims()[1];
    if options.sliding_window.is_some() || k.dims()[2] != len || len == 0 {
        return None;
    }
    let halves = halves(q_heads, kv_heads, group)?;
    let outputs: Vec<Vec<Tensor<B, 4>>> = halves
        .iter()
        .map(|half| {
            let per_q =
                |t: &Tensor<B, 4>| t.clone().narrow(1, half.q_heads.start, half.q_heads.len());
            let per_kv = |t: &Tensor<B, 4>| {
                t.clone()
                    .narrow(1, half.kv_heads.start, half.kv_heads.len())
            };
            let inputs: Vec<Tensor<B, 4>> = [per_q(&q), per_kv(&k), per_kv(&v)]
                .into_iter()
                .chain(extra.iter().map(per_q))
                .collect();
            over_groups(&inputs, &runs(len, group, half.shift), f)
        })
        .collect();
    Some(
        (0..outputs[0].len())
            .map(|i| Tensor::cat(outputs.iter().map(|o| o[i].clone()).collect(), 1))
            .collect(),
    )
}

/// The same options without S2 groups: what each group runs with.
fn causal(options: &AttentionOptions) -> AttentionOptions {
    AttentionOptions {
        shifted_group: None,
        ..*options
    }
}

/// [`super::attention`] with S2 groups, folded; `None` where the fold does not apply.
pub fn attention<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: AttentionOptions,
) -> Option<Tensor<B, 4>> {
    let plain = causal(&options);
    let f = |t: Vec<Tensor<B, 4>>| {
        let [q, k, v] = <[_; 3]>::try_from(t).expect("q, k, v");
        vec![super::attention(q, k, v, plain)]
    };
    fold_attention(q, k, v, vec![], &options, &f).map(|mut out| out.remove(0))
}

/// [`super::attention_with_lse`] with S2 groups, folded; `None` where the fold does not apply.
pub fn attention_with_lse<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: AttentionOptions,
) -> Option<(Tensor<B, 4>, Tensor<B, 3>)> {
    let plain = causal(&options);
    let f = |t: Vec<Tensor<B, 4>>| {
        let [q, k, v] = <[_; 3]>::try_from(t).expect("q, k, v");
        let (out, lse) = super::attention_with_lse(q, k, v, plain);
        vec![out, lse.unsqueeze_dim(3)]
    };
    let mut outputs = fold_attention(q, k, v, vec![], &options, &f)?;
    let lse = outputs.pop().expect("lse").squeeze_dim(3);
    Some((outputs.pop().expect("output"), lse))
}

/// [`super::attention_with_value`] with S2 groups, folded; `None` where the fold does not
/// apply.
pub fn attention_with_value<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    (out, lse): (Tensor<B, 4>, Tensor<B, 3>),
    options: AttentionOptions,
) -> Option<Tensor<B, 4>> {
    let plain = causal(&options);
    let f = |t: Vec<Tensor<B, 4>>| {
        let [q, k, v, out, lse] = <[_; 5]>::try_from(t).expect("q, k, v, out, lse");
        vec![super::attention_with_value(
            q,
            k,
            v,
            (out, lse.squeeze_dim(3)),
            plain,
        )]
    };
    let extra = vec![out, lse.unsqueeze_dim(3)];
    fold_attention(q, k, v, extra, &options, &f).map(|mut out| out.remove(0))
}

/// [`super::attention_backward`] with S2 groups, folded; `None` where the fold does not apply.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<B: LemoBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    out: Tensor<B, 4>,
    lse: Tensor<B, 3>,
    grad_out: Tensor<B, 4>,
    options: AttentionOptions,
) -> Option<(Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>)> {
    let plain = causal(&options);
    let f = |t: Vec<Tensor<B, 4>>| {
        let [q, k, v, out, lse, grad_out] = <[_; 6]>::try_from(t).expect("6 operands");
        let lse = lse.squeeze_dim(3);
        let (dq, dk, dv) = super::attention_backward(q, k, v, out, lse, grad_out, plain);
        vec![dq, dk, dv]
    };
    let extra = vec![out, lse.unsqueeze_dim(3), grad_out];
    let [dq, dk, dv] =
        <[_; 3]>::try_from(fold_attention(q, k, v, extra, &options, &f)?).expect("3 gradients");
    Some((dq, dk, dv))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_cut_at_shifted_group_boundaries() {
        let run = |start, count, len| Run { start, count, len };
        assert_eq!(runs(32, 8, 0), vec![run(0, 4, 8)]);
        assert_eq!(
            runs(32, 8, 4),
            vec![run(0, 1, 4), run(4, 3, 8), run(28, 1, 4)]
        );
        assert_eq!(runs(30, 8, 0), vec![run(0, 3, 8), run(24, 1, 6)]);
        assert_eq!(
            runs(30, 8, 4),
            vec![run(0, 1, 4), run(4, 3, 8), run(28, 1, 2)]
        );
        assert_eq!(runs(3, 8, 4), vec![run(0, 1, 3)]);
    }

    #[test]
    fn heads_split_where_kv_heads_do() {
        let ranges = |h: Vec<Half>| {
            h.into_iter()
                .map(|h| (h.q_heads, h.kv_heads, h.shift))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            ranges(halves(32, 8, 16).unwrap()),
            vec![(0..16, 0..4, 0), (16..32, 4..8, 8)]
        );
        assert_eq!(ranges(halves(1, 1, 16).unwrap()), vec![(0..1, 0..1, 8)]);
        assert!(halves(9, 3, 16).is_none());
    }
}
