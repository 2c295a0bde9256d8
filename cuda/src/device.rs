//! Finding the GPU without panicking, and the loaded kernel set of one device.
//!
//! Design: cudarc's dynamic loader panics when a library is missing, so every entry
//! point probes first ([`probe`]): libcuda present, at least one device, a context on
//! device 0. GPU tests call [`skip_reason`] and print one line when it is `Some`. The
//! architecture NVRTC targets comes from the device's compute capability ([`arch_for`]:
//! 9.0 -> `sm_90a`, so Hopper-only instructions stay available to later kernels).
//!
//! Invariants: [`Gpu::new`] compiles (or loads from the cache) every source of
//! [`crate::kernels::SOURCES`] and resolves every entry point once; launches never
//! look a function up by name afterwards. Event tracking is disabled: the engine uses
//! one stream, and a step must be capturable as a CUDA graph.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream};

use crate::error::{CudaError, Result};
use crate::kernels;

/// Whether libcuda can be loaded.
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen candidate names and drops what it opened.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Number of CUDA devices (an error when the driver is missing).
pub fn device_count() -> Result<usize> {
    if !driver_available() {
        return Err(CudaError::NoDriver);
    }
    let n = CudaContext::device_count().map_err(|e| CudaError::NoDevice(format!("{e:?}")))?;
    Ok(n.max(0) as usize)
}

/// `None` when a device is usable, else why not (one line, for "skipping: ..." messages).
pub fn skip_reason() -> Option<String> {
    match device_count() {
        Ok(0) => Some("no CUDA device".into()),
        Ok(_) if !kernels::nvrtc_available() => {
            Some("no CUDA device usable: libnvrtc not found".into())
        }
        Ok(_) => None,
        Err(_) => Some("no CUDA device".into()),
    }
}

/// Free and total bytes of device `ordinal`'s memory now (cuMemGetInfo on its primary
/// context); a clean error, never a loader panic, when no device is usable.
pub fn mem_info(ordinal: usize) -> Result<(u64, u64)> {
    if let Some(why) = skip_reason() {
        return Err(CudaError::NoDevice(why));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::driver("CudaContext::new", e))?;
    let (free, total) = ctx
        .mem_get_info()
        .map_err(|e| CudaError::driver("cuMemGetInfo", e))?;
    Ok((free as u64, total as u64))
}

/// NVRTC architecture for a compute capability: `sm_90a` for 9.0 (wgmma/setmaxnreg
/// need the `a` target), else `sm_XY`.
pub fn arch_for(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

/// Whether kernels launch with programmatic dependent launch (every entry point begins
/// with `pdl_enter`, cuda/kernels/common.cuh): on compute capability 9.0 and later,
/// unless the environment says `SPECLAB_PDL=0` (or `off`), for an A/B comparison in one
/// device call.
pub fn pdl_wanted(major: i32, env: Option<&str>) -> bool {
    major >= 9 && switch_on(env)
}

/// An on-by-default A/B switch as its environment variable sets it: off for `0`, `off`
/// or `false`, on otherwise (`SPECLAB_PDL`, `SPECLAB_MTP_PAD`, and each switch field of
/// [`Gpu`], whose doc names its variable).
pub fn switch_on(env: Option<&str>) -> bool {
    !matches!(env.map(str::trim), Some("0" | "off" | "false"))
}

/// [`switch_on`] of the environment variable `var`.
pub fn env_on(var: &str) -> bool {
    switch_on(std::env::var(var).ok().as_deref())
}

/// A row-count setting from the environment variable `var` (at least 1), else `default`.
pub fn rows_env(var: &str, default: usize) -> Result<usize> {
    match std::env::var(var) {
        Err(_) => Ok(default),
        Ok(v) => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| {
                CudaError::Input(format!("{var}=`{v}`: expected a row count of at least 1"))
            }),
    }
}

/// The INT4 expert GEMMs (tensor-core mma over pre-shuffled fragments: cuda/kernels/linear.cu).
pub const W4_KERNELS: [&str; 4] = [
    "moe_gate_up_w4",
    "moe_down_w4",
    "moe_experts_w4",
    "moe_gate_up_shared_w4",
];

/// Shared-memory carveout (percent of the SM's 228 KB) asked for the INT4 GEMMs: all of
/// it, room for 2 blocks of their 96 KB cp.async ring + accumulator array (2 blocks of
/// 256 threads is what their 128 registers allow); weights bypass L1 (cp.async.cg).
pub const W4_CARVEOUT_PERCENT: i32 = 100;

/// Opt kernel `name` into `bytes` of dynamic shared memory (required above 48 KB).
fn allow_smem(f: &CudaFunction, name: &str, bytes: u32) -> Result<()> {
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    f.set_attribute(
        A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .map_err(|e| CudaError::driver(format!("dynamic shared memory of {name}"), e))
}

fn prefer_shared(f: &CudaFunction, name: &str) -> Result<()> {
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    allow_smem(f, name, crate::launch::w4_smem())?;
    // A hint: if a driver refuses it the kernels still run (with fewer resident blocks,
    // which the bench record's occupancy shows).
    let _ = f.set_attribute(
        A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        W4_CARVEOUT_PERCENT,
    );
    Ok(())
}

/// A device context, its one stream, and every kernel of the engine.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// NVRTC target, e.g. `sm_90a`.
    pub arch: String,
    /// Device name.
    pub name: String,
    funcs: HashMap<&'static str, CudaFunction>,
    /// Kernel launches issued so far (kernels per step = difference around a step).
    pub launches: std::cell::Cell<u64>,
    /// Launch with programmatic dependent launch (sm_90+, unless `SPECLAB_PDL=0`):
    /// [`pdl_wanted`].
    pub pdl: std::cell::Cell<bool>,
    /// Rows from which the bf16 GEMMs launch their register-tiled kernels
    /// ([`crate::launch::tiled_min_rows`], `SPECLAB_LIN_TILED_MIN`).
    pub tiled_min_rows: usize,
    /// Rows up to which the bf16 GEMMs launch their skinny kernels, before the tiled ones
    /// ([`crate::launch::skinny_max_rows`], `SPECLAB_LIN_SKINNY_MAX`; 0 = never).
    pub skinny_max_rows: usize,
    /// Fuse each MoE layer's post-attention rmsnorm into its router kernel (default;
    /// `SPECLAB_ROUTER_NORM=0` launches kernel `rmsnorm` before it, the A/B reference).
    pub fuse_router_norm: bool,
    /// The router's last block sorts the pairs instead of a `moe_align` launch (default;
    /// `SPECLAB_ROUTER_ALIGN=0` launches `moe_align`, the A/B reference).
    pub fuse_router_align: bool,
    /// The shared expert's down-projection with the combine runs its dot before the
    /// grid-dependency wait when its input settled two grids back (`ops::linear_combine`
    /// `settled`); default, `SPECLAB_COMBINE_PRE=0` waits first (A/B).
    pub combine_pre: bool,
    /// The MoE combine as the shared expert's down-projection epilogue (default with the
    /// tiled GEMMs; `SPECLAB_MOE_COMBINE=0` launches `moe_combine`, the A/B reference).
    pub fuse_combine: bool,
    /// Each KDA layer's conv, recurrence and gated norm in one launch (`kda_fused_{dl}`,
    /// default; `SPECLAB_KDA_FUSED=0` launches the three kernels, the A/B reference).
    pub fuse_kda: bool,
    /// With [`Gpu::fuse_kda`], the fused KDA kernel also does the f / g up-projections
    /// (no `linear_pair` launch before it); default, `SPECLAB_KDA_LOWRANK=0` off.
    pub fuse_kda_lowrank: bool,
    /// Mean rows a chunk up to which the fused KDA kernel is taken
    /// ([`crate::ops::KDA_FUSED_MEAN_ROWS`]; `SPECLAB_KDA_FUSED_ROWS=n`, n >= 1).
    pub kda_fused_rows: usize,
    /// The MTP layer's embedding and two input norms in one launch (`mtp_in_norm`);
    /// default, `SPECLAB_MTP_IN_NORM=0` launches `embed_gather` and two `rmsnorm`s.
    pub fuse_mtp_in: bool,
    /// The KDA kernels read the state pages, conv windows and chunk metadata before the
    /// grid-dependency wait (kda.cu `pre`); default, `SPECLAB_KDA_PRE=0` after it.
    pub kda_pre: bool,
    /// A decode step's final norm also writes the head's input rows (`rmsnorm_dup`, no
    /// identity row gather); default, `SPECLAB_FINAL_DUP=0` launches `gather_rows`.
    pub final_dup: bool,
    /// Multi-row (verify) chunks' KDA layer in two launches (`kda_conv_lowrank_{dl}` +
    /// `kda_recurrent_norm_{dl}`, [`crate::ops::KdaPath::Pair`]); default,
    /// `SPECLAB_KDA_PAIR=0` launches linear_pair + the three kernels.
    pub kda_pair: bool,
    /// Steps of the split KDA path without snapshots (prefill) run the chunked kernels
    /// (`kda_chunk_prep_{dl}` + `kda_chunk_scan_{dl}`, [`crate::kda_chunk`]) in place of
    /// `kda_conv` + `kda_recurrent_{dl}`; default, `SPECLAB_KDA_CHUNKED=0` keeps the
    /// per-token recurrence (the A/B reference).
    pub kda_chunked: bool,
    /// Steps with a chunk of at least [`crate::ops::ATT_TILED_MIN_LEN`] tokens (prefill)
    /// run `prefill_attention` (16 query rows a block, K/V tiles in shared memory) in place
    /// of `paged_attention`; default, `SPECLAB_ATT_TILED=0` keeps `paged_attention`.
    pub att_tiled: bool,
    /// The fused router's latency cuts (kernel `moe_router_topk`'s `pre`: its first
    /// router-weight word, bias and norm weight loaded before the grid-dependency wait, and
    /// a one-block grid aligning from shared ids without the ticket); default,
    /// `SPECLAB_ROUTER_PRE=0` turns them off (A/B).
    pub router_pre: bool,
    /// The INT4 expert GEMMs' weight prologue before the grid-dependency wait where the
    /// routing is two grids back (linear.cu `w4_mma`); default, `SPECLAB_W4_PRE=0` off.
    pub w4_pre: bool,
    /// The INT4 expert GEMMs' K split by the wave rule (launch.rs `W4Split::waves`);
    /// default, `SPECLAB_W4_WAVES=0` takes the reaching rule (`W4Split::reaching`).
    pub w4_waves: bool,
    /// The shared expert's SwiGLU hidden computed by extra blocks of the routed gate/up
    /// launch (`moe_gate_up_shared_w4`) instead of its own launch after the experts;
    /// default with INT4 experts and the tiled GEMMs, `SPECLAB_SHARED_MERGE=0` off.
    pub merge_shared: bool,
    /// INT4 expert GEMM blocks resident at once: SMs x the occupancy of `moe_down_w4`
    /// at its block and shared memory (a wave of the K-split rule, launch.rs `W4Split::waves`).
    pub w4_slots: usize,
    /// The activation terms the INT4 expert GEMMs were compiled with (`W4_XS` of
    /// `SPECLAB_KERNEL_DEFINES`, [`kernels::w4_xs`]).
    pub w4_xs: usize,
    /// The wave rule's band: [`crate::launch::WaveBand::for_xs`] of `w4_xs`, or
    /// `SPECLAB_W4_BAND`.
    pub w4_band: crate::launch::WaveBand,
    /// linear.cu's module when its kernels were compiled with `W4_TRACE=1` (block traces
    /// of the INT4 expert kernels, [`crate::w4trace`]), else `None`.
    pub w4_trace: Option<Arc<cudarc::driver::CudaModule>>,
    /// While profiling: (kernel name, an event recorded right after its launch).
    pub profile: std::cell::RefCell<Option<Vec<(&'static str, cudarc::driver::CudaEvent)>>>,
}

/// SMs x resident `moe_down_w4` blocks an SM (every INT4 expert GEMM has its block,
/// register bound and shared memory): [`Gpu::w4_slots`].
fn w4_slots(ctx: &CudaContext, funcs: &HashMap<&'static str, CudaFunction>) -> Result<usize> {
    use cudarc::driver::sys::CUdevice_attribute as A;
    let sms = ctx
        .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| CudaError::driver("multiprocessor count", e))?;
    let f = funcs
        .get("moe_down_w4")
        .ok_or_else(|| CudaError::Input("kernel moe_down_w4 not loaded (internal)".into()))?;
    let per = f
        .occupancy_max_active_blocks_per_multiprocessor(
            32 * crate::launch::w4_warps(),
            crate::launch::w4_smem() as usize,
            None,
        )
        .map_err(|e| CudaError::driver("occupancy of moe_down_w4", e))?;
    Ok((sms.max(1) as usize) * (per.max(1) as usize))
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("name", &self.name)
            .field("arch", &self.arch)
            .field("kernels", &self.funcs.len())
            .finish()
    }
}

impl Gpu {
    /// Open device `ordinal`, compile / load every kernel for its architecture.
    pub fn new(ordinal: usize) -> Result<Self> {
        if let Some(why) = skip_reason() {
            return Err(CudaError::NoDevice(why));
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| CudaError::driver("CudaContext::new", e))?;
        // SAFETY: called before any allocation or stream of this context exists, and the
        // engine uses one stream only, so no cross-stream ordering is lost.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver("compute_capability", e))?;
        let arch = arch_for(major, minor);
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        let stream = ctx
            .new_stream()
            .map_err(|e| CudaError::driver("new_stream", e))?;
        let dir = kernels::cache_dir();
        let mut funcs = HashMap::new();
        let defines = kernels::env_defines()?;
        let traced = kernels::define_value(&defines, "W4_TRACE").unwrap_or(0) != 0;
        let mut w4_trace = None;
        for src in kernels::SOURCES {
            let ptx = kernels::compile(src, &arch, &dir)?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(ptx.ptx))
                .map_err(|e| CudaError::driver(format!("load_module {}", src.name), e))?;
            for &entry in src.entries {
                let f = module
                    .load_function(entry)
                    .map_err(|e| CudaError::driver(format!("load_function {entry}"), e))?;
                if W4_KERNELS.contains(&entry) {
                    prefer_shared(&f, entry)?;
                }
                if entry == "sample_verify" {
                    allow_smem(&f, entry, crate::sample::SAMPLE_SMEM)?;
                }
                funcs.insert(entry, f);
            }
            if traced && src.name == "linear.cu" {
                w4_trace = Some(module);
            }
        }
        let w4_slots = w4_slots(&ctx, &funcs)?;
        let w4_xs = kernels::w4_xs(&defines);
        let w4_band = crate::launch::WaveBand::for_xs(
            w4_xs,
            std::env::var(crate::launch::W4_BAND_ENV).ok().as_deref(),
        )?;
        Ok(Self {
            w4_slots,
            w4_xs,
            w4_band,
            ctx,
            stream,
            arch,
            name,
            funcs,
            launches: std::cell::Cell::new(0),
            pdl: std::cell::Cell::new(pdl_wanted(
                major,
                std::env::var("SPECLAB_PDL").ok().as_deref(),
            )),
            tiled_min_rows: crate::launch::tiled_min_rows(
                std::env::var(crate::launch::TILED_MIN_ENV).ok().as_deref(),
            )?,
            skinny_max_rows: crate::launch::skinny_max_rows(
                std::env::var(crate::launch::SKINNY_MAX_ENV).ok().as_deref(),
            )?,
            fuse_router_norm: env_on("SPECLAB_ROUTER_NORM"),
            fuse_router_align: env_on("SPECLAB_ROUTER_ALIGN"),
            fuse_combine: env_on("SPECLAB_MOE_COMBINE"),
            combine_pre: env_on("SPECLAB_COMBINE_PRE"),
            fuse_kda: env_on("SPECLAB_KDA_FUSED"),
            kda_fused_rows: rows_env("SPECLAB_KDA_FUSED_ROWS", crate::ops::KDA_FUSED_MEAN_ROWS)?,
            kda_pair: env_on("SPECLAB_KDA_PAIR"),
            kda_chunked: env_on("SPECLAB_KDA_CHUNKED"),
            att_tiled: env_on("SPECLAB_ATT_TILED"),
            final_dup: env_on("SPECLAB_FINAL_DUP"),
            kda_pre: env_on("SPECLAB_KDA_PRE"),
            fuse_mtp_in: env_on("SPECLAB_MTP_IN_NORM"),
            fuse_kda_lowrank: env_on("SPECLAB_KDA_LOWRANK"),
            router_pre: env_on("SPECLAB_ROUTER_PRE"),
            w4_pre: env_on("SPECLAB_W4_PRE"),
            w4_waves: env_on("SPECLAB_W4_WAVES"),
            merge_shared: env_on("SPECLAB_SHARED_MERGE"),
            w4_trace,
            profile: std::cell::RefCell::new(None),
        })
    }

    /// Hold the stream for `cycles` SM clocks (one thread of kernel `spin_wait`), so that
    /// the launches enqueued next queue up behind it as they would behind real work.
    pub fn spin(&self, cycles: i64) -> Result<()> {
        let args = [crate::ops::Arg::L(cycles)];
        let one = crate::launch::Shape {
            grid: (1, 1, 1),
            block: (1, 1, 1),
            smem: 0,
        };
        // SAFETY: spin_wait takes one `long long` and touches no memory.
        unsafe { crate::ops::launch(self, "spin_wait", one, &args) }
    }

    /// Start recording an event after every launch (eager steps only: events cannot be
    /// recorded inside a graph capture). The first entry is the start mark.
    pub fn profile_start(&self) -> Result<()> {
        // ~5 ms at the H200's ~2 GHz: longer than the host takes to enqueue a step.
        self.spin(10_000_000)?;
        let e = self.timing_event()?;
        *self.profile.borrow_mut() = Some(vec![("start", e)]);
        Ok(())
    }

    /// Stop profiling: µs of GPU time per kernel name (between the events before and
    /// after each launch) and launches per name, sorted by time, most first.
    pub fn profile_stop(&self) -> Result<Vec<(String, usize, f64)>> {
        let Some(ev) = self.profile.borrow_mut().take() else {
            return Ok(Vec::new());
        };
        self.sync()?;
        let mut by: HashMap<&'static str, (usize, f64)> = HashMap::new();
        for w in ev.windows(2) {
            let us = w[0]
                .1
                .elapsed_ms(&w[1].1)
                .map_err(|e| CudaError::driver("event elapsed", e))? as f64
                * 1e3;
            let e = by.entry(w[1].0).or_default();
            e.0 += 1;
            e.1 += us;
        }
        let mut v: Vec<(String, usize, f64)> = by
            .into_iter()
            .map(|(k, (n, t))| (k.to_string(), n, t))
            .collect();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        Ok(v)
    }

    /// An event with timing recorded on the stream now.
    pub fn timing_event(&self) -> Result<cudarc::driver::CudaEvent> {
        self.stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| CudaError::driver("record_event", e))
    }

    /// Resident blocks an SM of kernel `name` at `block` threads (no dynamic shared memory).
    pub fn blocks_per_sm(&self, name: &str, block: u32, smem: u32) -> Result<u32> {
        self.func(name)?
            .occupancy_max_active_blocks_per_multiprocessor(block, smem as usize, None)
            .map_err(|e| CudaError::driver(format!("occupancy of {name}"), e))
    }

    /// Registers a thread and local (spill) bytes a thread of kernel `name`.
    pub fn regs_and_local(&self, name: &str) -> Result<[i32; 2]> {
        use cudarc::driver::sys::CUfunction_attribute_enum as A;
        let f = self.func(name)?;
        let get = |a| {
            f.get_attribute(a)
                .map_err(|e| CudaError::driver(format!("attributes of {name}"), e))
        };
        Ok([
            get(A::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
            get(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
        ])
    }

    /// The kernel `name` (an internal error if it is not in [`kernels::SOURCES`]).
    pub fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| CudaError::Input(format!("kernel `{name}` is not loaded (internal)")))
    }

    /// The loaded kernel name equal to `name` (a `'static` key for the profile).
    pub fn func_name(&self, name: &str) -> &'static str {
        self.funcs
            .get_key_value(name)
            .map(|(k, _)| *k)
            .unwrap_or("unknown")
    }

    /// Whether an MoE layer of `t` tokens runs its shared expert's SwiGLU as extra blocks
    /// of the INT4 gate/up launch (`moe_gate_up_shared_w4`): INT4 experts, the switch on,
    /// the tiled (or skinny) GEMMs picked, not the one fused experts kernel, and blocks of
    /// [`crate::launch::W4_WARPS`] warps (the 256 threads of `swiglu_tiled_block`).
    pub fn merges_shared(&self, t: usize, int4: bool) -> bool {
        int4 && self.merge_shared
            && t >= self.tiled_min_rows
            && !crate::launch::moe_fused()
            && crate::launch::w4_blocks_carry_shared()
    }

    /// Whether an MoE layer of `t` tokens runs the combine as the epilogue of the shared
    /// expert's down-projection (`ops::linear_combine`).
    pub fn fuses_combine(&self, t: usize) -> bool {
        self.fuse_combine && t >= self.tiled_min_rows
    }

    /// Block until the stream is idle.
    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| CudaError::driver("synchronize", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn arch_mapping() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(8, 0), "sm_80");
        assert_eq!(arch_for(12, 0), "sm_120");
    }
    #[test]
    fn programmatic_launch_is_hopper_on_unless_switched_off() {
        assert!(pdl_wanted(9, None));
        assert!(pdl_wanted(10, Some("1")));
        assert!(!pdl_wanted(8, None));
        for off in ["0", "off", " false "] {
            assert!(!pdl_wanted(9, Some(off)), "{off:?}");
        }
    }
    /// The lines of `body` (from its opening brace) before its first `pdl_enter();` or
    /// call of one of `delegates`; `None` when it has neither.
    fn before_wait<'a>(body: &'a str, delegates: &[&str]) -> Option<&'a str> {
        let open = body.find('{')?;
        let body = &body[open + 1..];
        let cut = std::iter::once("pdl_enter();")
            .chain(delegates.iter().copied())
            .filter_map(|m| body.find(m))
            .min()?;
        Some(&body[..cut])
    }

    #[test]
    fn every_kernel_entry_waits_for_the_grid_before_it() {
        // A kernel launched with the programmatic attribute must wait before touching
        // memory the previous kernel writes (cuda/kernels/common.cuh pdl_enter): every
        // entry point calls it first, or after a prologue that only computes indices and
        // loads constant weights (the tiled GEMMs' LT_PREWAIT, the router's and KDA's
        // weight prologues), or first calls a device function held to the same rule.
        // The INT4 GEMMs' `pre` path (w4_mma / w4_item) also reads the routing before the
        // wait, which the host allows only two grids after the routing (linear.cu w4_mma),
        // and the KDA kernels' `pre` path the state pages and chunk metadata, written by
        // earlier steps or the host (kda.cu kda_recurrent_impl).
        let delegates = [
            "swiglu_tiled_block(",
            "swiglu_skinny_block(",
            "linear_skinny<",
            "linear_skinny_rows<",
            "swiglu_skinny_rows<",
            "combine_skinny_rows<",
            "skinny_dot<",
            "w4_mma<",
            "kda_recurrent_impl<",
            "kda_conv_block(",
            "lowrank_block<",
            "kda_chunk_prep_impl<",
            "kda_chunk_scan_impl<",
        ];
        let allowed = [
            "int m0, n0;",
            "int m0, r0;",
            "if (!tiled_origin(",
            "if (!tiled_origin_at(",
            "TiledPre pre;",
            "tiled_pre(pre, ",
            "tiled_pre_norm(pre, ",
            "const bool z = blockIdx.z != 0;",
            // The skinny GEMMs: indices, then (LS_PREWAIT) the first weight words.
            "int m, n;",
            "int m, r;",
            "if (!skinny_origin_at(",
            "switch (skinny_rows(M, m0)) {",
            "case 1:",
            // ... and the start of the line that calls skinny_dot (the cut falls inside it).
            "const float s =",
            "const int lane = threadIdx.x & 31;",
            "float acc[MR * LS_RN], ss[MR];",
            "for (int i = 0; i < MR * LS_RN; ++i) acc[i] = 0.0f;",
            "for (int r = 0; r < MR; ++r) ss[r] = 0.0f;",
            "uint4 wv[LS_U][LS_RN];",
            "if (LS_PREWAIT || !wait) skinny_load(wv, W, R, K, r0, lane);",
            "if (wait)",
            // linear_{tiled,skinny}_combine_bf16: with `settled` the shared hidden was
            // written two grids back (ops::linear_combine), so the dot precedes the wait
            // (w4_mma's `pre` argument); the routed outputs are read after it.
            "if (!settled)",
            "const bool st = settled != 0;",
            // moe_gate_up_shared_w4: block dispatch to the two delegates.
            "const int b = blockIdx.x;",
            "if (b < sh_blocks) {",
            "if (sh_skinny)",
            // kda_conv_lowrank: block dispatch; lowrank_block: its item's indices.
            "if (b < conv_blocks) {",
            "const int row = it / 2, which = it % 2;",
            // moe_router_topk: the first router-weight word of each warp.
            "const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;",
            "// warp < E",
            "const bool pw = pre && warp < E && lane < K / 8;",
            "uint4 w0 = make_uint4(",
            "if (pw) w0 = *reinterpret_cast<const uint4*>(W + ",
            "float nw0 = 0.0f, b0 = 0.0f;",
            "if (pre && norm_w != nullptr && threadIdx.x < K) nw0 = norm_w[threadIdx.x];",
            "if (pre && warp < E) b0 = bias[warp];",
            // w4_mma: the wait unless `pre` (then in w4_item, after the routing reads);
            // its block-trace clock (W4_TRACE, registers only).
            "if (!pre)",
            "W4Clock ck;",
            "ck.mark<0>();",
            // kda_recurrent_impl: indices, shared arrays, the weight rows' L2 prefetch.
            "__shared__ float ",
            "const int h = blockIdx.x, s = blockIdx.y, j = threadIdx.x;",
            "const int C = nl * DL;",
            "const bool lowrank = FUSED && wf != nullptr;",
            "const size_t wrow = (size_t)(h * DL + j) * DL;",
            "const uint4* wfp = ",
            "const uint4* wgp = ",
            "// The thread's f and g",
            "// (held in registers",
            "if (lowrank) {",
            "#pragma unroll",
            "for (int b = 0; b < DL * 2; b += 128) {",
            "asm volatile(\"prefetch.global.L2",
            "}",
        ];
        let mut bodies: Vec<(String, &str)> = Vec::new();
        for src in crate::kernels::SOURCES {
            for (i, _) in src.source.match_indices("extern \"C\" __global__") {
                bodies.push((format!("{} entry at byte {i}", src.name), &src.source[i..]));
            }
            for d in delegates {
                let name = d.trim_end_matches(['(', '<']);
                for (i, _) in src.source.match_indices(&format!(" {name}(")) {
                    // A definition: the signature is followed by its body, not a `;`.
                    let rest = &src.source[i..];
                    let (brace, semi) = (rest.find('{'), rest.find(';'));
                    if brace.is_some_and(|b| semi.is_none_or(|s| b < s)) {
                        bodies.push((format!("{} {name} at byte {i}", src.name), rest));
                    }
                }
            }
        }
        assert!(bodies.len() > 40, "found {} bodies", bodies.len());
        for (what, body) in bodies {
            let pre = before_wait(body, &delegates);
            let ok = pre.is_some_and(|p| {
                p.lines()
                    .map(|l| l.trim().trim_end_matches('\\').trim())
                    .filter(|l| !l.is_empty())
                    .all(|l| allowed.iter().any(|a| l.starts_with(a)))
            });
            assert!(ok, "{what} touches memory before pdl_enter(): {pre:?}");
        }
    }
    #[test]
    fn probing_never_panics() {
        // On a machine without CUDA this is Some(..); with one, None. Never a panic.
        let _ = skip_reason();
        let _ = device_count();
    }
}
