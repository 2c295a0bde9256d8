//! Shared helpers of the `engine_*` integration tests: the FCFS scheduler factory, the
//! micro target and drafters (random weights, seeded), and run-level checks.
#![allow(dead_code)]

use speclab_drafters::{DFlash2Config, DFlash2Weights, DraftMode, DrafterSpec};
use speclab_engine::exec::{EngineRequest, EngineRun, SchedulerParams};
use speclab_engine::kv::{CapPolicy, KvCacheManager};
use speclab_engine::model::{ModelConfig, ModelWeights};
use speclab_engine::Scheduler;

/// A FCFS scheduler factory with the given step budget and batch size.
pub fn fcfs(
    max_num_batched_tokens: u64,
    max_num_seqs: usize,
) -> impl FnMut(
    &KvCacheManager,
    &SchedulerParams,
    &[EngineRequest],
) -> speclab_engine::Result<Box<dyn Scheduler>> {
    speclab_schedulers::fcfs_factory(max_num_seqs, max_num_batched_tokens)
}

/// The micro target with random weights.
pub fn micro_target(seed: u64) -> ModelWeights {
    ModelWeights::random(&ModelConfig::micro(), seed, false).unwrap()
}

/// A random micro DFlash2 drafter for the micro target.
pub fn micro_dflash(seed: u64) -> DFlash2Weights {
    DFlash2Weights::random(&DFlash2Config::preset("dflash2-micro").unwrap(), seed).unwrap()
}

/// Every drafter kind for `target` with `n` drafts (DFlash: random micro weights, group
/// block 8, cap `cap`).
pub fn all_drafters(
    target: &ModelWeights,
    n: usize,
    dflash_seed: u64,
    cap: CapPolicy,
) -> Vec<(&'static str, DrafterSpec)> {
    let cfg = &target.cfg;
    let w = micro_dflash(dflash_seed);
    let nd = n.min(w.cfg.block_size - 1);
    vec![
        ("none", DrafterSpec::none()),
        ("ngram", DrafterSpec::ngram(n, 1, 3).unwrap()),
        ("mtp", DrafterSpec::mtp(cfg, n).unwrap()),
        (
            "dflash1",
            DrafterSpec::dflash(w.clone(), cfg, nd, DraftMode::V1, 8, cap).unwrap(),
        ),
        (
            "dflash2",
            DrafterSpec::dflash(w, cfg, nd, DraftMode::V2, 8, cap).unwrap(),
        ),
    ]
}

/// Random prompts over the non-special vocabulary.
pub fn prompts(seed: u64, lens: &[usize], vocab: usize) -> Vec<Vec<u32>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    lens.iter()
        .map(|&l| {
            (0..l)
                .map(|_| rng.random_range(0..(vocab - 8) as u32))
                .collect()
        })
        .collect()
}

/// The allocator invariants of a finished run.
pub fn assert_allocator_clean(run: &EngineRun, label: &str) {
    assert!(
        run.allocator_violation.is_none(),
        "{label}: {:?}",
        run.allocator_violation
    );
    assert_eq!(
        run.kv_free_blocks_end, run.kv_usable_blocks,
        "{label}: every block returned"
    );
    assert_eq!(
        run.kv_held_blocks_end, 0,
        "{label}: no request holds blocks"
    );
}

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use speclab_engine::exec::DrafterFactory;
use speclab_engine::kv::GroupSpec;
use speclab_engine::spec::{DraftProbs, SparseProbs};
use speclab_engine::{DraftReq, DraftStep, Drafter, Proposal, ProposeCtx, ReqSlot, RequestId};

/// One recorded proposal: (request, committed tokens when proposing, drafts).
pub type Record = (RequestId, Vec<u32>, Vec<u32>);

/// Wraps a factory; the drafters it builds record every non-empty proposal.
pub struct Recording<'a> {
    pub inner: &'a dyn DrafterFactory,
    pub log: Rc<RefCell<Vec<Record>>>,
}

struct RecordingDrafter {
    inner: Box<dyn Drafter>,
    log: Rc<RefCell<Vec<Record>>>,
}

impl Drafter for RecordingDrafter {
    fn propose(&mut self, ctx: &mut ProposeCtx<'_>) -> speclab_engine::Result<Proposal> {
        let p = self.inner.propose(ctx)?;
        if ctx.max_draft > 0 {
            self.log
                .borrow_mut()
                .push((ctx.request, ctx.tokens.to_vec(), p.tokens.clone()));
        }
        Ok(p)
    }
    fn lookahead_slots(&self) -> usize {
        self.inner.lookahead_slots()
    }
    fn layer_hidden(&self) -> speclab_engine::LayerHidden {
        self.inner.layer_hidden()
    }
    fn release(&mut self, slot: ReqSlot) {
        self.inner.release(slot)
    }
    /// Delegates the batch (so a batching drafter's batched path is what is recorded).
    fn propose_batch(
        &mut self,
        step: &mut DraftStep<'_>,
        reqs: &mut [DraftReq<'_>],
    ) -> speclab_engine::Result<Vec<Proposal>> {
        let props = self.inner.propose_batch(step, reqs)?;
        let mut log = self.log.borrow_mut();
        for (r, p) in reqs.iter().zip(&props) {
            if r.max_draft > 0 {
                log.push((r.request, r.tokens.to_vec(), p.tokens.clone()));
            }
        }
        Ok(props)
    }
}

impl DrafterFactory for Recording<'_> {
    fn num_speculative_tokens(&self) -> usize {
        self.inner.num_speculative_tokens()
    }
    fn kv_groups(&self) -> speclab_engine::Result<Vec<GroupSpec>> {
        self.inner.kv_groups()
    }
    fn build(
        &self,
        target: &ModelConfig,
        kv: &KvCacheManager,
    ) -> speclab_engine::Result<Box<dyn Drafter>> {
        Ok(Box::new(RecordingDrafter {
            inner: self.inner.build(target, kv)?,
            log: self.log.clone(),
        }))
    }
}

/// An oracle drafter: proposes the reference continuation of each request, replacing the
/// draft at output index `i` by `(t + 1) % 500` whenever `corrupt(request, i)`; sends
/// q when `with_q`: half on the draft, for even request ids the rest spread over the
/// vocabulary (dense rows), for odd ones over the 3 tokens after it (sparse rows).
#[derive(Clone)]
pub struct Oracle {
    pub n: usize,
    /// request -> (prompt length, reference output).
    pub reference: HashMap<RequestId, (usize, Vec<u32>)>,
    pub corrupt_every: usize,
    pub with_q: bool,
    pub vocab: usize,
}

impl Oracle {
    /// Is output index `i` of `request` corrupted?
    pub fn corrupted(&self, request: RequestId, i: usize) -> bool {
        self.corrupt_every > 0
            && (i + request as usize) % self.corrupt_every == self.corrupt_every - 1
    }
}

impl Drafter for Oracle {
    fn propose(&mut self, ctx: &mut ProposeCtx<'_>) -> speclab_engine::Result<Proposal> {
        let Some((plen, out)) = self.reference.get(&ctx.request) else {
            return Ok(Proposal::default());
        };
        let done = ctx.tokens.len() - plen;
        let k = self.n.min(ctx.max_draft);
        let tokens: Vec<u32> = out
            .iter()
            .enumerate()
            .skip(done)
            .take(k)
            .map(|(i, &t)| {
                if self.corrupted(ctx.request, i) {
                    (t + 1) % 500
                } else {
                    t
                }
            })
            .collect();
        let v = self.vocab;
        let probs = match (self.with_q, ctx.request % 2) {
            (false, _) => None,
            (true, 0) => Some(DraftProbs::Dense(
                tokens
                    .iter()
                    .map(|&t| {
                        let mut q = vec![0.5 / (v - 1) as f32; v];
                        q[t as usize] = 0.5;
                        q
                    })
                    .collect(),
            )),
            (true, _) => Some(DraftProbs::Sparse(SparseProbs {
                k: 4,
                ids: tokens
                    .iter()
                    .flat_map(|&t| (0..4).map(move |d| (t + d) % v as u32))
                    .collect(),
                p: tokens
                    .iter()
                    .flat_map(|_| [0.5, 0.5 / 3.0, 0.5 / 3.0, 0.5 / 3.0])
                    .collect(),
            })),
        };
        Ok(Proposal { tokens, probs })
    }
    fn lookahead_slots(&self) -> usize {
        0
    }
}

impl DrafterFactory for Oracle {
    fn num_speculative_tokens(&self) -> usize {
        self.n
    }
    fn kv_groups(&self) -> speclab_engine::Result<Vec<GroupSpec>> {
        Ok(Vec::new())
    }
    fn build(
        &self,
        _target: &ModelConfig,
        _kv: &KvCacheManager,
    ) -> speclab_engine::Result<Box<dyn Drafter>> {
        Ok(Box::new(self.clone()))
    }
}

/// Requests from prompts (ids 0..).
pub fn requests(prompts: &[Vec<u32>], max_tokens: u64) -> Vec<EngineRequest> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| EngineRequest {
            id: i as u64,
            prompt: p.clone(),
            max_tokens,
        })
        .collect()
}

/// Per-request outputs of a run.
pub fn outputs(run: &EngineRun) -> Vec<Vec<u32>> {
    run.requests.iter().map(|r| r.output.clone()).collect()
}

/// Run-level metric consistency: per-step counters sum to the run's, which are the sum of
/// the requests'; every output within max_tokens.
pub fn assert_metrics_consistent(run: &EngineRun, reqs: &[EngineRequest], label: &str) {
    let (mut d, mut dt, mut a, mut out) = (0, 0, 0, 0);
    for s in &run.steps {
        d += s.num_drafts;
        dt += s.num_draft_tokens;
        a += s.num_accepted_tokens;
        out += s.output_tokens;
        assert!(
            s.num_accepted_tokens <= s.num_draft_tokens,
            "{label}: step {}",
            s.step
        );
    }
    assert_eq!(
        (d, dt, a),
        (
            run.spec.num_drafts,
            run.spec.num_draft_tokens,
            run.spec.num_accepted_tokens
        ),
        "{label}"
    );
    assert_eq!(out, run.output_tokens, "{label}");
    assert!(
        run.spec.accepted_per_position.first().copied().unwrap_or(0) <= run.spec.num_drafts,
        "{label}"
    );
    for (r, q) in run.requests.iter().zip(reqs) {
        assert_eq!(r.id, q.id);
        assert!(
            r.output.len() as u64 <= q.max_tokens,
            "{label}: request {}",
            r.id
        );
        assert!(r.finish.is_some(), "{label}: request {} unfinished", r.id);
        assert!(r.ttft_steps.is_some(), "{label}: request {} TTFT", r.id);
    }
}

/// Proptest cases: `PROPTEST_CASES` if set, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
