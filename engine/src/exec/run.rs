//! The engine run loop ([`run_engine`]) and one-call generation ([`generate`]).
//!
//! [`run_engine`] is vLLM's `EngineCore.step` loop (schedule -> execute -> update) over a
//! [`Scheduler`], a [`ModelExecutor`] and one [`KvCacheManager`], like
//! [`crate::sim::run_sim`] for the simulated executor. After every `schedule` it checks the
//! allocator: the blocks in use (`usable - free`) equal the blocks the requests hold
//! (`held_blocks`, summed over every slot the run used); at the end of a run with no work
//! left every block is free again. A violation is recorded in
//! [`EngineRun::allocator_violation`] (the run goes on, so the outputs can still be read).
//!
//! [`generate`] assembles a run: the KV layout is the target's groups
//! (`ModelConfig::kv_layout(block_size, N, num_blocks)`) followed by the drafter's own
//! groups ([`DrafterFactory::kv_groups`], e.g. DFlash2's sliding-window group), one
//! manager for both; the scheduler comes from the caller's closure (the engine never names
//! a policy), told `N` and the lookahead (vLLM: N for MTP, N + 1 for DFlash, 0 for n-gram
//! and none).
//!
//! Invariants: the loop never runs past `max_steps` executed steps and stops at the first
//! wedge; tokens per second = output tokens / wall seconds of the whole loop.

use std::collections::BTreeSet;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::exec::executor::{ExecConfig, ModelExecutor, RequestStats, StepStats};
use crate::kv::{GroupSpec, KvCacheManager};
use crate::model::{ModelConfig, ModelRunner, ModelWeights};
use crate::request::ReqSlot;
use crate::sim::SpecMetrics;
use crate::spec::SamplingParams;
use crate::traits::{Drafter, Executor, RequestId, Scheduler};
use crate::{EngineError, Result};

/// A request to generate for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineRequest {
    pub id: RequestId,
    /// Prompt token ids (>= 1, each below the vocab, fewer than max_model_len).
    pub prompt: Vec<u32>,
    /// Output tokens to generate at most (>= 1).
    pub max_tokens: u64,
}

/// What a run observed.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct EngineRun {
    /// Outputs and metrics per request, in request order.
    pub requests: Vec<RequestStats>,
    /// Metrics per executed step.
    pub steps: Vec<StepStats>,
    /// vLLM spec-decode counters over the run.
    pub spec: SpecMetrics,
    /// Draft acceptance rate = accepted / drafted tokens.
    pub acceptance_rate: f64,
    /// Mean acceptance length tau = 1 + accepted / drafts.
    pub tau: f64,
    /// Unconditional per-position acceptance rates.
    pub per_position: Vec<f64>,
    pub num_steps: u64,
    pub output_tokens: u64,
    pub wall_s: f64,
    /// Output tokens per wall second.
    pub tokens_per_s: f64,
    /// The scheduler reported a wedge (its report); the run stopped there.
    pub wedged: Option<String>,
    /// Requests the policy refused.
    pub rejected: Vec<String>,
    pub preemptions: u64,
    pub hit_step_limit: bool,
    pub kv_usable_blocks: u64,
    pub kv_free_blocks_end: u64,
    /// Blocks still held by any request at the end (0 after a complete run).
    pub kv_held_blocks_end: u64,
    /// The first allocator invariant violation seen, if any.
    pub allocator_violation: Option<String>,
}

impl EngineRun {
    /// The output of request `id`.
    pub fn output(&self, id: RequestId) -> Option<&[u32]> {
        self.requests
            .iter()
            .find(|r| r.id == id)
            .map(|r| r.output.as_slice())
    }
    /// Every request finished, nothing wedged, rejected or cut by the step limit.
    pub fn complete(&self) -> bool {
        self.wedged.is_none()
            && self.rejected.is_empty()
            && !self.hit_step_limit
            && self.requests.iter().all(|r| r.finish.is_some())
    }
}

fn held_total(kv: &KvCacheManager, slots: &BTreeSet<ReqSlot>) -> u64 {
    slots
        .iter()
        .map(|&s| kv.held_blocks(s).iter().sum::<u64>())
        .sum()
}

/// Run `sched` + `exec` against `kv` until no work is left, a wedge, or `max_steps`
/// executed steps. Requests must already be added to both the scheduler and the executor
/// (same ids, prompt lengths and `max_tokens`).
pub fn run_engine(
    kv: &mut KvCacheManager,
    sched: &mut dyn Scheduler,
    exec: &mut ModelExecutor,
    max_steps: u64,
) -> Result<EngineRun> {
    let mut run = EngineRun {
        kv_usable_blocks: kv.usable_blocks(),
        ..EngineRun::default()
    };
    let mut slots = BTreeSet::new();
    exec.start_clock();
    let t0 = Instant::now();
    while sched.has_work() {
        if run.num_steps >= max_steps {
            run.hit_step_limit = true;
            break;
        }
        let out = sched.schedule(kv)?;
        run.rejected
            .extend(out.rejected.iter().map(|r| r.to_string()));
        run.preemptions += out.preempted.len() as u64;
        slots.extend(out.scheduled.iter().map(|s| s.slot));
        let in_use = kv.usable_blocks() - kv.num_free_blocks();
        let held = held_total(kv, &slots);
        if in_use != held && run.allocator_violation.is_none() {
            run.allocator_violation = Some(format!(
                "step {}: {in_use} blocks in use (usable - free) but requests hold {held}",
                run.num_steps
            ));
        }
        if let Some(w) = &out.wedged {
            run.wedged = Some(w.to_string());
            break;
        }
        let results = exec.execute(kv, &out)?;
        sched.update(kv, &out, &results)?;
        run.num_steps += 1;
    }
    run.wall_s = t0.elapsed().as_secs_f64();
    run.kv_free_blocks_end = kv.num_free_blocks();
    run.kv_held_blocks_end = held_total(kv, &slots);
    if !sched.has_work()
        && run.allocator_violation.is_none()
        && (run.kv_free_blocks_end != run.kv_usable_blocks || run.kv_held_blocks_end != 0)
    {
        run.allocator_violation = Some(format!(
            "end of run: {} of {} usable blocks free, requests still hold {}",
            run.kv_free_blocks_end, run.kv_usable_blocks, run.kv_held_blocks_end
        ));
    }
    run.requests = exec.request_stats();
    run.steps = exec.steps().to_vec();
    for r in &run.requests {
        run.output_tokens += r.output.len() as u64;
    }
    // vLLM SpecDecodingStats over the run = the sum of the per-request counters.
    let mut spec = SpecMetrics::default();
    for r in &run.requests {
        merge_spec(&mut spec, &r.spec);
    }
    run.acceptance_rate = spec.draft_acceptance_rate();
    run.tau = spec.mean_acceptance_length();
    run.per_position = spec.per_position_rates();
    run.spec = spec;
    run.tokens_per_s = if run.wall_s > 0.0 {
        run.output_tokens as f64 / run.wall_s
    } else {
        0.0
    };
    Ok(run)
}

/// Add `b`'s counters to `a`.
fn merge_spec(a: &mut SpecMetrics, b: &SpecMetrics) {
    a.num_drafts += b.num_drafts;
    a.num_draft_tokens += b.num_draft_tokens;
    a.num_accepted_tokens += b.num_accepted_tokens;
    if a.accepted_per_position.len() < b.accepted_per_position.len() {
        a.accepted_per_position
            .resize(b.accepted_per_position.len(), 0);
    }
    for (x, y) in a
        .accepted_per_position
        .iter_mut()
        .zip(&b.accepted_per_position)
    {
        *x += y;
    }
}

/// How to build a drafter for a run (implemented by `speclab_drafters::DrafterSpec`).
pub trait DrafterFactory {
    /// `N`: drafts per step (0 = no drafter).
    fn num_speculative_tokens(&self) -> usize;
    /// KV groups the drafter's own K/V live in, appended after the target's groups.
    fn kv_groups(&self) -> Result<Vec<GroupSpec>>;
    /// The drafter, over the run's KV manager (whose layout includes `kv_groups`).
    fn build(&self, target: &ModelConfig, kv: &KvCacheManager) -> Result<Box<dyn Drafter>>;
}

/// What the engine tells the scheduler factory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerParams {
    /// vLLM `num_speculative_tokens`.
    pub num_speculative_tokens: u64,
    /// vLLM `num_lookahead_tokens` (the drafter's `lookahead_slots`).
    pub lookahead: u64,
}

/// Builds the run's scheduler with `requests` queued (in order).
pub type SchedulerFactory<'a> = dyn FnMut(&KvCacheManager, &SchedulerParams, &[EngineRequest]) -> Result<Box<dyn Scheduler>>
    + 'a;

/// Engine knobs of [`generate`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EngineOptions {
    /// Block size of the target's `full` group.
    pub block_size: u32,
    /// Blocks in the pool (one is the null block).
    pub num_blocks: u32,
    /// Cap below the model's `max_position_embeddings` (`None`: the model's).
    pub max_model_len: Option<u64>,
    pub sampling: SamplingParams,
    pub seed: u64,
    pub ignore_eos: bool,
    pub collect_router: bool,
    /// Stop after this many executed steps.
    pub max_steps: u64,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 512,
            max_model_len: None,
            sampling: SamplingParams::GREEDY,
            seed: 0,
            ignore_eos: false,
            collect_router: false,
            max_steps: 100_000,
        }
    }
}

/// Check requests against the model and `max_model_len` (clear errors before any work).
pub(crate) fn check_requests(
    cfg: &ModelConfig,
    requests: &[EngineRequest],
    mml: u64,
) -> Result<()> {
    let mut ids = BTreeSet::new();
    for r in requests {
        if !ids.insert(r.id) {
            return Err(EngineError::DuplicateRequest {
                req: r.id.to_string(),
            });
        }
        if r.prompt.is_empty() {
            return Err(EngineError::BadTokenCount {
                req: r.id.to_string(),
                reason: "empty prompt".into(),
            });
        }
        if r.max_tokens == 0 {
            return Err(EngineError::BadTokenCount {
                req: r.id.to_string(),
                reason: "max_tokens must be >= 1".into(),
            });
        }
        if r.prompt.len() as u64 >= mml {
            return Err(EngineError::PromptTooLong {
                req: r.id.to_string(),
                prompt_len: r.prompt.len() as u64,
                max_model_len: mml,
            });
        }
        if let Some(&t) = r.prompt.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(EngineError::ModelInput(format!(
                "request {}: prompt token id {t} is not below vocab_size {}",
                r.id, cfg.vocab_size
            )));
        }
    }
    Ok(())
}

/// Generate for `requests` with the target and a drafter: build the KV manager (target
/// groups + drafter groups), runner, drafter, executor and scheduler, then [`run_engine`].
pub fn generate(
    target: &ModelWeights,
    drafter: &dyn DrafterFactory,
    requests: &[EngineRequest],
    opts: &EngineOptions,
    make_scheduler: &mut SchedulerFactory<'_>,
) -> Result<EngineRun> {
    opts.sampling.validate()?;
    let n = drafter.num_speculative_tokens();
    let n32 = u32::try_from(n).map_err(|_| EngineError::InvalidDrafterConfig {
        drafter: "any".into(),
        reason: format!("num_speculative_tokens {n} too large"),
    })?;
    let mut layout = target
        .cfg
        .kv_layout(opts.block_size, n32, opts.num_blocks)?;
    if let Some(m) = opts.max_model_len {
        if m == 0 || m > u64::from(layout.max_model_len) {
            return Err(EngineError::InvalidLayout {
                field: "max_model_len".into(),
                reason: format!(
                    "{m} must be in 1..={} (the model's max_position_embeddings)",
                    layout.max_model_len
                ),
            });
        }
        layout.max_model_len = m as u32;
    }
    layout.groups.extend(drafter.kv_groups()?);
    layout.resolve_groups()?;
    let kv_mml = u64::from(layout.max_model_len);
    check_requests(&target.cfg, requests, kv_mml)?;
    let mut kv = KvCacheManager::new(&layout, opts.num_blocks)?;
    let runner = ModelRunner::new(target.clone(), &kv)?;
    let d = drafter.build(&target.cfg, &kv)?;
    let params = SchedulerParams {
        num_speculative_tokens: n as u64,
        lookahead: d.lookahead_slots() as u64,
    };
    let cfg = ExecConfig {
        num_speculative_tokens: n,
        sampling: opts.sampling,
        seed: opts.seed,
        ignore_eos: opts.ignore_eos,
        collect_router: opts.collect_router,
    };
    let mut exec = ModelExecutor::new(runner, d, cfg)?;
    for r in requests {
        exec.add_request(r.id, r.prompt.clone(), r.max_tokens)?;
    }
    let mut sched = make_scheduler(&kv, &params, requests)?;
    run_engine(&mut kv, sched.as_mut(), &mut exec, opts.max_steps)
}

/// The no-drafter factory (the lossless check's reference run).
pub(crate) struct NoDrafterFactory;

struct NoDrafter;

impl Drafter for NoDrafter {
    fn propose(
        &mut self,
        _ctx: &mut crate::traits::ProposeCtx<'_>,
    ) -> Result<crate::traits::Proposal> {
        Ok(crate::traits::Proposal::default())
    }
    fn lookahead_slots(&self) -> usize {
        0
    }
}

impl DrafterFactory for NoDrafterFactory {
    fn num_speculative_tokens(&self) -> usize {
        0
    }
    fn kv_groups(&self) -> Result<Vec<GroupSpec>> {
        Ok(Vec::new())
    }
    fn build(&self, _target: &ModelConfig, _kv: &KvCacheManager) -> Result<Box<dyn Drafter>> {
        Ok(Box::new(NoDrafter))
    }
}
