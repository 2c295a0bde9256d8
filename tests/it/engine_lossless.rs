//! Greedy speculative decoding through the real engine is lossless.
//!
//! Property (proptest over target seeds, prompts, N, step budgets and batch sizes): with
//! every drafter (none, n-gram, MTP, DFlash v1 and v2 with a random micro drafter, and an
//! oracle that proposes the reference continuation with every third draft corrupted, which
//! exercises partial acceptance, bonus tokens and KDA rollback), the FCFS scheduler +
//! model executor, batched with chunked prefill, yields exactly the outputs of the target
//! alone without a drafter, request by request (so also: concurrency > 1 equals running
//! alone). Across each run the allocator holds (blocks in use == blocks the requests hold,
//! checked after every schedule; everything free at the end), and the metrics add up
//! (per step -> run -> per request, vLLM definitions).
//! A mismatch reports the target's top1 - top2 margin at the first divergence
//! (`speclab_engine::exec::mismatch_at`) so drift at a near tie can be told from a bug.

use std::collections::HashMap;

use crate::engine_support::*;
use proptest::prelude::*;
use speclab_engine::exec::{
    generate, mismatch_at, DrafterFactory, EngineOptions, EngineRequest, EngineRun,
};
use speclab_engine::kv::CapPolicy;
use speclab_engine::model::ModelWeights;

fn run(
    target: &ModelWeights,
    d: &dyn DrafterFactory,
    reqs: &[EngineRequest],
    budget: u64,
    seqs: usize,
    opts: &EngineOptions,
) -> EngineRun {
    let mut f = fcfs(budget, seqs);
    generate(target, d, reqs, opts, &mut f).unwrap()
}

fn assert_same(
    target: &ModelWeights,
    reqs: &[EngineRequest],
    reference: &EngineRun,
    got: &EngineRun,
    label: &str,
) {
    for (r, (a, b)) in reqs
        .iter()
        .zip(outputs(reference).iter().zip(outputs(got).iter()))
    {
        if a != b {
            let i = speclab_engine::exec::first_divergence(a, b).unwrap();
            let m = mismatch_at(target, r, a, b, i).unwrap();
            panic!("{label}: request {} diverges at output {i}: {m:?}\nreference {a:?}\ngot       {b:?}", r.id);
        }
    }
}

/// One proptest case: target, prompt lengths, output budget, N, step budget, batch size,
/// drafter window cap, EOS handling.
struct Case {
    target_seed: u64,
    lens: Vec<usize>,
    max_tokens: u64,
    n: usize,
    budget: u64,
    seqs: usize,
    cap: CapPolicy,
    ignore_eos: bool,
}

fn check_case(c: Case) {
    let Case {
        target_seed,
        ref lens,
        max_tokens,
        n,
        budget,
        seqs,
        cap,
        ignore_eos,
    } = c;
    let target = micro_target(target_seed);
    let ps = prompts(target_seed ^ 0xabc, lens, target.cfg.vocab_size);
    let reqs = requests(&ps, max_tokens);
    let opts = EngineOptions {
        ignore_eos,
        num_blocks: 256,
        collect_router: true,
        ..EngineOptions::default()
    };
    // The reference: no drafter, one request at a time, whole prompts.
    let reference = run(
        &target,
        &speclab_drafters::DrafterSpec::none(),
        &reqs,
        512,
        1,
        &opts,
    );
    assert_allocator_clean(&reference, "reference");
    assert_metrics_consistent(&reference, &reqs, "reference");
    assert_eq!(reference.spec.num_drafts, 0);
    let mut cands: Vec<(String, Box<dyn DrafterFactory>)> =
        all_drafters(&target, n, target_seed + 1, cap)
            .into_iter()
            .map(|(k, d)| (k.to_string(), Box::new(d) as Box<dyn DrafterFactory>))
            .collect();
    let oracle = Oracle {
        n,
        reference: reqs
            .iter()
            .zip(outputs(&reference))
            .map(|(r, o)| (r.id, (r.prompt.len(), o)))
            .collect::<HashMap<_, _>>(),
        corrupt_every: 3,
        with_q: false,
        vocab: target.cfg.vocab_size,
    };
    cands.push(("oracle".into(), Box::new(oracle)));
    for (name, d) in &cands {
        let label = format!("{name} N={n} budget={budget} seqs={seqs} seed={target_seed}");
        let got = run(&target, d.as_ref(), &reqs, budget, seqs, &opts);
        assert_allocator_clean(&got, &label);
        assert_metrics_consistent(&got, &reqs, &label);
        assert_same(&target, &reqs, &reference, &got, &label);
        // Some request outlives its first draft window (EOS can end one early): then the
        // oracle, right on two of every three drafts, gets drafts accepted.
        if name == "oracle" && outputs(&reference).iter().any(|o| o.len() > 4) {
            assert!(
                got.spec.num_accepted_tokens > 0,
                "{label}: the oracle's drafts are accepted"
            );
        }
        // Verify width and experts are recorded for decode steps.
        for s in &got.steps {
            assert!(
                s.verify_tokens == 0 || s.verify_experts.is_some(),
                "{label}: step {}",
                s.step
            );
        }
    }
}

proptest! {
    // 6 cases by default (debug builds); PROPTEST_CASES=N for a longer search.
    #![proptest_config(ProptestConfig { cases: cases(6), max_shrink_iters: 8, ..ProptestConfig::default() })]

    #[test]
    fn greedy_spec_decoding_equals_target_alone(
        target_seed in 0u64..1000,
        lens in proptest::collection::vec(2usize..20, 1..4),
        max_tokens in 3u64..12,
        n in 1usize..5,
        budget in 5u64..24,
        seqs in 1usize..4,
        cap in prop_oneof![Just(CapPolicy::None), Just(CapPolicy::Upstream), Just(CapPolicy::WindowPlusTwo)],
        ignore_eos in any::<bool>(),
    ) {
        check_case(Case { target_seed, lens, max_tokens, n, budget, seqs, cap, ignore_eos });
    }
}

#[test]
fn a_divergence_is_reported_with_the_target_margin() {
    use speclab_engine::exec::first_divergence;
    assert_eq!(first_divergence(&[1, 2, 3], &[1, 2, 3]), None);
    assert_eq!(first_divergence(&[1, 2, 3], &[1, 5, 3]), Some(1));
    assert_eq!(first_divergence(&[1, 2], &[1, 2, 3]), Some(2));
    let target = micro_target(5);
    let ps = prompts(1, &[9], target.cfg.vocab_size);
    let reqs = requests(&ps, 8);
    let opts = EngineOptions {
        ignore_eos: true,
        ..EngineOptions::default()
    };
    let reference = run(
        &target,
        &speclab_drafters::DrafterSpec::none(),
        &reqs,
        64,
        1,
        &opts,
    );
    let good = &outputs(&reference)[0];
    // A "buggy" output: token 4 replaced by the target's runner-up there.
    let mut bad = good.clone();
    bad[4] = (bad[4] + 1) % 500;
    let m = mismatch_at(&target, &reqs[0], good, &bad, 4).unwrap();
    assert_eq!(
        (m.index, m.reference_token, m.candidate_token),
        (4, Some(good[4]), Some(bad[4]))
    );
    // Greedy decoding emitted the teacher-forced argmax (up to drift at a near tie).
    assert!(m.top1_token == good[4] || m.margin < 1e-4, "{m:?}");
    assert!(m.margin >= 0.0 && m.top1_logit >= m.top2_logit);
    assert!(m.candidate_logit.unwrap() <= m.top1_logit);
    // A shorter candidate: the missing token is None.
    let m = mismatch_at(&target, &reqs[0], good, &good[..6], 6).unwrap();
    assert_eq!(
        (m.reference_token, m.candidate_token, m.candidate_logit),
        (Some(good[6]), None, None)
    );
}
