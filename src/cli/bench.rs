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
//! A run that times vLLM too writes a record (`runs/bench-kv-replay.json` unless `--out`;
//! a speclab-only run only where `--out` says), atomically and locked like experiment
//! records: the trace and its FNV-1a digest, both timings, the
//! ratio, the equality check, the machine's CPU count, the git commit and the command.
//! Invariant: the ratio printed is computed from the two timings of this run.
//!
//! `speclab bench moe` (issue 12): one GLM-5.3-Flash MoE layer on the GPU with the
//! engine's INT4 kernels ([`speclab_cuda::moebench`]): µs, distinct experts, bytes, GB/s
//! and the share of the copy bandwidth measured in the same run, per M and routing, each
//! row checked against an f64 reference; the record (`runs/bench-moe.json` unless
//! `--out`) is written atomically and locked like kv-replay's. The PyTorch anchors run in
//! the same device call from `recipes/moe_bench.sh`.

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
    /// Decode tok/s of the real engine per drafter and concurrency, graphs on/off (CUDA).
    E2e(super::bench_e2e::E2eArgs),
    /// One GLM-5.3-Flash W4A16 MoE layer on the GPU: µs, GB/s, % of copy bandwidth per M and routing.
    Moe(MoeArgs),
}

#[derive(Debug, Args)]
pub struct MoeArgs {
    /// Token counts M, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,4,8,16,32,64,128,256"
    )]
    pub m: Vec<usize>,
    /// Routings, comma-separated (uniform, zipf, sequence).
    #[arg(long, value_delimiter = ',', default_value = "uniform,zipf,sequence")]
    pub routing: Vec<String>,
    /// Timed calls per row (median reported), for the experts and for the whole layer.
    #[arg(long, default_value_t = 50)]
    pub iters: usize,
    /// Layer copies (and routing draws) rotated over, so no call hits L2 from the previous one.
    #[arg(long, default_value_t = 4)]
    pub copies: usize,
    /// Most pairs the f64 reference checks per row.
    #[arg(long, default_value_t = 512)]
    pub check_pairs: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where to write the record.
    #[arg(long, default_value = "runs/bench-moe.json")]
    pub out: PathBuf,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
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
    /// Where to write the benchmark record (default runs/bench-kv-replay.json when vLLM is
    /// timed too; a speclab-only run writes a record only where --out says).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Compare speclab's results with vLLM's results file; refuse any difference.
fn check_results(p: &std::path::Path, got: &[replay::OpResult]) -> anyhow::Result<usize> {
    let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
    let mut mismatches = 0usize;
    for (i, (line, res)) in text.lines().zip(got).enumerate() {
        let want: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}:{}", p.display(), i + 1))?;
        let got: serde_json::Value = serde_json::from_str(&res.to_json())?;
        if want.get("blocks") != got.get("blocks") || want.get("free") != got.get("free") {
            mismatches += 1;
        }
    }
    if mismatches > 0 {
        bail!(
            "{mismatches} of {} results differ from vLLM's ({})",
            got.len(),
            p.display()
        );
    }
    Ok(mismatches)
}

/// vLLM's replay time (best of `--repeat`) from the recipe, on the same trace.
fn vllm_seconds(
    py: &std::path::Path,
    recipe: &std::path::Path,
    a: &KvReplayArgs,
) -> anyhow::Result<Option<f64>> {
    let out = Command::new(py)
        .arg(recipe)
        .arg("--layout")
        .arg(&a.layout)
        .arg("--ops")
        .arg(&a.ops)
        .arg("--repeat")
        .arg(a.repeat.max(1).to_string())
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
    Ok(v.get("seconds").and_then(|s| s.as_f64()))
}

/// The human form of a benchmark record.
fn print_text(a: &KvReplayArgs, record: &serde_json::Value, out: Option<&std::path::Path>) {
    let f = |k: &str| record[k].as_f64();
    let n = record["ops"].as_u64().unwrap_or(0) as usize;
    let best = f("speclab_seconds").unwrap_or(f64::NAN);
    let vllm_s = f("vllm_seconds");
    let ratio = f("ratio");
    let checked = record["results_checked_against_vllm"]
        .as_bool()
        .map(|ok| if ok { 0 } else { n });
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
            "vLLM py  : {:>10.3} ms  ({:.0} ops/s, best of {})",
            v * 1e3,
            n as f64 / v,
            a.repeat.max(1)
        );
    }
    if let Some(r) = ratio {
        outln!("ratio    : speclab is {r:.1}x faster");
    }
    if let Some(m) = checked {
        outln!("results  : {} of {n} equal to vLLM's", n - m);
    }
    if cfg!(debug_assertions) {
        outln!("(debug build: timings are not representative; use cargo run --release)");
    }
    match out {
        Some(o) => outln!("record   : {}", o.display()),
        None => outln!("record   : none written (speclab only; give --python, or --out)"),
    }
}

/// FNV-1a 64 of a file's bytes (identifies the trace a record was measured on).
fn file_digest(p: &std::path::Path) -> anyhow::Result<String> {
    let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    Ok(format!("{h:016x}"))
}

pub fn run(c: BenchCommand) -> anyhow::Result<ExitCode> {
    match c {
        BenchCommand::KvReplay(a) => kv_replay(a),
        BenchCommand::E2e(a) => super::bench_e2e::e2e(a),
        BenchCommand::Moe(a) => moe(a),
    }
}

fn moe(a: MoeArgs) -> anyhow::Result<ExitCode> {
    use speclab_cuda::moebench::{self, MoeBenchConfig, RoutingMode};
    let modes = a
        .routing
        .iter()
        .map(|r| RoutingMode::parse(r))
        .collect::<Result<Vec<_>, _>>()?;
    let cfg = MoeBenchConfig {
        ms: a.m.clone(),
        modes,
        iters: a.iters,
        copies: a.copies,
        seed: a.seed,
        check_pairs: a.check_pairs,
        ..Default::default()
    };
    if cfg.iters == 0 || cfg.copies == 0 || cfg.ms.is_empty() || cfg.ms.contains(&0) {
        bail!("bench moe: --iters, --copies and every --m must be at least 1");
    }
    if let Some(why) = speclab_cuda::device::skip_reason() {
        bail!("{why}: bench moe needs a GPU (recipes/moe_bench.sh runs it on the device machine)");
    }
    // Lock the record first: an unwritable --out fails before any work.
    let mut lock = speclab_experiments::record::RecordLock::open(&a.out)?;
    let _guard = lock.try_lock()?;
    let report = moebench::run(&cfg, &mut |l| tracing::info!("{l}"))?;
    let mut record = serde_json::to_value(&report)?;
    record["bench"] = "moe".into();
    record["command"] = std::env::args().collect::<Vec<_>>().join(" ").into();
    record["git_commit"] = speclab_experiments::record::git_commit().into();
    record["measured_unix_s"] = speclab_experiments::record::now_unix().into();
    record["release_build"] = (!cfg!(debug_assertions)).into();
    speclab_experiments::record::write_atomic(&a.out, &serde_json::to_vec_pretty(&record)?)?;
    if a.json {
        outln!("{}", serde_json::to_string(&record)?);
    } else {
        print_moe(&report, &a.out);
    }
    Ok(if report.all_pass {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The human form of a `bench moe` record.
fn print_moe(r: &speclab_cuda::moebench::MoeBenchReport, out: &std::path::Path) {
    outln!(
        "{} ({}): copy {:.0} GB/s (end {:.0}), expert {:.2} MB, {} layer copies",
        r.device,
        r.arch,
        r.copy_gb_s,
        r.copy_gb_s_end,
        r.expert_bytes_each as f64 / 1e6,
        r.config.copies
    );
    outln!(
        "{:>8} {:>4} {:>7} {:>10} {:>10} {:>8} {:>6} {:>10} {:>7} {:>10} {:>9} {:>9} {}",
        "routing",
        "M",
        "experts",
        "experts_us",
        "floor_us",
        "GB/s",
        "%copy",
        "chained_us",
        "%copy",
        "layer_us",
        "rel_err",
        "vs_exact",
        ""
    );
    for w in &r.rows {
        outln!(
            "{:>8} {:>4} {:>7.1} {:>10.1} {:>10.1} {:>8.0} {:>5.0}% {:>10.1} {:>6.0}% {:>10.1} {:>9.1e} {:>9.1e} {}",
            w.routing,
            w.m,
            w.distinct_experts,
            w.experts_us,
            w.floor_us,
            w.gb_s,
            100.0 * w.frac_copy,
            w.experts_us_chained,
            100.0 * w.frac_copy_chained,
            w.layer_us,
            w.max_rel_err,
            w.max_rel_err_exact,
            if w.pass { "ok" } else { "FAIL" }
        );
    }
    if cfg!(debug_assertions) {
        outln!("(debug build: host launch overhead inflates small-M rows; use --release)");
    }
    outln!("record: {}", out.display());
}

fn kv_replay(mut a: KvReplayArgs) -> anyhow::Result<ExitCode> {
    let recipe = PathBuf::from("recipes/kv_replay_bench.py");
    // Lock the record first: an unwritable --out fails before any work.
    let out = a.out.clone().or_else(|| {
        a.python
            .as_ref()
            .map(|_| PathBuf::from("runs/bench-kv-replay.json"))
    });
    let mut lock = match &out {
        Some(o) => Some(speclab_experiments::record::RecordLock::open(o)?),
        None => None,
    };
    let _guard = match &mut lock {
        Some(l) => Some(l.try_lock()?),
        None => None,
    };
    let default_results = a.ops.with_extension("results.jsonl");
    if !a.ops.exists() || !a.layout.exists() {
        let Some(py) = &a.python else {
            bail!("{} or {} does not exist; the trace is generated by vLLM itself: python -m venv .venv && .venv/bin/pip install vllm==0.33.0, then pass --python .venv/bin/python (recipes/README.md)", a.layout.display(), a.ops.display())
        };
        let results = a
            .vllm_results
            .clone()
            .unwrap_or_else(|| default_results.clone());
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
    if a.vllm_results.is_none() && default_results.exists() {
        a.vllm_results = Some(default_results);
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
    let checked = match &a.vllm_results {
        Some(p) => Some(check_results(p, &last)?),
        None => None,
    };
    let vllm_s = match &a.python {
        Some(py) => vllm_seconds(py, &recipe, &a)?,
        None => None,
    };
    let ratio = vllm_s.map(|v| v / best);
    let record = serde_json::json!({
        "bench": "kv-replay",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "git_commit": speclab_experiments::record::git_commit(),
        "measured_unix_s": speclab_experiments::record::now_unix(),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "release_build": !cfg!(debug_assertions),
        "layout": a.layout.display().to_string(),
        "trace": a.ops.display().to_string(),
        "trace_fnv1a": file_digest(&a.ops)?,
        "ops": n,
        "repeat_best_of": a.repeat.max(1),
        "speclab_seconds": best,
        "vllm_seconds": vllm_s,
        "ratio": ratio,
        "results_checked_against_vllm": checked.map(|m| m == 0),
    });
    if let Some(o) = &out {
        speclab_experiments::record::write_atomic(o, &serde_json::to_vec_pretty(&record)?)?;
    }
    if a.json {
        outln!("{}", serde_json::to_string(&record)?);
    } else {
        print_text(&a, &record, out.as_deref());
    }
    Ok(ExitCode::SUCCESS)
}
