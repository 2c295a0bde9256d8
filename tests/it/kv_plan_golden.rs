//! Golden pool plans: speclab's GLM-5.3-Flash planning must answer what vLLM 0.33.0 does.
//!
//! `tests/golden/kv_plan/glm53_plan.json` is written by `recipes/kv_planning_golden.py`,
//! which calls vLLM's own `Platform._align_hybrid_block_size`, `get_kv_cache_groups`,
//! `_pool_bytes_per_block` and `get_kv_cache_capacity` on the CPU for 208 assumption sets
//! (TP 1/2/4/8 x KV dtype x block size x drafter block x indexer alignment x in-flight
//! tokens, plus the 2x Spark 1M rig). Invariant asserted: for every case the effective
//! block size, padded Mamba page, every group (kind, block size, layers, bytes, blocks a
//! request), bytes per block, num_blocks, concurrency (to 1e-12), the "GPU KV cache size"
//! tokens and the startup verdict equal vLLM's. The set must be substantial (>= 200
//! cases) so an empty or truncated file fails.

use std::path::Path;

use serde_json::Value;
use speclab_engine::kv::hybrid::{
    plan, KvDtype, PlanAssumptions, PlanDrafter, PlanInput, PoolPlan,
};
use speclab_engine::kv::GroupKind;

fn load() -> Vec<Value> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/kv_plan/glm53_plan.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let doc: Value = serde_json::from_str(&text).unwrap();
    assert!(
        doc["reference"]
            .as_str()
            .unwrap()
            .starts_with("vllm-0.33.0"),
        "goldens must come from vLLM 0.33.0"
    );
    doc["cases"].as_array().unwrap().clone()
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("field {k} missing in {v}"))
}

fn input(i: &Value) -> PlanInput {
    PlanInput {
        assumptions: PlanAssumptions {
            tp: u(i, "tp") as u32,
            kv_dtype: match i["kv_dtype"].as_str().unwrap() {
                "auto" => KvDtype::Auto,
                "fp8" => KvDtype::Fp8,
                other => panic!("kv dtype {other}"),
            },
            drafter_block_size: i["drafter_block_size"].as_u64().map(|b| b as u32),
            indexer_block_alignment: i["indexer_block_alignment"].as_bool().unwrap(),
            drafter_kv_heads: u(i, "drafter_kv_heads") as u32,
            drafter_head_dim: u(i, "drafter_head_dim") as u32,
            drafter_layers: u(i, "drafter_layers") as u32,
            drafter_weight_bytes: 0,
        },
        block_size: u(i, "block_size") as u32,
        num_speculative_tokens: u(i, "num_speculative_tokens") as u32,
        max_model_len: u(i, "max_model_len") as u32,
        max_in_flight_tokens: u(i, "max_in_flight_tokens") as u32,
        drafter_window: u(i, "drafter_window") as u32,
        kv_cache_memory_bytes: u(i, "kv_cache_memory_bytes"),
        drafter: PlanDrafter::Dflash2,
    }
}

fn kind(s: &str) -> GroupKind {
    match s {
        "full" => GroupKind::Full,
        "state" => GroupKind::State,
        "ring_buffer" => GroupKind::RingBuffer,
        "sliding_window" => GroupKind::SlidingWindow,
        other => panic!("group kind {other}"),
    }
}

fn compare(ctx: &str, got: &PoolPlan, want: &Value) {
    assert_eq!(
        got.effective_block_size,
        u(want, "effective_block_size"),
        "{ctx}"
    );
    assert_eq!(
        got.mamba_page_size_padded,
        want["mamba_page_size_padded"].as_u64(),
        "{ctx}: padded mamba page"
    );
    let groups = want["groups"].as_array().unwrap();
    assert_eq!(got.groups.len(), groups.len(), "{ctx}: number of groups");
    for (k, (g, w)) in got.groups.iter().zip(groups).enumerate() {
        let gctx = format!("{ctx}: group {k}");
        assert_eq!(g.kind, kind(w["kind"].as_str().unwrap()), "{gctx}");
        assert_eq!(g.block_size, u(w, "block_size"), "{gctx}: block size");
        assert_eq!(
            u64::from(g.num_layers),
            u(w, "num_layers"),
            "{gctx}: layers"
        );
        assert_eq!(g.bytes, u(w, "bytes"), "{gctx}: bytes");
        assert_eq!(g.blocks_per_request, u(w, "blocks_per_request"), "{gctx}");
    }
    assert_eq!(got.bytes_per_block, u(want, "bytes_per_block"), "{ctx}");
    assert_eq!(got.num_blocks, u(want, "num_blocks"), "{ctx}");
    assert_eq!(
        got.blocks_per_request,
        u(want, "blocks_per_request"),
        "{ctx}"
    );
    let c = want["max_concurrency"].as_f64().unwrap();
    assert!(
        (got.max_concurrency - c).abs() < 1e-12,
        "{ctx}: concurrency"
    );
    assert_eq!(
        got.kv_cache_tokens,
        u(want, "kv_cache_tokens"),
        "{ctx}: tokens"
    );
    assert_eq!(
        got.starts,
        want["starts"].as_bool().unwrap(),
        "{ctx}: starts"
    );
}

#[test]
fn plans_equal_vllm() {
    let cases = load();
    assert!(cases.len() >= 200, "only {} golden cases", cases.len());
    let mut changed = 0;
    for (n, c) in cases.iter().enumerate() {
        let ctx = format!("case {n} {}", c["input"]);
        let want = c
            .get("vllm")
            .unwrap_or_else(|| panic!("{ctx}: vLLM refused: {}", c["error"]));
        let got = plan(&input(&c["input"])).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        compare(&ctx, &got, want);
        changed += usize::from(got.effective_block_size != got.requested_block_size);
    }
    // The goldens exercise both paths: block sizes vLLM keeps and ones it changes.
    assert!(changed > 20 && changed < cases.len() - 20, "{changed}");
}
