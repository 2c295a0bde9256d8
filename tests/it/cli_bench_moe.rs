//! `speclab bench moe` without a GPU (CI): a clean "no CUDA device" error and no record;
//! bad arguments are rejected before the device is looked for. On the GPU machine the
//! command runs from recipes/moe_bench.sh (its numbers are in runs/bench-moe.json).

use std::process::Command;

fn speclab(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_speclab"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run speclab")
}

fn out_path(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("speclab-bench-moe-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d.join("bench-moe.json")
}

#[test]
fn without_a_gpu_the_error_is_clean_and_no_record_is_written() {
    if speclab_cuda::device::skip_reason().is_none() {
        eprintln!("skipping: a CUDA device is present (this test covers the no-GPU path)");
        return;
    }
    let out = out_path("nogpu");
    let o = speclab(&["bench", "moe", "--m", "1,2", "--out", out.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no CUDA device"), "stderr: {err}");
    assert!(!out.exists(), "a failed run must not leave a record");
}

#[test]
fn bad_arguments_are_rejected_before_the_device() {
    let out = out_path("args");
    let o = speclab(&[
        "bench",
        "moe",
        "--routing",
        "zipf,bogus",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("bogus"), "stderr: {err}");
    let o = speclab(&["bench", "moe", "--m", "0,4", "--out", out.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("at least 1"), "stderr: {err}");
    assert!(!out.exists());
}
