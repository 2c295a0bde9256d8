//! Issue 9 through the binary: one test (at least) per reliability class.
//!
//! Sizes fail fast with the numbers; fields without effect are refused by name;
//! overflowing counts are refused; a closed stdout ends a command quietly; checkpoints
//! and records are not lost (no overwrite without `--force`, locked records, no temp
//! file left, a failed run keeps the complete record); nonsense is refused (NaN
//! checkpoints, corrupt records in `--dry-run`, an unwritable `--out` before any leg);
//! errors name the file and the field; the main command reproduces a complete record
//! without touching it; frictions (plain finish words, one cap vocabulary).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_speclab"))
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("speclab-rel-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The command fails (non-zero, no panic) and its stderr contains every `needle`.
fn fails_with(o: &Output, needles: &[&str]) -> String {
    let e = stderr(o);
    assert!(!o.status.success(), "should fail; stderr: {e}");
    assert!(!e.contains("panicked"), "{e}");
    for n in needles {
        assert!(e.contains(n), "missing {n:?} in: {e}");
    }
    e
}

fn small_manifest() -> PathBuf {
    root().join("tests/fixtures/manifests/small.ron")
}

fn write(p: &Path, text: &str) {
    std::fs::write(p, text).unwrap();
}

// ---------------------------------------------------------------------------
// 1. Sizes
// ---------------------------------------------------------------------------

#[test]
fn a_pool_near_2_pow_32_blocks_fails_fast_with_the_numbers() {
    let d = tmpdir("bigpool");
    let layout = d.join("l.json");
    write(
        &layout,
        r#"{"num_blocks": 4294967295, "max_model_len": 64, "groups": [{"name": "f", "kind": "full", "block_size": 4}]}"#,
    );
    let ops = d.join("o.jsonl");
    write(&ops, "{\"op\":\"add\",\"req\":\"a\",\"prompt_len\":4}\n");
    let t0 = Instant::now();
    let o = bin()
        .args(["kv", "replay"])
        .arg(&layout)
        .arg(&ops)
        .output()
        .unwrap();
    fails_with(&o, &["l.json", "num_blocks", "4294967295", "16777216"]);
    assert!(t0.elapsed() < Duration::from_secs(10));
    // The same pool in a manifest.
    let m = d.join("m.ron");
    write(
        &m,
        &std::fs::read_to_string(small_manifest())
            .unwrap()
            .replace("num_blocks: Some(1012)", "num_blocks: Some(4294967295)"),
    );
    let o = bin().args(["run", "--dry-run"]).arg(&m).output().unwrap();
    fails_with(&o, &["m.ron", "num_blocks", "4294967295"]);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_workload_count_near_2_pow_32_fails_fast() {
    let d = tmpdir("bigcount");
    let m = d.join("m.ron");
    write(
        &m,
        &std::fs::read_to_string(small_manifest()).unwrap().replace(
            "workload: (prompts: [15523, 15556, 25344], output_len: 32)",
            "workload: (generate: Some((count: 4294967295, min: 1, max: 100)), output_len: 32)",
        ),
    );
    let t0 = Instant::now();
    let o = bin().args(["run", "--dry-run"]).arg(&m).output().unwrap();
    fails_with(
        &o,
        &["m.ron", "workload.generate.count", "4294967295", "100000"],
    );
    assert!(t0.elapsed() < Duration::from_secs(10));
    std::fs::remove_dir_all(&d).ok();
}

// ---------------------------------------------------------------------------
// 2. Fields read nowhere
// ---------------------------------------------------------------------------

#[test]
fn drafter_sliding_window_changes_the_preset_legs() {
    let d = tmpdir("window");
    let run = |w: u32| -> serde_json::Value {
        let m = d.join(format!("w{w}.ron"));
        write(
            &m,
            &std::fs::read_to_string(small_manifest()).unwrap().replace(
                "block_size: Some(8))",
                &format!("block_size: Some(8), sliding_window: Some({w}))"),
            ),
        );
        let o = bin().args(["bounds", "--json"]).arg(&m).output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    // Row 1 is cap window_plus_two: the drafter group holds cdiv(window, 16) + 2 blocks.
    let a = run(2048);
    let b = run(256);
    assert_eq!(a[1]["cap"], "window_plus_two");
    assert_eq!(a[1]["bound"]["need_at_bound"][6], 130);
    assert_eq!(
        b[1]["bound"]["need_at_bound"][6], 18,
        "the window must take effect"
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn fields_without_effect_are_refused_naming_the_field() {
    let d = tmpdir("noeffect");
    let base = std::fs::read_to_string(small_manifest()).unwrap();
    for (from, to, field) in [
        (
            "drafter: (kind: dflash2, num_speculative_tokens: 7, block_size: Some(8))",
            "drafter: (kind: mtp, num_speculative_tokens: 3, sliding_window: Some(64))",
            "drafter.sliding_window",
        ),
        (
            "acceptance: [0.8, 0.6, 0.4]",
            "acceptance: [0.8, 0.6, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1]",
            "acceptance",
        ),
        (
            "num_blocks: Some(1012)",
            "num_blocks: Some(1012), kv_cache_memory_bytes: Some(99)",
            "kv.kv_cache_memory_bytes",
        ),
        (
            "measure: (simulate: true, bound: true)",
            "measure: (simulate: false, bound: false)",
            "measure",
        ),
    ] {
        let m = d.join("m.ron");
        assert!(base.contains(from), "{from}");
        write(&m, &base.replace(from, to));
        let o = bin().args(["run", "--dry-run"]).arg(&m).output().unwrap();
        fails_with(&o, &["m.ron", &format!(": {field}: ")]);
    }
    std::fs::remove_dir_all(&d).ok();
}

// ---------------------------------------------------------------------------
// 3. Overflow
// ---------------------------------------------------------------------------

fn replay(d: &Path, ops: &str) -> Output {
    let layout = d.join("l.json");
    write(
        &layout,
        r#"{"num_blocks": 64, "max_model_len": 256, "groups": [{"name": "f", "kind": "full", "block_size": 4}]}"#,
    );
    let p = d.join("o.jsonl");
    write(&p, ops);
    bin()
        .args(["kv", "replay"])
        .arg(&layout)
        .arg(&p)
        .output()
        .unwrap()
}

#[test]
fn kv_replay_refuses_overflowing_lookahead_and_computed_beyond_slots() {
    let d = tmpdir("overflow");
    let o = replay(
        &d,
        "{\"op\":\"add\",\"req\":\"a\",\"prompt_len\":8}\n{\"op\":\"allocate\",\"req\":\"a\",\"num_new_tokens\":8,\"lookahead\":18446744073709551615}\n",
    );
    fails_with(
        &o,
        &[
            "o.jsonl:line 2",
            "lookahead 18446744073709551615",
            "overflows",
        ],
    );
    // Nothing was printed for the refused op.
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 1);
    let o = replay(
        &d,
        "{\"op\":\"add\",\"req\":\"a\",\"prompt_len\":8}\n{\"op\":\"allocate\",\"req\":\"a\",\"num_new_tokens\":8}\n{\"op\":\"computed\",\"req\":\"a\",\"n\":9}\n",
    );
    fails_with(&o, &["o.jsonl:line 3", "beyond the 8 token slots"]);
    std::fs::remove_dir_all(&d).ok();
}

// ---------------------------------------------------------------------------
// 4. Broken pipe
// ---------------------------------------------------------------------------

/// Run with stdout a pipe whose reader is already gone.
fn with_closed_stdout(cmd: &mut Command) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    child.wait_with_output().unwrap()
}

#[test]
fn a_closed_stdout_ends_commands_quietly() {
    let d = tmpdir("pipe");
    let o = with_closed_stdout(
        bin()
            .args(["run", "--out"])
            .arg(d.join("r.json"))
            .arg(small_manifest()),
    );
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    assert!(o.status.success(), "{}", stderr(&o));
    let o = with_closed_stdout(bin().args(["bounds"]).arg(small_manifest()));
    assert!(
        o.status.success() && !stderr(&o).contains("panicked"),
        "{}",
        stderr(&o)
    );
    std::fs::remove_dir_all(&d).ok();
}

// ---------------------------------------------------------------------------
// 5. Data loss
// ---------------------------------------------------------------------------

#[test]
fn checkpoints_are_not_overwritten_without_force() {
    let d = tmpdir("force");
    let ck = d.join("ck");
    let init = |extra: &[&str]| {
        bin()
            .args(["init-model", "--preset", "micro", "--out"])
            .arg(&ck)
            .args(extra)
            .output()
            .unwrap()
    };
    assert!(init(&[]).status.success());
    let before = std::fs::read(ck.join("model.safetensors")).unwrap();
    fails_with(&init(&["--seed", "9"]), &["ck", "--force"]);
    assert_eq!(std::fs::read(ck.join("model.safetensors")).unwrap(), before);
    assert!(init(&["--seed", "9", "--force"]).status.success());
    // quantize SRC --out SRC is refused, even with --force.
    let o = bin()
        .args(["quantize", "--method", "rtn", "--force", "--out"])
        .arg(&ck)
        .arg(&ck)
        .output()
        .unwrap();
    fails_with(&o, &["source checkpoint itself"]);
    // quantize over another existing checkpoint needs --force.
    let other = d.join("other");
    assert!(bin()
        .args(["init-model", "--preset", "micro", "--out"])
        .arg(&other)
        .output()
        .unwrap()
        .status
        .success());
    let o = bin()
        .args(["quantize", "--method", "rtn", "--out"])
        .arg(&other)
        .arg(&ck)
        .output()
        .unwrap();
    fails_with(&o, &["other", "already holds a checkpoint"]);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_locked_record_refuses_a_second_writer() {
    let d = tmpdir("lock");
    let rec = d.join("r.json");
    let mut lock = speclab_experiments::record::RecordLock::open(&rec).unwrap();
    let _held = lock.try_lock().unwrap();
    let o = bin()
        .args(["run", "--out"])
        .arg(&rec)
        .arg(small_manifest())
        .output()
        .unwrap();
    fails_with(
        &o,
        &[".r.json.lock", "another speclab run is writing this record"],
    );
    assert!(!rec.exists());
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_failed_atomic_write_leaves_no_temp_file_and_the_old_file_whole() {
    let d = tmpdir("atomic");
    // A non-empty directory in the way makes the final rename fail.
    let target = d.join("rec.json");
    std::fs::create_dir_all(target.join("inside")).unwrap();
    let e = speclab_experiments::record::write_atomic(&target, b"{}").unwrap_err();
    assert!(e.to_string().contains("rec.json"), "{e}");
    let left: Vec<String> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["rec.json"], "temp files left: {left:?}");
    std::fs::remove_dir_all(&d).ok();
}

// ---------------------------------------------------------------------------
// 6. Silent nonsense
// ---------------------------------------------------------------------------

/// Overwrite the bytes of every bf16 tensor of a safetensors file with NaN.
fn poison_bf16(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut poisoned = 0;
    for (name, t) in header.as_object().unwrap() {
        if name == "__metadata__" || t["dtype"] != "BF16" {
            continue;
        }
        let (a, b) = (
            t["data_offsets"][0].as_u64().unwrap() as usize,
            t["data_offsets"][1].as_u64().unwrap() as usize,
        );
        for k in (8 + n + a..8 + n + b).step_by(2) {
            bytes[k] = 0xc0;
            bytes[k + 1] = 0x7f;
        }
        poisoned += 1;
    }
    assert!(poisoned > 0);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn eval_ppl_on_nan_weights_is_an_error_naming_the_checkpoint() {
    let d = tmpdir("nan");
    let ck = d.join("nanck");
    assert!(bin()
        .args(["init-model", "--preset", "micro", "--out"])
        .arg(&ck)
        .output()
        .unwrap()
        .status
        .success());
    poison_bf16(&ck.join("model.safetensors"));
    let data = d.join("data.json");
    write(&data, "[[1, 2, 3, 4, 5, 6, 7, 8]]");
    let o = bin()
        .arg("eval-ppl")
        .arg(&ck)
        .arg("--data")
        .arg(&data)
        .output()
        .unwrap();
    fails_with(&o, &["nanck", "non-finite"]);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn dry_run_refuses_a_corrupt_record_and_run_checks_out_before_any_leg() {
    let d = tmpdir("dry");
    let rec = d.join("r.json");
    write(&rec, "{\"legs\": [");
    let o = bin()
        .args(["run", "--dry-run", "--out"])
        .arg(&rec)
        .arg(small_manifest())
        .output()
        .unwrap();
    fails_with(&o, &["r.json:1:", "not a readable run record"]);
    // A real run refuses it the same way; --fresh replaces it.
    let o = bin()
        .args(["run", "--out"])
        .arg(&rec)
        .arg(small_manifest())
        .output()
        .unwrap();
    fails_with(&o, &["r.json:1:", "not a readable run record"]);
    let o = bin()
        .args(["run", "--fresh", "--out"])
        .arg(&rec)
        .arg(small_manifest())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // An --out under a regular file cannot be written: refused before the first leg.
    let blocker = d.join("file");
    write(&blocker, "x");
    let t0 = Instant::now();
    let o = bin()
        .args(["run", "--out"])
        .arg(blocker.join("r.json"))
        .arg(small_manifest())
        .output()
        .unwrap();
    fails_with(&o, &["cannot write the record here"]);
    assert!(t0.elapsed() < Duration::from_secs(20));
    std::fs::remove_dir_all(&d).ok();
}

// ---------------------------------------------------------------------------
// 7. Unclear errors
// ---------------------------------------------------------------------------

#[test]
fn errors_name_the_file_and_the_field_as_written() {
    let d = tmpdir("errors");
    let m = d.join("m.ron");
    write(
        &m,
        &std::fs::read_to_string(small_manifest())
            .unwrap()
            .replace("output_len: 32", "output_len: 0"),
    );
    let o = bin().args(["run", "--dry-run"]).arg(&m).output().unwrap();
    fails_with(&o, &["m.ron", "workload.output_len"]);
    let r = d.join("r.ron");
    write(
        &r,
        "(name: \"r\", real: (model: \"tests/fixtures/model\", prompts: (generated: (count: 1, len: 4)), drafters: [none, ngram], num_speculative_tokens: [2], ngram_min: 0))",
    );
    let o = bin().args(["run", "--dry-run"]).arg(&r).output().unwrap();
    let e = fails_with(&o, &["r.ron", "real.ngram_min"]);
    assert!(!e.contains("prompt_lookup_min"), "{e}");
    // A UTF-8 BOM is accepted.
    let b = d.join("bom.ron");
    write(
        &b,
        &format!(
            "\u{feff}{}",
            std::fs::read_to_string(small_manifest()).unwrap()
        ),
    );
    let o = bin().args(["run", "--dry-run"]).arg(&b).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // config.json errors name the file.
    let ck = d.join("ck");
    std::fs::create_dir_all(&ck).unwrap();
    write(&ck.join("config.json"), "{\"model_type\": 3}");
    let o = bin()
        .arg("eval-ppl")
        .arg(&ck)
        .arg("--data")
        .arg(d.join("none.json"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let o = bin()
        .args(["generate", "--prompt-ids", "1,2", "--model"])
        .arg(&ck)
        .output()
        .unwrap();
    fails_with(&o, &["ck/config.json:1:"]);
    std::fs::remove_dir_all(&d).ok();
}

// ---------------------------------------------------------------------------
// 8. The newcomer's path
// ---------------------------------------------------------------------------

#[test]
fn run_over_a_complete_record_recomputes_and_leaves_it_untouched() {
    let d = tmpdir("repro");
    let rec = d.join("r.json");
    let run = || {
        bin()
            .args(["run", "--out"])
            .arg(&rec)
            .arg(small_manifest())
            .output()
            .unwrap()
    };
    let first = run();
    assert!(first.status.success(), "{}", stderr(&first));
    let bytes = std::fs::read(&rec).unwrap();
    let second = run();
    let out = String::from_utf8_lossy(&second.stdout);
    assert!(out.contains("REPRODUCED"), "{out}");
    assert!(!out.contains("recorded, skipped"), "{out}");
    assert_eq!(std::fs::read(&rec).unwrap(), bytes, "the record changed");
    let timings: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("r.timings.json")).unwrap()).unwrap();
    assert_eq!(timings["legs"].as_array().unwrap().len(), 6);
    // A record whose results differ is reported and replaced.
    let mut v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    v["legs"][0]["steps"] = serde_json::json!(999_999);
    std::fs::write(&rec, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    let third = run();
    let out = String::from_utf8_lossy(&third.stdout);
    assert!(
        out.contains("DIFFERS") && out.contains("steps: 999999 ->"),
        "{out}"
    );
    let replaced: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&rec).unwrap()).unwrap();
    let original: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(replaced["legs"][0]["steps"], original["legs"][0]["steps"]);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn resuming_keeps_finished_legs_bit_for_bit() {
    let d = tmpdir("bits");
    let rec = d.join("r.json");
    let run = |extra: &[&str]| {
        let o = bin()
            .args(["run", "--json", "--out"])
            .arg(&rec)
            .args(extra)
            .arg(small_manifest())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    };
    run(&[]);
    // Keep two legs, mark the record unfinished, and give the legs floats that
    // serde_json's default (lossy) parser gives back one ULP off: 0.09224900000000001
    // parses to a different f64 without `float_roundtrip`.
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&rec).unwrap()).unwrap();
    let mut legs = v["legs"].as_array().unwrap()[..2].to_vec();
    legs[0]["wall_ms"] = serde_json::json!(0.092_249_000_000_000_01);
    legs[1]["wall_ms"] = serde_json::json!(1.071_566_039_146_582_6e-75);
    v["legs"] = serde_json::Value::Array(legs.clone());
    v["complete"] = serde_json::json!(false);
    std::fs::write(&rec, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    run(&[]);
    let after: serde_json::Value = serde_json::from_slice(&std::fs::read(&rec).unwrap()).unwrap();
    for (i, l) in legs.iter().enumerate() {
        assert_eq!(
            serde_json::to_string(&after["legs"][i]).unwrap(),
            serde_json::to_string(l).unwrap()
        );
    }
    assert_eq!(
        after["legs"][0]["wall_ms"].as_f64().map(f64::to_bits),
        Some(0.092_249_000_000_000_01f64.to_bits())
    );
    std::fs::remove_dir_all(&d).ok();
}

// ---------------------------------------------------------------------------
// 9. Frictions
// ---------------------------------------------------------------------------

#[test]
fn generate_prints_plain_words_and_caps_have_one_vocabulary() {
    let model = root().join("tests/fixtures/model");
    for cap in ["window_plus_two", "window-plus-two"] {
        let o = bin()
            .args([
                "generate",
                "--prompt-ids",
                "1,2,3",
                "--max-tokens",
                "3",
                "--ignore-eos",
                "--cap",
                cap,
                "--model",
            ])
            .arg(&model)
            .output()
            .unwrap();
        assert!(o.status.success(), "{cap}: {}", stderr(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains("finish: length"), "{out}");
        assert!(!out.contains("Some("), "{out}");
    }
    // CLI counts name the flag as written, not the drafter's internal name.
    let o = bin()
        .args([
            "generate",
            "--prompt-ids",
            "1",
            "--drafter",
            "ngram",
            "--num-spec",
            "2",
            "--ngram-min",
            "0",
            "--model",
        ])
        .arg(&model)
        .output()
        .unwrap();
    let e = fails_with(&o, &["--ngram-min", ">= 1"]);
    assert!(!e.contains("prompt_lookup_min"), "{e}");
    let help = bin().args(["run", "--help"]).output().unwrap();
    assert!(String::from_utf8_lossy(&help.stdout).contains("spot-suite"));
}

#[test]
fn verify_lossless_takes_a_text_prompt() {
    let o = bin()
        .current_dir(root())
        .args([
            "verify-lossless",
            "--model",
            "models/tiny",
            "--drafter",
            "mtp",
            "--num-spec",
            "1",
            "--max-tokens",
            "4",
            "--prompt",
            "def add(a, b):",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("1 requests") && out.contains("LOSSLESS"),
        "{out}"
    );
}
