//! One-call generation ([`generate`], [`generate_on`]) on the engine's one step loop.
//!
//! [`generate_on`] assembles a run: the KV layout is the target's groups
//! (`ModelConfig::kv_layout(block_size, N, num_blocks)`) followed by the drafter's own
//! groups ([`DrafterFactory::kv_groups`], e.g. DFlash2's sliding-window group), one
//! manager for both; the target backend comes from a [`BackendFactory`] (the CPU
//! reference for [`generate`]); the scheduler comes from the caller's closure (the engine
//! never names a policy), told `N`, the lookahead (vLLM: N for MTP, N + 1 for DFlash, 0
//! for n-gram and none) and the EOS token of the stop rule, and queues the requests with
//! their token ids. The loop is [`crate::run::run`] with allocator checks on: after every
//! `schedule` the blocks in use (`usable - free`) must equal the blocks the requests
//! hold, and at the end of a complete run every block is free again; a violation is
//! recorded in [`EngineRun::allocator_violation`] (the run goes on, so the outputs can
//! still be read).
//!
//! Invariants: the loop never runs past `max_steps` executed steps and stops at the first
//! wedge; tokens per second = output tokens / wall seconds of the whole loop.

use serde::{Deserialize, Serialize};

use crate::backend::{BackendFactory, CpuBackend};
use crate::exec::executor::{ExecConfig, ModelExecutor};
use crate::kv::{GroupSpec, KvCacheManager};
use crate::model::{ModelConfig, ModelWeights};
use crate::request::FinishReason;
use crate::run::{run, RunLimits, RunReport, StepStats};
use crate::sim::SpecMetrics;
use crate::spec::SamplingParams;
use crate::traits::{Drafter, RequestId, Scheduler};
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

/// One request's outputs and metrics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestStats {
    pub id: RequestId,
    pub prompt_len: usize,
    /// Committed output token ids (EOS included when it stopped the request).
    pub output: Vec<u32>,
    /// `None`: not finished (wedged, rejected, or the run hit its step limit).
    pub finish: Option<FinishReason>,
    /// vLLM `SpecDecodingStats` over this request's verify steps.
    pub spec: SpecMetrics,
    /// Executed steps up to and including the one that produced the first output token.
    pub ttft_steps: Option<u64>,
    /// Seconds from the start of the run to the first output token.
    pub ttft_s: Option<f64>,
    /// Seconds from the start of the run to the finish.
    pub e2e_s: Option<f64>,
    pub num_preemptions: u64,
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

impl EngineRun {
    /// The engine's view of a [`RunReport`]: per request in `requests` order (outputs of
    /// finished requests from the report, of unfinished ones from the scheduler's
    /// tokens), the step records, and the run's rates.
    fn from_report(
        rep: RunReport,
        requests: &[EngineRequest],
        sched: &dyn Scheduler,
        steps: Vec<StepStats>,
    ) -> Self {
        let stats = requests.iter().map(|r| {
            let p = rep.requests.get(&r.id).cloned().unwrap_or_default();
            let output = if p.finish.is_some() {
                p.output
            } else {
                sched
                    .token_ids(r.id)
                    .and_then(|t| t.get(r.prompt.len()..))
                    .map(<[u32]>::to_vec)
                    .unwrap_or_default()
            };
            RequestStats {
                id: r.id,
                prompt_len: r.prompt.len(),
                output,
                finish: p.finish,
                spec: p.spec,
                ttft_steps: p.ttft_steps,
                ttft_s: p.ttft_s,
                e2e_s: p.e2e_s,
                num_preemptions: p.num_preemptions,
            }
        });
        let requests: Vec<RequestStats> = stats.collect();
        let output_tokens = requests.iter().map(|r| r.output.len() as u64).sum();
        let spec = rep.spec;
        Self {
            acceptance_rate: spec.draft_acceptance_rate(),
            tau: spec.mean_acceptance_length(),
            per_position: spec.per_position_rates(),
            spec,
            requests,
            steps,
            num_steps: rep.steps,
            output_tokens,
            wall_s: rep.wall_s,
            tokens_per_s: if rep.wall_s > 0.0 {
                output_tokens as f64 / rep.wall_s
            } else {
                0.0
            },
            wedged: rep.wedged.map(|w| w.to_string()),
            rejected: rep.rejected.iter().map(|r| r.to_string()).collect(),
            preemptions: rep.preemptions,
            hit_step_limit: rep.hit_step_limit,
            kv_usable_blocks: rep.kv_usable_blocks,
            kv_free_blocks_end: rep.kv_free_blocks_end,
            kv_held_blocks_end: rep.kv_held_blocks_end,
            allocator_violation: rep.allocator_violation,
        }
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
    /// EOS stops a request (`None`: `ignore_eos`); the scheduler's stop rule uses it.
    pub eos_token_id: Option<u32>,
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
    /// Check the allocator's invariant after every `schedule` (on by default; a
    /// benchmark turns it off so the check's host time is not counted).
    pub check_allocator: bool,
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
            check_allocator: true,
        }
    }
}

/// Check the prompts' token ids against the model's vocabulary before any work (the
/// counts, duplicates and lengths are the scheduler's to check when it queues them).
pub(crate) fn check_token_ids(cfg: &ModelConfig, requests: &[EngineRequest]) -> Result<()> {
    for r in requests {
        if let Some(&t) = r.prompt.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(EngineError::ModelInput(format!(
                "request {}: prompt token id {t} is not below vocab_size {}",
                r.id, cfg.vocab_size
            )));
        }
    }
    Ok(())
}

/// The KV layout of a run: the target's groups, then the drafter's own groups.
fn run_layout(
    target: &ModelWeights,
    drafter: &dyn DrafterFactory,
    opts: &EngineOptions,
) -> Result<crate::kv::KvLayout> {
    layout_for(&target.cfg, drafter, opts)
}

/// [`run_layout`] from the target's config alone.
fn layout_for(
    cfg: &ModelConfig,
    drafter: &dyn DrafterFactory,
    opts: &EngineOptions,
) -> Result<crate::kv::KvLayout> {
    let n = drafter.num_speculative_tokens();
    let n32 = u32::try_from(n).map_err(|_| EngineError::InvalidDrafterConfig {
        drafter: "any".into(),
        reason: format!("num_speculative_tokens {n} too large"),
    })?;
    let mut layout = cfg.kv_layout(opts.block_size, n32, opts.num_blocks)?;
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
    Ok(layout)
}

/// The pool of a run sized from a byte budget: the layout [`generate_on`] builds (the
/// target's `full` / `kda_state` groups, then the drafter's groups) planned by
/// [`crate::kv::planning::plan_pool`] (vLLM's rule: the largest group's page per block),
/// with what this engine's stores really allocate per block beside it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunPoolPlan {
    #[serde(flatten)]
    pub plan: crate::kv::planning::PoolPlan,
    /// Bytes per block of the target's store (host `KvStore`, device pool of speclab-cuda):
    /// its groups alias one block, so the largest target group's page (`KvGeometry`).
    pub target_store_bytes_per_block: u64,
    /// Bytes per block of the drafter's own stores (DFlash2's `DraftKvStore` keeps its
    /// pages apart from the target's instead of aliasing them): the sum of its groups' pages.
    pub drafter_store_bytes_per_block: u64,
}

impl RunPoolPlan {
    /// Bytes the engine's stores allocate for the planned pool (target + drafter).
    pub fn allocated_bytes(&self) -> u64 {
        u64::from(self.plan.num_blocks)
            .saturating_mul(self.target_store_bytes_per_block + self.drafter_store_bytes_per_block)
    }
    /// Bytes of the target's store for the planned pool (what the CUDA engine puts on the device).
    pub fn target_store_bytes(&self) -> u64 {
        u64::from(self.plan.num_blocks).saturating_mul(self.target_store_bytes_per_block)
    }
}

/// Plan the pool of a run of `drafter` on a target with config `cfg` from
/// `kv_cache_memory_bytes` (vLLM `--kv-cache-memory-bytes`); `opts.num_blocks` is ignored.
pub fn plan_run_pool(
    cfg: &ModelConfig,
    drafter: &dyn DrafterFactory,
    opts: &EngineOptions,
    kv_cache_memory_bytes: u64,
) -> Result<RunPoolPlan> {
    use crate::model::config::{FULL_GROUP, STATE_GROUP};
    let layout = layout_for(cfg, drafter, opts)?; // its num_blocks is replaced by the plan
    let plan = crate::kv::planning::plan_pool(&layout, kv_cache_memory_bytes)?;
    let is_target = |n: &str| n == FULL_GROUP || n == STATE_GROUP;
    let target_store_bytes_per_block = plan
        .groups
        .iter()
        .filter(|g| is_target(&g.name))
        .map(|g| g.bytes_per_block)
        .max()
        .unwrap_or(0);
    let drafter_store_bytes_per_block = plan
        .groups
        .iter()
        .filter(|g| !is_target(&g.name))
        .map(|g| g.bytes_per_block)
        .sum();
    Ok(RunPoolPlan {
        plan,
        target_store_bytes_per_block,
        drafter_store_bytes_per_block,
    })
}

/// Generate for `requests` on the CPU reference backend ([`generate_on`]).
pub fn generate(
    target: &ModelWeights,
    drafter: &dyn DrafterFactory,
    requests: &[EngineRequest],
    opts: &EngineOptions,
    make_scheduler: &mut SchedulerFactory<'_>,
) -> Result<EngineRun> {
    generate_on(&CpuBackend, target, drafter, requests, opts, make_scheduler)
}

/// Generate for `requests` with the target on `backend` and a drafter: build the KV
/// manager (target groups + drafter groups), backend, drafter, executor and scheduler
/// (which queues the requests with their token ids), then the one step loop
/// ([`crate::run::run`], allocator checks on).
pub fn generate_on(
    backend: &dyn BackendFactory,
    target: &ModelWeights,
    drafter: &dyn DrafterFactory,
    requests: &[EngineRequest],
    opts: &EngineOptions,
    make_scheduler: &mut SchedulerFactory<'_>,
) -> Result<EngineRun> {
    let parts = GenerateParts {
        backend,
        target,
        drafter,
        requests,
        opts,
    };
    generate_observed(&parts, make_scheduler, &mut |_: &StepStats| {})
}

/// What [`generate_observed`] runs: the backend, the models, the requests and options.
pub struct GenerateParts<'a> {
    pub backend: &'a dyn BackendFactory,
    pub target: &'a ModelWeights,
    pub drafter: &'a dyn DrafterFactory,
    pub requests: &'a [EngineRequest],
    pub opts: &'a EngineOptions,
}

/// [`generate_on`] with an observer that sees every executed step as it ends (a
/// benchmark reads device counters there).
pub fn generate_observed(
    parts: &GenerateParts<'_>,
    make_scheduler: &mut SchedulerFactory<'_>,
    observer: &mut dyn crate::run::RunObserver,
) -> Result<EngineRun> {
    let GenerateParts {
        backend,
        target,
        drafter,
        requests,
        opts,
    } = *parts;
    opts.sampling.validate()?;
    let layout = run_layout(target, drafter, opts)?;
    check_token_ids(&target.cfg, requests)?;
    let mut kv = KvCacheManager::new(&layout, opts.num_blocks)?;
    let d = drafter.build(&target.cfg, &kv)?;
    let params = SchedulerParams {
        num_speculative_tokens: drafter.num_speculative_tokens() as u64,
        lookahead: d.lookahead_slots() as u64,
        eos_token_id: (!opts.ignore_eos).then_some(target.cfg.eos_token_id),
    };
    let mut sched = make_scheduler(&kv, &params, requests)?;
    let cfg = ExecConfig {
        num_speculative_tokens: drafter.num_speculative_tokens(),
        sampling: opts.sampling,
        seed: opts.seed,
        collect_router: opts.collect_router,
    };
    let mut exec = ModelExecutor::new(backend.build(target, &kv)?, d, cfg)?;
    let mut steps = Vec::new();
    let limits = RunLimits {
        max_steps: opts.max_steps,
        check_allocator: opts.check_allocator,
    };
    let rep = run(
        &mut kv,
        sched.as_mut(),
        &mut exec,
        limits,
        &mut |s: &StepStats| {
            observer.on_step(s);
            steps.push(s.clone());
        },
    )?;
    Ok(EngineRun::from_report(rep, requests, sched.as_ref(), steps))
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
