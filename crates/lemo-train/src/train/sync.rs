//! What the ranks agree on each step: the summed gradients (one flat bucket, one all-reduce)
//! and the step's totals (loss, predictions, kept fractions, each rank's memory, and whether any
//! rank was asked to stop).

use anyhow::Result;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::optim::NamedTensors;
use super::replica::LocalStep;
use crate::distributed::Communicator;
use crate::memory::PeakTracker;
use lemo_kernels::exchange::Exchange;

/// Sums `grads` over the ranks as one flat bucket laid out by `layout` (a parameter without a
/// gradient on this rank contributes zeros). One rank returns `grads` as they are.
pub fn sum_grads<B: Backend>(
    grads: NamedTensors<B>,
    layout: &[(String, usize)],
    device: &B::Device,
    comm: &mut Communicator,
) -> Result<NamedTensors<B>> {
    if comm.ranks() == 1 {
        return Ok(grads);
    }
    let mut grads = grads;
    let parts: Vec<Tensor<B, 1>> = layout
        .iter()
        .map(|(name, len)| {
            grads
                .remove(name)
                .unwrap_or_else(|| Tensor::zeros([*len], device))
        })
        .collect();
    let bucket = comm.sum_tensor(Tensor::cat(parts, 0))?;
    let mut offset = 0;
    Ok(layout
        .iter()
        .map(|(name, len)| {
            let part = bucket.clone().narrow(0, offset, *len);
            offset += len;
            (name.clone(), part)
        })
        .collect())
}

/// A step's totals over the ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct StepTotals {
    pub loss_sum: f64,
    pub predictions: usize,
    /// Kept fractions averaged over the ranks.
    pub keep_attention: f64,
    pub keep_mlp: f64,
    /// Some rank was asked to stop (a signal): every rank stops after this step.
    pub stop: bool,
    /// Each rank's peak memory so far and memory after the forward pass, in bytes.
    pub peak: Vec<u64>,
    pub after_forward: Vec<u64>,
    /// Each rank's device-level peak so far, in bytes (0 where unknown).
    pub device_peak: Vec<u64>,
}

impl StepTotals {
    /// Sums `local` (and this rank's memory and stop request) over the ranks.
    pub fn gather(
        local: &LocalStep,
        peak: &PeakTracker,
        stop: bool,
        comm: &mut Communicator,
    ) -> Result<Self> {
        let (rank, ranks) = (comm.rank(), comm.ranks());
        // Shared sums first, then one slot per rank for the per-rank readings (zeros elsewhere,
        // so the sum gathers them).
        let mut values = vec![0.0; 5 + 3 * ranks];
        values[..5].copy_from_slice(&[
            local.loss_sum,
            local.predictions as f64,
            local.keep_attention,
            local.keep_mlp,
            f64::from(u8::from(stop)),
        ]);
        values[5 + rank] = peak.peak as f64;
        values[5 + ranks + rank] = local.after_forward as f64;
        values[5 + 2 * ranks + rank] = peak.device_peak as f64;
        comm.sum_host(&mut values)?;
        let per_rank = |slot: usize| -> Vec<u64> {
            let start = 5 + slot * ranks;
            values[start..start + ranks]
                .iter()
                .map(|&v| v as u64)
                .collect()
        };
        Ok(Self {
            loss_sum: values[0],
            predictions: values[1].round() as usize,
            keep_attention: values[2] / ranks as f64,
            keep_mlp: values[3] / ranks as f64,
            stop: values[4] > 0.0,
            peak: per_rank(0),
            after_forward: per_rank(1),
            device_peak: per_rank(2),
        })
    }

    /// Mean loss over the global batch's predictions.
    pub fn loss(&self) -> f64 {
        self.loss_sum / self.predictions as f64
    }
}

/// Mean loss of `sequences` scored by all ranks together: rank r scores every ranks-th one; with
/// a `sequence_group`, group g scores every groups-th one, each of its ranks its positions.
pub fn validation_loss<B: lemo_kernels::LemoBackend>(
    model: &lemo_models::CausalLm<B>,
    sequences: &[crate::data::Sequence],
    segment: usize,
    (comm, sequence_group): (&mut Communicator, Option<&Exchange>),
) -> Result<f64> {
    let group_size = sequence_group.map_or(1, Exchange::ranks);
    let mine: Vec<crate::data::Sequence> = sequences
        .iter()
        .skip(comm.rank() / group_size)
        .step_by(comm.ranks() / group_size)
        .cloned()
        .collect();
    let (sum, count) = super::step::validation_sums(model, &mine, segment, sequence_group)?;
    let mut totals = [sum, count as f64];
    comm.sum_host(&mut totals)?;
    Ok(totals[0] / totals[1].max(1.0))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use burn::backend::NdArray;

    use super::*;
    use crate::distributed::{Engine, Layout, run_ranks};

    type B = NdArray<f32>;

    #[test]
    fn ranks_sum_gradients_and_gather_their_totals() {
        let layout = vec![("a".to_string(), 2), ("b".to_string(), 1)];
        let outputs = run_ranks(
            Layout::local(2),
            Duration::from_secs(30),
            Engine::InProcess,
            |comm| {
                let device = Default::default();
                let rank = comm.rank();
                let mut grads = NamedTensors::<B>::new();
                grads.insert(
                    "a".into(),
                    Tensor::from_floats([1.0, 2.0 * rank as f32], &device),
                );
                // Rank 1 has no gradient for "b": it counts as zeros.
                if rank == 0 {
                    grads.insert("b".into(), Tensor::from_floats([5.0], &device));
                }
                let summed = sum_grads(grads, &layout, &device, comm)?;
                let local = LocalStep {
                    loss_sum: 10.0,
                    predictions: 4,
                    keep_attention: 0.5 * rank as f64,
                    keep_mlp: 1.0,
                    after_forward: 100 + rank as u64,
                };
                let peak = PeakTracker {
                    peak: 1000 * (rank as u64 + 1),
                    device_peak: 5000 + rank as u64,
                };
                let totals = StepTotals::gather(&local, &peak, rank == 1, comm)?;
                let values: Vec<Vec<f32>> = summed
                    .values()
                    .map(|t| t.clone().into_data().into_vec().unwrap())
                    .collect();
                Ok((values, totals))
            },
        )
        .unwrap();
        for (values, totals) in outputs {
            assert_eq!(values, vec![vec![2.0, 2.0], vec![5.0]]);
            assert_eq!(totals.loss(), 2.5);
            assert_eq!((totals.keep_attention, totals.keep_mlp), (0.25, 1.0));
            assert!(totals.stop, "one rank's stop request stops every rank");
            assert_eq!(totals.peak, vec![1000, 2000]);
            assert_eq!(totals.after_forward, vec![100, 101]);
            assert_eq!(totals.device_peak, vec![5000, 5001]);
        }
    }
}
