//! The engine's seams: [`Drafter`], [`Scheduler`], [`Executor`] (and, in
//! [`crate::backend`], the model seam [`TargetBackend`]).
//!
//! Shapes from DESIGN.md "Core seams" and vLLM v1's split of ownership
//! (`vllm/v1/core/sched/scheduler.py` owns every request's tokens and its
//! `scheduled_spec_decode_tokens`, `update_from_output` applies the stop rule once;
//! the model runner only executes a `SchedulerOutput` and returns what it sampled
//! and what the drafter proposed). Each trait has 2-4 methods; context is passed in
//! borrowed structs. One run loop ([`crate::run::run`]) drives any scheduler +
//! executor pair: the simulated executor (no weights) and the model executor alike.
//!
//! Invariants: a scheduler never allocates KV outside `KvCacheManager`; an executor
//! never changes which requests are scheduled and holds no token state of its own
//! (it reads tokens through [`TokenView`]); the stop rule runs only in
//! [`Scheduler::update`] ([`crate::request::check_stop`]).

use std::ops::Range;

use rand::RngCore;

use crate::backend::TargetBackend;
use crate::kv::KvCacheManager;
use crate::model::ForwardOut;
use crate::request::{FinishReason, ReqSlot};
use crate::spec::{DraftProbs, SamplingParams};
use crate::Result;

/// Identifier of a request in an engine run.
pub type RequestId = u64;

/// Real mode: the target model behind the backend seam and this step's forward pass,
/// as a drafter that reads target hidden states or keeps its own KV (MTP, DFlash2)
/// sees them.
pub struct TargetStep<'a> {
    /// The target (forward, MTP layer, shared embedding / lm_head), on whatever device
    /// the backend keeps it (the MTP layer's K/V live in the target's `full` group).
    pub backend: &'a mut dyn TargetBackend,
    /// The KV manager of the run (block tables of every group, the drafter's included).
    pub kv: &'a KvCacheManager,
    /// This step's target forward (`hidden` always; `per_layer_hidden` when the drafter
    /// asked for it through [`Drafter::wants_layer_hidden`]).
    pub forward: &'a ForwardOut,
    /// This request's rows of `forward` whose tokens are now committed: a prefill
    /// chunk's rows, or a verify pass's last committed token + accepted drafts.
    pub rows: Range<usize>,
    /// Absolute position of row `rows.start`.
    pub start_pos: usize,
}

/// What a drafter sees for one request after a target pass.
pub struct ProposeCtx<'a> {
    pub request: RequestId,
    /// The request's slot in the KV manager.
    pub slot: ReqSlot,
    /// Prompt + committed output tokens so far, including the tokens this step just
    /// sampled (the last one is the token to draft after). Shape: [num_tokens].
    pub tokens: &'a [u32],
    /// Maximum number of draft tokens to propose this step; 0 = only observe the
    /// target rows (a partial prefill chunk), propose nothing.
    pub max_draft: usize,
    /// The target's sampling parameters (drafters that sample use its temperature).
    pub sampling: SamplingParams,
    /// The request's RNG (needed by drafters that sample when `sampling` is not greedy).
    pub rng: Option<&'a mut dyn RngCore>,
    /// The target pass (real mode); `None` for token-only drafters (tests, simulation).
    pub target: Option<TargetStep<'a>>,
}

impl<'a> ProposeCtx<'a> {
    /// A token-only context (no target pass, greedy, no RNG, slot 0).
    pub fn new(request: RequestId, tokens: &'a [u32], max_draft: usize) -> Self {
        Self {
            request,
            slot: ReqSlot(0),
            tokens,
            max_draft,
            sampling: SamplingParams::GREEDY,
            rng: None,
            target: None,
        }
    }
}

impl std::fmt::Debug for ProposeCtx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProposeCtx")
            .field("request", &self.request)
            .field("slot", &self.slot)
            .field("num_tokens", &self.tokens.len())
            .field("max_draft", &self.max_draft)
            .field("sampling", &self.sampling)
            .field(
                "target_rows",
                &self.target.as_ref().map(|t| (t.rows.clone(), t.start_pos)),
            )
            .finish_non_exhaustive()
    }
}

/// A drafter's proposal.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Proposal {
    /// Draft tokens. Shape: [num_draft].
    pub tokens: Vec<u32>,
    /// Draft distributions q, when sampling: [num_draft] rows, dense over the vocabulary
    /// or sparse ([`DraftProbs`]); `None` means one-hot q (the draft token).
    pub probs: Option<DraftProbs>,
}

/// Where a drafter reads the target's per-layer hidden states ([`Drafter::layer_hidden`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LayerHidden {
    /// It does not read them.
    #[default]
    None,
    /// From [`ForwardOut::per_layer_hidden`](crate::model::ForwardOut) on the host.
    Host,
    /// In the device backend's own buffer (a drafter running on the same device, the
    /// CUDA DFlash2): the backend keeps them there and need not copy them out, nor the
    /// forward's final hidden rows (the drafter reads nothing of the target on the host).
    Device,
    /// Only the forward's final hidden rows, in the device backend's own buffer (the
    /// CUDA MTP chain): no per-layer collection and no host copy of the hidden.
    FinalOnDevice,
}

/// Proposes draft tokens around a target model.
///
/// Protocol (the model executor, `crate::exec`): after every target pass of a
/// request (every prefill chunk, every verify) the executor calls [`Drafter::propose`]
/// once for it, with the rows that pass committed (`ctx.target`) and the tokens
/// (`ctx.tokens`: the scheduler's committed tokens plus the ones just sampled).
/// Drafters with state (their own KV, context length) update it from those rows, in
/// position order, and then draft up to `ctx.max_draft` tokens (vLLM proposes right
/// after sampling, before the scheduler's stop rule; a partial prefill chunk proposes
/// nothing). A chunk starting at position 0 starts the request afresh (first prefill,
/// or the recompute after a preemption).
pub trait Drafter {
    /// Observe the committed rows of this step's target pass, then draft up to
    /// `ctx.max_draft` tokens.
    fn propose(&mut self, ctx: &mut ProposeCtx<'_>) -> Result<Proposal>;
    /// Lookahead slots the KV manager must reserve per decode step
    /// (vLLM: num_speculative_tokens, +1 for DFlash-style drafters, 0 without KV).
    fn lookahead_slots(&self) -> usize;
    /// Whether (and where) the target forward must collect per-layer hidden states
    /// (`ForwardOptions::collect_hidden` / `hidden_on_device`; DFlash2's target features).
    fn layer_hidden(&self) -> LayerHidden {
        LayerHidden::None
    }
    /// Forget a request's state (it finished or was preempted; its KV blocks belong
    /// to the KV manager and are freed there).
    fn release(&mut self, _slot: ReqSlot) {}
    /// Every request of a step at once (vLLM's proposers draft the whole batch: one
    /// drafter forward per draft position, not per request). Returns one proposal per
    /// entry of `reqs`, in order. The default calls [`Drafter::propose`] per request,
    /// so a drafter that batches gives the same proposals, only fewer device calls.
    fn propose_batch(
        &mut self,
        step: &mut DraftStep<'_>,
        reqs: &mut [DraftReq<'_>],
    ) -> Result<Vec<Proposal>> {
        let mut out = Vec::with_capacity(reqs.len());
        for r in reqs.iter_mut() {
            let mut ctx = ProposeCtx {
                request: r.request,
                slot: r.slot,
                tokens: r.tokens,
                max_draft: r.max_draft,
                sampling: step.sampling,
                rng: match r.rng.as_mut() {
                    Some(g) => Some(&mut **g),
                    None => None,
                },
                target: Some(TargetStep {
                    backend: &mut *step.backend,
                    kv: step.kv,
                    forward: step.forward,
                    rows: r.rows.clone(),
                    start_pos: r.start_pos,
                }),
            };
            out.push(self.propose(&mut ctx)?);
        }
        Ok(out)
    }
}

/// [`Drafter::propose`] for a drafter whose work is [`Drafter::propose_batch`] (MTP, the
/// CUDA DFlash2): the one request as a batch of one. `None` when `ctx` carries no target
/// pass (the caller names its drafter in the error).
pub fn propose_one<D: Drafter + ?Sized>(
    d: &mut D,
    ctx: &mut ProposeCtx<'_>,
) -> Option<Result<Proposal>> {
    let t = ctx.target.as_mut()?;
    let mut step = DraftStep {
        backend: &mut *t.backend,
        kv: t.kv,
        forward: t.forward,
        sampling: ctx.sampling,
    };
    let mut reqs = [DraftReq {
        request: ctx.request,
        slot: ctx.slot,
        tokens: ctx.tokens,
        max_draft: ctx.max_draft,
        rng: ctx.rng.as_mut().map(|r| &mut **r as &mut dyn RngCore),
        rows: t.rows.clone(),
        start_pos: t.start_pos,
    }];
    Some(
        d.propose_batch(&mut step, &mut reqs)
            .map(|mut out| out.pop().unwrap_or_default()),
    )
}

/// A step's target pass as a batched drafter sees it ([`Drafter::propose_batch`]).
pub struct DraftStep<'a> {
    pub backend: &'a mut dyn TargetBackend,
    pub kv: &'a KvCacheManager,
    pub forward: &'a ForwardOut,
    pub sampling: SamplingParams,
}

/// One request of a batched proposal: what [`ProposeCtx`] and [`TargetStep`] hold for it.
pub struct DraftReq<'a> {
    pub request: RequestId,
    pub slot: ReqSlot,
    /// Committed tokens plus the ones just sampled. Shape: [num_tokens].
    pub tokens: &'a [u32],
    pub max_draft: usize,
    pub rng: Option<&'a mut dyn RngCore>,
    /// This request's committed rows of the step's forward.
    pub rows: Range<usize>,
    /// Absolute position of row `rows.start`.
    pub start_pos: usize,
}

/// One request's share of a step (vLLM `SchedulerOutput.num_scheduled_tokens` +
/// `scheduled_spec_decode_tokens` for one request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledRequest {
    pub id: RequestId,
    pub slot: ReqSlot,
    /// Tokens already computed before this step (the chunk starts at this position).
    pub start_pos: u64,
    /// Tokens computed this step (prefill chunk, or 1 + drafts in decode).
    pub num_tokens: u64,
    /// Draft tokens included in `num_tokens` (decode only).
    pub num_draft: u64,
    /// The draft token ids to verify (vLLM `scheduled_spec_decode_tokens`), when the
    /// scheduler tracks token ids; empty in count-only simulation. Shape: [num_draft] or [0].
    pub draft_tokens: Vec<u32>,
    /// Whether the request is still prefilling.
    pub is_prefill: bool,
}

/// Token ids as the scheduler, their one owner, holds them (read by executors).
pub trait TokenView {
    /// Prompt + committed output tokens of a live request; `None` when the request is
    /// unknown or the scheduler only counts tokens (simulation).
    fn token_ids(&self, id: RequestId) -> Option<&[u32]>;
}

/// A [`TokenView`] that knows no tokens (count-only simulation, tests).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoTokens;

impl TokenView for NoTokens {
    fn token_ids(&self, _id: RequestId) -> Option<&[u32]> {
        None
    }
}

/// Why a run cannot make progress for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StallKind {
    /// The must-fit admission check needs more blocks than the usable pool
    /// (vLLM: Waiting 1 / Running 0 forever).
    MustFitExceedsPool,
    /// The request runs alone, cannot fit its next step plus lookahead,
    /// preempts itself and recomputes to the same point (a livelock).
    PerStepLivelock,
    /// The step backstop: nothing was scheduled for many consecutive steps.
    NoProgress,
}

/// Why a request cannot be admitted into an empty pool, with the numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionReport {
    /// What kind of stall this is.
    pub kind: StallKind,
    pub id: RequestId,
    /// Tokens the admission check sized (min(num_tokens, max_model_len)).
    pub num_tokens: u64,
    /// Blocks the must-fit check needs, per group. Shape: [num_groups].
    pub need_per_group: Vec<u64>,
    /// Group names, in group order. Shape: [num_groups].
    pub group_names: Vec<String>,
    /// Usable blocks of the pool (num_blocks - 1).
    pub usable: u64,
    /// The group needing the most blocks (the one to cap).
    pub binding_group: String,
}

/// The group(s) needing the most blocks: one name, or the tied names joined by
/// " = " (e.g. `full = drafter_swa`), so a tie is never reported as one group binding.
pub fn binding_group(names: &[String], need: &[u64]) -> Option<String> {
    let max = *need.iter().max()?;
    let tied: Vec<&str> = need
        .iter()
        .zip(names)
        .filter(|(&n, _)| n == max)
        .map(|(_, s)| s.as_str())
        .collect();
    (!tied.is_empty()).then(|| tied.join(" = "))
}

impl AdmissionReport {
    /// Total blocks needed.
    pub fn total(&self) -> u64 {
        self.need_per_group.iter().sum()
    }
}

impl std::fmt::Display for AdmissionReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per: Vec<String> = self
            .group_names
            .iter()
            .zip(&self.need_per_group)
            .map(|(n, b)| format!("{n}={b}"))
            .collect();
        match self.kind {
            StallKind::MustFitExceedsPool => write!(
                f,
                "request {} ({} tokens) needs {} blocks ({}) but the pool has {} usable blocks; binding group: {}",
                self.id,
                self.num_tokens,
                self.total(),
                per.join(", "),
                self.usable,
                self.binding_group
            ),
            StallKind::PerStepLivelock => write!(
                f,
                "request {} ({} tokens) passes admission ({} of {} usable blocks: {}) but cannot fit its next step plus lookahead even alone: it preempts itself and recomputes forever",
                self.id,
                self.num_tokens,
                self.total(),
                self.usable,
                per.join(", ")
            ),
            StallKind::NoProgress => write!(
                f,
                "no request was scheduled for many consecutive steps; head request {} ({} tokens) admission need {} of {} usable blocks ({})",
                self.id,
                self.num_tokens,
                self.total(),
                self.usable,
                per.join(", ")
            ),
        }
    }
}

/// A request admitted this step, with the per-group blocks its admission check sized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    pub id: RequestId,
    pub slot: ReqSlot,
    /// Shape: [num_groups].
    pub need_per_group: Vec<u64>,
}

/// The scheduler's decision for a step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    pub scheduled: Vec<ScheduledRequest>,
    /// Requests admitted (first allocation succeeded) this step.
    pub admitted: Vec<Admission>,
    /// Requests preempted this step.
    pub preempted: Vec<RequestId>,
    /// Requests rejected this step (policies that refuse impossible requests).
    pub rejected: Vec<AdmissionReport>,
    /// Set when nothing runs and the head request can never be admitted
    /// (faithful mode: vLLM would retry forever: Waiting 1, Running 0).
    pub wedged: Option<AdmissionReport>,
    /// Requests that finished since the previous step (vLLM `finished_req_ids`): the
    /// executor forgets their model state.
    pub finished_req_ids: Vec<RequestId>,
}

/// What an executor reports for one request after a step (vLLM `ModelRunnerOutput`
/// for one request: `sampled_token_ids` and the drafter's `draft_token_ids`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepResult {
    pub id: RequestId,
    /// Draft tokens accepted (decode only; 0 for prefill).
    pub accepted: u64,
    /// Tokens sampled this step (the accepted drafts, then the bonus or recovered
    /// token): `accepted + 1` of them after a sampling step, none after a partial
    /// prefill chunk; empty in count-only simulation. Shape: [accepted + 1] or [0].
    pub sampled: Vec<u32>,
    /// Drafts proposed for this request's next step; `None` = count-only simulation
    /// (the scheduler drafts its configured number of placeholder tokens).
    pub drafts: Option<Vec<u32>>,
}

/// A request that finished in a step, as the scheduler's stop rule decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub id: RequestId,
    pub reason: FinishReason,
    /// Committed output tokens (EOS included when it stopped the request); empty when
    /// the scheduler only counts tokens. Shape: [num_output_tokens] or [0].
    pub output: Vec<u32>,
    pub num_output_tokens: u64,
}

/// What [`Scheduler::update`] committed in one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepUpdate {
    /// Output tokens committed per request this step (after the stop rule), in
    /// scheduling order; requests that committed nothing are left out.
    pub committed: Vec<(RequestId, u64)>,
    /// Requests that finished this step.
    pub finished: Vec<Finished>,
}

impl StepUpdate {
    /// Ids of the requests that finished, in order.
    pub fn finished_ids(&self) -> Vec<RequestId> {
        self.finished.iter().map(|f| f.id).collect()
    }
    /// Output tokens committed this step, over all requests.
    pub fn num_committed(&self) -> u64 {
        self.committed.iter().map(|c| c.1).sum()
    }
}

/// Decides admission and per-step token budgets against the KV manager, and owns
/// every request's tokens, drafts and stop rule.
pub trait Scheduler: TokenView {
    /// Plan one step.
    fn schedule(&mut self, kv: &mut KvCacheManager) -> Result<SchedulerOutput>;
    /// Apply the executor's results (commit sampled tokens through the stop rule, roll
    /// back rejections, keep the proposed drafts, free finished requests).
    fn update(
        &mut self,
        kv: &mut KvCacheManager,
        out: &SchedulerOutput,
        results: &[StepResult],
    ) -> Result<StepUpdate>;
    /// Whether any request is waiting or running.
    fn has_work(&self) -> bool;
}

/// What an executor is handed for one step.
#[derive(Clone, Copy)]
pub struct StepCtx<'a> {
    /// Block tables the scheduler allocated for this step.
    pub kv: &'a KvCacheManager,
    /// The scheduler's decision.
    pub batch: &'a SchedulerOutput,
    /// The scheduler's tokens (prompts, committed outputs).
    pub tokens: &'a dyn TokenView,
}

/// Executor-side measurements of one step (zero / `None` in simulation).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepPerf {
    /// Seconds in the target forward and in the drafter.
    pub forward_s: f64,
    pub draft_s: f64,
    /// Distinct (MoE layer, expert) pairs routed to by the decode (verify) rows.
    pub verify_experts: Option<u64>,
    /// Distinct (MoE layer, expert) pairs routed to by the whole batch.
    pub batch_experts: Option<u64>,
}

/// What an executor returns for one step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepOutput {
    /// One result per scheduled request, in scheduling order.
    pub results: Vec<StepResult>,
    pub perf: StepPerf,
}

/// Runs one step for a scheduled batch.
pub trait Executor {
    /// Execute the step and report per-request results (one per scheduled request).
    fn execute(&mut self, ctx: &StepCtx<'_>) -> Result<StepOutput>;
}
