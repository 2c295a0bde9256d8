//! End-to-end tests of real-engine manifests through the binary: `speclab run`,
//! `findings` and `verify-lossless <manifest>`.
//!
//! What they pin: a `real` manifest over the micro fixture target (random weights) expands
//! into drafter x N x concurrency x temperature legs with stable ids, runs through the real
//! engine and records vLLM's acceptance counters consistently (tau >= 1, rates in [0, 1],
//! accepted <= drafted, per-position counts summing to the accepted tokens), greedy legs
//! with a drafter reproduce the spec-off leg's outputs; an interrupted run resumes without
//! recomputing finished legs; findings render the real-engine table and the SVG plot of
//! tau / acceptance vs N; the manifest form of verify-lossless passes (MTP, n-gram, DFlash2
//! and v1 on the micro fixtures); bad real manifests fail with the file and the field named.
//! Manifest paths are relative to the current directory, so every command runs from the
//! repository root.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_speclab"));
    c.current_dir(ROOT);
    c
}

fn fixture(name: &str) -> PathBuf {
    Path::new(ROOT).join("tests/fixtures/manifests").join(name)
}

/// The fixture as a path relative to the repository root (as a user would type it).
fn rel(name: &str) -> String {
    format!("tests/fixtures/manifests/{name}")
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("speclab-cli-real-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is JSON")
}

fn legs(v: &serde_json::Value) -> Vec<serde_json::Value> {
    v["legs"].as_array().unwrap().clone()
}

/// One full run of real_micro.ron shared by the tests (record path, printed record).
fn full_run() -> &'static (PathBuf, serde_json::Value) {
    static RUN: OnceLock<(PathBuf, serde_json::Value)> = OnceLock::new();
    RUN.get_or_init(|| {
        let d = tmpdir("full");
        let rec = d.join("real_micro.json");
        let v = json(
            &bin()
                .args(["run", "--json", "--fresh", "--out"])
                .arg(&rec)
                .arg(rel("real_micro.ron"))
                .output()
                .unwrap(),
        );
        (rec, v)
    })
}

fn f(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn u(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not an integer: {v}"))
}

#[test]
fn real_manifest_runs_and_records_acceptance() {
    let (rec, v) = full_run();
    let l = legs(v);
    // none: 2 c x 2 T; mtp and ngram: 2 N x 2 c x 2 T each.
    assert_eq!(l.len(), 4 + 8 + 8);
    assert_eq!(l[0]["id"], "drafter=none n=0 c=1 t=0.0");
    assert_eq!(l[4]["id"], "drafter=mtp n=1 c=1 t=0.0");
    assert_eq!(l[19]["id"], "drafter=ngram n=2 c=2 t=1.0");
    assert_eq!(v["complete"], true);
    let mut saw_drafts = false;
    for leg in &l {
        let id = leg["id"].as_str().unwrap();
        let r = &leg["real"];
        assert_eq!(leg["status"], "COMPLETED", "{id}");
        assert_eq!(r["complete"], true, "{id}");
        assert_eq!(u(&r["num_requests"]), 2, "{id}");
        assert_eq!(
            u(&r["output_tokens"]),
            16,
            "{id}: 2 prompts x 8 tokens (ignore_eos)"
        );
        assert_eq!(r["finish"]["length"], 2, "{id}");
        let n = u(&r["num_speculative_tokens"]);
        assert!(id.contains(&format!(" n={n} ")), "{id}");
        let c = u(&r["concurrency"]);
        assert!(
            u(&r["max_verify_width"]) <= c * (n + 1),
            "{id}: verify width bounded by c (1 + N)"
        );
        let (drafts, drafted, accepted) = (
            u(&r["num_drafts"]),
            u(&r["num_draft_tokens"]),
            u(&r["num_accepted_tokens"]),
        );
        assert!(accepted <= drafted, "{id}");
        assert!(drafted <= drafts * n.max(1), "{id}");
        let per: Vec<u64> = r["accepted_per_position"]
            .as_array()
            .unwrap()
            .iter()
            .map(u)
            .collect();
        assert_eq!(per.iter().sum::<u64>(), accepted, "{id}");
        for w in per.windows(2) {
            assert!(w[0] >= w[1], "{id}: per-position counts are non-increasing");
        }
        for x in r["acceptance_per_position"].as_array().unwrap() {
            assert!((0.0..=1.0).contains(&f(x)), "{id}");
        }
        if drafts > 0 {
            saw_drafts = true;
            let tau = f(&r["tau"]);
            let rate = f(&r["draft_acceptance_rate"]);
            assert!(tau >= 1.0 && tau <= 1.0 + n as f64, "{id}: tau {tau}");
            assert!((0.0..=1.0).contains(&rate), "{id}: rate {rate}");
            assert!(
                (tau - (1.0 + accepted as f64 / drafts as f64)).abs() < 1e-9,
                "{id}"
            );
            assert_eq!(
                r["acceptance_per_position"].as_array().unwrap().len() as u64,
                n,
                "{id}"
            );
        } else {
            assert!(
                r["tau"].is_null() && r["draft_acceptance_rate"].is_null(),
                "{id}"
            );
        }
        assert!(f(&r["tokens_per_s"]) > 0.0, "{id}");
        assert!(f(&r["mean_ttft_steps"]) >= 1.0, "{id}");
        // collect_router is on: every decode step routed to some experts, at most all slots.
        let experts = f(&r["mean_verify_experts"]);
        assert!(experts > 0.0 && experts <= f(&r["expert_slots"]), "{id}");
        assert_eq!(r["output_digests"].as_array().unwrap().len(), 2, "{id}");
    }
    assert!(saw_drafts, "MTP always drafts");
    // Greedy with a drafter reproduces the spec-off leg, token for token (digests).
    for leg in &l {
        let r = &leg["real"];
        if r["temperature"] == 0.0 {
            let control = l
                .iter()
                .find(|x| {
                    x["real"]["drafter"] == "none"
                        && x["real"]["temperature"] == 0.0
                        && x["real"]["concurrency"] == r["concurrency"]
                })
                .unwrap();
            assert_eq!(
                r["output_digests"], control["real"]["output_digests"],
                "{}",
                leg["id"]
            );
        }
    }
    // The record on disk equals what was printed; simulated fields stay out of the manifest.
    let on_disk: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(rec).unwrap()).unwrap();
    assert_eq!(&on_disk, v);
    assert_eq!(on_disk["manifest"]["real"]["model"], "tests/fixtures/model");
}

#[test]
fn interrupted_real_run_resumes_and_keeps_finished_legs() {
    let (_, full) = full_run();
    let d = tmpdir("resume");
    let rec = d.join("r.json");
    // Simulate a crash after three legs: keep them, with a sentinel wall time.
    let mut partial = full.clone();
    let mut kept = legs(full)[..3].to_vec();
    for k in &mut kept {
        k["wall_ms"] = serde_json::json!(-1.0);
    }
    partial["legs"] = serde_json::Value::Array(kept);
    partial["complete"] = serde_json::json!(false);
    std::fs::write(&rec, serde_json::to_vec(&partial).unwrap()).unwrap();
    let dry = json(
        &bin()
            .args(["run", "--dry-run", "--json", "--out"])
            .arg(&rec)
            .arg(rel("real_micro.ron"))
            .output()
            .unwrap(),
    );
    assert_eq!(dry["legs"].as_array().unwrap().len(), 20);
    assert_eq!(dry["recorded"].as_array().unwrap().len(), 3);
    let resumed = json(
        &bin()
            .args(["run", "--json", "--out"])
            .arg(&rec)
            .arg(rel("real_micro.ron"))
            .output()
            .unwrap(),
    );
    let l = legs(&resumed);
    assert_eq!(l.len(), 20);
    assert_eq!(resumed["complete"], true);
    for leg in &l[..3] {
        assert_eq!(leg["wall_ms"], -1.0, "{} was recomputed", leg["id"]);
    }
    // The rest were recomputed with the same outputs (greedy and seeded sampling alike)
    // and the same acceptance counters.
    for (a, b) in l[3..].iter().zip(&legs(full)[3..]) {
        assert_eq!(a["id"], b["id"]);
        assert!(f(&a["wall_ms"]) >= 0.0);
        for k in [
            "output_digests",
            "num_drafts",
            "num_draft_tokens",
            "num_accepted_tokens",
            "accepted_per_position",
            "steps",
        ] {
            assert_eq!(a["real"][k], b["real"][k], "{} {k}", a["id"]);
        }
    }
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn findings_render_the_real_table_and_the_plot() {
    let (rec, v) = full_run();
    let d = tmpdir("findings");
    let out = bin()
        .args(["findings", "--json", "--out-dir"])
        .arg(&d)
        .arg(rec)
        .output()
        .unwrap();
    let written = json(&out);
    assert_eq!(
        written.as_array().unwrap().len(),
        2,
        "markdown + svg: {written}"
    );
    let md = std::fs::read_to_string(d.join("real_micro.md")).unwrap();
    assert!(md.contains("## Speculative decoding (real engine)"), "{md}");
    assert!(md.contains("| leg | drafter | N | c | T | status | acceptance rate | tau | per-position rates | tokens/s |"), "{md}");
    // Every real leg has a row, with the record's tau.
    for leg in legs(v) {
        let id = leg["id"].as_str().unwrap();
        let row = md
            .lines()
            .find(|l| l.starts_with(&format!("| `{id}` |")))
            .unwrap_or_else(|| panic!("no row for {id}"));
        if let Some(t) = leg["real"]["tau"].as_f64() {
            assert!(row.contains(&format!("| {t:.3} |")), "{row}");
        }
        if leg["real"]["temperature"] == 0.0 && leg["real"]["drafter"] != "none" {
            assert!(row.ends_with("| 2/2 |"), "greedy = spec-off: {row}");
        }
    }
    assert!(
        md.contains("](real_micro-tau.svg)"),
        "the plot is linked: {md}"
    );
    assert!(
        !md.contains("## Legs\n"),
        "no simulated leg table for a real record"
    );
    let svg = std::fs::read_to_string(d.join("real_micro-tau.svg")).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
    // One series per drafter that drafted (x T x c here); n-gram never matched on these prompts.
    assert!(
        svg.contains("mtp T=0.0 c=1") && svg.contains("mtp T=1.0 c=2"),
        "series labels"
    );
    assert!(svg.contains("tau vs N") && svg.contains("acceptance rate vs N"));
    // Rendering is a pure function of the record.
    bin()
        .args(["findings", "--out-dir"])
        .arg(&d)
        .arg(rec)
        .output()
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(d.join("real_micro.md")).unwrap(),
        md
    );
    assert_eq!(
        std::fs::read_to_string(d.join("real_micro-tau.svg")).unwrap(),
        svg
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn verify_lossless_manifest_form_passes_on_the_micro_model() {
    let v = json(
        &bin()
            .args(["verify-lossless", "--json"])
            .arg(rel("real_lossless.ron"))
            .output()
            .unwrap(),
    );
    assert_eq!(v["lossless"], true, "{v}");
    let l = legs(&v);
    // mtp, ngram, dflash2, dflash1 at N = 3, c = 1 and 2 (none is the reference, not a leg).
    let ids: Vec<&str> = l.iter().map(|x| x["id"].as_str().unwrap()).collect();
    assert_eq!(
        ids,
        [
            "drafter=mtp n=3 c=1",
            "drafter=mtp n=3 c=2",
            "drafter=ngram n=3 c=1",
            "drafter=ngram n=3 c=2",
            "drafter=dflash2 n=3 c=1",
            "drafter=dflash2 n=3 c=2",
            "drafter=dflash1 n=3 c=1",
            "drafter=dflash1 n=3 c=2"
        ]
    );
    for x in &l {
        assert_eq!(x["requests_equal"], 2, "{x}");
        assert_eq!(x["num_tokens_compared"], 16, "{x}");
        assert!(x["mismatches"].as_array().unwrap().is_empty());
    }
    // Text form: one line per leg and PASS, exit 0.
    let out = bin()
        .arg("verify-lossless")
        .arg(rel("real_lossless.ron"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("drafter=dflash2 n=3 c=2: 2/2 requests equal"),
        "{text}"
    );
    assert!(text.contains("16/16 request checks equal: PASS"), "{text}");
    // The manifest form refuses flags of the flag form, and a simulated manifest.
    let out = bin()
        .args(["verify-lossless", "--model", "tests/fixtures/model"])
        .arg(rel("real_lossless.ron"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let out = bin()
        .arg("verify-lossless")
        .arg(rel("small.ron"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no `real` section"));
}

fn bad(name: &str) -> String {
    let out = bin()
        .arg("run")
        .arg("--out")
        .arg(std::env::temp_dir().join("speclab-real-never-written.json"))
        .arg(fixture(name))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{name} should fail");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains(name), "error names the file: {err}");
    err
}

#[test]
fn bad_real_manifests_are_clear_errors() {
    let e = bad("real_missing_model.ron");
    assert!(
        e.contains("real.model")
            && e.contains("no-such-model")
            && e.contains("relative to the current directory"),
        "{e}"
    );
    let e = bad("real_unknown_drafter.ron");
    assert!(
        e.contains("real_unknown_drafter.ron:7:")
            && e.contains("real.drafters[1]")
            && e.contains("eagle"),
        "{e}"
    );
    let e = bad("real_zero_n.ron");
    assert!(
        e.contains("real.num_speculative_tokens") && e.contains("N = 0"),
        "{e}"
    );
    let e = bad("real_zero_concurrency.ron");
    assert!(
        e.contains("real.concurrency[1]") && e.contains("concurrency 0"),
        "{e}"
    );
    let e = bad("real_bad_temperature.ron");
    assert!(
        e.contains("real.temperatures[1]") && e.contains("2.5") && e.contains("[0, 2]"),
        "{e}"
    );
    let e = bad("real_missing_prompt_file.ron");
    assert!(
        e.contains("real.prompts.file") && e.contains("no-such-prompts.safetensors"),
        "{e}"
    );
    let e = bad("real_missing_tensor.ron");
    assert!(
        e.contains("real.prompts.tensor") && e.contains("prompt_tokens"),
        "{e}"
    );
    let e = bad("real_dflash_n_too_big.ron");
    assert!(
        e.contains("real.num_speculative_tokens")
            && e.contains("N = 8")
            && e.contains("block_size 8"),
        "{e}"
    );
    let e = bad("real_missing_drafter_dir.ron");
    assert!(
        e.contains("real.drafter_dirs.dflash2")
            && e.contains("no-such-drafter")
            && e.contains("skip_missing_drafters"),
        "{e}"
    );
    let e = bad("real_num_blocks_and_bytes.ron");
    assert!(
        e.contains("real.kv_cache_memory_bytes")
            && e.contains("real.num_blocks (64)")
            && e.contains("give one of them"),
        "{e}"
    );
    let e = bad("real_bytes_too_small.ron");
    assert!(
        e.contains("real.kv_cache_memory_bytes") && e.contains("0 blocks"),
        "{e}"
    );
    let e = bad("real_with_sim_sections.ron");
    assert!(e.contains(": kv:") && e.contains("real engine"), "{e}");
    // bounds has nothing to bisect in a real manifest.
    let out = bin()
        .arg("bounds")
        .arg(rel("real_micro.ron"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no simulated KV layout"));
}

#[test]
fn missing_drafters_can_be_skipped_and_noted() {
    let d = tmpdir("skip");
    let m = d.join("skip.ron");
    let text = std::fs::read_to_string(fixture("real_missing_drafter_dir.ron")).unwrap().replace("drafters: [none, dflash2],", "drafters: [none, dflash2],\n        skip_missing_drafters: true,\n        max_tokens: 4,");
    std::fs::write(&m, text).unwrap();
    let rec = d.join("r.json");
    let v = json(
        &bin()
            .args(["run", "--json", "--out"])
            .arg(&rec)
            .arg(&m)
            .output()
            .unwrap(),
    );
    let ids: Vec<&str> = v["legs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["drafter=none n=0 c=1 t=0.0"]);
    assert!(
        v["notes"][0].as_str().unwrap().contains("dflash2 skipped"),
        "{}",
        v["notes"]
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn shipped_real_manifests_validate() {
    for (m, min_legs) in [
        ("experiments/acceptance-tiny.ron", 16),
        ("experiments/quality-spot.ron", 2),
    ] {
        let v = json(
            &bin()
                .args(["run", "--dry-run", "--json", m])
                .output()
                .unwrap(),
        );
        let ids: Vec<&str> = v["legs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().unwrap())
            .collect();
        assert!(ids.len() >= min_legs, "{m}: {ids:?}");
        assert_eq!(v["real"], true);
        if Path::new(ROOT).join("models/dflash2-tiny").is_dir() {
            assert!(
                ids.iter().any(|i| i.starts_with("drafter=dflash2 n=7")),
                "{m}: {ids:?}"
            );
        } else {
            assert!(
                v["notes"][0].as_str().unwrap().contains("dflash2 skipped"),
                "{m}"
            );
        }
    }
}

/// The committed record of experiments/df2w-real-six.ron (six requests, prompts up to
/// 4,000 tokens, the pool planned from bytes on models/tiny) is recomputed with the same
/// results: the `none` cap WEDGED, `window_plus_two` COMPLETED with the spec-off outputs,
/// and the planned pool (448,512 B a block, 401 blocks) in every leg. About 30 s.
#[test]
fn the_six_request_wedge_record_reproduces() {
    let d = tmpdir("six");
    let rec = d.join("df2w-real-six.json");
    std::fs::copy(Path::new(ROOT).join("runs/df2w-real-six.json"), &rec).unwrap();
    let before = std::fs::read(&rec).unwrap();
    let out = bin()
        .args(["run", "experiments/df2w-real-six.ron", "--out"])
        .arg(&rec)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("REPRODUCED"), "{stdout}");
    assert_eq!(stdout.matches(": matched").count(), 5, "{stdout}");
    assert_eq!(std::fs::read(&rec).unwrap(), before, "the record changed");
    let v: serde_json::Value = serde_json::from_slice(&before).unwrap();
    let status: Vec<String> = legs(&v)
        .iter()
        .map(|l| l["status"].as_str().unwrap_or("?").to_string())
        .collect();
    assert_eq!(status, ["COMPLETED", "WEDGED", "COMPLETED"]);
    for l in legs(&v) {
        let p = &l["real"]["kv_plan"];
        assert_eq!(p["bytes_per_block"], 448_512, "{}", l["id"]);
        assert_eq!(p["num_blocks"], 401, "{}", l["id"]);
        assert_eq!(l["num_blocks"], 401);
    }
}
