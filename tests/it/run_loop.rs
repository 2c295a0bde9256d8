//! The simulator and the real engine run through the same step loop
//! (`speclab_engine::run::run`) and report metrics computed by the same code.
//!
//! The real engine (micro target, MTP and n-gram drafters, FCFS with token ids, batched,
//! chunked prefill, EOS ignored) runs once while an executor wrapper records, step by
//! step, what was scheduled and what the model executor returned. The recording is then
//! replayed through the simulator's half: a count-only FCFS scheduler (no token ids) and
//! a scripted count-only executor that returns the recorded accepted counts and draft
//! counts. Because both go through one loop and one scheduler accounting, the replay must
//! schedule exactly the same batches and report the same spec-decode metrics (run and per
//! request), the same steps, admissions, finishing steps and per-step counters. A
//! deliberately different script (one proposal a draft shorter) must change the
//! metrics, so the comparison can fail.

use crate::engine_support::*;
use speclab_drafters::DrafterSpec;
use speclab_engine::backend::{BackendFactory, CpuBackend};
use speclab_engine::exec::{DrafterFactory, ExecConfig, ModelExecutor};
use speclab_engine::kv::KvCacheManager;
use speclab_engine::model::ModelWeights;
use speclab_engine::run::{run, RunLimits, RunReport, StepStats};
use speclab_engine::{Executor, RequestId, StepCtx, StepOutput, StepResult};
use speclab_schedulers::{FcfsScheduler, RequestSpec, SchedulerConfig};

/// (id, start_pos, num_tokens, num_draft) of a scheduled request.
type Sched = (RequestId, u64, u64, u64);

/// One step as the real run saw it.
#[derive(Debug, Clone)]
struct Recorded {
    scheduled: Vec<Sched>,
    /// (id, accepted, number of drafts proposed).
    results: Vec<(RequestId, u64, usize)>,
}

/// Wraps the model executor and records every step.
struct Recorder<'a> {
    inner: &'a mut dyn Executor,
    steps: Vec<Recorded>,
}

impl Executor for Recorder<'_> {
    fn execute(&mut self, ctx: &StepCtx<'_>) -> speclab_engine::Result<StepOutput> {
        let out = self.inner.execute(ctx)?;
        self.steps.push(Recorded {
            scheduled: ctx
                .batch
                .scheduled
                .iter()
                .map(|s| (s.id, s.start_pos, s.num_tokens, s.num_draft))
                .collect(),
            results: out
                .results
                .iter()
                .map(|r| (r.id, r.accepted, r.drafts.as_ref().map_or(0, Vec::len)))
                .collect(),
        });
        Ok(out)
    }
}

/// Replays a recording, count-only, and checks each batch matches it.
struct Scripted {
    steps: Vec<Recorded>,
    next: usize,
    mismatch: Option<String>,
}

impl Executor for Scripted {
    fn execute(&mut self, ctx: &StepCtx<'_>) -> speclab_engine::Result<StepOutput> {
        let rec = self.steps.get(self.next).cloned().unwrap_or(Recorded {
            scheduled: Vec::new(),
            results: Vec::new(),
        });
        self.next += 1;
        let got: Vec<Sched> = ctx
            .batch
            .scheduled
            .iter()
            .map(|s| (s.id, s.start_pos, s.num_tokens, s.num_draft))
            .collect();
        if got != rec.scheduled && self.mismatch.is_none() {
            self.mismatch = Some(format!(
                "step {}: scheduled {got:?}, the real run scheduled {:?}",
                self.next - 1,
                rec.scheduled
            ));
        }
        let results = ctx
            .batch
            .scheduled
            .iter()
            .map(|s| {
                let (accepted, n) = rec
                    .results
                    .iter()
                    .find(|r| r.0 == s.id)
                    .map_or((0, 0), |r| (r.1.min(s.num_draft), r.2));
                StepResult {
                    id: s.id,
                    accepted,
                    sampled: Vec::new(),
                    drafts: Some(vec![0; n]),
                }
            })
            .collect();
        Ok(StepOutput {
            results,
            ..StepOutput::default()
        })
    }
}

const BUDGET: u64 = 24;
const SEQS: usize = 3;
const MAX_TOKENS: u64 = 20;

fn sched_cfg(n: u64, lookahead: u64) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: SEQS,
        max_num_batched_tokens: BUDGET,
        num_speculative_tokens: n,
        lookahead,
        ..SchedulerConfig::default()
    }
}

fn limits() -> RunLimits {
    RunLimits {
        max_steps: 10_000,
        check_allocator: true,
    }
}

/// The real engine through `run`, recorded.
fn real_run(
    target: &ModelWeights,
    spec: &DrafterSpec,
    prompts: &[Vec<u32>],
) -> (RunReport, Vec<StepStats>, Vec<Recorded>) {
    let n = spec.num_speculative_tokens();
    let mut layout = target.cfg.kv_layout(16, n as u32, 512).unwrap();
    layout.groups.extend(spec.kv_groups().unwrap());
    let mut kv = KvCacheManager::new(&layout, 512).unwrap();
    let drafter = spec.build(&target.cfg, &kv).unwrap();
    let lookahead = drafter.lookahead_slots() as u64;
    let cfg = ExecConfig {
        num_speculative_tokens: n,
        ..ExecConfig::default()
    };
    let backend = CpuBackend.build(target, &kv).unwrap();
    let mut exec = ModelExecutor::new(backend, drafter, cfg).unwrap();
    let mut sched = FcfsScheduler::new(sched_cfg(n as u64, lookahead));
    for (i, p) in prompts.iter().enumerate() {
        sched
            .add_request_with_tokens(&kv, i as u64, p.clone(), MAX_TOKENS, None)
            .unwrap();
    }
    let mut rec = Recorder {
        inner: &mut exec,
        steps: Vec::new(),
    };
    let mut stats = Vec::new();
    let rep = run(
        &mut kv,
        &mut sched,
        &mut rec,
        limits(),
        &mut |s: &StepStats| stats.push(s.clone()),
    )
    .unwrap();
    (rep, stats, rec.steps)
}

/// The recording replayed through the simulator's half of the same loop.
fn replay(
    target: &ModelWeights,
    spec: &DrafterSpec,
    prompts: &[Vec<u32>],
    steps: Vec<Recorded>,
) -> (RunReport, Vec<StepStats>, Option<String>) {
    let n = spec.num_speculative_tokens();
    let mut layout = target.cfg.kv_layout(16, n as u32, 512).unwrap();
    layout.groups.extend(spec.kv_groups().unwrap());
    let mut kv = KvCacheManager::new(&layout, 512).unwrap();
    let lookahead = spec.build(&target.cfg, &kv).unwrap().lookahead_slots() as u64;
    let mut sched = FcfsScheduler::new(sched_cfg(n as u64, lookahead));
    for (i, p) in prompts.iter().enumerate() {
        let r = RequestSpec {
            id: i as u64,
            prompt_len: p.len() as u64,
            max_tokens: MAX_TOKENS,
        };
        sched.add_request(&kv, r).unwrap();
    }
    let mut exec = Scripted {
        steps,
        next: 0,
        mismatch: None,
    };
    let mut stats = Vec::new();
    let rep = run(
        &mut kv,
        &mut sched,
        &mut exec,
        limits(),
        &mut |s: &StepStats| stats.push(s.clone()),
    )
    .unwrap();
    (rep, stats, exec.mismatch)
}

/// The counters of a step, timings and expert counts left out.
fn counters(s: &StepStats) -> [u64; 8] {
    [
        s.step,
        s.num_reqs as u64,
        s.prefill_tokens,
        s.verify_tokens,
        s.num_drafts,
        s.num_draft_tokens,
        s.num_accepted_tokens,
        s.output_tokens,
    ]
}

fn assert_same_metrics(a: &RunReport, b: &RunReport, label: &str) {
    assert_eq!(a.spec, b.spec, "{label}: run spec metrics");
    assert_eq!(a.steps, b.steps, "{label}: steps");
    assert_eq!(a.finished, b.finished, "{label}: finishing steps");
    assert_eq!(a.admitted, b.admitted, "{label}: admissions");
    assert_eq!(a.output_tokens, b.output_tokens, "{label}: output tokens");
    assert_eq!(
        a.peak_held_per_group, b.peak_held_per_group,
        "{label}: KV peaks"
    );
    assert_eq!(a.requests.len(), b.requests.len(), "{label}");
    for (id, p) in &a.requests {
        let q = &b.requests[id];
        assert_eq!(p.spec, q.spec, "{label}: request {id} spec metrics");
        assert_eq!(p.ttft_steps, q.ttft_steps, "{label}: request {id} TTFT");
        assert_eq!(p.finish, q.finish, "{label}: request {id} finish");
        assert_eq!(
            p.num_output_tokens, q.num_output_tokens,
            "{label}: request {id}"
        );
    }
}

#[test]
fn simulator_and_real_engine_share_the_loop_and_its_metrics() {
    let target = micro_target(11);
    let prompts = prompts(5, &[9, 30, 17, 4], target.cfg.vocab_size);
    for (label, spec) in [
        ("mtp N=3", DrafterSpec::mtp(&target.cfg, 3).unwrap()),
        ("ngram N=2", DrafterSpec::ngram(2, 1, 2).unwrap()),
    ] {
        let (real, real_steps, rec) = real_run(&target, &spec, &prompts);
        assert!(
            real.allocator_violation.is_none(),
            "{label}: {:?}",
            real.allocator_violation
        );
        if label.starts_with("mtp") {
            assert!(
                real.spec.num_drafts > 0,
                "{label}: the real run verified drafts"
            );
        }
        assert_eq!(
            real.finished.len(),
            prompts.len(),
            "{label}: every request finished"
        );
        // The real run's per-request outputs are the scheduler's, cut by the stop rule.
        for p in real.requests.values() {
            assert_eq!(p.output.len() as u64, p.num_output_tokens, "{label}");
            assert_eq!(
                p.num_output_tokens, MAX_TOKENS,
                "{label}: EOS ignored, max_tokens"
            );
        }

        let (sim, sim_steps, mismatch) = replay(&target, &spec, &prompts, rec.clone());
        assert_eq!(
            mismatch, None,
            "{label}: the replay scheduled other batches"
        );
        assert_same_metrics(&real, &sim, label);
        let a: Vec<_> = real_steps.iter().map(counters).collect();
        let b: Vec<_> = sim_steps.iter().map(counters).collect();
        assert_eq!(a, b, "{label}: per-step counters");

        // Negative control: one proposal shortened by a draft changes what the loop
        // reports (the next step verifies one draft fewer), so the comparison can fail.
        let mut altered = rec;
        let hit = altered
            .iter_mut()
            .flat_map(|s| s.results.iter_mut())
            .find(|r| r.2 > 0);
        if let Some(r) = hit {
            r.2 -= 1;
            let (sim2, _, mismatch2) = replay(&target, &spec, &prompts, altered);
            assert_ne!(real.spec, sim2.spec, "{label}: the comparison can fail");
            assert!(
                mismatch2.is_some(),
                "{label}: the altered replay schedules other batches"
            );
        } else {
            assert!(!label.starts_with("mtp"), "{label}: MTP always proposes");
        }
    }
}
