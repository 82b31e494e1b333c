//! `metrics.jsonl` (one JSON object per step, plus validation records) and the SVG plots drawn
//! from it: loss (training and validation), learning rate, and memory per step.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use plotters::prelude::*;
use serde_json::Value;

pub const METRICS_FILE: &str = "metrics.jsonl";

/// Appends records to `metrics.jsonl`. Each record rewrites the file atomically (the file is
/// small next to a training step), so it always ends in a whole line.
pub struct MetricsWriter {
    path: PathBuf,
    text: String,
}

impl MetricsWriter {
    /// Opens the run's metrics, keeping only the records up to `keep_through_step` (a resumed
    /// run rewrites what came after its checkpoint).
    pub fn open(out: &Path, keep_through_step: usize) -> Result<Self> {
        let path = out.join(METRICS_FILE);
        let kept: Vec<String> = match std::fs::read_to_string(&path) {
            Ok(text) => text
                .lines()
                .filter(|l| {
                    serde_json::from_str::<Value>(l)
                        .ok()
                        .and_then(|v| v.get("step").and_then(Value::as_u64))
                        .is_some_and(|s| s as usize <= keep_through_step)
                })
                .map(|l| format!("{l}\n"))
                .collect(),
            Err(_) => Vec::new(),
        };
        let writer = Self {
            path,
            text: kept.concat(),
        };
        lemo_models::adapter::write_atomically(&writer.path, writer.text.as_bytes())?;
        Ok(writer)
    }

    pub fn write(&mut self, record: &Value) -> Result<()> {
        self.text.push_str(&format!("{record}\n"));
        lemo_models::adapter::write_atomically(&self.path, self.text.as_bytes())?;
        Ok(())
    }
}

pub fn read_metrics(out: &Path) -> Result<Vec<Value>> {
    let path = out.join(METRICS_FILE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

fn series(records: &[Value], kind: &str, key: &str) -> Vec<(f64, f64)> {
    records
        .iter()
        .filter(|r| r.get("kind").and_then(Value::as_str) == Some(kind))
        .filter_map(|r| Some((r.get("step")?.as_f64()?, r.get(key)?.as_f64()?)))
        .filter(|(_, y)| y.is_finite())
        .collect()
}

type Line<'a> = (&'a str, Vec<(f64, f64)>, RGBColor);

fn line_chart(path: &Path, title: &str, y_label: &str, lines: &[Line]) -> Result<()> {
    let points: Vec<&(f64, f64)> = lines.iter().flat_map(|(_, s, _)| s.iter()).collect();
    if points.is_empty() {
        return Ok(());
    }
    let x_max = points.iter().map(|p| p.0).fold(1.0, f64::max);
    let y_min = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let y_max = points.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let pad = ((y_max - y_min) * 0.05).max(y_max.abs() * 1e-3).max(1e-12);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 500)).into_drawing_area();
        draw_chart(
            &root,
            title,
            y_label,
            lines,
            x_max,
            (y_min - pad)..(y_max + pad),
        )
        .map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))?;
    }
    lemo_models::adapter::write_atomically(path, svg.as_bytes())?;
    Ok(())
}

fn draw_chart(
    root: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    title: &str,
    y_label: &str,
    lines: &[Line],
    x_max: f64,
    y_range: std::ops::Range<f64>,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_max, y_range)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_label)
        .draw()?;
    for (name, data, color) in lines {
        if data.is_empty() {
            continue;
        }
        let color = *color;
        chart
            .draw_series(LineSeries::new(data.iter().copied(), color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        if data.len() <= 50 {
            chart.draw_series(data.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Draws `plots/loss.svg`, `plots/lr.svg`, `plots/memory.svg` and, for `--method lemo`,
/// `plots/kept.svg` from the run's metrics.
pub fn plot(out: &Path) -> Result<Vec<PathBuf>> {
    let records = read_metrics(out)?;
    let dir = out.join("plots");
    std::fs::create_dir_all(&dir)?;
    let loss = dir.join("loss.svg");
    line_chart(
        &loss,
        "Loss",
        "cross-entropy (nats/token)",
        &[
            ("train", series(&records, "train", "loss"), BLUE),
            ("validation", series(&records, "val", "val_loss"), RED),
        ],
    )?;
    let lr = dir.join("lr.svg");
    line_chart(
        &lr,
        "Learning rate",
        "learning rate",
        &[("lr", series(&records, "train", "lr"), GREEN)],
    )?;
    let memory = dir.join("memory.svg");
    line_chart(
        &memory,
        "Memory per step",
        "GiB",
        &[
            ("peak", series(&records, "train", "mem_peak_gib"), RED),
            (
                "after forward",
                series(&records, "train", "mem_after_forward_gib"),
                BLUE,
            ),
        ],
    )?;
    let mut plots = vec![loss, lr, memory];
    let keep_attention = series(&records, "train", "keep_attention");
    if !keep_attention.is_empty() {
        let keep = dir.join("kept.svg");
        line_chart(
            &keep,
            "Kept fraction of tokens (token-eliminating blocks)",
            "kept fraction",
            &[
                ("attention", keep_attention, BLUE),
                ("MLP", series(&records, "train", "keep_mlp"), RED),
            ],
        )?;
        plots.push(keep);
    }
    Ok(plots)
}
