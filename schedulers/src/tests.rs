//! Unit tests of the FCFS scheduler on small hand-made layouts and on the
//! GLM-5.3-Flash + DFlash2 preset (the model card's wedge numbers).

use speclab_engine::kv::presets::glm53_dflash2;
use speclab_engine::kv::{CapPolicy, GroupSpec, KvCacheManager, KvLayout};
use speclab_engine::sim::{run_sim, AcceptanceModel, SimExecutor, SimLimits};
use speclab_engine::{
    Executor, NoTokens, ReqSlot, RequestId, RequestStatus, Scheduler, SchedulerOutput, StepCtx,
    StepResult,
};

use crate::{AdmissionPolicy, FcfsScheduler, RequestSpec, SchedulerConfig, SchedulerError};

fn full_kv(block_size: u32, num_blocks: u32, max_model_len: u32) -> KvCacheManager {
    let layout = KvLayout {
        num_blocks: Some(num_blocks),
        kv_cache_memory_bytes: None,
        max_model_len,
        max_in_flight_tokens: None,
        watermark: 0.0,
        groups: vec![GroupSpec::full("full", block_size)],
    };
    KvCacheManager::from_layout(&layout).unwrap()
}

fn cfg(budget: u64, k: u64, lookahead: u64) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 16,
        max_num_batched_tokens: budget,
        num_speculative_tokens: k,
        lookahead,
        policy: AdmissionPolicy::Fcfs,
        max_steps_without_progress: 5,
    }
}

fn req(id: RequestId, prompt_len: u64, max_tokens: u64) -> RequestSpec {
    RequestSpec {
        id,
        prompt_len,
        max_tokens,
    }
}

/// One engine step; returns the scheduler output and the finished ids.
fn step(
    s: &mut FcfsScheduler,
    kv: &mut KvCacheManager,
    e: &mut SimExecutor,
) -> (SchedulerOutput, Vec<RequestId>) {
    let out = s.schedule(kv).unwrap();
    let res = exec(e, kv, &out);
    let fin = s.update(kv, &out, &res).unwrap().finished_ids();
    (out, fin)
}

/// The executor's results for one step (count-only: no token view).
fn exec(e: &mut SimExecutor, kv: &KvCacheManager, out: &SchedulerOutput) -> Vec<StepResult> {
    let ctx = StepCtx {
        kv,
        batch: out,
        tokens: &NoTokens,
    };
    e.execute(&ctx).unwrap().results
}

/// (id, tokens) of each scheduled request.
fn sched_tokens(out: &SchedulerOutput) -> Vec<(RequestId, u64)> {
    out.scheduled.iter().map(|r| (r.id, r.num_tokens)).collect()
}

fn no_accept() -> SimExecutor {
    SimExecutor::new(0, AcceptanceModel::default())
}

fn glm_kv(cap: CapPolicy) -> KvCacheManager {
    KvCacheManager::from_layout(&glm53_dflash2(2304, cap, 1012, 262_144, 8192)).unwrap()
}

fn glm_cfg(policy: AdmissionPolicy) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        num_speculative_tokens: 7,
        lookahead: 8,
        policy,
        max_steps_without_progress: 50,
    }
}

fn glm_exec(seed: u64) -> SimExecutor {
    SimExecutor::new(
        seed,
        AcceptanceModel::new(vec![0.8, 0.65, 0.5, 0.4, 0.3, 0.2, 0.1]).unwrap(),
    )
}

#[test]
fn chunked_prefill_obeys_the_budget() {
    let mut kv = full_kv(4, 100, 1024);
    let mut s = FcfsScheduler::new(cfg(10, 0, 0));
    let mut e = no_accept();
    s.add_request(&kv, req(1, 25, 3)).unwrap();
    s.add_request(&kv, req(2, 7, 2)).unwrap();
    let mut trace = Vec::new();
    let mut finished = Vec::new();
    while s.has_work() {
        let (out, fin) = step(&mut s, &mut kv, &mut e);
        assert!(out.scheduled.iter().map(|r| r.num_tokens).sum::<u64>() <= 10);
        trace.push(sched_tokens(&out));
        finished.extend(fin);
    }
    assert_eq!(
        trace,
        vec![
            vec![(1, 10)],        // A's first chunk takes the whole budget; B waits
            vec![(1, 10)],        // running requests first
            vec![(1, 5), (2, 5)], // A finishes its prompt, B gets the rest of the budget
            vec![(1, 1), (2, 2)], // A decodes; B finishes its prompt
            vec![(1, 1), (2, 1)], // A reaches max_tokens 3, B reaches 2
        ]
    );
    assert_eq!(finished, vec![1, 2]);
    assert_eq!(kv.num_free_blocks(), kv.usable_blocks());
}

#[test]
fn head_of_line_blocking() {
    // 10 usable blocks of 4 tokens.
    let mut kv = full_kv(4, 11, 1024);
    let mut s = FcfsScheduler::new(cfg(1000, 0, 0));
    let mut e = no_accept();
    s.add_request(&kv, req(1, 24, 2)).unwrap(); // 6 blocks
    s.add_request(&kv, req(2, 20, 1)).unwrap(); // 5 blocks: does not fit next to A
    s.add_request(&kv, req(3, 4, 1)).unwrap(); // 1 block: would fit, but B is ahead
    let (out, fin) = step(&mut s, &mut kv, &mut e);
    assert_eq!(sched_tokens(&out), vec![(1, 24)]);
    assert!(out.wedged.is_none() && fin.is_empty());
    assert_eq!(s.waiting_ids().collect::<Vec<_>>(), vec![2, 3]);
    let (out, fin) = step(&mut s, &mut kv, &mut e);
    assert_eq!(sched_tokens(&out), vec![(1, 1)]);
    assert_eq!(fin, vec![1]);
    let (out, fin) = step(&mut s, &mut kv, &mut e);
    assert_eq!(sched_tokens(&out), vec![(2, 20), (3, 4)]);
    assert_eq!(
        out.admitted
            .iter()
            .map(|a| (a.id, a.need_per_group.clone()))
            .collect::<Vec<_>>(),
        vec![(2, vec![5]), (3, vec![1])]
    );
    assert_eq!(fin, vec![2, 3]);
    assert!(!s.has_work());
    assert_eq!(kv.num_free_blocks(), kv.usable_blocks());
}

#[test]
fn preemption_on_decode_allocation_failure() {
    // 8 usable blocks of 4 tokens; two 12-token prompts decode until the pool runs out.
    let mut kv = full_kv(4, 9, 1024);
    let mut s = FcfsScheduler::new(cfg(100, 0, 0));
    let mut e = no_accept();
    s.add_request(&kv, req(1, 12, 20)).unwrap();
    s.add_request(&kv, req(2, 12, 20)).unwrap();
    let mut steps = 0;
    let preempt_step = loop {
        let (out, _) = step(&mut s, &mut kv, &mut e);
        steps += 1;
        if !out.preempted.is_empty() {
            assert_eq!(
                out.preempted,
                vec![2],
                "FCFS preempts the last running request"
            );
            assert_eq!(sched_tokens(&out), vec![(1, 1)]);
            assert!(
                out.admitted.is_empty(),
                "no admission in a step that preempted"
            );
            break steps;
        }
        assert!(steps < 20);
    };
    // A at computed 16 needed a 5th block with the pool full: step 6.
    assert_eq!(preempt_step, 6);
    let b = *s.request(2).unwrap();
    assert_eq!(b.status, RequestStatus::Preempted);
    assert_eq!(b.num_computed_tokens, 0);
    assert_eq!(
        (b.num_tokens, b.num_output_tokens, b.num_preemptions),
        (17, 5, 1)
    );
    assert_eq!(kv.held_blocks(b.slot), vec![0]);
    assert_eq!(s.waiting_ids().collect::<Vec<_>>(), vec![2]);
    // B resumes only after A finishes, recomputing prompt + outputs in one chunk.
    let mut resumed = None;
    while s.has_work() {
        let (out, _) = step(&mut s, &mut kv, &mut e);
        if let Some(r) = out.scheduled.iter().find(|r| r.id == 2) {
            if resumed.is_none() {
                assert_eq!(s.num_running(), 1);
                resumed = Some((r.num_tokens, r.is_prefill));
            }
        }
    }
    assert_eq!(resumed, Some((17, true)));
    assert_eq!(kv.num_free_blocks(), kv.usable_blocks());
}

#[test]
fn self_preemption_then_wedge_or_reject() {
    // 4 usable blocks = 16 tokens; the request fits at admission but outgrows the pool.
    for policy in [AdmissionPolicy::Fcfs, AdmissionPolicy::RejectImpossible] {
        let mut kv = full_kv(4, 5, 1024);
        let mut s = FcfsScheduler::new(SchedulerConfig {
            policy,
            ..cfg(100, 0, 0)
        });
        s.add_request(&kv, req(7, 8, 20)).unwrap();
        let run = run_sim(
            &mut kv,
            &mut s,
            &mut no_accept(),
            SimLimits { max_steps: 100 },
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(run.preemptions, 1);
        let report = match policy {
            AdmissionPolicy::Fcfs => run.wedged.clone().unwrap(),
            AdmissionPolicy::RejectImpossible => {
                assert!(run.wedged.is_none());
                assert_eq!(run.rejected.len(), 1);
                run.rejected[0].clone()
            }
        };
        assert_eq!(
            (report.id, report.num_tokens, report.total(), report.usable),
            (7, 17, 5, 4)
        );
        assert!(!run.hit_step_limit);
        assert_eq!(kv.num_free_blocks(), kv.usable_blocks());
    }
}

#[test]
fn backstop_reports_a_lookahead_livelock() {
    // Admission needs 3 of 4 blocks, but the per-step check adds 8 lookahead
    // slots (20 tokens = 5 blocks): never scheduled, never provably impossible.
    let mut kv = full_kv(4, 5, 1024);
    let mut s = FcfsScheduler::new(cfg(100, 7, 8));
    s.add_request(&kv, req(3, 12, 4)).unwrap();
    let run = run_sim(
        &mut kv,
        &mut s,
        &mut no_accept(),
        SimLimits { max_steps: 100 },
        &mut |_| {},
    )
    .unwrap();
    let w = run.wedged.unwrap();
    assert_eq!(w.kind, speclab_engine::StallKind::NoProgress);
    assert_eq!((w.id, w.total(), w.usable), (3, 3, 4));
    assert_eq!(run.steps, 4, "the 5th idle schedule reports");
    assert!(run.admitted.is_empty());
}

#[test]
fn spec_decode_accounting_and_max_model_len() {
    // All drafts accepted: each decode commits k + 1 = 4 tokens.
    let mut kv = full_kv(4, 100, 32);
    let mut s = FcfsScheduler::new(cfg(100, 3, 3));
    let mut e = SimExecutor::new(1, AcceptanceModel::new(vec![1.0; 3]).unwrap());
    s.add_request(&kv, req(1, 20, 100)).unwrap();
    let mut trace = Vec::new();
    while s.has_work() {
        let (out, _) = step(&mut s, &mut kv, &mut e);
        let r = &out.scheduled[0];
        let st = s.request(1).copied();
        trace.push((
            r.num_tokens,
            r.num_draft,
            st.map(|x| (x.num_tokens, x.num_computed_tokens)),
        ));
    }
    assert_eq!(
        trace,
        vec![
            (20, 0, Some((21, 20))),
            (4, 3, Some((25, 24))),
            (4, 3, Some((29, 28))),
            // Clamped at max_model_len - num_computed - 1 = 3 tokens: 2 drafts.
            (3, 2, None),
        ]
    );
    assert_eq!(kv.num_free_blocks(), kv.usable_blocks());

    // max_tokens truncates the committed tokens.
    let mut kv = full_kv(4, 100, 1024);
    let mut s = FcfsScheduler::new(cfg(100, 3, 3));
    s.add_request(&kv, req(1, 20, 10)).unwrap();
    let mut n = 0;
    while s.has_work() {
        step(&mut s, &mut kv, &mut e);
        n += 1;
    }
    assert_eq!(n, 4); // 1 + 4 + 4 + (4 -> 1)
}

#[test]
fn rejected_drafts_roll_back() {
    let mut kv = full_kv(4, 100, 1024);
    let mut s = FcfsScheduler::new(cfg(100, 4, 4));
    let mut e = no_accept();
    s.add_request(&kv, req(1, 10, 5)).unwrap();
    step(&mut s, &mut kv, &mut e);
    let (out, _) = step(&mut s, &mut kv, &mut e);
    assert_eq!(
        (out.scheduled[0].num_tokens, out.scheduled[0].num_draft),
        (5, 4)
    );
    let r = s.request(1).unwrap();
    assert_eq!(
        (r.num_tokens, r.num_computed_tokens, r.num_output_tokens),
        (12, 11, 2)
    );
}

#[test]
fn proposed_draft_count_drives_the_next_step() {
    // A real drafter may propose fewer than k tokens (n-gram with no match: 0);
    // the next step verifies exactly what was proposed, as vLLM schedules
    // 1 + len(spec_token_ids).
    let mut kv = full_kv(4, 100, 1024);
    let mut s = FcfsScheduler::new(cfg(100, 4, 4));
    s.add_request(&kv, req(1, 10, 50)).unwrap();
    let out = s.schedule(&mut kv).unwrap();
    assert_eq!(out.scheduled[0].start_pos, 0);
    let res = vec![StepResult {
        id: 1,
        accepted: 0,
        sampled: Vec::new(),
        drafts: Some(vec![7, 7]),
    }];
    s.update(&mut kv, &out, &res).unwrap();
    let out = s.schedule(&mut kv).unwrap();
    assert_eq!(
        (
            out.scheduled[0].start_pos,
            out.scheduled[0].num_tokens,
            out.scheduled[0].num_draft
        ),
        (10, 3, 2)
    );
    let res = vec![StepResult {
        id: 1,
        accepted: 2,
        sampled: Vec::new(),
        drafts: Some(Vec::new()),
    }];
    s.update(&mut kv, &out, &res).unwrap();
    let out = s.schedule(&mut kv).unwrap();
    assert_eq!(
        (
            out.scheduled[0].start_pos,
            out.scheduled[0].num_tokens,
            out.scheduled[0].num_draft
        ),
        (13, 1, 0)
    );
}

#[test]
fn glm53_dflash2_card_wedge_numbers() {
    // Model card: ~15,556 tokens need 1,013 blocks of a 1,011-block usable pool.
    let mut kv = glm_kv(CapPolicy::None);
    let mut s = FcfsScheduler::new(glm_cfg(AdmissionPolicy::Fcfs));
    s.add_request(&kv, req(1, 15_556, 64)).unwrap();
    let run = run_sim(
        &mut kv,
        &mut s,
        &mut glm_exec(1),
        SimLimits { max_steps: 1000 },
        &mut |_| {},
    )
    .unwrap();
    let w = run.wedged.expect("15,556 tokens wedge at block 2304");
    assert_eq!(w.kind, speclab_engine::StallKind::MustFitExceedsPool);
    assert_eq!(w.id, 1);
    assert_eq!(w.num_tokens, 15_556);
    assert_eq!(w.need_per_group, vec![7, 1, 8, 8, 8, 8, 973]);
    assert_eq!(w.total(), 1013);
    assert_eq!(w.usable, 1011);
    assert_eq!(w.binding_group, "drafter_swa");
    assert_eq!(run.steps, 0);
    assert!(run.admitted.is_empty());
    assert_eq!(kv.num_free_blocks(), 1011);
    assert!(w.to_string().contains("needs 1013 blocks"));
    // Waiting 1 / Running 0, as vLLM would show forever.
    assert_eq!((s.num_waiting(), s.num_running()), (1, 0));

    // The largest admissible prompt is 15,536; 15,537 needs 1,012.
    let mut kv = glm_kv(CapPolicy::None);
    let mut s = FcfsScheduler::new(glm_cfg(AdmissionPolicy::Fcfs));
    s.add_request(&kv, req(2, 15_537, 64)).unwrap();
    let out = s.schedule(&mut kv).unwrap();
    assert_eq!(out.wedged.map(|w| w.total()), Some(1012));
}

#[test]
fn glm53_dflash2_admits_15523_with_zero_margin() {
    for (n, need_swa) in [(15_523u64, 971u64), (15_536, 971)] {
        let mut kv = glm_kv(CapPolicy::None);
        let mut s = FcfsScheduler::new(glm_cfg(AdmissionPolicy::Fcfs));
        s.add_request(&kv, req(1, n, 256)).unwrap();
        let run = run_sim(
            &mut kv,
            &mut s,
            &mut glm_exec(2),
            SimLimits { max_steps: 1000 },
            &mut |_| {},
        )
        .unwrap();
        assert!(run.wedged.is_none(), "{n} tokens must be admitted");
        assert_eq!(run.admitted.len(), 1);
        let (step, a) = &run.admitted[0];
        assert_eq!(*step, 0);
        assert_eq!(a.need_per_group, vec![7, 1, 8, 8, 8, 8, need_swa]);
        assert_eq!(a.need_per_group.iter().sum::<u64>(), 1011, "zero margin");
        assert_eq!(run.finished.len(), 1);
        assert_eq!(run.preemptions, 0);
        assert!(run.spec.num_drafts > 0 && run.spec.mean_acceptance_length() > 1.0);
        assert_eq!(kv.num_free_blocks(), kv.usable_blocks());
    }
}

#[test]
fn reject_impossible_rejects_15556_and_serves_the_next() {
    let mut kv = glm_kv(CapPolicy::None);
    let mut s = FcfsScheduler::new(glm_cfg(AdmissionPolicy::RejectImpossible));
    s.add_request(&kv, req(1, 15_556, 64)).unwrap();
    s.add_request(&kv, req(2, 1_000, 64)).unwrap();
    assert_eq!(s.num_waiting(), 1);
    let run = run_sim(
        &mut kv,
        &mut s,
        &mut glm_exec(3),
        SimLimits { max_steps: 1000 },
        &mut |_| {},
    )
    .unwrap();
    assert!(run.wedged.is_none());
    assert_eq!(run.rejected.len(), 1);
    let r = &run.rejected[0];
    assert_eq!(
        (r.id, r.total(), r.usable, r.binding_group.as_str()),
        (1, 1013, 1011, "drafter_swa")
    );
    assert_eq!(
        run.finished.iter().map(|f| f.1).collect::<Vec<_>>(),
        vec![2]
    );
    assert_eq!(kv.num_free_blocks(), kv.usable_blocks());
    assert!(!s.has_work());
}

#[test]
fn window_plus_two_fix_serves_256k() {
    // The card's fix serves a 256,388-token prompt at block 2304.
    let mut kv = glm_kv(CapPolicy::WindowPlusTwo);
    let mut s = FcfsScheduler::new(glm_cfg(AdmissionPolicy::Fcfs));
    s.add_request(&kv, req(1, 256_388, 512)).unwrap();
    let run = run_sim(
        &mut kv,
        &mut s,
        &mut glm_exec(4),
        SimLimits { max_steps: 10_000 },
        &mut |_| {},
    )
    .unwrap();
    assert!(run.wedged.is_none());
    assert_eq!(run.finished.len(), 1);
    assert_eq!(
        run.peak_held_per_group[6], 130,
        "drafter ring capped at cdiv(2048, 16) + 2"
    );
    assert_eq!(kv.num_free_blocks(), kv.usable_blocks());
}

#[test]
fn add_request_validation_and_slot_reuse() {
    let mut kv = full_kv(4, 100, 64);
    let mut s = FcfsScheduler::new(cfg(100, 0, 0));
    assert_eq!(
        s.add_request(&kv, req(1, 0, 1)),
        Err(SchedulerError::EmptyPrompt { id: 1 })
    );
    assert_eq!(
        s.add_request(&kv, req(1, 4, 0)),
        Err(SchedulerError::ZeroMaxTokens { id: 1 })
    );
    assert!(matches!(
        s.add_request(&kv, req(1, 64, 1)),
        Err(SchedulerError::PromptTooLong { .. })
    ));
    s.add_request(&kv, req(1, 63, 1)).unwrap();
    assert_eq!(
        s.add_request(&kv, req(1, 4, 1)),
        Err(SchedulerError::DuplicateRequest { id: 1 })
    );
    s.add_request(&kv, req(2, 4, 1)).unwrap();
    assert_eq!(s.request(2).map(|r| r.slot), Some(ReqSlot(1)));
    while s.has_work() {
        step(&mut s, &mut kv, &mut no_accept());
    }
    s.add_request(&kv, req(3, 4, 1)).unwrap();
    assert_eq!(
        s.request(3).map(|r| r.slot),
        Some(ReqSlot(0)),
        "lowest freed slot is reused"
    );
    let bad = FcfsScheduler::new(SchedulerConfig {
        max_num_seqs: 0,
        ..cfg(1, 0, 0)
    })
    .add_request(&kv, req(9, 4, 1));
    assert!(matches!(
        bad,
        Err(SchedulerError::InvalidConfig {
            field: "max_num_seqs",
            ..
        })
    ));
    let e: speclab_engine::EngineError = SchedulerError::DuplicateRequest { id: 5 }.into();
    assert!(e.to_string().contains('5'));
}

#[test]
fn max_num_seqs_limits_admission() {
    let mut kv = full_kv(4, 100, 1024);
    let mut s = FcfsScheduler::new(SchedulerConfig {
        max_num_seqs: 2,
        ..cfg(1000, 0, 0)
    });
    for id in 0..5 {
        s.add_request(&kv, req(id, 4, 3)).unwrap();
    }
    let (out, _) = step(&mut s, &mut kv, &mut no_accept());
    assert_eq!(sched_tokens(&out), vec![(0, 4), (1, 4)]);
    assert_eq!((s.num_running(), s.num_waiting()), (2, 3));
}

#[test]
fn bad_step_results_are_errors() {
    let mut kv = full_kv(4, 100, 1024);
    let mut s = FcfsScheduler::new(cfg(100, 2, 2));
    s.add_request(&kv, req(1, 4, 8)).unwrap();
    let out = s.schedule(&mut kv).unwrap();
    assert!(s.update(&mut kv, &out, &[]).is_err());
    let res = exec(&mut no_accept(), &kv, &out);
    s.update(&mut kv, &out, &res).unwrap();
    let out = s.schedule(&mut kv).unwrap();
    let mut res = exec(&mut no_accept(), &kv, &out);
    res[0].accepted = 3; // only 2 drafts
    assert!(s.update(&mut kv, &out, &res).is_err());
}

#[test]
fn preemption_thrash_is_reported() {
    // Alone in 47 usable one-token blocks, a 45-token request at computed 44
    // needs 44 + 1 + 3 lookahead = 48 slots: it preempts itself, recomputes
    // one token a step, and fails at the same place again.
    let mut kv = full_kv(1, 48, 48);
    let mut s = FcfsScheduler::new(SchedulerConfig {
        max_num_seqs: 1,
        ..cfg(1, 3, 3)
    });
    s.add_request(&kv, req(0, 17, 29)).unwrap();
    let run = run_sim(
        &mut kv,
        &mut s,
        &mut no_accept(),
        SimLimits { max_steps: 10_000 },
        &mut |_| {},
    )
    .unwrap();
    let w = run.wedged.expect("thrash reported");
    assert_eq!(w.kind, speclab_engine::StallKind::PerStepLivelock);
    assert!(w.to_string().contains("preempts itself"), "{w}");
    assert_eq!((w.id, w.num_tokens, w.total(), w.usable), (0, 45, 45, 47));
    assert_eq!(run.preemptions, 2);
    assert!(!run.hit_step_limit);
    assert_eq!(kv.num_free_blocks(), kv.usable_blocks());
}
