use super::*;
use LayerActivations::{Kept, Offloaded, Recomputed};
use lemo_test_support::HostRng;

const MIB: u64 = 1 << 20;

/// A table of `layers` equal layers: graphs of 10 MiB (2 MiB more during their backward pass),
/// inputs of 1 MiB, 3 MiB more for plans that mix, 100 ns per recomputation, no exposed copy
/// time.
fn equal_layers(layers: usize) -> CostTable {
    CostTable {
        base_bytes: 100 * MIB,
        input_bytes: MIB,
        mixed_bytes: 3 * MIB,
        layers: vec![
            LayerCost {
                kept_bytes: 10 * MIB,
                rebuilt_bytes: 10 * MIB,
                backward_bytes: 2 * MIB,
                recompute_ns: 100,
                exposed_copy_ns: 0,
            };
            layers
        ],
    }
}

fn random_table(random: &mut HostRng, layers: usize) -> CostTable {
    let mut below = |bound: u64| random.next_u64() % bound;
    CostTable {
        base_bytes: 50 * MIB + below(50 * MIB),
        input_bytes: MIB + below(2 * MIB),
        mixed_bytes: below(5 * MIB),
        layers: (0..layers)
            .map(|_| LayerCost {
                kept_bytes: 2 * MIB + below(20 * MIB),
                rebuilt_bytes: below(20 * MIB),
                backward_bytes: below(5 * MIB),
                recompute_ns: below(4) * 50,
                exposed_copy_ns: below(3) * 20,
            })
            .collect(),
    }
}

/// Every plan of `layers` layers.
fn every_plan(layers: usize) -> Vec<ActivationPlan> {
    (0..3usize.pow(layers as u32))
        .map(|mut code| {
            ActivationPlan::new(
                (0..layers)
                    .map(|_| {
                        let mode = LayerActivations::ALL[code % 3];
                        code /= 3;
                        mode
                    })
                    .collect(),
            )
        })
        .collect()
}

fn fits(footprint: Footprint, budget: Budget) -> bool {
    footprint.device_peak <= budget.device && footprint.host <= budget.host
}

/// On random tables of 1-6 layers and random budgets, the chosen plan fits, its footprint is
/// the one reported, and no plan that fits with the program's rounding to spare is faster
/// (exhaustive search over all 3^n plans).
#[test]
fn the_chosen_plan_fits_and_nothing_that_fits_is_faster() {
    let mut random = HostRng::new(lemo_test_support::seed());
    for case in 0..300 {
        let layers = 1 + case % 6;
        let costs = random_table(&mut random, layers);
        let all_kept = costs.footprint(&ActivationPlan::uniform(Kept, layers));
        let budget = Budget {
            device: costs.base_bytes
                + random.next_u64() % (all_kept.device_peak - costs.base_bytes + MIB),
            host: random.next_u64() % 4 * costs.input_bytes,
        };
        let plans = every_plan(layers);
        let slack = layers as u64 * (budget.device / UNITS).max(1);
        let strict = Budget {
            device: budget.device.saturating_sub(slack),
            ..budget
        };
        let best_within = |budget: Budget| {
            plans
                .iter()
                .filter(|p| fits(costs.footprint(p), budget))
                .map(|p| costs.score(p))
                .min()
        };
        match choose(&costs, budget) {
            Ok(chosen) => {
                assert!(
                    fits(chosen.footprint, budget),
                    "case {case}: {chosen:?} over {budget:?}"
                );
                assert_eq!(chosen.footprint, costs.footprint(&chosen.plan));
                if let Some(best) = best_within(strict) {
                    assert!(
                        costs.score(&chosen.plan) <= best,
                        "case {case}: {costs:?} {budget:?}"
                    );
                }
            }
            Err(error) => {
                assert_eq!(
                    best_within(strict),
                    None,
                    "case {case}: {costs:?} {budget:?}"
                );
                assert!(error.needed > budget.device);
            }
        }
    }
}

#[test]
fn at_equal_time_it_keeps_then_recomputes_then_offloads() {
    let mut costs = equal_layers(4);
    for layer in &mut costs.layers {
        layer.recompute_ns = 0;
    }
    let host = 4 * MIB;
    let all_kept = costs
        .footprint(&ActivationPlan::uniform(Kept, 4))
        .device_peak;
    let chosen = choose(
        &costs,
        Budget {
            device: all_kept,
            host,
        },
    )
    .unwrap();
    assert!(chosen.plan.is_all_kept(), "{:?}", chosen.plan);

    let all_recomputed = costs.footprint(&ActivationPlan::uniform(Recomputed, 4));
    let chosen = choose(
        &costs,
        Budget {
            device: all_recomputed.device_peak,
            host,
        },
    )
    .unwrap();
    assert_eq!(chosen.plan.count(Offloaded), 0, "{:?}", chosen.plan);
    // With less device memory than recomputing everything takes, offloading must come in.
    let budget = Budget {
        device: all_recomputed.device_peak - 1,
        host,
    };
    let chosen = choose(&costs, budget).unwrap();
    assert!(chosen.plan.count(Offloaded) > 0, "{:?}", chosen.plan);
    assert!(chosen.footprint.device_peak <= budget.device);
}

/// Between two budgets it keeps as many layers as fit, the rest recomputed, and the layers it
/// keeps are the ones whose graphs cost least for the time they save.
#[test]
fn it_keeps_the_layers_that_save_most_time_per_byte() {
    let mut costs = equal_layers(8);
    costs.layers[2].kept_bytes = 4 * MIB;
    costs.layers[5].recompute_ns = 1000;
    let budget = Budget {
        device: costs.base_bytes + 40 * MIB,
        host: 0,
    };
    let chosen = choose(&costs, budget).unwrap();
    let plan = chosen.plan.layers();
    assert_eq!(plan[2], Kept, "{plan:?}");
    assert_eq!(plan[5], Kept, "{plan:?}");
    assert!(chosen.plan.count(Kept) >= 3, "{plan:?}");
    assert!(chosen.footprint.device_peak <= budget.device);
    assert_eq!(chosen.plan.count(Offloaded), 0);
}

#[test]
fn what_cannot_fit_is_refused_with_the_budget_that_would() {
    let costs = equal_layers(6);
    let budget = Budget {
        device: costs.base_bytes + 3 * MIB,
        host: 0,
    };
    let error = choose(&costs, budget).unwrap_err();
    let message = error.to_string();
    assert!(!message.contains('\n'), "{message}");
    assert!(message.contains("GiB"), "{message}");
    let fitting = Budget {
        device: error.needed,
        ..budget
    };
    let chosen = choose(&costs, fitting).unwrap();
    assert!(chosen.footprint.device_peak <= error.needed);
    // Host memory lowers what the device needs.
    let with_host = costs.least_device_bytes(6 * MIB);
    assert!(with_host < error.needed, "{with_host} vs {}", error.needed);
    // A forced plan over the budget is refused likewise.
    let forced = ActivationPlan::uniform(Recomputed, 6);
    assert!(check(&costs, forced.clone(), budget).is_err());
    assert!(check(&costs, forced, fitting).is_ok());
}
