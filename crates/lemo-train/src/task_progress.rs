//! Progress of a long step that is not a training run (calibration, profiling, predictor
//! training, evaluation): a bar with an ETA on a terminal, and when stderr is piped to a file, a
//! plain line at most every few seconds and at the end, so logs stay readable.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often a piped log gets a line.
const PIPED_EVERY: Duration = Duration::from_secs(10);

pub struct TaskProgress {
    bar: ProgressBar,
    what: String,
    len: u64,
    started: Instant,
    /// When stderr is not a terminal: when the last line was printed.
    piped: Option<Instant>,
}

impl TaskProgress {
    /// `len` units of work called `what`; `show` false draws nothing (another rank reports).
    pub fn new(len: u64, what: &str, show: bool) -> Self {
        let terminal = std::io::stderr().is_terminal();
        let bar = match show && terminal {
            true => ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr()),
            false => ProgressBar::hidden(),
        };
        bar.set_style(
            ProgressStyle::with_template("{msg} {bar:30.cyan/blue} {pos}/{len} | ETA {eta}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_message(what.to_string());
        Self {
            bar,
            what: what.to_string(),
            len,
            started: Instant::now(),
            piped: (show && !terminal).then(Instant::now),
        }
    }

    /// One more unit done, with `detail` (a running figure) beside the count.
    pub fn inc(&mut self, detail: &str) {
        self.bar.inc(1);
        if !detail.is_empty() {
            self.bar.set_message(format!("{} {detail}", self.what));
        }
        let done = self.bar.position();
        if let Some(last) = &mut self.piped
            && (last.elapsed() >= PIPED_EVERY || done == self.len)
        {
            *last = Instant::now();
            let elapsed = self.started.elapsed().as_secs_f64();
            let eta = elapsed / done.max(1) as f64 * self.len.saturating_sub(done) as f64;
            eprintln!(
                "{} {done}/{} {detail} | {elapsed:.0}s elapsed, ETA {eta:.0}s",
                self.what, self.len
            );
        }
    }

    pub fn finish(self) {
        self.bar.finish_and_clear();
    }
}
