//! `speclab run`, `speclab bounds`, `speclab findings`.
//!
//! `run` executes a manifest (default: the embedded `experiments/df2w-wedge.ron`)
//! with a progress bar per leg and writes the record atomically after each leg
//! (`runs/<name>.json` unless `--out`), resuming finished legs. `bounds`
//! bisects the largest admissible prompt for each distinct layout of a
//! manifest. `findings` renders records to `findings/<name>.md` (and `<name>-tau.svg` for
//! a real sweep over N). `verify_manifest` is `speclab verify-lossless <manifest>`: the
//! lossless check of every drafter x N x concurrency of a real manifest.
//! `run --shard I/N` (or the Slurm / Kubernetes index variables, see
//! `speclab_experiments::shard`) runs only that shard's legs into
//! `runs/<name>.shard-I-of-N.json`; `merge` combines the shard records into the
//! unsharded record after checking they are the shards of one manifest.
//! Invariant: with `--json`, stdout carries only JSON.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use speclab_experiments::bounds::{self, ProbeCtx};
use speclab_experiments::findings;
use speclab_experiments::manifest::{cap_name, Manifest};
use speclab_experiments::real_run;
use speclab_experiments::record::{LegRecord, RunRecord};
use speclab_experiments::runner::{self, Progress, RunCtx, Verdict};
use speclab_experiments::shard::{self, Shard, ShardArgs};

/// The manifest `speclab run` uses first when none is given (simulated, no weights).
pub const EMBEDDED_MANIFEST: &str = include_str!("../../experiments/df2w-wedge.ron");
const EMBEDDED_PATH: &str = "experiments/df2w-wedge.ron";
/// The second default job: the quality spot-suite on the trained checkpoint
/// (`models/tiny` + `models/dflash2-tiny`, paths relative to the repository root).
const EMBEDDED_REAL: &str = include_str!("../../experiments/quality-spot.ron");
const EMBEDDED_REAL_PATH: &str = "experiments/quality-spot.ron";

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Manifest (RON). Default: the embedded experiments/df2w-wedge.ron, then (when
    /// models/tiny is present) the quality spot-suite experiments/quality-spot.ron.
    pub manifest: Option<PathBuf>,
    /// Record path (default runs/<name>.json).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Ignore an existing record instead of resuming (unfinished) or reproducing (complete) it.
    #[arg(long)]
    pub fresh: bool,
    /// Print the record as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Validate the manifest and list its legs (and what is already recorded) without running.
    #[arg(long)]
    pub dry_run: bool,
    /// Run only shard I of N (0-based): the legs whose manifest index i has i % N == I,
    /// into runs/<name>.shard-I-of-N.json. Wins over SLURM_ARRAY_TASK_ID /
    /// SLURM_ARRAY_TASK_COUNT and JOB_COMPLETION_INDEX, which are read otherwise.
    #[arg(long, value_name = "I/N")]
    pub shard: Option<String>,
    /// The shard count N for a Kubernetes Indexed Job (JOB_COMPLETION_INDEX gives only
    /// the index; SPECLAB_SHARD_COUNT is read when this is absent).
    #[arg(long, value_name = "N")]
    pub shard_count: Option<usize>,
    /// Ignore the Slurm / Kubernetes shard variables: run every leg.
    #[arg(long, conflicts_with_all = ["shard", "shard_count"])]
    pub no_shard: bool,
}

#[derive(Debug, Args)]
pub struct MergeArgs {
    /// The shard records (`speclab run --shard I/N`), one per shard, in any order.
    #[arg(required = true)]
    pub records: Vec<PathBuf>,
    /// Merged record path (default: the first record's path without `.shard-I-of-N`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the merged record as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BoundsArgs {
    /// Manifest (RON).
    pub manifest: PathBuf,
    /// Print JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct FindingsArgs {
    /// Run records (JSON) to render.
    #[arg(required = true)]
    pub records: Vec<PathBuf>,
    /// Output directory.
    #[arg(long, default_value = "findings")]
    pub out_dir: PathBuf,
    /// Print the written paths as JSON.
    #[arg(long)]
    pub json: bool,
}

fn load_manifest(path: Option<&Path>) -> anyhow::Result<(Manifest, PathBuf, String)> {
    match path {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("reading manifest {}", p.display()))?;
            let m: Manifest = speclab_experiments::manifest::parse_ron(p, &text)?;
            m.validate(p)?;
            Ok((m, p.to_path_buf(), text))
        }
        None => {
            let p = Path::new(EMBEDDED_PATH);
            let m: Manifest = speclab_experiments::manifest::parse_ron(p, EMBEDDED_MANIFEST)?;
            m.validate(p)?;
            Ok((m, p.to_path_buf(), EMBEDDED_MANIFEST.to_string()))
        }
    }
}

struct Bar {
    bar: Option<ProgressBar>,
}

impl Progress for Bar {
    fn leg_start(&mut self, index: usize, total: usize, id: &str, skipped: bool) {
        if let Some(b) = &self.bar {
            b.set_prefix(format!("leg {}/{}", index + 1, total));
            b.set_message(format!(
                "{id}{}",
                if skipped { " (recorded, skipped)" } else { "" }
            ));
            b.set_position(0);
        }
    }
    fn step(&mut self, step: u64) {
        if step.is_multiple_of(64) {
            if let Some(b) = &self.bar {
                b.set_position(step);
            }
        }
    }
    fn leg_done(&mut self, leg: &LegRecord) {
        if let Some(b) = &self.bar {
            b.println(format!(
                "  {}",
                findings::chain_line(leg).replace("**", "").replace('`', "")
            ));
        }
    }
}

fn bar(enabled: bool) -> Bar {
    if !enabled {
        return Bar { bar: None };
    }
    let b = ProgressBar::new_spinner();
    b.set_style(
        ProgressStyle::with_template("{spinner} {prefix} {msg} [{pos} steps, {elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    b.enable_steady_tick(std::time::Duration::from_millis(120));
    Bar { bar: Some(b) }
}

/// `speclab run`: the given manifest, or with none the embedded defaults: the
/// DFlash2 wedge experiment (simulated), then, when `models/tiny` is present, the
/// quality spot-suite on the trained checkpoint (real engine).
pub fn run(a: RunArgs) -> anyhow::Result<ExitCode> {
    let sa = ShardArgs {
        shard: a.shard.as_deref(),
        count: a.shard_count,
        no_shard: a.no_shard,
    };
    let sh = shard::resolve(&sa, &|k| std::env::var(k).ok())?;
    let a = &RunOpts {
        args: &a,
        shard: sh,
    };
    if a.args.manifest.is_some() {
        let (m, mpath, text) = load_manifest(a.args.manifest.as_deref())?;
        return run_one(a, m, mpath, text);
    }
    if a.args.out.is_some() {
        anyhow::bail!("--out needs a manifest (the default run writes one record per embedded manifest under runs/)");
    }
    let (m, mpath, text) = load_manifest(None)?;
    run_one(a, m, mpath, text)?;
    if Path::new("models/tiny/config.json").exists() {
        let p = Path::new(EMBEDDED_REAL_PATH);
        let m: Manifest = speclab_experiments::manifest::parse_ron(p, EMBEDDED_REAL)?;
        m.validate(p)?;
        run_one(a, m, p.to_path_buf(), EMBEDDED_REAL.to_string())?;
    } else if !a.args.json {
        outln!("(models/tiny not found here: skipped the quality spot-suite on the trained checkpoint; run from the repository root)");
    }
    Ok(ExitCode::SUCCESS)
}

/// The `run` flags with the resolved shard.
struct RunOpts<'a> {
    args: &'a RunArgs,
    shard: Option<Shard>,
}

fn run_one(o: &RunOpts<'_>, m: Manifest, mpath: PathBuf, text: String) -> anyhow::Result<ExitCode> {
    let a = o.args;
    let out = a.out.clone().unwrap_or_else(|| match o.shard {
        Some(s) => s.record_path(&m.name),
        None => PathBuf::from("runs").join(format!("{}.json", m.name)),
    });
    if a.dry_run {
        return dry_run(&m, &mpath, &text, &out, o);
    }
    let ctx = RunCtx {
        manifest: &m,
        manifest_path: &mpath,
        manifest_text: &text,
        record_path: &out,
        resume: !a.fresh,
        shard: o.shard,
    };
    let mut progress = bar(!a.json && std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let outcome = runner::run_manifest(&ctx, &mut progress)?;
    if let Some(b) = progress.bar.take() {
        b.finish_and_clear();
    }
    let verdict = verdict_line(&outcome, &out);
    if a.json {
        outln!("{}", serde_json::to_string(&outcome.record)?);
        eprintln!("{verdict}");
    } else {
        print_run(&outcome.record, &out);
        print_expectations(&m, &outcome.record);
        outln!("{verdict}");
    }
    Ok(ExitCode::SUCCESS)
}

/// One line saying whether the run reproduced the record that was there.
fn verdict_line(o: &runner::RunOutcome, out: &Path) -> String {
    let t = o.timings_path.display();
    match &o.verdict {
        Verdict::New => format!("wrote {} ({} legs computed; timings in {t})", out.display(), o.record.legs.len()),
        Verdict::Resumed { kept, computed } => format!(
            "resumed {}: {kept} finished legs kept unchanged, {computed} computed; timings in {t}",
            out.display()
        ),
        Verdict::Reproduced { legs } => format!(
            "REPRODUCED {}: all {legs} legs recomputed with the same results (record left untouched; this run's timings in {t}, untracked)",
            out.display()
        ),
        Verdict::Differs { legs, differing } => {
            let shown: Vec<String> = differing
                .iter()
                .take(5)
                .map(|(id, d)| format!("  {id}: {d}"))
                .collect();
            format!(
                "DIFFERS from the committed {}: {} of {legs} legs give other results; the record was replaced (see git diff):\n{}{}",
                out.display(),
                differing.len(),
                shown.join("\n"),
                if differing.len() > 5 { format!("\n  ... and {} more", differing.len() - 5) } else { String::new() }
            )
        }
    }
}

/// `speclab run --dry-run`: the legs of a validated manifest, and which a resume would skip.
fn dry_run(
    m: &Manifest,
    mpath: &Path,
    text: &str,
    out: &Path,
    o: &RunOpts<'_>,
) -> anyhow::Result<ExitCode> {
    let (fresh, json) = (o.args.fresh, o.args.json);
    let (mut ids, notes): (Vec<String>, Vec<String>) = match &m.real {
        Some(r) => (
            r.legs().into_iter().map(|l| l.id).collect(),
            r.skipped_drafters().into_iter().map(|(_, n)| n).collect(),
        ),
        None => (m.legs()?.into_iter().map(|l| l.id).collect(), vec![]),
    };
    if let Some(s) = o.shard {
        ids = ids
            .into_iter()
            .enumerate()
            .filter(|(i, _)| s.owns(*i))
            .map(|(_, id)| id)
            .collect();
    }
    // Refuse what a real run would refuse: an unreadable record, or one of another manifest.
    let recorded: Vec<String> = match (fresh, out.exists()) {
        (false, true) => {
            let r = RunRecord::load(out)?;
            if r.manifest_text != text {
                anyhow::bail!("{}: manifest_text: the record was made from a different manifest text; pass --fresh to overwrite or --out for a new record", out.display());
            }
            r.legs.into_iter().map(|l| l.id).collect()
        }
        _ => vec![],
    };
    if json {
        outln!(
            "{}",
            serde_json::json!({"manifest": mpath.display().to_string(), "name": m.name, "real": m.is_real(), "record": out.display().to_string(), "shard": o.shard, "legs": ids, "recorded": recorded, "notes": notes})
        );
    } else {
        outln!(
            "{} ({} legs{}) -> record {}",
            mpath.display(),
            ids.len(),
            if m.is_real() { ", real engine" } else { "" },
            out.display()
        );
        for (i, id) in ids.iter().enumerate() {
            outln!(
                "{:>3}. {id}{}",
                i + 1,
                if recorded.contains(id) {
                    " (recorded)"
                } else {
                    ""
                }
            );
        }
        for n in &notes {
            outln!("note: {n}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_run(rec: &RunRecord, out: &Path) {
    outln!(
        "{} ({} legs) -> record {}",
        rec.manifest_path,
        rec.legs.len(),
        out.display()
    );
    for (i, l) in rec.legs.iter().enumerate() {
        outln!(
            "{:>3}. {}",
            i + 1,
            findings::chain_line(l).replace("**", "").replace('`', "")
        );
        if let (Some(n), None) = (&l.note, &l.real) {
            outln!("       {n}");
        }
    }
    for n in &rec.notes {
        outln!("note: {n}");
    }
}

/// The manifest's expectations judged on the record (as the finding's comparison table).
fn print_expectations(m: &Manifest, rec: &RunRecord) {
    if !m.is_real() {
        return;
    }
    for e in &m.expectations {
        let (obs, verdict) = findings::judge(e, rec);
        outln!("expectation `{}`: {obs}: {verdict}", e.leg);
    }
}

/// `speclab merge`: the shard records into one record (checks in `speclab_experiments::shard`).
pub fn merge(a: MergeArgs) -> anyhow::Result<ExitCode> {
    let out = match (
        &a.out,
        a.records.first().and_then(|p| shard::merged_path(p)),
    ) {
        (Some(o), _) => o.clone(),
        (None, Some(p)) => p,
        (None, None) => anyhow::bail!(
            "{}: not named <name>.shard-I-of-N.json; pass --out for the merged record",
            a.records[0].display()
        ),
    };
    let rec = shard::merge_into(&a.records, &out)?;
    if a.json {
        outln!("{}", serde_json::to_string(&rec)?);
    } else {
        print_run(&rec, &out);
        outln!(
            "merged {} shard records into {} ({} legs)",
            a.records.len(),
            out.display(),
            rec.legs.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `speclab bounds`.
pub fn bounds(a: BoundsArgs) -> anyhow::Result<ExitCode> {
    let (m, _, _) = load_manifest(Some(&a.manifest))?;
    if m.is_real() {
        anyhow::bail!(
            "{}: a manifest with `real` runs the real engine and has no simulated KV layout to bisect; `speclab bounds` takes simulated manifests",
            a.manifest.display()
        );
    }
    let mut seen = std::collections::HashSet::new();
    let mut rows = Vec::new();
    for leg in m.legs()? {
        let set = leg.plan.as_ref().map(|p| p.set.clone()).unwrap_or_default();
        let key = (
            set,
            leg.num_speculative_tokens,
            leg.block_size,
            cap_name(leg.cap),
            leg.num_blocks,
        );
        if !seen.insert(key) {
            continue;
        }
        let ctx = ProbeCtx {
            layout: &leg.layout,
            num_blocks: leg.num_blocks,
            max_num_batched_tokens: u64::from(m.scheduler.max_num_batched_tokens),
            lookahead: m.drafter_for(&leg).lookahead(),
        };
        let b = bounds::find_bound(&ctx)?;
        rows.push(serde_json::json!({
            "block_size": leg.block_size,
            "cap": cap_name(leg.cap),
            "num_blocks": leg.num_blocks,
            "groups": leg.layout.groups.iter().map(|g| g.name.clone()).collect::<Vec<_>>(),
            "bound": b,
            "plan": leg.plan,
        }));
        if !a.json {
            let what = match (b.unbounded, b.largest_admissible) {
                (true, _) => format!("no bound up to max_model_len {}", m.kv.max_model_len),
                (false, Some(n)) => format!(
                    "largest admissible prompt {n} tokens ({} blocks); {} tokens need {} blocks, binding group {}",
                    b.need_at_bound.iter().sum::<u64>(),
                    n + 1,
                    b.need_above_bound.iter().sum::<u64>(),
                    b.binding_group_above.as_deref().unwrap_or("?")
                ),
                (false, None) => "not even a 1-token prompt is admissible".into(),
            };
            if let Some(p) = &leg.plan {
                outln!("{}", plan_line(p));
            }
            outln!(
                "block_size {:>5} cap {:<15} pool {:>6} blocks: {what}",
                leg.block_size
                    .map(|b| b.to_string())
                    .unwrap_or_else(|| "-".into()),
                cap_name(leg.cap),
                leg.num_blocks
            );
        }
    }
    if a.json {
        outln!("{}", serde_json::to_string(&rows)?);
    }
    Ok(ExitCode::SUCCESS)
}

/// What vLLM 0.33.0 makes of the leg's request (printed before its bound line); names the
/// change when vLLM would not use the block size or pool the user asked for, as vLLM logs it.
fn plan_line(p: &speclab_experiments::plan::LegPlan) -> String {
    let q = &p.plan;
    let mut s = format!("[{}] ", if p.set.is_empty() { "plan" } else { &p.set });
    if q.effective_block_size != q.requested_block_size {
        s.push_str(&format!(
            "vLLM changes --block-size {} to {} (\"Setting attention block size to {} tokens to ensure that attention page size is >= mamba page size\"); ",
            q.requested_block_size, q.effective_block_size, q.effective_block_size
        ));
    } else {
        s.push_str(&format!("block size {} kept; ", q.effective_block_size));
    }
    s.push_str(&format!(
        "{} bytes per block -> pool {} blocks{}; GPU KV cache size: {} tokens, maximum concurrency {:.2}x{}",
        q.bytes_per_block,
        q.num_blocks,
        if p.overridden { " (num_gpu_blocks_override)" } else { "" },
        q.kv_cache_tokens,
        q.max_concurrency,
        if q.starts { "" } else { "; vLLM REFUSES TO START (one max_model_len request does not fit)" }
    ));
    s
}

/// `speclab findings`.
pub fn findings(a: FindingsArgs) -> anyhow::Result<ExitCode> {
    let written = findings::render_files(&a.records, &a.out_dir)?;
    if a.json {
        outln!("{}", serde_json::to_string(&written)?);
    } else {
        for w in written {
            outln!("wrote {}", w.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `speclab verify-lossless <manifest.ron>`: the manifest form. For every drafter (but
/// `none`) x N x concurrency of the manifest's `real` section, greedy output with the
/// drafter must equal the output without it, token for token (`verify_lossless`); a
/// mismatch reports the first diverging index, both tokens and the target's logit margin
/// there. Exit 1 on any mismatch.
pub fn verify_manifest(path: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let (m, mpath, _) = load_manifest(Some(path))?;
    let Some(real) = &m.real else {
        anyhow::bail!("{}: no `real` section; the manifest form of verify-lossless needs a real manifest (model, drafters, prompts)", mpath.display());
    };
    let legs = real_run::lossless_legs(real);
    if legs.is_empty() {
        anyhow::bail!("{}: field real.drafters: no drafter besides `none`; nothing to compare with the spec-off control", mpath.display());
    }
    let runner = real_run::RealRunner::load(real, &mpath)?;
    let mut rows = Vec::new();
    let mut all_ok = true;
    for (i, l) in legs.iter().enumerate() {
        if !json {
            eprintln!(
                "[{}/{}] drafter={} n={} c={}{} ...",
                i + 1,
                legs.len(),
                l.drafter.name(),
                l.num_speculative_tokens,
                l.concurrency,
                l.id_suffix
            );
        }
        let (leg, _) = runner.verify_leg(l)?;
        all_ok &= leg.lossless;
        if !json {
            outln!(
                "{}: {}/{} requests equal, {} tokens compared: {} (acceptance {:.1}%, tau {:.3}; {:.1} s)",
                leg.id,
                leg.requests_equal,
                leg.num_requests,
                leg.num_tokens_compared,
                if leg.lossless { "LOSSLESS (token for token)" } else { "MISMATCH" },
                100.0 * leg.acceptance_rate,
                leg.tau,
                leg.wall_s
            );
            for mm in &leg.mismatches {
                let verdict = if mm.margin <= 1e-3 {
                    "near tie: numeric drift likely"
                } else {
                    "clear margin: logic bug likely"
                };
                outln!(
                    "  request {}: first divergence at output {}: reference {:?} vs drafter {:?}; target top1 {} ({:.6}) top2 {} ({:.6}), margin {:.3e} -> {verdict}",
                    mm.request, mm.index, mm.reference_token, mm.candidate_token, mm.top1_token, mm.top1_logit, mm.top2_token, mm.top2_logit, mm.margin
                );
            }
        }
        rows.push(leg);
    }
    let skipped: Vec<String> = real
        .skipped_drafters()
        .into_iter()
        .map(|(_, n)| n)
        .collect();
    if json {
        outln!(
            "{}",
            serde_json::json!({"manifest": mpath.display().to_string(), "lossless": all_ok, "legs": rows, "skipped": skipped})
        );
    } else {
        for n in &skipped {
            outln!("note: {n}");
        }
        let equal: usize = rows.iter().map(|r| r.requests_equal).sum();
        let total: usize = rows.iter().map(|r| r.num_requests).sum();
        outln!(
            "{}: {} legs, {equal}/{total} request checks equal: {}",
            mpath.display(),
            rows.len(),
            if all_ok { "PASS" } else { "FAIL" }
        );
    }
    Ok(if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
