//! Property tests of the KV cache manager, driven through the `kv replay`
//! engine (`speclab_experiments::replay::Replayer`).
//!
//! Random layouts (1-4 groups mixing full / sliding_window with caps
//! none|upstream|window_plus_two / state / ring_buffer; small block sizes,
//! windows, pools; optional watermark and max_in_flight_tokens) and random
//! *valid* op sequences (an intent stream interpreted against the live
//! requests, so every op is one vLLM accepts). Invariants, after every op:
//! - accounting: free + held + null = num_blocks (pool `is_held` / `free_ids`),
//!   the null block is neither held nor free, no id is both held and free and
//!   none is free twice;
//! - ownership: no non-null block id appears twice across all requests'
//!   tables, every table block is held, and every held block is in a table;
//! - free/preempt return exactly the request's held blocks;
//! - a must-fit allocation whose admission need (+ watermark) exceeds the free
//!   blocks is NoFit and changes nothing (free count, every table); any NoFit
//!   at most replaces blocks by the null block (vLLM's `remove_skipped_blocks`
//!   runs before the second check), freeing exactly those;
//! - a successful allocation hands out only blocks that were free;
//! - after freeing everything the pool is full.
//!
//! And monotonicity of admission: if a prompt of N tokens is admissible into an
//! empty pool (must-fit allocate of min(N, chunk) succeeds), so is N - 1.
//! Case counts are sized to keep the whole file well under ~10 s in debug.

use std::collections::HashSet;

use proptest::prelude::*;
use speclab_engine::kv::{AllocOutcome, CapPolicy, GroupKind, GroupSpec, KvLayout, NULL_BLOCK};
use speclab_engine::RequestStatus;
use speclab_experiments::replay::{Op, OpResult, Replayer};

// ---------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------

fn block_size() -> impl Strategy<Value = u32> {
    prop::sample::select(vec![1u32, 2, 3, 4, 8, 16])
}

fn group() -> impl Strategy<Value = GroupSpec> {
    let cap = prop_oneof![
        Just(CapPolicy::None),
        Just(CapPolicy::Upstream),
        Just(CapPolicy::WindowPlusTwo)
    ];
    prop_oneof![
        block_size().prop_map(|bs| GroupSpec::full("g", bs)),
        (block_size(), 1u32..=64, 0u32..=8, cap).prop_map(|(bs, w, extra, cap)| {
            let mut g = GroupSpec::sliding_window("g", bs, w, cap);
            g.extra_retained_tokens = extra;
            g
        }),
        (prop::option::of(block_size()), 0u32..=3).prop_map(|(bs, k)| {
            let mut g = GroupSpec::state("g", k);
            g.block_size = bs.map(|b| b * 8);
            g
        }),
        block_size().prop_map(|bs| GroupSpec::ring_buffer("g", bs)),
    ]
}

fn layout() -> impl Strategy<Value = KvLayout> {
    (
        prop::collection::vec(group(), 1..=4),
        16u32..=256,
        prop::option::of(1u32..=128),
        prop_oneof![3 => Just(0.0), 1 => Just(0.1)],
        2u32..=96,
    )
        .prop_map(|(mut groups, mml, mift, watermark, num_blocks)| {
            for (i, g) in groups.iter_mut().enumerate() {
                g.name = format!("g{i}");
            }
            KvLayout {
                num_blocks: Some(num_blocks),
                kv_cache_memory_bytes: None,
                max_model_len: mml,
                max_in_flight_tokens: mift,
                watermark,
                groups,
            }
        })
}

/// One intent: an action and raw numbers, turned into a valid op against the
/// live requests by [`Driver::op`].
#[derive(Debug, Clone, Copy)]
struct Intent {
    action: u8,
    a: u32,
    b: u32,
    flag1: bool,
    flag2: bool,
}

fn intents(max: usize) -> impl Strategy<Value = Vec<Intent>> {
    prop::collection::vec(
        (
            0u8..100,
            any::<u32>(),
            any::<u32>(),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(action, a, b, flag1, flag2)| Intent {
                action,
                a,
                b,
                flag1,
                flag2,
            }),
        1..=max,
    )
}

/// Turns intents into ops vLLM accepts and a scheduler could emit: the
/// computed count only advances over slots the request's last successful
/// allocation covered (`pending`), rollbacks never go below 0, and neither
/// prompt + outputs nor computed tokens pass max_model_len. (Letting computed
/// run ahead of the allocated table makes vLLM's own `allocate_new_blocks`
/// ask the pool for more than `get_num_blocks_to_allocate` counted; see the
/// `computed_ahead_of_allocation_is_an_error_not_a_panic` test.)
#[derive(Debug, Default)]
struct Driver {
    next_id: u32,
    /// Request id -> scheduled tokens not yet marked computed.
    pending: std::collections::HashMap<String, u64>,
}

impl Driver {
    fn op(&mut self, it: Intent, r: &Replayer, mml: u32) -> Op {
        let mut live: Vec<&str> = r.requests().map(|(k, _)| k).collect();
        live.sort_unstable();
        let mml = u64::from(mml);
        if live.is_empty() || it.action < 15 {
            let req = format!("r{}", self.next_id);
            self.next_id += 1;
            // Mostly short prompts, sometimes up to max_model_len.
            let cap = if it.flag1 { mml } else { mml.min(48) };
            return Op::Add {
                req,
                prompt_len: 1 + u64::from(it.a) % cap,
            };
        }
        let req = live[it.a as usize % live.len()].to_string();
        let st = *r.request(&req).expect("live request");
        let pending = self.pending.get(&req).copied().unwrap_or(0);
        match it.action {
            15..=59 => {
                // A prefill chunk or a decode step with drafts.
                let remaining = st.num_tokens.saturating_sub(st.num_computed_tokens);
                let num_new_tokens = if remaining > 0 && it.flag2 {
                    1 + u64::from(it.b) % remaining
                } else {
                    1 + u64::from(it.b % 8)
                };
                Op::Allocate {
                    req,
                    num_new_tokens,
                    lookahead: u64::from((it.b >> 8) % 5),
                    must_fit: it.flag1,
                    has_scheduled_reqs: !(it.b >> 16).is_multiple_of(3),
                }
            }
            60..=74 if pending > 0 && !(it.flag1 && it.flag2) => Op::Computed {
                req,
                n: (1 + u64::from(it.b) % pending) as i64,
            },
            60..=74 if st.num_computed_tokens > 0 => {
                // Rejected drafts: roll back (never below 0).
                Op::Computed {
                    req,
                    n: -((1 + u64::from(it.b) % st.num_computed_tokens.min(8)) as i64),
                }
            }
            60..=84 => Op::Append {
                req,
                n: u64::from(it.b % 4).min(mml.saturating_sub(st.num_tokens)),
            },
            85..=89 => Op::Preempt { req },
            _ => Op::Free { req },
        }
    }

    /// Update `pending` after `op` was applied with result `res`.
    fn applied(&mut self, op: &Op, res: &OpResult, r: &Replayer, mml: u32) {
        match op {
            Op::Allocate {
                req,
                num_new_tokens,
                ..
            } => {
                let computed = r.request(req).map_or(0, |s| s.num_computed_tokens);
                let p = match res.blocks {
                    Some(AllocOutcome::Allocated(_)) => {
                        (*num_new_tokens).min(u64::from(mml).saturating_sub(computed))
                    }
                    _ => 0,
                };
                self.pending.insert(req.clone(), p);
            }
            Op::Computed { req, n } if *n > 0 => {
                if let Some(p) = self.pending.get_mut(req) {
                    *p = p.saturating_sub(*n as u64);
                }
            }
            Op::Preempt { req } | Op::Free { req } => {
                self.pending.remove(req);
            }
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------
// Invariant checks
// ---------------------------------------------------------------------------

/// Every request's table per group (null blocks included), keyed by request id.
type Tables = Vec<(String, Vec<Vec<u32>>)>;

fn snapshot(r: &Replayer) -> Tables {
    let ng = r.kv().groups().len();
    let mut v: Tables = r
        .requests()
        .map(|(id, st)| {
            (
                id.to_string(),
                (0..ng).map(|g| r.kv().table(g, st.slot).to_vec()).collect(),
            )
        })
        .collect();
    v.sort();
    v
}

fn held_by(r: &Replayer, id: &str) -> u64 {
    r.request(id)
        .map(|st| r.kv().held_blocks(st.slot).iter().sum())
        .unwrap_or(0)
}

fn check_accounting(r: &Replayer) -> Result<(), TestCaseError> {
    let pool = r.kv().pool();
    let n = pool.num_blocks();
    let held: HashSet<u32> = (0..n).filter(|&b| pool.is_held(b)).collect();
    let free: Vec<u32> = pool.free_ids().collect();
    let free_set: HashSet<u32> = free.iter().copied().collect();
    prop_assert_eq!(free.len(), free_set.len(), "a block is free twice");
    prop_assert_eq!(free.len() as u64, r.kv().num_free_blocks());
    prop_assert!(
        !held.contains(&NULL_BLOCK) && !free_set.contains(&NULL_BLOCK),
        "null block handed out"
    );
    prop_assert!(held.is_disjoint(&free_set), "a block is both held and free");
    prop_assert_eq!(
        held.len() as u64 + free.len() as u64 + 1,
        u64::from(n),
        "free + held + null != total"
    );
    prop_assert!(free.iter().all(|&b| b < n));

    let mut seen = HashSet::new();
    for (id, tables) in snapshot(r) {
        for t in &tables {
            for &b in t.iter().filter(|&&b| b != NULL_BLOCK) {
                prop_assert!(seen.insert(b), "block {} appears twice (request {})", b, id);
                prop_assert!(
                    held.contains(&b),
                    "block {} in {}'s table is not held",
                    b,
                    id
                );
            }
        }
    }
    prop_assert_eq!(seen.len(), held.len(), "a held block is in no table (leak)");
    Ok(())
}

/// Admission need of a must-fit allocate, exactly as the gate computes it.
fn gate_fails(r: &Replayer, layout: &KvLayout, id: &str, has_scheduled: bool) -> bool {
    let st = r.request(id).expect("live");
    let need: u64 = r.kv().admission_need(&st.view()).iter().sum();
    let wm = if has_scheduled
        && matches!(st.status, RequestStatus::Waiting | RequestStatus::Preempted)
    {
        (layout.watermark * f64::from(layout.num_blocks.unwrap_or(0))) as u64
    } else {
        0
    };
    need + wm > r.kv().num_free_blocks()
}

fn run_sequence(layout: &KvLayout, intents: &[Intent]) -> Result<(), TestCaseError> {
    let mut r = Replayer::new(layout).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mml = layout.max_model_len;
    let mut d = Driver::default();
    check_accounting(&r)?;
    for it in intents {
        let op = d.op(*it, &r, mml);
        let free_before = r.kv().num_free_blocks();
        let tables_before = snapshot(&r);
        let held_before = held_by(&r, op.req());
        let free_set_before: HashSet<u32> = r.kv().pool().free_ids().collect();
        let gate = match &op {
            Op::Allocate {
                req,
                must_fit: true,
                has_scheduled_reqs,
                ..
            } => gate_fails(&r, layout, req, *has_scheduled_reqs),
            _ => false,
        };

        let res = r
            .apply(&op)
            .map_err(|e| TestCaseError::fail(format!("valid op refused: {op}: {e}")))?;
        d.applied(&op, &res, &r, mml);
        prop_assert_eq!(res.free, r.kv().num_free_blocks());
        check_accounting(&r)?;

        match (&op, &res.blocks) {
            (Op::Free { .. } | Op::Preempt { .. }, _) => {
                prop_assert_eq!(
                    r.kv().num_free_blocks(),
                    free_before + held_before,
                    "{} did not return all {} blocks",
                    op,
                    held_before
                );
                prop_assert_eq!(held_by(&r, op.req()), 0);
            }
            (Op::Allocate { .. }, Some(AllocOutcome::NoFit)) => {
                let after = snapshot(&r);
                if gate {
                    prop_assert_eq!(
                        r.kv().num_free_blocks(),
                        free_before,
                        "must-fit NoFit changed the free count: {}",
                        op
                    );
                    prop_assert_eq!(
                        &after,
                        &tables_before,
                        "must-fit NoFit changed a table: {}",
                        op
                    );
                } else {
                    // Second-stage NoFit: only remove_skipped_blocks may have run.
                    let mut nulled = 0u64;
                    prop_assert_eq!(after.len(), tables_before.len());
                    for ((_, ta), (_, tb)) in after.iter().zip(&tables_before) {
                        for (ga, gb) in ta.iter().zip(tb) {
                            prop_assert_eq!(
                                ga.len(),
                                gb.len(),
                                "NoFit grew or shrank a table: {}",
                                op
                            );
                            for (&x, &y) in ga.iter().zip(gb) {
                                prop_assert!(
                                    x == y || x == NULL_BLOCK,
                                    "NoFit replaced block {} by {}: {}",
                                    y,
                                    x,
                                    op
                                );
                                nulled += u64::from(x != y);
                            }
                        }
                    }
                    prop_assert_eq!(r.kv().num_free_blocks(), free_before + nulled);
                }
            }
            (Op::Allocate { .. }, Some(AllocOutcome::Allocated(new))) => {
                prop_assert!(!gate, "must-fit gate should have refused {}", op);
                prop_assert_eq!(new.len(), layout.groups.len());
                // A new block was free before the op, or was this request's own
                // block just released by remove_skipped_blocks; never another's.
                for &b in new.iter().flatten() {
                    let other_owner = tables_before
                        .iter()
                        .any(|(id, t)| id != op.req() && t.iter().flatten().any(|&x| x == b));
                    prop_assert!(
                        !other_owner,
                        "block {} handed out while owned by another request: {}",
                        b,
                        op
                    );
                    let own_before = tables_before
                        .iter()
                        .any(|(id, t)| id == op.req() && t.iter().flatten().any(|&x| x == b));
                    prop_assert!(
                        free_set_before.contains(&b) || own_before,
                        "block {} was neither free nor recycled: {}",
                        b,
                        op
                    );
                    prop_assert!(r.kv().pool().is_held(b));
                }
            }
            _ => {}
        }
    }
    // Free everything: the pool must be full again.
    let ids: Vec<String> = r.requests().map(|(k, _)| k.to_string()).collect();
    for id in ids {
        r.apply(&Op::Free { req: id })
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        check_accounting(&r)?;
    }
    prop_assert_eq!(
        r.kv().num_free_blocks(),
        r.kv().usable_blocks(),
        "pool not full after freeing everything"
    );
    Ok(())
}

/// Whether a prompt of `n` tokens is admitted into an empty pool with a first chunk of `chunk`.
fn admissible(layout: &KvLayout, n: u64, chunk: u64) -> Result<bool, TestCaseError> {
    let mut r = Replayer::new(layout).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let ok = |e: speclab_experiments::ExperimentError| TestCaseError::fail(e.to_string());
    r.apply(&Op::Add {
        req: "p".into(),
        prompt_len: n,
    })
    .map_err(ok)?;
    let res = r
        .apply(&Op::Allocate {
            req: "p".into(),
            num_new_tokens: n.min(chunk),
            lookahead: 0,
            must_fit: true,
            has_scheduled_reqs: false,
        })
        .map_err(ok)?;
    Ok(matches!(res.blocks, Some(AllocOutcome::Allocated(_))))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_on_random_traces(l in layout(), its in intents(160)) {
        run_sequence(&l, &its)?;
    }

    #[test]
    fn admission_is_monotone_in_prompt_length(l in layout(), frac in 0.0f64..1.0, chunk in 1u64..=256) {
        let mml = u64::from(l.max_model_len);
        let n = 2 + ((mml - 2) as f64 * frac) as u64;
        if admissible(&l, n, chunk)? {
            prop_assert!(admissible(&l, n - 1, chunk)?, "{} tokens admissible but {} not (chunk {})", n, n - 1, chunk);
        }
    }
}

/// The generator must actually exercise what the invariants are about: across
/// a fixed set of seeds we see NoFits from the gate, second-stage NoFits,
/// preemptions, frees, every group kind and every cap policy.
#[test]
fn generator_covers_the_interesting_cases() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        proptest::test_runner::TestRng::deterministic_rng(
            proptest::test_runner::RngAlgorithm::ChaCha,
        ),
    );
    let (mut gate_nofit, mut late_nofit, mut allocs, mut preempts) = (0, 0, 0, 0);
    let mut kinds = HashSet::new();
    let mut caps = HashSet::new();
    for _ in 0..300 {
        let l = layout().new_tree(&mut runner).expect("layout").current();
        let its = intents(160)
            .new_tree(&mut runner)
            .expect("intents")
            .current();
        for g in &l.groups {
            kinds.insert(format!("{:?}", g.kind));
            if g.kind == GroupKind::SlidingWindow {
                caps.insert(format!("{:?}", g.cap));
            }
        }
        let mut r = Replayer::new(&l).expect("layout");
        let mut d = Driver::default();
        for it in its {
            let op = d.op(it, &r, l.max_model_len);
            let gate = matches!(&op, Op::Allocate { req, must_fit: true, has_scheduled_reqs, .. } if gate_fails(&r, &l, req, *has_scheduled_reqs));
            let res = r.apply(&op).expect("valid op");
            d.applied(&op, &res, &r, l.max_model_len);
            match res.blocks {
                Some(AllocOutcome::NoFit) if gate => gate_nofit += 1,
                Some(AllocOutcome::NoFit) => late_nofit += 1,
                Some(AllocOutcome::Allocated(_)) => allocs += 1,
                None => {}
            }
            preempts += u32::from(matches!(op, Op::Preempt { .. }));
        }
    }
    assert_eq!(kinds.len(), 4, "{kinds:?}");
    assert_eq!(caps.len(), 3, "{caps:?}");
    eprintln!("coverage: gate NoFit {gate_nofit}, late NoFit {late_nofit}, allocations {allocs}, preempts {preempts}");
    assert!(
        gate_nofit > 100 && late_nofit > 100 && allocs > 1000 && preempts > 100,
        "gate {gate_nofit} late {late_nofit} allocs {allocs} preempts {preempts}"
    );
}

/// Outside what a scheduler emits (computed tokens running ahead of the
/// allocated table, so skipped blocks exceed held ones), the count and the
/// allocation disagree exactly as in vLLM 0.33.0 (where `get_new_blocks`
/// asserts). Here it must be an error that names the op, never a panic.
#[test]
fn computed_ahead_of_allocation_is_an_error_not_a_panic() {
    let mut g1 = GroupSpec::state("s8", 0);
    g1.block_size = Some(8);
    let l = KvLayout {
        num_blocks: Some(2),
        kv_cache_memory_bytes: None,
        max_model_len: 17,
        max_in_flight_tokens: None,
        watermark: 0.0,
        groups: vec![GroupSpec::state("s", 1), g1],
    };
    let mut r = Replayer::new(&l).expect("layout");
    r.apply(&Op::Add {
        req: "a".into(),
        prompt_len: 1,
    })
    .expect("add");
    // Computed tokens beyond the allocated slots are refused up front, naming the op.
    let e = r
        .apply(&Op::Computed {
            req: "a".into(),
            n: 25,
        })
        .expect_err("computed ahead of allocation")
        .to_string();
    assert!(e.contains("op 1") && e.contains("token slots"), "{e}");
    assert_eq!(r.request("a").map(|s| s.num_computed_tokens), Some(0));
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        r.apply(&Op::Allocate {
            req: "a".into(),
            num_new_tokens: 1,
            lookahead: 0,
            must_fit: false,
            has_scheduled_reqs: false,
        })
    }));
    match res {
        Ok(Ok(rec)) => assert!(rec.blocks.is_some()),
        Ok(Err(e)) => assert!(e.to_string().contains("op 1"), "{e}"),
        Err(_) => panic!("allocate panicked"),
    }
}
