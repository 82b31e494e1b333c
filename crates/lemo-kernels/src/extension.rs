//! [`LemoBackend`], the union of the backend-extension families.

use crate::ComputeBackend;
use crate::attention::backend::AttentionBackend;
use crate::exchange::backend::ExchangeBackend;
use crate::loss::LossBackend;

/// Every family of the backend extension: what lemo's models need beyond Burn's own operations.
/// Each family is its own trait next to its kernels (attention, loss, the rows exchanged between
/// the ranks of a sequence group, and the dense compute families of [`ComputeBackend`]); a
/// backend gets this one by implementing them all.
pub trait LemoBackend: AttentionBackend + ComputeBackend + ExchangeBackend + LossBackend {}

impl<B> LemoBackend for B where B: AttentionBackend + ComputeBackend + ExchangeBackend + LossBackend {}
