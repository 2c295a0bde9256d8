//! `speclab bench e2e` on the CPU engine (no GPU on CI): the record it writes holds one
//! row per drafter, every leg's greedy output equals the no-drafter leg's, the MTP leg
//! verified drafts, and decode throughput was measured; bad arguments are clean errors.
//! On the GPU machine the same command runs with `--device cuda` (recipes/e2e_bench.sh).

use std::process::Command;

fn tmpdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("speclab-bench-e2e-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn speclab(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_speclab"))
        .args(args)
        .env("SPECLAB_TEST_SWITCH", "0")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run speclab")
}

/// A CPU bench e2e at 16-token prompts into `out` with `args` (concurrency, drafters,
/// tokens, ...); the record after checking that the command succeeded.
fn cpu_record(out: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["bench", "e2e", "--device", "cpu", "--prompt-len", "16"];
    all.extend_from_slice(args);
    all.extend(["--out", out.to_str().unwrap()]);
    let o = speclab(&all);
    assert!(
        o.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&std::fs::read(out).unwrap()).unwrap()
}

#[test]
fn cpu_bench_writes_rows_with_matching_outputs() {
    let dir = tmpdir("rows");
    let out = dir.join("e2e.json");
    let args = [
        "--concurrency",
        "1,2",
        "--drafters",
        "none,mtp:2",
        "--new-tokens",
        "6",
    ];
    let rec = cpu_record(&out, &args);
    assert_eq!(rec["kind"], "bench-e2e");
    assert_eq!(rec["outputs_all_match"], true);
    // The run's SPECLAB_* switches are in the record.
    assert_eq!(
        rec["switches"]["SPECLAB_TEST_SWITCH"], "0",
        "{}",
        rec["switches"]
    );
    let rows = rec["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "2 concurrencies x 2 drafters");
    for r in rows {
        assert_eq!(r["mismatch_vs_none"], 0, "{r}");
        assert!(r["decode_tok_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["steps"].as_u64().unwrap() >= 1, "{r}");
    }
    for r in rows {
        assert_eq!(r["tok_s_runs"].as_array().unwrap().len(), 1, "{r}");
    }
    let mtp = rows.iter().find(|r| r["drafter"] == "mtp").unwrap();
    assert_eq!(mtp["num_spec"], 2);
    assert!(mtp["tau"].as_f64().unwrap() >= 1.0);
    assert!(mtp["verify_rows_per_step"].as_f64().unwrap() > 1.0, "{mtp}");
}

#[test]
fn bad_drafter_and_prompt_len_are_clean_errors() {
    let o = speclab(&[
        "bench",
        "e2e",
        "--device",
        "cpu",
        "--drafters",
        "mtp",
        "--out",
        "/dev/null/x",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("mtp:N"), "stderr: {err}");
    let dir = tmpdir("bad");
    let out = dir.join("e.json");
    let o = speclab(&[
        "bench",
        "e2e",
        "--device",
        "cpu",
        "--drafters",
        "none",
        "--prompt-len",
        "100000",
        "--out",
        out.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("--prompt-len 100000"), "stderr: {err}");
    assert!(!err.contains("panicked"), "stderr: {err}");
}

#[test]
fn repeated_legs_keep_the_median_run() {
    let dir = tmpdir("repeat");
    let out = dir.join("e2e.json");
    let args = [
        "--concurrency",
        "1",
        "--drafters",
        "none,mtp:1",
        "--new-tokens",
        "4",
    ];
    let rec = cpu_record(&out, &[&args[..], &["--repeat", "3"]].concat());
    assert_eq!(rec["repeat"], 3);
    for r in rec["rows"].as_array().unwrap() {
        let mut runs: Vec<f64> = r["tok_s_runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(runs.len(), 3, "{r}");
        runs.sort_by(f64::total_cmp);
        assert_eq!(
            r["decode_tok_s"].as_f64().unwrap(),
            runs[1],
            "the median run: {r}"
        );
        assert_eq!(r["mismatch_vs_none"], 0, "{r}");
    }
    let bad = speclab(&[
        "bench",
        "e2e",
        "--device",
        "cpu",
        "--repeat",
        "0",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--repeat"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}
