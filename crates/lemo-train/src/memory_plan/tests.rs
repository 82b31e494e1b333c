use super::*;

fn llama_2_7b(seq_len: usize, method: Method, checkpointing: bool) -> PlanInput {
    let path = lemo_test_support::repo_root().join("bench/configs/llama-2-7b.json");
    PlanInput {
        model: ModelConfig::from_file(&path).unwrap(),
        device: DeviceKind::Cuda,
        seq_len,
        batch_size: 1,
        context_parallel: 1,
        method,
        checkpointing,
        precision: PrecisionKind::Bf16,
        lora_rank: 8,
        lora_targets: ["q_proj", "k_proj", "v_proj", "o_proj"]
            .map(String::from)
            .to_vec(),
        train_extras: false,
        loss_segment: 1024,
        target_keep: 0.5,
        dense_layers: 1,
        projection_bits: None,
    }
}

/// Projections kept quantized count at their quantized size, plus one layer's projections
/// dense while a recomputed layer is rebuilt for its backward pass.
#[test]
fn quantized_projections_count_their_quantized_bytes() {
    let dense = llama_2_7b(8192, Method::Lora, true);
    let bits = lemo_models::quantized::nf4::BITS;
    let nf4 = PlanInput {
        projection_bits: Some(bits),
        ..dense.clone()
    };
    let predict = |input: &PlanInput| predict_plan(input, &uniform_plan(input));
    let (dense_plan, nf4_plan) = (predict(&dense), predict(&nf4));
    let dims = Dims::of(&dense.model);
    let projections = dims.layers * dims.layer_projections();
    let saved = dense_plan.weights - nf4_plan.weights;
    assert!(
        (saved - projections * (2.0 - bits / 8.0)).abs() < 1.0,
        "{saved}"
    );
    let buffer = nf4_plan.activations - dense_plan.activations;
    assert!(
        (buffer - 2.0 * dims.layer_projections()).abs() < 1.0,
        "one layer's dense projections: {buffer}"
    );
}

/// The prediction is within 10% of every device-level peak measured on the H200.
#[test]
fn predictions_match_the_measured_h200_peaks() {
    let path = lemo_test_support::repo_root().join("bench/results/h200-device-peaks.json");
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut checked = 0;
    for row in results["results"].as_array().unwrap() {
        let method = match row["method"].as_str().unwrap() {
            "lemo" => Method::Lemo,
            _ => Method::Lora,
        };
        let input = llama_2_7b(
            row["seq_len"].as_u64().unwrap() as usize,
            method,
            row["checkpointing"].as_bool().unwrap(),
        );
        let predicted = predict_plan(&input, &uniform_plan(&input)).total / GIB;
        let measured = row["device_peak_gib"].as_f64().unwrap();
        println!(
            "{} {} checkpointing {}: predicted {predicted:.1} GiB, measured {measured:.1}",
            row["method"], input.seq_len, input.checkpointing
        );
        lemo_test_support::assert_close_scalar("peak", predicted, measured, 0.10);
        checked += 1;
    }
    assert!(checked >= 3);
}

/// `lemo` plans that mix kept, recomputed and offloaded layers, as measured on the H200 with
/// `bench --target-keep 0.5` (Llama-2-7B at 32K-128K, Llama-3-8B at 96K and 128K): never more
/// than 1% under the device peak, and Llama-2-7B's at most 6% over it. Llama-3-8B's are 15-26%
/// over (the mixed-plan term was fitted to Llama-2-7B; see `LEMO_MIXED_LAYERS`). (The H100
/// peaks in `h100-idle-buffers.json` predate the cuDNN backward in pieces and the loss without a
/// copy of the hidden states, which lowered long-sequence peaks by gigabytes.)
#[test]
fn mixed_lemo_plans_match_the_measured_h200_peaks() {
    let path = lemo_test_support::repo_root().join("bench/results/h200-mixed-plans.json");
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let settings = crate::lemo::LemoSettings {
        target_keep: 0.5,
        ..Default::default()
    };
    let mut checked = 0;
    for call in results["calls"].as_array().unwrap() {
        for row in call["results"].as_array().unwrap() {
            let activations: ActivationPlan =
                row["activation_plan"].as_str().unwrap().parse().unwrap();
            let kept = activations.count(LayerActivations::Kept);
            if kept == 0 || kept == activations.num_layers() {
                continue;
            }
            let model = row["model"].as_str().unwrap();
            let config = lemo_test_support::repo_root().join(format!("bench/configs/{model}.json"));
            let input = PlanInput {
                model: ModelConfig::from_file(&config).unwrap(),
                target_keep: settings.mean_keep(),
                dense_layers: settings.dense_layers.len(),
                ..llama_2_7b(
                    row["seq_len"].as_u64().unwrap() as usize,
                    Method::Lemo,
                    false,
                )
            };
            let predicted = predict_plan(&input, &activations).total / GIB;
            let measured = row["device_peak_gib"].as_f64().unwrap();
            let name = format!("{model} {}", row["name"]);
            println!("{name} {activations}: predicted {predicted:.2} GiB, measured {measured:.2}");
            assert!(
                predicted >= 0.99 * measured,
                "{name}: predicted {predicted:.2} GiB, measured {measured:.2}"
            );
            if model == "llama-2-7b" {
                assert!(
                    predicted <= 1.06 * measured,
                    "{name}: predicted {predicted:.2} GiB, measured {measured:.2}"
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 8);
}

fn budget(device_gib: u64) -> Option<Budget> {
    Some(Budget {
        device: device_gib << 30,
        host: 0,
    })
}

#[test]
fn a_run_over_the_budget_names_the_length_that_fits() {
    let input = llama_2_7b(131072, Method::Lora, false);
    let message = plan(&input, budget(40)).unwrap_err().to_string();
    assert!(message.contains("--seq-len 131072"), "{message}");
    assert!(message.contains("try --seq-len"), "{message}");
    assert!(!message.contains('\n'));
    let message = plan(&input, budget(10)).unwrap_err().to_string();
    assert!(message.contains("weights"), "{message}");
}

/// Where offloading layer inputs would make a run fit, the refusal names the host memory budget
/// that does, if the machine has it.
#[test]
fn a_run_that_fits_with_host_memory_names_that_budget() {
    let input = llama_2_7b(32768, Method::Lora, false);
    let limit = Budget {
        device: 24 << 30,
        host: 0,
    };
    assert!(plan(&input, Some(limit)).is_err());
    let message = fitting_options(&input, limit, Some(256 << 30));
    let host_gib: u64 = message
        .split("--host-memory-budget ")
        .nth(1)
        .and_then(|rest| rest.split("GiB").next())
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("no host budget in {message:?}"));
    let with_host = |gib: u64| Budget {
        host: gib << 30,
        ..limit
    };
    assert!(plan(&input, Some(with_host(host_gib))).is_ok(), "{message}");
    assert!(
        plan(&input, Some(with_host(host_gib - 1))).is_err(),
        "{message}"
    );
    // Not where the machine lacks it, nor on the CPU.
    assert!(!fitting_options(&input, limit, Some(1 << 30)).contains("--host-memory-budget"));
    let on_cpu = PlanInput {
        device: DeviceKind::Cpu,
        ..input
    };
    assert!(!fitting_options(&on_cpu, limit, Some(256 << 30)).contains("--host-memory-budget"));
}

/// 16K dense does not fit 60 GiB with every layer kept: the plan recomputes some layers,
/// keeps the rest, and stays within the budget; more budget keeps more layers.
#[test]
fn the_plan_keeps_what_the_budget_holds() {
    let input = llama_2_7b(16384, Method::Lora, false);
    assert!(predict_plan(&input, &uniform_plan(&input)).total > 60.0 * GIB);
    let tight = plan(&input, budget(60)).unwrap();
    let kept = tight.activations.count(LayerActivations::Kept);
    assert!(kept > 0 && kept < 32, "{}", tight.line());
    assert!(tight.memory.total <= 60.0 * GIB);
    let roomy = plan(&input, budget(70)).unwrap();
    assert!(roomy.activations.count(LayerActivations::Kept) > kept);
    assert!(tight.line().starts_with("plan: "), "{}", tight.line());
    // --checkpointing recomputes every layer whatever the budget.
    let forced = plan(&llama_2_7b(16384, Method::Lora, true), budget(70)).unwrap();
    assert_eq!(forced.activations.count(LayerActivations::Recomputed), 32);
}

/// Dense plans that offload layer inputs, as measured on the H200 with `bench`: the plan within
/// 5% of the device peak.
#[test]
fn offloading_plans_match_the_measured_h200_peaks() {
    let path = lemo_test_support::repo_root().join("bench/results/h200-offload.json");
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for (call, label) in [("call3", "lora32k-off24"), ("call4", "lora32k-off22")] {
        let row = &results["calls"][call][label];
        let input = llama_2_7b(
            row["seq_len"].as_u64().unwrap() as usize,
            Method::Lora,
            false,
        );
        let activations: ActivationPlan = row["activation_plan"].as_str().unwrap().parse().unwrap();
        assert!(activations.count(LayerActivations::Offloaded) >= 22);
        let predicted = predict_plan(&input, &activations).total / GIB;
        let measured = row["device_peak_gib"].as_f64().unwrap();
        println!("{label} {activations}: predicted {predicted:.2} GiB, measured {measured:.2}");
        lemo_test_support::assert_close_scalar("peak", predicted, measured, 0.05);
    }
}

/// Offloading lowers the leanest plan by the inputs it moves to the host: dense 32K fits 22 GiB
/// with host memory for 30 inputs and not without it.
#[test]
fn host_memory_lowers_the_leanest_plan() {
    let input = llama_2_7b(32768, Method::Lora, false);
    let device_only = plan(&input, budget(22)).unwrap_err().to_string();
    assert!(device_only.contains("leanest plan"), "{device_only}");
    let with_host = Some(Budget {
        device: 22 << 30,
        host: 32 << 30,
    });
    let planned = plan(&input, with_host).unwrap();
    assert!(planned.memory.total <= 22.0 * GIB);
    assert!(planned.activations.count(LayerActivations::Offloaded) >= 20);
    assert!(planned.line().contains("on the host"), "{}", planned.line());
}

/// Llama-3-8B with a Q4_K base, `lemo` at 32K with every layer recomputed, and under 22 and 20
/// GiB budgets with layers offloaded (H200, `bench`'s defaults): the plan is never under the
/// device peak and at most 15% over it.
#[test]
fn quantized_lemo_plans_cover_the_measured_h200_peaks() {
    let root = lemo_test_support::repo_root();
    let path = root.join("bench/results/h200-rebuild-without-mlp-pass.json");
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let config_path = root.join("bench/configs/llama-3-8b.json");
    let model = ModelConfig::from_file(&config_path).unwrap();
    let projection_bits = lemo_models::quantized::projection_bits(
        &config_path,
        &model,
        lemo_models::quantized::QuantizeBase::Q4K,
    )
    .unwrap();
    let settings = crate::lemo::LemoSettings::default();
    let input = PlanInput {
        model,
        target_keep: settings.mean_keep(),
        dense_layers: settings.dense_layers.len(),
        projection_bits,
        ..llama_2_7b(32768, Method::Lemo, false)
    };
    for label in ["l3q4-32ck-new", "l3q4-32-22", "l3q4-32-20"] {
        let row = &results["rows"][label];
        let activations: ActivationPlan = row["activation_plan"].as_str().unwrap().parse().unwrap();
        let predicted = predict_plan(&input, &activations).total / GIB;
        let measured = row["device_peak_gib"].as_f64().unwrap();
        println!("{label} {activations}: predicted {predicted:.2} GiB, measured {measured:.2}");
        assert!(
            predicted >= measured && predicted <= 1.15 * measured,
            "{label}: predicted {predicted:.2} GiB, measured {measured:.2}"
        );
    }
}

/// A rank of a sequence split over 4 holds a quarter of the rows (as a sequence of a quarter of
/// the length would) and, in each layer's graph, the keys and values of every position.
#[test]
fn a_split_sequence_holds_its_share_of_the_rows_and_every_positions_keys_and_values() {
    let quarter = cost_table(&llama_2_7b(32768, Method::Lora, false));
    let split = cost_table(&PlanInput {
        seq_len: 131072,
        context_parallel: 4,
        ..llama_2_7b(32768, Method::Lora, false)
    });
    // K and V, 4096 channels each in bf16, at every one of the 131072 positions.
    let gathered = 2.0 * 4096.0 * 2.0 * 131072.0;
    assert_eq!(split.input_bytes, quarter.input_bytes);
    for (whole, rank) in quarter.layers.iter().zip(&split.layers) {
        for (x, y) in [
            (whole.kept_bytes, rank.kept_bytes),
            (whole.rebuilt_bytes, rank.rebuilt_bytes),
        ] {
            assert!(((y - x) as f64 - gathered).abs() < 1e3, "{x} -> {y}");
        }
        assert_eq!(rank.backward_bytes, whole.backward_bytes);
    }
}
