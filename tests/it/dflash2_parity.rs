//! Parity of the Rust DFlash2 drafter with the reference goldens (docs/dflash2.md §13).
//!
//! The fixture's scenario, for both prompts (13 and 30 tokens) and both modes (v1, v2),
//! run with the **Rust** micro target (`tests/fixtures/model/`, bf16): chunked prefill
//! (`[0..5]`, `[5..T]`) with per-layer hidden states -> drafter features appended in the
//! same chunks; step 0 draft; target verify with snapshot of `[anchor, d_1..d_7]`, forced
//! 3 accepted (`commit_state`), the verify rows' features of positions `T..T+3` appended;
//! step 1 draft with the bonus token. Compared: target features, context K/V (prompt 0),
//! block hidden / logits / per-layer residuals, draft tokens, `q` (temperature 1),
//! margins, and for v2 candidates, unary scores, pair scores, walk choices, realized
//! scores, top-k gaps. The same drafter is also fed the golden features directly, which
//! isolates its own error from the target's.
//!
//! All KV goes through one real `KvCacheManager`: the micro target's
//! `cfg.kv_layout(...)` groups plus the drafter's sliding-window group
//! (`DFlash2Config::kv_group`), allocated with `allocate_slots` and lookahead `N + 1` as
//! vLLM does for DFlash, so window eviction nulls real blocks of the drafter group
//! (checked) and the drafter reads only live blocks. Three drafter-group configurations
//! (block 4 / cap None, block 16 / Upstream, block 4 / WindowPlusTwo ring) must give
//! bit-identical drafts.
//!
//! Metric: `max|a - b| / max|b|` (§1.5), contract < 1e-2; every value is printed
//! (`cargo test --test dflash2_parity -- --nocapture`).

use std::path::{Path, PathBuf};

use speclab_drafters::dflash2::{DFlash2, DFlash2Weights, Draft, DraftMode, DraftRequest};
use speclab_engine::kv::manager::AllocArgs;
use speclab_engine::kv::{AllocOutcome, CapPolicy, KvCacheManager, NULL_BLOCK};
use speclab_engine::model::checkpoint::Checkpoint;
use speclab_engine::model::ops::{argmax, rel_err};
use speclab_engine::model::{ForwardOptions, ModelRunner, ModelWeights, SeqChunk};
use speclab_engine::{ReqSlot, RequestStatus, RequestView};

const CONTRACT: f32 = 1e-2; // docs/dflash2.md §1.5
const STRICT: f32 = 1e-4; // an f32 port is expected at ~1e-5
const TARGET_BS: u32 = 16;
const N: usize = 7;
const POOL: u32 = 64;
const FORCED: usize = 3;
const CHUNK: usize = 5;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn golden() -> Checkpoint {
    Checkpoint::open_file(&root().join("tests/fixtures/dflash2/golden.safetensors"))
        .expect("dflash2 golden")
}

fn g32(g: &Checkpoint, name: &str) -> Vec<f32> {
    g.f32_any_shape(name).unwrap_or_else(|e| panic!("{e}")).0
}

fn gi32(g: &Checkpoint, name: &str) -> Vec<i32> {
    g.i32_any_shape(name).unwrap_or_else(|e| panic!("{e}")).0
}

fn gu32(g: &Checkpoint, name: &str) -> Vec<u32> {
    gi32(g, name).into_iter().map(|t| t as u32).collect()
}

/// Worst relative error per quantity, over every case.
#[derive(Default)]
struct Worst(Vec<(String, f32)>);

impl Worst {
    fn check(&mut self, label: &str, what: &str, a: &[f32], b: &[f32]) {
        self.record(label, what, rel_err(a, b));
    }
    fn record(&mut self, label: &str, what: &str, e: f32) {
        assert!(
            e < CONTRACT,
            "{label} {what}: relative error {e:.3e} >= contract {CONTRACT:.0e}"
        );
        assert!(
            e < STRICT,
            "{label} {what}: relative error {e:.3e} >= {STRICT:.0e} (an f32 port should be ~1e-5)"
        );
        match self.0.iter_mut().find(|(w, _)| w == what) {
            Some((_, v)) => *v = v.max(e),
            None => self.0.push((what.to_string(), e)),
        }
    }
    fn print(&self, title: &str) {
        println!("{title}");
        for (w, e) in &self.0 {
            println!("  {w:28} worst rel err {e:.3e}");
        }
    }
}

/// One KV manager, the Rust target and the drafter; per-slot computed counts.
struct Harness {
    kv: KvCacheManager,
    runner: ModelRunner,
    drafter: DFlash2,
    computed: Vec<u64>,
}

impl Harness {
    fn new(drafter_bs: u32, cap: CapPolicy) -> Self {
        let target = ModelWeights::load(&root().join("tests/fixtures/model"))
            .unwrap_or_else(|e| panic!("{e}"));
        let dw =
            DFlash2Weights::load_for_target(&root().join("tests/fixtures/dflash2"), &target.cfg)
                .unwrap_or_else(|e| panic!("{e}"));
        let mut layout = target.cfg.kv_layout(TARGET_BS, N as u32, POOL).unwrap();
        layout
            .groups
            .push(dw.cfg.kv_group(drafter_bs, cap).unwrap());
        let kv = KvCacheManager::new(&layout, POOL).unwrap();
        let group = DFlash2::find_group(&kv).expect("drafter group");
        let drafter = DFlash2::new(dw, &target.cfg, &kv, group).unwrap_or_else(|e| panic!("{e}"));
        let runner = ModelRunner::new(target, &kv).unwrap();
        Self {
            kv,
            runner,
            drafter,
            computed: vec![0; 16],
        }
    }

    /// vLLM `allocate_slots` for `new` tokens with DFlash's lookahead `N + 1`.
    fn alloc(&mut self, slot: u32, new: usize, num_tokens: u64) {
        let c = self.computed[slot as usize];
        let view = RequestView {
            slot: ReqSlot(slot),
            num_computed_tokens: c,
            num_tokens: num_tokens.max(c + 1),
            num_prompt_tokens: num_tokens,
            status: if c == 0 {
                RequestStatus::Waiting
            } else {
                RequestStatus::Running
            },
            num_in_flight_tokens: 0,
        };
        let args = AllocArgs {
            num_new_tokens: new as u64,
            num_lookahead_tokens: (N + 1) as u64,
            full_sequence_must_fit: c == 0,
            has_scheduled_reqs: false,
        };
        match self.kv.allocate_slots(&view, args).unwrap() {
            AllocOutcome::Allocated(_) => {}
            AllocOutcome::NoFit => panic!("pool too small"),
        }
    }

    /// Target forward of `tokens` at the slot's computed position, collecting hidden states;
    /// returns (logits [T, V], features [T, F]).
    fn target(
        &mut self,
        slot: u32,
        tokens: &[u32],
        snapshot: bool,
        num_tokens: u64,
    ) -> (Vec<f32>, Vec<f32>) {
        self.alloc(slot, tokens.len(), num_tokens);
        let start = self.computed[slot as usize] as usize;
        let out = self
            .runner
            .forward_with(
                &self.kv,
                &[SeqChunk {
                    slot: ReqSlot(slot),
                    tokens,
                    start_pos: start,
                    snapshot,
                }],
                &ForwardOptions {
                    collect_hidden: true,
                    ..Default::default()
                },
            )
            .unwrap();
        self.computed[slot as usize] += tokens.len() as u64;
        let feats = self.drafter.features(&out, 0..tokens.len()).unwrap();
        (out.logits, feats)
    }

    fn draft(&self, slot: u32, anchor: u32, pos: usize, mode: DraftMode) -> Draft {
        let req = DraftRequest {
            slot: ReqSlot(slot),
            anchor_token: anchor,
            anchor_pos: pos,
            num_speculative_tokens: N,
            mode,
            temperature: 0.0,
            trace: true,
        };
        self.drafter
            .draft(&self.kv, self.runner.weights(), &req, None)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn free(&mut self, slot: u32) {
        self.kv.free(ReqSlot(slot));
        self.runner.release(ReqSlot(slot));
        self.drafter.release(ReqSlot(slot));
        self.computed[slot as usize] = 0;
    }

    fn leading_nulls(&self, slot: u32) -> usize {
        let t = self.kv.table(self.drafter.group(), ReqSlot(slot));
        t.iter().take_while(|&&b| b == NULL_BLOCK).count()
    }
}

/// Compare one draft step with its goldens `{m}.prompt{p}.step{s}.*`.
fn compare_step(g: &Checkpoint, w: &mut Worst, key: &str, d: &Draft, mode: DraftMode, v: usize) {
    assert_eq!(
        d.tokens,
        gu32(g, &format!("{key}.tokens")),
        "{key} draft tokens"
    );
    w.check(
        key,
        "block hidden",
        d.hidden.as_ref().unwrap(),
        &g32(g, &format!("{key}.hidden")),
    );
    w.check(
        key,
        "block logits",
        d.logits.as_ref().unwrap(),
        &g32(g, &format!("{key}.logits")),
    );
    let q: Vec<f32> = d.q.as_ref().unwrap().iter().flatten().copied().collect();
    assert_eq!(q.len(), N * v);
    w.check(key, "q (temp 1)", &q, &g32(g, &format!("{key}.q")));
    w.check(
        key,
        "margin",
        d.margin.as_ref().unwrap(),
        &g32(g, &format!("{key}.margin")),
    );
    if mode == DraftMode::V2 {
        let s = d.selector.as_ref().unwrap();
        assert_eq!(
            s.cand_ids,
            gu32(g, &format!("{key}.cand_ids")),
            "{key} candidates"
        );
        assert_eq!(
            s.choice,
            gu32(g, &format!("{key}.choice")),
            "{key} walk choices"
        );
        w.check(
            key,
            "cand_unary",
            &s.cand_unary,
            &g32(g, &format!("{key}.cand_unary")),
        );
        w.check(
            key,
            "edge_scores",
            &s.edge_scores,
            &g32(g, &format!("{key}.edge_scores")),
        );
        w.check(
            key,
            "realized",
            &s.realized,
            &g32(g, &format!("{key}.realized")),
        );
        w.check(
            key,
            "topk_gap",
            &s.topk_gap,
            &g32(g, &format!("{key}.topk_gap")),
        );
        // q lives on the candidates only.
        for (j, row) in d.q.as_ref().unwrap().iter().enumerate() {
            for (t, &p) in row.iter().enumerate() {
                let k = s.cand_ids.len() / N;
                if !s.cand_ids[j * k..(j + 1) * k].contains(&(t as u32)) {
                    assert_eq!(p, 0.0, "{key}: q nonzero off the candidates");
                }
            }
        }
    }
}

/// The outputs of one (prompt, mode) case, for cross-configuration comparison.
#[derive(PartialEq, Debug)]
struct CaseOut {
    tokens: [Vec<u32>; 2],
    logits: [Vec<f32>; 2],
}

/// The fixture scenario with the Rust target; returns the drafts for comparison.
fn run_case(
    hs: &mut Harness,
    g: &Checkpoint,
    w: &mut Worst,
    p: usize,
    mode: DraftMode,
    slot: u32,
) -> CaseOut {
    let m = if mode == DraftMode::V1 { "v1" } else { "v2" };
    let label = format!("{m}.prompt{p}");
    let v = hs.runner.config().vocab_size;
    let prompt = gu32(g, &format!("prompt{p}.tokens"));
    let t = prompt.len();
    // 1. chunked prefill, features appended per chunk (as the target produces them).
    let mut feats = Vec::new();
    let mut last_logits = Vec::new();
    for (a, b) in [(0, CHUNK), (CHUNK, t)] {
        let (lg, f) = hs.target(slot, &prompt[a..b], false, t as u64);
        hs.drafter
            .append_context(&hs.kv, ReqSlot(slot), a, &f)
            .unwrap_or_else(|e| panic!("{e}"));
        feats.extend_from_slice(&f);
        last_logits = lg[(b - a - 1) * v..].to_vec();
    }
    w.check(
        &label,
        "target features (prompt)",
        &feats,
        &g32(g, &format!("prompt{p}.features")),
    );
    let anchor0 = argmax(&last_logits) as u32;
    assert_eq!(
        anchor0,
        gu32(g, &format!("prompt{p}.anchor"))[0],
        "{label}: target greedy anchor"
    );
    assert_eq!(
        gu32(g, &format!("{label}.step0.anchor")),
        vec![anchor0, t as u32]
    );
    if p == 0 {
        for l in 0..2 {
            let (mut ks, mut vs) = (Vec::new(), Vec::new());
            for pos in 0..t {
                let (k, vv) = hs
                    .drafter
                    .context_kv(&hs.kv, ReqSlot(slot), l, pos)
                    .unwrap();
                ks.extend(k);
                vs.extend(vv);
            }
            w.check(
                &label,
                "context K",
                &ks,
                &g32(g, &format!("prompt0.ctx_k.layer{l}")),
            );
            w.check(
                &label,
                "context V",
                &vs,
                &g32(g, &format!("prompt0.ctx_v.layer{l}")),
            );
        }
        assert_eq!(
            gi32(g, "prompt0.ctx_pos"),
            (0..t as i32).collect::<Vec<_>>()
        );
    }
    // 2. step 0.
    let d0 = hs.draft(slot, anchor0, t, mode);
    compare_step(g, w, &format!("{label}.step0"), &d0, mode, v);
    if p == 0 {
        w.check(
            &label,
            "layer_out",
            d0.layer_out.as_ref().unwrap(),
            &g32(g, &format!("{label}.step0.layer_out")),
        );
    }
    // 3. verify [anchor, d_1..d_N] with snapshots; force 3 accepted.
    let mut vt = vec![anchor0];
    vt.extend_from_slice(&d0.tokens);
    let (vl, vf) = hs.target(slot, &vt, true, t as u64 + 1);
    hs.runner
        .commit_state(&hs.kv, ReqSlot(slot), FORCED)
        .unwrap();
    hs.computed[slot as usize] -= (N - FORCED) as u64;
    let f = hs.drafter.config().feature_dim();
    let vfeats = &vf[..(FORCED + 1) * f];
    w.check(
        &label,
        "target features (verify)",
        vfeats,
        &g32(g, &format!("{label}.verify.features")),
    );
    assert_eq!(
        gi32(g, &format!("{label}.verify.accepted")),
        vec![FORCED as i32]
    );
    let bonus = argmax(&vl[FORCED * v..(FORCED + 1) * v]) as u32;
    assert_eq!(
        gu32(g, &format!("{label}.step1.anchor")),
        vec![bonus, (t + FORCED + 1) as u32],
        "{label}: bonus token"
    );
    // 4. commit: append the anchor's and the accepted drafts' features.
    hs.drafter
        .append_context(&hs.kv, ReqSlot(slot), t, vfeats)
        .unwrap_or_else(|e| panic!("{e}"));
    let d1 = hs.draft(slot, bonus, t + FORCED + 1, mode);
    compare_step(g, w, &format!("{label}.step1"), &d1, mode, v);

    // The same drafter on the golden features (its own error, without the target's).
    let gslot = slot + 1;
    hs.alloc(gslot, t, t as u64);
    hs.computed[gslot as usize] = t as u64;
    hs.drafter
        .append_context(
            &hs.kv,
            ReqSlot(gslot),
            0,
            &g32(g, &format!("prompt{p}.features")),
        )
        .unwrap();
    let e0 = hs.draft(gslot, anchor0, t, mode);
    hs.alloc(gslot, 1 + N, t as u64 + 1);
    hs.drafter
        .append_context(
            &hs.kv,
            ReqSlot(gslot),
            t,
            &g32(g, &format!("{label}.verify.features")),
        )
        .unwrap();
    let e1 = hs.draft(gslot, bonus, t + FORCED + 1, mode);
    let mut wg = Worst::default();
    compare_step(g, &mut wg, &format!("{label}.step0"), &e0, mode, v);
    compare_step(g, &mut wg, &format!("{label}.step1"), &e1, mode, v);
    for (what, e) in wg.0 {
        w.record(&label, &format!("{what} [golden features]"), e);
    }
    hs.free(gslot);
    CaseOut {
        tokens: [d0.tokens, d1.tokens],
        logits: [d0.logits.unwrap(), d1.logits.unwrap()],
    }
}

#[test]
fn goldens_v1_v2_through_the_kv_manager() {
    let g = golden();
    let configs = [
        (4, CapPolicy::None),
        (16, CapPolicy::Upstream),
        (4, CapPolicy::WindowPlusTwo),
    ];
    let mut first: Option<Vec<CaseOut>> = None;
    for (bs, cap) in configs {
        let mut hs = Harness::new(bs, cap);
        let mut w = Worst::default();
        let mut outs = Vec::new();
        for p in 0..2 {
            for mode in [DraftMode::V1, DraftMode::V2] {
                let slot = 0;
                outs.push(run_case(&mut hs, &g, &mut w, p, mode, slot));
                if p == 1 && cap != CapPolicy::WindowPlusTwo && bs == 4 {
                    // T = 30 > W = 16: the step-0 verify allocation nulled the blocks of
                    // positions 0..11 (skipped = 31 - 16 = 15 tokens, 3 blocks of 4).
                    assert!(
                        hs.leading_nulls(slot) >= 3,
                        "eviction must null real drafter blocks"
                    );
                    let e = hs
                        .drafter
                        .context_kv(&hs.kv, ReqSlot(slot), 0, 0)
                        .unwrap_err()
                        .to_string();
                    assert!(e.contains("null block"), "{e}");
                }
                hs.free(slot);
            }
        }
        assert_eq!(
            hs.kv.num_free_blocks(),
            hs.kv.usable_blocks(),
            "every block returned"
        );
        w.print(&format!("drafter group block {bs}, cap {cap:?}:"));
        match &first {
            None => first = Some(outs),
            Some(f) => assert_eq!(
                f, &outs,
                "allocator configuration changed the drafts (block {bs}, {cap:?})"
            ),
        }
    }
}

#[test]
fn chunked_context_equals_whole_recompute() {
    let g = golden();
    let mut hs = Harness::new(4, CapPolicy::None);
    let f = hs.drafter.config().feature_dim();
    let p1 = g32(&g, "prompt1.features"); // [30, F]
    let vf = g32(&g, "v2.prompt1.verify.features"); // [4, F]
    let mut all = p1.clone();
    all.extend_from_slice(&vf);
    let total = all.len() / f; // 34
    let anchor = gu32(&g, "v2.prompt1.step1.anchor");
    let anchor0 = gu32(&g, "prompt1.anchor")[0];
    // Slot 0: all at once. Slot 1: uneven chunks, allocating before each as a scheduler
    // would (eviction between chunks). Slot 2: one row at a time.
    let plans: [&[usize]; 3] = [&[total], &[5, 7, 1, 17, 4], &[1; 34]];
    let mut drafts = Vec::new();
    for (s, plan) in plans.iter().enumerate() {
        let slot = s as u32;
        let mut pos = 0;
        let mut d0 = None;
        for &n in plan.iter() {
            hs.alloc(slot, n, (pos + n) as u64);
            hs.drafter
                .append_context(&hs.kv, ReqSlot(slot), pos, &all[pos * f..(pos + n) * f])
                .unwrap();
            pos += n;
            hs.computed[slot as usize] = pos as u64;
            if pos == 30 {
                d0 = Some(hs.draft(slot, anchor0, 30, DraftMode::V2));
            }
        }
        let d1 = hs.draft(slot, anchor[0], total, DraftMode::V2);
        drafts.push((d0, d1));
    }
    assert!(
        hs.leading_nulls(2) >= 3,
        "row-at-a-time allocation must have evicted blocks"
    );
    let (ref_d0, ref_d1) = &drafts[0];
    assert!(ref_d0.is_none(), "the one-shot slot never stops at 30");
    assert_eq!(ref_d1.tokens, gu32(&g, "v2.prompt1.step1.tokens"));
    for (s, (d0, d1)) in drafts.iter().enumerate().skip(1) {
        assert_eq!(d1.tokens, ref_d1.tokens, "slot {s}");
        assert_eq!(
            d1.selector.as_ref().unwrap().cand_ids,
            ref_d1.selector.as_ref().unwrap().cand_ids
        );
        let e = rel_err(d1.logits.as_ref().unwrap(), ref_d1.logits.as_ref().unwrap());
        println!("chunk plan {s}: step-1 logits vs whole-context recompute rel err {e:.3e}");
        assert!(
            e < 1e-5,
            "chunked context differs from the recompute: {e:.3e}"
        );
        let d0 = d0.as_ref().unwrap();
        assert_eq!(d0.tokens, gu32(&g, "v2.prompt1.step0.tokens"));
        let e0 = rel_err(
            d0.logits.as_ref().unwrap(),
            &g32(&g, "v2.prompt1.step0.logits"),
        );
        assert!(e0 < STRICT, "{e0:.3e}");
    }
}
