//! `speclab kv replay` end to end: the built binary on the fixtures in
//! `tests/fixtures/kv/`.
//!
//! Invariants asserted: every bad input (malformed layout, invalid layout
//! value, bad op line, op the manager refuses) exits non-zero, never panics,
//! and names the file and the place (`path:line:col`, the field path, or
//! `path:line N` plus the request); a good replay prints exactly the expected
//! records (`ops.expected.jsonl`: identical to what vLLM 0.33.0 answers,
//! `recipes/kv_golden.py --layout tests/fixtures/kv/layout.json --ops
//! tests/fixtures/kv/ops.jsonl`) and nothing but JSON on stdout, and the RON and
//! JSON spellings of one layout replay identically.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kv")
        .join(name)
}

fn replay(layout: &str, ops: &str, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_speclab"))
        .args(["kv", "replay"])
        .arg(fixture(layout))
        .arg(fixture(ops))
        .args(extra)
        .output()
        .expect("run speclab")
}

/// Run a bad input; require failure without panic and every `needle` in stderr.
fn fails_with(layout: &str, ops: &str, needles: &[&str]) -> String {
    let out = replay(layout, ops, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "{layout} {ops}: exit 0; stderr: {stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "{layout} {ops}: panicked: {stderr}"
    );
    for n in needles {
        assert!(
            stderr.contains(n),
            "{layout} {ops}: stderr lacks {n:?}:\n{stderr}"
        );
    }
    // Whatever was printed before the error is still well-formed JSON lines.
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "non-JSON stdout line {line:?}"
        );
    }
    stderr
}

#[test]
fn malformed_ron_layout_names_line_col_and_field() {
    fails_with(
        "bad_syntax.ron",
        "ops.jsonl",
        &[
            "bad_syntax.ron:6:57:",
            "groups[1].block_size",
            "Expected integer",
        ],
    );
}

#[test]
fn ron_syntax_error_names_line_col() {
    fails_with(
        "missing_comma.ron",
        "ops.jsonl",
        &["missing_comma.ron:4:5:", "Expected comma"],
    );
}

#[test]
fn zero_block_size_names_the_field() {
    fails_with(
        "zero_block_size.ron",
        "ops.jsonl",
        &[
            "zero_block_size.ron:",
            "groups[1] (swa).block_size",
            "must be > 0",
        ],
    );
}

#[test]
fn unknown_group_kind_names_line_col_and_field() {
    fails_with(
        "unknown_kind.json",
        "ops.jsonl",
        &[
            "unknown_kind.json:6:",
            "groups[1].kind",
            "linear_attention",
            "expected one of",
        ],
    );
}

#[test]
fn prompt_over_max_model_len_names_line_and_request() {
    fails_with(
        "layout.ron",
        "prompt_too_long.jsonl",
        &[
            "prompt_too_long.jsonl:line 2:",
            "\"long\"",
            "does not fit max_model_len 256",
        ],
    );
}

#[test]
fn unknown_request_names_line_and_id() {
    // Line 3 is blank: the error must name the file line (4), not the op index (2).
    fails_with(
        "layout.ron",
        "unknown_request.jsonl",
        &["unknown_request.jsonl:line 4:", "unknown request \"ghost\""],
    );
}

#[test]
fn zero_token_allocate_names_line() {
    fails_with(
        "layout.ron",
        "zero_tokens.jsonl",
        &["zero_tokens.jsonl:line 2:", "num_new_tokens = 0"],
    );
}

#[test]
fn malformed_op_line_names_line() {
    fails_with(
        "layout.ron",
        "malformed_op.jsonl",
        &[
            "malformed_op.jsonl:line 2:",
            "expected one JSON object per line",
        ],
    );
}

#[test]
fn missing_file_names_it() {
    fails_with("layout.ron", "no_such_ops.jsonl", &["no_such_ops.jsonl"]);
}

#[test]
fn good_replay_matches_expected_output() {
    let out = replay("layout.ron", "ops.jsonl", &["--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stderr: {stderr}");
    let want = std::fs::read_to_string(fixture("ops.expected.jsonl")).expect("expected file");
    let got = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        got.lines().collect::<Vec<_>>(),
        want.lines().collect::<Vec<_>>()
    );
    assert_eq!(got.lines().count(), 14);
}

#[test]
fn ron_and_json_layouts_agree() {
    let ron = replay("layout.ron", "ops.jsonl", &[]);
    let json = replay("layout.json", "ops.jsonl", &[]);
    assert!(ron.status.success() && json.status.success());
    assert_eq!(ron.stdout, json.stdout);
}

#[test]
fn summary_is_a_final_json_line() {
    let out = replay("layout.ron", "ops.jsonl", &["--summary"]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().expect("output");
    let v: serde_json::Value = serde_json::from_str(last).expect("JSON summary");
    let s = &v["summary"];
    assert_eq!(s["ops"], 14);
    assert_eq!(s["allocations"], 4);
    assert_eq!(s["failures"], 0);
    assert_eq!(s["final_free"], 63);
    assert_eq!(s["usable_blocks"], 63);
    assert!(String::from_utf8_lossy(&out.stderr).contains("replayed 14 ops"));
}

#[test]
fn startup_check_is_opt_in() {
    // layout.ron: one max_model_len request needs full 16 + ring 1 + state 2 +
    // swa 13 = 32 of 63 usable blocks: passes. tiny_pool.json: 16 of 11: the
    // trace replays (it never holds more than 10), but the check refuses it.
    let out = replay("layout.ron", "ops.jsonl", &["--check-startup"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = replay("tiny_pool.json", "ops.jsonl", &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = replay("tiny_pool.json", "ops.jsonl", &["--check-startup"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !stderr.contains("panicked"));
    assert!(
        stderr.contains("tiny_pool.json") && stderr.contains("max_model_len"),
        "{stderr}"
    );
}
