//! End-to-end tests of `speclab run`, `bounds` and `findings` through the binary.
//!
//! What they pin: the card's wedge numbers come out of the CLI's JSON, a run
//! interrupted after some legs resumes without recomputing (or altering) the
//! finished legs, findings render from records, and bad manifests give an
//! error naming the file, the place and the field, with a non-zero exit and
//! no panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_speclab"))
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/manifests")
        .join(name)
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("speclab-cli-run-{tag}-{}", std::process::id()));
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

#[test]
fn run_reproduces_the_card_numbers() {
    let d = tmpdir("numbers");
    let rec = d.join("r.json");
    let out = bin()
        .args(["run", "--json", "--out"])
        .arg(&rec)
        .arg(fixture("small.ron"))
        .output()
        .unwrap();
    let v = json(&out);
    let l = legs(&v);
    assert_eq!(l.len(), 6);
    assert_eq!(l[0]["id"], "bs=2304 cap=none prompt=15523");
    assert_eq!(l[0]["status"], "COMPLETED");
    assert_eq!(l[0]["admissions"][0]["total"], 1011);
    assert_eq!(l[1]["status"], "WEDGED");
    assert_eq!(l[1]["admissions"][0]["total"], 1013);
    assert_eq!(l[1]["admissions"][0]["binding_group"], "drafter_swa");
    assert_eq!(l[1]["bound"]["largest_admissible"], 15536);
    // The fix serves all three and the drafter group never holds more than 130 blocks.
    for leg in &l[3..] {
        assert_eq!(leg["status"], "COMPLETED", "{}", leg["id"]);
        assert!(leg["peak_held_per_group"][6].as_u64().unwrap() <= 130);
    }
    // The record on disk equals what was printed.
    let on_disk: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&rec).unwrap()).unwrap();
    assert_eq!(on_disk, v);
    assert_eq!(on_disk["complete"], true);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn interrupted_run_resumes_and_keeps_finished_legs() {
    let d = tmpdir("resume");
    let rec = d.join("r.json");
    let full = json(
        &bin()
            .args(["run", "--json", "--out"])
            .arg(&rec)
            .arg(fixture("small.ron"))
            .output()
            .unwrap(),
    );
    // Simulate a crash after two legs: keep them, mark them with a sentinel wall time.
    let mut partial = full.clone();
    let mut kept = legs(&full)[..2].to_vec();
    for k in &mut kept {
        k["wall_ms"] = serde_json::json!(-1.0);
    }
    partial["legs"] = serde_json::Value::Array(kept);
    partial["complete"] = serde_json::json!(false);
    std::fs::write(&rec, serde_json::to_vec(&partial).unwrap()).unwrap();
    let resumed = json(
        &bin()
            .args(["run", "--json", "--out"])
            .arg(&rec)
            .arg(fixture("small.ron"))
            .output()
            .unwrap(),
    );
    let l = legs(&resumed);
    assert_eq!(l.len(), 6);
    assert_eq!(resumed["complete"], true);
    // The two finished legs were not recomputed.
    assert_eq!(l[0]["wall_ms"], -1.0);
    assert_eq!(l[1]["wall_ms"], -1.0);
    // The others were, with the same results as the uninterrupted run.
    for (a, b) in l[2..].iter().zip(&legs(&full)[2..]) {
        assert_eq!(a["id"], b["id"]);
        assert_eq!(a["status"], b["status"]);
        assert_eq!(a["steps"], b["steps"]);
        assert!(a["wall_ms"].as_f64().unwrap() >= 0.0);
    }
    // --fresh recomputes everything.
    let fresh = json(
        &bin()
            .args(["run", "--json", "--fresh", "--out"])
            .arg(&rec)
            .arg(fixture("small.ron"))
            .output()
            .unwrap(),
    );
    assert!(legs(&fresh)
        .iter()
        .all(|x| x["wall_ms"].as_f64().unwrap() >= 0.0));
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_record_from_another_manifest_is_not_resumed() {
    let d = tmpdir("othermanifest");
    let rec = d.join("r.json");
    json(
        &bin()
            .args(["run", "--json", "--out"])
            .arg(&rec)
            .arg(fixture("small.ron"))
            .output()
            .unwrap(),
    );
    let other = d.join("other.ron");
    std::fs::write(
        &other,
        std::fs::read_to_string(fixture("small.ron"))
            .unwrap()
            .replace("output_len: 32", "output_len: 33"),
    )
    .unwrap();
    let out = bin()
        .args(["run", "--out"])
        .arg(&rec)
        .arg(&other)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("different manifest"));
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn bounds_json_gives_the_exact_bound() {
    let v = json(
        &bin()
            .args(["bounds", "--json"])
            .arg(fixture("small.ron"))
            .output()
            .unwrap(),
    );
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["cap"], "none");
    assert_eq!(rows[0]["bound"]["largest_admissible"], 15536);
    assert_eq!(rows[0]["bound"]["binding_group_above"], "drafter_swa");
    assert_eq!(rows[1]["cap"], "window_plus_two");
    assert_eq!(rows[1]["bound"]["unbounded"], true);
}

#[test]
fn findings_render_from_a_record() {
    let d = tmpdir("findings");
    let rec = d.join("r.json");
    json(
        &bin()
            .args(["run", "--json", "--out"])
            .arg(&rec)
            .arg(fixture("small.ron"))
            .output()
            .unwrap(),
    );
    let out = bin()
        .args(["findings", "--out-dir"])
        .arg(&d)
        .arg(&rec)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let md = std::fs::read_to_string(d.join("small.md")).unwrap();
    assert!(
        md.contains("| `bs=2304 cap=none prompt=15556` | 1,011 | 1,013 |"),
        "{md}"
    );
    assert!(md.contains("WEDGED"));
    assert!(md.contains("## Leg chain"));
    std::fs::remove_dir_all(&d).ok();
}

fn bad(name: &str) -> String {
    let out = bin()
        .arg("run")
        .arg("--out")
        .arg(std::env::temp_dir().join("speclab-never-written.json"))
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
fn bad_manifests_are_clear_errors() {
    let e = bad("unknown_field.ron");
    assert!(e.contains("unknown_field.ron:4:"), "line:col: {e}");
    assert!(e.contains("max_num_seq"), "field: {e}");
    let e = bad("prompt_too_long.ron");
    assert!(
        e.contains("workload.prompts[1]") && e.contains("5000"),
        "{e}"
    );
    let e = bad("zero_block_size.ron");
    assert!(e.contains("block_size"), "{e}");
    let e = bad("unknown_preset.ron");
    assert!(e.contains("llama-7b"), "{e}");
    let out = bin().args(["run", "does/not/exist.ron"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does/not/exist.ron"));
}
