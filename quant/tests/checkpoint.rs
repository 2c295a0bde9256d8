//! Checkpoint tests: pack-quantized write/read round trip (single file and shards with
//! index.json), config.json's quantization_config against docs/model.md §8, stale-file
//! removal, write errors, and the ignore-list semantics on the doc's list.

use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use safetensors::tensor::SafeTensors;
use serde_json::{json, Value};
use speclab_quant::checkpoint::{INDEX_FILE, SINGLE_FILE};
use speclab_quant::{
    is_quantized, quantize_rtn, read_config, read_safetensors_dir, read_w4a16,
    write_pack_quantized, Dtype, IgnoreList, QuantError, QuantizationConfig, TensorData,
    W4A16Tensor, WriteOptions,
};

/// `quantization_config` exactly as docs/model.md §8 shows it (micro preset).
const DOC_QCFG: &str = r#"{
  "config_groups": {
    "group_0": {
      "format": null,
      "input_activations": null,
      "output_activations": null,
      "targets": [
        "Linear"
      ],
      "weights": {
        "actorder": null,
        "block_structure": null,
        "dynamic": false,
        "group_size": 128,
        "num_bits": 4,
        "observer": "memoryless_minmax",
        "observer_kwargs": {},
        "scale_dtype": null,
        "strategy": "group",
        "symmetric": true,
        "type": "int",
        "zp_dtype": null
      }
    }
  },
  "format": "pack-quantized",
  "global_compression_ratio": null,
  "ignore": [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*linear_attn.*",
    "re:.*mlp\\.gate$",
    "re:.*shared_experts.*",
    "re:model\\.layers\\.0\\.mlp\\..*",
    "re:model\\.layers\\.4\\..*"
  ],
  "kv_cache_scheme": null,
  "quant_method": "compressed-tensors",
  "quantization_status": "compressed",
  "sparsity_config": {},
  "transform_config": {},
  "version": "0.17.0"
}"#;

fn doc_ignore() -> Vec<String> {
    let v: Value = serde_json::from_str(DOC_QCFG).unwrap();
    v["ignore"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap().to_string())
        .collect()
}

fn bf16_tensor(shape: Vec<usize>, seed: usize) -> TensorData {
    let n: usize = shape.iter().product();
    let v: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32((((i + seed) * 2654435761) % 997) as f32 / 997.0 - 0.5))
        .collect();
    TensorData::from_bf16(shape, &v).unwrap()
}

/// A micro-like model: dense layer 0, MoE layer 1 (2 experts), MTP layer 4, embeddings.
fn model() -> (BTreeMap<String, TensorData>, BTreeMap<String, W4A16Tensor>) {
    let h = 128;
    let mut t = BTreeMap::new();
    let mut s = 0;
    let mut add = |t: &mut BTreeMap<String, TensorData>, name: &str, shape: Vec<usize>| {
        s += 1;
        t.insert(name.to_string(), bf16_tensor(shape, s));
    };
    add(&mut t, "model.embed_tokens.weight", vec![64, h]);
    add(&mut t, "lm_head.weight", vec![64, h]);
    add(&mut t, "model.norm.weight", vec![h]);
    add(&mut t, "model.layers.0.mlp.gate_proj.weight", vec![256, h]);
    add(&mut t, "model.layers.0.mlp.down_proj.weight", vec![h, 256]);
    add(
        &mut t,
        "model.layers.0.linear_attn.q_proj.weight",
        vec![64, h],
    );
    add(
        &mut t,
        "model.layers.1.self_attn.q_proj.weight",
        vec![128, h],
    );
    add(&mut t, "model.layers.1.mlp.gate.weight", vec![2, h]);
    add(
        &mut t,
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        vec![h, h],
    );
    add(
        &mut t,
        "model.layers.4.mlp.experts.0.up_proj.weight",
        vec![h, h],
    );
    for j in 0..2 {
        for p in ["gate_proj", "up_proj", "down_proj"] {
            add(
                &mut t,
                &format!("model.layers.1.mlp.experts.{j}.{p}.weight"),
                vec![h, h],
            );
        }
    }
    t.insert(
        "model.layers.1.mlp.gate.e_score_correction_bias".into(),
        TensorData::from_f32(vec![2], &[0.25, -0.5]).unwrap(),
    );
    let mut q = BTreeMap::new();
    for j in 0..2 {
        for p in ["gate_proj", "up_proj", "down_proj"] {
            let m = format!("model.layers.1.mlp.experts.{j}.{p}");
            let w = t[&format!("{m}.weight")].to_f32().unwrap();
            q.insert(m, quantize_rtn(&w, h, h).unwrap());
        }
    }
    (t, q)
}

fn base_config() -> Value {
    json!({"model_type": "speclab_glm5_next_tiny", "hidden_size": 128, "torch_dtype": "bfloat16"})
}

fn check_round_trip(
    dir: &Path,
    t: &BTreeMap<String, TensorData>,
    q: &BTreeMap<String, W4A16Tensor>,
) {
    let back = read_safetensors_dir(dir).unwrap();
    for (name, td) in t {
        let m = name.strip_suffix(".weight").unwrap_or("");
        if q.contains_key(m) {
            assert!(!back.contains_key(name), "{name} should be replaced");
        } else {
            assert_eq!(&back[name], td, "{name} copied byte for byte");
        }
    }
    for (m, qt) in q {
        assert_eq!(back[&format!("{m}.weight_packed")].dtype, Dtype::I32);
        assert_eq!(back[&format!("{m}.weight_packed")].shape, vec![128, 16]);
        assert_eq!(back[&format!("{m}.weight_scale")].dtype, Dtype::BF16);
        assert_eq!(back[&format!("{m}.weight_scale")].shape, vec![128, 1]);
        assert_eq!(
            back[&format!("{m}.weight_shape")].to_i64().unwrap(),
            vec![128, 128]
        );
        assert_eq!(&read_w4a16(&back, m).unwrap(), qt);
    }
    assert_eq!(back.len(), t.len() + 2 * q.len());
    // config.json: base keys kept, quantization_config exactly the doc's
    let cfg = read_config(dir).unwrap();
    assert_eq!(cfg["model_type"], "speclab_glm5_next_tiny");
    assert_eq!(
        cfg["quantization_config"],
        serde_json::from_str::<Value>(DOC_QCFG).unwrap()
    );
    assert_eq!(
        QuantizationConfig::from_json(&cfg["quantization_config"])
            .unwrap()
            .ignore,
        doc_ignore()
    );
    // keys sorted in the file (as compressed-tensors' json.dump(sort_keys=True))
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let qc_text = &text[text.find("\"quantization_config\"").unwrap()..];
    let pos: Vec<usize> = [
        "config_groups",
        "format",
        "global_compression_ratio",
        "ignore",
        "version",
    ]
    .iter()
    .map(|k| qc_text.find(&format!("\"{k}\"")).unwrap())
    .collect();
    assert!(pos.windows(2).all(|w| w[0] < w[1]), "{pos:?}");
}

#[test]
fn single_file_round_trip() {
    let (t, q) = model();
    let dir = tempfile::tempdir().unwrap();
    let qcfg = QuantizationConfig::new(doc_ignore());
    let rep = write_pack_quantized(
        dir.path(),
        &t,
        &q,
        &base_config(),
        &qcfg,
        &WriteOptions::default(),
    )
    .unwrap();
    assert_eq!(
        rep.files,
        vec![SINGLE_FILE.to_string(), "config.json".to_string()]
    );
    assert_eq!(rep.quantized_modules, 6);
    assert_eq!(rep.tensors, t.len() + 12);
    assert_eq!(
        rep.unquantized_not_ignored,
        vec!["model.embed_tokens.weight".to_string()]
    );
    check_round_trip(dir.path(), &t, &q);
    // header metadata format=pt
    let bytes = std::fs::read(dir.path().join(SINGLE_FILE)).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
    // no temporary files left behind
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
    if let Ok(keep) = std::env::var("SPECLAB_QUANT_KEEP") {
        write_pack_quantized(
            Path::new(&keep),
            &t,
            &q,
            &base_config(),
            &qcfg,
            &WriteOptions::default(),
        )
        .unwrap();
    }
}

#[test]
fn sharded_round_trip_and_stale_removal() {
    let (t, q) = model();
    let dir = tempfile::tempdir().unwrap();
    let qcfg = QuantizationConfig::new(doc_ignore());
    let max = 80 * 1024;
    let opts = WriteOptions {
        max_shard_bytes: Some(max),
    };
    let rep = write_pack_quantized(dir.path(), &t, &q, &base_config(), &qcfg, &opts).unwrap();
    let shards: Vec<&String> = rep
        .files
        .iter()
        .filter(|f| f.ends_with(".safetensors"))
        .collect();
    assert!(shards.len() >= 3, "{:?}", rep.files);
    for (i, f) in shards.iter().enumerate() {
        assert_eq!(
            **f,
            format!("model-{:05}-of-{:05}.safetensors", i + 1, shards.len())
        );
        assert!(std::fs::metadata(dir.path().join(f)).unwrap().len() <= max);
    }
    assert!(rep.files.contains(&INDEX_FILE.to_string()));
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(INDEX_FILE)).unwrap())
            .unwrap();
    let wm = index["weight_map"].as_object().unwrap();
    assert_eq!(wm.len(), rep.tensors);
    assert_eq!(
        index["metadata"]["total_size"].as_u64().unwrap(),
        rep.total_size
    );
    // each tensor is in the file the index names
    for f in &shards {
        let bytes = std::fs::read(dir.path().join(f)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for name in st.names() {
            assert_eq!(wm[name], f.as_str());
        }
    }
    let data_bytes: u64 = read_safetensors_dir(dir.path())
        .unwrap()
        .values()
        .map(|t| t.data.len() as u64)
        .sum();
    assert_eq!(data_bytes, rep.total_size);
    check_round_trip(dir.path(), &t, &q);

    // Re-writing as one file removes the shards and the index.
    let rep2 = write_pack_quantized(
        dir.path(),
        &t,
        &q,
        &base_config(),
        &qcfg,
        &WriteOptions::default(),
    )
    .unwrap();
    assert_eq!(rep2.removed_stale.len(), shards.len() + 1);
    assert!(!dir.path().join(INDEX_FILE).exists());
    check_round_trip(dir.path(), &t, &q);

    // A max size that holds everything gives one file, no index.
    let big = WriteOptions {
        max_shard_bytes: Some(16 << 20),
    };
    let rep3 = write_pack_quantized(dir.path(), &t, &q, &base_config(), &qcfg, &big).unwrap();
    assert_eq!(
        rep3.files,
        vec![SINGLE_FILE.to_string(), "config.json".to_string()]
    );
}

#[test]
fn write_errors() {
    let (t, q) = model();
    let qcfg = QuantizationConfig::new(doc_ignore());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let w =
        |t: &BTreeMap<String, TensorData>,
         q: &BTreeMap<String, W4A16Tensor>,
         qcfg: &QuantizationConfig,
         o: &WriteOptions| { write_pack_quantized(&out, t, q, &base_config(), qcfg, o) };
    let d = WriteOptions::default();
    // a shard limit smaller than one tensor: error, nothing written
    let e = w(
        &t,
        &q,
        &qcfg,
        &WriteOptions {
            max_shard_bytes: Some(4096),
        },
    )
    .unwrap_err();
    assert!(
        matches!(e, QuantError::Checkpoint(ref m) if m.contains("does not fit")),
        "{e}"
    );
    assert!(!out.exists());
    // quantizing an ignored module
    let mut q2 = q.clone();
    let shared = "model.layers.1.mlp.shared_experts.up_proj";
    q2.insert(
        shared.into(),
        quantize_rtn(&t[&format!("{shared}.weight")].to_f32().unwrap(), 128, 128).unwrap(),
    );
    let e = w(&t, &q2, &qcfg, &d).unwrap_err();
    assert!(e.to_string().contains("re:.*shared_experts.*"), "{e}");
    // missing weight / wrong shape
    let mut q3 = q.clone();
    q3.insert(
        "model.layers.1.mlp.experts.9.up_proj".into(),
        q.values().next().unwrap().clone(),
    );
    assert!(w(&t, &q3, &qcfg, &d).is_err());
    let mut t4 = t.clone();
    t4.insert(
        "model.layers.1.mlp.experts.0.up_proj.weight".into(),
        bf16_tensor(vec![128, 256], 0),
    );
    assert!(w(&t4, &q, &qcfg, &d).is_err());
    // name collision with an existing weight_scale
    let mut t5 = t.clone();
    t5.insert(
        "model.layers.1.mlp.experts.0.up_proj.weight_scale".into(),
        bf16_tensor(vec![128, 1], 0),
    );
    assert!(w(&t5, &q, &qcfg, &d).is_err());
    // bad regex in the ignore list
    let e = w(&t, &q, &QuantizationConfig::new(vec!["re:(".into()]), &d).unwrap_err();
    assert!(matches!(e, QuantError::Regex { .. }));
    // inconsistent public fields
    let mut q6 = q.clone();
    q6.values_mut().next().unwrap().scale.pop();
    assert!(w(&t, &q6, &qcfg, &d).is_err());
    // base config not an object
    assert!(write_pack_quantized(&out, &t, &q, &json!([1]), &qcfg, &d).is_err());
    // reading a directory without a checkpoint
    assert!(matches!(
        read_safetensors_dir(dir.path()),
        Err(QuantError::Io { .. })
    ));
}

#[test]
fn ignore_list_semantics_on_doc_list() {
    let ig = doc_ignore();
    let list = IgnoreList::new(&ig).unwrap();
    let cases = [
        // routed experts of MoE layers 1..3: quantized
        ("model.layers.1.mlp.experts.0.gate_proj", true),
        ("model.layers.3.mlp.experts.3.down_proj", true),
        ("model.layers.2.mlp.experts.1.up_proj", true),
        // MTP layer 4: ignored (also its experts)
        ("model.layers.4.mlp.experts.0.up_proj", false),
        ("model.layers.4.eh_proj", false),
        // dense prefix layer 0
        ("model.layers.0.mlp.gate_proj", false),
        // attention, router, shared experts, lm_head
        ("model.layers.3.self_attn.q_proj", false),
        ("model.layers.1.linear_attn.f_a_proj", false),
        ("model.layers.1.mlp.gate", false),
        ("model.layers.1.mlp.shared_experts.down_proj", false),
        ("lm_head", false),
        // exact entries are exact; anchored at the start only
        ("model.lm_head", true),
        ("lm_head.extra", true),
        ("model.layers.1.mlp.gate_proj", true), // `gate$`: not the dense gate_proj
        ("model.layers.10.mlp.experts.0.up_proj", true), // layers\.0\. is not a prefix of layers.10.
        ("model.layers.40.mlp.experts.0.up_proj", true), // nor layers\.4\. of layers.40.
        ("x.model.layers.0.mlp.up_proj", true),          // re.match anchors at the start
    ];
    for (m, want) in cases {
        assert_eq!(is_quantized(m, &ig), want, "{m}");
        assert_eq!(list.is_quantized(m), want, "{m}");
    }
    assert_eq!(
        list.matching_entry("model.layers.1.mlp.gate"),
        Some("re:.*mlp\\.gate$")
    );
    // an uncompilable regex matches nothing in the free function, is an error in IgnoreList
    let bad = vec!["re:(?<=x)y".to_string(), "re:[".to_string()];
    assert!(is_quantized("xy", &bad));
    assert!(IgnoreList::new(&bad).is_err());
    // alternation stays anchored: ^(?:a|b) not ^a|b
    let alt = vec!["re:foo|bar".to_string()];
    assert!(!is_quantized("bar.x", &alt));
    assert!(is_quantized("x.bar", &alt));
}

#[test]
fn quantization_config_json() {
    let qc = QuantizationConfig::new(doc_ignore());
    let v = qc.to_json();
    assert_eq!(v, serde_json::from_str::<Value>(DOC_QCFG).unwrap());
    assert_eq!(QuantizationConfig::from_json(&v).unwrap(), qc);
    // actorder "weight" (alias "static") keeps the format
    for a in ["weight", "static"] {
        let mut w = v.clone();
        w["config_groups"]["group_0"]["weights"]["actorder"] = json!(a);
        assert!(QuantizationConfig::from_json(&w).is_ok(), "{a}");
    }
    // rejects other schemes
    for (ptr, bad) in [
        ("/format", json!("int-quantized")),
        ("/quant_method", json!("gptq")),
        ("/config_groups/group_0/weights/num_bits", json!(8)),
        ("/config_groups/group_0/weights/group_size", json!(64)),
        ("/config_groups/group_0/weights/symmetric", json!(false)),
        ("/config_groups/group_0/weights/actorder", json!("group")),
        ("/config_groups/group_0/weights/actorder", json!("dynamic")),
        ("/config_groups/group_0/weights/actorder", json!(true)),
        (
            "/config_groups/group_0/input_activations",
            json!({"num_bits": 8}),
        ),
        ("/config_groups/group_0/targets", json!(["Embedding"])),
        ("/ignore", json!("lm_head")),
    ] {
        let mut w = v.clone();
        *w.pointer_mut(ptr).unwrap() = bad;
        assert!(QuantizationConfig::from_json(&w).is_err(), "{ptr}");
    }
}
