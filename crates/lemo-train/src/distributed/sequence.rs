//! The sequence groups of context parallelism between the ranks of one process: the all-gather
//! and reduce-scatter of [`lemo_kernels::exchange`] as sums of the group's host values (an
//! all-gather is the sum of each rank's values placed in its own part of a zeroed buffer).

use std::sync::Arc;

use lemo_kernels::exchange::RowExchange;

use super::local::LocalGroup;

/// One rank's end of a sequence group.
pub struct SequenceGroup {
    group: Arc<LocalGroup>,
    /// The rank's index in the group.
    index: usize,
}

impl SequenceGroup {
    pub fn new(group: Arc<LocalGroup>, index: usize) -> Self {
        Self { group, index }
    }

    /// The sum of `values` over the group; zeros when the group has stopped (the failure stays
    /// with the group, and the step's next collective reports it).
    fn sum(&self, values: Vec<f64>) -> Vec<f32> {
        let len = values.len();
        match self.group.sum(self.index, values) {
            Ok(sum) => sum.iter().map(|&v| v as f32).collect(),
            Err(_) => vec![0.0; len],
        }
    }
}

impl RowExchange for SequenceGroup {
    fn rank(&self) -> usize {
        self.index
    }

    fn ranks(&self) -> usize {
        self.group.ranks()
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

    fn barrier(&self) {
        self.sum(Vec::new());
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

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
