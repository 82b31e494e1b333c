//! LongLoRA's shifted sparse attention (S2) on the kept rows of a token-sparse attention block,
//! at their original positions.
//!
//! S2 attention is causal attention within groups of `group` consecutive positions, the second
//! half of the query heads with groups shifted by half a group. The pass over every row computes
//! it exactly (output and log-sum-exp of each row); the kept rows' graph takes that value and
//! back-propagates S2 attention over every key restricted to the kept keys, as the plain causal
//! block does ([`attention_with_value`]). Kept rows are in position order, so the kept rows of
//! one group are a run of consecutive kept rows, and within a run "a kept key at a position no
//! later than the query's" is causal order by index: each run is one call of plain causal
//! attention, and the kept rows of a group attend to exactly the kept keys their positions see.

use std::ops::Range;

use burn::tensor::Tensor;
use lemo_kernels::attention::{AttentionPiece, attention_pieces_with_value};
use lemo_kernels::{AttentionOptions, LemoBackend};
use lemo_sparsity::KeptRows;

use crate::token_plan::BlockRows;

/// The runs of kept rows that fall in one S2 group of `group` positions shifted by `shift`
/// ([`AttentionOptions::shifted_groups`]) in a sequence of `len` positions: index ranges of
/// consecutive rows, empty groups left out. `rows_before(position)` counts the kept rows before
/// a group boundary.
pub fn runs_in_groups(
    rows_before: impl Fn(usize) -> usize,
    len: usize,
    group: usize,
    shift: usize,
) -> Vec<Range<usize>> {
    AttentionOptions::shifted_groups(len, group, shift)
        .map(|positions_in_group| {
            rows_before(positions_in_group.start)..rows_before(positions_in_group.end)
        })
        .filter(|run| !run.is_empty())
        .collect()
}

/// For each sequence of `kept`, the kept rows before a position that starts or ends an S2
/// group of `group`: counted where every segment keeps as many rows and group boundaries are
/// segment boundaries (half-group selection, no read of the rows), else from the positions.
enum KeptRowsBefore {
    /// Every segment of `segment` positions keeps `rows` rows.
    Counted { segment: usize, rows: usize },
    /// The kept positions, read from the device.
    Read(KeptRows),
}

impl KeptRowsBefore {
    fn new<B: LemoBackend>(kept: &BlockRows, group: usize) -> Self {
        match kept
            .segment
            .filter(|&segment| (group / 2).is_multiple_of(segment))
        {
            Some(segment) => Self::Counted {
                segment,
                rows: kept.kept / (kept.seq / segment),
            },
            None => Self::Read(kept.to_host::<B>()),
        }
    }

    /// The kept rows of sequence `sequence` at positions before `position`.
    fn count(&self, sequence: usize, position: usize) -> usize {
        match self {
            Self::Counted { segment, rows } => {
                debug_assert!(
                    position.is_multiple_of(*segment),
                    "{position} ends no segment"
                );
                position / segment * rows
            }
            Self::Read(positions) => {
                let rows =
                    &positions.rows[sequence * positions.kept..(sequence + 1) * positions.kept];
                rows.partition_point(|&p| (p as usize) < position)
            }
        }
    }
}

/// S2 attention of the kept rows `q: [batch, q_heads, kept, head_dim]`,
/// `k, v: [batch, kv_heads, kept, head_dim]` at their positions (`kept`) in groups of `group`,
/// given its value on those rows from the pass over every row (`out`, and `lse`
/// `[batch, q_heads, kept]`): that value, with the backward pass of S2 attention over every key
/// restricted to the kept keys. `options` gives the scale, the group and each head's shift.
/// Work: one causal backward per run of kept rows in a group, per sequence and half of the
/// heads ([`attention_pieces_with_value`]: the value is `out` itself, no copy).
pub fn kept_rows_s2_attention<B: LemoBackend>(
    (q, k, v): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>),
    (out, lse): (Tensor<B, 4>, Tensor<B, 3>),
    kept: &BlockRows,
    options: AttentionOptions,
) -> Tensor<B, 4> {
    let group = options
        .shifted_group
        .expect("S2 attention of the kept rows needs S2 groups");
    let [batch, q_heads, rows, head_dim] = q.dims();
    let kv_heads = k.dims()[1];
    let causal = AttentionOptions {
        shifted_group: None,
        ..options
    };
    // The heads in order, cut where the shift changes: a half of plain groups, one shifted.
    let first_shifted = (0..q_heads)
        .position(|head| options.group_shift(head, q_heads) != 0)
        .unwrap_or(q_heads);
    let halves = [0..first_shifted, first_shifted..q_heads]
        .map(|heads| (options.group_shift(heads.start, q_heads), heads));
    // Each half reads the key/value heads of its query heads: a slice of them where the halves
    // split the groups of query heads evenly (every model with an even number of such groups),
    // else key/value heads repeated for each query head (SmolLM2: 9 query heads on 3).
    let per_kv = q_heads / kv_heads;
    let (k, v) = if first_shifted.is_multiple_of(per_kv) {
        (k, v)
    } else {
        let repeat = |t: Tensor<B, 4>| {
            t.unsqueeze_dim::<5>(2)
                .expand([batch, kv_heads, per_kv, rows, head_dim])
                .reshape([batch, q_heads, rows, head_dim])
        };
        (repeat(k), repeat(v))
    };
    let rows_before = KeptRowsBefore::new::<B>(kept, group);
    let pieces = (0..batch)
        .flat_map(|sequence| {
            let rows_before = &rows_before;
            halves
                .iter()
                .filter(|(_, heads)| !heads.is_empty())
                .flat_map(move |(shift, heads)| {
                    let in_sequence = |position| rows_before.count(sequence, position);
                    runs_in_groups(in_sequence, kept.seq, group, *shift)
                        .into_iter()
                        .map(move |rows| AttentionPiece {
                            sequence,
                            heads: heads.clone(),
                            rows,
                        })
                })
        })
        .collect();
    attention_pieces_with_value(q, k, v, (out, lse), pieces, causal)
}

#[cfg(test)]
mod tests {
    use burn::backend::Autodiff;
    use burn::tensor::backend::Backend;
    use burn::tensor::{Bool, ElementConversion, Int, TensorData};
    use lemo_kernels::attention::attention_with_lse;
    use lemo_kernels::{CpuBackend, WgpuBackend};
    use lemo_sparsity::KeptRows;
    use lemo_test_support::{random, seed_backend};

    use super::*;

    /// Kept rows `[1, n]` at `positions` of a sequence of `seq`, read from the host.
    fn kept_at(positions: &[u32], seq: usize) -> BlockRows {
        let kept = KeptRows {
            rows: positions.to_vec(),
            batch: 1,
            kept: positions.len(),
            seq,
        };
        BlockRows::from_host::<CpuBackend>(kept, false, &Default::default())
    }

    #[test]
    fn runs_follow_the_groups_of_the_positions() {
        let positions = [0, 1, 5, 8, 9, 15, 16, 30];
        let rows_before = KeptRowsBefore::new::<CpuBackend>(&kept_at(&positions, 32), 8);
        let runs = |shift| runs_in_groups(|position| rows_before.count(0, position), 32, 8, shift);
        assert_eq!(runs(0), [0..3, 3..6, 6..7, 7..8]);
        // Shifted by 4: groups start at positions 4, 12, 20, 28.
        assert_eq!(runs(4), [0..2, 2..5, 5..7, 7..8]);
        let none_kept = KeptRowsBefore::new::<CpuBackend>(&kept_at(&[], 32), 8);
        assert_eq!(
            runs_in_groups(|position| none_kept.count(0, position), 32, 8, 0),
            Vec::<Range<usize>>::new()
        );
    }

    /// Rows kept as many in every half group are cut into the runs their positions give, from
    /// the count alone.
    #[test]
    fn counted_runs_of_half_group_selection_are_the_positions_runs() {
        // Groups of 16 over 64 positions, half groups of 8 keeping 3 rows each.
        let positions: Vec<u32> = (0..8)
            .flat_map(|half_group| [0, 4, 7].map(|offset| half_group * 8 + offset))
            .collect();
        let read = kept_at(&positions, 64);
        let counted = read.clone().in_segments(8);
        let (read, counted) = (
            KeptRowsBefore::new::<CpuBackend>(&read, 16),
            KeptRowsBefore::new::<CpuBackend>(&counted, 16),
        );
        assert!(matches!(
            counted,
            KeptRowsBefore::Counted {
                segment: 8,
                rows: 3
            }
        ));
        for shift in [0, 8] {
            assert_eq!(
                runs_in_groups(|position| counted.count(0, position), 64, 16, shift),
                runs_in_groups(|position| read.count(0, position), 64, 16, shift),
                "shift {shift}"
            );
        }
    }

    /// `[heads, kept, kept]`: true where kept query `i` may not see kept key `j` under S2 at
    /// their positions (a later position, or another group of the head's half).
    fn hidden_by_position<B: Backend>(
        positions: &[u32],
        heads: usize,
        group: usize,
        device: &B::Device,
    ) -> Tensor<B, 3, Bool> {
        let n = positions.len();
        let mut hidden = Vec::with_capacity(heads * n * n);
        for head in 0..heads {
            let shift = if head >= heads / 2 { group / 2 } else { 0 };
            let group_of = |p: u32| (p as usize + shift) / group;
            for &query in positions {
                for &key in positions {
                    hidden.push(key > query || group_of(key) != group_of(query));
                }
            }
        }
        Tensor::from_data(TensorData::new(hidden, [heads, n, n]), device)
    }

    /// Against the definition: the kept rows' output is the whole sequence's S2 attention output
    /// there, whose dependence on the kept queries, keys and values is through the visible kept
    /// pairs' terms, the dropped keys' share of each row's sums held constant. On the CPU
    /// reference and on the CubeCL kernels (wgpu), which take the runs the cuDNN engine cannot;
    /// with halves that split the key/value heads evenly (4 on 2) and halves that share one.
    fn kept_rows_get_the_whole_sequences_value_and_the_restricted_gradient<I: LemoBackend>(
        (heads, kv_heads): (usize, usize),
    ) {
        type B<I> = Autodiff<I>;
        let device = Default::default();
        seed_backend::<B<I>>(&device);
        let (seq, group, head_dim) = (24, 8, 8);
        let positions: Vec<u32> = vec![0, 1, 2, 5, 6, 9, 12, 13, 14, 15, 20, 23];
        let n = positions.len();
        let projection = |heads| random::<B<I>, 4>([1, heads, seq, head_dim], &device);
        let (q_all, k_all, v_all) = (
            projection(heads),
            projection(kv_heads),
            projection(kv_heads),
        );
        let options = AttentionOptions {
            shifted_group: Some(group),
            ..AttentionOptions::causal(head_dim)
        };
        let (out_all, lse_all) =
            attention_with_lse(q_all.clone(), k_all.clone(), v_all.clone(), options);
        let rows = Tensor::<B<I>, 1, Int>::from_data(
            TensorData::new(positions.iter().map(|&p| p as i64).collect(), [n]),
            &device,
        );
        let kept_rows = |t: Tensor<B<I>, 4>| t.select(2, rows.clone()).detach().require_grad();
        let (q, k, v) = (kept_rows(q_all), kept_rows(k_all), kept_rows(v_all));
        let out = out_all.select(2, rows.clone()).detach();
        let lse = lse_all.select(2, rows.clone()).detach();
        let upstream = random::<B<I>, 4>([1, heads, n, head_dim], &device);
        let kept = KeptRows {
            rows: positions.clone(),
            batch: 1,
            kept: n,
            seq,
        };
        let kept = BlockRows::from_host::<B<I>>(kept, false, &device);

        let tested = kept_rows_s2_attention(
            (q.clone(), k.clone(), v.clone()),
            (out.clone(), lse.clone()),
            &kept,
            options,
        );

        let repeat = |t: Tensor<B<I>, 4>| {
            t.unsqueeze_dim::<5>(2)
                .expand([1, kv_heads, heads / kv_heads, n, head_dim])
                .reshape([1, heads, n, head_dim])
        };
        let hidden = hidden_by_position(&positions, heads, group, &device).unsqueeze_dim::<4>(0);
        let terms = (q.clone().matmul(repeat(k.clone()).swap_dims(2, 3)) * options.scale)
            .mask_fill(hidden, -1.0e30)
            .exp();
        let kept_sum = terms.clone().sum_dim(3);
        let kept_weighted = terms.matmul(repeat(v.clone()));
        let total = lse.unsqueeze_dim::<4>(3).exp();
        let rest_sum = total.clone() - kept_sum.clone().detach();
        let rest_weighted = out.clone() * total - kept_weighted.clone().detach();
        let expected = (kept_weighted + rest_weighted) / (kept_sum + rest_sum);

        let max = |t: Tensor<I, 4>| -> f32 { t.abs().max().into_scalar().elem() };
        let gradients = |t: Tensor<B<I>, 4>| {
            let grads = (t * upstream.clone()).sum().backward();
            [&q, &k, &v].map(|x| x.grad(&grads).expect("the output reads it"))
        };
        let value_error = max((tested.clone() - out.clone()).inner());
        assert!(
            value_error <= 1e-5,
            "value differs from the pass's by {value_error}"
        );
        let expected_error = max((expected.clone() - out).inner());
        assert!(
            expected_error <= 1e-4,
            "the reference's value is off by {expected_error}"
        );
        for (name, (a, b)) in ["q", "k", "v"]
            .iter()
            .zip(gradients(tested).into_iter().zip(gradients(expected)))
        {
            let scale = max(b.clone());
            let error = max(a - b);
            assert!(scale > 0.0, "d{name} is zero");
            assert!(
                error <= 1e-4 * scale,
                "d{name} differs by {error} (of {scale})"
            );
        }
    }

    #[test]
    fn kept_rows_s2_on_the_cpu_reference() {
        for heads in [(4, 2), (4, 1)] {
            kept_rows_get_the_whole_sequences_value_and_the_restricted_gradient::<CpuBackend>(
                heads,
            );
        }
    }

    #[test]
    fn kept_rows_s2_on_the_cubecl_kernels() {
        for heads in [(4, 2), (4, 1)] {
            kept_rows_get_the_whole_sequences_value_and_the_restricted_gradient::<WgpuBackend>(
                heads,
            );
        }
    }
}
