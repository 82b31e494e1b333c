//! How a failure reaches the user: one line on stderr, whatever failed.

/// Errors from deep inside a backend surface as panics; they are shown as one line like any
/// other. Only the first is shown: on several GPUs the panics that follow (the other ranks, a
/// device left broken by the first) are its consequences, and the first names the cause.
pub fn report_panics_in_one_line() {
    static REPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    std::panic::set_hook(Box::new(|info| {
        if REPORTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        // A rank's thread is named `rank-N`: say which GPU failed.
        let rank = std::thread::current()
            .name()
            .and_then(|name| name.strip_prefix("rank-"))
            .map(|rank| format!("rank {rank}: "))
            .unwrap_or_default();
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("unknown panic");
        let first_line = message.lines().next().unwrap_or("");
        if message.contains("No possible adapter available") {
            eprintln!(
                "error: --device wgpu: no Vulkan or GL adapter on this machine (a software one: apt-get install mesa-vulkan-drivers)"
            );
        } else if crate::memory::is_out_of_memory(message) {
            eprintln!(
                "error: {rank}the device ran out of memory ({first_line}): try a shorter --seq-len (training: a smaller --memory-budget, --checkpointing or a smaller --batch-size)"
            );
        } else {
            eprintln!("error: {rank}internal failure: {first_line}");
        }
        // For a bug report: where it failed, and how it got there.
        if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
            if let Some(location) = info.location() {
                eprintln!("  at {location}");
            }
            eprintln!("{}", std::backtrace::Backtrace::force_capture());
        }
    }));
}
