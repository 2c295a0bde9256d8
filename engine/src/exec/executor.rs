//! [`ModelExecutor`]: the real target + a drafter behind the engine's [`Executor`] seam.
//!
//! One step (see the module doc of [`crate::exec`] for the sources):
//! 1. requests preempted by this step's `schedule` forget their runner / drafter state
//!    (their KV was freed; the scheduler recomputes them from position 0 later);
//! 2. every scheduled request becomes one [`SeqChunk`]: a prefill chunk is
//!    `tokens[start_pos .. start_pos + num_tokens]`; a decode step with `k` drafts is
//!    `[last committed token, d_1 .. d_k]` with KDA snapshots (`snapshot: true`);
//! 3. one batched target forward (logits of every row when some chunk verifies drafts,
//!    else only each chunk's last row; per-layer hidden states when the drafter wants
//!    them; router traces when asked);
//! 4. per sampling request (the chunk reaches the end of the known tokens): verify the
//!    drafts against the `k + 1` rows (greedy, or rejection sampling with the drafter's q
//!    or one-hot q), roll the KDA state back to the accepted prefix (`commit_state`),
//!    append the `accepted + 1` emitted tokens one by one until a stop (vLLM
//!    `check_stop`: EOS unless `ignore_eos`, `max_tokens`, `max_model_len`);
//! 5. per live request, the drafter observes the committed rows (`TargetStep`) and,
//!    after a sampling step, proposes up to `min(N, max_model_len - num_tokens - 1)`
//!    drafts (the scheduler never schedules past `max_model_len - 1`); a finished request
//!    is released instead.
//!
//! Invariants: tokens per request = prompt + committed outputs, exactly those the
//! scheduler committed (cut after EOS); drafts held for a request are the ones reported
//! in `next_drafts`; a scheduled decode step verifies a prefix of them.

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::kv::KvCacheManager;
use crate::model::{ForwardOptions, LogitsRows, ModelRunner, SeqChunk};
use crate::request::ReqSlot;
use crate::sim::SpecMetrics;
use crate::spec::{seeded_rng, SamplingParams, SpecRng, VerifyCtx};
use crate::traits::{
    Drafter, Executor, Proposal, ProposeCtx, RequestId, SchedulerOutput, StepResult, TargetStep,
};
use crate::{EngineError, Result};

/// Executor knobs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ExecConfig {
    /// `N` (vLLM `num_speculative_tokens`): most drafts per step; 0 without a drafter.
    /// Must match the KV layout's (the `kda_state` group holds 1 + N snapshot blocks).
    pub num_speculative_tokens: usize,
    /// The target's sampling parameters (greedy = temperature 0).
    pub sampling: SamplingParams,
    /// Seed of the per-request RNGs (request `id` samples from `seeded_rng(mix(seed, id))`).
    pub seed: u64,
    /// Do not stop at EOS (vLLM `SamplingParams.ignore_eos`).
    pub ignore_eos: bool,
    /// Record the distinct experts each step's forward routed to (`ForwardOptions::collect_router`).
    pub collect_router: bool,
}

impl Default for ExecConfig {
    fn default() -> Self {
        Self {
            num_speculative_tokens: 0,
            sampling: SamplingParams::GREEDY,
            seed: 0,
            ignore_eos: false,
            collect_router: false,
        }
    }
}

/// Why a request stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model emitted EOS (included in the output).
    Eos,
    /// `max_tokens` outputs.
    Length,
    /// The sequence reached `max_model_len`.
    MaxModelLen,
}

/// One executed step, as the executor saw it.
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
    /// Output tokens committed this step (after stop cuts).
    pub output_tokens: u64,
    /// Distinct (MoE layer, expert) pairs routed to by the decode (verify) rows; `None`
    /// unless `ExecConfig::collect_router` (or no decode rows).
    pub verify_experts: Option<u64>,
    /// Distinct (MoE layer, expert) pairs routed to by the whole batch.
    pub batch_experts: Option<u64>,
    /// Seconds in the target forward, in the drafter, and in the whole `execute`.
    pub forward_s: f64,
    pub draft_s: f64,
    pub step_s: f64,
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

/// Per-request executor state.
struct ReqState {
    id: RequestId,
    prompt_len: usize,
    /// Prompt + committed outputs.
    tokens: Vec<u32>,
    max_tokens: u64,
    slot: Option<ReqSlot>,
    /// Drafts for the next step (reported as `next_drafts`).
    drafts: Proposal,
    rng: SpecRng,
    finish: Option<FinishReason>,
    spec: SpecMetrics,
    ttft: Option<(u64, f64)>,
    e2e_s: Option<f64>,
    preemptions: u64,
}

impl ReqState {
    fn num_output(&self) -> u64 {
        (self.tokens.len() - self.prompt_len) as u64
    }
}

/// A chunk of the batch, planned.
struct Planned {
    id: RequestId,
    slot: ReqSlot,
    start_pos: usize,
    tokens: Vec<u32>,
    num_draft: usize,
    /// The chunk reaches the end of the known tokens: it samples.
    sampling: bool,
    is_prefill: bool,
    /// First row of the chunk in the batch.
    offset: usize,
}

fn bad_batch(id: RequestId, reason: String) -> EngineError {
    EngineError::BadTokenCount {
        req: id.to_string(),
        reason,
    }
}

/// SplitMix64 finaliser: decorrelates per-request seeds.
fn mix(seed: u64, id: u64) -> u64 {
    let mut z = seed ^ id.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The model executor (module doc).
pub struct ModelExecutor {
    runner: ModelRunner,
    drafter: Box<dyn Drafter>,
    cfg: ExecConfig,
    reqs: HashMap<RequestId, ReqState>,
    /// Request ids in the order they were added.
    order: Vec<RequestId>,
    steps: Vec<StepStats>,
    clock: Option<Instant>,
}

impl std::fmt::Debug for ModelExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelExecutor")
            .field("cfg", &self.cfg)
            .field("requests", &self.order.len())
            .field("steps", &self.steps.len())
            .finish_non_exhaustive()
    }
}

impl ModelExecutor {
    /// An executor over `runner` (built for the run's KV manager) and `drafter`.
    pub fn new(runner: ModelRunner, drafter: Box<dyn Drafter>, cfg: ExecConfig) -> Result<Self> {
        cfg.sampling.validate()?;
        Ok(Self {
            runner,
            drafter,
            cfg,
            reqs: HashMap::new(),
            order: Vec::new(),
            steps: Vec::new(),
            clock: None,
        })
    }

    /// Register a request before the scheduler schedules it (the scheduler gets the same
    /// id, prompt length and `max_tokens`).
    pub fn add_request(&mut self, id: RequestId, prompt: Vec<u32>, max_tokens: u64) -> Result<()> {
        let vocab = self.runner.config().vocab_size;
        if prompt.is_empty() {
            return Err(bad_batch(id, "empty prompt".into()));
        }
        if max_tokens == 0 {
            return Err(bad_batch(id, "max_tokens must be >= 1".into()));
        }
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::ModelInput(format!(
                "request {id}: prompt token id {t} is not below vocab_size {vocab}"
            )));
        }
        if self.reqs.contains_key(&id) {
            return Err(EngineError::DuplicateRequest {
                req: id.to_string(),
            });
        }
        let st = ReqState {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            max_tokens,
            slot: None,
            drafts: Proposal::default(),
            rng: seeded_rng(mix(self.cfg.seed, id)),
            finish: None,
            spec: SpecMetrics::default(),
            ttft: None,
            e2e_s: None,
            preemptions: 0,
        };
        self.reqs.insert(id, st);
        self.order.push(id);
        Ok(())
    }

    /// Start the run's clock (TTFT and end-to-end times count from here; otherwise from
    /// the first `execute`).
    pub fn start_clock(&mut self) {
        self.clock = Some(Instant::now());
    }

    /// The config.
    pub fn config(&self) -> &ExecConfig {
        &self.cfg
    }
    /// The target runner.
    pub fn runner(&self) -> &ModelRunner {
        &self.runner
    }
    /// Output tokens of a request so far.
    pub fn output(&self, id: RequestId) -> Option<&[u32]> {
        self.reqs.get(&id).map(|r| &r.tokens[r.prompt_len..])
    }
    /// Statistics of every executed step.
    pub fn steps(&self) -> &[StepStats] {
        &self.steps
    }
    /// Outputs and metrics of every request, in the order they were added.
    pub fn request_stats(&self) -> Vec<RequestStats> {
        self.order
            .iter()
            .filter_map(|id| self.reqs.get(id))
            .map(|r| RequestStats {
                id: r.id,
                prompt_len: r.prompt_len,
                output: r.tokens[r.prompt_len..].to_vec(),
                finish: r.finish,
                spec: r.spec.clone(),
                ttft_steps: r.ttft.map(|t| t.0),
                ttft_s: r.ttft.map(|t| t.1),
                e2e_s: r.e2e_s,
                num_preemptions: r.preemptions,
            })
            .collect()
    }

    fn forget(&mut self, slot: ReqSlot) {
        self.drafter.release(slot);
        self.runner.release(slot);
    }

    /// Turn the scheduler's batch into chunks (checks every count against the tokens held).
    fn plan(&mut self, batch: &SchedulerOutput) -> Result<Vec<Planned>> {
        let mut plan = Vec::with_capacity(batch.scheduled.len());
        let mut offset = 0usize;
        for s in &batch.scheduled {
            let st = self
                .reqs
                .get_mut(&s.id)
                .ok_or(EngineError::UnknownRequest {
                    req: s.id.to_string(),
                })?;
            if st.finish.is_some() {
                return Err(bad_batch(s.id, "scheduled after it finished".into()));
            }
            let len = st.tokens.len();
            let (start, n, k) = (
                s.start_pos as usize,
                s.num_tokens as usize,
                s.num_draft as usize,
            );
            if n == 0 {
                return Err(bad_batch(s.id, "scheduled with 0 tokens".into()));
            }
            if st.slot.is_some_and(|old| old != s.slot) {
                return Err(bad_batch(
                    s.id,
                    format!(
                        "scheduled in slot {} but it lives in slot {}",
                        s.slot.0,
                        st.slot.map_or(0, |x| x.0)
                    ),
                ));
            }
            st.slot = Some(s.slot);
            let tokens = if k > 0 {
                if start + 1 != len || n != k + 1 || k > st.drafts.tokens.len() {
                    return Err(bad_batch(
                        s.id,
                        format!(
                            "decode step at position {start} with {n} tokens and {k} drafts, but the request holds {len} tokens and {} drafts",
                            st.drafts.tokens.len()
                        ),
                    ));
                }
                let mut t = Vec::with_capacity(n);
                t.push(st.tokens[len - 1]);
                t.extend_from_slice(&st.drafts.tokens[..k]);
                t
            } else {
                if start + n > len {
                    return Err(bad_batch(
                        s.id,
                        format!(
                            "chunk {start}..{} runs past the {len} tokens the request holds",
                            start + n
                        ),
                    ));
                }
                st.tokens[start..start + n].to_vec()
            };
            let sampling = start + n - k == len;
            if start == 0 {
                // A fresh start (first chunk, or the recompute after a preemption).
                let slot = s.slot;
                self.forget(slot);
            }
            plan.push(Planned {
                id: s.id,
                slot: s.slot,
                start_pos: start,
                tokens,
                num_draft: k,
                sampling,
                is_prefill: s.is_prefill,
                offset,
            });
            offset += n;
        }
        Ok(plan)
    }
}

/// Count distinct (layer, expert) pairs over batch rows selected by `keep`.
fn distinct_experts(
    router: &[crate::model::RouterTrace],
    num_rows: usize,
    keep: &dyn Fn(usize) -> bool,
) -> u64 {
    let mut seen = BTreeSet::new();
    for tr in router {
        if num_rows == 0 {
            break;
        }
        let k = tr.ids.len() / num_rows;
        for (row, ids) in tr.ids.chunks(k.max(1)).enumerate() {
            if keep(row) {
                for &e in ids {
                    seen.insert((tr.layer, e));
                }
            }
        }
    }
    seen.len() as u64
}

impl Executor for ModelExecutor {
    fn execute(&mut self, kv: &KvCacheManager, batch: &SchedulerOutput) -> Result<Vec<StepResult>> {
        let t_step = Instant::now();
        let clock = *self.clock.get_or_insert(t_step);
        let step = self.steps.len() as u64;
        let mut stats = StepStats {
            step,
            num_reqs: batch.scheduled.len(),
            ..StepStats::default()
        };

        // 1. Preempted requests lose their KV: forget their runner / drafter state.
        for id in &batch.preempted {
            if let Some(st) = self.reqs.get_mut(id) {
                st.drafts = Proposal::default();
                st.preemptions += 1;
                if let Some(slot) = st.slot {
                    self.drafter.release(slot);
                    self.runner.release(slot);
                }
            }
        }
        if batch.scheduled.is_empty() {
            stats.step_s = t_step.elapsed().as_secs_f64();
            self.steps.push(stats);
            return Ok(Vec::new());
        }

        // 2. Chunks.
        let plan = self.plan(batch)?;
        let n_spec = self.cfg.num_speculative_tokens;
        if let Some(p) = plan.iter().find(|p| p.num_draft > n_spec) {
            return Err(bad_batch(
                p.id,
                format!(
                    "{} drafts scheduled, num_speculative_tokens is {n_spec}",
                    p.num_draft
                ),
            ));
        }

        // 3. One batched target forward.
        let any_verify = plan.iter().any(|p| p.num_draft > 0);
        let opts = ForwardOptions {
            logits: if any_verify {
                LogitsRows::All
            } else {
                LogitsRows::LastPerChunk
            },
            collect_hidden: self.drafter.wants_layer_hidden(),
            collect_router: self.cfg.collect_router,
        };
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .map(|p| SeqChunk {
                slot: p.slot,
                tokens: &p.tokens,
                start_pos: p.start_pos,
                snapshot: p.num_draft > 0,
            })
            .collect();
        let t_fwd = Instant::now();
        let fwd = self.runner.forward_with(kv, &chunks, &opts)?;
        stats.forward_s = t_fwd.elapsed().as_secs_f64();
        let vocab = self.runner.config().vocab_size;
        let eos = self.runner.config().eos_token_id;
        let mml = usize::try_from(kv.max_model_len()).unwrap_or(usize::MAX);
        let total_rows = fwd.num_tokens;

        if let Some(router) = fwd.router.as_deref() {
            let decode_rows: Vec<bool> = {
                let mut v = vec![false; total_rows];
                for p in &plan {
                    if !p.is_prefill {
                        v[p.offset..p.offset + p.tokens.len()]
                            .iter_mut()
                            .for_each(|x| *x = true);
                    }
                }
                v
            };
            stats.batch_experts = Some(distinct_experts(router, total_rows, &|_| true));
            if decode_rows.iter().any(|&x| x) {
                stats.verify_experts =
                    Some(distinct_experts(router, total_rows, &|r| decode_rows[r]));
            }
        }

        // 4-5. Verify, commit, stop checks, then the drafter.
        let mut results = Vec::with_capacity(plan.len());
        let mut draft_s = 0.0f64;
        for (ci, p) in plan.iter().enumerate() {
            let n = p.tokens.len();
            if p.is_prefill {
                stats.prefill_tokens += n as u64;
            } else {
                stats.verify_tokens += n as u64;
            }
            let Self {
                runner,
                drafter,
                reqs,
                cfg,
                ..
            } = self;
            let st = reqs.get_mut(&p.id).ok_or(EngineError::UnknownRequest {
                req: p.id.to_string(),
            })?;
            let mut accepted = 0usize;
            let mut committed_rows = n;
            if p.sampling {
                let (logits, proposal) = if p.num_draft > 0 {
                    let probs = match st.drafts.probs.as_ref() {
                        Some(q) if q.len() >= p.num_draft => Some(q[..p.num_draft].to_vec()),
                        Some(q) => {
                            return Err(bad_batch(
                                p.id,
                                format!(
                                    "drafter gave {} q rows for {} drafts",
                                    q.len(),
                                    p.num_draft
                                ),
                            ));
                        }
                        None => None,
                    };
                    let prop = Proposal {
                        tokens: p.tokens[1..].to_vec(),
                        probs,
                    };
                    (&fwd.logits[p.offset * vocab..(p.offset + n) * vocab], prop)
                } else {
                    let row = if any_verify { p.offset + n - 1 } else { ci };
                    (
                        &fwd.logits[row * vocab..(row + 1) * vocab],
                        Proposal::default(),
                    )
                };
                let v =
                    VerifyCtx::new(cfg.sampling, &mut st.rng).verify(logits, vocab, &proposal)?;
                if p.num_draft > 0 {
                    runner.commit_state(kv, p.slot, v.accepted)?;
                    v.observe(&mut st.spec);
                    stats.num_drafts += 1;
                    stats.num_draft_tokens += p.num_draft as u64;
                    stats.num_accepted_tokens += v.accepted as u64;
                    committed_rows = v.accepted + 1;
                }
                accepted = v.accepted;
                // vLLM check_stop, token by token.
                let before = st.tokens.len();
                for &tok in &v.tokens {
                    if st.num_output() >= st.max_tokens || st.tokens.len() >= mml {
                        break;
                    }
                    st.tokens.push(tok);
                    if !cfg.ignore_eos && tok == eos {
                        st.finish = Some(FinishReason::Eos);
                        break;
                    }
                }
                if st.finish.is_none() {
                    if st.num_output() >= st.max_tokens {
                        st.finish = Some(FinishReason::Length);
                    } else if st.tokens.len() >= mml {
                        st.finish = Some(FinishReason::MaxModelLen);
                    }
                }
                let emitted = (st.tokens.len() - before) as u64;
                stats.output_tokens += emitted;
                if emitted > 0 && st.ttft.is_none() {
                    st.ttft = Some((step + 1, clock.elapsed().as_secs_f64()));
                }
            }
            st.drafts = Proposal::default();
            let mut next_drafts = 0u64;
            if st.finish.is_some() {
                st.e2e_s = Some(clock.elapsed().as_secs_f64());
                drafter.release(p.slot);
                runner.release(p.slot);
            } else {
                let max_draft = if p.sampling {
                    n_spec.min(mml.saturating_sub(st.tokens.len() + 1))
                } else {
                    0
                };
                let t_draft = Instant::now();
                let ReqState { tokens, rng, .. } = st;
                let mut ctx = ProposeCtx {
                    request: p.id,
                    slot: p.slot,
                    tokens,
                    max_draft,
                    sampling: cfg.sampling,
                    rng: Some(rng),
                    target: Some(TargetStep {
                        runner,
                        kv,
                        forward: &fwd,
                        rows: p.offset..p.offset + committed_rows,
                        start_pos: p.start_pos,
                    }),
                };
                let prop = drafter.propose(&mut ctx)?;
                draft_s += t_draft.elapsed().as_secs_f64();
                check_proposal(p.id, &prop, max_draft, vocab)?;
                next_drafts = prop.tokens.len() as u64;
                st.drafts = prop;
            }
            results.push(StepResult {
                id: p.id,
                accepted: accepted as u64,
                eos: st.finish == Some(FinishReason::Eos),
                next_drafts: Some(next_drafts),
            });
        }
        stats.draft_s = draft_s;
        stats.step_s = t_step.elapsed().as_secs_f64();
        self.steps.push(stats);
        Ok(results)
    }
}

/// A drafter's proposal must respect `max_draft`, the vocabulary and q's shape.
fn check_proposal(id: RequestId, p: &Proposal, max_draft: usize, vocab: usize) -> Result<()> {
    let bad = |reason: String| EngineError::InvalidDrafterConfig {
        drafter: format!("(request {id})"),
        reason,
    };
    if p.tokens.len() > max_draft {
        return Err(bad(format!(
            "proposed {} drafts, at most {max_draft} allowed this step",
            p.tokens.len()
        )));
    }
    if let Some(&t) = p.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(bad(format!(
            "draft token {t} is not below vocab_size {vocab}"
        )));
    }
    if let Some(q) = &p.probs {
        if q.len() != p.tokens.len() || q.iter().any(|r| r.len() != vocab) {
            return Err(bad(format!(
                "q must be [{} drafts][{vocab}]",
                p.tokens.len()
            )));
        }
    }
    Ok(())
}
