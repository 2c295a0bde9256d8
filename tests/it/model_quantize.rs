//! `speclab init-model` + `speclab quantize` end to end, and the calibration tap.
//!
//! Pins: the observed forward (GPTQ calibration) computes exactly what the
//! plain forward computes; a quantized checkpoint loads with the same loader
//! as any W4A16 checkpoint and has exactly the routed experts packed; GPTQ's
//! objective beats RTN's on the same Hessians; bad inputs are clear errors.

use std::path::PathBuf;
use std::process::Command;

use speclab_engine::kv::KvCacheManager;
use speclab_engine::model::{
    Checkpoint, ExpertInput, ExpertObserver, ForwardOptions, ModelConfig, ModelRunner,
    ModelWeights, SeqChunk,
};
use speclab_engine::ReqSlot;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_speclab"))
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("speclab-q-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[derive(Default)]
struct Count {
    rows: std::collections::HashMap<(usize, ExpertInput), usize>,
}
impl ExpertObserver for Count {
    fn observe(
        &mut self,
        layer: usize,
        _expert: usize,
        input: ExpertInput,
        x: &[f32],
        rows: usize,
    ) {
        assert_eq!(x.len() % rows, 0);
        *self.rows.entry((layer, input)).or_default() += rows;
    }
}

#[test]
fn observed_forward_is_the_forward() {
    let cfg = ModelConfig::micro();
    let w = ModelWeights::random(&cfg, 3, false).unwrap();
    let toks: Vec<u32> = (0..20).map(|i| (i * 37 % 500) as u32).collect();
    let run = |observe: bool| {
        let mut kv = KvCacheManager::from_layout(&cfg.kv_layout(16, 0, 16).unwrap()).unwrap();
        kv.allocate_whole(ReqSlot(0), 20).unwrap();
        let mut r = ModelRunner::new(w.clone(), &kv).unwrap();
        let chunk = [SeqChunk {
            slot: ReqSlot(0),
            tokens: &toks,
            start_pos: 0,
            snapshot: false,
        }];
        let mut c = Count::default();
        let out = if observe {
            r.forward_observed(&kv, &chunk, &ForwardOptions::default(), &mut c)
                .unwrap()
        } else {
            r.forward(&kv, &chunk).unwrap()
        };
        (out.logits, c)
    };
    let (a, _) = run(false);
    let (b, c) = run(true);
    assert_eq!(a, b, "observing must not change the numbers");
    // Every token reaches num_experts_per_tok experts in every MoE layer, for both inputs.
    let moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace;
    assert_eq!(c.rows.len(), 2 * moe_layers);
    for (_, n) in c.rows {
        assert_eq!(n, 20 * cfg.num_experts_per_tok);
    }
}

#[test]
fn init_then_quantize_then_load() {
    let d = tmp("pipeline");
    let bf16 = d.join("bf16");
    let q = d.join("q");
    let st = bin()
        .args(["init-model", "--preset", "micro", "--seed", "5", "--out"])
        .arg(&bf16)
        .status()
        .unwrap();
    assert!(st.success());
    let out = bin()
        .args(["quantize", "--json", "--calib-random", "6:48", "--out"])
        .arg(&q)
        .arg(&bf16)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let cfg = ModelConfig::micro();
    let experts = (cfg.num_hidden_layers - cfg.first_k_dense_replace) * cfg.n_routed_experts * 3;
    assert_eq!(rep["matrices"].as_array().unwrap().len(), experts);
    // GPTQ minimises the proxy loss that RTN only bounds: it must come out lower overall.
    let ratio = rep["total_proxy_ratio_vs_rtn"].as_f64().unwrap();
    assert!(ratio < 1.0, "GPTQ / RTN proxy loss = {ratio}");
    // The result loads like any W4A16 checkpoint and packs exactly the routed experts.
    let w = ModelWeights::load(&q).unwrap();
    assert!(w.cfg.quantization_config.is_some());
    let ck = Checkpoint::open(&q).unwrap();
    let packed = ck.names().filter(|n| n.ends_with(".weight_packed")).count();
    assert_eq!(packed, experts);
    assert!(ck
        .names()
        .filter(|n| n.ends_with(".weight_packed"))
        .all(|n| n.contains(".mlp.experts.")));
    // Quantizing twice is refused.
    let again = bin()
        .args(["quantize", "--method", "rtn", "--out"])
        .arg(d.join("x"))
        .arg(&q)
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already quantized"));
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn quantize_input_errors() {
    let d = tmp("errors");
    let bf16 = d.join("bf16");
    assert!(bin()
        .args(["init-model", "--preset", "micro", "--out"])
        .arg(&bf16)
        .status()
        .unwrap()
        .success());
    let err = |args: &[&str]| {
        let o = bin()
            .arg("quantize")
            .arg(&bf16)
            .args(args)
            .output()
            .unwrap();
        assert!(!o.status.success());
        let e = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(!e.contains("panicked"), "{e}");
        e
    };
    assert!(err(&["--out", "/tmp/never"]).contains("calibration"));
    assert!(err(&["--out", "/tmp/never", "--calib-random", "nope"]).contains("N:LEN"));
    let bad = d.join("calib.json");
    std::fs::write(&bad, "[[1, 2, 999999]]").unwrap();
    let e = err(&["--out", "/tmp/never", "--calib", bad.to_str().unwrap()]);
    assert!(e.contains("999999") && e.contains("vocab_size"), "{e}");
    std::fs::write(&bad, "[[1, 2,").unwrap();
    let e = err(&["--out", "/tmp/never", "--calib", bad.to_str().unwrap()]);
    assert!(e.contains("calib.json:1:"), "{e}");
    std::fs::remove_dir_all(&d).ok();
}
