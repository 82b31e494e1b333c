//! The fastest [`ActivationPlan`] that fits a device and a host memory budget.
//!
//! The cost model, in bytes over one training step:
//! - `base_bytes` are live throughout (weights, trainable state, the loss head, CUDA context,
//!   pool slack);
//! - a layer stores its graph on the device (`kept_bytes`, kept), its input (`input_bytes`,
//!   recomputed) or nothing (offloaded: `input_bytes` of host memory), so the forward pass ends
//!   with every layer's stored part;
//! - the backward pass runs from the last layer down and frees each layer's stored part when
//!   done with it: while layer l's runs, the layers below hold their stored part and layer l its
//!   graph (kept), or its input and its rebuilt graph (`rebuilt_bytes`), and beside either the
//!   gradients' working memory (`backward_bytes`);
//! - offloading reserves two layer inputs on the device: in the forward pass one being copied to
//!   the host (held until its copy is done), in the backward pass one in use and the next being
//!   fetched;
//! - a plan that mixes kept and other layers also holds `mixed_bytes`: the device pool keeps the
//!   working memory of the layers that run without a graph reserved beside the kept graphs,
//!   which cannot reuse it (a plan of one kind reuses it, and its figures include it).
//!
//! Time: a recomputed layer runs its forward pass again (`recompute_ns`); an offloaded one too,
//! plus what of its copies the compute beside them does not hide (`exposed_copy_ns`).
//!
//! The peak is a maximum over the points of a step, not a sum, and it depends on where in the
//! stack each choice sits; so the choice is a dynamic program over the layers from the first,
//! whose state is the device bytes stored below the current layer (in units of 1/4096 of the
//! budget, rounded up, so a chosen plan never exceeds the budget) and the number of offloaded
//! layers (host memory holds whole layer inputs). At equal time it keeps rather than recomputes
//! and recomputes rather than offloads.

use std::fmt;

use super::{ActivationPlan, LayerActivations};

/// What one layer costs under each [`LayerActivations`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerCost {
    /// Its graph, kept from the forward to the backward pass.
    pub kept_bytes: u64,
    /// Its rebuilt graph, live during its backward pass.
    pub rebuilt_bytes: u64,
    /// The working memory of its backward pass beside its graph, kept or rebuilt.
    pub backward_bytes: u64,
    /// Its forward pass, which a recomputation repeats.
    pub recompute_ns: u64,
    /// What of its input's copies to the host and back the compute beside them does not hide.
    pub exposed_copy_ns: u64,
}

/// The costs of one run's layers, and what the step holds besides them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CostTable {
    pub base_bytes: u64,
    /// One layer's input (the residual stream, the same width in every layer).
    pub input_bytes: u64,
    /// What a plan mixing kept and other layers holds besides (see the module's notes).
    pub mixed_bytes: u64,
    pub layers: Vec<LayerCost>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub device: u64,
    pub host: u64,
}

/// What a plan costs: device peak, host bytes and seconds beyond the all-kept step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    pub device_peak: u64,
    pub host: u64,
    pub extra_ns: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen {
    pub plan: ActivationPlan,
    pub footprint: Footprint,
}

/// No plan fits: `needed` bytes of device memory would (with the same host budget).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DoesNotFit {
    pub needed: u64,
    pub budget: u64,
}

impl fmt::Display for DoesNotFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the leanest plan needs {:.1} GiB of device memory, over the {:.1} GiB budget",
            gib(self.needed),
            gib(self.budget)
        )
    }
}

impl std::error::Error for DoesNotFit {}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Units of the device budget in the dynamic program's state.
const UNITS: u64 = 4096;

/// Ordered as the planner prefers: less time, then fewer layers not kept, then fewer offloaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Score {
    extra_ns: u64,
    not_kept: u32,
    offloaded: u32,
}

impl Score {
    fn with(self, cost: &LayerCost, mode: LayerActivations) -> Self {
        let (extra_ns, not_kept, offloaded) = match mode {
            LayerActivations::Kept => (0, 0, 0),
            LayerActivations::Recomputed => (cost.recompute_ns, 1, 0),
            LayerActivations::Offloaded => (cost.recompute_ns + cost.exposed_copy_ns, 1, 1),
        };
        Self {
            extra_ns: self.extra_ns + extra_ns,
            not_kept: self.not_kept + not_kept,
            offloaded: self.offloaded + offloaded,
        }
    }
}

impl CostTable {
    /// Device bytes a layer holds from its forward to its backward pass.
    fn stored(&self, cost: &LayerCost, mode: LayerActivations) -> u64 {
        match mode {
            LayerActivations::Kept => cost.kept_bytes,
            LayerActivations::Recomputed => self.input_bytes,
            LayerActivations::Offloaded => 0,
        }
    }

    /// Device bytes of a layer during its backward pass.
    fn live(&self, cost: &LayerCost, mode: LayerActivations) -> u64 {
        match mode {
            LayerActivations::Kept => cost.kept_bytes + cost.backward_bytes,
            _ => self.input_bytes + cost.rebuilt_bytes + cost.backward_bytes,
        }
    }

    fn reserve(&self, offloads: bool) -> u64 {
        if offloads { 2 * self.input_bytes } else { 0 }
    }

    /// The most whole layer inputs `host` bytes hold, at most one per layer.
    fn max_offloaded(&self, host: u64) -> usize {
        (host / self.input_bytes.max(1)).min(self.layers.len() as u64) as usize
    }

    fn score(&self, plan: &ActivationPlan) -> Score {
        self.layers
            .iter()
            .zip(plan.layers())
            .fold(Score::default(), |score, (cost, &mode)| {
                score.with(cost, mode)
            })
    }

    /// The device peak, host bytes and extra time of `plan` (one mode per layer of the table).
    pub fn footprint(&self, plan: &ActivationPlan) -> Footprint {
        assert_eq!(plan.num_layers(), self.layers.len(), "one mode per layer");
        let offloaded = plan.count(LayerActivations::Offloaded) as u64;
        let kept = plan.count(LayerActivations::Kept);
        let mixed = if kept > 0 && kept < plan.num_layers() {
            self.mixed_bytes
        } else {
            0
        };
        let fixed = self.base_bytes + self.reserve(offloaded > 0) + mixed;
        let (mut below, mut peak) = (0, 0);
        for (cost, &mode) in self.layers.iter().zip(plan.layers()) {
            peak = peak.max(fixed + below + self.live(cost, mode));
            below += self.stored(cost, mode);
        }
        Footprint {
            device_peak: peak.max(fixed + below),
            host: offloaded * self.input_bytes,
            extra_ns: self.score(plan).extra_ns,
        }
    }

    /// Plans that need the least device memory: the first `k` layers offloaded (their inputs
    /// come back last, so their copies have the longest to hide in), the rest recomputed.
    fn leanest(&self, host: u64) -> impl Iterator<Item = ActivationPlan> + '_ {
        let layers = self.layers.len();
        (0..=self.max_offloaded(host)).map(move |k| {
            let mut modes = vec![LayerActivations::Offloaded; k];
            modes.resize(layers, LayerActivations::Recomputed);
            ActivationPlan::new(modes)
        })
    }

    /// The least device budget [`choose`] accepts with `host` bytes of host memory.
    pub fn least_device_bytes(&self, host: u64) -> u64 {
        self.leanest(host)
            .map(|plan| self.footprint(&plan).device_peak)
            .min()
            .unwrap_or(self.base_bytes)
    }

    /// The best plan the dynamic program finds with up to `max_offloaded` offloaded layers.
    fn program(&self, budget: Budget, max_offloaded: usize) -> Option<ActivationPlan> {
        // Plans of one kind are tried apart (see `choose`): these may mix.
        let fixed = self.base_bytes + self.reserve(max_offloaded > 0) + self.mixed_bytes;
        let room = budget.device.checked_sub(fixed)?;
        let unit = (budget.device / UNITS).max(1);
        let units = |bytes: u64| bytes.div_ceil(unit) as usize;
        let cap = (room / unit) as usize;
        let counts = max_offloaded + 1;
        let at = |stored: usize, offloaded: usize| stored * counts + offloaded;
        let mut best: Vec<Option<Score>> = vec![None; (cap + 1) * counts];
        best[0] = Some(Score::default());
        let mut choices: Vec<Vec<u8>> = Vec::with_capacity(self.layers.len());
        for cost in &self.layers {
            let mut next = vec![None; best.len()];
            let mut choice = vec![u8::MAX; best.len()];
            for stored in 0..=cap {
                for offloaded in 0..counts {
                    let Some(score) = best[at(stored, offloaded)] else {
                        continue;
                    };
                    let below = stored as u64 * unit;
                    for (index, mode) in LayerActivations::ALL.into_iter().enumerate() {
                        let offload = usize::from(mode == LayerActivations::Offloaded);
                        let after = stored + units(self.stored(cost, mode));
                        if offloaded + offload >= counts
                            || after > cap
                            || fixed + below + self.live(cost, mode) > budget.device
                        {
                            continue;
                        }
                        let score = score.with(cost, mode);
                        let slot = at(after, offloaded + offload);
                        if next[slot].is_none_or(|s| score < s) {
                            next[slot] = Some(score);
                            choice[slot] = index as u8;
                        }
                    }
                }
            }
            best = next;
            choices.push(choice);
        }
        let (mut stored, mut offloaded, _) = (0..=cap)
            .flat_map(|stored| (0..counts).map(move |offloaded| (stored, offloaded)))
            .filter_map(|(s, o)| best[at(s, o)].map(|score| (s, o, score)))
            .min_by_key(|&(_, _, score)| score)?;
        let mut modes = vec![LayerActivations::Kept; self.layers.len()];
        for (layer, cost) in self.layers.iter().enumerate().rev() {
            let mode = LayerActivations::ALL[usize::from(choices[layer][at(stored, offloaded)])];
            modes[layer] = mode;
            stored -= units(self.stored(cost, mode));
            offloaded -= usize::from(mode == LayerActivations::Offloaded);
        }
        Some(ActivationPlan::new(modes))
    }
}

/// The fastest plan whose device peak and host bytes fit `budget`.
pub fn choose(costs: &CostTable, budget: Budget) -> Result<Chosen, DoesNotFit> {
    let max_offloaded = costs.max_offloaded(budget.host);
    [0, max_offloaded]
        .into_iter()
        .filter_map(|max| costs.program(budget, max))
        // The program's rounding can miss a plan at the edge of the budget: every layer kept,
        // and the leanest plans, are tried as they are.
        .chain(std::iter::once(ActivationPlan::uniform(
            LayerActivations::Kept,
            costs.layers.len(),
        )))
        .chain(costs.leanest(budget.host))
        .map(|plan| (costs.score(&plan), costs.footprint(&plan), plan))
        .filter(|(_, footprint, _)| {
            footprint.device_peak <= budget.device && footprint.host <= budget.host
        })
        .min_by_key(|(score, _, _)| *score)
        .map(|(_, footprint, plan)| Chosen { plan, footprint })
        .ok_or(DoesNotFit {
            needed: costs.least_device_bytes(budget.host),
            budget: budget.device,
        })
}

/// `plan` (forced, or read back) with its footprint, if it fits `budget`.
pub fn check(
    costs: &CostTable,
    plan: ActivationPlan,
    budget: Budget,
) -> Result<Chosen, DoesNotFit> {
    let footprint = costs.footprint(&plan);
    if footprint.device_peak <= budget.device && footprint.host <= budget.host {
        Ok(Chosen { plan, footprint })
    } else {
        Err(DoesNotFit {
            needed: footprint.device_peak,
            budget: budget.device,
        })
    }
}

#[cfg(test)]
mod tests;
