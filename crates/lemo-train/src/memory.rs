//! Memory accounting: device memory in use where the backend can say (CubeCL's memory pools on
//! CUDA and wgpu), else the process's resident set (the CPU backend keeps tensors in host memory).
//! The probe is the calling thread's: each rank of a data-parallel run reads its own device.
//!
//! CubeCL reports the bytes in use by the calling thread's stream and keeps no peak, so the peak
//! here is the maximum over the samples taken (after the forward pass, after the backward pass,
//! after the optimizer step); on the CPU the kernel's own high-water mark (`VmHWM`) is exact.

use std::cell::RefCell;

/// One reading, in bytes.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct MemorySample {
    /// Bytes in use now.
    pub in_use: u64,
    /// Bytes reserved from the device (pools included), when known.
    pub reserved: u64,
    /// Process peak resident set on the CPU; 0 where unknown.
    pub os_peak: u64,
    /// What the whole device has in use (`cuMemGetInfo`: pools, context, library workspaces),
    /// what `nvidia-smi` shows; 0 where unknown.
    pub device_used: u64,
}

type Probe = Box<dyn Fn() -> MemorySample>;

thread_local! {
    static PROBE: RefCell<Option<Probe>> = const { RefCell::new(None) };
}

/// Installs the calling thread's probe for the device it runs on.
pub fn set_probe(probe: Probe) {
    PROBE.with(|p| *p.borrow_mut() = Some(probe));
}

/// Reads the calling thread's probe, or the process's resident set when none is installed.
pub fn sample() -> MemorySample {
    PROBE.with(|p| match p.borrow().as_ref() {
        Some(probe) => probe(),
        None => process_memory(),
    })
}

/// What this sampling point's memory is called in reports: device bytes or host RSS.
pub fn source() -> &'static str {
    PROBE.with(|p| match p.borrow().is_some() {
        true => "device",
        false => "host-rss",
    })
}

/// Resident set size and its high-water mark from `/proc/self/status` (Linux); zeros elsewhere.
pub fn process_memory() -> MemorySample {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return MemorySample::default();
    };
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    let rss = field("VmRSS:");
    MemorySample {
        in_use: rss,
        reserved: rss,
        os_peak: field("VmHWM:"),
        device_used: 0,
    }
}

/// A probe over a CubeCL runtime's memory pools.
pub fn cubecl_probe<R: cubecl::Runtime>(device: R::Device) -> Probe {
    let client = R::client(&device);
    Box::new(move || match client.memory_usage() {
        Ok(usage) => MemorySample {
            in_use: usage.bytes_in_use,
            reserved: usage.bytes_reserved,
            os_peak: 0,
            device_used: 0,
        },
        Err(_) => MemorySample::default(),
    })
}

/// A probe over any backend's device memory (see `lemo_kernels::memory`).
pub fn backend_probe<B: lemo_kernels::ComputeBackend>(device: B::Device) -> Probe {
    Box::new(move || {
        let stats = lemo_kernels::memory::memory_stats::<B>(&device);
        MemorySample {
            in_use: stats.bytes_in_use,
            reserved: stats.bytes_reserved,
            os_peak: 0,
            device_used: stats.device_used.unwrap_or(0),
        }
    })
}

/// Tracks the largest readings seen.
#[derive(Debug, Default, Clone, Copy)]
pub struct PeakTracker {
    /// Bytes in use (the pools' live tensors, or the process's resident set on the CPU).
    pub peak: u64,
    /// The device-level reading (0 where unknown). The pools keep their pages within a step, so
    /// sampling where live memory peaks also catches the most the device held.
    pub device_peak: u64,
}

impl PeakTracker {
    pub fn record(&mut self) -> MemorySample {
        let s = sample();
        self.peak = self.peak.max(s.in_use).max(s.os_peak);
        self.device_peak = self.device_peak.max(s.device_used);
        s
    }
}

pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Whether an error says the device ran out of memory: CubeCL's "out-of-memory" launch error,
/// a failed buffer allocation, CUDA's `CUDA_ERROR_OUT_OF_MEMORY`.
pub fn is_out_of_memory(message: &str) -> bool {
    let letters: String = message
        .to_lowercase()
        .chars()
        .filter(char::is_ascii_alphabetic)
        .collect();
    letters.contains("outofmemory") || letters.contains("allocat")
}

/// The device-level memory in use on GPU 0 as `nvidia-smi` counts it (NVML), polled every 10 ms
/// on its own thread: what the memory pools reserve, library workspaces and the CUDA context
/// included, which is what runs out. The idle level is read when the watch starts, before the
/// process creates its CUDA context, and the peak is reported above it.
pub struct DeviceWatch {
    idle: u64,
    peak: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    poller: Option<std::thread::JoinHandle<()>>,
}

/// NVML's `nvmlMemory_t`.
#[repr(C)]
#[derive(Default)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

/// NVML loaded at run time (the driver ships it; builds need no CUDA toolkit).
struct Nvml {
    _library: libloading::Library,
    device: *mut std::ffi::c_void,
    memory_info: unsafe extern "C" fn(*mut std::ffi::c_void, *mut NvmlMemory) -> i32,
}

// SAFETY: NVML handles are thread-safe; the poller is the only user after the watch starts.
unsafe impl Send for Nvml {}

impl Nvml {
    fn open() -> Option<Self> {
        type Init = unsafe extern "C" fn() -> i32;
        type HandleByIndex = unsafe extern "C" fn(u32, *mut *mut std::ffi::c_void) -> i32;
        // SAFETY: NVML's documented signatures; every status is checked before use.
        unsafe {
            let library = libloading::Library::new("libnvidia-ml.so.1").ok()?;
            let init: Init = *library.get(b"nvmlInit_v2").ok()?;
            let handle_by_index: HandleByIndex =
                *library.get(b"nvmlDeviceGetHandleByIndex_v2").ok()?;
            let memory_info = *library.get(b"nvmlDeviceGetMemoryInfo").ok()?;
            let mut device = std::ptr::null_mut();
            if init() != 0 || handle_by_index(0, &mut device) != 0 {
                return None;
            }
            Some(Self {
                _library: library,
                device,
                memory_info,
            })
        }
    }

    fn used(&self) -> Option<u64> {
        let mut memory = NvmlMemory::default();
        // SAFETY: `device` came from NVML and `memory` is the struct it fills.
        (unsafe { (self.memory_info)(self.device, &mut memory) } == 0).then_some(memory.used)
    }
}

impl DeviceWatch {
    /// Starts polling; `None` where NVML is missing (no NVIDIA driver).
    pub fn start() -> Option<Self> {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let nvml = Nvml::open()?;
        let idle = nvml.used()?;
        let peak = std::sync::Arc::new(AtomicU64::new(idle));
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let poller = {
            let (peak, stop) = (peak.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(used) = nvml.used() {
                        peak.fetch_max(used, Ordering::Relaxed);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            })
        };
        Some(Self {
            idle,
            peak,
            stop,
            poller: Some(poller),
        })
    }

    /// The peak above the idle level since the start or the last call, after which the peak
    /// starts again from the memory in use now (pools keep what they reserved).
    pub fn take_peak(&self) -> u64 {
        let peak = self.peak.swap(0, std::sync::atomic::Ordering::Relaxed);
        peak.saturating_sub(self.idle)
    }
}

impl Drop for DeviceWatch {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(poller) = self.poller.take() {
            let _ = poller.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_out_of_memory;

    #[test]
    fn out_of_memory_errors_are_recognized() {
        for message in [
            "An out-of-memory error happened during launch\nCaused by:\n  ...",
            "CUDA_ERROR_OUT_OF_MEMORY",
            "Unable to allocate buffer of 2.3 GB",
        ] {
            assert!(is_out_of_memory(message), "{message}");
        }
        assert!(!is_out_of_memory(
            "A compilation error happened during launch"
        ));
    }
}
