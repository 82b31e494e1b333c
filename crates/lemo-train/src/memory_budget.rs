//! `--memory-budget` and `--host-memory-budget`: the device and host memory a run's activation
//! plan may use (see [`crate::memory_plan::plan`]), with their defaults.

use anyhow::{Result, bail};
use clap::Args;
use lemo_models::activation_plan::planner::Budget;
use serde::{Deserialize, Serialize};

use crate::device::DeviceKind;
use crate::memory::gib;

/// The share of the device's free memory the default budget leaves unplanned.
const DEVICE_MARGIN: f64 = 0.03;
/// The share of the host's available memory the default host budget leaves.
const HOST_MARGIN: f64 = 0.25;

#[derive(Args, Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryBudgetArgs {
    /// Device memory the run may use, e.g. 76GiB, 80000MiB: the planner keeps as many layers'
    /// activations as fit and recomputes (or offloads) the rest [default: the device's free
    /// memory less 3%].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub memory_budget: Option<u64>,
    /// Host memory that layer inputs offloaded from the device may take [default: the host's
    /// available memory less 25%].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub host_memory_budget: Option<u64>,
}

/// Bytes of `76GiB`, `1.5TiB`, `512MiB`, `80G` (binary units), or a plain number of bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" | "kb" => 10,
        "m" | "mib" | "mb" => 20,
        "g" | "gib" | "gb" => 30,
        "t" | "tib" | "tb" => 40,
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (use B, KiB, MiB, GiB or TiB)"
            ));
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size such as 76GiB"))?;
    let bytes = value * (1u64 << shift) as f64;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(format!("{text:?} is not a usable size"));
    }
    Ok(bytes as u64)
}

impl MemoryBudgetArgs {
    /// The budgets of a run on `device`: the flags, else the defaults; `None` where the device's
    /// memory cannot be known (wgpu) and no budget was given. A host budget over what the
    /// machine has available is refused.
    pub fn resolve(&self, device: DeviceKind) -> Result<Option<Budget>> {
        let available = host_available_memory();
        if let (Some(host), Some(available)) = (self.host_memory_budget, available)
            && host > available
        {
            bail!(
                "--host-memory-budget {:.1} GiB is more than the {:.1} GiB this machine has available",
                gib(host),
                gib(available)
            );
        }
        let host = self
            .host_memory_budget
            .or(available.map(|b| (b as f64 * (1.0 - HOST_MARGIN)) as u64))
            .unwrap_or(0);
        let device_bytes = self.memory_budget.or_else(|| {
            free_memory(device).map(|free| (free as f64 * (1.0 - DEVICE_MARGIN)) as u64)
        });
        Ok(device_bytes.map(|device| Budget { device, host }))
    }
}

/// Free memory of the device the run will use: CUDA's free bytes on device 0, the host's
/// available memory for the CPU backend; `None` where it cannot be known (wgpu).
pub fn free_memory(device: DeviceKind) -> Option<u64> {
    match device {
        DeviceKind::Cuda => cuda_free_memory(),
        DeviceKind::Cpu => host_available_memory(),
        _ => None,
    }
}

pub fn host_available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `cuMemGetInfo` in device 0's primary context (the one the CUDA backend uses), through the
/// driver library loaded at run time.
fn cuda_free_memory() -> Option<u64> {
    use std::ffi::c_void;
    type Init = unsafe extern "C" fn(u32) -> i32;
    type DeviceGet = unsafe extern "C" fn(*mut i32, i32) -> i32;
    type Retain = unsafe extern "C" fn(*mut *mut c_void, i32) -> i32;
    type Push = unsafe extern "C" fn(*mut c_void) -> i32;
    type Pop = unsafe extern "C" fn(*mut *mut c_void) -> i32;
    type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> i32;
    type Release = unsafe extern "C" fn(i32) -> i32;
    // SAFETY: the driver API's documented signatures; every status is checked before use.
    unsafe {
        let lib = libloading::Library::new("libcuda.so.1").ok()?;
        let init: libloading::Symbol<Init> = lib.get(b"cuInit").ok()?;
        let device_get: libloading::Symbol<DeviceGet> = lib.get(b"cuDeviceGet").ok()?;
        let retain: libloading::Symbol<Retain> = lib.get(b"cuDevicePrimaryCtxRetain").ok()?;
        let push: libloading::Symbol<Push> = lib.get(b"cuCtxPushCurrent_v2").ok()?;
        let pop: libloading::Symbol<Pop> = lib.get(b"cuCtxPopCurrent_v2").ok()?;
        let mem_get_info: libloading::Symbol<MemGetInfo> = lib.get(b"cuMemGetInfo_v2").ok()?;
        let release: libloading::Symbol<Release> = lib.get(b"cuDevicePrimaryCtxRelease_v2").ok()?;
        let mut device = 0;
        if init(0) != 0 || device_get(&mut device, 0) != 0 {
            return None;
        }
        let mut context = std::ptr::null_mut();
        if retain(&mut context, device) != 0 {
            return None;
        }
        let (mut free, mut total) = (0usize, 0usize);
        let ok = push(context) == 0 && mem_get_info(&mut free, &mut total) == 0;
        let mut popped = std::ptr::null_mut();
        pop(&mut popped);
        release(device);
        ok.then_some(free as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_in_binary_units() {
        assert_eq!(parse_size("76GiB"), Ok(76 << 30));
        assert_eq!(parse_size("1.5 TiB"), Ok(3 << 39));
        assert_eq!(parse_size("512m"), Ok(512 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        for bad in ["", "GiB", "12 parsecs", "-3GiB", "0", "nan"] {
            let error = parse_size(bad).unwrap_err();
            assert!(!error.contains('\n'), "{error}");
        }
    }

    #[test]
    fn a_host_budget_past_the_machine_is_refused() {
        let args = MemoryBudgetArgs {
            memory_budget: Some(1 << 30),
            host_memory_budget: Some(u64::MAX / 2),
        };
        let error = args.resolve(DeviceKind::Cpu).unwrap_err().to_string();
        assert!(error.contains("--host-memory-budget"), "{error}");
        let args = MemoryBudgetArgs {
            host_memory_budget: None,
            ..args
        };
        assert_eq!(
            args.resolve(DeviceKind::Cpu).unwrap().unwrap().device,
            1 << 30
        );
    }
}
