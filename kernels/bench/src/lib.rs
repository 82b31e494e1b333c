//! Timing shared by the benchmark binaries.

use std::time::Duration;

use cubecl::prelude::{ComputeClient, Runtime};

/// Median device time of one call: `repeats` timed loops of `calls` back-to-back calls (each loop
/// between two device synchronizations, cubecl's profiler), after one warm-up loop.
pub fn time_calls<R: Runtime, O: Send + 'static>(
    client: &ComputeClient<R>,
    repeats: usize,
    calls: usize,
    run: impl Fn() -> O + Send + Sync,
) -> Duration {
    let looped = || {
        let mut last = None;
        for _ in 0..calls {
            last = Some(run());
        }
        last
    };
    drop(looped());
    let mut times: Vec<Duration> = (0..repeats.max(1))
        .map(|_| {
            let (output, duration) = client.profile(looped, "lemo_bench").expect("profiling");
            drop(output);
            cubecl::future::block_on(duration.resolve()).duration() / calls as u32
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}
