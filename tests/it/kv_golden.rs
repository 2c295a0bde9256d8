//! Golden traces: speclab's KV cache manager must answer exactly what vLLM does.
//!
//! Every `tests/golden/kv/*.json` (written by `recipes/kv_golden.py` from vLLM
//! 0.33.0's own `KVCacheManager`; format `{"name","reference","layout","ops",
//! "results"}`, layout/ops/results as in `docs/kv-replay-format.md`) is replayed
//! through `speclab_experiments::replay::Replayer`. Invariants asserted: for
//! every op, the op index and name, `blocks` (absent for non-allocate ops,
//! `null` on NoFit, else the new block ids per group) and `free` equal vLLM's.
//! The golden set must be substantial (>= 20 layouts, >= 2,000 ops) so that an
//! empty or truncated directory fails instead of passing vacuously.

use std::path::{Path, PathBuf};

use serde_json::Value;
use speclab_engine::kv::KvLayout;
use speclab_experiments::replay::{Op, Replayer};

const MIN_LAYOUTS: usize = 20;
const MIN_OPS: usize = 2_000;
/// Ops of context shown before a mismatch.
const CONTEXT: usize = 6;

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/kv")
}

fn golden_files() -> Vec<PathBuf> {
    let dir = golden_dir();
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "json"))
        .collect();
    v.sort();
    v
}

struct Golden {
    name: String,
    layout: KvLayout,
    ops: Vec<Op>,
    results: Vec<Value>,
}

fn load(path: &Path) -> Golden {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let field = |k: &str| {
        v.get(k)
            .cloned()
            .unwrap_or_else(|| panic!("{}: missing `{k}`", path.display()))
    };
    let layout: KvLayout = serde_json::from_value(field("layout"))
        .unwrap_or_else(|e| panic!("{}: layout: {e}", path.display()));
    let ops_v = field("ops");
    let ops_a = ops_v
        .as_array()
        .unwrap_or_else(|| panic!("{}: `ops` is not a list", path.display()));
    let ops = ops_a
        .iter()
        .enumerate()
        .map(|(i, o)| {
            serde_json::from_value(o.clone())
                .unwrap_or_else(|e| panic!("{}: ops[{i}] {o}: {e}", path.display()))
        })
        .collect();
    let results = field("results")
        .as_array()
        .cloned()
        .unwrap_or_else(|| panic!("{}: `results` is not a list", path.display()));
    let name = v
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("?")
        .to_string();
    Golden {
        name,
        layout,
        ops,
        results,
    }
}

/// Replay one golden; `Err` carries a full mismatch report.
fn check(path: &Path, g: &Golden) -> Result<(), String> {
    if g.ops.len() != g.results.len() {
        return Err(format!(
            "{}: {} ops but {} results",
            path.display(),
            g.ops.len(),
            g.results.len()
        ));
    }
    let context = |i: usize| -> String {
        let from = i.saturating_sub(CONTEXT);
        let mut s = String::new();
        for k in from..i {
            s += &format!("    [{k}] {}  ->  {}\n", g.ops[k], g.results[k]);
        }
        s
    };
    let mut r =
        Replayer::new(&g.layout).map_err(|e| format!("{}: layout refused: {e}", path.display()))?;
    for (i, (op, want)) in g.ops.iter().zip(&g.results).enumerate() {
        let got = match r.apply(op) {
            Ok(got) => got,
            Err(e) => {
                return Err(format!(
                "{} ({}): op {i} {op}: replay error: {e}\n  expected: {want}\n  previous ops:\n{}",
                path.display(),
                g.name,
                context(i)
            ))
            }
        };
        let got_v = serde_json::to_value(&got).map_err(|e| e.to_string())?;
        let same = got_v.get("i") == want.get("i")
            && got_v.get("op") == want.get("op")
            && got_v.get("blocks") == want.get("blocks")
            && got_v.get("free") == want.get("free");
        if !same {
            let slot = r
                .request(op.req())
                .map(|s| format!("{s:?}"))
                .unwrap_or_else(|| "(forgotten)".into());
            return Err(format!(
                "{} ({}): mismatch at op {i}: {op}\n  expected: {want}\n  got:      {got_v}\n  request state after: {slot}\n  previous ops:\n{}",
                path.display(),
                g.name,
                context(i)
            ));
        }
    }
    Ok(())
}

#[test]
fn goldens_match_vllm() {
    let files = golden_files();
    let mut total_ops = 0;
    let mut failures = Vec::new();
    for f in &files {
        let g = load(f);
        total_ops += g.ops.len();
        if let Err(e) = check(f, &g) {
            failures.push(e);
        }
    }
    eprintln!(
        "kv goldens: {} files, {} ops, {} mismatching",
        files.len(),
        total_ops,
        failures.len()
    );
    assert!(
        files.len() >= MIN_LAYOUTS,
        "only {} golden layouts in {} (need >= {MIN_LAYOUTS}); regenerate with recipes/kv_golden.py",
        files.len(),
        golden_dir().display()
    );
    assert!(
        total_ops >= MIN_OPS,
        "only {total_ops} golden ops (need >= {MIN_OPS})"
    );
    assert!(
        failures.is_empty(),
        "{} of {} goldens disagree with vLLM:\n\n{}",
        failures.len(),
        files.len(),
        failures.join("\n\n")
    );
}

/// The comparison itself must be able to fail: corrupting one expected `free`
/// count (or one block id) of a real golden is detected at that op.
#[test]
fn golden_check_detects_a_corrupted_result() {
    let files = golden_files();
    let f = files.first().expect("no goldens");
    let mut g = load(f);
    let k = g.results.len() / 2;
    let bumped = g.results[k]["free"].as_u64().expect("free") + 1;
    g.results[k]["free"] = Value::from(bumped);
    let e = check(f, &g).expect_err("a corrupted golden passed");
    assert!(e.contains(&format!("mismatch at op {k}")), "{e}");

    let mut g = load(f);
    let (k, _) = g
        .results
        .iter()
        .enumerate()
        .find(|(_, r)| {
            r["blocks"].as_array().is_some_and(|b| {
                b.iter()
                    .any(|gr| gr.as_array().is_some_and(|x| !x.is_empty()))
            })
        })
        .expect("a golden with no allocation");
    g.results[k]["blocks"] = Value::Null;
    let e = check(f, &g).expect_err("a corrupted golden passed");
    assert!(e.contains(&format!("mismatch at op {k}")), "{e}");
}
