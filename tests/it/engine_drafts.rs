//! The drafters inside the engine draft what a from-scratch computation drafts.
//!
//! - MTP (docs/model.md §6, vLLM EAGLE/MTP proposer): for every proposal recorded during
//!   an engine run (batched, chunked prefill, spec verify with rejections), recompute from
//!   scratch on the committed tokens `S` (length `L`): target prefill of `S[..L-1]`, MTP
//!   over positions `0..L-1` with the next tokens `S[1..L]`, argmax, then autoregressive
//!   steps feeding back `MtpOut.hidden`; the drafts must be equal. This pins the first
//!   pass (which hidden / which next token / which position) and the KV consistency of the
//!   MTP cache (rejected drafts never leak into it).
//! - DFlash v1 / v2 (docs/dflash2.md §7): a fresh drafter with the target features of
//!   `S[..L-1]` appended in one go drafts from anchor `S[L-1]` at position `L-1`; equal.
//! - Every drafter: drafts depend only on the committed prefix: a batched, chunked run with
//!   preemptions (a small pool: recompute from position 0) proposes at every shared prefix
//!   what a run of each request alone proposes; outputs equal the reference.

use std::collections::HashMap;
use std::rc::Rc;

use crate::engine_support::*;
use speclab_drafters::{DFlash2, DFlash2Weights, DraftMode, DraftRequest, DrafterSpec};
use speclab_engine::exec::{generate, DrafterFactory, EngineOptions, EngineRun};
use speclab_engine::kv::manager::AllocArgs;
use speclab_engine::kv::{AllocOutcome, CapPolicy, KvCacheManager};
use speclab_engine::model::ops::argmax;
use speclab_engine::model::{
    ForwardOptions, LogitsRows, ModelRunner, ModelWeights, MtpChunk, SeqChunk,
};
use speclab_engine::{ReqSlot, RequestStatus, RequestView};

/// A fresh KV manager (target groups + optional DFlash group) with slot 0 allocated for
/// `tokens` positions.
fn fresh_kv(
    target: &ModelWeights,
    dflash: Option<&DFlash2Weights>,
    n: u32,
    tokens: u64,
) -> KvCacheManager {
    let mut layout = target.cfg.kv_layout(16, n, 128).unwrap();
    if let Some(w) = dflash {
        layout
            .groups
            .push(w.cfg.kv_group(8, CapPolicy::None).unwrap());
    }
    let mut kv = KvCacheManager::new(&layout, 128).unwrap();
    let view = RequestView {
        slot: ReqSlot(0),
        num_computed_tokens: 0,
        num_tokens: tokens,
        num_prompt_tokens: tokens,
        status: RequestStatus::Waiting,
        num_in_flight_tokens: 0,
    };
    let a = AllocArgs {
        num_new_tokens: tokens,
        num_lookahead_tokens: 0,
        full_sequence_must_fit: true,
        has_scheduled_reqs: false,
    };
    assert!(matches!(
        kv.allocate_slots(&view, a).unwrap(),
        AllocOutcome::Allocated(_)
    ));
    kv
}

/// MTP drafts from scratch for committed tokens `s`.
fn mtp_reference(target: &ModelWeights, s: &[u32], n: usize) -> Vec<u32> {
    let l = s.len();
    let kv = fresh_kv(target, None, n as u32, (l + n) as u64);
    let mut r = ModelRunner::new(target.clone(), &kv).unwrap();
    let out = r
        .forward(
            &kv,
            &[SeqChunk {
                slot: ReqSlot(0),
                tokens: &s[..l - 1],
                start_pos: 0,
                snapshot: false,
            }],
        )
        .unwrap();
    let opts = ForwardOptions {
        logits: LogitsRows::LastPerChunk,
        ..ForwardOptions::default()
    };
    let m = r
        .mtp_forward(
            &kv,
            &[MtpChunk {
                slot: ReqSlot(0),
                hidden: &out.hidden,
                next_tokens: &s[1..],
                start_pos: 0,
            }],
            &opts,
        )
        .unwrap();
    let h = target.cfg.hidden_size;
    let mut d = argmax(&m.logits) as u32;
    let mut drafts = vec![d];
    let mut prev = m.hidden[(l - 2) * h..].to_vec();
    for i in 1..n {
        let o = r
            .mtp_forward(
                &kv,
                &[MtpChunk {
                    slot: ReqSlot(0),
                    hidden: &prev,
                    next_tokens: &[d],
                    start_pos: l - 2 + i,
                }],
                &opts,
            )
            .unwrap();
        d = argmax(&o.logits) as u32;
        drafts.push(d);
        prev = o.hidden;
    }
    drafts
}

/// DFlash drafts from scratch for committed tokens `s`.
fn dflash_reference(
    target: &ModelWeights,
    w: &DFlash2Weights,
    s: &[u32],
    n: usize,
    mode: DraftMode,
) -> Vec<u32> {
    let l = s.len();
    let kv = fresh_kv(target, Some(w), n as u32, (l + n + 1) as u64);
    let mut r = ModelRunner::new(target.clone(), &kv).unwrap();
    let opts = ForwardOptions {
        collect_hidden: true,
        ..ForwardOptions::default()
    };
    let out = r
        .forward_with(
            &kv,
            &[SeqChunk {
                slot: ReqSlot(0),
                tokens: &s[..l - 1],
                start_pos: 0,
                snapshot: false,
            }],
            &opts,
        )
        .unwrap();
    let mut d = DFlash2::new(
        w.clone(),
        &target.cfg,
        &kv,
        DFlash2::find_group(&kv).unwrap(),
    )
    .unwrap();
    let f = d.features(&out, 0..l - 1).unwrap();
    d.append_context(&kv, ReqSlot(0), 0, &f).unwrap();
    let req = DraftRequest {
        slot: ReqSlot(0),
        anchor_token: s[l - 1],
        anchor_pos: l - 1,
        num_speculative_tokens: n,
        mode,
        temperature: 0.0,
        trace: false,
    };
    d.draft(&kv, target, &req, None).unwrap().tokens
}

fn recorded_run(
    target: &ModelWeights,
    d: &dyn DrafterFactory,
    reqs: &[speclab_engine::exec::EngineRequest],
    budget: u64,
    seqs: usize,
    blocks: u32,
) -> (EngineRun, Vec<Record>) {
    let rec = Recording {
        inner: d,
        log: Rc::default(),
    };
    let opts = EngineOptions {
        ignore_eos: true,
        num_blocks: blocks,
        ..EngineOptions::default()
    };
    let mut f = fcfs(budget, seqs);
    let run = generate(target, &rec, reqs, &opts, &mut f).unwrap();
    let log = rec.log.borrow().clone();
    (run, log)
}

#[test]
fn mtp_and_dflash_drafts_equal_a_from_scratch_recompute() {
    let target = micro_target(21);
    let w = micro_dflash(4);
    let n = 3;
    let ps = prompts(5, &[9, 17, 4], target.cfg.vocab_size);
    let reqs = requests(&ps, 10);
    let cfg = &target.cfg;
    let cases: Vec<(&str, DrafterSpec, Option<DraftMode>)> = vec![
        ("mtp", DrafterSpec::mtp(cfg, n).unwrap(), None),
        (
            "dflash1",
            DrafterSpec::dflash(w.clone(), cfg, n, DraftMode::V1, 8, CapPolicy::None).unwrap(),
            Some(DraftMode::V1),
        ),
        (
            "dflash2",
            DrafterSpec::dflash(
                w.clone(),
                cfg,
                n,
                DraftMode::V2,
                8,
                CapPolicy::WindowPlusTwo,
            )
            .unwrap(),
            Some(DraftMode::V2),
        ),
    ];
    for (name, spec, mode) in cases {
        let (run, log) = recorded_run(&target, &spec, &reqs, 7, 3, 256);
        assert_allocator_clean(&run, name);
        assert!(log.len() >= 10, "{name}: {} proposals recorded", log.len());
        for (id, s, drafts) in &log {
            let want = match mode {
                None => mtp_reference(&target, s, n),
                Some(m) => dflash_reference(&target, &w, s, n, m),
            };
            assert_eq!(
                &want[..drafts.len()],
                &drafts[..],
                "{name}: request {id} at {} committed tokens",
                s.len()
            );
        }
    }
}

#[test]
fn drafts_depend_only_on_the_committed_prefix_even_with_preemption() {
    let target = micro_target(7);
    let ps = prompts(11, &[20, 14, 26], target.cfg.vocab_size);
    let reqs = requests(&ps, 12);
    let reference = {
        let opts = EngineOptions {
            ignore_eos: true,
            ..EngineOptions::default()
        };
        let mut f = fcfs(512, 1);
        generate(&target, &DrafterSpec::none(), &reqs, &opts, &mut f).unwrap()
    };
    // Pools small enough to preempt (found by probing these prompts), big enough to finish.
    let pools = [
        ("none", 10u32),
        ("ngram", 12),
        ("mtp", 12),
        ("dflash1", 19),
        ("dflash2", 19),
    ];
    for (name, spec) in all_drafters(&target, 3, 2, CapPolicy::None) {
        let pool = pools.iter().find(|p| p.0 == name).unwrap().1;
        let (alone, log_a) = recorded_run(&target, &spec, &reqs, 512, 1, 256);
        let (squeezed, log_b) = recorded_run(&target, &spec, &reqs, 16, 3, pool);
        assert!(squeezed.preemptions > 0, "{name}: the small pool preempts");
        assert!(squeezed.complete(), "{name}: {:?}", squeezed.wedged);
        assert_allocator_clean(&squeezed, name);
        assert_metrics_consistent(&squeezed, &reqs, name);
        assert_eq!(
            outputs(&alone),
            outputs(&reference),
            "{name}: alone == no drafter"
        );
        assert_eq!(
            outputs(&squeezed),
            outputs(&reference),
            "{name}: batched + preempted == no drafter"
        );
        assert!(
            squeezed
                .requests
                .iter()
                .map(|r| r.num_preemptions)
                .sum::<u64>()
                > 0
        );
        let by_prefix: HashMap<(u64, Vec<u32>), Vec<u32>> =
            log_a.into_iter().map(|(id, s, d)| ((id, s), d)).collect();
        let mut shared = 0;
        for (id, s, d) in log_b {
            if let Some(a) = by_prefix.get(&(id, s.clone())) {
                let k = a.len().min(d.len());
                assert_eq!(
                    &a[..k],
                    &d[..k],
                    "{name}: request {id} at {} tokens",
                    s.len()
                );
                shared += 1;
            }
        }
        if name != "none" {
            assert!(shared > 5, "{name}: {shared} shared prefixes");
        }
    }
}
