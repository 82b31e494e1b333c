//! The ranks of one process: a sum over the ranks' host values (the reduction of simulated
//! ranks, which share one device), and the liveness every in-process group needs, NCCL's too: a
//! rank that stops (an error, a panic) marks the group, and the ranks waiting on it end with an
//! error instead of waiting forever. Every wait also has a deadline, the collective timeout.
//! A sequence group of context parallelism is a subgroup of consecutive ranks with rounds of its
//! own: a rank that stops stops every group it is in, and a subgroup's ranks see their parent's
//! stops.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::PeerFailure;

/// One round of a sum: what each rank has contributed so far.
struct Round {
    /// Rounds completed so far.
    generation: u64,
    contributions: Vec<Option<Vec<f64>>>,
    /// The sum of the last completed round.
    result: Arc<Vec<f64>>,
    /// The first rank that stopped, and why.
    stopped: Option<(usize, String)>,
}

/// The shared state of a process's ranks.
pub struct LocalGroup {
    ranks: usize,
    timeout: Duration,
    round: Mutex<Round>,
    changed: Condvar,
    /// The group this one is a subgroup of, whose stops it shares.
    parent: Option<Arc<LocalGroup>>,
    /// Subgroups by their first rank.
    subgroups: Mutex<HashMap<usize, Arc<LocalGroup>>>,
}

impl LocalGroup {
    pub fn new(ranks: usize, timeout: Duration) -> Arc<Self> {
        Self::with_parent(ranks, timeout, None)
    }

    fn with_parent(ranks: usize, timeout: Duration, parent: Option<Arc<Self>>) -> Arc<Self> {
        Arc::new(Self {
            ranks,
            timeout,
            round: Mutex::new(Round {
                generation: 0,
                contributions: vec![None; ranks],
                result: Arc::new(Vec::new()),
                stopped: None,
            }),
            changed: Condvar::new(),
            parent,
            subgroups: Mutex::new(HashMap::new()),
        })
    }

    /// The subgroup of the `ranks` consecutive ranks from `first` (indices in this group): made
    /// by the first of them to ask, the same one for the others.
    pub fn subgroup(self: &Arc<Self>, first: usize, ranks: usize) -> Arc<Self> {
        let mut subgroups = self.subgroups.lock().unwrap_or_else(|e| e.into_inner());
        subgroups
            .entry(first)
            .or_insert_with(|| Self::with_parent(ranks, self.timeout, Some(self.clone())))
            .clone()
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        // A rank that panicked while holding the lock left a consistent round behind: every
        // update below is a single assignment.
        self.round.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sums `values` over the ranks: every rank gets the same sum, added in rank order.
    /// Once a rank has stopped, every later sum fails at once.
    pub fn sum(&self, rank: usize, values: Vec<f64>) -> Result<Arc<Vec<f64>>, PeerFailure> {
        let deadline = Instant::now() + self.timeout;
        if let Some((who, why)) = self.stopped() {
            return Err(PeerFailure(format!("rank {who} stopped ({why})")));
        }
        let mut round = self.lock();
        let generation = round.generation;
        round.contributions[rank] = Some(values);
        if round.contributions.iter().all(Option::is_some) {
            let contributions: Vec<Vec<f64>> = round
                .contributions
                .iter_mut()
                .map(|c| c.take().expect("checked above"))
                .collect();
            let len = contributions[0].len();
            if contributions.iter().any(|c| c.len() != len) {
                let message = "the ranks reduced buffers of different sizes".to_string();
                round.stopped.get_or_insert((rank, message.clone()));
                self.changed.notify_all();
                return Err(PeerFailure(message));
            }
            let mut sum = vec![0.0; len];
            for contribution in &contributions {
                for (s, v) in sum.iter_mut().zip(contribution) {
                    *s += v;
                }
            }
            round.result = Arc::new(sum);
            round.generation += 1;
            self.changed.notify_all();
            return Ok(round.result.clone());
        }
        loop {
            if round.generation != generation {
                return Ok(round.result.clone());
            }
            if let Some((who, why)) = round.stopped.clone().or_else(|| self.parent_stopped()) {
                return Err(PeerFailure(format!("rank {who} stopped ({why})")));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<String> = (0..self.ranks)
                    .filter(|&r| round.contributions[r].is_none())
                    .map(|r| r.to_string())
                    .collect();
                let message = format!(
                    "rank {rank}: no answer from rank {} within {} s (--collective-timeout)",
                    missing.join(", "),
                    self.timeout.as_secs()
                );
                round.stopped.get_or_insert((rank, message.clone()));
                self.changed.notify_all();
                drop(round);
                if let Some(parent) = &self.parent {
                    parent.stop(rank, message.clone());
                }
                return Err(PeerFailure(message));
            }
            // A subgroup also looks at its parent's stops, which do not wake it.
            let wait = (deadline - now).min(Duration::from_millis(100));
            round = self
                .changed
                .wait_timeout(round, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Marks `rank` as stopped for `why`: the ranks waiting on it, now or later, end with an
    /// error, in this group and its subgroups (which look at it at least every 100 ms).
    pub fn stop(&self, rank: usize, why: String) {
        self.lock().stopped.get_or_insert((rank, why));
        self.changed.notify_all();
    }

    /// The first rank that stopped (here or in the parent group), and why.
    pub fn stopped(&self) -> Option<(usize, String)> {
        let own = self.lock().stopped.clone();
        own.or_else(|| self.parent_stopped())
    }

    fn parent_stopped(&self) -> Option<(usize, String)> {
        self.parent.as_ref().and_then(|parent| parent.stopped())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_get_the_same_sum_round_after_round() {
        let group = LocalGroup::new(3, Duration::from_secs(30));
        let sums: Vec<Vec<Vec<f64>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    let group = group.clone();
                    s.spawn(move || {
                        (0..20)
                            .map(|round| {
                                let values = vec![rank as f64, round as f64];
                                group.sum(rank, values).unwrap().to_vec()
                            })
                            .collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for rank in &sums {
            for (round, sum) in rank.iter().enumerate() {
                assert_eq!(sum, &vec![3.0, 3.0 * round as f64]);
            }
        }
    }

    #[test]
    fn a_stopped_rank_ends_the_wait_and_a_silent_one_times_out() {
        let group = LocalGroup::new(2, Duration::from_secs(30));
        let waiter = {
            let group = group.clone();
            std::thread::spawn(move || group.sum(0, vec![1.0]))
        };
        std::thread::sleep(Duration::from_millis(50));
        group.stop(1, "out of memory".into());
        let error = waiter.join().unwrap().unwrap_err();
        assert!(
            error.0.contains("rank 1 stopped (out of memory)"),
            "{}",
            error.0
        );

        let silent = LocalGroup::new(2, Duration::from_millis(100));
        let error = silent.sum(0, vec![1.0]).unwrap_err();
        assert!(error.0.contains("no answer from rank 1"), "{}", error.0);
    }
}
