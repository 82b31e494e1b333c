//! Data-parallel ranks of one process and the collectives between them.
//!
//! Each rank runs on a thread of its own with its own device. Gradients are summed as one flat
//! f32 bucket per step: through NCCL between CUDA devices ([`Engine::Nccl`]), or in process
//! memory between simulated ranks that share one device ([`Engine::InProcess`], which is how
//! the multi-rank path is tested on the CPU). The few host values a step agrees on (loss sums,
//! kept fractions, memory, a stop request) are summed in process memory. A rank that fails
//! stops the group: the others end with an error, and every wait has a deadline (the collective
//! timeout), so no rank waits forever.

pub mod launch;
pub mod local;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod sequence;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, bail};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use lemo_kernels::exchange::Exchange;

use local::LocalGroup;
use sequence::{ExchangeClock, SequenceGroup};

/// A collective ended because another rank stopped or did not answer in time: a consequence,
/// not the cause, of a failed run.
#[derive(Debug)]
pub struct PeerFailure(pub String);

impl std::fmt::Display for PeerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PeerFailure {}

/// What sums the gradient buckets.
pub enum Engine {
    /// Ranks share one device; buckets are summed in process memory.
    InProcess,
    /// One CUDA device per rank (rank r on device r); buckets are summed by NCCL.
    #[cfg(feature = "cuda")]
    Nccl(nccl::UniqueId),
}

/// Which ranks this process runs: all of them (one thread each), or, under a launcher, one
/// rank of a group that spans processes.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// Ranks in all.
    pub world: usize,
    /// The first of this process's ranks, and its CUDA device; the next ranks take the next
    /// devices.
    pub first_rank: usize,
    pub first_device: usize,
    /// Ranks this process runs.
    pub local: usize,
}

impl Layout {
    /// Every rank in this process, rank r on device r.
    pub fn local(ranks: usize) -> Self {
        Self {
            world: ranks,
            first_rank: 0,
            first_device: 0,
            local: ranks,
        }
    }
}

/// One rank's end of the group.
pub struct Communicator {
    rank: usize,
    /// Index among this process's ranks.
    local: usize,
    world: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    device: usize,
    group: Arc<LocalGroup>,
    #[cfg(feature = "cuda")]
    nccl: Option<(nccl::UniqueId, Option<nccl::NcclComm>)>,
}

impl Communicator {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn ranks(&self) -> usize {
        self.world
    }

    /// Index among this process's ranks (the rank itself unless launched one per process).
    pub fn local(&self) -> usize {
        self.local
    }

    /// The NCCL communicator, made at the first sum, once every rank is known to be up (a
    /// blocking NCCL initialization would wait forever for a rank that failed to load).
    #[cfg(feature = "cuda")]
    fn nccl(&mut self) -> Result<Option<&mut nccl::NcclComm>> {
        let (rank, world, device) = (self.rank, self.world, self.device);
        let Some((id, comm)) = &mut self.nccl else {
            return Ok(None);
        };
        if comm.is_none() {
            *comm = Some(nccl::NcclComm::new(rank, world, device, id)?);
        }
        Ok(comm.as_mut())
    }

    /// Joins the NCCL communicator now rather than at the first sum.
    pub fn connect(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        self.nccl()?;
        Ok(())
    }

    /// Sums `values` over the ranks, in place: in process memory among the ranks of one
    /// process, through NCCL when the group spans processes.
    pub fn sum_host(&mut self, values: &mut [f64]) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        if self.group.ranks() < self.world {
            #[cfg(feature = "cuda")]
            {
                let group = self.group.clone();
                if let Some(comm) = self.nccl()? {
                    return comm.sum_host(values, &group);
                }
            }
            anyhow::bail!("ranks in several processes need NCCL (CUDA)");
        }
        let sum = self.group.sum(self.local, values.to_vec())?;
        values.copy_from_slice(&sum);
        Ok(())
    }

    /// This rank's end of its sequence group (context parallelism): the `size` consecutive
    /// ranks from `rank / size * size`. Rows on CUDA devices travel through an NCCL
    /// communicator split from the world's (every rank makes its group at the same point); the
    /// few host values run in process memory when the group's ranks are all this process's, and
    /// through that communicator when they are not. With the clock of the rank's time in the
    /// group's exchanges.
    pub fn sequence_group(&mut self, size: usize) -> Result<(Exchange, ExchangeClock)> {
        let first = self.rank / size * size;
        let first_here = self.rank - self.local;
        let in_process = first >= first_here && first + size <= first_here + self.group.ranks();
        let index = self.rank - first;
        #[cfg(feature = "cuda")]
        {
            let (rank, group) = (self.rank, self.group.clone());
            if let Some(world) = self.nccl()? {
                let mut comm = |group| -> Result<nccl::SequenceComm> {
                    Ok(nccl::SequenceComm::new(
                        world.split(first, rank)?,
                        group,
                        rank,
                    ))
                };
                let sequence_group = match in_process {
                    true => {
                        let subgroup = group.subgroup(first - first_here, size);
                        SequenceGroup::new(subgroup.clone(), index).on_device(comm(subgroup)?)
                    }
                    false => SequenceGroup::spanning(index, size, comm(group)?),
                };
                let clock = sequence_group.clock();
                return Ok((Exchange(Arc::new(sequence_group)), clock));
            }
        }
        if !in_process {
            bail!(
                "--context-parallel {size}: a sequence group over several processes exchanges keys and values through NCCL, which needs --device cuda"
            );
        }
        let subgroup = self.group.subgroup(first - first_here, size);
        let sequence_group = SequenceGroup::new(subgroup, index);
        let clock = sequence_group.clock();
        Ok((Exchange(Arc::new(sequence_group)), clock))
    }

    /// Sums a flat f32 bucket over the ranks; every rank gets the sum.
    pub fn sum_tensor<B: Backend>(&mut self, bucket: Tensor<B, 1>) -> Result<Tensor<B, 1>> {
        if self.ranks() == 1 {
            return Ok(bucket);
        }
        #[cfg(feature = "cuda")]
        {
            let group = self.group.clone();
            if let Some(comm) = self.nccl()? {
                return comm.sum(bucket, &group);
            }
        }
        let device = bucket.device();
        let values = bucket
            .into_data()
            .convert::<f64>()
            .into_vec::<f64>()
            .map_err(|e| anyhow::anyhow!("gradient bucket: {e:?}"))?;
        let len = values.len();
        let sum = self.group.sum(self.local, values)?;
        let sum: Vec<f32> = sum.iter().map(|&v| v as f32).collect();
        Ok(Tensor::from_data(TensorData::new(sum, [len]), &device))
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.group.stop(self.rank, "it panicked".into());
        }
    }
}

/// Runs `body` once per rank of this process, each on a thread of its own, and returns the
/// ranks' outputs in rank order. When ranks fail, the error is the first one that is not a
/// consequence of another rank's failure.
pub fn run_ranks<T: Send>(
    layout: Layout,
    timeout: Duration,
    engine: Engine,
    body: impl Fn(&mut Communicator) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let group = LocalGroup::new(layout.local, timeout);
    #[cfg(feature = "cuda")]
    let nccl_id = match engine {
        Engine::Nccl(id) => Some(id),
        Engine::InProcess => None,
    };
    #[cfg(not(feature = "cuda"))]
    let Engine::InProcess = engine;
    let body = &body;
    let results: Vec<std::thread::Result<Result<T>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..layout.local)
            .map(|local| {
                let rank = layout.first_rank + local;
                let mut communicator = Communicator {
                    rank,
                    local,
                    world: layout.world,
                    device: layout.first_device + local,
                    group: group.clone(),
                    #[cfg(feature = "cuda")]
                    nccl: nccl_id.map(|id| (id, None)),
                };
                // `rank-N` when there are several: the panic hook names the rank that failed.
                let name = match layout.world {
                    1 => "train".to_string(),
                    _ => format!("rank-{rank}"),
                };
                std::thread::Builder::new()
                    .name(name)
                    // The main thread's size: deep autodiff graphs recurse.
                    .stack_size(64 << 20)
                    .spawn_scoped(scope, move || {
                        // Ranks in other processes are known to be up only now, just after the
                        // rendezvous: NCCL's blocking initialization cannot wait on a rank
                        // that died while loading.
                        let result = match layout.local < layout.world {
                            true => communicator.connect(),
                            false => Ok(()),
                        }
                        .and_then(|()| body(&mut communicator));
                        if let Err(error) = &result {
                            let why = format!("{error:#}");
                            let first = why.lines().next().unwrap_or("").to_string();
                            communicator.group.stop(rank, first);
                        }
                        result
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        handles.into_iter().map(|handle| handle.join()).collect()
    });
    // A rank that panicked has had its message printed (by the panic hook); the run ends as a
    // panic of one device would, without a second message.
    let results: Vec<Result<T>> = match results.into_iter().collect() {
        Ok(results) => results,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    let mut outputs = Vec::with_capacity(layout.local);
    let mut consequence = None;
    for (local, result) in results.into_iter().enumerate() {
        match result {
            Ok(output) => outputs.push(output),
            Err(error) if error.downcast_ref::<PeerFailure>().is_some() => {
                consequence.get_or_insert(error);
            }
            Err(error) if layout.world > 1 => {
                return Err(error.context(format!("rank {}", layout.first_rank + local)));
            }
            Err(error) => return Err(error),
        }
    }
    match consequence {
        Some(error) => Err(error),
        None => Ok(outputs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::bail;
    use burn::backend::NdArray;

    #[test]
    fn simulated_ranks_sum_buckets_and_name_the_rank_that_failed() {
        type B = NdArray<f32>;
        let sums = run_ranks(
            Layout::local(2),
            Duration::from_secs(30),
            Engine::InProcess,
            |comm| {
                let rank = comm.rank() as f32;
                let bucket = Tensor::<B, 1>::from_floats([rank, 1.0 + rank], &Default::default());
                let sum = comm.sum_tensor(bucket)?;
                let mut host = [rank as f64];
                comm.sum_host(&mut host)?;
                Ok((sum.into_data().into_vec::<f32>().unwrap(), host[0]))
            },
        )
        .unwrap();
        assert_eq!(sums, vec![(vec![1.0, 3.0], 1.0); 2]);

        let error = run_ranks(
            Layout::local(2),
            Duration::from_secs(30),
            Engine::InProcess,
            |comm| {
                if comm.rank() == 1 {
                    bail!("out of memory");
                }
                comm.sum_host(&mut [1.0])
            },
        )
        .unwrap_err();
        assert_eq!(format!("{error:#}"), "rank 1: out of memory");
    }
}
