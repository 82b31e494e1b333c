//! Training progress on stderr: a bar that fits an 80-column terminal, or, when stderr is not
//! a terminal (piped to a log), a full line every twentieth of the run and at least every
//! `PIPED_INTERVAL`, each with the elapsed time, the ETA and the latest validation loss.

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

const PIPED_INTERVAL: Duration = Duration::from_secs(60);

/// What one step reports.
pub struct StepReport {
    pub loss: f64,
    pub lr: f64,
    pub tokens_per_s: f64,
    /// The largest peak over the ranks: live tensors (the pools' own figure), or the process's
    /// resident set where the backend keeps tensors in host memory (`host_memory`).
    pub mem_gib: f64,
    pub host_memory: bool,
    /// The largest device-level peak over the ranks (pools' reservations, context and library
    /// workspaces included: what runs out), where the device says.
    pub device_gib: Option<f64>,
    /// Kept fractions (attention, MLP) of `--method lemo`.
    pub kept: Option<(f64, f64)>,
    /// With several ranks: each rank's peak memory, and the share of the step spent summing
    /// gradients (waiting for the slowest rank included).
    pub ranks: Option<RankReport>,
}

pub struct RankReport {
    pub mem_gib: Vec<f64>,
    pub device_gib: Option<Vec<f64>>,
    pub allreduce_share: f64,
}

pub struct Progress {
    bar: ProgressBar,
    steps: usize,
    start: usize,
    started: Instant,
    last_line: Instant,
    val_loss: Option<f64>,
}

impl Progress {
    pub fn new(steps: usize, start: usize) -> Self {
        let bar = ProgressBar::with_draw_target(Some(steps as u64), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template("{bar:12.cyan/blue} {pos}/{len} {msg} ETA {eta}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_position(start as u64);
        bar.reset_eta();
        Self {
            bar,
            steps,
            start,
            started: Instant::now(),
            last_line: Instant::now(),
            val_loss: None,
        }
    }

    pub fn step(&mut self, done: usize, report: &StepReport) {
        self.bar.set_position(done as u64);
        self.bar
            .set_message(terminal_message(report, self.val_loss));
        let periodic = done.is_multiple_of((self.steps / 20).max(1));
        if self.bar.is_hidden()
            && (done == self.start + 1
                || periodic
                || done == self.steps
                || self.last_line.elapsed() >= PIPED_INTERVAL)
        {
            eprintln!("{}", self.piped_line(done, report));
            self.last_line = Instant::now();
        }
    }

    pub fn validation(&mut self, done: usize, val_loss: f64) {
        self.val_loss = Some(val_loss);
        self.bar.println(format!(
            "step {done}: validation loss {val_loss:.4} (perplexity {:.3})",
            val_loss.exp()
        ));
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }

    pub fn abandon(&self) {
        self.bar.abandon();
    }

    fn piped_line(&self, done: usize, report: &StepReport) -> String {
        let elapsed = self.started.elapsed();
        let per_step = elapsed.as_secs_f64() / (done - self.start).max(1) as f64;
        let eta = Duration::from_secs_f64(per_step * (self.steps - done) as f64);
        let val = self
            .val_loss
            .map_or(String::new(), |v| format!(" | val {v:.4}"));
        let kept = report
            .kept
            .map_or(String::new(), |(a, m)| format!(" | kept {a:.2}/{m:.2}"));
        let gib = |values: &[f64]| -> String {
            let values: Vec<String> = values.iter().map(|m| format!("{m:.2}")).collect();
            values.join("/")
        };
        let device = |values: Option<&[f64]>| {
            values.map_or(String::new(), |v| format!(" (device {})", gib(v)))
        };
        let mem = match &report.ranks {
            Some(ranks) => format!(
                "mem {} GiB by rank{} | all-reduce {:.1}%",
                gib(&ranks.mem_gib),
                device(ranks.device_gib.as_deref()),
                100.0 * ranks.allreduce_share
            ),
            None => format!(
                "{} {} GiB{}",
                if report.host_memory {
                    "host mem"
                } else {
                    "mem"
                },
                gib(&[report.mem_gib]),
                device(report.device_gib.as_ref().map(std::slice::from_ref))
            ),
        };
        format!(
            "step {done}/{} | loss {:.4}{val} | lr {:.2e} | {:.0} tok/s | {mem}{kept} | \
             elapsed {} | ETA {}",
            self.steps,
            report.loss,
            report.lr,
            report.tokens_per_s,
            clock(elapsed),
            clock(eta)
        )
    }
}

/// The bar's message, short enough that with the 12-column bar, `99999/99999` and `ETA 59m`
/// the line stays within 80 columns: the kept fractions of `--method lemo` take the place of
/// the throughput, and the device-level peak that of the live one (the piped lines and
/// metrics.jsonl keep both).
fn terminal_message(report: &StepReport, val_loss: Option<f64>) -> String {
    let mut message = format!("loss {:.3}", report.loss);
    if let Some(v) = val_loss {
        message.push_str(&format!(" val {v:.3}"));
    }
    match report.kept {
        Some((a, m)) => message.push_str(&format!(" kept {a:.2}/{m:.2}")),
        None => message.push_str(&format!(" {} tok/s", compact(report.tokens_per_s))),
    }
    // The device-level peak where known: it is what runs out.
    let mem = report.device_gib.unwrap_or(report.mem_gib);
    message.push_str(&format!(" {mem:.1}G"));
    message
}

/// `1234` -> `1234`, `12345` -> `12.3k`, `1234567` -> `1.2M`.
fn compact(value: f64) -> String {
    match value {
        v if v >= 1e6 => format!("{:.1}M", v / 1e6),
        v if v >= 1e4 => format!("{:.1}k", v / 1e3),
        v => format!("{v:.0}"),
    }
}

/// `h:mm:ss` or `m:ss`.
fn clock(duration: Duration) -> String {
    let s = duration.as_secs();
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_terminal_line_fits_80_columns() {
        for (kept, device_gib) in [(None, None), (Some((0.5, 0.5)), Some(141.2))] {
            let report = StepReport {
                loss: 12.3456,
                lr: 2e-4,
                tokens_per_s: 123456.0,
                mem_gib: 139.9,
                host_memory: false,
                device_gib,
                kept,
                ranks: None,
            };
            let message = terminal_message(&report, Some(12.3456));
            // bar, position, message and the widest ETA indicatif prints below an hour ("59m").
            let line = format!("{} 99999/99999 {message} ETA 59m", "=".repeat(12));
            assert!(line.len() <= 80, "{} columns: {line}", line.len());
        }
    }

    #[test]
    fn the_piped_line_puts_the_device_peak_beside_the_pools() {
        let progress = Progress::new(10, 0);
        let mut report = StepReport {
            loss: 2.0,
            lr: 1e-4,
            tokens_per_s: 1000.0,
            mem_gib: 30.31,
            host_memory: false,
            device_gib: None,
            kept: None,
            ranks: None,
        };
        let line = |report: &StepReport| progress.piped_line(1, report);
        assert!(
            line(&report).contains("| mem 30.31 GiB |"),
            "{}",
            line(&report)
        );
        report.host_memory = true;
        assert!(
            line(&report).contains("| host mem 30.31 GiB |"),
            "{}",
            line(&report)
        );
        report.host_memory = false;
        report.device_gib = Some(44.05);
        assert!(
            line(&report).contains("| mem 30.31 GiB (device 44.05) |"),
            "{}",
            line(&report)
        );
        report.ranks = Some(RankReport {
            mem_gib: vec![30.31, 30.5],
            device_gib: Some(vec![45.92, 44.98]),
            allreduce_share: 0.005,
        });
        assert!(
            line(&report)
                .contains("mem 30.31/30.50 GiB by rank (device 45.92/44.98) | all-reduce 0.5%"),
            "{}",
            line(&report)
        );
    }

    #[test]
    fn clocks_and_compact_numbers() {
        assert_eq!(clock(Duration::from_secs(75)), "1:15");
        assert_eq!(clock(Duration::from_secs(3725)), "1:02:05");
        assert_eq!(compact(950.0), "950");
        assert_eq!(compact(12345.0), "12.3k");
    }
}
