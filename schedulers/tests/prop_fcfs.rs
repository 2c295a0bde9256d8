//! Property tests of `FcfsScheduler` on random small layouts and workloads.
//!
//! Properties: every step schedules at most `max_num_batched_tokens` tokens
//! and at most `max_num_seqs` requests (and never runs more than
//! `max_num_seqs`); a run ends (all finished, rejected, or wedged with nothing
//! running) well before the step limit; at the end every block is back in the
//! pool (`num_free_blocks == usable_blocks`); every request is accounted for.

use proptest::prelude::*;
use speclab_engine::kv::{CapPolicy, GroupSpec, KvCacheManager, KvLayout};
use speclab_engine::sim::{run_sim, AcceptanceModel, SimExecutor, SimLimits};
use speclab_engine::{RequestId, Scheduler, SchedulerOutput, StepResult, StepUpdate, TokenView};
use speclab_schedulers::{AdmissionPolicy, FcfsScheduler, RequestSpec, SchedulerConfig};

/// Wraps the scheduler and checks per-step limits.
struct Checked {
    inner: FcfsScheduler,
    max_seqs: usize,
    budget: u64,
    violations: Vec<String>,
}

impl Scheduler for Checked {
    fn schedule(&mut self, kv: &mut KvCacheManager) -> speclab_engine::Result<SchedulerOutput> {
        let out = self.inner.schedule(kv)?;
        let tokens: u64 = out.scheduled.iter().map(|r| r.num_tokens).sum();
        if tokens > self.budget {
            self.violations
                .push(format!("{tokens} tokens > budget {}", self.budget));
        }
        if out.scheduled.len() > self.max_seqs || self.inner.num_running() > self.max_seqs {
            self.violations.push(format!(
                "{} scheduled / {} running > {}",
                out.scheduled.len(),
                self.inner.num_running(),
                self.max_seqs
            ));
        }
        if out.scheduled.iter().any(|r| r.num_tokens == 0) {
            self.violations.push("zero-token schedule".into());
        }
        Ok(out)
    }
    fn update(
        &mut self,
        kv: &mut KvCacheManager,
        out: &SchedulerOutput,
        results: &[StepResult],
    ) -> speclab_engine::Result<StepUpdate> {
        self.inner.update(kv, out, results)
    }
    fn has_work(&self) -> bool {
        self.inner.has_work()
    }
}

impl TokenView for Checked {
    fn token_ids(&self, id: RequestId) -> Option<&[u32]> {
        self.inner.token_ids(id)
    }
}

fn group_strategy() -> impl Strategy<Value = GroupSpec> {
    prop_oneof![
        (1u32..9).prop_map(|bs| GroupSpec::full("g", bs)),
        (
            1u32..9,
            1u32..24,
            prop_oneof![
                Just(CapPolicy::None),
                Just(CapPolicy::Upstream),
                Just(CapPolicy::WindowPlusTwo)
            ]
        )
            .prop_map(|(bs, w, cap)| GroupSpec::sliding_window("g", bs, w, cap)),
        (0u32..3).prop_map(|n| GroupSpec::state("g", n)),
        (1u32..9).prop_map(|bs| GroupSpec::ring_buffer("g", bs)),
    ]
}

fn layout_strategy() -> impl Strategy<Value = KvLayout> {
    (
        prop::collection::vec(group_strategy(), 1..4),
        2u32..80,
        16u32..128,
    )
        .prop_map(|(mut groups, num_blocks, mml)| {
            for (i, g) in groups.iter_mut().enumerate() {
                g.name = format!("g{i}");
            }
            KvLayout {
                num_blocks: Some(num_blocks),
                kv_cache_memory_bytes: None,
                max_model_len: mml,
                max_in_flight_tokens: None,
                watermark: 0.0,
                groups,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn runs_return_every_block_and_respect_limits(
        layout in layout_strategy(),
        reqs in prop::collection::vec((1u64..100, 1u64..40), 1..12),
        max_seqs in 1usize..5,
        budget in 1u64..40,
        k in 0u64..4,
        dflash in any::<bool>(),
        reject in any::<bool>(),
        rate in 0.0f64..1.0,
        seed in any::<u64>(),
    ) {
        let mut kv = KvCacheManager::from_layout(&layout).unwrap();
        let cfg = SchedulerConfig {
            max_num_seqs: max_seqs,
            max_num_batched_tokens: budget,
            num_speculative_tokens: k,
            lookahead: if k == 0 { 0 } else if dflash { k + 1 } else { k },
            policy: if reject { AdmissionPolicy::RejectImpossible } else { AdmissionPolicy::Fcfs },
            max_steps_without_progress: 20,
        };
        let mut s = Checked { inner: FcfsScheduler::new(cfg), max_seqs, budget, violations: vec![] };
        let mut added = 0usize;
        let mut refused = 0usize;
        for (id, (p, m)) in reqs.iter().enumerate() {
            match s.inner.add_request(&kv, RequestSpec { id: id as u64, prompt_len: *p, max_tokens: *m }) {
                Ok(()) => added += 1,
                Err(_) => { prop_assert!(*p >= kv.max_model_len()); refused += 1; }
            }
        }
        prop_assert_eq!(added + refused, reqs.len());
        let model = AcceptanceModel::new((0..k).map(|i| rate.powi(i as i32 + 1)).collect()).unwrap();
        let mut e = SimExecutor::new(seed, model);
        let run = run_sim(&mut kv, &mut s, &mut e, SimLimits { max_steps: 20_000 }, &mut |_| {}).unwrap();
        prop_assert!(s.violations.is_empty(), "{:?}", s.violations);
        prop_assert!(!run.hit_step_limit, "livelock: {} steps", run.steps);
        prop_assert_eq!(s.inner.num_running(), 0);
        prop_assert_eq!(kv.num_free_blocks(), kv.usable_blocks());
        let left = s.inner.num_waiting();
        prop_assert_eq!(run.finished.len() + run.rejected.len() + left, added);
        prop_assert_eq!(left > 0, run.wedged.is_some());
        prop_assert!(run.peak_total_held <= kv.usable_blocks());
        prop_assert!(run.spec.num_accepted_tokens <= run.spec.num_draft_tokens);
    }
}
