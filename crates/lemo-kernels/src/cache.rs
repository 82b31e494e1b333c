//! Persistent caches for cubecl: compiled kernels (PTX on CUDA) and autotune results are kept on
//! disk, so a second run skips the first run's compilation and tuning (about a minute for
//! Burn's autotuned kernels on the H200).
//!
//! cubecl reads its configuration once, from `cubecl.toml` (or the `[cubecl]` section of
//! `burn.toml`) in the working directory or a parent, then the `CUBECL_*` environment
//! variables. [`enable_persistent_caches`] starts from that configuration and points both caches
//! at one directory; it must run before the first tensor is created.

use std::path::{Path, PathBuf};

use cubecl::config::cache::CacheConfig;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// `$LEMO_CUBECL_CACHE`, else `$XDG_CACHE_HOME/lemo/cubecl`, else `~/.cache/lemo/cubecl`.
pub fn default_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("LEMO_CUBECL_CACHE") {
        return Some(dir.into());
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".cache")))?;
    Some(base.join("lemo").join("cubecl"))
}

/// Keeps cubecl's compiled kernels and autotune results under `dir` across runs. Returns
/// `false` (and changes nothing) when cubecl's configuration was already read, i.e. a device
/// was used before this call.
pub fn enable_persistent_caches(dir: &Path) -> bool {
    if CubeClRuntimeConfig::storage().lock().is_some() {
        return false;
    }
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    if config.compilation.cache.is_none() {
        config.compilation.cache = Some(CacheConfig::File(dir.join("kernels")));
    }
    config.autotune.cache = CacheConfig::File(dir.join("autotune"));
    CubeClRuntimeConfig::set(config);
    true
}
