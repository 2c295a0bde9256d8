//! The vLLM-faithful FCFS scheduler (and its reject-impossible variant).
//!
//! Ported behaviour (not code) of vLLM 0.33.0 `vllm/v1/core/sched/scheduler.py`,
//! synchronous scheduling, no prefix caching, no connector, no encoder, FCFS
//! policy, `scheduler_reserve_full_isl = True`:
//! - `Scheduler.schedule`, running loop: each running request (in order) gets
//!   `num_tokens_with_spec - num_computed_tokens` tokens (rest of the prompt,
//!   or 1 + its drafts), capped by the token budget and by
//!   `max_model_len - num_computed_tokens - 1`; `allocate_slots(num_new,
//!   num_lookahead_tokens)`; on failure preempt `running[-1]` and retry; if the
//!   request preempted itself, stop the running loop.
//! - `Scheduler.schedule`, waiting loop (skipped if anything was preempted this
//!   step): while budget > 0 and `len(running) < max_num_seqs`, the head of the
//!   waiting queue gets `num_tokens - num_computed_tokens` capped by the budget
//!   (chunked prefill), `allocate_slots(..., full_sequence_must_fit=True,
//!   has_scheduled_reqs=bool(running))`; `None` ends admission for the step and
//!   the request stays at the head (head-of-line blocking).
//! - `Scheduler._preempt_request`: free the KV, `num_computed_tokens = 0`,
//!   drop pending drafts, status PREEMPTED, push to the FRONT of the waiting queue.
//! - `Scheduler._update_after_schedule` + `update_from_output`: computed tokens
//!   advance by the scheduled count; a step that reaches `num_tokens` samples:
//!   rejected drafts roll `num_computed_tokens` back, `accepted + 1` tokens are
//!   appended one by one and `check_stop` (`sched/utils.py`; here
//!   `speclab_engine::check_stop`, the one place the stop rule runs) stops at
//!   EOS, at `max_tokens` or at `max_model_len`; finished requests free their KV
//!   and are announced to the executor in the next `SchedulerOutput`
//!   (`finished_req_ids`). Drafts exist for the next step only after a sampling
//!   step (vLLM proposes after sampling; partial prefill chunks propose nothing).
//!
//! Token ownership (vLLM: the scheduler's `Request` holds `all_token_ids` and
//! `spec_token_ids`): a request added with
//! [`FcfsScheduler::add_request_with_tokens`] has its prompt, committed outputs
//! and pending draft ids here; each step schedules the draft ids to verify
//! (`ScheduledRequest::draft_tokens`, vLLM `scheduled_spec_decode_tokens`) and
//! `update` appends the executor's sampled ids through the stop rule and keeps
//! the drafter's next proposal. A request added with
//! [`FcfsScheduler::add_request`] is count-only (simulation: no ids, no EOS).
//!
//! Beyond vLLM: a request that can never be admitted (admission need above the
//! usable pool while nothing runs) is reported as `SchedulerOutput::wedged`
//! instead of retrying forever (`AdmissionPolicy::RejectImpossible` removes
//! such requests instead). A request that preempts itself while running alone
//! twice at the same `num_tokens` is also reported as wedged: its recompute
//! replays the same chunks to the same failing per-step allocation (typically
//! the lookahead slots pushing past the pool), so vLLM would thrash forever.
//! A counter of consecutive steps that schedule nothing backstops any other
//! livelock. In the last two cases the report carries the request's admission
//! numbers, which may fit the pool: the per-step allocation is what fails.
//!
//! Invariants: every live request has one dense `ReqSlot` (freed slots are
//! reused, lowest first); waiting requests hold no KV blocks; a step schedules
//! at most `max_num_batched_tokens` tokens and never more than `max_num_seqs`
//! running requests; finished and rejected requests hold nothing.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use speclab_engine::kv::manager::AllocArgs;
use speclab_engine::kv::{AllocOutcome, KvCacheManager};
use speclab_engine::{
    check_stop, Admission, AdmissionReport, EngineError, FinishReason, Finished, ReqSlot,
    RequestId, RequestStatus, RequestView, ScheduledRequest, Scheduler, SchedulerOutput, StallKind,
    StepResult, StepUpdate, StopRule, TokenView,
};

use crate::config::{AdmissionPolicy, RequestSpec, SchedulerConfig};
use crate::error::SchedulerError;

/// Scheduling state of one live request (vLLM `Request`, the fields scheduling reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestState {
    pub id: RequestId,
    pub slot: ReqSlot,
    pub status: RequestStatus,
    pub num_prompt_tokens: u64,
    /// Prompt + committed output tokens (drafts are never counted).
    pub num_tokens: u64,
    /// Tokens whose KV is computed; `num_tokens - 1` between decode steps.
    pub num_computed_tokens: u64,
    pub num_output_tokens: u64,
    pub max_tokens: u64,
    /// Drafts were proposed after the last sampling step (vLLM `spec_token_ids`).
    pub pending_drafts: u64,
    pub num_preemptions: u64,
    /// `num_tokens` when this request last preempted itself while it was the
    /// only running request (it could not proceed even with the pool to itself).
    pub alone_self_preempted_at: Option<u64>,
}

impl RequestState {
    /// What `allocate_slots` sees (synchronous scheduling: nothing in flight).
    pub fn view(&self) -> RequestView {
        RequestView {
            slot: self.slot,
            num_computed_tokens: self.num_computed_tokens,
            num_tokens: self.num_tokens,
            num_prompt_tokens: self.num_prompt_tokens,
            status: self.status,
            num_in_flight_tokens: 0,
        }
    }
}

/// Build the report of why a request cannot (or could not) be admitted.
fn admission_report(
    kind: StallKind,
    kv: &KvCacheManager,
    r: &RequestState,
    need: Vec<u64>,
) -> AdmissionReport {
    let group_names: Vec<String> = kv.groups().iter().map(|g| g.name.clone()).collect();
    AdmissionReport {
        kind,
        id: r.id,
        num_tokens: r.num_tokens.min(kv.max_model_len()),
        binding_group: speclab_engine::binding_group(&group_names, &need).unwrap_or_default(),
        need_per_group: need,
        group_names,
        usable: kv.usable_blocks(),
    }
}

/// The token ids of a request whose tokens the scheduler tracks (real engine runs).
#[derive(Debug, Clone, PartialEq, Eq)]
struct ReqTokens {
    /// Prompt + committed outputs. Shape: [num_tokens].
    tokens: Vec<u32>,
    /// Drafts proposed after the last sampling step (vLLM `spec_token_ids`). Shape: [pending_drafts].
    drafts: Vec<u32>,
    /// EOS stops the request (`None`: `ignore_eos`).
    eos_token_id: Option<u32>,
}

/// vLLM's FCFS scheduler (see the module docs).
#[derive(Debug, Clone)]
pub struct FcfsScheduler {
    cfg: SchedulerConfig,
    /// Live requests by slot. Shape: [slots ever used].
    reqs: Vec<Option<RequestState>>,
    /// Token ids by slot, for requests added with them (`None`: count-only). Shape: [slots ever used].
    toks: Vec<Option<ReqTokens>>,
    /// Requests finished by `update` since the last `schedule` (vLLM `finished_req_ids`).
    finished_since: Vec<RequestId>,
    free_slots: BinaryHeap<Reverse<u32>>,
    by_id: HashMap<RequestId, ReqSlot>,
    waiting: VecDeque<ReqSlot>,
    running: Vec<ReqSlot>,
    /// Rejections found by `add_request`, reported by the next `schedule`.
    pending_rejected: Vec<AdmissionReport>,
    /// Consecutive steps that scheduled nothing while work was left.
    idle_steps: u64,
}

impl FcfsScheduler {
    /// An empty scheduler. The config is validated by `add_request` and `schedule`.
    pub fn new(cfg: SchedulerConfig) -> Self {
        Self {
            cfg,
            reqs: Vec::new(),
            toks: Vec::new(),
            finished_since: Vec::new(),
            free_slots: BinaryHeap::new(),
            by_id: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending_rejected: Vec::new(),
            idle_steps: 0,
        }
    }

    /// Queue a request (vLLM `Scheduler.add_request`). Under `RejectImpossible`
    /// a request that cannot fit even an empty pool is not queued; its report
    /// comes with the next `schedule`.
    pub fn add_request(
        &mut self,
        kv: &KvCacheManager,
        r: RequestSpec,
    ) -> Result<(), SchedulerError> {
        self.add_inner(kv, r, None)
    }

    /// Queue a request with its prompt token ids (real engine runs): the scheduler then
    /// owns its tokens (read through [`TokenView`]), the draft ids it schedules, and the
    /// stop rule with `eos_token_id` (`None`: EOS does not stop, vLLM `ignore_eos`).
    pub fn add_request_with_tokens(
        &mut self,
        kv: &KvCacheManager,
        id: RequestId,
        prompt: Vec<u32>,
        max_tokens: u64,
        eos_token_id: Option<u32>,
    ) -> Result<(), SchedulerError> {
        let spec = RequestSpec {
            id,
            prompt_len: prompt.len() as u64,
            max_tokens,
        };
        let t = ReqTokens {
            tokens: prompt,
            drafts: Vec::new(),
            eos_token_id,
        };
        self.add_inner(kv, spec, Some(t))
    }

    fn add_inner(
        &mut self,
        kv: &KvCacheManager,
        r: RequestSpec,
        tokens: Option<ReqTokens>,
    ) -> Result<(), SchedulerError> {
        self.cfg.validate()?;
        if r.prompt_len == 0 {
            return Err(SchedulerError::EmptyPrompt { id: r.id });
        }
        if r.max_tokens == 0 {
            return Err(SchedulerError::ZeroMaxTokens { id: r.id });
        }
        if r.prompt_len >= kv.max_model_len() {
            return Err(SchedulerError::PromptTooLong {
                id: r.id,
                prompt_len: r.prompt_len,
                max_model_len: kv.max_model_len(),
            });
        }
        if self.by_id.contains_key(&r.id) {
            return Err(SchedulerError::DuplicateRequest { id: r.id });
        }
        let slot = self.take_slot()?;
        let state = RequestState {
            id: r.id,
            slot,
            status: RequestStatus::Waiting,
            num_prompt_tokens: r.prompt_len,
            num_tokens: r.prompt_len,
            num_computed_tokens: 0,
            num_output_tokens: 0,
            max_tokens: r.max_tokens,
            pending_drafts: 0,
            num_preemptions: 0,
            alone_self_preempted_at: None,
        };
        if self.cfg.policy == AdmissionPolicy::RejectImpossible {
            let need = kv.admission_need(&state.view());
            if need.iter().sum::<u64>() > kv.usable_blocks() {
                self.pending_rejected.push(admission_report(
                    StallKind::MustFitExceedsPool,
                    kv,
                    &state,
                    need,
                ));
                self.free_slots.push(Reverse(slot.0));
                return Ok(());
            }
        }
        self.reqs[slot.0 as usize] = Some(state);
        self.toks[slot.0 as usize] = tokens;
        self.by_id.insert(r.id, slot);
        self.waiting.push_back(slot);
        Ok(())
    }

    /// Requests waiting (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests running.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// State of a live request.
    pub fn request(&self, id: RequestId) -> Option<&RequestState> {
        let slot = self.by_id.get(&id)?;
        self.reqs.get(slot.0 as usize)?.as_ref()
    }

    /// Waiting request ids, head first.
    pub fn waiting_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.waiting
            .iter()
            .filter_map(|s| self.state(*s).map(|r| r.id))
    }

    /// Running request ids, in scheduling order.
    pub fn running_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.running
            .iter()
            .filter_map(|s| self.state(*s).map(|r| r.id))
    }

    fn state(&self, slot: ReqSlot) -> Option<&RequestState> {
        self.reqs.get(slot.0 as usize)?.as_ref()
    }

    fn get(&self, slot: ReqSlot) -> Result<RequestState, SchedulerError> {
        self.state(slot).copied().ok_or_else(|| {
            SchedulerError::Engine(EngineError::UnknownRequest {
                req: format!("slot {}", slot.0),
            })
        })
    }

    fn get_mut(&mut self, slot: ReqSlot) -> Result<&mut RequestState, SchedulerError> {
        self.reqs
            .get_mut(slot.0 as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| {
                SchedulerError::Engine(EngineError::UnknownRequest {
                    req: format!("slot {}", slot.0),
                })
            })
    }

    /// Lowest free slot, or a new one.
    fn take_slot(&mut self) -> Result<ReqSlot, SchedulerError> {
        if let Some(Reverse(s)) = self.free_slots.pop() {
            return Ok(ReqSlot(s));
        }
        let n = self.reqs.len();
        let s = u32::try_from(n).map_err(|_| SchedulerError::TooManyRequests { live: n })?;
        self.reqs.push(None);
        self.toks.push(None);
        Ok(ReqSlot(s))
    }

    /// Forget a request that holds no KV (finished and freed, or rejected).
    fn release(&mut self, slot: ReqSlot) {
        if let Some(r) = self.reqs.get_mut(slot.0 as usize).and_then(Option::take) {
            self.toks[slot.0 as usize] = None;
            self.by_id.remove(&r.id);
            self.free_slots.push(Reverse(slot.0));
        }
    }

    /// vLLM `Scheduler._preempt_request` (the caller already removed it from running).
    fn preempt(
        &mut self,
        kv: &mut KvCacheManager,
        slot: ReqSlot,
    ) -> Result<RequestId, SchedulerError> {
        kv.free(slot);
        let r = self.get_mut(slot)?;
        r.status = RequestStatus::Preempted;
        r.num_computed_tokens = 0;
        r.pending_drafts = 0;
        r.num_preemptions += 1;
        let id = r.id;
        if let Some(t) = self.toks.get_mut(slot.0 as usize).and_then(Option::as_mut) {
            t.drafts.clear();
        }
        self.waiting.push_front(slot);
        Ok(id)
    }

    fn schedule_inner(
        &mut self,
        kv: &mut KvCacheManager,
    ) -> Result<SchedulerOutput, SchedulerError> {
        self.cfg.validate()?;
        let mut out = SchedulerOutput {
            rejected: std::mem::take(&mut self.pending_rejected),
            finished_req_ids: std::mem::take(&mut self.finished_since),
            ..SchedulerOutput::default()
        };
        let mut budget = self.cfg.max_num_batched_tokens;
        let livelocked = self.schedule_running(kv, &mut out, &mut budget)?;
        // Then waiting requests, FCFS, unless something was preempted this step.
        if out.preempted.is_empty() {
            self.schedule_waiting(kv, &mut out, &mut budget)?;
        }
        self.detect_stall(kv, &mut out, livelocked)?;
        Ok(out)
    }

    /// The draft token ids of `slot` to verify this step (empty when count-only).
    fn draft_ids(&self, slot: ReqSlot, num_draft: u64) -> Vec<u32> {
        let k = usize::try_from(num_draft).unwrap_or(usize::MAX);
        match self.toks.get(slot.0 as usize).and_then(Option::as_ref) {
            Some(t) => t.drafts.iter().take(k).copied().collect(),
            None => Vec::new(),
        }
    }

    /// Running requests first (vLLM schedule(): "First, schedule the RUNNING
    /// requests"). Returns the slot found livelocked, if any.
    fn schedule_running(
        &mut self,
        kv: &mut KvCacheManager,
        out: &mut SchedulerOutput,
        budget: &mut u64,
    ) -> Result<Option<ReqSlot>, SchedulerError> {
        let mml = kv.max_model_len();
        let mut livelocked = None;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let slot = self.running[i];
            let r = self.get(slot)?;
            let wanted = r.num_tokens.saturating_sub(r.num_computed_tokens) + r.pending_drafts;
            // "Make sure the input position does not exceed the max model len."
            let n = wanted
                .min(*budget)
                .min(mml.saturating_sub(r.num_computed_tokens + 1));
            if n == 0 {
                i += 1;
                continue;
            }
            if !self.allocate_running(kv, out, &r, n, &mut livelocked)? {
                break;
            }
            let num_draft = (r.num_computed_tokens + n).saturating_sub(r.num_tokens);
            out.scheduled.push(ScheduledRequest {
                id: r.id,
                slot,
                start_pos: r.num_computed_tokens,
                num_tokens: n,
                num_draft,
                draft_tokens: self.draft_ids(slot, num_draft),
                is_prefill: r.num_computed_tokens + 1 < r.num_tokens,
            });
            *budget -= n;
            i += 1;
        }
        Ok(livelocked)
    }

    /// `allocate_slots` for a running request, preempting from the back of the running
    /// queue until it fits; false when the request preempted itself.
    fn allocate_running(
        &mut self,
        kv: &mut KvCacheManager,
        out: &mut SchedulerOutput,
        r: &RequestState,
        n: u64,
        livelocked: &mut Option<ReqSlot>,
    ) -> Result<bool, SchedulerError> {
        // vLLM passes no has_scheduled_reqs here (default True); the watermark only
        // applies to WAITING/PREEMPTED requests anyway.
        let args = AllocArgs {
            num_new_tokens: n,
            num_lookahead_tokens: self.cfg.lookahead,
            full_sequence_must_fit: false,
            has_scheduled_reqs: true,
        };
        let view = r.view();
        loop {
            if let AllocOutcome::Allocated(_) = kv.allocate_slots(&view, args)? {
                return Ok(true);
            }
            // FCFS: preempt the lowest-priority (last) running request.
            let Some(victim) = self.running.pop() else {
                return Ok(false);
            };
            out.preempted.push(self.preempt(kv, victim)?);
            if victim == r.slot {
                if self.running.is_empty() {
                    // Alone in the pool and still no fit. Recomputing from 0 replays
                    // the same chunks to the same state, so a second time at the same
                    // num_tokens is a certain livelock (vLLM would thrash forever).
                    let st = self.get_mut(r.slot)?;
                    if st.alone_self_preempted_at == Some(st.num_tokens) {
                        *livelocked = Some(r.slot);
                    }
                    st.alone_self_preempted_at = Some(st.num_tokens);
                }
                return Ok(false);
            }
        }
    }

    /// Waiting requests, FCFS, head-of-line blocking.
    fn schedule_waiting(
        &mut self,
        kv: &mut KvCacheManager,
        out: &mut SchedulerOutput,
        budget: &mut u64,
    ) -> Result<(), SchedulerError> {
        while *budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&slot) = self.waiting.front() else {
                break;
            };
            let r = self.get(slot)?;
            let view = r.view();
            // The numbers the must-fit gate checks, before it runs.
            let need = kv.admission_need(&view);
            if self.cfg.policy == AdmissionPolicy::RejectImpossible
                && need.iter().sum::<u64>() > kv.usable_blocks()
            {
                self.waiting.pop_front();
                out.rejected.push(admission_report(
                    StallKind::MustFitExceedsPool,
                    kv,
                    &r,
                    need,
                ));
                self.release(slot);
                continue;
            }
            let n = r
                .num_tokens
                .saturating_sub(r.num_computed_tokens)
                .min(*budget);
            let args = AllocArgs {
                num_new_tokens: n,
                num_lookahead_tokens: self.cfg.lookahead,
                full_sequence_must_fit: true,
                has_scheduled_reqs: !self.running.is_empty(),
            };
            if let AllocOutcome::NoFit = kv.allocate_slots(&view, args)? {
                // Head-of-line blocking: the request stays at the head.
                break;
            }
            self.waiting.pop_front();
            self.running.push(slot);
            self.get_mut(slot)?.status = RequestStatus::Running;
            out.admitted.push(Admission {
                id: r.id,
                slot,
                need_per_group: need,
            });
            out.scheduled.push(ScheduledRequest {
                id: r.id,
                slot,
                start_pos: r.num_computed_tokens,
                num_tokens: n,
                num_draft: 0,
                draft_tokens: Vec::new(),
                is_prefill: r.num_computed_tokens + 1 < r.num_tokens,
            });
            *budget -= n;
        }
        Ok(())
    }

    /// Wedge, livelock and no-progress detection after a step was planned.
    fn detect_stall(
        &mut self,
        kv: &KvCacheManager,
        out: &mut SchedulerOutput,
        livelocked: Option<ReqSlot>,
    ) -> Result<(), SchedulerError> {
        let report =
            |s: &Self, kind: StallKind, slot: ReqSlot| -> Result<AdmissionReport, SchedulerError> {
                let r = s.get(slot)?;
                let need = kv.admission_need(&r.view());
                Ok(admission_report(kind, kv, &r, need))
            };
        // Wedge: nothing runs and the head can never fit, even in an empty pool.
        // (vLLM retries forever here: Waiting 1 / Running 0.)
        if self.cfg.policy == AdmissionPolicy::Fcfs
            && out.scheduled.is_empty()
            && self.running.is_empty()
        {
            if let Some(&head) = self.waiting.front() {
                let rep = report(self, StallKind::MustFitExceedsPool, head)?;
                if rep.total() > kv.usable_blocks() {
                    out.wedged = Some(rep);
                }
            }
        }
        // Preemption thrash of a request that cannot proceed even alone.
        if out.wedged.is_none() {
            if let Some(slot) = livelocked {
                out.wedged = Some(report(self, StallKind::PerStepLivelock, slot)?);
            }
        }
        // Backstop for any other livelock.
        let work_left = !self.waiting.is_empty() || !self.running.is_empty();
        self.idle_steps = if out.scheduled.is_empty() && work_left {
            self.idle_steps + 1
        } else {
            0
        };
        let limit = self.cfg.max_steps_without_progress;
        if out.wedged.is_none() && limit > 0 && self.idle_steps >= limit {
            if let Some(&head) = self.waiting.front().or(self.running.first()) {
                out.wedged = Some(report(self, StallKind::NoProgress, head)?);
            }
        }
        Ok(())
    }

    fn update_inner(
        &mut self,
        kv: &mut KvCacheManager,
        out: &SchedulerOutput,
        results: &[StepResult],
    ) -> Result<StepUpdate, SchedulerError> {
        if results.len() != out.scheduled.len() {
            let id = out
                .scheduled
                .first()
                .map(|s| s.id)
                .or(results.first().map(|r| r.id))
                .unwrap_or_default();
            return Err(SchedulerError::BadStepResult {
                id,
                reason: format!(
                    "{} results for {} scheduled requests",
                    results.len(),
                    out.scheduled.len()
                ),
            });
        }
        let in_order = out.scheduled.iter().zip(results).all(|(s, r)| s.id == r.id);
        let by_id: HashMap<RequestId, &StepResult> = if in_order {
            HashMap::new()
        } else {
            results.iter().map(|r| (r.id, r)).collect()
        };
        let mut upd = StepUpdate::default();
        let mut done: Vec<ReqSlot> = Vec::new();
        for (i, s) in out.scheduled.iter().enumerate() {
            let res = if in_order {
                results.get(i)
            } else {
                by_id.get(&s.id).copied()
            };
            let res = res.ok_or_else(|| SchedulerError::BadStepResult {
                id: s.id,
                reason: "no result for a scheduled request".into(),
            })?;
            let (committed, finished) = self.update_one(kv, s, res)?;
            if committed > 0 {
                upd.committed.push((s.id, committed));
            }
            if let Some(f) = finished {
                upd.finished.push(f);
                done.push(s.slot);
            }
        }
        if done.is_empty() {
            return Ok(upd);
        }
        self.running.retain(|s| !done.contains(s));
        for slot in done {
            kv.free(slot);
            self.release(slot);
        }
        self.finished_since
            .extend(upd.finished.iter().map(|f| f.id));
        Ok(upd)
    }

    /// The checks of one scheduled request's result against the scheduler's state.
    fn check_result(
        &self,
        s: &ScheduledRequest,
        res: &StepResult,
    ) -> Result<ReqSlot, SchedulerError> {
        let bad = |reason: String| SchedulerError::BadStepResult { id: s.id, reason };
        let slot = *self
            .by_id
            .get(&s.id)
            .ok_or(SchedulerError::UnknownRequest { id: s.id })?;
        if slot != s.slot {
            return Err(bad(format!(
                "scheduled in slot {}, lives in slot {}",
                s.slot.0, slot.0
            )));
        }
        if res.accepted > s.num_draft {
            return Err(bad(format!(
                "accepted {} of {} draft tokens",
                res.accepted, s.num_draft
            )));
        }
        let k = usize::try_from(res.accepted).unwrap_or(usize::MAX);
        if !s.draft_tokens.is_empty()
            && res.sampled.len() > k
            && res.sampled[..k] != s.draft_tokens[..k]
        {
            return Err(bad(format!(
                "sampled {:?} does not start with the {k} accepted drafts {:?}",
                res.sampled,
                &s.draft_tokens[..k]
            )));
        }
        Ok(slot)
    }

    /// Apply one request's result (module doc, `update_from_output`): returns the output
    /// tokens committed and, when the stop rule ended it, the finished request.
    fn update_one(
        &mut self,
        kv: &KvCacheManager,
        s: &ScheduledRequest,
        res: &StepResult,
    ) -> Result<(u64, Option<Finished>), SchedulerError> {
        let slot = self.check_result(s, res)?;
        let k = self.cfg.num_speculative_tokens;
        let mml = kv.max_model_len();
        let bad = |reason: String| SchedulerError::BadStepResult { id: s.id, reason };
        let r = self.get_mut(slot)?;
        if r.status != RequestStatus::Running {
            return Err(SchedulerError::UnknownRequest { id: s.id });
        }
        let computed = r.num_computed_tokens + s.num_tokens;
        if computed < r.num_tokens {
            // A partial prefill chunk samples nothing and proposes nothing.
            r.num_computed_tokens = computed;
            r.pending_drafts = 0;
            return Ok((0, None));
        }
        // A sampling step (last prefill chunk or decode): roll back the rejected
        // drafts, then append accepted + 1 tokens one by one until check_stop.
        let drafts = computed - r.num_tokens;
        if drafts != s.num_draft {
            return Err(bad(format!(
                "scheduled {} drafts but the request state implies {drafts}",
                s.num_draft
            )));
        }
        r.num_computed_tokens = computed - (drafts - res.accepted);
        let rule = StopRule {
            max_tokens: r.max_tokens,
            max_model_len: mml,
            eos_token_id: None,
        };
        let state = *r;
        let (committed, reason) = self.commit_tokens(slot, state, res, rule)?;
        let r = self.get_mut(slot)?;
        r.num_tokens += committed;
        r.num_output_tokens += committed;
        r.pending_drafts = match &res.drafts {
            Some(d) => d.len() as u64,
            None => k,
        };
        let Some(reason) = reason else {
            return Ok((committed, None));
        };
        r.status = RequestStatus::Finished;
        let num_output_tokens = r.num_output_tokens;
        let prompt = usize::try_from(r.num_prompt_tokens).unwrap_or(usize::MAX);
        let output = self.toks[slot.0 as usize]
            .as_ref()
            .map(|t| t.tokens.get(prompt..).unwrap_or(&[]).to_vec())
            .unwrap_or_default();
        let f = Finished {
            id: s.id,
            reason,
            output,
            num_output_tokens,
        };
        Ok((committed, Some(f)))
    }

    /// Append up to `accepted + 1` tokens through the stop rule (vLLM `check_stop` after
    /// each); keep the proposed drafts. Returns how many were committed and why the
    /// request stopped, if it did.
    fn commit_tokens(
        &mut self,
        slot: ReqSlot,
        r: RequestState,
        res: &StepResult,
        mut rule: StopRule,
    ) -> Result<(u64, Option<FinishReason>), SchedulerError> {
        let tracked = self.toks.get_mut(slot.0 as usize).and_then(Option::as_mut);
        let Some(t) = tracked else {
            // Count-only: no token ids, no EOS.
            let (mut n, mut out) = (r.num_tokens, r.num_output_tokens);
            for _ in 0..=res.accepted {
                n += 1;
                out += 1;
                if let Some(why) = check_stop(n, out, None, &rule) {
                    return Ok((out - r.num_output_tokens, Some(why)));
                }
            }
            return Ok((out - r.num_output_tokens, None));
        };
        let want = usize::try_from(res.accepted + 1).unwrap_or(usize::MAX);
        if res.sampled.len() != want {
            return Err(SchedulerError::BadStepResult {
                id: r.id,
                reason: format!(
                    "{} tokens sampled after accepting {} drafts (expected accepted + 1)",
                    res.sampled.len(),
                    res.accepted
                ),
            });
        }
        rule.eos_token_id = t.eos_token_id;
        let before = t.tokens.len();
        let mut why = None;
        for &tok in &res.sampled {
            t.tokens.push(tok);
            let n = t.tokens.len() as u64;
            why = check_stop(n, n - r.num_prompt_tokens, Some(tok), &rule);
            if why.is_some() {
                break;
            }
        }
        t.drafts = res.drafts.clone().unwrap_or_default();
        Ok(((t.tokens.len() - before) as u64, why))
    }
}

impl TokenView for FcfsScheduler {
    fn token_ids(&self, id: RequestId) -> Option<&[u32]> {
        let slot = self.by_id.get(&id)?;
        self.toks
            .get(slot.0 as usize)?
            .as_ref()
            .map(|t| t.tokens.as_slice())
    }
}

impl Scheduler for FcfsScheduler {
    fn schedule(&mut self, kv: &mut KvCacheManager) -> speclab_engine::Result<SchedulerOutput> {
        self.schedule_inner(kv).map_err(EngineError::from)
    }

    fn update(
        &mut self,
        kv: &mut KvCacheManager,
        out: &SchedulerOutput,
        results: &[StepResult],
    ) -> speclab_engine::Result<StepUpdate> {
        self.update_inner(kv, out, results)
            .map_err(EngineError::from)
    }

    fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || !self.pending_rejected.is_empty()
    }
}
