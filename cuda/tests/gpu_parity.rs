//! GPU parity of the CUDA engine against the CPU engine and the PyTorch goldens on
//! models/tiny (speclab_cuda::check::parity): logits / hidden / router within
//! docs/model.md §1.6's tolerance, greedy tokens identical (eager and on-device argmax
//! with CUDA graphs), KDA snapshot + commit_state rollback.
//!
//! Skips with one line when no CUDA device (or no libnvrtc) is present, as on CI.

use std::path::PathBuf;

#[test]
fn cuda_engine_matches_the_cpu_engine_on_models_tiny() {
    if let Some(why) = speclab_cuda::device::skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tiny");
    let lines = speclab_cuda::check::parity(&dir).expect("parity run");
    for l in &lines {
        println!(
            "{} {:<72} {:.3e} (bound {:.1e})",
            if l.pass { "ok  " } else { "FAIL" },
            l.name,
            l.value,
            l.bound
        );
    }
    let failed: Vec<_> = lines
        .iter()
        .filter(|l| !l.pass)
        .map(|l| l.name.clone())
        .collect();
    assert!(failed.is_empty(), "failed: {failed:?}");
}
