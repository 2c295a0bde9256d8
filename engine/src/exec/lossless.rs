//! The lossless check: greedy speculative decoding must reproduce greedy decoding.
//!
//! [`verify_lossless`] runs the same requests twice through [`generate`]: once without a
//! drafter (the reference: plain greedy decoding, `N = 0`) and once with the drafter, and
//! compares the outputs token for token. For the first diverging index of each request it
//! re-runs the target teacher-forced on `prompt + reference[..index]` (one prefill, no
//! drafter) and reports the target's top-2 logits there: a margin (top1 - top2) near 0
//! says both tokens are near-ties and the runs drifted numerically (a verify pass
//! batches `1 + k` rows where plain decoding runs one, and GEMM row grouping changes the
//! last bits); a large margin says a logic bug (wrong KV, wrong state rollback, wrong
//! token bookkeeping).
//!
//! Invariant: only greedy sampling can be checked token for token (temperature > 0 is
//! lossless in distribution only); `verify_lossless` refuses it.

use serde::{Deserialize, Serialize};

use crate::exec::run::{
    check_token_ids, generate_on, DrafterFactory, EngineOptions, EngineRequest, EngineRun,
    NoDrafterFactory, SchedulerFactory,
};
use crate::kv::{AllocOutcome, KvCacheManager};
use crate::model::{ForwardOptions, LogitsRows, ModelRunner, ModelWeights, SeqChunk};
use crate::request::ReqSlot;
use crate::traits::RequestId;
use crate::{EngineError, Result};

/// The first index where `a` and `b` differ (the shorter length when one is a proper
/// prefix of the other); `None` when equal.
pub fn first_divergence(a: &[u32], b: &[u32]) -> Option<usize> {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => Some(i),
        None if a.len() != b.len() => Some(a.len().min(b.len())),
        None => None,
    }
}

/// One request whose outputs differ.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mismatch {
    pub request: RequestId,
    /// First diverging output index.
    pub index: usize,
    /// The reference's (no drafter) token there; `None` if its output ended first.
    pub reference_token: Option<u32>,
    /// The drafter run's token there; `None` if its output ended first.
    pub candidate_token: Option<u32>,
    /// The target's argmax and runner-up at that position, teacher-forced on
    /// `prompt + reference[..index]`.
    pub top1_token: u32,
    pub top1_logit: f32,
    pub top2_token: u32,
    pub top2_logit: f32,
    /// `top1_logit - top2_logit`: ~0 = numeric drift at a near tie; large = a logic bug.
    pub margin: f32,
    /// Logits of the two diverging tokens there.
    pub reference_logit: Option<f32>,
    pub candidate_logit: Option<f32>,
}

/// Result of [`verify_lossless`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LosslessReport {
    pub num_requests: usize,
    /// Output tokens of the reference run.
    pub num_tokens_compared: u64,
    /// Requests whose outputs differ, in request order.
    pub mismatches: Vec<Mismatch>,
    /// The run without a drafter.
    pub reference: EngineRun,
    /// The run with the drafter.
    pub candidate: EngineRun,
}

impl LosslessReport {
    /// Every output matched token for token.
    pub fn is_lossless(&self) -> bool {
        self.mismatches.is_empty()
    }
    /// Every mismatch sits at a near tie (`margin <= tol`): numeric drift, not a logic bug.
    pub fn only_near_ties(&self, tol: f32) -> bool {
        self.mismatches.iter().all(|m| m.margin <= tol)
    }
}

/// The target's last-row logits after a teacher-forced prefill of `context`.
pub fn teacher_forced_logits(target: &ModelWeights, context: &[u32]) -> Result<Vec<f32>> {
    let bs = 16u32;
    let mml = target.cfg.max_position_embeddings as u64;
    if context.is_empty() || context.len() as u64 > mml {
        return Err(EngineError::ModelInput(format!(
            "teacher-forced context of {} tokens (needs 1..={mml})",
            context.len()
        )));
    }
    let blocks = u32::try_from(context.len().div_ceil(bs as usize) + 4).unwrap_or(u32::MAX);
    let layout = target.cfg.kv_layout(bs, 0, blocks)?;
    let mut kv = KvCacheManager::new(&layout, blocks)?;
    let n = context.len() as u64;
    if let AllocOutcome::NoFit = kv.allocate_whole(ReqSlot(0), n)? {
        return Err(EngineError::InsufficientKvMemory(format!(
            "teacher-forced pass of {n} tokens does not fit {blocks} blocks"
        )));
    }
    let mut runner = ModelRunner::new(target.clone(), &kv)?;
    let opts = ForwardOptions {
        logits: LogitsRows::LastPerChunk,
        ..ForwardOptions::default()
    };
    let out = runner.forward_with(
        &kv,
        &[SeqChunk {
            slot: ReqSlot(0),
            tokens: context,
            start_pos: 0,
            snapshot: false,
        }],
        &opts,
    )?;
    Ok(out.logits)
}

/// Top-2 (index, value), ties to the lower index.
fn top2(row: &[f32]) -> ((usize, f32), (usize, f32)) {
    let mut a = (0usize, f32::NEG_INFINITY);
    let mut b = (0usize, f32::NEG_INFINITY);
    for (i, &x) in row.iter().enumerate() {
        if x > a.1 {
            b = a;
            a = (i, x);
        } else if x > b.1 {
            b = (i, x);
        }
    }
    (a, b)
}

/// Build the [`Mismatch`] of request `r` at `index` (teacher-forced margin).
pub fn mismatch_at(
    target: &ModelWeights,
    r: &EngineRequest,
    reference: &[u32],
    candidate: &[u32],
    index: usize,
) -> Result<Mismatch> {
    let mut ctx = r.prompt.clone();
    ctx.extend_from_slice(&reference[..index.min(reference.len())]);
    let logits = teacher_forced_logits(target, &ctx)?;
    let ((t1, l1), (t2, l2)) = top2(&logits);
    let rt = reference.get(index).copied();
    let ct = candidate.get(index).copied();
    let at = |t: Option<u32>| t.and_then(|t| logits.get(t as usize).copied());
    Ok(Mismatch {
        request: r.id,
        index,
        reference_token: rt,
        candidate_token: ct,
        top1_token: t1 as u32,
        top1_logit: l1,
        top2_token: t2 as u32,
        top2_logit: l2,
        margin: l1 - l2,
        reference_logit: at(rt),
        candidate_logit: at(ct),
    })
}

/// Run `requests` greedily without a drafter and with `drafter` (same options, same
/// scheduler factory) and compare the outputs token for token (module doc).
pub fn verify_lossless(
    target: &ModelWeights,
    drafter: &dyn DrafterFactory,
    requests: &[EngineRequest],
    opts: &EngineOptions,
    make_scheduler: &mut SchedulerFactory<'_>,
) -> Result<LosslessReport> {
    verify_lossless_on(
        &crate::backend::CpuBackend,
        target,
        drafter,
        requests,
        opts,
        make_scheduler,
    )
}

/// [`verify_lossless`] with both runs' target on `backend` (e.g. the CUDA engine); the
/// diagnosis of a mismatch (the target's teacher-forced logit margin) stays on the CPU
/// reference.
pub fn verify_lossless_on(
    backend: &dyn crate::backend::BackendFactory,
    target: &ModelWeights,
    drafter: &dyn DrafterFactory,
    requests: &[EngineRequest],
    opts: &EngineOptions,
    make_scheduler: &mut SchedulerFactory<'_>,
) -> Result<LosslessReport> {
    if !opts.sampling.is_greedy() {
        return Err(EngineError::InvalidSamplingParams {
            field: "temperature".into(),
            reason: format!(
                "the lossless check compares greedy outputs token for token; temperature {} is lossless only in distribution",
                opts.sampling.temperature
            ),
        });
    }
    check_token_ids(&target.cfg, requests)?;
    let reference = generate_on(
        backend,
        target,
        &NoDrafterFactory,
        requests,
        opts,
        make_scheduler,
    )?;
    let candidate = generate_on(backend, target, drafter, requests, opts, make_scheduler)?;
    for (name, run) in [
        ("reference (no drafter)", &reference),
        ("drafter", &candidate),
    ] {
        if !run.complete() {
            let why = run
                .wedged
                .clone()
                .or_else(|| run.rejected.first().cloned())
                .unwrap_or_else(|| format!("hit the step limit of {} steps", opts.max_steps));
            return Err(EngineError::Unsupported(format!(
                "lossless check: the {name} run did not finish every request: {why}"
            )));
        }
    }
    let mut mismatches = Vec::new();
    let mut compared = 0u64;
    for r in requests {
        let a = reference.output(r.id).unwrap_or(&[]);
        let b = candidate.output(r.id).unwrap_or(&[]);
        compared += a.len() as u64;
        if let Some(i) = first_divergence(a, b) {
            mismatches.push(mismatch_at(target, r, a, b, i)?);
        }
    }
    Ok(LosslessReport {
        num_requests: requests.len(),
        num_tokens_compared: compared,
        mismatches,
        reference,
        candidate,
    })
}
