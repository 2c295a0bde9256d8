//! End-to-end tests of sharded sweeps: `speclab run --shard I/N` and `speclab merge`.
//!
//! What they pin: three shards of the small fixture, merged, equal one unsharded run leg
//! for leg (timing fields aside); the shard comes from `--shard` or from the Slurm and
//! Kubernetes variables (the flag winning); merge refuses a shard of another manifest, a
//! missing shard and a duplicated one, naming the file; bad shard input names the flag
//! or variable and the value.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Every variable the shard resolution reads, removed so the host's never leak in.
const SHARD_VARS: [&str; 6] = [
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_COUNT",
    "SLURM_ARRAY_TASK_MIN",
    "SLURM_ARRAY_TASK_STEP",
    "JOB_COMPLETION_INDEX",
    "SPECLAB_SHARD_COUNT",
];

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_speclab"));
    for v in SHARD_VARS {
        c.env_remove(v);
    }
    c
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/manifests")
        .join(name)
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("speclab-cli-shard-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn ok(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is JSON")
}

fn err(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure");
    let e = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!e.contains("panicked"), "{e}");
    e
}

/// A leg's JSON without its timing fields (also inside `real`).
fn results(leg: &serde_json::Value) -> serde_json::Value {
    let mut v = leg.clone();
    fn strip(v: &mut serde_json::Value) {
        if let Some(m) = v.as_object_mut() {
            m.retain(|k, _| {
                !matches!(k.as_str(), "wall_ms" | "wall_s" | "tokens_per_s")
                    && !k.ends_with("_ttft_s")
            });
            if let Some(r) = m.get_mut("real") {
                strip(r);
            }
        }
    }
    strip(&mut v);
    v
}

fn legs(v: &serde_json::Value) -> Vec<serde_json::Value> {
    v["legs"].as_array().unwrap().iter().map(results).collect()
}

/// `speclab run --shard I/3` of `manifest` into `dir/small.shard-I-of-3.json`.
fn run_shard(dir: &Path, manifest: &Path, i: usize) -> (PathBuf, serde_json::Value) {
    let p = dir.join(format!("small.shard-{i}-of-3.json"));
    let v = ok(&bin()
        .args(["run", "--json", "--shard", &format!("{i}/3"), "--out"])
        .arg(&p)
        .arg(manifest)
        .output()
        .unwrap());
    (p, v)
}

fn merge(paths: &[&Path], out: &Path) -> Output {
    bin()
        .args(["merge", "--json", "--out"])
        .arg(out)
        .args(paths)
        .output()
        .unwrap()
}

#[test]
fn three_shards_merged_equal_one_unsharded_run() {
    let d = tmpdir("equal");
    let full = ok(&bin()
        .args(["run", "--json", "--out"])
        .arg(d.join("full.json"))
        .arg(fixture("small.ron"))
        .output()
        .unwrap());
    assert!(
        full.get("shard").is_none(),
        "an unsharded record has no shard field"
    );
    let shards: Vec<(PathBuf, serde_json::Value)> = (0..3)
        .map(|i| run_shard(&d, &fixture("small.ron"), i))
        .collect();
    for (i, (_, v)) in shards.iter().enumerate() {
        assert_eq!(v["shard"], serde_json::json!({"index": i, "count": 3}));
        assert_eq!(v["complete"], true);
        // Round robin: shard i holds legs i and i + 3 of the six.
        let ids: Vec<&str> = v["legs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["id"].as_str().unwrap())
            .collect();
        let want: Vec<&str> = [i, i + 3]
            .iter()
            .map(|&k| full["legs"][k]["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, want);
    }
    let out = d.join("merged.json");
    // Given out of order: the merged legs follow the manifest.
    let paths: Vec<&Path> = [2, 0, 1].iter().map(|&i| shards[i].0.as_path()).collect();
    let merged = ok(&merge(&paths, &out));
    let on_disk: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(on_disk, merged);
    assert_eq!(legs(&merged).len(), 6);
    assert_eq!(legs(&merged), legs(&full), "leg for leg, timings aside");
    assert_eq!(merged["complete"], true);
    assert!(merged.get("shard").is_none());
    assert_eq!(merged["manifest_text"], full["manifest_text"]);
    // The merged record is a normal record: a plain rerun over it reproduces it.
    let rerun = bin()
        .args(["run", "--out"])
        .arg(&out)
        .arg(fixture("small.ron"))
        .output()
        .unwrap();
    assert!(
        rerun.status.success(),
        "{}",
        String::from_utf8_lossy(&rerun.stderr)
    );
    assert!(String::from_utf8_lossy(&rerun.stdout).contains("REPRODUCED"));
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn merge_refuses_another_manifest_a_missing_and_a_duplicated_shard() {
    let d = tmpdir("refuse");
    let (p0, _) = run_shard(&d, &fixture("small.ron"), 0);
    let (p1, _) = run_shard(&d, &fixture("small.ron"), 1);
    let (p2, _) = run_shard(&d, &fixture("small.ron"), 2);
    // The same manifest with one more prompt: another manifest text.
    let other_dir = d.join("other");
    std::fs::create_dir_all(&other_dir).unwrap();
    let text = std::fs::read_to_string(fixture("small.ron")).unwrap();
    let other_m = d.join("small-other.ron");
    std::fs::write(&other_m, text.replace("output_len: 32", "output_len: 16")).unwrap();
    let (o2, _) = run_shard(&other_dir, &other_m, 2);
    let out = d.join("m.json");

    let e = err(&merge(&[&p0, &p1, &o2], &out));
    assert!(
        e.contains(&o2.display().to_string()) && e.contains("different manifest text"),
        "{e}"
    );
    let e = err(&merge(&[&p0, &p2], &out));
    assert!(e.contains("missing shard(s) 1 of 3"), "{e}");
    let e = err(&merge(&[&p0, &p1, &p1, &p2], &out));
    assert!(
        e.contains(&p1.display().to_string()) && e.contains("given twice"),
        "{e}"
    );
    // An unsharded record is not a shard.
    let full = d.join("full.json");
    ok(&bin()
        .args(["run", "--json", "--out"])
        .arg(&full)
        .arg(fixture("small.ron"))
        .output()
        .unwrap());
    let e = err(&merge(&[&p0, &p1, &full], &out));
    assert!(
        e.contains(&full.display().to_string()) && e.contains("not a shard record"),
        "{e}"
    );
    assert!(!out.exists(), "a refused merge writes nothing");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn shard_from_slurm_and_kubernetes_variables_and_the_flag_wins() {
    let d = tmpdir("env");
    let m = fixture("small.ron");
    let run = || {
        let mut c = bin();
        c.args(["run", "--dry-run", "--json"]);
        c
    };
    let dry = |c: &mut Command| ok(&c.arg(&m).output().unwrap());
    let v = dry(run()
        .env("SLURM_ARRAY_TASK_ID", "2")
        .env("SLURM_ARRAY_TASK_COUNT", "3")
        .env("SLURM_ARRAY_TASK_MIN", "1"));
    assert_eq!(v["shard"], serde_json::json!({"index": 1, "count": 3}));
    assert_eq!(v["record"], "runs/small.shard-1-of-3.json");
    assert_eq!(v["legs"].as_array().unwrap().len(), 2);
    let v = dry(run()
        .env("JOB_COMPLETION_INDEX", "0")
        .env("SPECLAB_SHARD_COUNT", "2"));
    assert_eq!(v["shard"], serde_json::json!({"index": 0, "count": 2}));
    assert_eq!(v["legs"].as_array().unwrap().len(), 3);
    let v = dry(run()
        .env("JOB_COMPLETION_INDEX", "2")
        .args(["--shard-count", "3"]));
    assert_eq!(v["shard"], serde_json::json!({"index": 2, "count": 3}));
    let v = dry(run()
        .env("SLURM_ARRAY_TASK_ID", "2")
        .env("SLURM_ARRAY_TASK_COUNT", "3")
        .args(["--shard", "0/2"]));
    assert_eq!(v["shard"], serde_json::json!({"index": 0, "count": 2}));
    let v = dry(run()
        .env("SLURM_ARRAY_TASK_ID", "2")
        .env("SLURM_ARRAY_TASK_COUNT", "3")
        .arg("--no-shard"));
    assert!(v["shard"].is_null());
    assert_eq!(v["record"], "runs/small.json");
    assert_eq!(v["legs"].as_array().unwrap().len(), 6);
    // A real run under the Slurm variables writes its shard record.
    let p = d.join("s.json");
    let v = ok(&bin()
        .env("SLURM_ARRAY_TASK_ID", "1")
        .env("SLURM_ARRAY_TASK_COUNT", "3")
        .args(["run", "--json", "--out"])
        .arg(&p)
        .arg(&m)
        .output()
        .unwrap());
    assert_eq!(v["shard"], serde_json::json!({"index": 1, "count": 3}));
    // Over that record, another shard (or no shard) is refused.
    let e = err(&bin()
        .args(["run", "--shard", "2/3", "--out"])
        .arg(&p)
        .arg(&m)
        .output()
        .unwrap());
    assert!(
        e.contains("shard: the record is shard 1/3 but this run is shard 2/3"),
        "{e}"
    );
    std::fs::remove_dir_all(&d).ok();
}

/// Environment variables, extra `run` arguments, and the expected error text.
type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str], &'a str);

#[test]
fn bad_shard_input_names_the_flag_or_variable_and_the_value() {
    let m = fixture("small.ron");
    let cases: [Case<'_>; 6] = [
        (
            &[],
            &["--shard", "3/3"],
            "--shard: shard index 3 is not below the count 3",
        ),
        (&[], &["--shard", "0/0"], "--shard: the shard count is 0"),
        (
            &[],
            &["--shard", "one/3"],
            "--shard: \"one\" is not a non-negative integer",
        ),
        (
            &[
                ("SLURM_ARRAY_TASK_ID", "x"),
                ("SLURM_ARRAY_TASK_COUNT", "3"),
            ],
            &[],
            "SLURM_ARRAY_TASK_ID: \"x\"",
        ),
        (
            &[
                ("SLURM_ARRAY_TASK_ID", "5"),
                ("SLURM_ARRAY_TASK_COUNT", "3"),
            ],
            &[],
            "SLURM_ARRAY_TASK_ID: 5",
        ),
        (
            &[("JOB_COMPLETION_INDEX", "1")],
            &[],
            "JOB_COMPLETION_INDEX: 1 is set but the shard count is not",
        ),
    ];
    for (vars, args, want) in cases {
        let mut c = bin();
        for (k, v) in vars {
            c.env(k, v);
        }
        let e = err(&c
            .args(["run", "--dry-run"])
            .args(args)
            .arg(&m)
            .output()
            .unwrap());
        assert!(e.contains(want), "{vars:?} {args:?}: {e}");
    }
}
