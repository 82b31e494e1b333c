//! Which training sequences each rank reads. The corpus serves one stream of sequences whose
//! order depends on the seed alone; micro-step `m` of step `s` takes the next
//! `ranks x batch` of them, and rank `r` reads its `batch` consecutive ones. So the global batch
//! is ranks x batch x grad-accum, and N ranks of batch b read, at every step, exactly the
//! sequences one rank of batch N x b reads: the data order is the same whatever the rank count.

/// One rank's slice of every micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub ranks: usize,
    /// Sequences per micro-batch of one rank.
    pub batch: usize,
    pub grad_accum: usize,
}

impl Shard {
    /// Positions in the corpus's sequence stream of this rank's sequences in micro-batch `micro`
    /// of step `step`.
    pub fn sequences(&self, step: usize, micro: usize) -> std::ops::Range<usize> {
        let global_batch = self.ranks * self.batch;
        let first = (step * self.grad_accum + micro) * global_batch + self.rank * self.batch;
        first..first + self.batch
    }

    /// Positions in the sequence stream of every rank's sequences of `step`, all micro-batches.
    pub fn global_batch(&self, step: usize) -> std::ops::Range<usize> {
        let size = self.ranks * self.batch * self.grad_accum;
        step * size..(step + 1) * size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_split_the_single_rank_stream() {
        let one = Shard {
            rank: 0,
            ranks: 1,
            batch: 4,
            grad_accum: 3,
        };
        for step in 0..5 {
            for micro in 0..3 {
                let whole: Vec<usize> = one.sequences(step, micro).collect();
                let split: Vec<usize> = (0..2)
                    .flat_map(|rank| {
                        Shard {
                            rank,
                            ranks: 2,
                            batch: 2,
                            ..one
                        }
                        .sequences(step, micro)
                    })
                    .collect();
                assert_eq!(split, whole, "step {step} micro {micro}");
                assert!(whole.iter().all(|i| one.global_batch(step).contains(i)));
            }
        }
    }
}
