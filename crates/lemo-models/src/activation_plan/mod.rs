//! Where each layer's backward pass finds what it needs: its graph kept from the forward pass,
//! rebuilt from its input kept on the device, or rebuilt from its input copied to host memory
//! during the forward pass and brought back ahead of the backward pass. [`planner`] picks the
//! fastest mix that fits a memory budget; [`crate::planned_backward::planned_loss_backward`] runs it.

pub mod planner;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What layer `l` holds between its forward and its backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerActivations {
    /// Its graph: the activations its backward pass reads (with token elimination, the kept
    /// rows' only).
    Kept,
    /// Its input on the device; the backward pass runs the layer again to rebuild its graph.
    Recomputed,
    /// Its input in host memory; it comes back to the device for the recomputation.
    Offloaded,
}

impl LayerActivations {
    pub const ALL: [Self; 3] = [Self::Kept, Self::Recomputed, Self::Offloaded];

    /// One letter per layer in [`ActivationPlan`]'s text form.
    fn letter(self) -> char {
        match self {
            Self::Kept => 'k',
            Self::Recomputed => 'r',
            Self::Offloaded => 'o',
        }
    }
}

/// One [`LayerActivations`] per layer, layer 0 first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct ActivationPlan {
    layers: Vec<LayerActivations>,
}

impl ActivationPlan {
    pub fn new(layers: Vec<LayerActivations>) -> Self {
        Self { layers }
    }

    /// Every one of `num_layers` layers the same way.
    pub fn uniform(mode: LayerActivations, num_layers: usize) -> Self {
        Self::new(vec![mode; num_layers])
    }

    pub fn layers(&self) -> &[LayerActivations] {
        &self.layers
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn count(&self, mode: LayerActivations) -> usize {
        self.layers.iter().filter(|&&m| m == mode).count()
    }

    /// Whether no layer is recomputed: the plain backward pass over one graph.
    pub fn is_all_kept(&self) -> bool {
        self.count(LayerActivations::Kept) == self.layers.len()
    }
}

/// `20 layers kept, 12 recomputed, 0 offloaded`.
impl fmt::Display for ActivationPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} layers kept, {} recomputed, {} offloaded",
            self.count(LayerActivations::Kept),
            self.count(LayerActivations::Recomputed),
            self.count(LayerActivations::Offloaded)
        )
    }
}

/// The compact form recorded in metrics and run folders: one letter per layer (`kkrro`).
impl From<ActivationPlan> for String {
    fn from(plan: ActivationPlan) -> Self {
        plan.layers.iter().map(|m| m.letter()).collect()
    }
}

impl TryFrom<String> for ActivationPlan {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        text.parse()
    }
}

impl FromStr for ActivationPlan {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        text.trim()
            .chars()
            .map(|c| {
                LayerActivations::ALL
                    .into_iter()
                    .find(|m| m.letter() == c)
                    .ok_or_else(|| {
                        format!("activation plan {text:?}: {c:?} is none of k (kept), r (recomputed), o (offloaded)")
                    })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Self::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_reads_back_from_its_letters_and_counts_its_layers() {
        let plan: ActivationPlan = "kkro".parse().unwrap();
        assert_eq!(plan.to_string(), "2 layers kept, 1 recomputed, 1 offloaded");
        assert_eq!(String::from(plan.clone()), "kkro");
        let json = serde_json::to_string(&plan).unwrap();
        assert_eq!(json, "\"kkro\"");
        assert_eq!(serde_json::from_str::<ActivationPlan>(&json).unwrap(), plan);
        assert!(!plan.is_all_kept());
        assert!(ActivationPlan::uniform(LayerActivations::Kept, 3).is_all_kept());
        let error = "kx".parse::<ActivationPlan>().unwrap_err();
        assert!(error.contains("'x'") && !error.contains('\n'), "{error}");
    }
}
