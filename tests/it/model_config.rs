//! Config presets, KV layout, weight export / round trip and random weights
//! (docs/model.md §8-§10).
//!
//! The `micro` preset equals `tests/fixtures/model/config.json` key for key, and with
//! its W4A16 `quantization_config` equals `w4a16/config.json` (both written by
//! `recipes/model.py`); the fixture checkpoints round-trip byte-exactly through
//! `ModelWeights::tensors` / `save`; `ModelWeights::random` is seeded, quantizes exactly
//! the routed experts, and its W4A16 and dequantized paths agree through the forward.

use std::path::{Path, PathBuf};

use speclab_engine::kv::manager::AllocArgs;
use speclab_engine::kv::planning::resolve_num_blocks;
use speclab_engine::kv::{AllocOutcome, KvCacheManager};
use speclab_engine::model::checkpoint::Checkpoint;
use speclab_engine::model::ops::rel_err;
use speclab_engine::model::weights::quantized_module_names;
use speclab_engine::model::{ModelConfig, ModelRunner, ModelWeights, SeqChunk};
use speclab_engine::{ReqSlot, RequestStatus, RequestView};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/model")
}

fn json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn micro_preset_equals_fixture_config() {
    let want = json(&fixture().join("config.json"));
    assert_eq!(serde_json::to_value(ModelConfig::micro()).unwrap(), want);
    let want_q = json(&fixture().join("w4a16/config.json"));
    assert_eq!(
        serde_json::to_value(ModelConfig::micro().with_quantization()).unwrap(),
        want_q
    );
    // And the file parses back to the preset.
    let parsed = ModelConfig::from_file(&fixture().join("w4a16/config.json")).unwrap();
    assert_eq!(parsed, ModelConfig::micro().with_quantization());
}

#[test]
fn presets_match_the_card_numbers() {
    assert_eq!(ModelConfig::micro().num_parameters(), 1_436_726);
    assert_eq!(ModelConfig::tiny().num_parameters(), 20_909_592);
    let g = ModelConfig::glm53_flash().with_quantization();
    assert_eq!(
        quantized_module_names(&g).unwrap().len(),
        36_288,
        "the card's 36,288 quantized tensors"
    );
    assert_eq!(
        quantized_module_names(&ModelConfig::micro().with_quantization())
            .unwrap()
            .len(),
        36
    );
    assert_eq!(
        quantized_module_names(&ModelConfig::tiny().with_quantization())
            .unwrap()
            .len(),
        336
    );
    assert_eq!((g.num_full_layers(), g.num_kda_layers()), (9, 36));
    assert_eq!(ModelConfig::preset("tiny").unwrap(), ModelConfig::tiny());
    assert!(ModelConfig::preset("huge")
        .unwrap_err()
        .to_string()
        .contains("micro"));
}

#[test]
fn kv_layout_sizes_the_pool_from_bytes_and_holds_one_plus_n_state_blocks() {
    let cfg = ModelConfig::glm53_flash();
    let mut layout = cfg.kv_layout(2304, 7, 1).unwrap();
    // full: 9 full layers + MTP, 2304 x 8 x 128 x 2 x 4 B; state: 36 KDA layers.
    let full = layout.groups[0].memory.unwrap();
    let state = layout.groups[1].memory.unwrap();
    assert_eq!(
        (full.num_layers, full.page_size_bytes),
        (10, 2304 * 8 * 128 * 2 * 4)
    );
    assert_eq!(
        (state.num_layers, state.page_size_bytes),
        (36, (3 * 3 * 4096 + 32 * 128 * 128) * 4)
    );
    layout.num_blocks = None;
    layout.kv_cache_memory_bytes = Some(100 << 30);
    let bpb = u64::from(full.num_layers) * full.page_size_bytes; // the full group binds
    assert_eq!(
        u64::from(resolve_num_blocks(&layout).unwrap()),
        (100u64 << 30) / bpb
    );
    // A request holds 1 + N state blocks and cdiv(tokens, bs) full blocks.
    let micro = ModelConfig::micro();
    let l = micro.kv_layout(16, 3, 32).unwrap();
    let mut kv = KvCacheManager::new(&l, 32).unwrap();
    let view = RequestView {
        slot: ReqSlot(0),
        num_computed_tokens: 0,
        num_tokens: 40,
        num_prompt_tokens: 40,
        status: RequestStatus::Waiting,
        num_in_flight_tokens: 0,
    };
    let a = AllocArgs {
        num_new_tokens: 40,
        num_lookahead_tokens: 3,
        full_sequence_must_fit: true,
        has_scheduled_reqs: false,
    };
    assert!(matches!(
        kv.allocate_slots(&view, a).unwrap(),
        AllocOutcome::Allocated(_)
    ));
    assert_eq!(kv.held_blocks(ReqSlot(0)), vec![3, 4]);
}

#[test]
fn fixture_checkpoints_round_trip_byte_exactly() {
    for sub in ["", "w4a16"] {
        let dir = fixture().join(sub);
        let w = ModelWeights::load(&dir).unwrap();
        let orig = Checkpoint::open(&dir).unwrap();
        let tensors = w.tensors();
        assert_eq!(tensors.len(), orig.len(), "{sub}: tensor count");
        for t in &tensors {
            assert_eq!(orig.shape(&t.name), Some(t.shape.as_slice()), "{}", t.name);
        }
        let tmp = std::env::temp_dir().join(format!(
            "speclab-model-config-{}-{}",
            std::process::id(),
            if sub.is_empty() { "bf16" } else { sub }
        ));
        w.save(&tmp).unwrap();
        let a = std::fs::read(dir.join("model.safetensors")).unwrap();
        let b = std::fs::read(tmp.join("model.safetensors")).unwrap();
        // Same tensors and bytes (header key order may differ: compare loaded weights + data size).
        assert_eq!(a.len(), b.len(), "{sub}: file size");
        assert_eq!(ModelWeights::load(&tmp).unwrap(), w);
        assert_eq!(
            json(&tmp.join("config.json")),
            json(&dir.join("config.json"))
        );
        let _ = std::fs::remove_dir_all(&tmp);
    }
}

#[test]
fn random_weights_are_seeded_quantized_and_consistent() {
    let cfg = ModelConfig::micro();
    let a = ModelWeights::random(&cfg, 7, true).unwrap();
    assert_eq!(
        a,
        ModelWeights::random(&cfg, 7, true).unwrap(),
        "same seed, same weights"
    );
    assert_eq!(a.num_quantized(), 36);
    assert!(a.cfg.quantization_config.is_some());
    let d = a.dequantized();
    assert_eq!(d.num_quantized(), 0);
    // Save + load of random W4A16 weights is exact.
    let tmp = std::env::temp_dir().join(format!(
        "speclab-model-config-{}-random",
        std::process::id()
    ));
    a.save(&tmp).unwrap();
    assert_eq!(ModelWeights::load(&tmp).unwrap(), a);
    let _ = std::fs::remove_dir_all(&tmp);
    // W4A16 kernel vs its dequantized f32 copy through the whole model.
    let layout = cfg.kv_layout(16, 0, 8).unwrap();
    let mut logits = Vec::new();
    for w in [a, d] {
        let mut kv = KvCacheManager::new(&layout, 8).unwrap();
        let view = RequestView {
            slot: ReqSlot(0),
            num_computed_tokens: 0,
            num_tokens: 12,
            num_prompt_tokens: 12,
            status: RequestStatus::Waiting,
            num_in_flight_tokens: 0,
        };
        let args = AllocArgs {
            num_new_tokens: 12,
            num_lookahead_tokens: 0,
            full_sequence_must_fit: true,
            has_scheduled_reqs: false,
        };
        kv.allocate_slots(&view, args).unwrap();
        let mut r = ModelRunner::new(w, &kv).unwrap();
        let toks: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 504).collect();
        logits.push(
            r.forward(
                &kv,
                &[SeqChunk {
                    slot: ReqSlot(0),
                    tokens: &toks,
                    start_pos: 0,
                    snapshot: false,
                }],
            )
            .unwrap()
            .logits,
        );
    }
    let e = rel_err(&logits[0], &logits[1]);
    println!("random micro: W4A16 vs dequantized logits rel err {e:.3e}");
    assert!(e < 1e-5, "{e}");
    let std = (logits[0].iter().map(|x| x * x).sum::<f32>() / logits[0].len() as f32).sqrt();
    assert!(std > 1.0, "non-degenerate logits (rms {std})");
}
