//! The `--device cuda` paths on a machine without a GPU: a clean error naming the missing
//! device (non-zero exit), never a panic from the dynamic CUDA loader. On a GPU machine
//! the commands must run instead (checked there by the device recipes under recipes/).

use std::process::Command;

/// Run speclab with `args` (from the repository root) and check it fails cleanly because
/// no CUDA device is present; returns false (and prints one line) when a device is there.
fn fails_cleanly_without_a_gpu(args: &[&str]) -> bool {
    if speclab_cuda::device::skip_reason().is_none() {
        eprintln!("skipping: a CUDA device is present (covered by the recipes/ device scripts)");
        return false;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_speclab"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run speclab");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        matches!(out.status.code(), Some(c) if c != 0),
        "{args:?}: stderr: {err}"
    );
    assert!(
        err.contains("CUDA device unavailable"),
        "{args:?}: stderr: {err}"
    );
    assert!(!err.contains("panicked"), "{args:?}: stderr: {err}");
    true
}

#[test]
fn generate_device_cuda_without_a_gpu_is_a_clean_error() {
    fails_cleanly_without_a_gpu(&[
        "generate",
        "--model",
        "models/tiny",
        "--device",
        "cuda",
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "2",
    ]);
}

#[test]
fn verify_lossless_device_cuda_without_a_gpu_is_a_clean_error() {
    fails_cleanly_without_a_gpu(&[
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
    ]);
}

#[test]
fn eval_ppl_device_cuda_without_a_gpu_is_a_clean_error() {
    fails_cleanly_without_a_gpu(&[
        "eval-ppl",
        "models/tiny",
        "--data",
        "models/tiny/data.safetensors",
        "--limit",
        "1",
        "--device",
        "cuda",
    ]);
}

#[test]
fn a_cuda_manifest_without_a_gpu_is_a_clean_error() {
    let dir = std::env::temp_dir().join(format!("speclab-cli-cuda-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rec = dir.join("r.json");
    let rec_s = rec.to_str().unwrap();
    let ran = fails_cleanly_without_a_gpu(&[
        "run",
        "experiments/df2w-real-below-none-cuda.ron",
        "--out",
        rec_s,
    ]);
    if ran {
        assert!(!rec.exists(), "no record for a run that never started");
    }
}

#[test]
fn the_six_request_cuda_manifest_without_a_gpu_is_a_clean_error() {
    let dir = std::env::temp_dir().join(format!("speclab-cli-cuda-six-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rec = dir.join("r.json");
    let ran = fails_cleanly_without_a_gpu(&[
        "run",
        "experiments/df2w-real-six-cuda.ron",
        "--out",
        rec.to_str().unwrap(),
    ]);
    if ran {
        assert!(!rec.exists(), "no record for a run that never started");
    }
}
