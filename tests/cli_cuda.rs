//! `speclab generate --device cuda` on a machine without a GPU: a clean error naming the
//! missing device (non-zero exit), never a panic from the dynamic CUDA loader.
//! On a GPU machine the command must generate instead (checked there by the device script).

use std::process::Command;

#[test]
fn generate_device_cuda_without_a_gpu_is_a_clean_error() {
    if speclab_cuda::device::skip_reason().is_none() {
        eprintln!("skipping: a CUDA device is present (covered by recipes/gpu_check.sh)");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_speclab"))
        .args([
            "generate",
            "--model",
            "models/tiny",
            "--device",
            "cuda",
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "2",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run speclab");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        matches!(out.status.code(), Some(c) if c != 0),
        "stderr: {err}"
    );
    assert!(err.contains("CUDA device unavailable"), "stderr: {err}");
    assert!(!err.contains("panicked"), "stderr: {err}");
}

#[test]
fn verify_lossless_device_cuda_without_a_gpu_is_a_clean_error() {
    if speclab_cuda::device::skip_reason().is_none() {
        eprintln!("skipping: a CUDA device is present (covered by recipes/gpu_check.sh)");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_speclab"))
        .args([
            "verify-lossless",
            "--model",
            "models/tiny",
            "--device",
            "cuda",
            "--drafter",
            "mtp",
            "--num-spec",
            "2",
            "--random-prompts",
            "1:4",
            "--max-tokens",
            "2",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run speclab");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        matches!(out.status.code(), Some(c) if c != 0),
        "stderr: {err}"
    );
    assert!(err.contains("CUDA device unavailable"), "stderr: {err}");
    assert!(!err.contains("panicked"), "stderr: {err}");
}

#[test]
fn a_cuda_manifest_without_a_gpu_is_a_clean_error() {
    if speclab_cuda::device::skip_reason().is_none() {
        eprintln!("skipping: a CUDA device is present (covered by recipes/real_cuda.sh)");
        return;
    }
    let out_dir = std::env::temp_dir().join(format!("speclab-cli-cuda-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).unwrap();
    let rec = out_dir.join("r.json");
    let out = Command::new(env!("CARGO_BIN_EXE_speclab"))
        .args(["run", "experiments/df2w-real-below-none-cuda.ron", "--out"])
        .arg(&rec)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run speclab");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "stderr: {err}");
    assert!(err.contains("CUDA device unavailable"), "stderr: {err}");
    assert!(!err.contains("panicked"), "stderr: {err}");
    assert!(!rec.exists(), "no record for a run that never started");
}

#[test]
fn eval_ppl_device_cuda_without_a_gpu_is_a_clean_error() {
    if speclab_cuda::device::skip_reason().is_none() {
        eprintln!("skipping: a CUDA device is present (covered by recipes/eval_ppl_cuda.sh)");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_speclab"))
        .args([
            "eval-ppl",
            "models/tiny",
            "--data",
            "models/tiny/data.safetensors",
            "--limit",
            "1",
            "--device",
            "cuda",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run speclab");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "stderr: {err}");
    assert!(err.contains("CUDA device unavailable"), "stderr: {err}");
    assert!(!err.contains("panicked"), "stderr: {err}");
}
