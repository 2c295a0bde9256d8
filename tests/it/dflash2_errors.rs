//! Malformed DFlash2 inputs give clear errors naming the key, file or tensor, never panics
//! (docs/dflash2.md §2, §9, §10): invalid configs, a drafter that does not fit the target
//! (hidden size, vocab, target layer ids), `num_speculative_tokens` out of range, broken
//! checkpoints (missing / extra / misshapen tensors, half a v2 set), the wrong KV group,
//! and protocol misuse (drafting without context, positions out of order, unallocated or
//! freed blocks). Also: presets equal `recipes/dflash2.py::make_config`, and a v1-only
//! checkpoint drafts v1 exactly like the full one and refuses v2.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use speclab_drafters::dflash2::{DFlash2, DFlash2Config, DFlash2Weights, DraftMode, DraftRequest};
use speclab_engine::kv::manager::AllocArgs;
use speclab_engine::kv::{AllocOutcome, CapPolicy, KvCacheManager};
use speclab_engine::model::checkpoint::{write_safetensors, Checkpoint, NamedTensor};
use speclab_engine::model::{ModelConfig, ModelWeights};
use speclab_engine::{EngineError, ReqSlot, RequestStatus, RequestView};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn drafter_dir() -> PathBuf {
    root().join("tests/fixtures/dflash2")
}

fn fixture_config() -> Value {
    serde_json::from_str(&std::fs::read_to_string(drafter_dir().join("config.json")).unwrap())
        .unwrap()
}

/// Parse a config JSON value; return the error message (panics if it parses).
fn config_err(v: &Value) -> String {
    match DFlash2Config::from_json_str(&v.to_string(), "config.json") {
        Ok(_) => panic!("config should be refused: {v}"),
        Err(e) => e.to_string(),
    }
}

fn with(mut v: Value, path: &[&str], x: Value) -> Value {
    let mut cur = &mut v;
    for k in &path[..path.len() - 1] {
        cur = cur.get_mut(*k).unwrap();
    }
    cur[path[path.len() - 1]] = x;
    v
}

fn expect_err<T>(r: Result<T, EngineError>, needles: &[&str]) -> String {
    let msg = match r {
        Ok(_) => panic!("expected an error containing {needles:?}"),
        Err(e) => e.to_string(),
    };
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} should mention {n:?}");
    }
    msg
}

#[test]
fn presets_equal_the_reference() {
    // micro == the committed fixture config.json (written by make_config("dflash2-micro")).
    let micro = serde_json::to_value(DFlash2Config::preset("dflash2-micro").unwrap()).unwrap();
    assert_eq!(micro, fixture_config());
    // tiny and glm53-flash: make_config's JSON, copied from `recipes/dflash2.py`.
    let tiny = json!({"architectures": ["DFlash2DraftModel"], "attention_bias": false, "block_size": 8, "dflash_config": {"conv_group_size": 16, "conv_kernel_size": 2, "mask_token_id": 8195, "selector_rank": 32, "selector_top_k": 8, "target_layer_ids": [1, 3, 5]}, "head_dim": 64, "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 512, "is_causal": false, "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention"], "max_position_embeddings": 4096, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 2, "num_target_layers": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 256, "speclab_preset": "dflash2-tiny", "target_hidden_size": 256, "target_preset": "tiny", "tie_word_embeddings": false, "torch_dtype": "bfloat16", "training": {"loss_decay_gamma": 4.0, "num_anchors": 512, "selector_loss_weight": 1.0}, "use_sliding_window": true, "vocab_size": 8200});
    let glm = json!({"architectures": ["DFlash2DraftModel"], "attention_bias": false, "block_size": 8, "dflash_config": {"conv_group_size": 16, "conv_kernel_size": 2, "mask_token_id": 154875, "selector_rank": 256, "selector_top_k": 16, "target_layer_ids": [5, 14, 24, 33, 42]}, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "is_causal": false, "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention"], "max_position_embeddings": 262144, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 45, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": 2048, "speclab_preset": "dflash2-glm53-flash", "target_hidden_size": 4096, "target_preset": "glm53-flash", "tie_word_embeddings": false, "torch_dtype": "bfloat16", "training": {"loss_decay_gamma": 4.0, "num_anchors": 512, "selector_loss_weight": 1.0}, "use_sliding_window": true, "vocab_size": 154880});
    assert_eq!(
        serde_json::to_value(DFlash2Config::preset("dflash2-tiny").unwrap()).unwrap(),
        tiny
    );
    assert_eq!(
        serde_json::to_value(DFlash2Config::preset("dflash2-glm53-flash").unwrap()).unwrap(),
        glm
    );
    // Each preset fits its target preset; the card's drafter group: 5 layers x 4,096 B/token in bf16.
    for (d, t) in [
        ("dflash2-micro", "micro"),
        ("dflash2-tiny", "tiny"),
        ("dflash2-glm53-flash", "glm53-flash"),
    ] {
        DFlash2Config::preset(d)
            .unwrap()
            .check_target(&ModelConfig::preset(t).unwrap())
            .unwrap();
    }
    let g = DFlash2Config::preset("dflash2-glm53-flash").unwrap();
    assert_eq!(g.kv_bytes_per_token(2), 5 * 4096);
    let spec = g.kv_group(16, CapPolicy::WindowPlusTwo).unwrap();
    assert_eq!(
        (spec.block_size, spec.sliding_window),
        (Some(16), Some(2048))
    );
    assert_eq!(spec.memory.unwrap().page_size_bytes, 16 * 2 * 8 * 128 * 4);
    // JSON round trip.
    let m = DFlash2Config::preset("dflash2-micro").unwrap();
    assert_eq!(
        DFlash2Config::from_json_str(&m.to_json_string().unwrap(), "x").unwrap(),
        m
    );
    expect_err(
        DFlash2Config::preset("dflash2-huge"),
        &["speclab_preset", "dflash2-micro"],
    );
}

#[test]
fn invalid_configs_name_the_key() {
    let base = fixture_config();
    let cases: Vec<(Value, &str)> = vec![
        (with(base.clone(), &["block_size"], json!(1)), "block_size"),
        (with(base.clone(), &["block_size"], json!(32)), "block_size"),
        (with(base.clone(), &["is_causal"], json!(true)), "is_causal"),
        (
            with(base.clone(), &["use_sliding_window"], json!(false)),
            "use_sliding_window",
        ),
        (
            with(
                base.clone(),
                &["layer_types"],
                json!(["sliding_attention", "full_attention"]),
            ),
            "layer_types",
        ),
        (
            with(
                base.clone(),
                &["architectures"],
                json!(["DFlashDraftModel"]),
            ),
            "architectures",
        ),
        (
            with(base.clone(), &["model_type"], json!("llama")),
            "model_type",
        ),
        (
            with(base.clone(), &["hidden_act"], json!("gelu")),
            "hidden_act",
        ),
        (
            with(base.clone(), &["torch_dtype"], json!("float16")),
            "torch_dtype",
        ),
        (
            with(base.clone(), &["num_key_value_heads"], json!(3)),
            "num_attention_heads",
        ),
        (
            with(base.clone(), &["hidden_size"], json!(64)),
            "hidden_size",
        ),
        (
            with(
                base.clone(),
                &["dflash_config", "target_layer_ids"],
                json!([0, 4]),
            ),
            "dflash_config.target_layer_ids",
        ),
        (
            with(
                base.clone(),
                &["dflash_config", "target_layer_ids"],
                json!([]),
            ),
            "dflash_config.target_layer_ids",
        ),
        (
            with(
                base.clone(),
                &["dflash_config", "mask_token_id"],
                json!(512),
            ),
            "dflash_config.mask_token_id",
        ),
        (
            with(
                base.clone(),
                &["dflash_config", "conv_group_size"],
                json!(3),
            ),
            "dflash_config.conv_group_size",
        ),
        (
            with(base.clone(), &["dflash_config", "selector_top_k"], json!(0)),
            "dflash_config.selector_top_k",
        ),
        (
            with(
                base.clone(),
                &["dflash_config", "selector_top_k"],
                json!(513),
            ),
            "dflash_config.selector_top_k",
        ),
        (
            with(base.clone(), &["final_logit_softcapping"], json!(30.0)),
            "final_logit_softcapping",
        ),
        (
            with(
                base.clone(),
                &["dflash_config", "mask_embedding"],
                json!([0.0]),
            ),
            "dflash_config.mask_embedding",
        ),
        (
            with(base.clone(), &["draft_vocab_size"], json!(256)),
            "draft_vocab_size",
        ),
        (
            with(base.clone(), &["rms_norm_eps"], json!(0.0)),
            "rms_norm_eps",
        ),
    ];
    for (v, key) in &cases {
        let e = config_err(v);
        assert!(
            e.contains(&format!("`{key}`")),
            "error {e:?} should name key {key}"
        );
    }
    // A missing key names it; neutral vLLM knobs are accepted.
    let mut v = base.clone();
    v.as_object_mut().unwrap().remove("sliding_window");
    let e = config_err(&v);
    assert!(e.contains("sliding_window"), "{e}");
    let ok = with(
        with(base.clone(), &["input_embedding_scale"], json!(1.0)),
        &["final_logit_softcapping"],
        Value::Null,
    );
    DFlash2Config::from_json_str(&ok.to_string(), "config.json").unwrap();
    expect_err(
        DFlash2Config::from_json_str("{", "cfg.json"),
        &["cfg.json", "parse"],
    );
}

/// A micro drafter config with `f` applied, valid on its own.
fn micro_cfg(f: impl FnOnce(&mut DFlash2Config)) -> DFlash2Config {
    let mut c = DFlash2Config::preset("dflash2-micro").unwrap();
    f(&mut c);
    c.validate().unwrap();
    c
}

fn manager(target: &ModelConfig, dcfg: &DFlash2Config, bs: u32) -> KvCacheManager {
    let mut layout = target.kv_layout(16, 7, 64).unwrap();
    layout
        .groups
        .push(dcfg.kv_group(bs, CapPolicy::None).unwrap());
    KvCacheManager::new(&layout, 64).unwrap()
}

#[test]
fn drafter_target_mismatch() {
    let target = ModelConfig::micro();
    let cases: Vec<(DFlash2Config, Vec<&str>)> = vec![
        (
            micro_cfg(|c| {
                c.hidden_size = 64;
                c.target_hidden_size = 64;
            }),
            vec!["`hidden_size`", "64", "128"],
        ),
        (
            micro_cfg(|c| c.vocab_size = 1024),
            vec!["`vocab_size`", "1024", "512"],
        ),
        (
            micro_cfg(|c| {
                c.num_target_layers = 8;
                c.dflash_config.target_layer_ids = vec![0, 5];
            }),
            vec![
                "`dflash_config.target_layer_ids`",
                "layer 5",
                "4 decoder layers",
            ],
        ),
    ];
    for (cfg, needles) in cases {
        expect_err(cfg.check_target(&target), &needles);
        let w = DFlash2Weights::random(&cfg, 1).unwrap();
        let kv = manager(&target, &DFlash2Config::preset("dflash2-micro").unwrap(), 4);
        let g = DFlash2::find_group(&kv).unwrap();
        expect_err(DFlash2::new(w.clone(), &target, &kv, g), &needles);
        // Through the loader too.
        let dir = TmpDir::new("mismatch");
        w.save(&dir.0).unwrap();
        expect_err(DFlash2Weights::load_for_target(&dir.0, &target), &needles);
    }
}

/// A temp dir removed on drop.
struct TmpDir(PathBuf);
impl TmpDir {
    fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let d = std::env::temp_dir().join(format!(
            "speclab-dflash2-{}-{tag}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Self(d)
    }
    /// The fixture drafter with its tensors passed through `f`.
    fn fixture_with(tag: &str, f: impl FnOnce(&mut Vec<NamedTensor>)) -> Self {
        let d = Self::new(tag);
        std::fs::copy(drafter_dir().join("config.json"), d.0.join("config.json")).unwrap();
        let mut t = DFlash2Weights::load(&drafter_dir()).unwrap().tensors();
        f(&mut t);
        write_safetensors(&d.0.join("model.safetensors"), &t).unwrap();
        d
    }
}
impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn broken_checkpoints() {
    // Export is byte-faithful: the re-written fixture loads to the same weights.
    let same = TmpDir::fixture_with("same", |_| {});
    assert_eq!(
        DFlash2Weights::load(&same.0).unwrap(),
        DFlash2Weights::load(&drafter_dir()).unwrap()
    );
    // A missing v1 tensor: names the file and the tensor.
    let d = TmpDir::fixture_with("missing", |t| {
        t.retain(|x| x.name != "layers.1.mlp.up_proj.weight")
    });
    let e = expect_err(
        DFlash2Weights::load(&d.0),
        &[
            "layers.1.mlp.up_proj.weight",
            "model.safetensors",
            "missing",
        ],
    );
    println!("missing tensor: {e}");
    // Half a v2 set.
    let d = TmpDir::fixture_with("half-v2", |t| {
        t.retain(|x| x.name != "layers.0.mlp_conv.base_kernel")
    });
    let e = expect_err(
        DFlash2Weights::load(&d.0),
        &["layers.0.mlp_conv.base_kernel", "all present"],
    );
    println!("half v2: {e}");
    // An extra tensor (the drafter never stores the shared head).
    let d = TmpDir::fixture_with("extra", |t| {
        t.push(NamedTensor::bf16(
            "lm_head.weight",
            vec![512, 128],
            &vec![0.0; 512 * 128],
        ))
    });
    expect_err(
        DFlash2Weights::load(&d.0),
        &["lm_head.weight", "does not use"],
    );
    // A misshapen tensor names the config key.
    let d = TmpDir::fixture_with("shape", |t| {
        let i = t.iter().position(|x| x.name == "fc.weight").unwrap();
        t[i] = NamedTensor::bf16("fc.weight", vec![128, 384], &vec![0.0; 128 * 384]);
    });
    expect_err(
        DFlash2Weights::load(&d.0),
        &["fc.weight", "target_layer_ids"],
    );
    let d = TmpDir::fixture_with("rank", |t| {
        let i = t
            .iter()
            .position(|x| x.name == "candidate_selector.successor_codebook")
            .unwrap();
        t[i] = NamedTensor::bf16(
            "candidate_selector.successor_codebook",
            vec![512, 8],
            &vec![0.0; 512 * 8],
        );
    });
    expect_err(
        DFlash2Weights::load(&d.0),
        &["successor_codebook", "dflash_config.selector_rank"],
    );
    // No weights file / no config.
    let d = TmpDir::new("empty");
    expect_err(DFlash2Weights::load(&d.0), &["config.json"]);
    std::fs::copy(drafter_dir().join("config.json"), d.0.join("config.json")).unwrap();
    expect_err(DFlash2Weights::load(&d.0), &["model.safetensors"]);
    // Truncated file.
    let d = TmpDir::fixture_with("trunc", |_| {});
    let bytes = std::fs::read(d.0.join("model.safetensors")).unwrap();
    std::fs::write(d.0.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    expect_err(DFlash2Weights::load(&d.0), &["model.safetensors"]);
    assert!(Checkpoint::open(&drafter_dir()).is_ok());
}

/// The fixture target + drafter over one manager, with a prompt's worth of context.
struct Setup {
    kv: KvCacheManager,
    target: ModelWeights,
    drafter: DFlash2,
}

fn alloc(kv: &mut KvCacheManager, slot: u32, computed: u64, new: u64) {
    let view = RequestView {
        slot: ReqSlot(slot),
        num_computed_tokens: computed,
        num_tokens: computed + new,
        num_prompt_tokens: computed + new,
        status: if computed == 0 {
            RequestStatus::Waiting
        } else {
            RequestStatus::Running
        },
        num_in_flight_tokens: 0,
    };
    let args = AllocArgs {
        num_new_tokens: new,
        num_lookahead_tokens: 8,
        full_sequence_must_fit: computed == 0,
        has_scheduled_reqs: false,
    };
    assert!(matches!(
        kv.allocate_slots(&view, args).unwrap(),
        AllocOutcome::Allocated(_)
    ));
}

fn setup(weights: DFlash2Weights) -> Setup {
    let target = ModelWeights::load(&root().join("tests/fixtures/model")).unwrap();
    let kv = manager(&target.cfg, &weights.cfg, 4);
    let g = DFlash2::find_group(&kv).unwrap();
    let drafter = DFlash2::new(weights, &target.cfg, &kv, g).unwrap();
    Setup {
        kv,
        target,
        drafter,
    }
}

fn golden_features(name: &str) -> Vec<f32> {
    Checkpoint::open_file(&drafter_dir().join("golden.safetensors"))
        .unwrap()
        .f32_any_shape(name)
        .unwrap()
        .0
}

fn req(slot: u32, anchor: u32, pos: usize, n: usize, mode: DraftMode) -> DraftRequest {
    DraftRequest {
        slot: ReqSlot(slot),
        anchor_token: anchor,
        anchor_pos: pos,
        num_speculative_tokens: n,
        mode,
        temperature: 0.0,
        trace: false,
    }
}

#[test]
fn runtime_errors_and_v1_only() {
    let mut s = setup(DFlash2Weights::load(&drafter_dir()).unwrap());
    let feats = golden_features("prompt0.features"); // [13, 256]
    let f = s.drafter.config().feature_dim();
    let sl = ReqSlot(0);
    // Drafting before any context; appending without allocated blocks.
    expect_err(
        s.drafter
            .draft(&s.kv, &s.target, &req(0, 5, 0, 7, DraftMode::V2), None),
        &["no DFlash2 context"],
    );
    expect_err(
        s.drafter.append_context(&s.kv, sl, 0, &feats),
        &["allocate_slots"],
    );
    alloc(&mut s.kv, 0, 0, 13);
    expect_err(
        s.drafter.append_context(&s.kv, sl, 0, &feats[..f - 1]),
        &["features", "256"],
    );
    expect_err(
        s.drafter.append_context(&s.kv, sl, 3, &feats),
        &["in order"],
    );
    s.drafter.append_context(&s.kv, sl, 0, &feats).unwrap();
    // num_speculative_tokens out of range: 0 and B = 8 (> B - 1).
    for n in [0, 8, 100] {
        expect_err(
            s.drafter
                .draft(&s.kv, &s.target, &req(0, 5, 13, n, DraftMode::V2), None),
            &["num_speculative_tokens", "1..=7"],
        );
    }
    // N < B - 1 is allowed (untrained, vLLM sizes the block 1 + N).
    let d3 = s
        .drafter
        .draft(&s.kv, &s.target, &req(0, 5, 13, 3, DraftMode::V2), None)
        .unwrap();
    assert_eq!(d3.tokens.len(), 3);
    // Anchor position / token, temperature.
    expect_err(
        s.drafter
            .draft(&s.kv, &s.target, &req(0, 5, 12, 7, DraftMode::V2), None),
        &["position 12", "n = 13"],
    );
    expect_err(
        s.drafter
            .draft(&s.kv, &s.target, &req(0, 512, 13, 7, DraftMode::V2), None),
        &["anchor token id 512"],
    );
    let mut hot = req(0, 5, 13, 7, DraftMode::V2);
    hot.temperature = 0.7;
    expect_err(
        s.drafter.draft(&s.kv, &s.target, &hot, None),
        &["temperature", "RNG"],
    );
    hot.temperature = -1.0;
    expect_err(
        s.drafter.draft(&s.kv, &s.target, &hot, None),
        &["temperature"],
    );
    hot.temperature = f32::NAN;
    expect_err(
        s.drafter.draft(&s.kv, &s.target, &hot, None),
        &["temperature"],
    );
    // Another target's weights.
    let mut other = s.target.clone();
    other.cfg.vocab_size = 1024;
    expect_err(
        s.drafter
            .draft(&s.kv, &other, &req(0, 5, 13, 7, DraftMode::V2), None),
        &["vocab"],
    );
    // Another manager.
    let kv2 = manager(&s.target.cfg, s.drafter.config(), 4);
    let mut kv3 = {
        let mut layout = s.target.cfg.kv_layout(16, 7, 32).unwrap();
        layout
            .groups
            .push(s.drafter.config().kv_group(4, CapPolicy::None).unwrap());
        KvCacheManager::new(&layout, 32).unwrap()
    };
    expect_err(
        s.drafter
            .draft(&kv3, &s.target, &req(0, 5, 13, 7, DraftMode::V2), None),
        &["not the one"],
    );
    alloc(&mut kv3, 0, 0, 13);
    expect_err(
        s.drafter.append_context(&kv3, sl, 0, &feats),
        &["not the one"],
    );
    // Same pool size but the request has no blocks there.
    expect_err(
        s.drafter
            .draft(&kv2, &s.target, &req(0, 5, 13, 7, DraftMode::V2), None),
        &["allocate_slots"],
    );
    // After the manager frees the request, its blocks are gone: an error, not a read.
    let v1_full = s
        .drafter
        .draft(&s.kv, &s.target, &req(0, 5, 13, 7, DraftMode::V1), None)
        .unwrap();
    s.kv.free(sl);
    expect_err(
        s.drafter
            .draft(&s.kv, &s.target, &req(0, 5, 13, 7, DraftMode::V2), None),
        &["allocate_slots"],
    );
    s.drafter.release(sl);
    assert_eq!(s.drafter.context_len(sl), None);

    // A v1-only checkpoint: loads, drafts v1 exactly like the full one, refuses v2.
    let d = TmpDir::fixture_with("v1only", |t| {
        t.retain(|x| !(x.name.contains("_conv.") || x.name.starts_with("candidate_selector")))
    });
    let w1 = DFlash2Weights::load(&d.0).unwrap();
    assert!(!w1.has_v2());
    let mut s1 = setup(w1);
    alloc(&mut s1.kv, 0, 0, 13);
    s1.drafter.append_context(&s1.kv, sl, 0, &feats).unwrap();
    let v1 = s1
        .drafter
        .draft(&s1.kv, &s1.target, &req(0, 5, 13, 7, DraftMode::V1), None)
        .unwrap();
    assert_eq!(v1.tokens, v1_full.tokens);
    expect_err(
        s1.drafter
            .draft(&s1.kv, &s1.target, &req(0, 5, 13, 7, DraftMode::V2), None),
        &["v2", "v1-only"],
    );
}

#[test]
fn wrong_kv_group() {
    let target = ModelWeights::load(&root().join("tests/fixtures/model")).unwrap();
    let w = DFlash2Weights::load(&drafter_dir()).unwrap();
    let kv = manager(&target.cfg, &w.cfg, 4);
    // The target's full-attention group, a group that does not exist.
    expect_err(
        DFlash2::new(w.clone(), &target.cfg, &kv, 0),
        &["groups[0]", "sliding_window group"],
    );
    expect_err(DFlash2::new(w.clone(), &target.cfg, &kv, 9), &["groups[9]"]);
    // A sliding-window group with another window.
    let other = micro_cfg(|c| c.sliding_window = 32);
    let kv = manager(&target.cfg, &other, 4);
    let g = DFlash2::find_group(&kv).unwrap();
    expect_err(
        DFlash2::new(w.clone(), &target.cfg, &kv, g),
        &["sliding_window 32", "16"],
    );
    // A group whose memory describes other pages.
    let mut layout = target.cfg.kv_layout(16, 7, 64).unwrap();
    let mut spec = w.cfg.kv_group(4, CapPolicy::None).unwrap();
    spec.memory.as_mut().unwrap().page_size_bytes /= 2; // bf16 pages: not this engine's f32 store
    layout.groups.push(spec);
    let kv = KvCacheManager::new(&layout, 64).unwrap();
    let g = DFlash2::find_group(&kv).unwrap();
    expect_err(
        DFlash2::new(w, &target.cfg, &kv, g),
        &["memory", "f32 pages"],
    );
}
