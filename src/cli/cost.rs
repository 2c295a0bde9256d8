//! `speclab cost fit` and `speclab cost overlap`: the step-cost model against GPU records.
//!
//! `fit` reads bench records (`gpu-check`, `bench-e2e`, `bench-moe`; see
//! `speclab_experiments::cost_fit`), fits the cost model's launch / row / expert
//! parameters by non-negative least squares with the bandwidth term fixed at each
//! record's measured copy bandwidth, predicts held-out rows (`--hold-out 8,128`, or
//! leave-one-batch-out) and prints per row measured / predicted / residual; `--out`
//! writes the report as a record (locked, atomic). `overlap` prints `E[distinct
//! experts]` under the overlap models (uniform, Zipf, sequence-correlated) and, with
//! `--record`, the distinct experts a real run measured per verify step beside the
//! uniform model and the fitted reuse probability.
//! Invariant: with `--json`, stdout carries only JSON.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand};
use speclab_engine::cost::Routing;
use speclab_experiments::cost_fit::{self, FitReport, FitShape};
use speclab_experiments::record::{self, RunRecord};

#[derive(Debug, Subcommand)]
pub enum CostCommand {
    /// Fit the step-cost model to GPU bench records; predict held-out rows.
    Fit(FitArgs),
    /// Expected distinct experts of a verify batch; measured overlap of a real record.
    Overlap(OverlapArgs),
}

#[derive(Debug, Args)]
pub struct FitArgs {
    /// Bench records (gpu-check, bench-e2e, bench-moe JSON).
    #[arg(required = true)]
    pub records: Vec<PathBuf>,
    /// Batch / concurrency values to hold out of the fit and predict (comma-separated);
    /// default: leave-one-batch-out (each value predicted from the others).
    #[arg(long, value_delimiter = ',')]
    pub hold_out: Vec<u64>,
    /// Hold out by `batch` (the default: `--hold-out`'s values, or each batch in turn) or
    /// by `config`: each configuration (drafter, N, graphs) in turn, predicted at every
    /// batch from the others.
    #[arg(long, value_enum, default_value = "batch")]
    pub hold_out_by: HoldOutBy,
    /// Write the report here (e.g. runs/cost-fit-tiny.json).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

/// `--hold-out-by`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum HoldOutBy {
    Batch,
    Config,
}

#[derive(Debug, Args)]
pub struct OverlapArgs {
    /// Routed experts per layer.
    #[arg(long, default_value_t = 288)]
    pub experts: u32,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    pub top_k: u32,
    /// Batches as SEQSxROWS (rows per sequence) or ROWS (one row per sequence).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub rows: Vec<String>,
    /// Zipf exponent of expert popularity.
    #[arg(long, default_value_t = 0.0)]
    pub zipf: f64,
    /// Probability a row reuses the previous row's experts (same sequence).
    #[arg(long, default_value_t = 0.0)]
    pub reuse: f64,
    /// A real record (e.g. runs/acceptance-tiny.json): measured experts per verify step.
    #[arg(long)]
    pub record: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

/// Run a `cost` subcommand.
pub fn run(c: CostCommand) -> anyhow::Result<ExitCode> {
    match c {
        CostCommand::Fit(a) => fit(a),
        CostCommand::Overlap(a) => overlap(a),
    }
}

fn fit(a: FitArgs) -> anyhow::Result<ExitCode> {
    let mut rows = Vec::new();
    let mut shape: Option<FitShape> = None;
    for p in &a.records {
        let (r, s) = cost_fit::load_rows(p, shape)?;
        shape = Some(s);
        rows.extend(r);
    }
    anyhow::ensure!(!rows.is_empty(), "no timing rows in {:?}", a.records);
    let shape = shape.context("no record")?;
    let how = match a.hold_out_by {
        HoldOutBy::Batch => cost_fit::HoldOut::Batches(&a.hold_out),
        HoldOutBy::Config => {
            anyhow::ensure!(
                a.hold_out.is_empty(),
                "--hold-out {:?} names batches; it cannot be combined with --hold-out-by config",
                a.hold_out
            );
            cost_fit::HoldOut::Configs
        }
    };
    let rep = cost_fit::fit_report_by(&a.records, &rows, shape, how)?;
    if let Some(out) = &a.out {
        save(out, &rep)?;
    }
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&rep)?);
    } else {
        print_fit(&rep, a.out.as_deref());
    }
    Ok(ExitCode::SUCCESS)
}

fn save(out: &Path, rep: &FitReport) -> anyhow::Result<()> {
    let mut lock = record::RecordLock::open(out)?;
    let _guard = lock.try_lock()?;
    let mut text = serde_json::to_string_pretty(rep)?;
    text.push('\n');
    record::write_atomic(out, text.as_bytes())?;
    Ok(())
}

fn opt(x: Option<f64>, f: impl Fn(f64) -> String) -> String {
    x.map_or_else(|| "-".into(), f)
}

fn print_fit(rep: &FitReport, out: Option<&Path>) {
    outln!(
        "cost fit of {} ({} rows), held out: {}",
        rep.inputs.join(", "),
        rep.rows.len(),
        rep.held_out
    );
    let params: Vec<String> = rep
        .params
        .iter()
        .map(|(k, v)| format!("{k} = {v:.4}"))
        .collect();
    outln!("parameters (fit on every row): {}", params.join(", "));
    outln!(
        "{:<34} {:>10} {:>10} {:>8} {:>10} {:>8} {:>11} {:>11}",
        "row",
        "meas. us",
        "fit us",
        "resid.",
        "held us",
        "error",
        "meas. tok/s",
        "pred. tok/s"
    );
    for r in &rep.rows {
        outln!(
            "{:<34} {:>10.1} {:>10.1} {:>7.1}% {:>10} {:>8} {:>11} {:>11}",
            r.label,
            r.measured_us,
            r.predicted_us,
            100.0 * r.residual,
            opt(r.held_out_us, |v| format!("{v:.1}")),
            opt(r.held_out_error, |v| format!("{:.1}%", 100.0 * v)),
            opt(r.measured_tok_s, |v| format!("{v:.0}")),
            opt(r.held_out_tok_s, |v| format!("{v:.0}"))
        );
    }
    outln!(
        "held-out rows within 10%: {} of {}; largest held-out error: {}",
        rep.held_out_within_10pct,
        rep.held_out_rows,
        opt(rep.max_abs_held_out_error, |v| format!("{:.1}%", 100.0 * v))
    );
    if let Some(o) = out {
        outln!("wrote {}", o.display());
    }
}

/// `SEQSxROWS` or `ROWS` (that many one-row sequences).
fn parse_batch(s: &str) -> anyhow::Result<Vec<u64>> {
    let (seqs, rows) = match s.split_once('x') {
        Some((a, b)) => (a.trim().parse::<u64>()?, b.trim().parse::<u64>()?),
        None => (s.trim().parse::<u64>()?, 1),
    };
    Ok(vec![rows; seqs as usize])
}

fn overlap(a: OverlapArgs) -> anyhow::Result<ExitCode> {
    let routing = Routing {
        zipf: a.zipf,
        reuse: a.reuse,
    };
    routing.validate()?;
    anyhow::ensure!(
        a.top_k >= 1 && a.top_k <= a.experts,
        "--top-k {} must be in 1..=--experts {}",
        a.top_k,
        a.experts
    );
    let mut model = Vec::new();
    for b in &a.rows {
        let seqs = parse_batch(b)
            .with_context(|| format!("--rows entry {b:?}: expected ROWS or SEQSxROWS"))?;
        let d = routing.expected_distinct(a.experts, a.top_k, &seqs);
        model.push(serde_json::json!({"batch": b, "rows": seqs.iter().sum::<u64>(), "expected_distinct": d}));
    }
    let measured = match &a.record {
        Some(p) => Some(measured_overlap(p)?),
        None => None,
    };
    let doc = serde_json::json!({"experts": a.experts, "top_k": a.top_k, "routing": routing,
        "model": model, "measured": measured});
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "E[distinct experts] of one layer, {} experts top-{}, zipf {}, reuse {}:",
        a.experts,
        a.top_k,
        a.zipf,
        a.reuse
    );
    for m in &model {
        outln!(
            "  {:>8} ({} rows): {:.1}",
            m["batch"].as_str().unwrap_or(""),
            m["rows"],
            m["expected_distinct"].as_f64().unwrap_or(0.0)
        );
    }
    if let Some(m) = &measured {
        print_measured(m);
    }
    Ok(ExitCode::SUCCESS)
}

fn measured_overlap(p: &Path) -> anyhow::Result<serde_json::Value> {
    let rec = RunRecord::load(p)?;
    let model = rec
        .manifest
        .pointer("/real/model")
        .and_then(|v| v.as_str())
        .with_context(|| {
            format!(
                "{}: not a real-engine record (no manifest.real.model)",
                p.display()
            )
        })?;
    let shape = FitShape::from_config(Path::new(model), 0.0)?;
    let rows = cost_fit::overlap_rows(&rec, shape.experts, shape.top_k);
    Ok(
        serde_json::json!({"record": p.display().to_string(), "model": model,
        "experts": shape.experts, "top_k": shape.top_k, "moe_layers": shape.moe_layers, "legs": rows}),
    )
}

fn print_measured(m: &serde_json::Value) {
    outln!(
        "measured in {} ({}: {} experts top-{}, {} MoE layers), distinct (layer, expert) pairs per verify step:",
        m["record"].as_str().unwrap_or(""),
        m["model"].as_str().unwrap_or(""),
        m["experts"],
        m["top_k"],
        m["moe_layers"]
    );
    outln!(
        "  {:<28} {:>6} {:>9} {:>8} {:>6}",
        "leg",
        "rows",
        "measured",
        "uniform",
        "reuse"
    );
    for l in m["legs"].as_array().into_iter().flatten() {
        let f = |k: &str| l[k].as_f64().unwrap_or(f64::NAN);
        outln!(
            "  {:<28} {:>6.2} {:>9.2} {:>8.2} {:>6}",
            l["leg"].as_str().unwrap_or(""),
            f("mean_verify_width"),
            f("measured"),
            f("uniform"),
            l["fitted_reuse"]
                .as_f64()
                .map_or_else(|| "-".into(), |r| format!("{r:.3}"))
        );
    }
}
