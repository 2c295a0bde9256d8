//! Render run records into markdown findings.
//!
//! Every number in a finding comes from the record it names (the brief's rule:
//! every figure in `findings/` is rendered from a run record in the repo).
//! A finding has: the source record and commit, the manifest's assumptions,
//! a leg table (per-group admission need, status, steps, peaks, bound), the
//! reference comparison (computed matched / not matched), the leg chain (one
//! line per leg, in order), and the manifest's discussion paragraphs.
//!
//! Invariant: rendering is a pure function of the records (no clock, no I/O
//! besides the write), so re-rendering an unchanged record is byte-identical.

use std::fmt::Write as _;
use std::path::Path;

use crate::manifest::{Expectation, Manifest};
use crate::real::{temp_label, RealSpec};
use crate::record::{LegRecord, LegStatus, RealLegRecord, RunRecord};
use crate::{ExperimentError, Result};

pub(crate) fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn status_word(s: LegStatus) -> &'static str {
    match s {
        LegStatus::Completed => "COMPLETED",
        LegStatus::StepLimit => "STEP LIMIT",
        LegStatus::Wedged => "WEDGED",
        LegStatus::Rejected => "REJECTED",
        LegStatus::BoundOnly => "bound only",
        LegStatus::RefusedAtStartup => "REFUSED AT STARTUP",
    }
}

pub(crate) fn bound_text(l: &LegRecord) -> String {
    match &l.bound {
        None => "-".into(),
        Some(b) if b.unbounded => format!(
            "none <= max_model_len ({})",
            thousands(b.largest_admissible.unwrap_or(0))
        ),
        Some(b) => match b.largest_admissible {
            Some(n) => thousands(n),
            None => "not even 1 token".into(),
        },
    }
}

/// `x` with `d` decimals, or `-`.
fn opt(x: Option<f64>, d: usize) -> String {
    x.map(|v| format!("{v:.d$}")).unwrap_or_else(|| "-".into())
}

/// The leg-chain line of a real leg.
fn real_chain_line(l: &LegRecord, r: &RealLegRecord) -> String {
    let mut s = format!(
        "`{}`: **{}**; {} requests, {} output tokens in {} steps ({:.1} tok/s)",
        l.id,
        status_word(l.status),
        r.num_requests,
        thousands(r.output_tokens),
        thousands(r.steps),
        r.tokens_per_s
    );
    if let (Some(a), Some(t)) = (r.draft_acceptance_rate, r.tau) {
        let _ = write!(s, ", acceptance {:.1}%, tau {t:.3}", 100.0 * a);
    }
    if let Some(n) = &l.note {
        let _ = write!(s, "; {n}");
    }
    s
}

/// The leg-chain line of one leg.
pub fn chain_line(l: &LegRecord) -> String {
    if let Some(r) = &l.real {
        return real_chain_line(l, r);
    }
    let mut s = format!("`{}`: **{}**", l.id, status_word(l.status));
    if let Some(a) = l.admissions.first() {
        let margin = a.usable as i64 - a.total as i64;
        let _ = write!(
            s,
            "; admission needs {} of {} usable blocks (margin {margin}), binding group `{}`",
            thousands(a.total),
            thousands(a.usable),
            a.binding_group
        );
    }
    if l.steps > 0 {
        let _ = write!(
            s,
            "; {} steps, {} finished, {} preemptions",
            thousands(l.steps),
            l.finished,
            l.preemptions
        );
    }
    if let Some(b) = &l.bound {
        let _ = write!(s, "; largest admissible prompt {}", bound_text(l));
        if let Some(g) = &b.binding_group_above {
            let _ = write!(s, " (one token more binds on `{g}`)");
        }
    }
    if let Some(n) = &l.note {
        if l.status == LegStatus::RefusedAtStartup {
            let _ = write!(s, "; {n}");
        }
    }
    s
}

/// Whether leg `id` matches an expectation's `leg`: every space-separated token of the
/// pattern is a token of the id (`bs=1024 cap=none` matches `tp=4 bs=1024 cap=none prompt=1`).
pub fn leg_matches(id: &str, pattern: &str) -> bool {
    let toks: Vec<&str> = id.split(' ').collect();
    pattern
        .split(' ')
        .filter(|t| !t.is_empty())
        .all(|t| toks.contains(&t))
}

/// Evaluate an expectation against the record: (observed, verdict).
pub fn judge(e: &Expectation, rec: &RunRecord) -> (String, &'static str) {
    let legs: Vec<&LegRecord> = rec
        .legs
        .iter()
        .filter(|l| leg_matches(&l.id, &e.leg))
        .collect();
    if legs.is_empty() {
        return ("leg not in record".into(), "not measured");
    }
    if let Some(r) = crate::findings_plan::judge_plan(e, rec, &legs) {
        return r;
    }
    if let Some(sp) = &e.speedup {
        return crate::findings_cost::judge_speedup(sp, rec, &legs);
    }
    if let Some(about) = e.bound_about {
        let tol = e.tolerance.unwrap_or(about / 50);
        let Some(b) = legs.iter().find_map(|l| l.bound.as_ref()) else {
            return ("no bound measured".into(), "not measured");
        };
        if b.unbounded {
            return ("no bound".into(), "NOT matched");
        }
        let got = b.largest_admissible.unwrap_or(0);
        let ok = got.abs_diff(about) <= tol;
        return (thousands(got), if ok { "matched" } else { "NOT matched" });
    }
    if let Some((lo, hi)) = e.no_wedge_in {
        let Some(b) = legs.iter().find_map(|l| l.bound.as_ref()) else {
            return ("no bound measured".into(), "not measured");
        };
        let got = b.largest_admissible.unwrap_or(0);
        let ok = b.unbounded || got >= hi;
        let obs = if b.unbounded {
            "no bound".to_string()
        } else {
            format!(
                "bound {} (range {}-{})",
                thousands(got),
                thousands(lo),
                thousands(hi)
            )
        };
        return (obs, if ok { "matched" } else { "NOT matched" });
    }
    if let Some((group, max)) = &e.peak_at_most {
        let mut worst = 0u64;
        for l in &legs {
            let Some(gi) = l.group_names.iter().position(|g| g == group) else {
                return (format!("no group {group}"), "not measured");
            };
            worst = worst.max(l.peak_held_per_group.get(gi).copied().unwrap_or(0));
        }
        return (
            format!("peak {worst} blocks of {group} over {} legs", legs.len()),
            if worst <= *max {
                "matched"
            } else {
                "NOT matched"
            },
        );
    }
    if let Some(want) = e.peak_running {
        return judge_peak_running(want, &legs);
    }
    if let Some(want) = e.outputs_equal_control {
        return judge_outputs_equal_control(want, rec, &legs);
    }
    if let Some(st) = &e.status {
        let got: Vec<&str> = legs.iter().map(|l| status_word(l.status)).collect();
        let ok = got.iter().all(|g| g.eq_ignore_ascii_case(st));
        return (got.join(", "), if ok { "matched" } else { "NOT matched" });
    }
    ("nothing to compare".into(), "not measured")
}

/// `outputs_equal_control`: in every matching real leg, exactly `want` requests give the
/// spec-off leg's greedy output (same concurrency; output digests).
fn judge_outputs_equal_control(
    want: u64,
    rec: &RunRecord,
    legs: &[&LegRecord],
) -> (String, &'static str) {
    let mut got = Vec::new();
    for l in legs {
        let Some(r) = l.real.as_ref() else {
            return ("not a real leg".into(), "not measured");
        };
        let control = rec.legs.iter().filter_map(|c| c.real.as_ref()).find(|c| {
            c.drafter == "none" && c.temperature == 0.0 && c.concurrency == r.concurrency
        });
        let Some(c) = control else {
            return ("no control leg".into(), "not measured");
        };
        if r.temperature != 0.0 {
            return ("not greedy".into(), "not measured");
        }
        let equal = r
            .output_digests
            .iter()
            .zip(&c.output_digests)
            .filter(|(a, b)| a == b)
            .count() as u64;
        got.push((equal, r.output_digests.len()));
    }
    let ok = got.iter().all(|&(e, _)| e == want);
    let obs: Vec<String> = got.iter().map(|(e, n)| format!("{e}/{n} equal")).collect();
    (obs.join(", "), if ok { "matched" } else { "NOT matched" })
}

/// `peak_running`: every matching leg's most requests in one step equals `want`.
fn judge_peak_running(want: u64, legs: &[&LegRecord]) -> (String, &'static str) {
    let got: Vec<Option<u64>> = legs
        .iter()
        .map(|l| l.concurrency.as_ref().map(|c| c.peak_running))
        .collect();
    if got.iter().any(Option::is_none) {
        return ("no concurrency measured".into(), "not measured");
    }
    let got: Vec<u64> = got.into_iter().flatten().collect();
    let obs = got
        .iter()
        .map(|g| format!("{g} per step"))
        .collect::<Vec<_>>()
        .join(", ");
    let ok = got.iter().all(|g| *g == want);
    (obs, if ok { "matched" } else { "NOT matched" })
}

/// Render one record (read from `record_path`) to markdown.
pub fn render(rec: &RunRecord, record_path: &str) -> String {
    let manifest: Option<Manifest> = serde_json::from_value(rec.manifest.clone()).ok();
    let mut md = String::new();
    let name = manifest
        .as_ref()
        .map(|m| m.name.clone())
        .unwrap_or_else(|| "run".into());
    let _ = writeln!(md, "# {name}\n");
    if let Some(m) = &manifest {
        if !m.description.is_empty() {
            let _ = writeln!(md, "{}\n", m.description);
        }
    }
    render_header(&mut md, rec, record_path);
    render_setup(&mut md, rec, manifest.as_ref());
    render_sim_legs(&mut md, rec);
    let many_sets = crate::findings_plan::render(&mut md, rec, manifest.as_ref());
    if rec.legs.iter().any(|l| l.real.is_some()) {
        real_section(&mut md, rec, &name);
    }
    if let Some(m) = manifest.as_ref().filter(|_| !many_sets) {
        render_comparison(&mut md, rec, m);
    }
    crate::findings_cost::render(&mut md, rec);
    render_spec_legs(&mut md, rec);
    render_concurrency(&mut md, rec);
    render_chain(&mut md, rec, manifest.as_ref());
    md
}

/// Where the page comes from (record, manifest, commit) and whether it is complete.
fn render_header(md: &mut String, rec: &RunRecord, record_path: &str) {
    let _ = writeln!(
        md,
        "Rendered by `speclab findings` from the run record [`{record_path}`]({}) (manifest `{}`, commit `{}`, speclab {}). {} of the manifest's legs are recorded{}.\n",
        if Path::new(record_path).is_absolute() { record_path.to_string() } else { format!("../{record_path}") },
        rec.manifest_path,
        rec.git_commit.as_deref().unwrap_or("unknown"),
        rec.speclab_version,
        rec.legs.len(),
        if rec.complete { " (complete)" } else { " (INCOMPLETE: resume with `speclab run`)" }
    );
}

/// The setup section (real legs, or the simulated layout, scheduler and drafter).
fn render_setup(md: &mut String, rec: &RunRecord, manifest: Option<&Manifest>) {
    if let Some(real) = manifest.and_then(|m| m.real.as_ref()) {
        real_setup(md, real, rec);
        if let Some(m) = manifest {
            if !m.assumptions.is_empty() {
                let _ = writeln!(md, "### Assumptions\n");
                for a in &m.assumptions {
                    let _ = writeln!(md, "- {a}");
                }
                let _ = writeln!(md);
            }
        }
    } else if let Some(m) = manifest {
        let _ = writeln!(md, "## Setup\n");
        let _ = writeln!(
            md,
            "- KV: {}, max_model_len {}, pool {}, sliding-window cap `{}`",
            m.kv.preset.as_deref().unwrap_or("explicit layout"),
            thousands(u64::from(m.kv.max_model_len)),
            m.kv.num_blocks
                .map(|n| format!("{} blocks (override)", thousands(u64::from(n))))
                .or(m
                    .kv
                    .kv_cache_memory_bytes
                    .map(|b| format!("{} bytes of KV memory", thousands(b))))
                .unwrap_or_else(|| "per leg".into()),
            crate::manifest::cap_name(m.kv.cap)
        );
        let _ = writeln!(
            md,
            "- scheduler: `{:?}`, max_num_seqs {}, max_num_batched_tokens {}",
            m.scheduler.policy,
            m.scheduler.max_num_seqs,
            thousands(u64::from(m.scheduler.max_num_batched_tokens))
        );
        let _ = writeln!(
            md,
            "- drafter: `{:?}`, num_speculative_tokens {}, lookahead {} slots per step",
            m.drafter.kind,
            m.drafter.num_speculative_tokens,
            m.drafter.lookahead()
        );
        if !m.assumptions.is_empty() {
            let _ = writeln!(md, "\n### Assumptions\n");
            for a in &m.assumptions {
                let _ = writeln!(md, "- {a}");
            }
        }
        let _ = writeln!(md);
    }
}

/// The simulated legs' table.
fn render_sim_legs(md: &mut String, rec: &RunRecord) {
    let sim_legs: Vec<&LegRecord> = rec.legs.iter().filter(|l| l.real.is_none()).collect();
    if !sim_legs.is_empty() {
        let _ = writeln!(md, "## Legs\n");
        let names = sim_legs
            .first()
            .map(|l| l.group_names.clone())
            .unwrap_or_default();
        let _ = writeln!(md, "| leg | pool (usable) | admission need (total) | per-group need ({}) | status | steps | peak held per request, per group | largest admissible prompt |", names.join(" / "));
        let _ = writeln!(md, "|---|---|---|---|---|---|---|---|");
        for l in sim_legs {
            let (need, per) = match l.admissions.first() {
                Some(a) => (
                    thousands(a.total),
                    a.need_per_group
                        .iter()
                        .map(|n| n.to_string())
                        .collect::<Vec<_>>()
                        .join(" / "),
                ),
                None => ("-".into(), "-".into()),
            };
            let peaks = if l.steps > 0 {
                l.peak_held_per_group
                    .iter()
                    .map(|n| n.to_string())
                    .collect::<Vec<_>>()
                    .join(" / ")
            } else {
                "-".into()
            };
            let _ = writeln!(
                md,
                "| `{}` | {} | {} | {} | {} | {} | {} | {} |",
                l.id,
                thousands(l.usable_blocks),
                need,
                per,
                status_word(l.status),
                thousands(l.steps),
                peaks,
                bound_text(l)
            );
        }
        let _ = writeln!(md);
    }
}

/// The reference comparison of the manifest's expectations.
fn render_comparison(md: &mut String, rec: &RunRecord, m: &Manifest) {
    if m.expectations.is_empty() {
        return;
    }
    let _ = writeln!(md, "## Comparison with the reference\n");
    let _ = writeln!(md, "| leg | reference | source | speclab | verdict |");
    let _ = writeln!(md, "|---|---|---|---|---|");
    for e in &m.expectations {
        let reference = if let Some(r) = crate::findings_plan::reference_text(e) {
            r
        } else if let Some(sp) = &e.speedup {
            crate::findings_cost::speedup_reference(sp)
        } else if let Some((g, m)) = &e.peak_at_most {
            format!("`{g}` holds at most {m} blocks")
        } else if let Some(b) = e.bound_about {
            format!("bound ~{}", thousands(b))
        } else if let Some((lo, hi)) = e.no_wedge_in {
            format!("no wedge across {}-{}", thousands(lo), thousands(hi))
        } else if let Some(n) = e.peak_running {
            format!("{n} running per step at most")
        } else if let Some(n) = e.outputs_equal_control {
            format!("{n} requests with the spec-off greedy output")
        } else {
            e.status.clone().unwrap_or_default()
        };
        let (obs, verdict) = judge(e, rec);
        let _ = writeln!(
            md,
            "| `{}` | {} | {} | {} | **{}** |",
            e.leg, reference, e.source, obs, verdict
        );
    }
    let _ = writeln!(md);
}

/// The simulated spec-decode table.
fn render_spec_legs(md: &mut String, rec: &RunRecord) {
    let spec_legs: Vec<&LegRecord> = rec
        .legs
        .iter()
        .filter(|l| l.real.is_none() && l.spec.num_drafts > 0)
        .collect();
    if !spec_legs.is_empty() {
        let _ = writeln!(md, "## Speculative decoding (simulated acceptance)\n");
        let _ = writeln!(
            md,
            "| leg | drafts | draft tokens | accepted | acceptance rate | tau |"
        );
        let _ = writeln!(md, "|---|---|---|---|---|---|");
        for l in spec_legs {
            let _ = writeln!(
                md,
                "| `{}` | {} | {} | {} | {:.3} | {:.3} |",
                l.id,
                thousands(l.spec.num_drafts),
                thousands(l.spec.num_draft_tokens),
                thousands(l.spec.num_accepted_tokens),
                l.spec.draft_acceptance_rate.unwrap_or(0.0),
                l.spec.mean_acceptance_length.unwrap_or(0.0)
            );
        }
        let _ = writeln!(md);
    }
}

/// Requests scheduled per step and output tokens per step (`measure.concurrency`).
fn render_concurrency(md: &mut String, rec: &RunRecord) {
    let legs: Vec<(&LegRecord, &crate::record::ConcurrencyRecord)> = rec
        .legs
        .iter()
        .filter_map(|l| l.concurrency.as_ref().map(|c| (l, c)))
        .collect();
    if legs.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "## Concurrency (requests scheduled per step)
"
    );
    let _ = writeln!(md, "Per leg: the most requests one step scheduled (vLLM's \"Running\"), how many steps did, the mean over all steps, and output tokens per step (the throughput proxy without a cost model).\n");
    let _ = writeln!(
        md,
        "| leg | requests | peak running | steps at peak | mean running | steps | output tokens | tokens per step |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|");
    for (l, c) in legs {
        let _ = writeln!(
            md,
            "| `{}` | {} | {} | {} | {:.2} | {} | {} | {:.3} |",
            l.id,
            l.prompts.len(),
            c.peak_running,
            thousands(c.steps_at_peak),
            c.mean_running.unwrap_or(0.0),
            thousands(l.steps),
            thousands(c.output_tokens),
            c.tokens_per_step.unwrap_or(0.0)
        );
    }
    let _ = writeln!(md);
}

/// The leg chain and the discussion.
fn render_chain(md: &mut String, rec: &RunRecord, manifest: Option<&Manifest>) {
    let _ = writeln!(md, "## Leg chain\n");
    for (i, l) in rec.legs.iter().enumerate() {
        let _ = writeln!(md, "{}. {}", i + 1, chain_line(l));
        if matches!(l.status, LegStatus::Wedged | LegStatus::Rejected) {
            if let Some(n) = &l.note {
                let _ = writeln!(md, "   - {n}");
            }
        }
    }
    let _ = writeln!(md);
    if let Some(m) = manifest {
        if !m.discussion.is_empty() {
            let _ = writeln!(md, "## Discussion\n");
            for p in &m.discussion {
                let _ = writeln!(md, "{p}\n");
            }
        }
    }
}

/// The plot file name of a record named `name` (next to its markdown).
pub fn plot_file_name(name: &str) -> String {
    format!("{name}-tau.svg")
}

/// Render records into `out_dir/<manifest name>.md` (and `<name>-tau.svg` for a real
/// sweep over N); returns the written paths.
pub fn render_files(
    records: &[std::path::PathBuf],
    out_dir: &Path,
) -> Result<Vec<std::path::PathBuf>> {
    let mut written = Vec::new();
    let mut hazards = Vec::new();
    for p in records {
        let rec = RunRecord::load(p)?;
        if let Some(h) = crate::atlas::entry(&rec, p) {
            hazards.push(h);
        }
        let name = rec
            .manifest
            .get("name")
            .and_then(|v| v.as_str())
            .unwrap_or("run")
            .to_string();
        let md = render(&rec, &p.display().to_string());
        let out = out_dir.join(format!("{name}.md"));
        crate::record::write_atomic(&out, md.as_bytes())?;
        written.push(out);
        if let Some(svg) =
            crate::plot::tau_svg(&rec, &format!("{name}: tau and acceptance rate vs N"))
        {
            let sp = out_dir.join(plot_file_name(&name));
            crate::record::write_atomic(&sp, svg.as_bytes())?;
            written.push(sp);
        }
    }
    if !hazards.is_empty() {
        // Rows in name order, whatever order the records were given in.
        hazards.sort_by(|a: &crate::atlas::Entry, b| a.name.cmp(&b.name));
        let out = out_dir.join("atlas.md");
        crate::record::write_atomic(&out, crate::atlas::render(&hazards).as_bytes())?;
        written.push(out);
    }
    if written.is_empty() {
        return Err(ExperimentError::Invalid {
            path: out_dir.to_path_buf(),
            field: "records".into(),
            msg: "no record given".into(),
        });
    }
    Ok(written)
}

/// The setup of a real manifest, from the manifest stored in the record.
fn real_setup(md: &mut String, real: &RealSpec, rec: &RunRecord) {
    let _ = writeln!(md, "## Setup (real engine)\n");
    let _ = writeln!(md, "- target: `{}`", real.model);
    let p = &real.prompts;
    let prompts = match (&p.file, &p.generated) {
        (Some(f), _) => {
            let rows = match p.count {
                Some(c) => format!("{c} rows from row {}", p.offset),
                None => format!("every row from row {}", p.offset),
            };
            let trunc = p
                .truncate
                .map(|t| format!(", truncated to {t} tokens"))
                .unwrap_or_default();
            format!("{rows} of `{}` in `{f}`{trunc}", p.tensor)
        }
        (None, Some(g)) => match g.min_len {
            Some(_) => format!(
                "{} random prompts of {} tokens (seed {})",
                g.count,
                (0..g.count)
                    .map(|i| g.len_of(i).to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                g.seed
            ),
            None => format!(
                "{} random prompts of {} tokens (seed {})",
                g.count, g.len, g.seed
            ),
        },
        (None, None) => "-".into(),
    };
    let _ = writeln!(md, "- prompts: {prompts}");
    if let Some(r) = rec.legs.iter().find_map(|l| l.real.as_ref()) {
        let _ = writeln!(
            md,
            "- per leg: {} requests, {} prompt tokens in all, max_tokens {} each{}",
            r.num_requests,
            thousands(r.prompt_tokens),
            r.max_tokens,
            if real.ignore_eos { " (ignore_eos)" } else { "" }
        );
    }
    let ns: Vec<String> = real
        .drafters
        .iter()
        .map(|&d| {
            let n = real
                .ns_for(d)
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(", ");
            format!("`{}` (N {n})", d.name())
        })
        .collect();
    let _ = writeln!(md, "- drafters: {}", ns.join(", "));
    let _ = writeln!(
        md,
        "- concurrency (max_num_seqs): {}; temperatures: {}; seed {}",
        real.concurrency
            .iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        real.temperatures
            .iter()
            .map(|&t| temp_label(t))
            .collect::<Vec<_>>()
            .join(", "),
        real.seed
    );
    let pool = match (real.num_blocks, real.kv_cache_memory_bytes) {
        (Some(n), _) => format!("{n} blocks"),
        (None, Some(b)) => format!(
            "planned per leg from kv_cache_memory_bytes {} B (below)",
            thousands(b)
        ),
        (None, None) => "sized per leg so every request fits at once".into(),
    };
    let caps = if real.caps.is_empty() {
        format!("cap `{}`", crate::manifest::cap_name(real.cap))
    } else {
        let c: Vec<String> = real
            .caps
            .iter()
            .map(|&c| format!("`{}`", crate::manifest::cap_name(c)))
            .collect();
        format!("caps {}", c.join(", "))
    };
    let _ = writeln!(
        md,
        "- engine: vLLM-faithful FCFS scheduler, max_num_batched_tokens {}, KV block size {}, pool {pool}; DFlash window group block {} {caps}",
        real.max_num_batched_tokens,
        real.block_size,
        real.drafter_block_size,
    );
    kv_plan_lines(md, rec);
    for n in &rec.notes {
        let _ = writeln!(md, "- note: {n}");
    }
    let _ = writeln!(md);
}

/// The pools planned from `kv_cache_memory_bytes`, one line per distinct plan (legs sharing it named).
fn kv_plan_lines(md: &mut String, rec: &RunRecord) {
    let mut plans: Vec<(&speclab_engine::exec::RunPoolPlan, Vec<&str>)> = Vec::new();
    for l in &rec.legs {
        if let Some(p) = l.real.as_ref().and_then(|r| r.kv_plan.as_ref()) {
            match plans.iter_mut().find(|(q, _)| *q == p) {
                Some((_, ids)) => ids.push(&l.id),
                None => plans.push((p, vec![&l.id])),
            }
        }
    }
    for (p, ids) in plans {
        let groups: Vec<String> = p
            .plan
            .groups
            .iter()
            .map(|g| {
                format!(
                    "{} {} x {} B = {} B",
                    g.name,
                    g.num_layers,
                    thousands(g.page_size_bytes),
                    thousands(g.bytes_per_block)
                )
            })
            .collect();
        let ids: Vec<String> = ids.iter().map(|i| format!("`{i}`")).collect();
        let _ = writeln!(
            md,
            "- planned pool ({}): pages per block {}; bytes_per_block {} B (the largest group's); num_blocks = {} // {} = {} (stores allocate {} B a block: target {} + drafter {})",
            ids.join(", "),
            groups.join(", "),
            thousands(p.plan.bytes_per_block),
            thousands(p.plan.kv_cache_memory_bytes),
            thousands(p.plan.bytes_per_block),
            p.plan.num_blocks,
            thousands(p.target_store_bytes_per_block + p.drafter_store_bytes_per_block),
            thousands(p.target_store_bytes_per_block),
            thousands(p.drafter_store_bytes_per_block)
        );
    }
}

/// "k/n" requests whose greedy output equals the spec-off leg's (same concurrency), from digests.
fn greedy_vs_control(r: &RealLegRecord, rec: &RunRecord) -> String {
    if r.temperature != 0.0 {
        return "-".into();
    }
    if r.drafter == "none" {
        return "control".into();
    }
    let control =
        rec.legs.iter().filter_map(|l| l.real.as_ref()).find(|c| {
            c.drafter == "none" && c.temperature == 0.0 && c.concurrency == r.concurrency
        });
    match control {
        None => "no control leg".into(),
        Some(c) => {
            let n = r.output_digests.len().min(c.output_digests.len());
            let equal = r
                .output_digests
                .iter()
                .zip(&c.output_digests)
                .filter(|(a, b)| a == b)
                .count();
            let first = r
                .output_digests
                .iter()
                .zip(&c.output_digests)
                .position(|(a, b)| a != b);
            match first {
                None if r.output_digests.len() == c.output_digests.len() => format!("{equal}/{n}"),
                None => format!("{equal}/{n} (request counts differ)"),
                Some(i) => format!("**{equal}/{n}** (request {i} differs)"),
            }
        }
    }
}

/// The real-engine table (and the plot link), every number from the record.
fn real_section(md: &mut String, rec: &RunRecord, name: &str) {
    let _ = writeln!(md, "## Speculative decoding (real engine)\n");
    let _ = writeln!(
        md,
        "vLLM's definitions: acceptance rate = accepted / drafted tokens; tau = 1 + accepted / drafts (mean acceptance length); per-position rate k = drafts whose position k was accepted / drafts. Verify width = tokens the target verified in one decode step over the batch. Experts = distinct (MoE layer, expert) pairs the verify rows of a step routed to. Greedy = spec-off: requests whose output equals the `none` leg's at the same concurrency (FNV-1a digests of the token ids).\n"
    );
    let _ = writeln!(md, "| leg | drafter | N | c | T | status | acceptance rate | tau | per-position rates | tokens/s | verify width (mean / max) | experts per verify step (mean / max of slots) | TTFT mean (steps / s) | greedy = spec-off |");
    let _ = writeln!(
        md,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for l in &rec.legs {
        let Some(r) = &l.real else { continue };
        let per = if r.acceptance_per_position.is_empty() {
            "-".into()
        } else {
            r.acceptance_per_position
                .iter()
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let width = match r.mean_verify_width {
            Some(w) => format!("{w:.2} / {}", r.max_verify_width),
            None => "-".into(),
        };
        let experts = match (r.mean_verify_experts, r.max_verify_experts) {
            (Some(m), Some(x)) => format!("{m:.1} / {x} of {}", r.expert_slots),
            _ => "-".into(),
        };
        let _ = writeln!(
            md,
            "| `{}` | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {} / {} | {} |",
            l.id,
            r.drafter,
            r.num_speculative_tokens,
            r.concurrency,
            temp_label(r.temperature),
            status_word(l.status),
            r.draft_acceptance_rate
                .map(|a| format!("{:.1}%", 100.0 * a))
                .unwrap_or_else(|| "-".into()),
            opt(r.tau, 3),
            per,
            r.tokens_per_s,
            width,
            experts,
            opt(r.mean_ttft_steps, 1),
            opt(r.mean_ttft_s, 3),
            greedy_vs_control(r, rec)
        );
    }
    let _ = writeln!(md);
    if crate::plot::has_n_sweep(rec) {
        let f = plot_file_name(name);
        let _ = writeln!(md, "![tau and acceptance rate vs N, per drafter]({f})\n");
        let _ = writeln!(md, "Plot: [`{f}`]({f}), rendered from the same record.\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(15536), "15,536");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000_000), "1,000,000");
    }
}
