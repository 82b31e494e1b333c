//! Ctrl-C (SIGINT) and SIGTERM while training: the first asks the run to stop after the
//! current step, write a checkpoint and say how to resume; a second exits at once (the
//! checkpoint being written, if any, stays a `.partial` folder that resume ignores). Before the
//! first step (loading, calibration) there is nothing to save, and the first exits at once.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static SIGNALS: AtomicUsize = AtomicUsize::new(0);
static STEPPING: AtomicBool = AtomicBool::new(false);

/// The exit status of a run stopped by a signal (the shell's 128 + SIGINT).
pub const EXIT_STATUS: i32 = 130;

extern "C" fn on_signal(_: libc::c_int) {
    if !STEPPING.load(Ordering::SeqCst) {
        let message = b"\ninterrupt: stopped before the first step; run the same command again (or --resume the folder) to start over\n";
        // SAFETY: write and _exit are async-signal-safe.
        unsafe {
            libc::write(2, message.as_ptr().cast(), message.len());
            libc::_exit(EXIT_STATUS)
        };
    }
    if SIGNALS.fetch_add(1, Ordering::SeqCst) > 0 {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(EXIT_STATUS) };
    }
    let message =
        b"\ninterrupt: finishing this step and writing a checkpoint (interrupt again to quit now)\n";
    // SAFETY: write is async-signal-safe; a failed write of the notice is harmless.
    unsafe { libc::write(2, message.as_ptr().cast(), message.len()) };
}

/// Routes SIGINT and SIGTERM to the run from now on.
pub fn install() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only touches an atomic and calls async-signal-safe functions.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// From now on a signal stops the run after its step (with a checkpoint) instead of at once.
pub fn steps_started() {
    STEPPING.store(true, Ordering::SeqCst);
}

/// Whether a signal asked the run to stop.
pub fn requested() -> bool {
    SIGNALS.load(Ordering::SeqCst) > 0
}
