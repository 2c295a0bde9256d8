//! `speclab bench kv-replay`: speclab's replay and vLLM's, side by side, in one run.
//!
//! The brief's rule: speed goals are ratios measured side by side in one run,
//! never timed tests. This command replays one operation trace through
//! speclab's `KvCacheManager` (best of `--repeat`, parsing excluded) and then
//! through vLLM 0.33.0's Python `KVCacheManager` via
//! `recipes/kv_replay_bench.py` (its replay loop only, same trace), checks
//! that both produced the same results when vLLM's results file is given,
//! and prints the ratio. If the trace does not exist and a Python with vLLM
//! is given, it is generated first with the recipe's deterministic generator.
//! Invariant: the ratio printed is computed from the two timings of this run.

use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use speclab_experiments::replay::{self, Replayer};

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Replay a long KV trace through speclab and through vLLM (Python) and print the ratio.
    KvReplay(KvReplayArgs),
}

#[derive(Debug, Args)]
pub struct KvReplayArgs {
    /// Layout (JSON/RON).
    #[arg(
        long,
        default_value = "tests/golden/kv/bench/glm53_dflash2_upstream.layout.json"
    )]
    pub layout: PathBuf,
    /// Operations (JSON lines).
    #[arg(
        long,
        default_value = "tests/golden/kv/bench/glm53_dflash2_upstream_100k.ops.jsonl"
    )]
    pub ops: PathBuf,
    /// vLLM's results for the same trace (from the generator's --out-results), to check equality.
    #[arg(long)]
    pub vllm_results: Option<PathBuf>,
    /// Python interpreter with vllm==0.33.0 installed; without it only speclab is timed.
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// Operations to generate when the trace is missing.
    #[arg(long, default_value_t = 100_000)]
    pub gen: u64,
    /// Repetitions (best of) for speclab.
    #[arg(long, default_value_t = 5)]
    pub repeat: u32,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(c: BenchCommand) -> anyhow::Result<ExitCode> {
    match c {
        BenchCommand::KvReplay(a) => kv_replay(a),
    }
}

fn kv_replay(a: KvReplayArgs) -> anyhow::Result<ExitCode> {
    let recipe = PathBuf::from("recipes/kv_replay_bench.py");
    if !a.ops.exists() || !a.layout.exists() {
        let Some(py) = &a.python else {
            bail!("{} or {} does not exist; pass --python <python with vllm==0.33.0> to generate it (recipes/README.md)", a.layout.display(), a.ops.display())
        };
        let results = a
            .vllm_results
            .clone()
            .unwrap_or_else(|| a.ops.with_extension("results.jsonl"));
        let st = Command::new(py)
            .arg(&recipe)
            .args(["--gen", &a.gen.to_string(), "--seed", "0", "--out-layout"])
            .arg(&a.layout)
            .arg("--out-ops")
            .arg(&a.ops)
            .arg("--out-results")
            .arg(&results)
            .status()
            .with_context(|| format!("running {} {}", py.display(), recipe.display()))?;
        if !st.success() {
            bail!("trace generation failed ({st})");
        }
    }
    let layout = replay::load_layout(&a.layout)?;
    let trace = replay::parse_ops(&a.ops)?;
    let n = trace.ops.len();
    let mut best = f64::INFINITY;
    let mut last = Vec::new();
    for _ in 0..a.repeat.max(1) {
        let mut r = Replayer::new(&layout)?;
        let mut out = Vec::with_capacity(n);
        let t0 = Instant::now();
        r.run(&trace, |res| {
            out.push(res.clone());
            Ok(())
        })?;
        best = best.min(t0.elapsed().as_secs_f64());
        last = out;
    }
    let mut checked = None;
    if let Some(p) = &a.vllm_results {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let mut mismatches = 0usize;
        for (i, (line, res)) in text.lines().zip(&last).enumerate() {
            let want: serde_json::Value =
                serde_json::from_str(line).with_context(|| format!("{}:{}", p.display(), i + 1))?;
            let got: serde_json::Value = serde_json::from_str(&res.to_json())?;
            if want.get("blocks") != got.get("blocks") || want.get("free") != got.get("free") {
                mismatches += 1;
            }
        }
        checked = Some(mismatches);
        if mismatches > 0 {
            bail!(
                "{mismatches} of {n} results differ from vLLM's ({})",
                p.display()
            );
        }
    }
    let mut vllm_s = None;
    if let Some(py) = &a.python {
        let out = Command::new(py)
            .arg(&recipe)
            .arg("--layout")
            .arg(&a.layout)
            .arg("--ops")
            .arg(&a.ops)
            .output()
            .with_context(|| format!("running {} {}", py.display(), recipe.display()))?;
        if !out.status.success() {
            bail!(
                "vLLM replay failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let line = String::from_utf8_lossy(&out.stdout);
        let v: serde_json::Value = serde_json::from_str(line.trim().lines().last().unwrap_or(""))
            .context("parsing the recipe's JSON")?;
        vllm_s = v.get("seconds").and_then(|s| s.as_f64());
    }
    let ratio = vllm_s.map(|v| v / best);
    if a.json {
        outln!(
            "{}",
            serde_json::json!({"ops": n, "speclab_seconds": best, "vllm_seconds": vllm_s, "ratio": ratio, "results_checked_against_vllm": checked.map(|m| m == 0)})
        );
    } else {
        outln!(
            "trace: {} ({n} ops), layout {}",
            a.ops.display(),
            a.layout.display()
        );
        outln!(
            "speclab  : {:>10.3} ms  ({:.0} ops/s, best of {})",
            best * 1e3,
            n as f64 / best,
            a.repeat.max(1)
        );
        if let Some(v) = vllm_s {
            outln!(
                "vLLM py  : {:>10.3} ms  ({:.0} ops/s)",
                v * 1e3,
                n as f64 / v
            );
        }
        if let Some(r) = ratio {
            outln!("ratio    : speclab is {r:.1}x faster");
        }
        if let Some(m) = checked {
            outln!("results  : {} of {n} equal to vLLM's", n - m);
        }
    }
    Ok(ExitCode::SUCCESS)
}
