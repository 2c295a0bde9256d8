//! The runner: executes a manifest's legs and records them.
//!
//! Per leg: build the KV manager from the leg's layout and pool, apply vLLM's
//! startup check (a pool that cannot hold one max_model_len request is refused,
//! `kv_cache_planning.check_enough_kv_cache_memory`), optionally bisect the
//! admission bound, then simulate the workload with the scheduler policy and
//! the simulated executor until every request completes, the run WEDGES, or
//! the step backstop is hit.
//!
//! Records: the record is locked (`fd-lock`) for the whole run, so a second run over
//! it fails fast. Progress is saved atomically after each leg to the hidden
//! `.<record>.partial` sidecar, which a later run resumes (finished legs are never
//! recomputed nor rewritten); the record itself is replaced only at the end. Over a
//! complete record of the same manifest text every leg is recomputed and compared
//! with it, timings aside ([`Verdict`]): same results leave the record untouched
//! (bit for bit); different ones replace it and are listed. The wall times of every
//! run go to `<stem>.timings.json` next to the record (gitignored).
//!
//! A manifest with a `real` section runs its legs through the real engine instead
//! ([`crate::real_run`]): the target, prompts and drafter checkpoints are loaded once,
//! only when some leg is left to run; the record bookkeeping is the same.
//!
//! A sharded run ([`RunCtx::shard`], [`crate::shard`]) runs only the legs its shard
//! owns into its own record, which says so (`shard`); the same bookkeeping applies to
//! it, and a record of another shard (or an unsharded one) at its path is refused.
//!
//! Invariant: the record on disk is always whole; a killed run never shrinks it.

use std::path::Path;
use std::time::Instant;

use speclab_engine::kv::{planning, KvCacheManager};
use speclab_engine::sim::{run_sim_stats, AcceptanceModel, SimExecutor, SimLimits, SimRun};
use speclab_schedulers::{AdmissionPolicy, FcfsScheduler, RequestSpec, SchedulerConfig};

use crate::bounds::{self, ProbeCtx};
use crate::manifest::{cap_name, Leg, Manifest, PolicyName};
use crate::manifest_cost::acceptance_rates;
use crate::real_run::RealRunner;
use crate::record::{
    self, AdmissionRecord, LegRecord, LegStatus, RunRecord, SimTimeRecord, SpecRecord,
};
use crate::{ExperimentError, Result};

/// Progress events for a UI.
pub trait Progress {
    /// A leg starts (index, total, id); `skipped` when resumed from the record.
    fn leg_start(&mut self, index: usize, total: usize, id: &str, skipped: bool);
    /// A simulated step finished.
    fn step(&mut self, step: u64);
    /// A leg finished.
    fn leg_done(&mut self, leg: &LegRecord);
}

/// No-op progress.
pub struct Quiet;
impl Progress for Quiet {
    fn leg_start(&mut self, _: usize, _: usize, _: &str, _: bool) {}
    fn step(&mut self, _: u64) {}
    fn leg_done(&mut self, _: &LegRecord) {}
}

/// What the runner needs besides the manifest.
pub struct RunCtx<'a> {
    pub manifest: &'a Manifest,
    pub manifest_path: &'a Path,
    pub manifest_text: &'a str,
    pub record_path: &'a Path,
    /// Skip legs already recorded for the same manifest text.
    pub resume: bool,
    /// Run only the legs of this shard (None: every leg).
    pub shard: Option<crate::shard::Shard>,
}

/// Run (or resume) every leg of a manifest, saving the record after each leg.
pub fn run_manifest(ctx: &RunCtx<'_>, progress: &mut dyn Progress) -> Result<RunOutcome> {
    let m = ctx.manifest;
    if let Some(real) = &m.real {
        let legs = real.legs();
        let ids: Vec<String> = legs.iter().map(|l| l.id.clone()).collect();
        let notes: Vec<String> = real
            .skipped_drafters()
            .into_iter()
            .map(|(_, n)| n)
            .collect();
        // The model is loaded only if some leg is left to run.
        let mut runner: Option<RealRunner<'_>> = None;
        return run_legs(ctx, &ids, notes, vec![], progress, &mut |i, _progress| {
            if runner.is_none() {
                runner = Some(RealRunner::load(real, ctx.manifest_path)?);
            }
            match &runner {
                Some(r) => r.run_leg(&legs[i]),
                None => unreachable!("loaded above"),
            }
        });
    }
    let legs = m.legs()?;
    let ids: Vec<String> = legs.iter().map(|l| l.id.clone()).collect();
    let plans: Vec<_> = legs.iter().filter_map(|l| l.plan.clone()).collect();
    run_legs(ctx, &ids, vec![], plans, progress, &mut |i, progress| {
        run_leg(m, &legs[i], progress)
    })
}

/// How a run related to the record that was already at its path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No record was there (or `--fresh`): every leg was computed and written.
    New,
    /// An unfinished record (or an interrupted run's `.partial`) was resumed: finished
    /// legs were kept byte for byte, the others computed.
    Resumed { kept: usize, computed: usize },
    /// A complete record was there: every leg was recomputed and gave the same results
    /// (timings aside). The record was left untouched.
    Reproduced { legs: usize },
    /// A complete record was there and some legs' results differ: the record was
    /// replaced. Each entry: leg id and its first differing field (`old -> new`).
    Differs {
        legs: usize,
        differing: Vec<(String, String)>,
    },
}

/// A finished run: the record as it now stands on disk, what happened, and where the
/// timings of this run were written.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    pub record: RunRecord,
    pub verdict: Verdict,
    pub timings_path: std::path::PathBuf,
}

/// The record bookkeeping shared by simulated and real manifests (module doc): lock the
/// record, pick up an interrupted run or an unfinished record, run each leg not yet
/// recorded (progress saved atomically to the `.partial` sidecar after each), then
/// either confirm the committed record or replace it.
fn run_legs(
    ctx: &RunCtx<'_>,
    ids: &[String],
    notes: Vec<String>,
    plans: Vec<crate::plan::LegPlan>,
    progress: &mut dyn Progress,
    run_one: &mut dyn FnMut(usize, &mut dyn Progress) -> Result<LegRecord>,
) -> Result<RunOutcome> {
    let mut lock = record::RecordLock::open(ctx.record_path)?;
    let _guard = lock.try_lock()?;
    let partial = record::partial_path(ctx.record_path);
    let (mut rec, committed) = start_record(ctx, &partial)?;
    let kept = rec.legs.len();
    rec.notes = notes;
    rec.plans = plans;
    let owned: Vec<(usize, &String)> = ids
        .iter()
        .enumerate()
        .filter(|(i, _)| ctx.shard.is_none_or(|s| s.owns(*i)))
        .collect();
    let total = owned.len();
    for (k, &(i, id)) in owned.iter().enumerate() {
        if rec.leg(id).is_some() {
            progress.leg_start(k, total, id, true);
            continue;
        }
        progress.leg_start(k, total, id, false);
        let lr = run_one(i, progress)?;
        progress.leg_done(&lr);
        rec.legs.push(lr);
        rec.updated_unix_s = record::now_unix();
        rec.save(&partial)?;
    }
    // Keep manifest order even after a resume.
    rec.legs
        .sort_by_key(|l| ids.iter().position(|x| *x == l.id).unwrap_or(usize::MAX));
    rec.complete = owned.iter().all(|(_, id)| rec.leg(id).is_some());
    let timings_path = record::timings_path(ctx.record_path);
    record::TimingsRecord::of(ctx.record_path, &rec.legs).save(&timings_path)?;
    let verdict = match committed {
        Some(old) => compare(&old, &rec),
        None if kept > 0 => Verdict::Resumed {
            kept,
            computed: rec.legs.len() - kept,
        },
        None => Verdict::New,
    };
    let record = if matches!(verdict, Verdict::Reproduced { .. }) {
        std::fs::remove_file(&partial).ok();
        RunRecord::load(ctx.record_path)?
    } else {
        rec.updated_unix_s = record::now_unix();
        rec.save(ctx.record_path)?;
        std::fs::remove_file(&partial).ok();
        rec
    };
    Ok(RunOutcome {
        record,
        verdict,
        timings_path,
    })
}

/// The record a run starts from, and the complete record it must reproduce (if any).
///
/// - `--fresh`: an empty record (a stale `.partial` is discarded);
/// - a `.partial` of the same manifest text: resumed (an interrupted run);
/// - a complete record of the same manifest text: an empty record, compared at the end;
/// - an unfinished record of the same manifest text: resumed;
/// - a record of another manifest text: refused (`--fresh` or `--out`).
fn start_record(ctx: &RunCtx<'_>, partial: &Path) -> Result<(RunRecord, Option<RunRecord>)> {
    if !ctx.resume {
        // --fresh: whatever is at the path (even an unreadable record) is replaced at the end.
        std::fs::remove_file(partial).ok();
        return Ok((new_record(ctx), None));
    }
    let existing = if ctx.record_path.exists() {
        let r = RunRecord::load(ctx.record_path)?;
        if r.manifest_text != ctx.manifest_text {
            return Err(ExperimentError::Invalid {
                path: ctx.record_path.to_path_buf(),
                field: "manifest_text".into(),
                msg: "the record was made from a different manifest text; pass --fresh to overwrite or --out for a new record".into(),
            });
        }
        if r.shard != ctx.shard {
            return Err(ExperimentError::Invalid {
                path: ctx.record_path.to_path_buf(),
                field: "shard".into(),
                msg: format!(
                    "the record is {} but this run is {}; pass --fresh to overwrite or --out for a new record",
                    shard_name(r.shard),
                    shard_name(ctx.shard)
                ),
            });
        }
        Some(r)
    } else {
        None
    };
    let committed = existing.clone().filter(|r| r.complete);
    if partial.exists() {
        match RunRecord::load(partial) {
            Ok(p) if p.manifest_text == ctx.manifest_text && p.shard == ctx.shard => {
                return Ok((p, committed))
            }
            // A stale or unreadable sidecar of an interrupted run: start over.
            _ => {
                std::fs::remove_file(partial).ok();
            }
        }
    }
    match existing {
        Some(r) if !r.complete => Ok((r, None)),
        _ => Ok((new_record(ctx), committed)),
    }
}

fn shard_name(s: Option<crate::shard::Shard>) -> String {
    s.map_or_else(|| "unsharded".into(), |s| format!("shard {s}"))
}

fn new_record(ctx: &RunCtx<'_>) -> RunRecord {
    RunRecord {
        speclab_version: env!("CARGO_PKG_VERSION").to_string(),
        git_commit: record::git_commit(),
        manifest_path: ctx.manifest_path.display().to_string(),
        manifest_text: ctx.manifest_text.to_string(),
        manifest: serde_json::to_value(ctx.manifest).unwrap_or(serde_json::Value::Null),
        started_unix_s: record::now_unix(),
        updated_unix_s: record::now_unix(),
        legs: vec![],
        complete: false,
        notes: vec![],
        plans: vec![],
        shard: ctx.shard,
    }
}

/// Compare a recomputed record with the committed one, leg by leg (timings aside).
fn compare(old: &RunRecord, new: &RunRecord) -> Verdict {
    let mut differing = Vec::new();
    for l in &new.legs {
        let d = match old.leg(&l.id) {
            Some(o) => record::result_difference(o, l),
            None => Some("not in the committed record".into()),
        };
        if let Some(d) = d {
            differing.push((l.id.clone(), d));
        }
    }
    for o in &old.legs {
        if new.leg(&o.id).is_none() {
            differing.push((o.id.clone(), "no longer a leg of the manifest".into()));
        }
    }
    if differing.is_empty() && old.notes == new.notes {
        Verdict::Reproduced {
            legs: new.legs.len(),
        }
    } else {
        Verdict::Differs {
            legs: new.legs.len(),
            differing,
        }
    }
}

fn policy(p: PolicyName) -> AdmissionPolicy {
    match p {
        PolicyName::Fcfs => AdmissionPolicy::Fcfs,
        PolicyName::RejectImpossible => AdmissionPolicy::RejectImpossible,
    }
}

/// Run one leg.
pub fn run_leg(m: &Manifest, leg: &Leg, progress: &mut dyn Progress) -> Result<LegRecord> {
    let t0 = Instant::now();
    let ctxs = format!("leg {}", leg.id);
    let group_names: Vec<String> = leg.layout.groups.iter().map(|g| g.name.clone()).collect();
    let mut lr = LegRecord {
        id: leg.id.clone(),
        block_size: leg.block_size,
        cap: cap_name(leg.cap).to_string(),
        num_blocks: leg.num_blocks,
        usable_blocks: u64::from(leg.num_blocks).saturating_sub(1),
        group_names: group_names.clone(),
        prompts: leg.prompts.clone(),
        status: LegStatus::BoundOnly,
        admissions: vec![],
        steps: 0,
        preemptions: 0,
        finished: 0,
        peak_held_per_group: vec![0; group_names.len()],
        peak_total_held: 0,
        spec: SpecRecord::default(),
        bound: None,
        note: None,
        wall_ms: 0.0,
        real: None,
        sim_time: None,
        concurrency: None,
    };
    let drafter = m.drafter_for(leg);
    let lookahead = drafter.lookahead();
    let mnbt = u64::from(m.scheduler.max_num_batched_tokens);
    let pc = ProbeCtx {
        layout: &leg.layout,
        num_blocks: leg.num_blocks,
        max_num_batched_tokens: mnbt,
        lookahead,
    };
    if let Err(e) = planning::check_startup(&leg.layout, leg.num_blocks) {
        lr.status = LegStatus::RefusedAtStartup;
        lr.note = Some(e.to_string());
        if m.measure.bound && m.measure.bound_if_refused {
            lr.bound = Some(bounds::find_bound(&pc)?);
        }
        lr.wall_ms = t0.elapsed().as_secs_f64() * 1e3;
        return Ok(lr);
    }
    let max_num_seqs = leg.max_num_seqs.unwrap_or(m.scheduler.max_num_seqs);
    if let Some(why) = cudagraph_refusal(m, leg, max_num_seqs) {
        lr.status = LegStatus::RefusedAtStartup;
        lr.note = Some(why);
        if m.measure.bound && m.measure.bound_if_refused {
            lr.bound = Some(bounds::find_bound(&pc)?);
        }
        lr.wall_ms = t0.elapsed().as_secs_f64() * 1e3;
        return Ok(lr);
    }
    if m.measure.bound {
        lr.bound = Some(bounds::find_bound(&pc)?);
    }
    if m.measure.simulate && !leg.prompts.is_empty() {
        let mut kv = KvCacheManager::new(&leg.layout, leg.num_blocks)
            .map_err(|e| ExperimentError::engine(ctxs.clone(), e))?;
        let cfg = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens: mnbt,
            num_speculative_tokens: drafter.drafts_per_step(),
            lookahead,
            policy: policy(m.scheduler.policy),
            max_steps_without_progress: 1000,
        };
        let mut sched = FcfsScheduler::new(cfg);
        for (i, &p) in leg.prompts.iter().enumerate() {
            sched
                .add_request(
                    &kv,
                    RequestSpec {
                        id: i as u64,
                        prompt_len: p,
                        max_tokens: m.workload.output_len,
                    },
                )
                .map_err(|e| ExperimentError::Invalid {
                    path: "manifest".into(),
                    field: format!("{ctxs}: request {i}"),
                    msg: e.to_string(),
                })?;
        }
        // A swept N uses the first N acceptance rates (positions beyond N are never drafted).
        let n = drafter.drafts_per_step() as usize;
        let acc = AcceptanceModel {
            per_position: acceptance_rates(m, Path::new(&format!("manifest {}", m.name)))?
                .into_iter()
                .take(n)
                .collect(),
        };
        let mut exec = SimExecutor::new(m.seed, acc);
        if let Some(c) = &m.cost {
            exec = exec
                .with_cost(c.clone(), drafter.drafts_per_step())
                .map_err(|e| ExperimentError::engine(format!("{ctxs}: cost"), e))?;
        }
        let mut conc = record::ConcurrencyCounter::default();
        let run = run_sim_stats(
            &mut kv,
            &mut sched,
            &mut exec,
            SimLimits {
                max_steps: m.max_steps,
            },
            &mut |s| {
                conc.observe(s);
                progress.step(s.step + 1)
            },
        )
        .map_err(|e| ExperimentError::engine(ctxs.clone(), e))?;
        fill_from_sim(&mut lr, leg, &run, &group_names);
        lr.sim_time = exec
            .sim_time()
            .map(|t| SimTimeRecord::of(t, drafter.num_speculative_tokens, run.output_tokens));
        if m.measure.concurrency {
            lr.concurrency = Some(conc.record());
        }
    }
    lr.wall_ms = t0.elapsed().as_secs_f64() * 1e3;
    Ok(lr)
}

/// vLLM's FULL-cudagraph check for models with state (vllm/config/compilation.py,
/// `CompilationConfig` cudagraph resolution after the KV cache config is known): each
/// decode sequence needs one Mamba cache block, so max_num_seqs > num_blocks is refused.
fn cudagraph_refusal(m: &Manifest, leg: &Leg, max_num_seqs: usize) -> Option<String> {
    use speclab_engine::kv::GroupKind;
    let has_state = leg.layout.groups.iter().any(|g| g.kind == GroupKind::State);
    let blocks = leg.num_blocks as usize;
    (m.scheduler.full_cudagraphs && has_state && max_num_seqs > blocks).then(|| {
        format!(
            "max_num_seqs ({max_num_seqs}) exceeds available Mamba cache blocks ({blocks}). Each decode sequence requires one Mamba cache block, so CUDA graph capture cannot proceed. Please lower max_num_seqs to at most {blocks} or increase gpu_memory_utilization. (vLLM 0.33.0 CompilationConfig)"
        )
    })
}

fn fill_from_sim(lr: &mut LegRecord, leg: &Leg, run: &SimRun, names: &[String]) {
    let usable = lr.usable_blocks;
    for (step, a) in &run.admitted {
        let total = a.need_per_group.iter().sum();
        lr.admissions.push(AdmissionRecord {
            request: a.id,
            prompt_len: leg.prompts.get(a.id as usize).copied().unwrap_or(0),
            need_per_group: a.need_per_group.clone(),
            total,
            usable,
            binding_group: bounds::binding(names, &a.need_per_group).unwrap_or_default(),
            admitted_at_step: Some(*step),
        });
    }
    let mut notes = Vec::new();
    for r in run.rejected.iter().chain(run.wedged.iter()) {
        lr.admissions.push(AdmissionRecord {
            request: r.id,
            prompt_len: leg.prompts.get(r.id as usize).copied().unwrap_or(0),
            need_per_group: r.need_per_group.clone(),
            total: r.total(),
            usable: r.usable,
            binding_group: r.binding_group.clone(),
            admitted_at_step: None,
        });
        notes.push(r.to_string());
    }
    lr.steps = run.steps;
    lr.preemptions = run.preemptions;
    lr.finished = run.finished.len() as u64;
    lr.peak_held_per_group = run.peak_held_per_group.clone();
    lr.peak_total_held = run.peak_total_held;
    lr.spec = SpecRecord {
        num_drafts: run.spec.num_drafts,
        num_draft_tokens: run.spec.num_draft_tokens,
        num_accepted_tokens: run.spec.num_accepted_tokens,
        accepted_per_position: run.spec.accepted_per_position.clone(),
        draft_acceptance_rate: (run.spec.num_draft_tokens > 0)
            .then(|| run.spec.draft_acceptance_rate()),
        mean_acceptance_length: (run.spec.num_drafts > 0)
            .then(|| run.spec.mean_acceptance_length()),
    };
    lr.status = if run.wedged.is_some() {
        LegStatus::Wedged
    } else if !run.rejected.is_empty() {
        LegStatus::Rejected
    } else if run.hit_step_limit {
        LegStatus::StepLimit
    } else {
        LegStatus::Completed
    };
    if !notes.is_empty() {
        lr.note = Some(notes.join("; "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MANIFEST: &str = "(name: \"t\", kv: (preset: Some(\"glm53-flash-dflash2\"), block_size: Some(2304), num_blocks: Some(1012)), \
        drafter: (kind: dflash2, num_speculative_tokens: 7), workload: (prompts: [1000, 2000, 3000], output_len: 4))";

    /// A run that fails after its first leg: the complete record stays whole, and the
    /// finished leg waits in the `.partial` sidecar for the next run.
    #[test]
    fn a_failing_run_keeps_the_complete_record_and_its_progress() {
        let dir = tempfile::tempdir().unwrap();
        let rec = dir.path().join("t.json");
        let p = Path::new("t.ron");
        let m: Manifest = crate::manifest::parse_ron(p, MANIFEST).unwrap();
        m.validate(p).unwrap();
        let ctx = RunCtx {
            manifest: &m,
            manifest_path: p,
            manifest_text: MANIFEST,
            record_path: &rec,
            resume: true,
            shard: None,
        };
        run_manifest(&ctx, &mut Quiet).unwrap();
        let complete = std::fs::read(&rec).unwrap();
        let legs = m.legs().unwrap();
        let ids: Vec<String> = legs.iter().map(|l| l.id.clone()).collect();
        for resume in [false, true] {
            let ctx = RunCtx { resume, ..ctx };
            let e = run_legs(&ctx, &ids, vec![], vec![], &mut Quiet, &mut |i, pr| {
                if i == 1 {
                    return Err(ExperimentError::engine(
                        "test",
                        speclab_engine::EngineError::Unsupported("killed".into()),
                    ));
                }
                run_leg(&m, &legs[i], pr)
            })
            .unwrap_err();
            assert!(e.to_string().contains("killed"), "{e}");
            assert_eq!(std::fs::read(&rec).unwrap(), complete, "resume {resume}");
            let partial = RunRecord::load(&record::partial_path(&rec)).unwrap();
            assert_eq!(partial.legs.len(), 1);
            assert!(!partial.complete);
        }
    }
}
