//! Parity of the Rust model with the reference goldens (docs/model.md §12).
//!
//! For the bf16 and W4A16 micro checkpoints of `tests/fixtures/model/`: prefill logits of
//! the 3 prompts, per-layer hidden states / final hidden / router choices of prompt 0,
//! MTP logits and MTP router choices, the 16-token greedy continuation token for token
//! (and its logits for prompt 0). Then the engine's own consistency: prefill vs
//! token-by-token decode vs chunked prefill, batched vs single requests, and speculative
//! verify with snapshot + `commit_state` (rollback) vs the plain sequence. All KV goes
//! through a real `KvCacheManager` built from `cfg.kv_layout(...)`, allocated with
//! `allocate_slots` as a scheduler would. Metric: `max|a-b| / max|b|` (§1.6); every
//! value is printed (`cargo test --test model_parity -- --nocapture`).

use std::path::{Path, PathBuf};

use speclab_engine::kv::manager::AllocArgs;
use speclab_engine::kv::{AllocOutcome, KvCacheManager};
use speclab_engine::model::checkpoint::Checkpoint;
use speclab_engine::model::ops::{argmax, rel_err};
use speclab_engine::model::{
    ForwardOptions, LogitsRows, ModelRunner, ModelWeights, MtpChunk, SeqChunk,
};
use speclab_engine::{ReqSlot, RequestStatus, RequestView};

const CONTRACT: f32 = 1e-2; // docs/model.md §1.6
const SELF_TOL: f32 = 1e-4; // prefill vs decode / chunked / rollback
const BLOCK: u32 = 16;
const SPEC: u32 = 4;
const POOL: u32 = 64;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/model")
}

fn golden() -> Checkpoint {
    Checkpoint::open_file(&fixture().join("golden.safetensors")).expect("golden")
}

fn g32(g: &Checkpoint, name: &str) -> Vec<f32> {
    g.f32_any_shape(name).unwrap_or_else(|e| panic!("{e}")).0
}

fn gi32(g: &Checkpoint, name: &str) -> Vec<i32> {
    g.i32_any_shape(name).unwrap_or_else(|e| panic!("{e}")).0
}

fn prompt(g: &Checkpoint, p: usize) -> Vec<u32> {
    gi32(g, &format!("prompt{p}.tokens"))
        .into_iter()
        .map(|t| t as u32)
        .collect()
}

fn load(variant: &str) -> ModelWeights {
    let dir = if variant == "bf16" {
        fixture()
    } else {
        fixture().join("w4a16")
    };
    ModelWeights::load(&dir).unwrap_or_else(|e| panic!("{e}"))
}

/// A scheduler-like driver: one KV manager, a runner, and per-request computed counts.
struct Engine {
    kv: KvCacheManager,
    runner: ModelRunner,
    computed: Vec<u64>,
}

impl Engine {
    fn new(w: ModelWeights) -> Self {
        let layout = w.cfg.kv_layout(BLOCK, SPEC, POOL).unwrap();
        let kv = KvCacheManager::new(&layout, POOL).unwrap();
        let runner = ModelRunner::new(w, &kv).unwrap();
        Self {
            kv,
            runner,
            computed: vec![0; 8],
        }
    }
    /// allocate_slots for `n` new tokens of request `slot` (vLLM: computed + new must have slots).
    fn alloc(&mut self, slot: u32, n: usize) {
        let c = self.computed[slot as usize];
        let view = RequestView {
            slot: ReqSlot(slot),
            num_computed_tokens: c,
            num_tokens: c + n as u64,
            num_prompt_tokens: c + n as u64,
            status: if c == 0 {
                RequestStatus::Waiting
            } else {
                RequestStatus::Running
            },
            num_in_flight_tokens: 0,
        };
        let args = AllocArgs {
            num_new_tokens: n as u64,
            num_lookahead_tokens: 0,
            full_sequence_must_fit: c == 0,
            has_scheduled_reqs: false,
        };
        match self.kv.allocate_slots(&view, args).unwrap() {
            AllocOutcome::Allocated(_) => {}
            AllocOutcome::NoFit => panic!("pool too small"),
        }
    }
    /// Run one chunk for one request; returns (logits [T, V], hidden [T, H]).
    fn run(&mut self, slot: u32, tokens: &[u32], snapshot: bool) -> (Vec<f32>, Vec<f32>) {
        self.alloc(slot, tokens.len());
        let start = self.computed[slot as usize] as usize;
        let out = self
            .runner
            .forward(
                &self.kv,
                &[SeqChunk {
                    slot: ReqSlot(slot),
                    tokens,
                    start_pos: start,
                    snapshot,
                }],
            )
            .unwrap();
        self.computed[slot as usize] += tokens.len() as u64;
        (out.logits, out.hidden)
    }
    /// After a snapshot verify of `t` tokens keep `accepted + 1` (vLLM rolls back num_computed_tokens).
    fn commit(&mut self, slot: u32, t: usize, accepted: usize) {
        self.runner
            .commit_state(&self.kv, ReqSlot(slot), accepted)
            .unwrap();
        self.computed[slot as usize] -= (t - accepted - 1) as u64;
    }
}

fn report(label: &str, e: f32, tol: f32) {
    println!("{label:48} rel err {e:.3e}");
    assert!(e < tol, "{label}: relative error {e:.3e} >= {tol:.0e}");
}

#[test]
fn goldens_bf16_and_w4a16() {
    let g = golden();
    let mut worst = 0.0f32;
    for variant in ["bf16", "w4a16"] {
        let w = load(variant);
        let cfg = w.cfg.clone();
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let mut eng = Engine::new(w);
        for p in 0..3 {
            let toks = prompt(&g, p);
            let t = toks.len();
            let key = format!("{variant}.prompt{p}");
            let slot = p as u32;
            eng.alloc(slot, t);
            let opts = ForwardOptions {
                collect_hidden: true,
                collect_router: true,
                ..Default::default()
            };
            let out = eng
                .runner
                .forward_with(
                    &eng.kv,
                    &[SeqChunk {
                        slot: ReqSlot(slot),
                        tokens: &toks,
                        start_pos: 0,
                        snapshot: false,
                    }],
                    &opts,
                )
                .unwrap();
            eng.computed[slot as usize] = t as u64;
            let e = rel_err(&out.logits, &g32(&g, &format!("{key}.logits")));
            worst = worst.max(e);
            report(&format!("{key}.logits"), e, CONTRACT);
            if p == 0 {
                let hs = out.per_layer_hidden.as_ref().unwrap();
                let gh = g32(&g, &format!("{key}.hidden_states"));
                for l in 0..=cfg.num_hidden_layers {
                    let r = l * t * h..(l + 1) * t * h;
                    report(
                        &format!("{key}.hidden_states[{l}]"),
                        rel_err(&hs[r.clone()], &gh[r]),
                        CONTRACT,
                    );
                }
                report(
                    &format!("{key}.final_hidden"),
                    rel_err(&out.hidden, &g32(&g, &format!("{key}.final_hidden"))),
                    CONTRACT,
                );
                let router = out.router.as_ref().unwrap();
                let ids: Vec<i32> = router
                    .iter()
                    .flat_map(|r| r.ids.iter().map(|&x| x as i32))
                    .collect();
                assert_eq!(
                    ids,
                    gi32(&g, &format!("{key}.router_topk_ids")),
                    "{key} router ids"
                );
                let wts: Vec<f32> = router.iter().flat_map(|r| r.weights.clone()).collect();
                report(
                    &format!("{key}.router_topk_weights"),
                    rel_err(&wts, &g32(&g, &format!("{key}.router_topk_weights"))),
                    CONTRACT,
                );
            }
            // Greedy continuation: greedy[0] from the prefill, then one decode step per token.
            let gg = gi32(&g, &format!("{key}.greedy"));
            let mut rows = out.logits[(t - 1) * v..t * v].to_vec();
            let mut toks_out = vec![argmax(&rows) as i32];
            let mut cont = rows.clone();
            for _ in 1..gg.len() {
                let last = *toks_out.last().unwrap() as u32;
                let (l, _) = eng.run(slot, &[last], false);
                rows = l;
                toks_out.push(argmax(&rows) as i32);
                cont.extend_from_slice(&rows);
            }
            assert_eq!(toks_out, gg, "{key} greedy continuation");
            println!(
                "{:48} identical ({} tokens)",
                format!("{key}.greedy"),
                gg.len()
            );
            if p == 0 {
                let e = rel_err(&cont, &g32(&g, &format!("{key}.continuation_logits")));
                worst = worst.max(e);
                report(&format!("{key}.continuation_logits"), e, CONTRACT);
            }
            // MTP over every prefill position: row t gets h_t and prompt[t+1] (greedy[0] last).
            let mut next: Vec<u32> = toks[1..].to_vec();
            next.push(gg[0] as u32);
            let opts = ForwardOptions {
                collect_router: true,
                ..Default::default()
            };
            let m = eng
                .runner
                .mtp_forward(
                    &eng.kv,
                    &[MtpChunk {
                        slot: ReqSlot(slot),
                        hidden: &out.hidden,
                        next_tokens: &next,
                        start_pos: 0,
                    }],
                    &opts,
                )
                .unwrap();
            let e = rel_err(&m.logits, &g32(&g, &format!("{key}.mtp_logits")));
            worst = worst.max(e);
            report(&format!("{key}.mtp_logits"), e, CONTRACT);
            if p == 0 {
                let ids: Vec<i32> = m.router.as_ref().unwrap()[0]
                    .ids
                    .iter()
                    .map(|&x| x as i32)
                    .collect();
                assert_eq!(
                    ids,
                    gi32(&g, &format!("{key}.mtp_router_topk_ids")),
                    "{key} MTP router ids"
                );
            }
        }
    }
    println!("worst logits relative error over all goldens: {worst:.3e}");
}

#[test]
fn prefill_decode_chunked_batched_agree() {
    let g = golden();
    for variant in ["bf16", "w4a16"] {
        let w = load(variant);
        let mut eng = Engine::new(w);
        let p2 = prompt(&g, 2);
        let p1 = prompt(&g, 1);
        let (pre, _) = eng.run(0, &p2, false);
        // token by token
        let mut dec = Vec::new();
        for &t in &p2 {
            dec.extend(eng.run(1, &[t], false).0);
        }
        report(
            &format!("{variant} prefill vs decode"),
            rel_err(&dec, &pre),
            SELF_TOL,
        );
        // chunked [5], [3], [rest] (a speculative verify's shape)
        let mut ch = Vec::new();
        for part in [&p2[..5], &p2[5..8], &p2[8..]] {
            ch.extend(eng.run(2, part, false).0);
        }
        report(
            &format!("{variant} prefill vs chunked [5],[3],[rest]"),
            rel_err(&ch, &pre),
            SELF_TOL,
        );
        // batched: two requests in one forward, one of them mid-sequence
        let (pre1, _) = eng.run(3, &p1, false);
        eng.run(4, &p2[..10], false);
        eng.alloc(5, p1.len());
        eng.alloc(4, p2.len() - 10);
        let out = eng
            .runner
            .forward(
                &eng.kv,
                &[
                    SeqChunk {
                        slot: ReqSlot(5),
                        tokens: &p1,
                        start_pos: 0,
                        snapshot: false,
                    },
                    SeqChunk {
                        slot: ReqSlot(4),
                        tokens: &p2[10..],
                        start_pos: 10,
                        snapshot: false,
                    },
                ],
            )
            .unwrap();
        let v = eng.runner.config().vocab_size;
        report(
            &format!("{variant} batched request A vs alone"),
            rel_err(&out.logits[..p1.len() * v], &pre1),
            SELF_TOL,
        );
        report(
            &format!("{variant} batched request B (mid-sequence) vs prefill"),
            rel_err(&out.logits[p1.len() * v..], &pre[10 * v..]),
            SELF_TOL,
        );
        // Last-row logits only (serving prefill) equal the last rows of the full logits.
        eng.alloc(6, p2.len());
        let last = eng
            .runner
            .forward_with(
                &eng.kv,
                &[SeqChunk {
                    slot: ReqSlot(6),
                    tokens: &p2,
                    start_pos: 0,
                    snapshot: false,
                }],
                &ForwardOptions {
                    logits: LogitsRows::LastPerChunk,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(last.logits.len(), v);
        report(
            &format!("{variant} LastPerChunk vs last row"),
            rel_err(&last.logits, &pre[(p2.len() - 1) * v..]),
            SELF_TOL,
        );
        // MTP over all positions at once vs one position at a time (docs/model.md §12 check).
        let h = eng.runner.config().hidden_size;
        let hidden = last.hidden;
        let mut next: Vec<u32> = p2[1..].to_vec();
        next.push(7);
        let all = eng
            .runner
            .mtp_forward(
                &eng.kv,
                &[MtpChunk {
                    slot: ReqSlot(6),
                    hidden: &hidden,
                    next_tokens: &next,
                    start_pos: 0,
                }],
                &ForwardOptions::default(),
            )
            .unwrap();
        let mut steps = Vec::new();
        for t in 0..p2.len() {
            let chunk = MtpChunk {
                slot: ReqSlot(6),
                hidden: &hidden[t * h..(t + 1) * h],
                next_tokens: &next[t..=t],
                start_pos: t,
            };
            steps.extend(
                eng.runner
                    .mtp_forward(&eng.kv, &[chunk], &ForwardOptions::default())
                    .unwrap()
                    .logits,
            );
        }
        report(
            &format!("{variant} MTP all positions vs one at a time"),
            rel_err(&steps, &all.logits),
            SELF_TOL,
        );
    }
}

#[test]
fn snapshot_verify_then_rollback_equals_plain_sequence() {
    let g = golden();
    for variant in ["bf16", "w4a16"] {
        let w = load(variant);
        let v = w.cfg.vocab_size;
        let mut eng = Engine::new(w);
        let s = prompt(&g, 2); // 24 tokens
        let (plain, _) = eng.run(0, &s, false);
        // Verify rounds: (position of the last committed token, drafts that are right, junk drafts).
        // Each chunk = [s[p], s[p+1..p+1+good], junk...] of length <= 1 + SPEC.
        for (slot, rounds) in [
            (
                1u32,
                vec![(8usize, 2usize, 2usize), (11, 0, 4), (12, 4, 0), (17, 1, 3)],
            ),
            (2, vec![(3, 3, 1), (7, 0, 0), (8, 2, 1)]),
        ] {
            let first = rounds[0].0;
            let mut rows = eng.run(slot, &s[..first], false).0;
            let mut pos = first;
            for (p, good, junk) in rounds {
                assert_eq!(p, pos);
                let mut chunk = s[p..=p + good].to_vec();
                chunk.extend((0..junk).map(|j| (7 + 13 * j as u32) % 500));
                let t = chunk.len();
                let (l, _) = eng.run(slot, &chunk, true);
                eng.commit(slot, t, good);
                rows.extend_from_slice(&l[..(good + 1) * v]);
                pos += good + 1;
            }
            let rest = eng.run(slot, &s[pos..], false).0;
            rows.extend(rest);
            report(
                &format!("{variant} snapshot/rollback rounds (slot {slot}) vs plain"),
                rel_err(&rows, &plain),
                SELF_TOL,
            );
        }
    }
}

#[test]
fn forward_refuses_unallocated_kv_and_uncommitted_snapshot() {
    let w = load("bf16");
    let mut eng = Engine::new(w);
    let toks = [1u32, 2, 3];
    let e = eng
        .runner
        .forward(
            &eng.kv,
            &[SeqChunk {
                slot: ReqSlot(6),
                tokens: &toks,
                start_pos: 0,
                snapshot: false,
            }],
        )
        .unwrap_err();
    assert!(
        e.to_string().contains("slot 6") && e.to_string().contains("allocate_slots"),
        "{e}"
    );
    eng.run(6, &toks, false);
    let e = eng
        .runner
        .forward(
            &eng.kv,
            &[SeqChunk {
                slot: ReqSlot(6),
                tokens: &[9999],
                start_pos: 3,
                snapshot: false,
            }],
        )
        .unwrap_err();
    assert!(e.to_string().contains("9999"), "{e}");
    eng.run(6, &[4, 5, 6], true);
    eng.alloc(6, 1);
    let e = eng
        .runner
        .forward(
            &eng.kv,
            &[SeqChunk {
                slot: ReqSlot(6),
                tokens: &[7],
                start_pos: 6,
                snapshot: false,
            }],
        )
        .unwrap_err();
    assert!(e.to_string().contains("commit_state"), "{e}");
    let e = eng.runner.commit_state(&eng.kv, ReqSlot(6), 3).unwrap_err();
    assert!(e.to_string().contains("at most 2 drafts"), "{e}");
    // More drafts than state blocks: 1 + SPEC blocks hold at most SPEC + 1 positions.
    eng.runner.commit_state(&eng.kv, ReqSlot(6), 2).unwrap();
    let long: Vec<u32> = (0..(SPEC + 2)).collect();
    eng.alloc(6, long.len());
    let e = eng
        .runner
        .forward(
            &eng.kv,
            &[SeqChunk {
                slot: ReqSlot(6),
                tokens: &long,
                start_pos: 6,
                snapshot: true,
            }],
        )
        .unwrap_err();
    assert!(e.to_string().contains("kda_state"), "{e}");
}
