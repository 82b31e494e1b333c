//! `--device auto|cuda|wgpu|cpu`: choosing a Burn backend at run time and running a job on it;
//! `--precision bf16|f32`: the storage type of the model on it.

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use lemo_kernels::precision::Precision;
use lemo_kernels::{CpuBackend, LemoBackend, WgpuBackend};
use lemo_models::quantized::QuantizeBase;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// CUDA when an NVIDIA GPU is present, else the CPU.
    Auto,
    /// CubeCL on CUDA (NVIDIA GPUs).
    Cuda,
    /// CubeCL on wgpu (Vulkan/Metal; Mesa's software Vulkan on CPU-only machines).
    Wgpu,
    /// Pure-CPU backend (ndarray).
    Cpu,
}

/// `--precision`: how the pretrained weights and the hidden states are stored. LoRA adapters,
/// trainable embeddings and norms, their gradients, the optimizer state and the loss are f32 in
/// both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionKind {
    /// bf16 model and activations (f32 accumulation), as PEFT trains a bf16 model.
    Bf16,
    /// Everything in f32.
    F32,
}

impl PrecisionKind {
    pub fn name(self) -> &'static str {
        match self {
            PrecisionKind::Bf16 => "bf16",
            PrecisionKind::F32 => "f32",
        }
    }

    pub fn policy(self) -> Precision {
        match self {
            PrecisionKind::Bf16 => Precision::MIXED_BF16,
            PrecisionKind::F32 => Precision::F32,
        }
    }
}

/// `--device` and `--precision`, which every subcommand that runs a model takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Runtime {
    /// auto (CUDA when an NVIDIA driver is present, else the CPU), cuda, wgpu or cpu.
    #[arg(long, value_enum, default_value_t = DeviceKind::Auto)]
    pub device: DeviceKind,
    /// bf16 (model and activations; LoRA, gradients and optimizer f32) or f32
    /// [default: bf16 on cuda; f32 on cpu and wgpu, which have no bf16].
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionKind>,
    /// Keep the frozen projections quantized on the device, dequantized per product: nf4
    /// (QLoRA's NF4 with double quantization), q4_k or q8_0 quantize the base at load; none loads
    /// every weight dense [default: a GGUF base's quantized projections stay in their blocks,
    /// other bases load dense].
    #[arg(long)]
    pub quantize_base: Option<QuantizeBase>,
}

impl Default for Runtime {
    fn default() -> Self {
        crate::defaults()
    }
}

impl Runtime {
    /// The device resolved (`auto` picks one) and the precision to run at on it.
    pub fn resolve(self) -> Result<(DeviceKind, PrecisionKind)> {
        let device = self.device.resolve();
        Ok((device, device.precision(self.precision)?))
    }

    /// `--quantize-base`, or the default (GGUF projections kept in their blocks).
    pub fn quantize_base(self) -> QuantizeBase {
        self.quantize_base.unwrap_or_default()
    }
}

/// Work that runs on whichever backend the user picked.
pub trait BackendJob {
    type Output;
    fn run<B: LemoBackend>(self, device: B::Device) -> Result<Self::Output>;
}

fn cuda_driver_present() -> bool {
    // SAFETY: loading the driver library runs its initializers, which is what using CUDA does anyway.
    unsafe { libloading::Library::new("libcuda.so.1") }.is_ok()
}

/// The CPU backend allocates and frees tensors of hundreds of MB per layer at long context; glibc
/// serves those with fresh `mmap`s, and the page faults cost more than the arithmetic (3x slower
/// evaluation of stories260K at 2048 tokens). Keeping large blocks in the heap avoids that.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning parameters; called before the job allocates.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 256 << 20);
    }
}

impl DeviceKind {
    /// `auto` resolved to a concrete device (and said so on stderr).
    pub fn resolve(self) -> Self {
        if self != DeviceKind::Auto {
            return self;
        }
        let picked = if cfg!(feature = "cuda") && cuda_driver_present() {
            DeviceKind::Cuda
        } else {
            DeviceKind::Cpu
        };
        eprintln!("device: auto picked {}", picked.name());
        picked
    }

    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Auto => "auto",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Wgpu => "wgpu",
            DeviceKind::Cpu => "cpu",
        }
    }

    /// The precision to run at on this (resolved) device: the one asked for, else bf16 on CUDA
    /// and f32 elsewhere; an error for bf16 on a backend without it.
    pub fn precision(self, asked: Option<PrecisionKind>) -> Result<PrecisionKind> {
        match (self, asked) {
            (DeviceKind::Cuda, asked) => Ok(asked.unwrap_or(PrecisionKind::Bf16)),
            (DeviceKind::Cpu, Some(PrecisionKind::Bf16)) => bail!(
                "--precision bf16 needs --device cuda: the CPU backend (ndarray) has no bf16; use --precision f32"
            ),
            (DeviceKind::Wgpu, Some(PrecisionKind::Bf16)) => bail!(
                "--precision bf16 needs --device cuda: the wgpu backend (WGSL) has no bf16; use --precision f32"
            ),
            (DeviceKind::Auto, _) => self.resolve().precision(asked),
            (_, asked) => Ok(asked.unwrap_or(PrecisionKind::F32)),
        }
    }

    pub fn run<J: BackendJob>(self, job: J) -> Result<J::Output> {
        let kind = self.resolve();
        if matches!(kind, DeviceKind::Cuda | DeviceKind::Wgpu) {
            // Compiled kernels and autotune results persist, so only the first run pays for them.
            if let Some(dir) = lemo_kernels::cache::default_cache_dir() {
                lemo_kernels::cache::enable_persistent_caches(&dir);
            }
        }
        match kind {
            DeviceKind::Cpu => {
                keep_freed_memory();
                job.run::<CpuBackend>(Default::default())
            }
            DeviceKind::Wgpu => {
                crate::memory::set_probe(crate::memory::cubecl_probe::<cubecl::wgpu::WgpuRuntime>(
                    Default::default(),
                ));
                job.run::<WgpuBackend>(Default::default())
            }
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => {
                if !cuda_driver_present() {
                    bail!("--device cuda: no CUDA driver (libcuda.so.1) on this machine");
                }
                crate::memory::set_probe(crate::memory::cubecl_probe::<cubecl::cuda::CudaRuntime>(
                    Default::default(),
                ));
                job.run::<lemo_kernels::CudaBackend>(Default::default())
            }
            #[cfg(not(feature = "cuda"))]
            DeviceKind::Cuda => {
                bail!("--device cuda: this build has no CUDA support (feature `cuda`)")
            }
            DeviceKind::Auto => unreachable!("resolved above"),
        }
    }
}
