//! The sequence groups of context parallelism: the all-gather and reduce-scatter of
//! [`lemo_kernels::exchange`] through NCCL on the ranks' GPUs, and through the host (on the CPU
//! backends, and for the barrier) as sums of the group's host values (an all-gather is the sum
//! of each rank's values placed in its own part of a zeroed buffer): in process memory when
//! the group's ranks share the process, through NCCL when it spans processes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use lemo_kernels::exchange::{DeviceRowExchange, RowExchange};

use super::local::LocalGroup;

/// The time a rank's host spends blocked in its sequence group's exchanges: host sums and
/// barriers, and device collectives, whose wait includes the device finishing the work queued
/// before them. Shared by the group and its NCCL communicator; read (and reset) once a step.
#[derive(Debug, Clone, Default)]
pub struct ExchangeClock(Arc<AtomicU64>);

impl ExchangeClock {
    /// `exchange()`, its duration added to the clock.
    pub fn time<T>(&self, exchange: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let result = exchange();
        let nanos = started.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        self.0.fetch_add(nanos, Ordering::Relaxed);
        result
    }

    /// Seconds added since the last call.
    pub fn take(&self) -> f64 {
        self.0.swap(0, Ordering::Relaxed) as f64 * 1e-9
    }
}

/// One rank's end of a sequence group.
pub struct SequenceGroup {
    /// The group's ranks when they are all in this process; `None` when the group spans
    /// processes (its host values then travel through NCCL).
    local: Option<Arc<LocalGroup>>,
    /// The rank's index in the group.
    index: usize,
    ranks: usize,
    /// The group's NCCL communicator, when its ranks are CUDA devices.
    #[cfg(feature = "cuda")]
    device: Option<super::nccl::SequenceComm>,
    clock: ExchangeClock,
}

impl SequenceGroup {
    /// Rank `index` of a group whose ranks are all this process's.
    pub fn new(group: Arc<LocalGroup>, index: usize) -> Self {
        Self {
            ranks: group.ranks(),
            local: Some(group),
            index,
            #[cfg(feature = "cuda")]
            device: None,
            clock: ExchangeClock::default(),
        }
    }

    /// The group with its NCCL communicator for rows on the device.
    #[cfg(feature = "cuda")]
    pub fn on_device(self, comm: super::nccl::SequenceComm) -> Self {
        Self {
            device: Some(comm.timed_by(self.clock.clone())),
            ..self
        }
    }

    /// Rank `index` of a group of `ranks` ranks in several processes, joined by `comm`.
    #[cfg(feature = "cuda")]
    pub fn spanning(index: usize, ranks: usize, comm: super::nccl::SequenceComm) -> Self {
        let clock = ExchangeClock::default();
        Self {
            local: None,
            index,
            ranks,
            device: Some(comm.timed_by(clock.clone())),
            clock,
        }
    }

    /// The clock of the rank's time in the group's exchanges.
    pub fn clock(&self) -> ExchangeClock {
        self.clock.clone()
    }

    /// The sum of `values` over the group; zeros when the group has stopped (the failure stays
    /// with the group, and the step's next collective reports it).
    fn sum(&self, values: Vec<f64>) -> Vec<f32> {
        let len = values.len();
        let sum = self.clock.time(|| match &self.local {
            Some(group) => group.sum(self.index, values).ok().map(|sum| sum.to_vec()),
            #[cfg(feature = "cuda")]
            None => self
                .device
                .as_ref()
                .and_then(|comm| comm.sum_host(values).ok()),
            #[cfg(not(feature = "cuda"))]
            None => None,
        });
        match sum {
            Some(sum) => sum.iter().map(|&v| v as f32).collect(),
            None => vec![0.0; len],
        }
    }
}

impl RowExchange for SequenceGroup {
    fn rank(&self) -> usize {
        self.index
    }

    fn ranks(&self) -> usize {
        self.ranks
    }

    fn all_gather(&self, local: Vec<f32>) -> Vec<f32> {
        let len = local.len();
        let mut placed = vec![0.0; len * self.ranks()];
        let own = &mut placed[self.index * len..(self.index + 1) * len];
        own.iter_mut()
            .zip(&local)
            .for_each(|(slot, &v)| *slot = v as f64);
        self.sum(placed)
    }

    fn reduce_scatter(&self, full: Vec<f32>) -> Vec<f32> {
        let share = full.len() / self.ranks();
        let sum = self.sum(full.into_iter().map(f64::from).collect());
        sum[self.index * share..(self.index + 1) * share].to_vec()
    }

    /// Ranks in other processes have autodiff graphs of their own: only the ranks of this
    /// process need to meet (see [`lemo_kernels::exchange::Exchange::before_backward`]).
    fn barrier(&self) {
        if self.local.is_some() {
            self.sum(Vec::new());
        }
    }

    fn device(&self) -> Option<&dyn DeviceRowExchange> {
        #[cfg(feature = "cuda")]
        if let Some(comm) = &self.device {
            return Some(comm);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_clock_adds_the_time_of_exchanges_until_taken() {
        let clock = ExchangeClock::default();
        let shared = clock.clone();
        assert_eq!(shared.time(|| 7), 7);
        shared.time(|| std::thread::sleep(Duration::from_millis(20)));
        let waited = clock.take();
        assert!((0.02..1.0).contains(&waited), "{waited}");
        assert_eq!(clock.take(), 0.0);
    }

    #[test]
    fn subgroups_gather_and_scatter_their_own_ranks_values() {
        let world = LocalGroup::new(4, Duration::from_secs(30));
        let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|rank| {
                    let world = world.clone();
                    s.spawn(move || {
                        let first = rank / 2 * 2;
                        let group = SequenceGroup::new(world.subgroup(first, 2), rank - first);
                        let gathered = group.all_gather(vec![rank as f32, 10.0 * rank as f32]);
                        let scattered = group.reduce_scatter(vec![1.0, 2.0, rank as f32, 3.0]);
                        (gathered, scattered)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(results[0].0, vec![0.0, 0.0, 1.0, 10.0]);
        assert_eq!(results[3].0, vec![2.0, 20.0, 3.0, 30.0]);
        assert_eq!(results[0].1, vec![2.0, 4.0]);
        assert_eq!(results[1].1, vec![1.0, 6.0]);
        assert_eq!(results[2].1, vec![2.0, 4.0]);
        assert_eq!(results[3].1, vec![5.0, 6.0]);
    }

    #[test]
    fn a_stopped_world_ends_a_subgroups_wait() {
        let world = LocalGroup::new(2, Duration::from_secs(30));
        let group = SequenceGroup::new(world.subgroup(0, 2), 0);
        let waiter = std::thread::spawn(move || group.all_gather(vec![1.0]));
        std::thread::sleep(Duration::from_millis(50));
        world.stop(1, "out of memory".into());
        assert_eq!(waiter.join().unwrap(), vec![0.0, 0.0]);
        let (rank, why) = world.stopped().unwrap();
        assert_eq!((rank, why.as_str()), (1, "out of memory"));
    }
}
