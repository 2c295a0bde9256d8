//! The kernel sources and their NVRTC compilation, with an on-disk PTX cache.
//!
//! Design (shared/DESIGN.md, "The GPU engine"): kernels are `.cu` files under
//! `cuda/kernels/`, embedded with `include_str!`, compiled at run time by NVRTC for the
//! device's architecture (sm_90a on the H200; [`DEFAULT_ARCH`] when compiling without a
//! device, as CI does) and cached on disk under a key that hashes the NVRTC version, the
//! architecture, the options and the full source ([`cache_key`]). No nvcc at build time.
//! Every source is prefixed with `kernels/common.cuh` (the prelude: no `#include`, so
//! NVRTC needs no CUDA headers) and a `#line 1` directive so compile errors name the
//! `.cu` file and line.
//!
//! Invariants: [`SOURCES`] lists every `.cu` file and every `extern "C"` entry point the
//! engine launches (the CI test compiles all of them and checks each entry appears in
//! the PTX); the cache key is stable across runs and Rust versions (FNV-1a 64, not
//! `DefaultHasher`); cache writes are atomic (temp file + rename), a corrupt or
//! unreadable entry is recompiled, never trusted.

use std::path::{Path, PathBuf};

use crate::error::{CudaError, Result};

/// Architecture used when no device tells us (CI's PTX-only compile): the H200's.
pub const DEFAULT_ARCH: &str = "sm_90a";

/// Environment variable naming the kernel cache directory.
pub const CACHE_ENV: &str = "SPECLAB_KERNEL_CACHE";
/// Environment variable of NVRTC-time kernel tunables, e.g. `W4_XS=2`.
pub const DEFINES_ENV: &str = "SPECLAB_KERNEL_DEFINES";
/// The tunables [`DEFINES_ENV`] may set, with their allowed range: compile-time knobs of
/// the kernels that the host's launch shapes do not depend on (`W4_XS`: the INT4 expert
/// GEMMs' activation split terms, 3 exact, 1 the bf16 activations of W4A16 as vLLM's Marlin
/// takes them; `W4_PACK2`: their tiles of 3-5 pairs in two packed mma
/// sets (1) or unpacked (0, the default); `W4_PACK2_HALVES`: the K slice, in half
/// 128-groups, a warp must walk for that packing; `LT_PREWAIT`: the tiled bf16 GEMMs load their first
/// weight words before the programmatic-dependent-launch wait; `LS_PREWAIT`: the skinny
/// ones likewise; `LS_EXACT_ROWS`: the skinny ones instantiated for 1 and 2 rows (1) or
/// always 4 with the last row repeated (0); `MOE_ALIGN_FAST`: moe.cu's pair sort by
/// shared atomics and a parallel scan (1) or per-expert ballots and a serial scan (0);
/// `ALIGN_STAGE`: pairs the sort copies into shared memory for its scatter, 0 none, the
/// scatter then reads L2; `ATT_INFLIGHT`:
/// positions `paged_attention` loads per warp pass; `W4_MINB`: the INT4 expert GEMMs'
/// `__launch_bounds__` blocks an SM, which caps their registers; the host reads the
/// resulting occupancy, so the K-split rule's wave follows it; `W4_STAGES`: their weight
/// stages, 2 or 3, with the blocks' shared memory following, `launch::w4_smem`;
/// `W4_TRACE`: block traces of the INT4 expert kernels, `crate::w4trace`; `W4_EPI`: their
/// epilogue specialized by the K split, 1 by default, 0 the run-time one; `W4_PF`: their
/// L2 prefetch of the weights that many half groups ahead, 0 none; `W4_WARPS`: their warps
/// a block, 8 or 4, the host following with `launch::w4_warps`; `W4_BULK`: their weight
/// walk by bulk copies with that many stages, 2 to 6, 0 the cp.async walk,
/// `launch::w4_smem` following).
pub const TUNABLES: [(&str, std::ops::RangeInclusive<u32>); 16] = [
    ("W4_XS", 1..=3),
    ("W4_MINB", 1..=4),
    ("W4_STAGES", 2..=3),
    ("W4_PACK2", 0..=1),
    ("W4_PACK2_HALVES", 1..=64),
    ("LT_PREWAIT", 0..=1),
    ("LS_PREWAIT", 0..=1),
    ("LS_EXACT_ROWS", 0..=1),
    ("MOE_ALIGN_FAST", 0..=1),
    ("ALIGN_STAGE", 0..=8192),
    ("ATT_INFLIGHT", 1..=8),
    ("W4_TRACE", 0..=1),
    ("W4_EPI", 0..=1),
    ("W4_PF", 0..=16),
    ("W4_WARPS", 4..=8),
    ("W4_BULK", 0..=6),
];

/// The prelude prepended to every source.
pub const PRELUDE: &str = include_str!("../kernels/common.cuh");

/// One `.cu` file and the kernels the engine launches from it.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File name under `cuda/kernels/` (also the NVRTC program name).
    pub name: &'static str,
    /// The file's text.
    pub source: &'static str,
    /// `extern "C"` entry points.
    pub entries: &'static [&'static str],
}

/// Every kernel source of the engine.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "basic.cu",
        source: include_str!("../kernels/basic.cu"),
        entries: &[
            "embed_gather",
            "rmsnorm",
            "rmsnorm_dup",
            "mtp_in_norm",
            "gather_rows",
            "argmax_rows",
            "copy_f32",
            "copy_f32x4",
            "mtp_feed",
            "spin_wait",
        ],
    },
    KernelSource {
        name: "linear.cu",
        source: include_str!("../kernels/linear.cu"),
        entries: &[
            "linear_bf16",
            "linear_norm_bf16",
            "linear_pair_bf16",
            "swiglu_dense_bf16",
            "linear_tiled_bf16",
            "linear_tiled_combine_bf16",
            "linear_norm_tiled_bf16",
            "linear_pair_tiled_bf16",
            "swiglu_tiled_bf16",
            "linear_skinny_bf16",
            "linear_norm_skinny_bf16",
            "linear_pair_skinny_bf16",
            "swiglu_skinny_bf16",
            "linear_skinny_combine_bf16",
            "moe_split_x",
            "moe_gate_up_w4",
            "moe_gate_up_shared_w4",
            "moe_gate_up_bf16",
            "moe_down_w4",
            "moe_down_bf16",
            "moe_experts_w4",
        ],
    },
    KernelSource {
        name: "moe.cu",
        source: include_str!("../kernels/moe.cu"),
        entries: &["moe_topk", "moe_router_topk", "moe_align", "moe_combine"],
    },
    KernelSource {
        name: "attention.cu",
        source: include_str!("../kernels/attention.cu"),
        entries: &["rope_kv_write", "paged_attention", "prefill_attention"],
    },
    KernelSource {
        name: "dflash.cu",
        source: include_str!("../kernels/dflash.cu"),
        entries: &[
            "df2_features",
            "df2_ctx_write",
            "df2_head_norm_rope",
            "df2_conv",
            "df2_attention",
            "df2_topk",
        ],
    },
    KernelSource {
        name: "sample.cu",
        source: include_str!("../kernels/sample.cu"),
        entries: &["sample_verify"],
    },
    KernelSource {
        name: "bench.cu",
        source: include_str!("../kernels/bench.cu"),
        entries: &[
            "bench_fill_u32",
            "bench_fill_bf16",
            "bench_fill_f32",
            "moe_ref_gate_up_w4",
            "moe_ref_down_w4",
        ],
    },
    KernelSource {
        name: "kda.cu",
        source: include_str!("../kernels/kda.cu"),
        entries: &[
            "kda_conv",
            "kda_recurrent_32",
            "kda_recurrent_64",
            "kda_recurrent_128",
            "kda_fused_32",
            "kda_fused_64",
            "kda_fused_128",
            "kda_recurrent_norm_32",
            "kda_recurrent_norm_64",
            "kda_recurrent_norm_128",
            "kda_conv_lowrank_32",
            "kda_conv_lowrank_64",
            "kda_conv_lowrank_128",
            "kda_gate_norm",
            "kda_chunk_prep_32",
            "kda_chunk_prep_64",
            "kda_chunk_prep_128",
            "kda_chunk_scan_32",
            "kda_chunk_scan_64",
            "kda_chunk_scan_128",
        ],
    },
];

/// The text NVRTC compiles for `src`: prelude, then the file from its line 1.
pub fn full_source(src: &KernelSource) -> String {
    format!("{PRELUDE}\n#line 1 \"{}\"\n{}", src.name, src.source)
}

/// NVRTC options for `arch` (e.g. `sm_90a`). No fast math: docs/model.md §1 numerics.
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--device-as-default-execution-space".to_string(),
    ]
}

/// `-D` options from a tunables string (`NAME=VALUE` separated by commas or spaces; each
/// NAME one of [`TUNABLES`], VALUE an integer in its range). Empty input: none.
pub fn parse_defines(text: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for item in text.split([',', ' ']).filter(|t| !t.is_empty()) {
        let bad = |why: String| {
            CudaError::Input(format!(
                "{DEFINES_ENV}: `{item}`: {why} (allowed: {TUNABLES:?})"
            ))
        };
        let (name, value) = item
            .split_once('=')
            .ok_or_else(|| bad("expected NAME=VALUE".into()))?;
        let range = TUNABLES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, r)| r)
            .ok_or_else(|| bad(format!("unknown tunable `{name}`")))?;
        let v: u32 = value
            .parse()
            .map_err(|_| bad(format!("`{value}` is not an integer")))?;
        if !range.contains(&v) {
            return Err(bad(format!("{v} is outside {range:?}")));
        }
        if name == "W4_WARPS" && !v.is_power_of_two() {
            return Err(bad(format!("{v} warps a block: expected 4 or 8")));
        }
        if name == "W4_BULK" && v == 1 {
            return Err(bad(
                "1 bulk stage: expected 0 (the cp.async walk) or 2 to 6".into(),
            ));
        }
        out.push(format!("-D{name}={v}"));
    }
    Ok(out)
}

/// The `-D` options of [`DEFINES_ENV`] (none when unset).
pub fn env_defines() -> Result<Vec<String>> {
    match std::env::var(DEFINES_ENV) {
        Ok(t) => parse_defines(&t),
        Err(_) => Ok(Vec::new()),
    }
}

/// The value of tunable `name` in `defines` (as [`env_defines`] gives them): the last one
/// given, if any.
pub fn define_value(defines: &[String], name: &str) -> Option<usize> {
    defines.iter().rev().find_map(|d| {
        d.strip_prefix("-D")?
            .strip_prefix(name)?
            .strip_prefix('=')?
            .parse()
            .ok()
    })
}

/// The activation split terms the INT4 kernels are compiled with: the last `W4_XS` of
/// `defines`, else the source's default, 3.
pub fn w4_xs(defines: &[String]) -> usize {
    define_value(defines, "W4_XS").unwrap_or(3)
}

/// The INT4 kernels' weight stages: the last `W4_STAGES` of `defines`, else 2.
pub fn w4_stages(defines: &[String]) -> usize {
    define_value(defines, "W4_STAGES").unwrap_or(2)
}

/// FNV-1a 64-bit hash (stable across runs, platforms and Rust versions).
pub fn fnv1a64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Separator so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Cache key of one compilation: hash of NVRTC version, arch, options and the full source.
pub fn cache_key(nvrtc_version: (i32, i32), arch: &str, options: &[String], source: &str) -> u64 {
    let ver = format!("{}.{}", nvrtc_version.0, nvrtc_version.1);
    let opts = options.join("\u{1}");
    fnv1a64(&[
        ver.as_bytes(),
        arch.as_bytes(),
        opts.as_bytes(),
        source.as_bytes(),
    ])
}

/// The cache directory: `$SPECLAB_KERNEL_CACHE`, else `$HOME/.cache/speclab/kernels`,
/// else `<temp>/speclab-kernels`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(CACHE_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        Some(h) => PathBuf::from(h).join(".cache/speclab/kernels"),
        None => std::env::temp_dir().join("speclab-kernels"),
    }
}

/// The cache file of a compilation.
pub fn cache_path(dir: &Path, name: &str, arch: &str, key: u64) -> PathBuf {
    dir.join(format!("{name}.{arch}.{key:016x}.ptx"))
}

/// Whether libnvrtc can be loaded (never panics).
pub fn nvrtc_available() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on candidate library names and
    // drops what it opened; it dereferences nothing of ours.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: libnvrtc is present (checked above, so the loader does not panic);
    // nvrtcVersion writes two ints through the pointers, which point at live locals.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Compile {
            source_name: "<nvrtcVersion>".into(),
            arch: String::new(),
            options: Vec::new(),
            log: format!("{r:?}"),
        });
    }
    Ok((major, minor))
}

/// Compiled PTX of one source and where it came from.
#[derive(Debug, Clone)]
pub struct CompiledPtx {
    pub name: &'static str,
    /// PTX text.
    pub ptx: String,
    /// Served from the disk cache.
    pub cached: bool,
}

/// Compile `src` for `arch` through the cache in `dir` (created if missing; a cache
/// that cannot be written is not an error, only a recompile next time).
pub fn compile(src: &KernelSource, arch: &str, dir: &Path) -> Result<CompiledPtx> {
    let ver = nvrtc_version()?;
    let mut options = compile_options(arch);
    options.extend(env_defines()?);
    let text = full_source(src);
    let key = cache_key(ver, arch, &options, &text);
    let path = cache_path(dir, src.name, arch, key);
    if let Ok(ptx) = std::fs::read_to_string(&path) {
        if src.entries.iter().all(|e| ptx_has_entry(&ptx, e)) {
            return Ok(CompiledPtx {
                name: src.name,
                ptx,
                cached: true,
            });
        }
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: options.clone(),
        name: Some(src.name.to_string()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&text, opts).map_err(|e| {
        let log = match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        };
        CudaError::Compile {
            source_name: src.name.into(),
            arch: arch.into(),
            options: options.clone(),
            log,
        }
    })?;
    let ptx = ptx.to_src();
    store(dir, &path, &ptx);
    Ok(CompiledPtx {
        name: src.name,
        ptx,
        cached: false,
    })
}

/// Best-effort atomic write of a cache entry.
fn store(dir: &Path, path: &Path, ptx: &str) {
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, ptx).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// Whether the PTX defines the entry point `name` (`.entry name(`).
pub fn ptx_has_entry(ptx: &str, name: &str) -> bool {
    ptx.contains(&format!(".entry {name}("))
}

/// Compile every source (the CI check): one [`CompiledPtx`] per file, or the first error.
pub fn compile_all(arch: &str, dir: &Path) -> Result<Vec<CompiledPtx>> {
    SOURCES.iter().map(|s| compile(s, arch, dir)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_is_stable_and_sensitive() {
        let opts = compile_options("sm_90a");
        let k = cache_key((13, 0), "sm_90a", &opts, "src");
        // Pinned value: a change of the hash function would silently orphan caches.
        assert_eq!(k, cache_key((13, 0), "sm_90a", &opts, "src"));
        assert_eq!(fnv1a64(&[b"speclab"]), PINNED_SPECLAB);
        assert_ne!(k, cache_key((13, 1), "sm_90a", &opts, "src"));
        assert_ne!(k, cache_key((13, 0), "sm_80", &opts, "src"));
        assert_ne!(k, cache_key((13, 0), "sm_90a", &opts[..1], "src"));
        assert_ne!(k, cache_key((13, 0), "sm_90a", &opts, "src "));
        assert_ne!(fnv1a64(&[b"ab", b"c"]), fnv1a64(&[b"a", b"bc"]));
    }

    /// `fnv1a64(&[b"speclab"])`, pinned when the cache was introduced.
    const PINNED_SPECLAB: u64 = 0x820b_bd06_59da_759e;

    #[test]
    fn sources_list_every_entry_point() {
        for s in SOURCES {
            let declared: Vec<&str> = s
                .source
                .match_indices("extern \"C\" __global__ void ")
                .map(|(i, m)| {
                    let mut rest = &s.source[i + m.len()..];
                    if let Some(r) = rest.strip_prefix("__launch_bounds__(") {
                        rest = r[r.find(')').map_or(0, |j| j + 1)..].trim_start();
                    }
                    &rest[..rest.find('(').unwrap_or(0)]
                })
                .collect();
            for d in declared.iter().filter(|d| !d.contains('#')) {
                assert!(s.entries.contains(d), "{}: {d} not in SOURCES", s.name);
            }
            // Macro-generated entries (kda_recurrent_N) are listed explicitly.
            for e in s.entries {
                assert!(
                    declared.contains(e) || s.source.contains("KDA_RECURRENT("),
                    "{}: {e} listed but not declared",
                    s.name
                );
            }
            assert!(
                !s.source.contains("#include"),
                "{}: kernels must not include headers",
                s.name
            );
        }
        assert!(!PRELUDE.contains("#include"));
    }

    #[test]
    fn tunable_defines_parse_and_reject_bad_input() {
        assert_eq!(
            parse_defines("W4_XS=2, W4_XS=3").unwrap(),
            vec!["-DW4_XS=2".to_string(), "-DW4_XS=3".to_string()]
        );
        assert_eq!(w4_xs(&parse_defines("W4_XS=2").unwrap()), 2);
        assert_eq!(w4_xs(&parse_defines("W4_XS=1").unwrap()), 1);
        assert_eq!(w4_stages(&parse_defines("W4_STAGES=3").unwrap()), 3);
        assert_eq!(w4_stages(&[]), 2);
        let four = parse_defines("W4_WARPS=4").unwrap();
        assert_eq!(define_value(&four, "W4_WARPS"), Some(4));
        assert!(parse_defines("W4_WARPS=16").is_err());
        assert!(parse_defines("W4_WARPS=2").is_err());
        let six = parse_defines("W4_WARPS=6").unwrap_err().to_string();
        assert!(
            six.contains("`W4_WARPS=6`") && six.contains("expected 4 or 8"),
            "{six}"
        );
        let one = parse_defines("W4_BULK=1").unwrap_err().to_string();
        assert!(
            one.contains("`W4_BULK=1`") && one.contains("2 to 6"),
            "{one}"
        );
        assert!(parse_defines("W4_BULK=7").is_err());
        assert_eq!(
            define_value(&parse_defines("W4_BULK=4").unwrap(), "W4_BULK"),
            Some(4)
        );
        // A name that only starts like another is not it.
        assert_eq!(define_value(&["-DW4_XSX=1".to_string()], "W4_XS"), None);
        assert_eq!(w4_xs(&parse_defines("W4_XS=2, W4_XS=3").unwrap()), 3);
        assert_eq!(w4_xs(&[]), 3);
        assert_eq!(
            parse_defines("W4_XS=1 W4_MINB=3").unwrap(),
            vec!["-DW4_XS=1".to_string(), "-DW4_MINB=3".to_string()]
        );
        assert!(parse_defines("").unwrap().is_empty());
        for bad in [
            "W4_XS",
            "W4_RT=2",
            "W4_XS=x",
            "W4_XS=0",
            "W4_XS=4",
            "W4_MINB=5",
        ] {
            let e = parse_defines(bad).unwrap_err().to_string();
            assert!(e.contains(DEFINES_ENV) && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn cache_dir_honours_env_and_paths_are_distinct() {
        let d = Path::new("/tmp/x");
        assert_ne!(
            cache_path(d, "a.cu", "sm_90a", 1),
            cache_path(d, "a.cu", "sm_90a", 2)
        );
        assert!(cache_path(d, "a.cu", "sm_90a", 255)
            .to_string_lossy()
            .ends_with("a.cu.sm_90a.00000000000000ff.ptx"));
    }
}
