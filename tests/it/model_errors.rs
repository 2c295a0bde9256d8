//! Malformed model inputs give clear errors, never panics (docs/model.md §7-§9).
//!
//! Each case copies the micro fixture (`tests/fixtures/model/`) into a fresh temp
//! directory, breaks one thing (truncated or corrupt safetensors, a wrong shape or
//! dtype, a missing tensor or shard, a config that does not match the weights, an
//! unsupported config value, a quantized module that disagrees with
//! `quantization_config`) and checks the error names the file, tensor or key.

use std::path::{Path, PathBuf};

use speclab_engine::model::checkpoint::{
    write_checkpoint, write_safetensors, NamedTensor, TensorDtype,
};
use speclab_engine::model::{ModelConfig, ModelWeights};
use speclab_engine::EngineError;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/model")
}

/// A fresh temp dir holding a copy of the bf16 (or W4A16) checkpoint.
struct Tmp(PathBuf);
impl Tmp {
    fn new(tag: &str, w4a16: bool) -> Self {
        let d =
            std::env::temp_dir().join(format!("speclab-model-errors-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let src = if w4a16 {
            fixture().join("w4a16")
        } else {
            fixture()
        };
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), d.join(f)).unwrap();
        }
        Self(d)
    }
    fn path(&self, f: &str) -> PathBuf {
        self.0.join(f)
    }
    fn config(&self) -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(self.path("config.json")).unwrap()).unwrap()
    }
    fn set_config(&self, v: &serde_json::Value) {
        std::fs::write(
            self.path("config.json"),
            serde_json::to_string_pretty(v).unwrap(),
        )
        .unwrap();
    }
    /// The checkpoint's tensors as stored.
    fn tensors(&self) -> Vec<NamedTensor> {
        ModelWeights::load(&self.0).unwrap().tensors()
    }
    fn write(&self, t: &[NamedTensor]) {
        write_safetensors(&self.path("model.safetensors"), t).unwrap();
    }
    fn load_err(&self) -> EngineError {
        match ModelWeights::load(&self.0) {
            Ok(_) => panic!("loading {} should fail", self.0.display()),
            Err(e) => e,
        }
    }
}
impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn has(e: &EngineError, parts: &[&str]) {
    let s = e.to_string();
    for p in parts {
        assert!(s.contains(p), "error {s:?} should mention {p:?}");
    }
    println!("ok: {s}");
}

#[test]
fn truncated_and_corrupt_safetensors() {
    let t = Tmp::new("trunc", false);
    let f = t.path("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() - 100]).unwrap();
    let e = t.load_err();
    assert!(matches!(e, EngineError::CorruptCheckpoint { .. }), "{e:?}");
    has(&e, &["model.safetensors", "truncated"]);
    // header length larger than the file
    let mut b = bytes.clone();
    b[..8].copy_from_slice(&(10_000_000u64).to_le_bytes());
    std::fs::write(&f, &b).unwrap();
    has(&t.load_err(), &["model.safetensors", "corrupt"]);
    // garbage in the JSON header
    let mut b = bytes.clone();
    for x in &mut b[8..40] {
        *x = b'#';
    }
    std::fs::write(&f, &b).unwrap();
    has(&t.load_err(), &["model.safetensors", "corrupt"]);
    // empty file
    std::fs::write(&f, b"").unwrap();
    has(&t.load_err(), &["model.safetensors"]);
}

#[test]
fn wrong_shape_missing_tensor_and_dtype() {
    let t = Tmp::new("shape", false);
    let base = t.tensors();
    // A different rank (the conv stored as [C, kc]): a plain shape error.
    let mut ts = base.clone();
    let c = ts
        .iter_mut()
        .find(|x| x.name == "model.layers.0.linear_attn.q_conv1d.weight")
        .unwrap();
    c.shape = vec![c.shape[0], c.shape[2]];
    t.write(&ts);
    let e = t.load_err();
    assert!(matches!(e, EngineError::TensorShape { .. }), "{e:?}");
    has(
        &e,
        &[
            "model.safetensors",
            "model.layers.0.linear_attn.q_conv1d.weight",
            "[64, 4]",
            "[64, 1, 4]",
        ],
    );
    // A config-driven axis swapped: names the key and the axis.
    let mut ts = base.clone();
    let c = ts
        .iter_mut()
        .find(|x| x.name == "model.layers.0.linear_attn.q_conv1d.weight")
        .unwrap();
    c.shape = vec![c.shape[0], c.shape[2], 1];
    t.write(&ts);
    has(
        &t.load_err(),
        &[
            "linear_conv_kernel_dim",
            "q_conv1d",
            "[64, 4, 1]",
            "axis 2 is 1",
        ],
    );
    // A config-driven dimension: names the key.
    let mut ts = base.clone();
    let o = ts
        .iter_mut()
        .find(|x| x.name == "model.layers.1.linear_attn.o_norm.weight")
        .unwrap();
    o.shape = vec![16];
    o.data.truncate(32);
    t.write(&ts);
    let e = t.load_err();
    assert!(matches!(e, EngineError::ConfigMismatch { .. }), "{e:?}");
    has(
        &e,
        &[
            "linear_head_dim",
            "model.layers.1.linear_attn.o_norm.weight",
            "model.safetensors",
        ],
    );
    // Missing tensor.
    let ts: Vec<NamedTensor> = base
        .iter()
        .filter(|x| x.name != "model.norm.weight")
        .cloned()
        .collect();
    t.write(&ts);
    let e = t.load_err();
    assert!(matches!(e, EngineError::MissingTensor { .. }), "{e:?}");
    has(&e, &["model.safetensors", "model.norm.weight"]);
    // fp32-only tensor stored as bf16.
    let ts: Vec<NamedTensor> = base
        .iter()
        .map(|x| {
            if x.name == "model.layers.2.linear_attn.A_log" {
                NamedTensor::bf16(&x.name, x.shape.clone(), &[1.0, 2.0])
            } else {
                x.clone()
            }
        })
        .collect();
    t.write(&ts);
    let e = t.load_err();
    assert!(matches!(e, EngineError::TensorDtype { .. }), "{e:?}");
    has(&e, &["model.layers.2.linear_attn.A_log", "BF16", "F32"]);
    // A tensor the config does not use.
    let mut ts = base.clone();
    ts.push(NamedTensor::f32(
        "model.layers.0.mystery.weight",
        vec![2],
        &[0.0, 1.0],
    ));
    t.write(&ts);
    has(
        &t.load_err(),
        &["model.layers.0.mystery.weight", "does not use"],
    );
}

#[test]
fn config_not_matching_the_weights() {
    let t = Tmp::new("mismatch", false);
    let orig = t.config();
    let cases: Vec<(&str, serde_json::Value, &[&str])> = vec![
        (
            "hidden_size",
            serde_json::json!(256),
            &["hidden_size", "model.embed_tokens.weight"],
        ),
        (
            "vocab_size",
            serde_json::json!(1024),
            &["vocab_size", "model.embed_tokens.weight"],
        ),
        (
            "n_routed_experts",
            serde_json::json!(3),
            &["n_routed_experts", "experts.3"],
        ),
        (
            "n_routed_experts",
            serde_json::json!(8),
            &["n_routed_experts", "mlp.gate.weight"],
        ),
        (
            "num_hidden_layers",
            serde_json::json!(3),
            &["num_hidden_layers"],
        ),
        (
            "layer_types",
            serde_json::json!([
                "linear_attention",
                "linear_attention",
                "full_attention",
                "full_attention"
            ]),
            &["layer_types[2]", "model.layers.2"],
        ),
        (
            "first_k_dense_replace",
            serde_json::json!(2),
            &["first_k_dense_replace", "model.layers.1"],
        ),
        (
            "linear_num_heads",
            serde_json::json!(4),
            &["linear_num_heads"],
        ),
        (
            "num_key_value_heads",
            serde_json::json!(4),
            &[
                "num_key_value_heads",
                "model.layers.3.self_attn.k_proj.weight",
            ],
        ),
    ];
    for (key, val, parts) in cases {
        let mut c = orig.clone();
        c[key] = val;
        if key == "num_hidden_layers" {
            c["layer_types"] =
                serde_json::json!(["linear_attention", "linear_attention", "full_attention"]);
        }
        t.set_config(&c);
        let e = t.load_err();
        assert!(
            matches!(e, EngineError::ConfigMismatch { .. }),
            "{key}: {e:?}"
        );
        has(&e, parts);
    }
}

#[test]
fn unsupported_config_values() {
    let t = Tmp::new("unsupported", true);
    let orig = t.config();
    type Edit = fn(&mut serde_json::Value);
    let cases: Vec<(Edit, &[&str])> = vec![
        (
            |c| {
                c["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] =
                    false.into()
            },
            &["weights.symmetric", "asymmetric"],
        ),
        (
            |c| c["layer_types"][0] = "sliding_attention".into(),
            &[
                "layer_types[0]",
                "sliding_attention",
                "linear_attention",
                "full_attention",
            ],
        ),
        (
            |c| c["scoring_func"] = "softmax".into(),
            &["scoring_func", "softmax", "sigmoid"],
        ),
        (
            |c| c["topk_method"] = "greedy".into(),
            &["topk_method", "noaux_tc"],
        ),
        (|c| c["n_group"] = 8.into(), &["n_group", "8"]),
        (|c| c["topk_group"] = 4.into(), &["topk_group"]),
        (
            |c| c["hidden_act"] = "gelu".into(),
            &["hidden_act", "gelu", "silu"],
        ),
        (
            |c| c["num_nextn_predict_layers"] = 2.into(),
            &["num_nextn_predict_layers", "2"],
        ),
        (
            |c| c["num_key_value_heads"] = 3.into(),
            &["num_key_value_heads", "divide"],
        ),
        (
            |c| c["layer_types"] = serde_json::json!(["linear_attention"]),
            &["layer_types", "num_hidden_layers"],
        ),
        (
            |c| c["model_type"] = "llama".into(),
            &["model_type", "speclab_glm5_next_tiny"],
        ),
        (
            |c| c["quantization_config"]["quant_method"] = "gptq".into(),
            &["quant_method", "compressed-tensors"],
        ),
        (
            |c| c["quantization_config"]["format"] = "int-quantized".into(),
            &["format", "pack-quantized"],
        ),
        (
            |c| {
                c["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] =
                    8.into()
            },
            &["num_bits", "8", "4"],
        ),
        (
            |c| {
                c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] =
                    64.into()
            },
            &["group_size", "64", "128"],
        ),
        (
            |c| {
                c["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] =
                    "channel".into()
            },
            &["strategy", "channel", "group"],
        ),
        (
            |c| {
                c["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] =
                    "group".into()
            },
            &["actorder"],
        ),
        (
            |c| {
                c["quantization_config"]["config_groups"]["group_0"]["input_activations"] =
                    serde_json::json!({"num_bits": 8})
            },
            &["input_activations"],
        ),
        (
            |c| c["quantization_config"]["ignore"][1] = "re:(".into(),
            &["ignore[1]", "regex"],
        ),
        (
            |c| c["bos_token_id"] = 512.into(),
            &["bos_token_id", "vocab_size"],
        ),
        (|c| c["rms_norm_eps"] = (-1.0).into(), &["rms_norm_eps"]),
    ];
    for (edit, parts) in cases {
        let mut c = orig.clone();
        edit(&mut c);
        t.set_config(&c);
        let e = t.load_err();
        assert!(matches!(e, EngineError::InvalidConfig { .. }), "{e:?}");
        has(&e, parts);
    }
    // Parse errors name the file and the key.
    let mut c = orig.clone();
    c.as_object_mut().unwrap().remove("hidden_size");
    t.set_config(&c);
    let e = t.load_err();
    assert!(matches!(e, EngineError::ConfigParse { .. }), "{e:?}");
    has(&e, &["config.json", "hidden_size"]);
    std::fs::write(t.path("config.json"), "{ not json").unwrap();
    has(&t.load_err(), &["config.json"]);
    std::fs::remove_file(t.path("config.json")).unwrap();
    has(&t.load_err(), &["config.json"]);
    // The config alone (no weights) validates the same way.
    let mut c = ModelConfig::micro();
    c.layer_types[3] = "mamba".into();
    has(&c.validate().unwrap_err(), &["layer_types[3]", "mamba"]);
}

#[test]
fn quantized_modules_must_match_quantization_config() {
    let t = Tmp::new("quant", true);
    let base = t.tensors();
    // A routed expert stored dense instead of packed.
    let m = "model.layers.2.mlp.experts.1.up_proj";
    let mut ts: Vec<NamedTensor> = base
        .iter()
        .filter(|x| !x.name.starts_with(&format!("{m}.weight_")))
        .cloned()
        .collect();
    ts.push(NamedTensor::bf16(
        &format!("{m}.weight"),
        vec![128, 128],
        &vec![0.0; 128 * 128],
    ));
    t.write(&ts);
    let e = t.load_err();
    assert!(matches!(e, EngineError::Quantization { .. }), "{e:?}");
    has(&e, &[m, "weight_packed", "dense"]);
    // A routed expert with no weight at all.
    let ts: Vec<NamedTensor> = base
        .iter()
        .filter(|x| !x.name.starts_with(&format!("{m}.")))
        .cloned()
        .collect();
    t.write(&ts);
    has(&t.load_err(), &[m, "weight_packed"]);
    // A packed tensor where the ignore list says dense (the shared expert).
    let s = "model.layers.1.mlp.shared_experts.gate_proj";
    let mut ts: Vec<NamedTensor> = base
        .iter()
        .filter(|x| x.name != format!("{s}.weight"))
        .cloned()
        .collect();
    ts.push(NamedTensor::i32(
        &format!("{s}.weight_packed"),
        vec![128, 16],
        &vec![0x8888_8888u32 as i32; 128 * 16],
    ));
    ts.push(NamedTensor::bf16(
        &format!("{s}.weight_scale"),
        vec![128, 1],
        &[1.0; 128],
    ));
    ts.push(NamedTensor::i64(
        &format!("{s}.weight_shape"),
        vec![2],
        &[128, 128],
    ));
    t.write(&ts);
    let e = t.load_err();
    assert!(matches!(e, EngineError::Quantization { .. }), "{e:?}");
    has(&e, &[s, "unexpected packed tensor", "ignore"]);
    // Packed tensors with a config that has no quantization_config.
    t.write(&base);
    let mut c = t.config();
    c.as_object_mut().unwrap().remove("quantization_config");
    t.set_config(&c);
    has(&t.load_err(), &["weight_packed", "no quantization_config"]);
    // weight_packed with the wrong dtype; weight_shape disagreeing with the config.
    let mut c = t.config();
    c["quantization_config"] = ModelConfig::micro()
        .with_quantization()
        .quantization_config
        .map(|q| serde_json::to_value(q).unwrap())
        .unwrap();
    t.set_config(&c);
    let p = "model.layers.3.mlp.experts.0.down_proj";
    let ts: Vec<NamedTensor> = base
        .iter()
        .map(|x| {
            if x.name == format!("{p}.weight_packed") {
                NamedTensor {
                    dtype: TensorDtype::F32,
                    ..x.clone()
                }
            } else {
                x.clone()
            }
        })
        .collect();
    t.write(&ts);
    let e = t.load_err();
    assert!(matches!(e, EngineError::TensorDtype { .. }), "{e:?}");
    has(&e, &[&format!("{p}.weight_packed"), "I32", "F32"]);
    let ts: Vec<NamedTensor> = base
        .iter()
        .map(|x| {
            if x.name == format!("{p}.weight_shape") {
                NamedTensor::i64(&x.name, vec![2], &[128, 256])
            } else {
                x.clone()
            }
        })
        .collect();
    t.write(&ts);
    has(&t.load_err(), &[&format!("{p}.weight_shape"), "[128, 256]"]);
}

#[test]
fn sharded_checkpoints_and_missing_shard() {
    let t = Tmp::new("shards", true);
    let w = ModelWeights::load(&t.0).unwrap();
    std::fs::remove_file(t.path("model.safetensors")).unwrap();
    let files = write_checkpoint(&t.0, &w.tensors(), Some(700_000)).unwrap();
    assert!(files.len() >= 4, "{files:?}");
    assert_eq!(
        ModelWeights::load(&t.0).unwrap(),
        w,
        "sharded load equals the single file"
    );
    // A shard the index names is missing.
    std::fs::remove_file(t.path(&files[1])).unwrap();
    let e = t.load_err();
    assert!(matches!(e, EngineError::CorruptCheckpoint { .. }), "{e:?}");
    has(
        &e,
        &["model.safetensors.index.json", &files[1], "does not exist"],
    );
    // The index names a tensor its shard does not hold.
    write_checkpoint(&t.0, &w.tensors(), Some(700_000)).unwrap();
    let idx = t.path("model.safetensors.index.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&idx).unwrap()).unwrap();
    v["weight_map"]["model.norm.weight"] = files[0].clone().into();
    std::fs::write(&idx, v.to_string()).unwrap();
    has(&t.load_err(), &["model.norm.weight", &files[0]]);
    std::fs::write(&idx, "[]").unwrap();
    has(
        &t.load_err(),
        &["model.safetensors.index.json", "weight_map"],
    );
}
