//! How one attention call is cut into cuDNN graph calls, each over strided views of the caller's
//! buffers (no copies).
//!
//! Plain causal attention is one call. S2 attention ([`AttentionOptions::shifted_group`]) is
//! causal attention within each group, so each half of the query heads (with the K/V heads it
//! reads) runs as causal attention over its groups folded into the graph's batch dimension: a
//! group is `len` consecutive positions and the next one starts `group_stride` positions on,
//! which is a stride like any other. The unshifted half is one call where its groups are of one
//! length; the shifted half is one call over its whole groups and one over the two half groups
//! at either end. In the backward pass a call whose f32 dQ accumulator would pass a limit runs in
//! [`pieces`] of whole K/V head groups, one sequence at a time.

use std::ops::Range;

use super::super::{AttentionOptions, FUSED_ATTENTION_LENGTH_MULTIPLE};

/// One graph call: these sequences, query heads and the K/V heads they read, over `groups`
/// groups of `len` positions from `start`, `group_stride` positions apart (folded into the
/// graph's batch; more than one group only within one sequence), and the `kv_len` keys whose
/// last `len` the queries are (`len` but for plain causal attention with fewer queries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Segment {
    pub sequences: Range<usize>,
    pub q_heads: Range<usize>,
    pub kv_heads: Range<usize>,
    pub start: usize,
    pub groups: usize,
    pub group_stride: usize,
    pub len: usize,
    pub kv_len: usize,
}

/// Where a segment reads or writes one tensor: the element offset of its first value, and the
/// dims and strides cuDNN is given, `[folded batch, heads, len, x]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct View {
    pub offset: usize,
    pub dims: [i64; 4],
    pub strides: [i64; 4],
}

impl Segment {
    /// The graph's batch: the sequences, or the groups of one sequence.
    pub fn folded(&self) -> usize {
        self.sequences.len() * self.groups
    }

    /// The segment's view of a query-shaped tensor `[batch, q_heads, len, x]` with `strides`.
    pub fn queries(&self, x: usize, strides: [i64; 4]) -> View {
        self.view(&self.q_heads, self.len, x, strides)
    }

    /// The segment's view of a key-shaped tensor `[batch, kv_heads, kv_len, x]` with `strides`.
    pub fn keys(&self, x: usize, strides: [i64; 4]) -> View {
        self.view(&self.kv_heads, self.kv_len, x, strides)
    }

    /// The view of `rows` rows over `heads` of a tensor `[batch, heads, len, x]` with `strides`
    /// (in elements).
    fn view(&self, heads: &Range<usize>, rows: usize, x: usize, strides: [i64; 4]) -> View {
        let [sequence, head, position, _] = strides.map(|s| s as usize);
        let folded_stride = if self.groups > 1 {
            self.group_stride * position
        } else {
            sequence
        };
        View {
            offset: self.sequences.start * sequence + heads.start * head + self.start * position,
            dims: [self.folded(), heads.len(), rows, x].map(|d| d as i64),
            strides: [folded_stride as i64, strides[1], strides[2], strides[3]],
        }
    }
}

/// `count` consecutive groups of `len` positions from `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    start: usize,
    count: usize,
    len: usize,
}

/// The S2 groups of `len` positions shifted by `shift`, consecutive groups of one length
/// in one run.
fn runs(len: usize, group: usize, shift: usize) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for range in AttentionOptions::shifted_groups(len, group, shift) {
        match runs.last_mut() {
            Some(run) if run.len == range.len() => run.count += 1,
            _ => runs.push(Run {
                start: range.start,
                count: 1,
                len: range.len(),
            }),
        }
    }
    runs
}

/// One half of the heads: query heads `q_heads`, the K/V heads they read, and their S2 shift.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Half {
    q_heads: Range<usize>,
    kv_heads: Range<usize>,
    shift: usize,
}

/// The halves of `q_heads` query heads reading `kv_heads` K/V heads under S2 groups of `group`
/// (see [`AttentionOptions::group_shift`]), or `None` when a K/V head serves query heads of both
/// halves (e.g. 9 query heads on 3): their gradients would need summing across calls.
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

/// The calls of attention over `q: [batch, q_heads, len, _]` and `kv_heads` K/V heads of
/// `kv_len` keys with `options`, or `None` where cuDNN cannot run them: a length or group length
/// that is not a multiple of [`FUSED_ATTENTION_LENGTH_MULTIPLE`] (the engine reads rows up to
/// the next multiple, which may belong to the next group), fewer keys than queries, S2 with more
/// keys than queries, or K/V heads shared across the S2 halves.
pub(super) fn segments(
    [batch, q_heads, len, _]: [usize; 4],
    [kv_heads, kv_len]: [usize; 2],
    options: &AttentionOptions,
) -> Option<Vec<Segment>> {
    let whole = Segment {
        sequences: 0..batch,
        q_heads: 0..q_heads,
        kv_heads: 0..kv_heads,
        start: 0,
        groups: 1,
        group_stride: len,
        len,
        kv_len,
    };
    let fused = |len: usize| len.is_multiple_of(FUSED_ATTENTION_LENGTH_MULTIPLE);
    let Some(group) = options.shifted_group else {
        return (fused(len) && fused(kv_len) && kv_len >= len).then(|| vec![whole]);
    };
    if kv_len != len {
        return None;
    }
    let mut segments = Vec::new();
    for half in halves(q_heads, kv_heads, group)? {
        let mut runs = runs(len, group, half.shift);
        if runs.iter().any(|run| !fused(run.len)) {
            return None;
        }
        let of_half = |start, groups, group_stride, len| Segment {
            q_heads: half.q_heads.clone(),
            kv_heads: half.kv_heads.clone(),
            start,
            groups,
            group_stride,
            len,
            kv_len: len,
            ..whole.clone()
        };
        // The shifted half's half groups at either end: one call, `group_stride` apart.
        if let [first, .., last] = runs[..]
            && runs.len() > 2
            && first.count == 1
            && last.count == 1
            && first.len == last.len
        {
            segments.push(of_half(first.start, 2, last.start - first.start, first.len));
            runs = runs[1..runs.len() - 1].to_vec();
        }
        for run in runs {
            segments.push(of_half(run.start, run.count, run.len, run.len));
        }
    }
    // Groups fold within one sequence: one call per sequence where there is more than one.
    Some(
        segments
            .into_iter()
            .flat_map(|segment| per_sequence(segment, |s| s.groups > 1))
            .collect(),
    )
}

/// `segment` once per sequence where `split` says so, else whole.
fn per_sequence(segment: Segment, split: impl Fn(&Segment) -> bool) -> Vec<Segment> {
    if !split(&segment) || segment.sequences.len() == 1 {
        return vec![segment];
    }
    segment
        .sequences
        .clone()
        .map(|sequence| Segment {
            sequences: sequence..sequence + 1,
            ..segment.clone()
        })
        .collect()
}

/// `segment`'s backward pass whole when its f32 dQ accumulator (`[folded, q_heads, len,
/// head_dim]`) fits `limit` bytes, else in pieces of one sequence and as many whole K/V head
/// groups as fit (at least one; split evenly). O(sequences * kv_heads) pieces at most.
pub(super) fn pieces(segment: Segment, head_dim: usize, limit: Option<u64>) -> Vec<Segment> {
    let kv_heads = segment.kv_heads.len();
    let per_kv_head = (segment.q_heads.len() / kv_heads * segment.len * head_dim * 4) as u64;
    let over = |s: &Segment| {
        per_kv_head * (s.folded() * s.kv_heads.len()) as u64 > limit.unwrap_or(u64::MAX)
    };
    let Some(limit) = limit.filter(|_| over(&segment)) else {
        return vec![segment];
    };
    let ratio = segment.q_heads.len() / kv_heads;
    per_sequence(segment, over)
        .into_iter()
        .flat_map(|sequence| {
            let fitting = (limit / (per_kv_head * sequence.folded() as u64))
                .clamp(1, kv_heads as u64) as usize;
            let size = kv_heads.div_ceil(kv_heads.div_ceil(fitting));
            let (first_kv, first_q) = (sequence.kv_heads.start, sequence.q_heads.start);
            (0..kv_heads).step_by(size).map(move |head| {
                let end = (head + size).min(kv_heads);
                Segment {
                    kv_heads: first_kv + head..first_kv + end,
                    q_heads: first_q + head * ratio..first_q + end * ratio,
                    ..sequence.clone()
                }
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(group: Option<usize>) -> AttentionOptions {
        let causal = AttentionOptions::causal(64);
        group.map_or(causal, |g| causal.with_shifted_groups(g))
    }

    /// For each (sequence, query head, position), the keys (K/V head, positions) the segments
    /// let it see, each query required to be covered exactly once.
    fn visible_keys(
        segments: &[Segment],
        [batch, q_heads, len]: [usize; 3],
    ) -> Vec<Option<(usize, Vec<usize>)>> {
        let mut seen = vec![None; batch * q_heads * len];
        for segment in segments {
            let ratio = segment.q_heads.len() / segment.kv_heads.len();
            for sequence in segment.sequences.clone() {
                for group in 0..segment.groups {
                    let first = segment.start + group * segment.group_stride;
                    for (index, head) in segment.q_heads.clone().enumerate() {
                        let kv_head = segment.kv_heads.start + index / ratio;
                        for row in 0..segment.len {
                            let slot = &mut seen[(sequence * q_heads + head) * len + first + row];
                            assert!(slot.is_none(), "a query in two segments");
                            *slot = Some((kv_head, (first..=first + row).collect()));
                        }
                    }
                }
            }
        }
        seen
    }

    /// What S2 (or plain causal attention) lets each query see, by its definition.
    fn expected_keys(
        [batch, q_heads, len]: [usize; 3],
        kv_heads: usize,
        options: &AttentionOptions,
    ) -> Vec<Option<(usize, Vec<usize>)>> {
        let mut expected = Vec::new();
        for _ in 0..batch {
            for head in 0..q_heads {
                let shift = options.group_shift(head, q_heads);
                let bucket = |p: usize| options.shifted_group.map(|g| (p + shift) / g);
                for position in 0..len {
                    let keys = (0..=position)
                        .filter(|&key| bucket(key) == bucket(position))
                        .collect();
                    expected.push(Some((head / (q_heads / kv_heads), keys)));
                }
            }
        }
        expected
    }

    #[test]
    fn segments_cover_every_query_with_exactly_its_keys() {
        // (batch, q heads, kv heads, len, S2 group)
        let cases = [
            (2, 4, 2, 512, None),
            (1, 8, 8, 1024, Some(256)),
            (2, 8, 8, 1152, Some(256)),
            (1, 8, 4, 1024, Some(256)),
            (2, 6, 2, 1280, Some(512)),
            (1, 2, 2, 768, Some(1024)),
            (1, 1, 1, 512, Some(256)),
        ];
        for (batch, q_heads, kv_heads, len, group) in cases {
            let options = options(group);
            let segments = segments([batch, q_heads, len, 64], [kv_heads, len], &options)
                .unwrap_or_else(|| panic!("{len} tokens in groups of {group:?} run on cuDNN"));
            let dims = [batch, q_heads, len];
            assert_eq!(
                visible_keys(&segments, dims),
                expected_keys(dims, kv_heads, &options),
                "{batch} x {q_heads}/{kv_heads} heads, {len} tokens, groups of {group:?}"
            );
        }
    }

    #[test]
    fn an_s2_half_runs_in_at_most_three_calls() {
        // 32K in groups of 8192, MHA: the unshifted half in one call; the shifted half's three
        // whole groups in one and its two half groups at either end in one.
        let calls = segments([1, 32, 32768, 128], [32, 32768], &options(Some(8192))).unwrap();
        let layout: Vec<_> = calls
            .iter()
            .map(|s| (s.q_heads.clone(), s.start, s.groups, s.group_stride, s.len))
            .collect();
        assert_eq!(
            layout,
            [
                (0..16, 0, 4, 8192, 8192),
                (16..32, 0, 2, 28672, 4096),
                (16..32, 4096, 3, 8192, 8192),
            ]
        );
    }

    #[test]
    fn lengths_cudnn_cannot_take_are_declined() {
        assert!(segments([1, 4, 1000, 64], [4, 1000], &options(None)).is_none());
        // Groups of 200 end at positions that are not multiples of 128.
        assert!(segments([1, 4, 1024, 64], [4, 1024], &options(Some(200))).is_none());
        // 9 query heads on 3: K/V head 1 serves both halves.
        assert!(segments([1, 9, 1024, 64], [3, 1024], &options(Some(256))).is_none());
        // More queries than keys; S2 over queries that are the last of more keys.
        assert!(segments([1, 4, 1024, 64], [4, 512], &options(None)).is_none());
        assert!(segments([1, 4, 512, 64], [4, 1024], &options(Some(256))).is_none());
        assert!(segments([1, 4, 512, 64], [4, 1000], &options(None)).is_none());
    }

    #[test]
    fn queries_that_end_a_longer_key_sequence_run_in_one_call() {
        // A rank's chunk of a split sequence: 512 queries against the 1536 keys up to its end.
        let calls = segments([2, 8, 512, 128], [2, 1536], &options(None)).unwrap();
        assert_eq!(calls.len(), 1);
        let strides = [1536 * 2 * 128, 128, 2 * 128, 1];
        let keys = calls[0].keys(128, strides);
        assert_eq!((keys.offset, keys.dims), (0, [2, 2, 1536, 128]));
        assert_eq!(calls[0].queries(128, strides).dims, [2, 8, 512, 128]);
    }

    #[test]
    fn views_address_the_rows_of_each_group() {
        // A sequence-major `[batch, heads, len, dim]`: strides (len * heads * dim, dim,
        // heads * dim, 1).
        let (heads, len, dim) = (4usize, 1024usize, 64usize);
        let strides = [len * heads * dim, dim, heads * dim, 1].map(|s| s as i64);
        let segment = Segment {
            sequences: 1..2,
            q_heads: 2..4,
            kv_heads: 1..2,
            start: 128,
            groups: 3,
            group_stride: 256,
            len: 256,
            kv_len: 256,
        };
        let view = segment.queries(dim, strides);
        // Element of (folded group 2, head 1 of the view, row 5, column 7).
        let index = |[f, h, r, c]: [i64; 4]| {
            view.offset as i64
                + f * view.strides[0]
                + h * view.strides[1]
                + r * view.strides[2]
                + c * view.strides[3]
        };
        let position = 128 + 2 * 256 + 5;
        let expected = len * heads * dim + position * heads * dim + 3 * dim + 7;
        assert_eq!(index([2, 1, 5, 7]), expected as i64);
        assert_eq!(view.dims, [3, 2, 256, 64]);
    }

    fn piece(segment: &Segment) -> (Range<usize>, Range<usize>, Range<usize>) {
        (
            segment.sequences.clone(),
            segment.kv_heads.clone(),
            segment.q_heads.clone(),
        )
    }

    fn whole(batch: usize, q_heads: usize, kv_heads: usize) -> Segment {
        segments(
            [batch, q_heads, 1024, 128],
            [kv_heads, 1024],
            &options(None),
        )
        .unwrap()
        .remove(0)
    }

    #[test]
    fn a_backward_within_the_limit_runs_whole() {
        // 2 * 32 * 1024 * 128 f32: 32 MiB.
        for limit in [None, Some(32 << 20)] {
            assert_eq!(pieces(whole(2, 32, 8), 128, limit), [whole(2, 32, 8)]);
        }
    }

    #[test]
    fn a_larger_backward_splits_per_sequence_into_even_head_groups() {
        // One K/V head with its 4 query heads: 2 MiB; 5 fit in 10 MiB, so 8 heads go in two
        // groups of 4, per sequence.
        let split: Vec<_> = pieces(whole(2, 32, 8), 128, Some(10 << 20))
            .iter()
            .map(piece)
            .collect();
        assert_eq!(
            split,
            [
                (0..1, 0..4, 0..16),
                (0..1, 4..8, 16..32),
                (1..2, 0..4, 0..16),
                (1..2, 4..8, 16..32)
            ]
        );
        // Uneven: 3 of 8 fit, so three groups of at most 3.
        let uneven: Vec<_> = pieces(whole(1, 8, 8), 128, Some(3 << 19))
            .into_iter()
            .map(|piece| piece.kv_heads)
            .collect();
        assert_eq!(uneven, [0..3, 3..6, 6..8]);
    }

    #[test]
    fn a_head_group_past_the_limit_still_runs_alone() {
        let single: Vec<_> = pieces(whole(1, 32, 8), 128, Some(1))
            .into_iter()
            .map(|piece| piece.kv_heads)
            .collect();
        assert_eq!(single, (0..8).map(|h| h..h + 1).collect::<Vec<_>>());
    }

    #[test]
    fn pieces_of_an_s2_half_keep_its_heads_and_groups() {
        // The shifted half of 32 heads over 4 groups: heads 16..32, split in two.
        let half =
            segments([1, 32, 32768, 128], [32, 32768], &options(Some(8192))).unwrap()[2].clone();
        let split = pieces(half.clone(), 128, Some(3 * 8192 * 128 * 4 * 8));
        let heads: Vec<_> = split.iter().map(|s| s.q_heads.clone()).collect();
        assert_eq!(heads, [16..24, 24..32]);
        assert!(
            split
                .iter()
                .all(|s| s.start == half.start && s.groups == half.groups)
        );
    }
}
