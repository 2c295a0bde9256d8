//! The simulated half of speclab: an acceptance-model executor and the run loop.
//!
//! What it does: [`SimExecutor`] plays the target + drafter without weights.
//! A prefill chunk accepts nothing; a decode step with `k` drafts samples how
//! many are accepted from an [`AcceptanceModel`] (vLLM's per-position
//! acceptance rates, `vllm/v1/spec_decode/metrics.py` `SpecDecodingStats`),
//! seeded through `rand_chacha::ChaCha8Rng` so runs are reproducible. It never
//! emits EOS: `max_tokens` (or `max_model_len`) ends requests, and it tracks no
//! token ids (count-only: `StepResult::sampled` empty, `drafts: None`). [`run_sim`]
//! is the engine's one step loop ([`crate::run::run`], shared with the real engine)
//! with a progress callback: it records admissions, rejections, a wedge, peaks of
//! KV use and spec-decode metrics ([`SpecMetrics`], counted in that loop).
//!
//! With a step-cost model ([`SimExecutor::with_cost`], [`crate::cost`]) the executor
//! also prices every step it executes and accumulates simulated time ([`SimTime`]):
//! total and per-term microseconds, and the decode-only steps' tokens and time, from
//! which a record states simulated tok/s. Without one nothing is priced and the run is
//! exactly what it was (same RNG draws, same results).
//!
//! Where the design comes from: DESIGN.md "Core seams" (the `Executor` seam,
//! `SimExecutor` = acceptance model, no weights) and "Measuring" (metric
//! definitions); the step order is vLLM 0.33.0 `v1/engine/core.py`.
//!
//! Invariants: the executor returns exactly one [`StepResult`] per scheduled
//! request with `accepted <= num_draft`; the same seed and inputs give the
//! same run; `run_sim` never loops past `SimLimits::max_steps` and stops at the
//! first wedge (vLLM would retry forever: Waiting 1 / Running 0). Peaks are
//! sampled right after `schedule` (blocks are only allocated there; `update`
//! only frees), so requests that finish in a step still count.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::cost::{CostModel, StepCost, StepShape};
use crate::kv::KvCacheManager;
pub use crate::metrics::SpecMetrics;
pub use crate::run::RunReport as SimRun;
use crate::run::{run, RunLimits, StepStats};
use crate::traits::{Executor, Scheduler, SchedulerOutput, StepCtx, StepOutput, StepResult};
use crate::{EngineError, Result};

/// vLLM's per-position acceptance rates: `per_position[i]` is the fraction of
/// drafts whose position `i` (0-based) was accepted (unconditional, so the
/// vector is non-increasing and each value is in [0, 1]). Positions beyond the
/// vector are always rejected.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct AcceptanceModel {
    pub per_position: Vec<f64>,
}

fn bad_acceptance(reason: String) -> EngineError {
    // EngineError has no dedicated variant for executor configuration.
    EngineError::Unsupported(format!("acceptance model: {reason}"))
}

impl AcceptanceModel {
    /// A validated model.
    pub fn new(per_position: Vec<f64>) -> Result<Self> {
        let m = Self { per_position };
        m.validate()?;
        Ok(m)
    }

    /// Every rate finite, in [0, 1], and non-increasing with position.
    pub fn validate(&self) -> Result<()> {
        let mut prev = 1.0f64;
        for (i, &a) in self.per_position.iter().enumerate() {
            if !a.is_finite() || !(0.0..=1.0).contains(&a) {
                return Err(bad_acceptance(format!(
                    "per_position[{i}] = {a} is not a rate in [0, 1]"
                )));
            }
            if a > prev {
                return Err(bad_acceptance(format!(
                    "per_position[{i}] = {a} exceeds per_position[{}] = {prev}; unconditional per-position rates cannot increase",
                    i.saturating_sub(1)
                )));
            }
            prev = a;
        }
        Ok(())
    }

    /// Conditional acceptance probabilities: `P(i accepted | i-1 accepted) = a_i / a_{i-1}`
    /// (with `a_{-1} = 1`; 0 after a zero rate). Shape: [len].
    pub fn conditional(&self) -> Vec<f64> {
        let mut prev = 1.0f64;
        self.per_position
            .iter()
            .map(|&a| {
                let c = if prev > 0.0 {
                    (a / prev).clamp(0.0, 1.0)
                } else {
                    0.0
                };
                prev = a;
                c
            })
            .collect()
    }

    /// Expected tau with `k` drafts per step: `1 + sum_{i<k} a_i`.
    pub fn expected_tau(&self, k: usize) -> f64 {
        1.0 + self.per_position.iter().take(k).sum::<f64>()
    }
}

/// Draw the accepted prefix length for `k` drafts: walk positions, accept
/// position `i` with its conditional probability, stop at the first rejection.
fn sample_accepted<R: Rng + ?Sized>(rng: &mut R, conditional: &[f64], k: u64) -> u64 {
    let mut accepted = 0u64;
    for &c in conditional
        .iter()
        .take(usize::try_from(k).unwrap_or(usize::MAX))
    {
        if c <= 0.0 || rng.random::<f64>() >= c {
            break;
        }
        accepted += 1;
    }
    accepted
}

/// Simulated time of a run under a cost model ([`SimExecutor::with_cost`]).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SimTime {
    /// Priced steps.
    pub steps: u64,
    /// Simulated microseconds over all steps.
    pub total_us: f64,
    /// Per-term microseconds summed over all steps.
    pub terms: StepCost,
    /// Steps with decode rows and no prefill chunk, their microseconds, and the tokens
    /// they produced (accepted + 1 per decode request).
    pub decode_steps: u64,
    pub decode_us: f64,
    pub decode_tokens: u64,
    /// Decode/verify rows and decode requests summed over the decode-only steps.
    pub decode_rows: u64,
    pub decode_reqs: u64,
    /// Per-term microseconds summed over the decode-only steps.
    pub decode_terms: StepCost,
}

/// The step shape of a scheduled batch ([`StepShape`]): prefill chunks and verify
/// groups are one sequence each; a decode request reads `start_pos + num_tokens` of KV.
pub fn step_shape(batch: &SchedulerOutput, num_speculative: u64) -> StepShape {
    let mut s = StepShape {
        num_speculative,
        ..StepShape::default()
    };
    for r in &batch.scheduled {
        if r.is_prefill {
            s.prefill_tokens += r.num_tokens;
        } else {
            s.decode_rows += r.num_tokens;
            s.decode_reqs += 1;
            s.context_tokens += r.start_pos + r.num_tokens;
        }
        s.seq_rows.push(r.num_tokens);
        s.sampling_reqs += 1;
    }
    s
}

/// The pricing state of an executor with a cost model.
#[derive(Debug, Clone)]
struct Pricing {
    model: CostModel,
    num_speculative: u64,
    time: SimTime,
}

/// The simulated executor: acceptance model, no weights, no EOS.
#[derive(Debug, Clone)]
pub struct SimExecutor {
    rng: ChaCha8Rng,
    acceptance: AcceptanceModel,
    conditional: Vec<f64>,
    /// Set when the acceptance model failed validation; `execute` returns it.
    invalid: Option<EngineError>,
    pricing: Option<Pricing>,
}

impl SimExecutor {
    /// Seeded executor. An invalid acceptance model is reported by the first `execute`.
    pub fn new(seed: u64, acceptance: AcceptanceModel) -> Self {
        let invalid = acceptance.validate().err();
        let conditional = acceptance.conditional();
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
            acceptance,
            conditional,
            invalid,
            pricing: None,
        }
    }

    /// Price every step with `model`; the drafter proposes `num_speculative` tokens a
    /// step (0: no drafter runs). An invalid model is refused here.
    pub fn with_cost(mut self, model: CostModel, num_speculative: u64) -> Result<Self> {
        model.validate()?;
        self.pricing = Some(Pricing {
            model,
            num_speculative,
            time: SimTime::default(),
        });
        Ok(self)
    }

    /// Simulated time so far (None without a cost model).
    pub fn sim_time(&self) -> Option<&SimTime> {
        self.pricing.as_ref().map(|p| &p.time)
    }

    /// Price one executed step.
    fn price(&mut self, batch: &SchedulerOutput, results: &[StepResult]) {
        let Some(p) = &mut self.pricing else { return };
        let shape = step_shape(batch, p.num_speculative);
        let c = p.model.step(&shape);
        let us = c.total();
        let t = &mut p.time;
        t.steps += 1;
        t.total_us += us;
        t.terms.add(&c);
        if shape.prefill_tokens == 0 && shape.decode_reqs > 0 {
            t.decode_steps += 1;
            t.decode_us += us;
            t.decode_tokens += results.iter().map(|r| r.accepted + 1).sum::<u64>();
            t.decode_rows += shape.decode_rows;
            t.decode_reqs += shape.decode_reqs;
            t.decode_terms.add(&c);
        }
    }

    /// The acceptance model in use.
    pub fn acceptance(&self) -> &AcceptanceModel {
        &self.acceptance
    }

    /// Sample the accepted count for one decode step with `k` drafts.
    pub fn sample_accepted(&mut self, k: u64) -> u64 {
        sample_accepted(&mut self.rng, &self.conditional, k)
    }
}

impl Executor for SimExecutor {
    fn execute(&mut self, ctx: &StepCtx<'_>) -> Result<StepOutput> {
        if let Some(e) = &self.invalid {
            return Err(e.clone());
        }
        let mut results = Vec::with_capacity(ctx.batch.scheduled.len());
        for s in &ctx.batch.scheduled {
            let accepted = if s.is_prefill || s.num_draft == 0 {
                0
            } else {
                self.sample_accepted(s.num_draft)
            };
            // Count-only: no token ids sampled, the scheduler drafts its configured N.
            results.push(StepResult {
                id: s.id,
                accepted,
                sampled: Vec::new(),
                drafts: None,
            });
        }
        self.price(ctx.batch, &results);
        Ok(StepOutput {
            results,
            ..StepOutput::default()
        })
    }
}

/// Limits of one simulated run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimLimits {
    /// Stop after this many executed steps (`SimRun::hit_step_limit`).
    pub max_steps: u64,
}

/// Run a scheduler + executor against a KV manager until no work is left, a
/// wedge is reported, or `limits.max_steps` steps ran: the engine's one loop
/// ([`crate::run::run`], no allocator check). `on_step` is called after every
/// executed step with the number of steps so far.
pub fn run_sim(
    kv: &mut KvCacheManager,
    sched: &mut dyn Scheduler,
    exec: &mut dyn Executor,
    limits: SimLimits,
    on_step: &mut dyn FnMut(u64),
) -> Result<SimRun> {
    run_sim_stats(kv, sched, exec, limits, &mut |s: &StepStats| {
        on_step(s.step + 1)
    })
}

/// [`run_sim`] with every executed step's [`StepStats`] handed to `on_step` (requests
/// scheduled in the step, output tokens committed): what concurrency measurements need.
pub fn run_sim_stats(
    kv: &mut KvCacheManager,
    sched: &mut dyn Scheduler,
    exec: &mut dyn Executor,
    limits: SimLimits,
    on_step: &mut dyn FnMut(&StepStats),
) -> Result<SimRun> {
    let limits = RunLimits {
        max_steps: limits.max_steps,
        check_allocator: false,
    };
    run(kv, sched, exec, limits, &mut |s: &StepStats| on_step(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::manager::AllocArgs;
    use crate::kv::{GroupSpec, KvLayout};
    use crate::request::{FinishReason, ReqSlot, RequestStatus, RequestView};
    use crate::traits::{
        Finished, NoTokens, RequestId, ScheduledRequest, SchedulerOutput, StepUpdate, TokenView,
    };

    #[test]
    fn acceptance_validation() {
        assert!(AcceptanceModel::new(vec![0.9, 0.7, 0.7, 0.0]).is_ok());
        assert!(AcceptanceModel::new(vec![]).is_ok());
        assert!(AcceptanceModel::new(vec![0.5, 0.6]).is_err());
        assert!(AcceptanceModel::new(vec![1.1]).is_err());
        assert!(AcceptanceModel::new(vec![-0.1]).is_err());
        assert!(AcceptanceModel::new(vec![f64::NAN]).is_err());
        let c = AcceptanceModel {
            per_position: vec![0.8, 0.4, 0.0, 0.0],
        }
        .conditional();
        assert_eq!(c, vec![0.8, 0.5, 0.0, 0.0]);
    }

    #[test]
    fn invalid_model_is_reported_by_execute() {
        let mut e = SimExecutor::new(
            1,
            AcceptanceModel {
                per_position: vec![0.2, 0.9],
            },
        );
        let kv = KvCacheManager::new(
            &crate::kv::KvLayout {
                num_blocks: Some(4),
                kv_cache_memory_bytes: None,
                max_model_len: 16,
                max_in_flight_tokens: None,
                watermark: 0.0,
                groups: vec![crate::kv::GroupSpec::full("f", 4)],
            },
            4,
        )
        .unwrap();
        let batch = SchedulerOutput::default();
        let ctx = StepCtx {
            kv: &kv,
            batch: &batch,
            tokens: &NoTokens,
        };
        assert!(e.execute(&ctx).is_err());
    }

    #[test]
    fn sampling_matches_per_position_rates() {
        let rates = vec![0.9, 0.75, 0.5, 0.3, 0.1];
        let mut e = SimExecutor::new(42, AcceptanceModel::new(rates.clone()).unwrap());
        let k = 7u64; // beyond the vector: always rejected
        let n = 200_000u64;
        let mut m = SpecMetrics::default();
        for _ in 0..n {
            let a = e.sample_accepted(k);
            assert!(a <= rates.len() as u64);
            m.observe_draft(k, a);
        }
        let got = m.per_position_rates();
        for (i, &r) in rates.iter().enumerate() {
            // 5 sigma of a binomial proportion at n = 200k is < 0.006.
            assert!(
                (got[i] - r).abs() < 0.006,
                "position {i}: {} vs {r}",
                got[i]
            );
        }
        assert_eq!(got[5], 0.0);
        assert_eq!(got[6], 0.0);
        let tau = m.mean_acceptance_length();
        let want = AcceptanceModel::new(rates).unwrap().expected_tau(7);
        assert!((tau - want).abs() < 0.02, "tau {tau} vs {want}");
    }

    #[test]
    fn sampling_is_seeded() {
        let m = AcceptanceModel::new(vec![0.7, 0.5, 0.2]).unwrap();
        let mut a = SimExecutor::new(7, m.clone());
        let mut b = SimExecutor::new(7, m);
        let xs: Vec<u64> = (0..100).map(|_| a.sample_accepted(3)).collect();
        let ys: Vec<u64> = (0..100).map(|_| b.sample_accepted(3)).collect();
        assert_eq!(xs, ys);
    }

    #[test]
    fn tau_hand_case() {
        // Three drafts of 4 tokens: accepted 4, 2, 0.
        let mut m = SpecMetrics::default();
        m.observe_draft(4, 4);
        m.observe_draft(4, 2);
        m.observe_draft(4, 0);
        assert_eq!(m.num_drafts, 3);
        assert_eq!(m.num_draft_tokens, 12);
        assert_eq!(m.num_accepted_tokens, 6);
        assert_eq!(m.accepted_per_position, vec![2, 2, 1, 1]);
        assert!((m.mean_acceptance_length() - 3.0).abs() < 1e-12); // 1 + 6/3
        assert!((m.draft_acceptance_rate() - 0.5).abs() < 1e-12); // 6/12
        let r = m.per_position_rates();
        assert!((r[0] - 2.0 / 3.0).abs() < 1e-12 && (r[3] - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(SpecMetrics::default().mean_acceptance_length(), 1.0);
    }

    /// A minimal scheduler for the loop test: one request, prompt in one chunk,
    /// then `decodes` decode steps with 2 drafts each.
    struct OneShot {
        computed: u64,
        tokens: u64,
        decodes: u64,
        live: bool,
    }

    impl Scheduler for OneShot {
        fn schedule(&mut self, kv: &mut KvCacheManager) -> Result<SchedulerOutput> {
            let prefill = self.computed == 0;
            let n = if prefill { self.tokens } else { 3 };
            let view = RequestView {
                slot: ReqSlot(0),
                num_computed_tokens: self.computed,
                num_tokens: self.tokens,
                num_prompt_tokens: 4,
                status: if prefill {
                    RequestStatus::Waiting
                } else {
                    RequestStatus::Running
                },
                num_in_flight_tokens: 0,
            };
            kv.allocate_slots(
                &view,
                AllocArgs {
                    num_new_tokens: n,
                    num_lookahead_tokens: 2,
                    full_sequence_must_fit: prefill,
                    has_scheduled_reqs: false,
                },
            )?;
            Ok(SchedulerOutput {
                scheduled: vec![ScheduledRequest {
                    start_pos: 0,
                    id: 9,
                    slot: ReqSlot(0),
                    num_tokens: n,
                    num_draft: if prefill { 0 } else { 2 },
                    draft_tokens: Vec::new(),
                    is_prefill: prefill,
                }],
                ..SchedulerOutput::default()
            })
        }
        fn update(
            &mut self,
            kv: &mut KvCacheManager,
            out: &SchedulerOutput,
            results: &[StepResult],
        ) -> Result<StepUpdate> {
            let s = &out.scheduled[0];
            let a = results[0].accepted;
            self.computed += s.num_tokens - (s.num_draft - a);
            self.tokens += a + 1;
            if !s.is_prefill {
                self.decodes -= 1;
            }
            let mut upd = StepUpdate {
                committed: vec![(9, a + 1)],
                finished: Vec::new(),
            };
            if self.decodes == 0 {
                kv.free(ReqSlot(0));
                self.live = false;
                upd.finished.push(Finished {
                    id: 9 as RequestId,
                    reason: FinishReason::Length,
                    output: Vec::new(),
                    num_output_tokens: self.tokens - 4,
                });
            }
            Ok(upd)
        }
        fn has_work(&self) -> bool {
            self.live
        }
    }

    impl TokenView for OneShot {
        fn token_ids(&self, _id: RequestId) -> Option<&[u32]> {
            None
        }
    }

    #[test]
    fn run_loop_accumulates_metrics_and_returns_blocks() {
        let layout = KvLayout {
            num_blocks: Some(64),
            kv_cache_memory_bytes: None,
            max_model_len: 1024,
            max_in_flight_tokens: None,
            watermark: 0.0,
            groups: vec![GroupSpec::full("full", 4)],
        };
        let mut kv = KvCacheManager::from_layout(&layout).unwrap();
        let mut s = OneShot {
            computed: 0,
            tokens: 4,
            decodes: 10,
            live: true,
        };
        let mut e = SimExecutor::new(3, AcceptanceModel::new(vec![1.0, 1.0]).unwrap());
        let mut seen = 0;
        let run = run_sim(
            &mut kv,
            &mut s,
            &mut e,
            SimLimits { max_steps: 100 },
            &mut |n| seen = n,
        )
        .unwrap();
        assert_eq!(run.steps, 11);
        assert_eq!(seen, 11);
        assert_eq!(run.finished, vec![(10, 9)]);
        assert_eq!(run.spec.num_drafts, 10);
        assert_eq!(run.spec.num_accepted_tokens, 20);
        assert!((run.spec.mean_acceptance_length() - 3.0).abs() < 1e-12);
        // Last decode: computed 4 + 9*3 = 31, +3 new +2 lookahead = 36 tokens = 9 blocks.
        assert_eq!(run.peak_held_per_group, vec![9]);
        assert_eq!(run.peak_total_held, 9);
        assert_eq!(kv.num_free_blocks(), kv.usable_blocks());
        // Step limit.
        let mut kv = KvCacheManager::from_layout(&layout).unwrap();
        let mut s = OneShot {
            computed: 0,
            tokens: 4,
            decodes: 10,
            live: true,
        };
        let run = run_sim(
            &mut kv,
            &mut s,
            &mut e,
            SimLimits { max_steps: 3 },
            &mut |_| {},
        )
        .unwrap();
        assert!(run.hit_step_limit);
        assert_eq!(run.steps, 3);
    }

    #[test]
    fn a_cost_model_prices_steps_without_changing_the_run() {
        use crate::cost::{CostModel, ForwardShape, HardwareProfile, Routing};
        let layout = KvLayout {
            num_blocks: Some(64),
            kv_cache_memory_bytes: None,
            max_model_len: 1024,
            max_in_flight_tokens: None,
            watermark: 0.0,
            groups: vec![GroupSpec::full("full", 4)],
        };
        let model = CostModel {
            hardware: HardwareProfile {
                hbm_gb_s: 1000.0,
                launch_us: 1.0,
                allreduce_us: 0.0,
                tp: 1,
                ep: 1,
                compute_tflops: 1.0,
                row_us: 2.0,
                expert_us: 0.0,
                ep_busiest: false,
                allreduce_gb_s: 0.0,
            },
            target: ForwardShape {
                kernels: 10.0,
                dense_bytes: 0.0,
                moe: None,
                flops_per_token: 0.0,
                allreduces: 0.0,
                kv_bytes_per_token: 0.0,
                state_bytes: 0.0,
                allreduce_bytes_per_row: 0.0,
            },
            drafter: None,
            routing: Routing::UNIFORM,
        };
        let acc = AcceptanceModel::new(vec![0.6, 0.3]).unwrap();
        let mut runs = Vec::new();
        for priced in [false, true] {
            let mut kv = KvCacheManager::from_layout(&layout).unwrap();
            let mut s = OneShot {
                computed: 0,
                tokens: 4,
                decodes: 10,
                live: true,
            };
            let mut e = SimExecutor::new(3, acc.clone());
            if priced {
                e = e.with_cost(model.clone(), 2).unwrap();
            }
            let run = run_sim(
                &mut kv,
                &mut s,
                &mut e,
                SimLimits { max_steps: 100 },
                &mut |_| {},
            )
            .unwrap();
            runs.push((run.spec.clone(), run.steps, e.sim_time().cloned()));
        }
        assert_eq!(runs[0].0, runs[1].0);
        assert!(runs[0].2.is_none());
        let t = runs[1].2.clone().unwrap();
        // Prefill of 4 tokens: 10 + 4 x 2 us; 10 decode steps of 3 rows: 10 + 3 x 2 us.
        assert_eq!(t.steps, 11);
        assert!((t.total_us - (18.0 + 10.0 * 16.0)).abs() < 1e-9, "{t:?}");
        assert_eq!(t.decode_steps, 10);
        assert_eq!(t.decode_tokens, runs[1].0.num_accepted_tokens + 10);
        let mut bad = model;
        bad.hardware.hbm_gb_s = -1.0;
        assert!(SimExecutor::new(1, acc).with_cost(bad, 1).is_err());
    }
}
