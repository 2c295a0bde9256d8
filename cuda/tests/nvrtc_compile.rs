//! CI check: every kernel source compiles with NVRTC to PTX for the H200 (sm_90a) and
//! defines every entry point the engine launches.
//!
//! Needs only libnvrtc (no GPU): `.ci/run` installs `nvidia-cuda-nvrtc==13.0.88` from
//! PyPI, puts it on LD_LIBRARY_PATH and sets SPECLAB_REQUIRE_NVRTC=1, so a missing
//! library fails CI loudly; a developer without libnvrtc gets one "skipping" line.

use speclab_cuda::kernels::{self, ptx_has_entry, SOURCES};

#[test]
fn every_kernel_compiles_to_ptx_for_sm_90a() {
    if !kernels::nvrtc_available() {
        if std::env::var("SPECLAB_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
            panic!(
                "SPECLAB_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded (LD_LIBRARY_PATH={:?})",
                std::env::var("LD_LIBRARY_PATH").ok()
            );
        }
        eprintln!("skipping: libnvrtc not found (see cuda/README.md to install it)");
        return;
    }
    let ver = kernels::nvrtc_version().unwrap();
    let dir = std::env::temp_dir().join(format!("speclab-kernel-test-{}", std::process::id()));
    let mut failures = Vec::new();
    for src in SOURCES {
        match kernels::compile(src, kernels::DEFAULT_ARCH, &dir) {
            Ok(p) => {
                assert!(
                    !p.cached,
                    "{}: fresh cache dir served a cached entry",
                    src.name
                );
                for e in src.entries {
                    if !ptx_has_entry(&p.ptx, e) {
                        failures.push(format!("{}: entry `{e}` missing from the PTX", src.name));
                    }
                }
                assert!(
                    p.ptx.contains(".target sm_90a"),
                    "{}: PTX not for sm_90a",
                    src.name
                );
                println!(
                    "{}: {} bytes of PTX, {} entries (NVRTC {}.{})",
                    src.name,
                    p.ptx.len(),
                    src.entries.len(),
                    ver.0,
                    ver.1
                );
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    // Every tunable's non-default values compile too (SPECLAB_KERNEL_DEFINES), each with
    // the source that reads it. This file's only test, so setting the process environment
    // races nothing.
    for (name, defines) in [
        ("linear.cu", "W4_XS=2"),
        ("linear.cu", "W4_XS=1"),
        ("moe.cu", "W4_XS=1"),
        ("bench.cu", "W4_XS=1"),
        ("linear.cu", "W4_XS=1 W4_MINB=3"),
        ("linear.cu", "W4_XS=1 W4_STAGES=3"),
        ("linear.cu", "W4_STAGES=3"),
        ("linear.cu", "W4_PACK2=1"),
        ("linear.cu", "W4_PACK2=1 W4_PACK2_HALVES=1"),
        ("linear.cu", "LT_PREWAIT=0"),
        ("linear.cu", "LS_PREWAIT=0"),
        ("linear.cu", "LS_EXACT_ROWS=0"),
        ("moe.cu", "MOE_ALIGN_FAST=0"),
        ("linear.cu", "W4_EPI=0"),
        ("linear.cu", "W4_XS=1 W4_EPI=0"),
        ("linear.cu", "W4_XS=1 W4_PF=4"),
        ("linear.cu", "W4_PF=2"),
        ("linear.cu", "W4_XS=1 W4_WARPS=4 W4_MINB=4"),
        ("linear.cu", "W4_WARPS=4"),
        ("linear.cu", "W4_XS=1 W4_BULK=4"),
        ("linear.cu", "W4_XS=1 W4_BULK=6"),
        ("linear.cu", "W4_XS=1 W4_BULK=3 W4_WARPS=4 W4_MINB=4"),
        ("linear.cu", "W4_BULK=2"),
        ("attention.cu", "ATT_INFLIGHT=4"),
    ] {
        let source = SOURCES.iter().find(|s| s.name == name).expect(name);
        std::env::set_var(kernels::DEFINES_ENV, defines);
        if let Err(e) = kernels::compile(source, kernels::DEFAULT_ARCH, &dir) {
            failures.push(format!("{name} {defines}: {e}"));
        }
        std::env::remove_var(kernels::DEFINES_ENV);
    }
    // The block trace (W4_TRACE=1, cuda/src/w4trace.rs) declares the globals the host reads.
    let linear = SOURCES.iter().find(|s| s.name == "linear.cu").unwrap();
    std::env::set_var(kernels::DEFINES_ENV, "W4_XS=1, W4_TRACE=1");
    match kernels::compile(linear, kernels::DEFAULT_ARCH, &dir) {
        Ok(p) => {
            for global in ["w4_trace[", "w4_trace_n"] {
                if !p.ptx.contains(global) {
                    failures.push(format!("linear.cu W4_TRACE=1: no global {global}"));
                }
            }
        }
        Err(e) => failures.push(format!("linear.cu W4_TRACE=1: {e}")),
    }
    std::env::remove_var(kernels::DEFINES_ENV);
    // The second compile of one source is served from the cache.
    let again = kernels::compile(&SOURCES[0], kernels::DEFAULT_ARCH, &dir).unwrap();
    assert!(again.cached, "second compile was not a cache hit");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "{} kernel problem(s):\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}
