//! The one step loop: [`run`] drives any [`Scheduler`] + [`Executor`] pair against a
//! [`KvCacheManager`], for the simulator and the real engine alike.
//!
//! Source: vLLM 0.33.0 `vllm/v1/engine/core.py` `EngineCore.step` (`schedule` ->
//! `execute_model` -> `update_from_output`) and DESIGN.md "The step loop" (one owner
//! per piece of state; metrics counted once).
//!
//! Per step the loop:
//! 1. calls `schedule`, records rejections, admissions, preemptions and the KV peaks
//!    (blocks are only allocated in `schedule`; `update` only frees), and, when asked
//!    ([`RunLimits::check_allocator`]), checks that the blocks in use
//!    (`usable - free`) equal the blocks the requests hold (summed over every slot the
//!    run used);
//! 2. stops at the first wedge (vLLM would retry forever: Waiting 1 / Running 0);
//! 3. calls `execute` with the scheduler's tokens ([`StepCtx`]), checks the results
//!    pair with the scheduled requests (`accepted <= num_draft`);
//! 4. calls `update` (the stop rule) and counts [`SpecMetrics`] once: per run and per
//!    request, from the scheduled drafts and the accepted counts; TTFT at the first
//!    committed output token; end-to-end time at the finish;
//! 5. hands the step's [`StepStats`] to the observer (progress bars, per-step records).
//!
//! Invariants: never runs past `max_steps` executed steps; the same seed and inputs give
//! the same counts (timings aside); at the end of a run with no work left and the
//! allocator check on, every block is free again (else `allocator_violation`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::kv::KvCacheManager;
use crate::metrics::SpecMetrics;
use crate::request::{FinishReason, ReqSlot};
use crate::traits::{
    Admission, AdmissionReport, Executor, RequestId, ScheduledRequest, Scheduler, SchedulerOutput,
    StepCtx, StepOutput, StepResult, StepUpdate, TokenView,
};
use crate::{EngineError, Result};

/// Limits and checks of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunLimits {
    /// Stop after this many executed steps ([`RunReport::hit_step_limit`]).
    pub max_steps: u64,
    /// Check after every `schedule` that the blocks in use equal the blocks held.
    pub check_allocator: bool,
}

/// One executed step: counts from the loop, timings and expert counts from the executor.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StepStats {
    /// 0-based index of the executed step.
    pub step: u64,
    /// Requests in the batch.
    pub num_reqs: usize,
    /// Tokens of prefill chunks (`is_prefill`, including a final chunk that samples).
    pub prefill_tokens: u64,
    /// Verify width: tokens of decode chunks (`1 + drafts` each).
    pub verify_tokens: u64,
    /// Decode chunks that verified at least one draft (vLLM `num_drafts`).
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    /// Output tokens committed this step (after the stop rule).
    pub output_tokens: u64,
    /// Distinct (MoE layer, expert) pairs routed to by the decode (verify) rows; `None`
    /// unless the executor collects routing (or no decode rows).
    pub verify_experts: Option<u64>,
    /// Distinct (MoE layer, expert) pairs routed to by the whole batch.
    pub batch_experts: Option<u64>,
    /// Seconds in the target forward, in the drafter, and in the whole `execute`.
    pub forward_s: f64,
    pub draft_s: f64,
    pub step_s: f64,
    /// Seconds of the whole loop iteration: `schedule`, `execute` and `update`.
    pub loop_s: f64,
}

/// What the run saw of one request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestProgress {
    /// vLLM `SpecDecodingStats` over this request's verify steps.
    pub spec: SpecMetrics,
    /// Executed steps up to and including the one that committed the first output token.
    pub ttft_steps: Option<u64>,
    /// Seconds from the start of the run to the first output token / to the finish.
    pub ttft_s: Option<f64>,
    pub e2e_s: Option<f64>,
    pub num_preemptions: u64,
    /// Set when the stop rule finished the request.
    pub finish: Option<FinishReason>,
    /// Committed outputs at the finish (empty while running, or when the scheduler
    /// only counts tokens). Shape: [num_output_tokens] or [0].
    pub output: Vec<u32>,
    pub num_output_tokens: u64,
}

/// Everything a run observed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunReport {
    /// Executed steps (a step that wedged is not counted).
    pub steps: u64,
    /// Set when the scheduler reported a wedge; the run stopped there.
    pub wedged: Option<AdmissionReport>,
    /// Requests the policy refused, in order.
    pub rejected: Vec<AdmissionReport>,
    /// (step index, admission), step index 0-based.
    pub admitted: Vec<(u64, Admission)>,
    /// (step index, request), step index 0-based.
    pub finished: Vec<(u64, RequestId)>,
    /// Preemptions over the run.
    pub preemptions: u64,
    /// Max over steps of the blocks held by any single scheduled request, per group.
    /// Shape: [num_groups].
    pub peak_held_per_group: Vec<u64>,
    /// Max over steps of `usable - free`.
    pub peak_total_held: u64,
    /// Spec-decode counters over the run.
    pub spec: SpecMetrics,
    /// Per request, by id.
    pub requests: BTreeMap<RequestId, RequestProgress>,
    /// Output tokens committed over the run.
    pub output_tokens: u64,
    /// The run stopped at `max_steps` with work left.
    pub hit_step_limit: bool,
    /// Wall seconds of the whole loop.
    pub wall_s: f64,
    pub kv_usable_blocks: u64,
    pub kv_free_blocks_end: u64,
    /// Blocks still held by any request at the end (0 after a complete run).
    pub kv_held_blocks_end: u64,
    /// The first allocator invariant violation seen (only with `check_allocator`).
    pub allocator_violation: Option<String>,
}

/// Sees every executed step.
pub trait RunObserver {
    /// Called after each executed step's `update`.
    fn on_step(&mut self, stats: &StepStats);
}

impl<F: FnMut(&StepStats)> RunObserver for F {
    fn on_step(&mut self, stats: &StepStats) {
        self(stats)
    }
}

/// The loop's running state beside the report.
struct Tracker {
    report: RunReport,
    slots: BTreeSet<ReqSlot>,
    t0: Instant,
    check_allocator: bool,
}

fn held_total(kv: &KvCacheManager, slots: &BTreeSet<ReqSlot>) -> u64 {
    slots
        .iter()
        .map(|&s| kv.held_blocks(s).iter().sum::<u64>())
        .sum()
}

/// Pair each scheduled request with its result (same order fast path, else by id) and
/// check `accepted <= num_draft`.
fn pair_results<'a>(
    batch: &'a SchedulerOutput,
    results: &'a [StepResult],
) -> Result<Vec<(&'a ScheduledRequest, &'a StepResult)>> {
    if results.len() != batch.scheduled.len() {
        return Err(EngineError::BadTokenCount {
            req: "batch".into(),
            reason: format!(
                "executor returned {} results for {} scheduled requests",
                results.len(),
                batch.scheduled.len()
            ),
        });
    }
    let pairs: Vec<_> = if batch
        .scheduled
        .iter()
        .zip(results)
        .all(|(s, r)| s.id == r.id)
    {
        batch.scheduled.iter().zip(results).collect()
    } else {
        let by_id: HashMap<RequestId, &StepResult> = results.iter().map(|r| (r.id, r)).collect();
        batch
            .scheduled
            .iter()
            .map(|s| {
                by_id
                    .get(&s.id)
                    .map(|r| (s, *r))
                    .ok_or_else(|| EngineError::UnknownRequest {
                        req: s.id.to_string(),
                    })
            })
            .collect::<Result<_>>()?
    };
    for (s, r) in &pairs {
        if r.accepted > s.num_draft {
            return Err(EngineError::BadTokenCount {
                req: s.id.to_string(),
                reason: format!(
                    "executor accepted {} of {} draft tokens",
                    r.accepted, s.num_draft
                ),
            });
        }
    }
    Ok(pairs)
}

impl Tracker {
    fn new(kv: &KvCacheManager, check_allocator: bool) -> Self {
        let report = RunReport {
            peak_held_per_group: vec![0; kv.groups().len()],
            kv_usable_blocks: kv.usable_blocks(),
            ..RunReport::default()
        };
        Self {
            report,
            slots: BTreeSet::new(),
            t0: Instant::now(),
            check_allocator,
        }
    }

    /// Step 1 of the module doc.
    fn note_schedule(&mut self, step: u64, out: &SchedulerOutput, kv: &KvCacheManager) {
        let r = &mut self.report;
        r.rejected.extend(out.rejected.iter().cloned());
        r.admitted
            .extend(out.admitted.iter().map(|a| (step, a.clone())));
        r.preemptions += out.preempted.len() as u64;
        for id in &out.preempted {
            r.requests.entry(*id).or_default().num_preemptions += 1;
        }
        r.peak_total_held = r
            .peak_total_held
            .max(kv.usable_blocks().saturating_sub(kv.num_free_blocks()));
        for s in &out.scheduled {
            for (peak, held) in r.peak_held_per_group.iter_mut().zip(kv.held_blocks(s.slot)) {
                *peak = (*peak).max(held);
            }
        }
        if !self.check_allocator {
            return;
        }
        self.slots.extend(out.scheduled.iter().map(|s| s.slot));
        let in_use = kv.usable_blocks().saturating_sub(kv.num_free_blocks());
        let held = held_total(kv, &self.slots);
        if in_use != held && r.allocator_violation.is_none() {
            r.allocator_violation = Some(format!(
                "step {step}: {in_use} blocks in use (usable - free) but requests hold {held}"
            ));
        }
    }

    /// Step 4 of the module doc: metrics of one executed step, counted once.
    fn note_step(
        &mut self,
        step: u64,
        pairs: &[(&ScheduledRequest, &StepResult)],
        exec: &StepOutput,
        upd: &StepUpdate,
        step_s: f64,
    ) -> StepStats {
        let now = self.t0.elapsed().as_secs_f64();
        let r = &mut self.report;
        let mut st = StepStats {
            step,
            num_reqs: pairs.len(),
            verify_experts: exec.perf.verify_experts,
            batch_experts: exec.perf.batch_experts,
            forward_s: exec.perf.forward_s,
            draft_s: exec.perf.draft_s,
            step_s,
            ..StepStats::default()
        };
        for (s, res) in pairs {
            if s.is_prefill {
                st.prefill_tokens += s.num_tokens;
            } else {
                st.verify_tokens += s.num_tokens;
            }
            if s.num_draft > 0 {
                // vLLM update_from_output: stats only for steps that verified drafts.
                r.spec.observe_draft(s.num_draft, res.accepted);
                r.requests
                    .entry(s.id)
                    .or_default()
                    .spec
                    .observe_draft(s.num_draft, res.accepted);
                st.num_drafts += 1;
                st.num_draft_tokens += s.num_draft;
                st.num_accepted_tokens += res.accepted;
            }
        }
        for &(id, n) in &upd.committed {
            let p = r.requests.entry(id).or_default();
            p.num_output_tokens += n;
            if n > 0 && p.ttft_steps.is_none() {
                p.ttft_steps = Some(step + 1);
                p.ttft_s = Some(now);
            }
            st.output_tokens += n;
        }
        r.output_tokens += st.output_tokens;
        for f in &upd.finished {
            let p = r.requests.entry(f.id).or_default();
            p.finish = Some(f.reason);
            p.output = f.output.clone();
            p.num_output_tokens = f.num_output_tokens;
            p.e2e_s = Some(now);
            r.finished.push((step, f.id));
        }
        st
    }

    fn finish(mut self, kv: &KvCacheManager, work_left: bool) -> RunReport {
        let r = &mut self.report;
        r.wall_s = self.t0.elapsed().as_secs_f64();
        r.kv_free_blocks_end = kv.num_free_blocks();
        r.kv_held_blocks_end = held_total(kv, &self.slots);
        if self.check_allocator
            && !work_left
            && r.allocator_violation.is_none()
            && (r.kv_free_blocks_end != r.kv_usable_blocks || r.kv_held_blocks_end != 0)
        {
            r.allocator_violation = Some(format!(
                "end of run: {} of {} usable blocks free, requests still hold {}",
                r.kv_free_blocks_end, r.kv_usable_blocks, r.kv_held_blocks_end
            ));
        }
        self.report
    }
}

/// Run `sched` + `exec` against `kv` until no work is left, a wedge, or
/// `limits.max_steps` executed steps (module doc). Requests must already be queued in
/// the scheduler.
pub fn run(
    kv: &mut KvCacheManager,
    sched: &mut dyn Scheduler,
    exec: &mut dyn Executor,
    limits: RunLimits,
    observer: &mut dyn RunObserver,
) -> Result<RunReport> {
    let mut t = Tracker::new(kv, limits.check_allocator);
    while sched.has_work() {
        if t.report.steps >= limits.max_steps {
            t.report.hit_step_limit = true;
            break;
        }
        let step = t.report.steps;
        let t_loop = Instant::now();
        let out = sched.schedule(kv)?;
        t.note_schedule(step, &out, kv);
        if let Some(w) = &out.wedged {
            t.report.wedged = Some(w.clone());
            break;
        }
        let t_step = Instant::now();
        let tokens: &dyn TokenView = &*sched;
        let exec_out = exec.execute(&StepCtx {
            kv: &*kv,
            batch: &out,
            tokens,
        })?;
        let step_s = t_step.elapsed().as_secs_f64();
        let pairs = pair_results(&out, &exec_out.results)?;
        let upd = sched.update(kv, &out, &exec_out.results)?;
        let mut stats = t.note_step(step, &pairs, &exec_out, &upd, step_s);
        stats.loop_s = t_loop.elapsed().as_secs_f64();
        t.report.steps += 1;
        observer.on_step(&stats);
    }
    let work_left = sched.has_work();
    Ok(t.finish(kv, work_left))
}
