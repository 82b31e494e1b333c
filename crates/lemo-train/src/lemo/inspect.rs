//! `calibrate` and `profile`: thresholds and informativeness statistics of a model on the
//! user's data, without training.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use lemo_kernels::LemoBackend;
use lemo_models::token_plan::{TokenPlan, TokenSparsity};
use lemo_models::{CausalLm, ModelConfig};
use lemo_sparsity::KeptRows;
use lemo_sparsity::calibration::{Block, Calibrator};
use plotters::prelude::*;
use serde_json::json;

use super::inputs::{InspectArgs, read_sequences};
use super::predictors::{TrainPredictorsArgs, train_predictors};
use super::{
    LemoSettings, calibrate, profile, read_thresholds, thresholds_for_model, write_thresholds,
};
use crate::data::int_tokens;
use crate::device::BackendJob;
use crate::modelio::{self, ModelSetup};

enum Task {
    Calibrate,
    Profile,
    TrainPredictors(Box<TrainPredictorsArgs>),
}

struct InspectJob {
    args: InspectArgs,
    settings: LemoSettings,
    setup: ModelSetup,
    task: Task,
}

/// `lemo-train calibrate`: writes the thresholds file; returns its path.
pub fn run_calibrate(args: InspectArgs) -> Result<PathBuf> {
    run(args, Task::Calibrate)
}

/// `lemo-train profile`: writes `profile.json` and `kept.svg`; returns the folder.
pub fn run_profile(args: InspectArgs) -> Result<PathBuf> {
    run(args, Task::Profile)
}

/// `lemo-train train-predictors`: writes the predictors file; returns its path.
pub fn run_train_predictors(args: TrainPredictorsArgs) -> Result<PathBuf> {
    run(args.inspect.clone(), Task::TrainPredictors(Box::new(args)))
}

fn run(args: InspectArgs, task: Task) -> Result<PathBuf> {
    let settings = args.lemo.clone();
    settings.validate()?;
    if let Some(out) = &args.out {
        let inputs = [
            Some(&args.model.model),
            Some(&args.data),
            args.model.adapter.as_ref(),
        ];
        let inputs: Vec<&Path> = inputs.into_iter().flatten().map(PathBuf::as_path).collect();
        modelio::check_output("--out", out, &inputs)?;
    }
    if settings.keep_exactly {
        bail!(
            "--keep-exactly is for train and eval: calibrate, profile and train-predictors work with thresholds"
        );
    }
    let (device, setup) = args.model.resolve()?;
    device.run(InspectJob {
        args,
        settings,
        setup,
        task,
    })
}

impl BackendJob for InspectJob {
    type Output = PathBuf;

    fn run<B: LemoBackend>(self, device: B::Device) -> Result<PathBuf> {
        let args = &self.args;
        let setup = &self.setup;
        let (model, config) = modelio::load::<B>(&args.model.model, setup, &device)?;
        let seq_len = args
            .seq_len
            .or(args.model.target_context)
            .unwrap_or(config.max_position_embeddings());
        setup.check_seq_len(&config, seq_len)?;
        self.settings.check_sequence(&model, seq_len)?;
        let read = || {
            let count = self.settings.calibration_sequences;
            read_sequences(args, &args.data, &config, seq_len, count)
        };
        let name = args.model.model.display().to_string();
        match self.task {
            Task::TrainPredictors(predictor_args) => {
                let interpolation = setup.interpolation_factor(&config)?;
                let (settings, args) = (&self.settings, &predictor_args);
                train_predictors(args, settings, &model, &config, seq_len, interpolation)
            }
            Task::Calibrate => {
                let sequences = read()?;
                let thresholds =
                    calibrate(&model, &config, &name, &sequences, &self.settings, true)?;
                let out = args.out.clone().unwrap_or_else(|| "thresholds.json".into());
                write_thresholds(&out, &thresholds)?;
                eprintln!("calibrate: wrote {}", out.display());
                Ok(out)
            }
            Task::Profile => {
                let sequences = read()?;
                let out = args.out.clone().unwrap_or_else(|| "profile".into());
                write_profile(&model, &config, &name, &sequences, &self.settings, &out)?;
                Ok(out)
            }
        }
    }
}

/// Percentiles `[10, 50, 90]`, the mean and the count of `values`.
fn statistics(values: &[f32]) -> serde_json::Value {
    if values.is_empty() {
        return serde_json::Value::Null;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f32::total_cmp);
    let at = |q: f64| sorted[((q * (sorted.len() - 1) as f64).round()) as usize];
    let mean = sorted.iter().map(|&v| v as f64).sum::<f64>() / sorted.len() as f64;
    json!({"mean": mean, "p10": at(0.1), "median": at(0.5), "p90": at(0.9), "blocks": sorted.len()})
}

/// Per layer and block type, statistics of the token-block scores over `sequences`; the kept
/// blocks of the first sequence under the thresholds (`--thresholds`, else the paper's initial
/// ones, each layer's mean score) drawn as a heat map, layers by token blocks.
fn write_profile<B: LemoBackend>(
    model: &CausalLm<B>,
    config: &ModelConfig,
    name: &str,
    sequences: &[Vec<u32>],
    settings: &LemoSettings,
    out: &Path,
) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let profiles = profile(model, config, sequences, settings.scoring(), true);
    let thresholds = match &settings.thresholds {
        Some(path) => read_thresholds(path, config)?,
        None => {
            let calibrator = Calibrator::new(
                profiles.clone(),
                &settings.dense_layers,
                settings.mean_keep(),
                1.0,
            );
            thresholds_for_model(config, name, settings, calibrator.thresholds())
        }
    };
    let device = model.lm_head_weight().device();
    let tokens = int_tokens::<B>(&sequences[..1], &device);
    let mut sparsity =
        TokenSparsity::select(&thresholds).with_query_stride(settings.scoring().query_stride);
    model.hidden_states(tokens, None, &mut sparsity);
    let plan = sparsity.into_plan().unwrap_or_default();
    let layers: Vec<serde_json::Value> = profiles
        .iter()
        .enumerate()
        .map(|(index, p)| {
            let kept = |block| {
                plan.layers
                    .get(index)
                    .and_then(|l| l.get(block).as_ref())
                    .map_or(1.0, |k| k.fraction())
            };
            json!({
                "layer": index,
                "attention": statistics(&p.attention),
                "mlp": statistics(&p.mlp),
                "threshold_attention": thresholds.layers[index].attention,
                "threshold_mlp": thresholds.layers[index].mlp,
                "kept_attention": kept(Block::Attention),
                "kept_mlp": kept(Block::Mlp),
            })
        })
        .collect();
    let report = json!({
        "model": name,
        "sequences": sequences.len(),
        "seq_len": sequences[0].len(),
        "block_size": settings.block_size,
        "thresholds": settings.thresholds.as_ref().map_or("initial (each layer's mean score)".into(), |p| p.display().to_string()),
        "layers": layers,
    });
    let json_path = out.join("profile.json");
    lemo_models::adapter::write_atomically(
        &json_path,
        serde_json::to_string_pretty(&report)?.as_bytes(),
    )?;
    let map = out.join("kept.svg");
    heat_map(
        &map,
        &kept_rows::<B>(&plan),
        config.num_layers(),
        sequences[0].len(),
        settings.block_size,
    )?;
    eprintln!(
        "profile: wrote {} and {}",
        json_path.display(),
        map.display()
    );
    Ok(())
}

/// Each layer's kept rows of its attention and its MLP block on the host (`None`: dense).
fn kept_rows<B: LemoBackend>(plan: &TokenPlan) -> Vec<[Option<KeptRows>; 2]> {
    plan.layers
        .iter()
        .map(|l| {
            [Block::Attention, Block::Mlp].map(|b| l.get(b).as_ref().map(|k| k.to_host::<B>()))
        })
        .collect()
}

/// Kept token blocks of the first sequence: one row per layer, the attention block's half above
/// the MLP block's; kept blocks dark, dropped ones light, dense layers grey.
fn heat_map(
    path: &Path,
    kept_rows: &[[Option<KeptRows>; 2]],
    layers: usize,
    seq_len: usize,
    block_size: usize,
) -> Result<()> {
    let blocks = seq_len.div_ceil(block_size);
    let root = SVGBackend::new(path, (1000, (60 + 24 * layers) as u32)).into_drawing_area();
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "Kept token blocks by layer (top half: attention, bottom: MLP)",
                ("sans-serif", 18),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..blocks as f64, 0.0..layers as f64)?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("token block")
            .y_desc("layer")
            .draw()?;
        for layer in 0..layers {
            for (half, block) in [(0.5, 0), (0.0, 1)] {
                let kept = kept_rows.get(layer).and_then(|l| l[block].as_ref());
                for n in 0..blocks {
                    let color = match kept {
                        None => RGBColor(200, 200, 200),
                        Some(k) if k.rows[..k.kept].contains(&((n * block_size) as u32)) => {
                            RGBColor(30, 80, 160)
                        }
                        Some(_) => RGBColor(235, 240, 250),
                    };
                    let y = layer as f64 + half;
                    chart.plotting_area().draw(&Rectangle::new(
                        [(n as f64, y), (n as f64 + 1.0, y + 0.5)],
                        color.filled(),
                    ))?;
                }
            }
        }
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))
}
