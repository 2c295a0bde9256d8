//! [`ModelExecutor`]: the real target (behind [`TargetBackend`]) + a drafter behind the
//! engine's [`Executor`] seam. It executes a `SchedulerOutput` and returns what it sampled
//! and what the drafter proposed; the scheduler owns every token and the stop rule.
//!
//! One step (see the module doc of [`crate::exec`] for the sources):
//! 1. requests finished since the last step (`finished_req_ids`) and requests preempted
//!    by this step's `schedule` forget their backend / drafter state (their KV was
//!    freed; a preempted request recomputes from position 0 later);
//! 2. every scheduled request becomes one [`SeqChunk`] built from the scheduler's tokens
//!    ([`crate::TokenView`]): a prefill chunk is `tokens[start_pos .. start_pos +
//!    num_tokens]`; a decode step with `k` drafts is `[last committed token,
//!    draft_tokens...]` (the ids the scheduler scheduled) with KDA snapshots;
//! 3. one batched target forward (logits of every row when some chunk verifies drafts,
//!    else only each chunk's last row; per-layer hidden states when the drafter wants
//!    them; router traces when asked);
//! 4. per sampling chunk (it reaches the end of the known tokens): verify the drafts
//!    against the `k + 1` rows (greedy, or rejection sampling with the drafter's q or
//!    one-hot q) and roll the KDA state back to the accepted prefix (`commit_state`);
//!    when sampling and the backend has a device sampler ([`TargetBackend::device_sampler`],
//!    vLLM samples on the GPU too), every chunk verifies there in one call, the logits never
//!    leaving the device, with the uniforms the request's RNG would give (drawn ahead from a
//!    clone; the RNG then advances by what was consumed): the same tokens and RNG streams;
//! 5. per request, the drafter observes the committed rows (`TargetStep`) and, after a
//!    sampling step, proposes up to `min(N, max_model_len - num_tokens - 1)` drafts from
//!    the committed tokens plus the ones just sampled (vLLM proposes right after
//!    sampling, before the stop rule; the scheduler drops the drafts of a request that
//!    stopped).
//!
//! Invariants: the executor holds no tokens (only per-request RNG, the drafter's q, and
//! the backend's / drafter's state by slot); it returns one `StepResult` per scheduled
//! request with `sampled = accepted + 1` tokens after a sampling step; a scheduled
//! decode step verifies exactly the draft ids the scheduler handed it.

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::backend::{SampleReq, TargetBackend};
use crate::kv::KvCacheManager;
use crate::model::{ForwardOptions, ForwardOut, LogitsRows, SeqChunk};
use crate::request::ReqSlot;
use crate::spec::sampling::uniform;
use crate::spec::{
    max_uniforms, seeded_rng, DraftProbs, SamplingParams, SpecRng, Verified, VerifyCtx,
};
use crate::traits::{
    DraftReq, DraftStep, Drafter, Executor, LayerHidden, Proposal, RequestId, ScheduledRequest,
    StepCtx, StepOutput, StepPerf, StepResult,
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
    /// Record the distinct experts each step's forward routed to (`ForwardOptions::collect_router`).
    pub collect_router: bool,
}

impl Default for ExecConfig {
    fn default() -> Self {
        Self {
            num_speculative_tokens: 0,
            sampling: SamplingParams::GREEDY,
            seed: 0,
            collect_router: false,
        }
    }
}

/// Per-request model state: the executor's only per-request memory (tokens are the
/// scheduler's).
struct ReqModel {
    slot: ReqSlot,
    /// Seeded from (run seed, request id) on first sight; survives preemption.
    rng: SpecRng,
    /// The drafter's q for the drafts it last proposed (rejection sampling): num_draft
    /// rows, dense or sparse.
    q: Option<DraftProbs>,
}

/// A chunk of the batch, planned.
struct Planned {
    id: RequestId,
    slot: ReqSlot,
    start_pos: usize,
    /// The chunk's input tokens (prefill slice, or `[last, d_1 .. d_k]`). Shape: [T].
    tokens: Vec<u32>,
    num_draft: usize,
    /// The chunk reaches the end of the known tokens: it samples.
    sampling: bool,
    is_prefill: bool,
    /// First row of the chunk in the batch.
    offset: usize,
}

/// A sampling chunk's inputs to the device sampler: (chunk index, first logits row, the
/// drafter's q rows, the uniforms drawn ahead).
type DeviceAsk = (usize, usize, Option<DraftProbs>, Vec<f64>);

/// What verification of one sampling chunk produced.
struct Sampled {
    /// `accepted + 1` tokens. Shape: [accepted + 1].
    tokens: Vec<u32>,
    accepted: usize,
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
    backend: Box<dyn TargetBackend>,
    drafter: Box<dyn Drafter>,
    cfg: ExecConfig,
    vocab: usize,
    reqs: HashMap<RequestId, ReqModel>,
    /// Sampling (not greedy) steps verify through the backend's device sampler.
    device_sampling: bool,
}

impl std::fmt::Debug for ModelExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelExecutor")
            .field("cfg", &self.cfg)
            .field("live_requests", &self.reqs.len())
            .finish_non_exhaustive()
    }
}

/// Check one scheduled request against the tokens the scheduler holds and build its
/// chunk's input tokens (one place for every batch check).
fn chunk_tokens(s: &ScheduledRequest, held: &[u32], n_spec: usize) -> Result<Vec<u32>> {
    let len = held.len();
    let (start, n, k) = (
        s.start_pos as usize,
        s.num_tokens as usize,
        s.num_draft as usize,
    );
    if n == 0 {
        return Err(bad_batch(s.id, "scheduled with 0 tokens".into()));
    }
    if k > n_spec {
        return Err(bad_batch(
            s.id,
            format!("{k} drafts scheduled, num_speculative_tokens is {n_spec}"),
        ));
    }
    if k == 0 {
        return held
            .get(start..start + n)
            .map(<[u32]>::to_vec)
            .ok_or_else(|| {
                bad_batch(
                    s.id,
                    format!(
                        "chunk {start}..{} runs past the {len} tokens the request holds",
                        start + n
                    ),
                )
            });
    }
    if start + 1 != len || n != k + 1 || s.draft_tokens.len() != k {
        return Err(bad_batch(
            s.id,
            format!(
                "decode step at position {start} with {n} tokens and {k} drafts, but the request holds {len} tokens and {} draft ids were scheduled",
                s.draft_tokens.len()
            ),
        ));
    }
    let mut t = Vec::with_capacity(n);
    t.push(held[len - 1]);
    t.extend_from_slice(&s.draft_tokens);
    Ok(t)
}

impl ModelExecutor {
    /// An executor over `backend` (built for the run's KV manager) and `drafter`.
    pub fn new(
        mut backend: Box<dyn TargetBackend>,
        drafter: Box<dyn Drafter>,
        cfg: ExecConfig,
    ) -> Result<Self> {
        cfg.sampling.validate()?;
        let vocab = backend.head_dims().1;
        let device_sampling = !cfg.sampling.is_greedy() && backend.device_sampler().is_some();
        Ok(Self {
            backend,
            drafter,
            cfg,
            vocab,
            reqs: HashMap::new(),
            device_sampling,
        })
    }

    /// The config.
    pub fn config(&self) -> &ExecConfig {
        &self.cfg
    }

    fn forget(&mut self, slot: ReqSlot) {
        self.drafter.release(slot);
        self.backend.release(slot);
    }

    /// Requests that finished or were preempted lose their model state (their KV was
    /// freed by the scheduler; a preempted request recomputes from position 0).
    fn forget_gone(&mut self, ctx: &StepCtx<'_>) {
        for id in &ctx.batch.finished_req_ids {
            if let Some(st) = self.reqs.remove(id) {
                self.forget(st.slot);
            }
        }
        for id in &ctx.batch.preempted {
            if let Some(slot) = self.reqs.get_mut(id).map(|st| {
                st.q = None;
                st.slot
            }) {
                self.forget(slot);
            }
        }
    }

    /// Turn the scheduler's batch into chunks.
    fn plan(&mut self, ctx: &StepCtx<'_>) -> Result<Vec<Planned>> {
        let mut plan = Vec::with_capacity(ctx.batch.scheduled.len());
        let mut offset = 0usize;
        for s in &ctx.batch.scheduled {
            let held = ctx
                .tokens
                .token_ids(s.id)
                .ok_or_else(|| EngineError::UnknownRequest {
                    req: s.id.to_string(),
                })?;
            let tokens = chunk_tokens(s, held, self.cfg.num_speculative_tokens)?;
            let seed = self.cfg.seed;
            let st = self.reqs.entry(s.id).or_insert_with(|| ReqModel {
                slot: s.slot,
                rng: seeded_rng(mix(seed, s.id)),
                q: None,
            });
            if st.slot != s.slot {
                return Err(bad_batch(
                    s.id,
                    format!(
                        "scheduled in slot {} but it lives in slot {}",
                        s.slot.0, st.slot.0
                    ),
                ));
            }
            let (start, n, k) = (s.start_pos as usize, tokens.len(), s.num_draft as usize);
            if start == 0 {
                // A fresh start (first chunk, or the recompute after a preemption).
                self.forget(s.slot);
            }
            plan.push(Planned {
                id: s.id,
                slot: s.slot,
                start_pos: start,
                sampling: start + n - k == held.len(),
                tokens,
                num_draft: k,
                is_prefill: s.is_prefill,
                offset,
            });
            offset += n;
        }
        Ok(plan)
    }

    /// One batched target forward over the planned chunks.
    fn forward(&mut self, kv: &KvCacheManager, plan: &[Planned]) -> Result<ForwardOut> {
        let any_verify = plan.iter().any(|p| p.num_draft > 0);
        let hidden = self.drafter.layer_hidden();
        let opts = ForwardOptions {
            logits: if any_verify {
                LogitsRows::All
            } else {
                LogitsRows::LastPerChunk
            },
            collect_hidden: matches!(hidden, LayerHidden::Host | LayerHidden::Device),
            hidden_on_device: hidden == LayerHidden::Device,
            collect_router: self.cfg.collect_router,
            greedy_ids: self.cfg.sampling.is_greedy(),
            // A device drafter reads the target on the device: no host copy of the hidden.
            skip_hidden: self.cfg.num_speculative_tokens == 0
                || matches!(hidden, LayerHidden::Device | LayerHidden::FinalOnDevice),
            logits_on_device: self.device_sampling,
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
        self.backend.forward(kv, &chunks, &opts)
    }

    /// Verify one sampling chunk (greedy, or rejection sampling with the drafter's q or
    /// one-hot q) and roll the KDA state back to the accepted prefix.
    fn verify(
        &mut self,
        kv: &KvCacheManager,
        p: &Planned,
        fwd: &ForwardOut,
        chunk_index: usize,
    ) -> Result<Sampled> {
        let vocab = self.vocab;
        let n = p.tokens.len();
        let st = self
            .reqs
            .get_mut(&p.id)
            .ok_or_else(|| EngineError::UnknownRequest {
                req: p.id.to_string(),
            })?;
        let all_rows = match &fwd.argmax {
            Some(ids) => ids.len() == fwd.num_tokens,
            None => fwd.logits.len() == fwd.num_tokens * vocab,
        };
        let row = logits_row(p, chunk_index, all_rows);
        let rows = if p.num_draft > 0 { n } else { 1 };
        let q = st.q.take();
        if let (Some(ids), true) = (&fwd.argmax, self.cfg.sampling.is_greedy()) {
            let ids = ids.get(row..row + rows).ok_or_else(|| {
                bad_batch(p.id, "the forward returned too few argmax rows".into())
            })?;
            let v = crate::spec::verify_greedy_ids(ids, &p.tokens[1..rows.max(1)])?;
            return self.finish_verify(kv, p, v);
        }
        let logits = fwd
            .logits
            .get(row * vocab..(row + rows) * vocab)
            .ok_or_else(|| bad_batch(p.id, "the forward returned too few logits rows".into()))?;
        let proposal = Proposal {
            tokens: p.tokens[1..=p.num_draft].to_vec(),
            probs: draft_q(p, q)?,
        };
        let v = VerifyCtx::new(self.cfg.sampling, &mut st.rng).verify(logits, vocab, &proposal)?;
        self.finish_verify(kv, p, v)
    }

    /// Step 4 on the backend's device sampler: every sampling chunk in one call, each
    /// request's uniforms drawn ahead from a clone of its RNG (`max_uniforms` of its
    /// drafts), which then advances by exactly the draws the verification consumed, so
    /// tokens and RNG streams are those of [`Self::verify`] on the same logits. One
    /// entry per planned chunk (`None` for chunks that do not sample).
    fn sample_on_device(&mut self, plan: &[Planned]) -> Result<Vec<Option<Verified>>> {
        let any_verify = plan.iter().any(|p| p.num_draft > 0);
        let mut asks: Vec<DeviceAsk> = Vec::new();
        for (ci, p) in plan.iter().enumerate().filter(|(_, p)| p.sampling) {
            let st = self
                .reqs
                .get_mut(&p.id)
                .ok_or_else(|| EngineError::UnknownRequest {
                    req: p.id.to_string(),
                })?;
            let q = draft_q(p, st.q.take())?;
            // The forward returned every row exactly when some chunk verifies drafts.
            let row = logits_row(p, ci, any_verify);
            let mut ahead = st.rng.clone();
            let us = (0..max_uniforms(p.num_draft))
                .map(|_| uniform(&mut ahead))
                .collect();
            asks.push((ci, row, q, us));
        }
        let reqs: Vec<SampleReq<'_>> = asks
            .iter()
            .map(|(ci, row, q, us)| SampleReq {
                row: *row,
                drafts: &plan[*ci].tokens[1..=plan[*ci].num_draft],
                q: q.as_ref(),
                uniforms: us,
            })
            .collect();
        let params = self.cfg.sampling;
        let sampler = self
            .backend
            .device_sampler()
            .ok_or_else(|| EngineError::Unsupported("the backend has no device sampler".into()))?;
        let outs = sampler.sample(&params, &reqs)?;
        if outs.len() != asks.len() {
            return Err(EngineError::Unsupported(format!(
                "the device sampler answered {} of {} chunks",
                outs.len(),
                asks.len()
            )));
        }
        let mut verdicts = vec![None; plan.len()];
        for ((ci, ..), out) in asks.iter().zip(outs) {
            if let Some(st) = self.reqs.get_mut(&plan[*ci].id) {
                for _ in 0..out.consumed {
                    uniform(&mut st.rng);
                }
            }
            verdicts[*ci] = Some(out.verified);
        }
        Ok(verdicts)
    }

    /// Roll the KDA state back to the accepted prefix of a verified chunk.
    fn finish_verify(&mut self, kv: &KvCacheManager, p: &Planned, v: Verified) -> Result<Sampled> {
        if p.num_draft > 0 {
            self.backend.commit_state(kv, p.slot, v.accepted)?;
        }
        Ok(Sampled {
            tokens: v.tokens,
            accepted: v.accepted,
        })
    }

    /// The drafter observes every request's committed rows and, after a sampling step,
    /// proposes up to `min(N, max_model_len - num_tokens - 1)` drafts per request; one
    /// [`Drafter::propose_batch`] call for the whole step.
    fn propose_all(
        &mut self,
        ctx: &StepCtx<'_>,
        plan: &[Planned],
        fwd: &ForwardOut,
        sampled: &[Option<Sampled>],
    ) -> Result<Vec<Proposal>> {
        if self.cfg.num_speculative_tokens == 0 {
            // No drafts can be asked for (`max_draft` would be 0 for every request), and a
            // run without speculation has no drafter to observe the rows: skip building
            // every request's token list (31-55 us a step at c = 128 on the H200 host,
            // runs/bench-e2e-h200.json `draft_us_per_step` of the none rows).
            return Ok(vec![Proposal::default(); plan.len()]);
        }
        let mml = usize::try_from(ctx.kv.max_model_len()).unwrap_or(usize::MAX);
        let mut toks = Vec::with_capacity(plan.len());
        let mut spans = Vec::with_capacity(plan.len());
        for (p, s) in plan.iter().zip(sampled) {
            let mut tokens = ctx.tokens.token_ids(p.id).unwrap_or(&[]).to_vec();
            let span = match s {
                Some(s) => {
                    tokens.extend_from_slice(&s.tokens);
                    let rows = if p.num_draft > 0 {
                        s.accepted + 1
                    } else {
                        p.tokens.len()
                    };
                    let max = self
                        .cfg
                        .num_speculative_tokens
                        .min(mml.saturating_sub(tokens.len() + 1));
                    (rows, max)
                }
                None => (p.tokens.len(), 0),
            };
            toks.push(tokens);
            spans.push(span);
        }
        let mut rngs: HashMap<RequestId, &mut SpecRng> = self
            .reqs
            .iter_mut()
            .map(|(id, st)| (*id, &mut st.rng))
            .collect();
        let mut reqs = Vec::with_capacity(plan.len());
        for ((p, tokens), &(rows, max_draft)) in plan.iter().zip(&toks).zip(&spans) {
            let rng = rngs
                .remove(&p.id)
                .ok_or_else(|| EngineError::UnknownRequest {
                    req: p.id.to_string(),
                })?;
            reqs.push(DraftReq {
                request: p.id,
                slot: p.slot,
                tokens,
                max_draft,
                rng: Some(rng as &mut dyn rand::RngCore),
                rows: p.offset..p.offset + rows,
                start_pos: p.start_pos,
            });
        }
        let mut step = DraftStep {
            backend: self.backend.as_mut(),
            kv: ctx.kv,
            forward: fwd,
            sampling: self.cfg.sampling,
        };
        let props = self.drafter.propose_batch(&mut step, &mut reqs)?;
        if props.len() != plan.len() {
            return Err(EngineError::InvalidDrafterConfig {
                drafter: "(batch)".into(),
                reason: format!("{} proposals for {} requests", props.len(), plan.len()),
            });
        }
        for ((p, prop), &(_, max_draft)) in plan.iter().zip(&props).zip(&spans) {
            check_proposal(p.id, prop, max_draft, self.vocab)?;
        }
        Ok(props)
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

/// Experts touched by the decode rows and by the whole batch (when routing was collected).
fn expert_counts(fwd: &ForwardOut, plan: &[Planned], perf: &mut StepPerf) {
    let Some(router) = fwd.router.as_deref() else {
        return;
    };
    let total = fwd.num_tokens;
    let mut decode_rows = vec![false; total];
    for p in plan.iter().filter(|p| !p.is_prefill) {
        decode_rows[p.offset..p.offset + p.tokens.len()].fill(true);
    }
    perf.batch_experts = Some(distinct_experts(router, total, &|_| true));
    if decode_rows.iter().any(|&x| x) {
        perf.verify_experts = Some(distinct_experts(router, total, &|r| decode_rows[r]));
    }
}

impl Executor for ModelExecutor {
    fn execute(&mut self, ctx: &StepCtx<'_>) -> Result<StepOutput> {
        self.forget_gone(ctx);
        if ctx.batch.scheduled.is_empty() {
            return Ok(StepOutput::default());
        }
        let plan = self.plan(ctx)?;
        let t_fwd = Instant::now();
        let fwd = self.forward(ctx.kv, &plan)?;
        let mut perf = StepPerf {
            forward_s: t_fwd.elapsed().as_secs_f64(),
            ..StepPerf::default()
        };
        expert_counts(&fwd, &plan, &mut perf);
        let mut device = if self.device_sampling {
            self.sample_on_device(&plan)?
        } else {
            Vec::new()
        };
        let mut sampled = Vec::with_capacity(plan.len());
        for (ci, p) in plan.iter().enumerate() {
            sampled.push(match device.get_mut(ci).and_then(Option::take) {
                Some(v) => Some(self.finish_verify(ctx.kv, p, v)?),
                None if p.sampling => Some(self.verify(ctx.kv, p, &fwd, ci)?),
                None => None,
            });
        }
        let t_draft = Instant::now();
        let props = self.propose_all(ctx, &plan, &fwd, &sampled)?;
        perf.draft_s = t_draft.elapsed().as_secs_f64();
        let mut results = Vec::with_capacity(plan.len());
        for ((p, s), prop) in plan.iter().zip(sampled).zip(props) {
            if let Some(st) = self.reqs.get_mut(&p.id) {
                st.q = prop.probs;
            }
            let (sampled, accepted) = s.map_or((Vec::new(), 0), |s| (s.tokens, s.accepted));
            results.push(StepResult {
                id: p.id,
                accepted: accepted as u64,
                sampled,
                drafts: Some(prop.tokens),
            });
        }
        Ok(StepOutput { results, perf })
    }
}

/// The first logits row chunk `p` (the `chunk_index`-th) samples from: its first row when
/// it verifies drafts, else its last row, which is row `chunk_index` when the forward
/// returned only each chunk's last row (`all_rows` false).
fn logits_row(p: &Planned, chunk_index: usize, all_rows: bool) -> usize {
    match (p.num_draft > 0, all_rows) {
        (true, _) => p.offset,
        (false, true) => p.offset + p.tokens.len() - 1,
        (false, false) => chunk_index,
    }
}

/// The drafter's q for chunk `p`'s drafts (the rows it gave when it proposed them), or
/// `None` for one-hot q (no q, or a chunk without drafts); too few rows is an error.
fn draft_q(p: &Planned, q: Option<DraftProbs>) -> Result<Option<DraftProbs>> {
    match (q, p.num_draft) {
        (_, 0) | (None, _) => Ok(None),
        (Some(mut q), k) if q.rows() >= k => {
            q.truncate(k);
            Ok(Some(q))
        }
        (Some(q), k) => Err(bad_batch(
            p.id,
            format!("drafter gave {} q rows for {k} drafts", q.rows()),
        )),
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
        if !q.shape_matches(p.tokens.len(), vocab) {
            return Err(bad(format!(
                "q must be [{} drafts][{vocab}] dense, or {} rows of k > 0 (id, p) pairs",
                p.tokens.len(),
                p.tokens.len()
            )));
        }
    }
    Ok(())
}
