//! Launch shapes and shape checks of every kernel, and the MoE tile bound (pure host code).
//!
//! Source: the `Launch:` line of each kernel in `cuda/kernels/*.cu` (grid, block) and
//! its stated requirements; vLLM `moe_align_block_size` for the padded-tile bound.
//!
//! Invariants: the constants mirror the `#define`s of the kernels (tested against the
//! sources); a grid is never zero-sized (callers skip empty launches) and never exceeds
//! the CUDA limits (`grid.y, grid.z <= 65535`), which [`grid_2d`] checks.

use crate::error::{CudaError, Result};

/// Warps (output columns) per block of the GEMM kernels (`LIN_WARPS`).
pub const LIN_WARPS: u32 = 4;
/// Rows per GEMM tile (`ROWS_PER_TILE`, `MOE_TILE`).
pub const ROWS_PER_TILE: u32 = 8;
/// Register-tiled GEMMs (`linear_tiled_bf16` and kin): a warp's rows (`LT_RM`) and weight
/// rows (`LT_RN`), warps along rows (`LT_WR`) and weight rows (`LT_WC`).
pub const LT_RM: u32 = 4;
pub const LT_RN: u32 = 8;
pub const LT_WR: u32 = 4;
pub const LT_WC: u32 = 2;
/// Rows from which the bf16 GEMMs run register-tiled. Measured on the H200
/// (runs/ab-9268bac): tiling from one row was faster at every batch than tiling from 9
/// rows (past the first 8-row tile) or not at all, so it is 1: the per-column kernels
/// are the `off` reference. A one-row tiling of 32 weight rows a warp was slower still
/// (runs/ab-64b1a5f: too few blocks for 256-768-row projections).
pub const TILED_MIN_ROWS: usize = 1;
/// Environment variable overriding [`TILED_MIN_ROWS`] (`off` never tiles: the A/B switch).
pub const TILED_MIN_ENV: &str = "SPECLAB_LIN_TILED_MIN";
/// Skinny bf16 GEMMs (`linear_skinny_bf16` and kin, for decode rows): rows of x a block
/// takes (`LS_RM`), weight rows a warp (`LS_RN`) and warps a block (`LS_WARPS`).
pub const LS_RM: u32 = 4;
pub const LS_RN: u32 = 2;
pub const LS_WARPS: u32 = 8;
/// Rows up to which the bf16 GEMMs launch their skinny kernels (before the tiled ones):
/// one block of rows, where the tiled kernels leave 6 of 8 warps idle.
pub const SKINNY_MAX_ROWS: usize = LS_RM as usize;
/// Environment variable overriding [`SKINNY_MAX_ROWS`] (`off`: never skinny, the A/B
/// switch; or a row count of at least 1).
pub const SKINNY_MAX_ENV: &str = "SPECLAB_LIN_SKINNY_MAX";

/// [`SKINNY_MAX_ROWS`] as `SPECLAB_LIN_SKINNY_MAX` sets it: `off` (0: never) or a row
/// count of at least 1; anything else is an error naming the variable.
pub fn skinny_max_rows(env: Option<&str>) -> Result<usize> {
    match env.map(str::trim) {
        None => Ok(SKINNY_MAX_ROWS),
        Some("off") => Ok(0),
        Some(v) => v.parse::<usize>().ok().filter(|&n| n >= 1).ok_or_else(|| {
            CudaError::Input(format!(
                "{SKINNY_MAX_ENV}=`{v}`: expected `off` or a row count of at least 1"
            ))
        }),
    }
}

/// [`TILED_MIN_ROWS`] as `SPECLAB_LIN_TILED_MIN` sets it: `off` (never tile) or a row
/// count of at least 1; anything else is an error naming the variable.
pub fn tiled_min_rows(env: Option<&str>) -> Result<usize> {
    match env.map(str::trim) {
        None => Ok(TILED_MIN_ROWS),
        Some("off") => Ok(usize::MAX),
        Some(v) => v.parse::<usize>().ok().filter(|&n| n >= 1).ok_or_else(|| {
            CudaError::Input(format!(
                "{TILED_MIN_ENV}=`{v}`: expected `off` or a row count of at least 1"
            ))
        }),
    }
}
/// mma tiles of 16 rows a warp of the INT4 expert GEMMs owns (`W4_RT`): a row block of 64.
pub const W4_RT: u32 = 4;
/// Warps per block of the INT4 expert GEMMs (`W4_WARPS`).
pub const W4_WARPS: u32 = 8;
/// Most bf16 terms the INT4 gate/up kernel splits an `h` element into (linear.cu `W4_XS`
/// <= 3): the `h` scratch holds `P Im W4_XS_MAX / 2` words.
pub const W4_XS_MAX: usize = 3;
/// Weight stages of the INT4 GEMMs (`W4_STAGES`, a double buffer; 3 with
/// `SPECLAB_KERNEL_DEFINES=W4_STAGES=3`, [`w4_smem`]).
pub const W4_STAGES: u32 = 2;
/// Blocks an INT4 expert GEMM launch aims at (2 resident per SM on the H200's 132 SMs,
/// about one wave): [`w4_ks`] splits K no further than needed to reach it.
pub const W4_TARGET_BLOCKS: usize = 256;
/// Environment variable overriding [`W4_TARGET_BLOCKS`] (a tuning knob, recorded by
/// `bench moe`).
pub const W4_TARGET_ENV: &str = "SPECLAB_W4_TARGET_BLOCKS";

/// Environment variable forcing the separate INT4 expert GEMMs' K split to `1`, `2`, `4`
/// or `8` ways (at most `k / 64`) whatever the tile count: a tuning knob for sweeps,
/// recorded by `bench moe`; unset, the reaching rule ([`w4_ks`]).
pub const W4_KS_ENV: &str = "SPECLAB_W4_KS";

/// The wave rule's band ([`w4_ks_waves`]): a split whose items fill one wave of resident
/// blocks to between `lo` and `hi` percent is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct WaveBand {
    pub lo: usize,
    pub hi: usize,
}

impl WaveBand {
    /// Exact activations (`W4_XS` 2, 3): 70-100%. The lower bound was fitted on the H200
    /// sweep of `runs/ab-210cbc4/`; the upper one was 105% until the A/B of
    /// `runs/moe-exact-hi-83a361d/` (H100): a split of 101-105% of a wave leaves its last
    /// few items to a second wave, and at 100% the draws that took one (sequence M = 8 and
    /// 16's 17- and 34-tile draws at 2 ways and whole-K, zipf M = 8's 34-tile one at
    /// whole-K) take 4 ways instead: sequence M = 8 120.4 -> 117.7 us single, 127.5 ->
    /// 119.6 chained; zipf M = 8 185.4 -> 182.8 / 186.2 -> 178.7; sequence M = 16 204.1 ->
    /// 202.7 / 201.2 -> 194.9, as the H200 sweep's forced splits had it (sequence M = 8 at
    /// 4 ways 105.8 against 122.3 at 2; zipf M = 8 162.7 against 192.6 whole-K).
    pub const EXACT: Self = Self { lo: 70, hi: 100 };
    /// bf16 activations (`W4_XS` 1): 65-100%. Every tile of at most 8 pairs is then one
    /// mma a k16 step, so tiles cost alike and one partial wave beats a second one
    /// sooner. Fitted on `SPECLAB_W4_KS` / `SPECLAB_W4_BAND` legs:
    /// - sequence M = 8 (17-21 tiles; 17 at 2 ways is 103%): on an H100, 110.5 us at 4
    ///   ways against 120.5 under the exact band (`runs/moe-a16-4e243be/`);
    /// - sequence M = 2 (11 tiles, 67% at 2 ways): on an H100, 67.6 us against 69.8 at
    ///   70-105% (`runs/moe-a16-074be95/`).
    ///
    /// 60-100% was better on that H100 (its 10-tile draws at 2 ways) but lost on an H200
    /// (`runs/moe-a16-h200-4881ed1/`): zipf M = 4's 21-tile draws then take a whole-K walk
    /// at 64% of a wave, 107.2 us against 95.9 at 4 ways; the sum over M <= 64 was
    /// 4,943.6 us against 4,933.5.
    pub const A16: Self = Self { lo: 65, hi: 100 };

    /// The band for kernels compiled with `xs` activation terms, or the one
    /// [`W4_BAND_ENV`] gives (`lo,hi` percent).
    pub fn for_xs(xs: usize, env: Option<&str>) -> Result<Self> {
        match env {
            Some(v) => Self::parse(v),
            None if xs <= 1 => Ok(Self::A16),
            None => Ok(Self::EXACT),
        }
    }

    /// `lo,hi`: percents, 1 <= lo <= hi <= 400.
    pub fn parse(v: &str) -> Result<Self> {
        let bad = || {
            CudaError::Input(format!(
                "{W4_BAND_ENV}=`{v}`: expected `lo,hi` percents of a wave, 1 <= lo <= hi <= 400"
            ))
        };
        let (a, b) = v.split_once(',').ok_or_else(bad)?;
        let lo = a.trim().parse::<usize>().map_err(|_| bad())?;
        let hi = b.trim().parse::<usize>().map_err(|_| bad())?;
        if lo == 0 || lo > hi || hi > 400 {
            return Err(bad());
        }
        Ok(Self { lo, hi })
    }

    /// Whether `items` fill `slots` within the band.
    fn holds(&self, items: usize, slots: usize) -> bool {
        100 * items >= self.lo * slots && 100 * items <= self.hi * slots
    }
}

/// Environment variable setting the wave rule's band, `lo,hi` percent (a tuning knob for
/// sweeps, recorded by `bench moe`); unset, [`WaveBand::for_xs`] of the compiled kernels.
pub const W4_BAND_ENV: &str = "SPECLAB_W4_BAND";

/// Fixed counters ahead of the per-tile ones in the fused INT4 experts kernel's `sync`
/// buffer (linear.cu `moe_experts_w4`): ticket, blocks done, split chunks done.
pub const MOE_SYNC_FIXED: usize = 3;

/// Environment variable turning the fused INT4 experts kernel (`moe_experts_w4`: split,
/// gate/up and down in one launch) on: `1`. Off by default: it measured slower than the
/// three kernels at GLM-5.3-Flash shapes and on models/tiny's graphed steps
/// (runs/moe-variants/README.md, "Persistent grid ... fused experts kernel").
pub const MOE_FUSED_ENV: &str = "SPECLAB_MOE_FUSED";

/// Whether an opt-in switch's value turns it on (`1` only; unset or anything else: off),
/// e.g. `SPECLAB_MOE_FUSED` for the fused kernel.
pub fn opt_in(v: Option<&str>) -> bool {
    v.map(str::trim) == Some("1")
}

/// The fused INT4 experts kernel is used ([`MOE_FUSED_ENV`], read once).
pub fn moe_fused() -> bool {
    static FUSED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FUSED.get_or_init(|| opt_in(std::env::var(MOE_FUSED_ENV).ok().as_deref()))
}

/// The INT4 GEMMs' target block count: [`W4_TARGET_ENV`] if set (1..=65536), else
/// [`W4_TARGET_BLOCKS`].
pub fn w4_target_blocks() -> Result<usize> {
    // Read once: the MoE layers of every step ask.
    static TARGET: std::sync::OnceLock<std::result::Result<usize, String>> =
        std::sync::OnceLock::new();
    TARGET
        .get_or_init(|| match std::env::var(W4_TARGET_ENV) {
            Err(_) => Ok(W4_TARGET_BLOCKS),
            Ok(v) => parse_w4_target(&v).map_err(|e| match e {
                CudaError::Input(m) => m,
                other => other.to_string(),
            }),
        })
        .clone()
        .map_err(CudaError::Input)
}

/// The forced K split ([`W4_KS_ENV`], read once), or `None`.
pub fn w4_ks_forced() -> Result<Option<usize>> {
    static KS: std::sync::OnceLock<std::result::Result<Option<usize>, String>> =
        std::sync::OnceLock::new();
    KS.get_or_init(|| match std::env::var(W4_KS_ENV) {
        Err(_) => Ok(None),
        Ok(v) => parse_w4_ks(&v).map(Some).map_err(|e| e.to_string()),
    })
    .clone()
    .map_err(CudaError::Input)
}

/// A [`W4_KS_ENV`] value: 1, 2, 4 or 8.
pub fn parse_w4_ks(v: &str) -> Result<usize> {
    v.trim()
        .parse::<usize>()
        .ok()
        .filter(|n| [1, 2, 4, 8].contains(n))
        .ok_or_else(|| {
            CudaError::Input(format!(
                "{W4_KS_ENV}=`{v}`: expected a K split of 1, 2, 4 or 8"
            ))
        })
}

/// A [`W4_TARGET_ENV`] value.
pub fn parse_w4_target(v: &str) -> Result<usize> {
    v.trim()
        .parse::<usize>()
        .ok()
        .filter(|n| (1..=65_536).contains(n))
        .ok_or_else(|| {
            CudaError::Input(format!(
                "{W4_TARGET_ENV}=`{v}`: expected a block count from 1 to 65536"
            ))
        })
}

/// A lower bound of the tiles `moe_align` fills for `t` tokens of `k` distinct experts
/// each: every token's k experts differ (so >= k tiles) and a tile holds <= 8 pairs.
pub fn moe_min_tiles(t: usize, k: usize) -> usize {
    k.max((t * k).div_ceil(ROWS_PER_TILE as usize))
}
/// uint4s a lane a stage (`W4_SLOT`: 4 k16 steps of weights + the group's scales).
pub const W4_SLOT: u32 = 5;
/// Dynamic shared memory of an INT4 GEMM block: the cp.async ring
/// `[W4_WARPS][W4_STAGES][W4_SLOT][32]` uint4 and the accumulator array
/// `[2 sets][W4_WARPS][W4_RT 4][32]` f32 (linear.cu `w4_run`: with `W4_PACK2=1` a tile of
/// 3-5 pairs keeps two accumulator sets; the default leaves the second unused).
pub const W4_SMEM: u32 = w4_smem_for(W4_STAGES);

/// [`W4_SMEM`] for `stages` weight stages.
pub const fn w4_smem_for(stages: u32) -> u32 {
    w4_smem_with(W4_WARPS, stages)
}

/// [`W4_SMEM`] for blocks of `warps` warps and `stages` weight stages.
pub const fn w4_smem_with(warps: u32, stages: u32) -> u32 {
    warps * stages * W4_SLOT * 32 * 16 + 2 * warps * W4_RT * 4 * 32 * 4
}

/// uint4s a warp's stage of the bulk-copy walk holds (linear.cu `W4_BSLOT`: 4 k16 steps
/// of 32 lanes' weights, then the group's 8 scale uint4s once).
pub const W4_BSLOT: u32 = 4 * 32 + 8;

/// The dynamic shared memory of the bulk-copy walk (`W4_BULK=stages`) with blocks of
/// `warps` warps: `[warps][stages][W4_BSLOT]` uint4, which the accumulator array of
/// [`w4_smem_with`] overlays after the walk, then `[warps][stages]` u64 mbarriers.
pub const fn w4_smem_bulk(warps: u32, stages: u32) -> u32 {
    warps * stages * W4_BSLOT * 16 + warps * stages * 8
}

/// The INT4 GEMMs' dynamic shared memory as the kernels are compiled now: with `W4_BULK`
/// of `SPECLAB_KERNEL_DEFINES` [`w4_smem_bulk`], else [`w4_smem_for`] its `W4_STAGES`
/// ([`crate::kernels::w4_stages`]), by default [`W4_SMEM`]; blocks of [`w4_warps`]. (A
/// bad define fails the kernels' compile before any launch.)
pub fn w4_smem() -> u32 {
    static SMEM: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *SMEM.get_or_init(|| {
        let defines = crate::kernels::env_defines().unwrap_or_default();
        match crate::kernels::define_value(&defines, "W4_BULK") {
            Some(n) if n > 0 => w4_smem_bulk(w4_warps(), n as u32),
            _ => w4_smem_with(w4_warps(), crate::kernels::w4_stages(&defines) as u32),
        }
    })
}

/// Whether the INT4 gate/up launch can carry the shared expert's SwiGLU as extra blocks
/// (`moe_gate_up_shared_w4`): only with blocks of [`W4_WARPS`] warps, the 256 threads
/// `swiglu_tiled_block` needs. The one test behind `Gpu::merges_shared`, the refusal in
/// `ops::moe_experts` and the merge parity's skip.
pub fn w4_blocks_carry_shared() -> bool {
    w4_warps() == W4_WARPS
}

/// Warps a block of the INT4 expert GEMMs as the kernels are compiled now: the `W4_WARPS`
/// of `SPECLAB_KERNEL_DEFINES` (4 or 8; linear.cu refuses others at compile time), else
/// [`W4_WARPS`]. Four-warp blocks halve a block's weight bytes, so a partial wave is
/// finer grained (an experiment for the H200's small-M rows, findings/bench-moe.md).
pub fn w4_warps() -> u32 {
    static WARPS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *WARPS.get_or_init(|| {
        let defines = crate::kernels::env_defines().unwrap_or_default();
        crate::kernels::define_value(&defines, "W4_WARPS").map_or(W4_WARPS, |w| w as u32)
    })
}
/// Largest k of `moe_topk` / `moe_combine` (`TOPK_MAX`).
pub const TOPK_MAX: usize = 8;
/// Largest expert count of `moe_topk` / `moe_align` (`EXPERTS_MAX`).
pub const EXPERTS_MAX: usize = 1024;
/// Largest head_dim of `paged_attention` (`HEAD_DIM_MAX`).
pub const HEAD_DIM_MAX: usize = 128;
/// Largest conv kernel of `kda_conv` (`KC_MAX`).
pub const KC_MAX: usize = 8;

/// A launch shape: (grid, block, dynamic shared bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    /// Dynamic shared memory bytes.
    pub smem: u32,
}

impl Shape {
    /// As cudarc's config.
    pub fn cfg(self) -> cudarc::driver::LaunchConfig {
        cudarc::driver::LaunchConfig {
            grid_dim: self.grid,
            block_dim: self.block,
            shared_mem_bytes: self.smem,
        }
    }
}

fn to_u32(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| CudaError::Unsupported(format!("{what} = {v} exceeds u32")))
}

/// A 2-D grid of `x` by `y` blocks of `block` threads; errors beyond CUDA's limits.
pub fn grid_2d(x: usize, y: usize, block: u32, what: &str) -> Result<Shape> {
    if x == 0 || y == 0 {
        return Err(CudaError::Input(format!(
            "{what}: empty launch ({x} x {y} blocks)"
        )));
    }
    if x > (1usize << 31) - 1 || y > 65_535 {
        return Err(CudaError::Unsupported(format!(
            "{what}: grid {x} x {y} exceeds CUDA's limits (x < 2^31, y <= 65535)"
        )));
    }
    Ok(Shape {
        grid: (to_u32(x, what)?, to_u32(y, what)?, 1),
        block: (block, 1, 1),
        smem: 0,
    })
}

/// GEMM kernels (`linear_bf16`, `swiglu_dense_bf16`): grid (ceil(N / 4), ceil(M / 8)), block 128.
pub fn gemm(m: usize, n: usize, what: &str) -> Result<Shape> {
    grid_2d(
        n.div_ceil(LIN_WARPS as usize),
        m.div_ceil(ROWS_PER_TILE as usize),
        32 * LIN_WARPS,
        what,
    )
}

/// Register-tiled GEMMs over `r` weight rows: grid (ceil(r / 16), ceil(m / 16)), block 256.
pub fn gemm_tiled(m: usize, r: usize, what: &str) -> Result<Shape> {
    grid_2d(
        r.div_ceil((LT_RN * LT_WC) as usize),
        m.div_ceil((LT_RM * LT_WR) as usize),
        32 * LT_WR * LT_WC,
        what,
    )
}

/// Skinny bf16 GEMMs over `m` rows and `r` weight rows: grid (ceil(r / 16), ceil(m / 4)),
/// block 256 (linear.cu `linear_skinny_bf16`).
pub fn gemm_skinny(m: usize, r: usize, what: &str) -> Result<Shape> {
    grid_2d(
        r.div_ceil((LS_RN * LS_WARPS) as usize),
        m.div_ceil(LS_RM as usize),
        32 * LS_WARPS,
        what,
    )
}

/// MoE expert GEMMs: grid (ceil(N / 4), max_tiles), block 128.
pub fn moe_gemm(n: usize, max_tiles: usize, what: &str) -> Result<Shape> {
    grid_2d(
        n.div_ceil(LIN_WARPS as usize),
        max_tiles,
        32 * LIN_WARPS,
        what,
    )
}

/// `moe_split_x` over `t` rows of `k`: one thread per (row, k16 step, lane-in-group).
pub fn moe_split(t: usize, k: usize, what: &str) -> Result<Shape> {
    grid_2d((t * k / 4).div_ceil(128), 1, 128, what)
}

/// Warps splitting K in the INT4 expert GEMMs for `rows` weight rows of `k` over `tiles`
/// real tiles, as the kernels choose it (linear.cu `w4_ks`, from moe_align's tile count):
/// the smallest power of two whose blocks reach `target` (longer walks amortize a warp's
/// start-up latency), at most `ks_hi`. The host's `ks_hi` is this with `ks_hi` =
/// `min(W4_WARPS, k / 64)` (a warp walks whole half 128-groups) at [`moe_min_tiles`], so
/// the grid covers any real tile count; small layers such as models/tiny's take the most
/// warps on K, for parallelism.
pub fn w4_ks(rows: usize, tiles: usize, ks_hi: usize, target: usize) -> usize {
    let mut ks = 1;
    while ks < ks_hi.min(w4_warps() as usize) && w4_groups(rows, ks) * tiles < target {
        ks *= 2;
    }
    ks
}

/// Row-block groups a tile of `rows` weight rows takes at K split `ks` (linear.cu
/// `w4_groups`).
pub fn w4_groups(rows: usize, ks: usize) -> usize {
    (rows / 64).div_ceil(w4_warps() as usize / ks)
}

/// Segments a [`W4Split`] holds (linear.cu `W4_SEGS`).
pub const W4_SEGS: usize = 8;
/// Largest tile-count bound a segment can hold (`bound << 3` fits an `int`).
const W4_SEG_MAX: usize = (i32::MAX >> 3) as usize;

/// The K split of the separate INT4 kernels (`moe_gate_up_w4`, `moe_down_w4`): the
/// grid's bound and the tile-count segments the kernel picks by (linear.cu `w4_split`):
/// segment `(bound << 3) | log2(ks)`, bounds ascending; the first whose bound exceeds
/// the tile count gives the split, past the last 1 way; unused segments are 0; at most
/// `ks_hi`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct W4Split {
    pub ks_hi: usize,
    pub seg: [usize; W4_SEGS],
}

impl W4Split {
    /// Segments of `ks_of`, constant between consecutive `breaks` (ascending, from 0;
    /// constant past the last): equal neighbours merged, a last 1-way segment implicit.
    fn from_breaks(ks_hi: usize, breaks: &[usize], ks_of: impl Fn(usize) -> usize) -> Self {
        let mut runs: Vec<(usize, usize)> = Vec::new(); // (bound, ks)
        for (i, &b) in breaks.iter().enumerate() {
            let bound = breaks
                .get(i + 1)
                .copied()
                .unwrap_or(W4_SEG_MAX)
                .min(W4_SEG_MAX);
            let ks = ks_of(b);
            match runs.last_mut() {
                Some(last) if last.1 == ks => last.0 = bound,
                _ => runs.push((bound, ks)),
            }
        }
        if runs.last().is_some_and(|r| r.1 == 1) {
            runs.pop();
        }
        let mut seg = [0; W4_SEGS];
        for (s, &(bound, ks)) in seg.iter_mut().zip(&runs) {
            *s = (bound << 3) | ks.trailing_zeros() as usize;
        }
        // The rules here give at most W4_SEGS runs (tested for the wave rule over rows,
        // slots and caps); more would drop the last ones, and the kernel and `ks` would
        // still agree, both reading these segments.
        debug_assert!(runs.len() <= W4_SEGS, "{} K-split segments", runs.len());
        Self { ks_hi, seg }
    }

    /// The reaching rule ([`w4_ks`] to `target`) as segments: `ks >= 2 j` exactly when
    /// `w4_groups(rows, j) * tiles < target`, i.e. `tiles < ceil(target / groups)`.
    pub fn reaching(rows: usize, ks_hi: usize, target: usize) -> Self {
        let mut breaks = vec![0];
        breaks.extend([4, 2, 1].map(|j| target.div_ceil(w4_groups(rows, j))));
        breaks.sort_unstable();
        breaks.dedup();
        Self::from_breaks(ks_hi, &breaks, |t| w4_ks(rows, t, 8, target))
    }

    /// `ks` ways whatever the tile count (at most `ks_hi`).
    pub fn forced(ks: usize, ks_hi: usize) -> Self {
        Self::from_breaks(ks_hi, &[0], |_| ks)
    }

    /// The wave rule for `rows` weight rows, `slots` blocks resident at once, at most
    /// `cap` ways (`W4_WAVE_CAP` and the K bound): [`w4_ks_waves`] as segments (each of
    /// its conditions flips at one tile count a split).
    pub fn waves(rows: usize, cap: usize, slots: usize, band: WaveBand) -> Self {
        let mut breaks = vec![0];
        for ks in [1, 2, 4] {
            let g = w4_groups(rows, ks).max(1);
            breaks.extend([
                (band.lo * slots).div_ceil(100 * g),
                band.hi * slots / (100 * g) + 1,
                (5 * slots).div_ceil(2 * g),
                slots / g + 1,
                (3 * slots).div_ceil(2 * g),
                slots.div_ceil(2 * g),
            ]);
        }
        breaks.sort_unstable();
        breaks.dedup();
        Self::from_breaks(cap, &breaks, |t| w4_ks_waves(rows, t, cap, slots, band))
    }

    /// The kernel's split for `tiles` real tiles (linear.cu `w4_split`).
    pub fn ks(&self, tiles: usize) -> usize {
        let ks = self
            .seg
            .iter()
            .find(|&&s| tiles < s >> 3)
            .map_or(1, |&s| 1 << (s & 7));
        ks.min(self.ks_hi)
    }

    /// The largest split of any tile count in `lo..=hi`.
    pub fn max_over(&self, lo: usize, hi: usize) -> usize {
        let mut ks = self.ks(lo).max(self.ks(hi));
        for &s in self.seg.iter().filter(|&&s| s > 0) {
            if (lo..=hi).contains(&(s >> 3)) {
                ks = ks.max(self.ks(s >> 3));
            }
        }
        ks
    }
}

/// Most ways the wave rule splits K: 8 never measured faster at GLM-5.3-Flash shapes
/// (`runs/ab-210cbc4/`, every M and routing: M = 1 46.3 against 39.4 us at 4).
pub const W4_WAVE_CAP: usize = 4;

/// The wave rule (fitted on the `SPECLAB_W4_KS` sweep of `runs/ab-210cbc4/`, GLM-5.3-Flash
/// shapes on the H200): of the splits up to `cap`, the largest whose items (row-block
/// groups x `tiles`) fill one wave of `slots` resident blocks within `band` (70-100%,
/// [`WaveBand::EXACT`]; 65-100% for bf16 activations, [`WaveBand::A16`]); else the
/// smallest whose items reach 2.5 waves (dynamic scheduling then evens out tiles of
/// unequal cost, such as the unpacked tiles of skewed routing); else, where `cap`'s
/// items would leave a second wave less than half full (1 to 1.5 waves), the largest
/// split whose items fill one wave at least half; else `cap`. A partial second wave is
/// what it avoids: zipf M = 8 (35.5 tiles) took 193.6 us at the reaching rule's whole-K
/// walks (1.08 waves) and 162.7 at 4 ways (4.3 waves). The half-wave step takes 9-11
/// tiles to 2 ways (55-67% of a wave) where `cap` 4 made 1.1-1.3 waves: sequence M = 2's
/// 10- and 11-tile draws, on an H100 72.1 against 67.0 us with exact activations and
/// 69.0 against 65.5 with bf16 (`runs/moe-band-b00b353/`), and on the H200 sweep 61.2 us
/// with every draw at 2 ways against 65.7 at 4 (`runs/ab-210cbc4/`).
pub fn w4_ks_waves(rows: usize, tiles: usize, cap: usize, slots: usize, band: WaveBand) -> usize {
    let cap = cap.max(1);
    let cands = [1, 2, 4, 8].into_iter().filter(|&k| k <= cap);
    let items = |k: usize| w4_groups(rows, k) * tiles;
    let fill = |k: usize| band.holds(items(k), slots);
    if let Some(k) = cands.clone().rev().find(|&k| fill(k)) {
        return k;
    }
    if let Some(k) = cands.clone().find(|&k| 2 * items(k) >= 5 * slots) {
        return k;
    }
    let top = cands.clone().next_back().unwrap_or(1);
    if items(top) > slots && 2 * items(top) < 3 * slots {
        let half_wave = |&k: &usize| items(k) <= slots && 2 * items(k) >= slots;
        if let Some(k) = cands.clone().rev().find(half_wave) {
            return k;
        }
    }
    top
}

/// The largest K split of `k`: `min(w4_warps(), k / 64)`, a power of two as the warps are.
pub fn w4_ks_max(k: usize) -> usize {
    let mut ks = 1;
    while 2 * ks <= (w4_warps() as usize).min(k / 64) {
        ks *= 2;
    }
    ks
}

/// What an INT4 expert GEMM launch knows about its tiles.
#[derive(Debug, Clone, Copy)]
pub struct W4Tiles {
    /// The grid's tiles (`moe_max_tiles`).
    pub max: usize,
    /// A lower bound of the real ones ([`moe_min_tiles`]).
    pub min: usize,
    /// Target real blocks ([`w4_target_blocks`]).
    pub target: usize,
    /// A forced K split ([`w4_ks_forced`]) in place of the rules.
    pub forced: Option<usize>,
    /// The wave rule's resident blocks (`Gpu::w4_slots`) and band (`Gpu::w4_band`);
    /// `None`: the reaching rule.
    pub waves: Option<(usize, WaveBand)>,
}

/// INT4 expert GEMMs (`moe_gate_up_w4` with `nmat` 2, `moe_down_w4` with 1) over
/// `n * nmat` weight rows of `k` weights: row blocks of 64 rows, `W4_WARPS / ks` of them a
/// block for the kernels' K split `ks <= ks_hi` (returned beside the shape as a
/// [`W4Split`], the kernels' arguments), a 1-D grid of max_tiles x ceil(row blocks /
/// (W4_WARPS / ks_hi)) items (those past the real tiles exit), block 32 W4_WARPS, dynamic
/// shared memory [`W4_SMEM`]. Needs K % 128 == 0 and `n * nmat` % 64 == 0 (the repacked
/// layout).
pub fn moe_w4(
    n: usize,
    k: usize,
    nmat: usize,
    t: &W4Tiles,
    what: &str,
) -> Result<(Shape, W4Split)> {
    let max_tiles = t.max;
    if k == 0
        || !k.is_multiple_of(128)
        || n == 0
        || !(1..=2).contains(&nmat)
        || !(n * nmat).is_multiple_of(64)
    {
        return Err(CudaError::Unsupported(format!(
            "{what}: INT4 expert GEMM with N = {n}, K = {k}, {nmat} matrices (needs K % 128 == 0, N x matrices % 64 == 0)"
        )));
    }
    let split = match (t.forced, t.waves) {
        (Some(ks), _) => W4Split::forced(ks, ks.min(w4_ks_max(k))),
        (None, Some((slots, band))) => {
            let w = W4Split::waves(n * nmat, W4_WAVE_CAP.min(w4_ks_max(k)), slots, band);
            W4Split {
                ks_hi: w.max_over(t.min.min(max_tiles), max_tiles),
                ..w
            }
        }
        (None, None) => {
            let ks_hi = w4_ks(n * nmat, t.min.min(max_tiles), w4_ks_max(k), t.target);
            W4Split::reaching(n * nmat, ks_hi, t.target)
        }
    };
    let per_block = w4_warps() as usize / split.ks_hi;
    let mut s = grid_2d(
        (n * nmat / 64).div_ceil(per_block) * max_tiles,
        1,
        32 * w4_warps(),
        what,
    )?;
    s.smem = w4_smem();
    Ok((s, split))
}

/// One block of `block` threads per row.
pub fn per_row(rows: usize, block: u32, what: &str) -> Result<Shape> {
    grid_2d(rows, 1, block, what)
}

/// One warp per item, 4 warps a block.
pub fn per_warp(items: usize, what: &str) -> Result<Shape> {
    grid_2d(items.div_ceil(4), 1, 128, what)
}

/// Upper bound of the tiles `moe_align` produces for `p` routed pairs over `e` experts:
/// each non-empty expert pads its segment by at most 7 rows, and at most min(e, p)
/// experts are non-empty: ceil((p + min(e, p) * 7) / 8).
pub fn moe_max_tiles(p: usize, e: usize) -> usize {
    let t = ROWS_PER_TILE as usize;
    (p + e.min(p) * (t - 1)).div_ceil(t)
}

/// The host model of `moe_align` (moe.cu `align_tiles`) for the pair ids `ids` (`ids[p]`
/// the expert of pair p, `< e`): `sorted` [8 max_tiles] holds the pairs of expert 0, then
/// expert 1, ..., ascending p within an expert, each expert's segment padded with -1 to a
/// multiple of 8; `tile_expert` [max_tiles + 1] the expert of each used tile, -1 past the
/// last, and at `max_tiles` the number of tiles used. `max_tiles` must cover the pairs
/// ([`moe_max_tiles`]); O(e p), for checks.
pub fn moe_align_model(ids: &[i32], e: usize, max_tiles: usize) -> (Vec<i32>, Vec<i32>) {
    let t = ROWS_PER_TILE as usize;
    let mut sorted = vec![-1; t * max_tiles];
    let mut tiles = vec![-1; max_tiles + 1];
    let mut pos = 0;
    for ex in 0..e {
        let ps: Vec<usize> = (0..ids.len())
            .filter(|&p| usize::try_from(ids[p]).ok() == Some(ex))
            .collect();
        for (j, &p) in ps.iter().enumerate() {
            sorted[pos + j] = p as i32;
        }
        let nt = ps.len().div_ceil(t);
        tiles[pos / t..pos / t + nt].fill(ex as i32);
        pos += nt * t;
    }
    tiles[max_tiles] = (pos / t) as i32;
    (sorted, tiles)
}

/// The tiles `moe_align` actually uses for per-expert counts `counts` (the host model).
pub fn moe_tiles_used(counts: &[usize]) -> usize {
    let t = ROWS_PER_TILE as usize;
    counts.iter().map(|c| c.div_ceil(t)).sum()
}

/// Of [`moe_tiles_used`], the tiles whose pairs do not pack into one mma's columns
/// (`pairs * xs > 8`, `linear.cu` `w4_mma`: such a tile takes `xs` mmas and B loads a k16
/// step): every full tile, and a partial one of more than `8 / xs` pairs.
pub fn moe_tiles_unpacked(counts: &[usize], xs: usize) -> usize {
    let t = ROWS_PER_TILE as usize;
    counts
        .iter()
        .map(|&c| c / t * usize::from(t * xs > t) + usize::from(c % t > 0 && (c % t) * xs > t))
        .sum()
}

/// Checks of a GEMM's operands: K a multiple of 8 (16-byte bf16 loads, one INT4 word per
/// lane), the activation stride and column offset multiples of 4 floats (16-byte loads).
pub fn check_gemm_operands(k: usize, x_stride: usize, x_col: usize, what: &str) -> Result<()> {
    if k == 0
        || !k.is_multiple_of(8)
        || !x_stride.is_multiple_of(4)
        || !x_col.is_multiple_of(4)
        || x_stride < x_col + k
    {
        return Err(CudaError::Unsupported(format!(
            "{what}: GEMM with K = {k}, activation stride {x_stride}, column {x_col} (needs K % 8 == 0, stride and column % 4 == 0, column + K <= stride)"
        )));
    }
    Ok(())
}

/// Round `x` up to a multiple of `m`.
pub fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::SOURCES;

    #[test]
    fn unpacked_tiles_are_full_tiles_and_partials_past_eight_over_xs() {
        // xs 3: a partial tile of 1 or 2 pairs packs, 3..7 does not; full tiles never do.
        assert_eq!(
            moe_tiles_unpacked(&[1, 2, 3, 7, 8, 9, 11, 0], 3),
            1 + 1 + 1 + 1 + 2
        );
        // xs 2: up to 4 pairs pack.
        assert_eq!(moe_tiles_unpacked(&[4, 5, 16], 2), 1 + 2);
        // xs 1 (bf16 activations): every tile of at most 8 pairs packs.
        assert_eq!(moe_tiles_unpacked(&[1, 7, 8, 16, 23], 1), 0);
        assert!(moe_tiles_unpacked(&[5, 9], 3) <= moe_tiles_used(&[5, 9]));
    }

    #[test]
    fn tiled_switch_and_shape() {
        assert_eq!(skinny_max_rows(None).unwrap(), SKINNY_MAX_ROWS);
        assert_eq!(skinny_max_rows(Some("off")).unwrap(), 0);
        assert_eq!(skinny_max_rows(Some(" 8 ")).unwrap(), 8);
        for bad in ["0", "-1", "four", ""] {
            let e = skinny_max_rows(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains(SKINNY_MAX_ENV) && e.contains(&format!("`{bad}`")),
                "{e}"
            );
        }
        assert_eq!(gemm_skinny(1, 288, "t").unwrap().grid, (18, 1, 1));
        assert_eq!(gemm_skinny(5, 4096, "t").unwrap().grid, (256, 2, 1));
        assert_eq!(gemm_skinny(1, 17, "t").unwrap().block, (256, 1, 1));
        assert_eq!(tiled_min_rows(None).unwrap(), TILED_MIN_ROWS);
        assert_eq!(tiled_min_rows(Some("off")).unwrap(), usize::MAX);
        assert_eq!(tiled_min_rows(Some(" 33 ")).unwrap(), 33);
        for bad in ["x", "0", "-1"] {
            let e = tiled_min_rows(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(TILED_MIN_ENV) && e.contains("at least 1"), "{e}");
        }
        let s = gemm_tiled(17, 8196, "t").unwrap();
        assert_eq!((s.grid, s.block), ((513, 2, 1), (256, 1, 1)));
    }

    fn define(name: &str) -> Option<usize> {
        let prelude = [crate::kernels::PRELUDE];
        let texts = SOURCES.iter().map(|s| s.source).chain(prelude);
        texts.into_iter().find_map(|src| {
            src.lines().find_map(|l| {
                let rest = l.strip_prefix("#define ")?;
                let mut it = rest.split_whitespace();
                (it.next()? == name).then(|| it.next()?.parse().ok())?
            })
        })
    }

    #[test]
    fn align_model_sorts_pads_and_counts_tiles() {
        // Pairs 0..6: experts 2, 0, 2, 2, 1, 0 (E = 3): one tile an expert, ascending p.
        let ids = [2, 0, 2, 2, 1, 0];
        let mt = moe_max_tiles(ids.len(), 3);
        let (sorted, tiles) = moe_align_model(&ids, 3, mt);
        assert_eq!(&sorted[..8], &[1, 5, -1, -1, -1, -1, -1, -1]);
        assert_eq!(&sorted[8..16], &[4, -1, -1, -1, -1, -1, -1, -1]);
        assert_eq!(&sorted[16..24], &[0, 2, 3, -1, -1, -1, -1, -1]);
        assert_eq!(&tiles[..3], &[0, 1, 2]);
        assert!(tiles[3..mt].iter().all(|&t| t == -1));
        assert_eq!(tiles[mt], 3);
        // 9 pairs of expert 1 (E = 2): two tiles, the second padded.
        let ids = [1; 9];
        let (sorted, tiles) = moe_align_model(&ids, 2, moe_max_tiles(9, 2));
        assert_eq!(&sorted[..10], &[0, 1, 2, 3, 4, 5, 6, 7, 8, -1]);
        assert_eq!((tiles[0], tiles[1], *tiles.last().unwrap()), (1, 1, 2));
        assert_eq!(tiles.last().copied(), Some(moe_tiles_used(&[0, 9]) as i32));
    }

    #[test]
    fn constants_mirror_the_kernels() {
        assert_eq!(define("LIN_WARPS"), Some(LIN_WARPS as usize));
        assert_eq!(define("ROWS_PER_TILE"), Some(ROWS_PER_TILE as usize));
        assert_eq!(define("LT_RM"), Some(LT_RM as usize));
        assert_eq!(define("LT_RN"), Some(LT_RN as usize));
        assert_eq!(define("LT_WR"), Some(LT_WR as usize));
        assert_eq!(define("LT_WC"), Some(LT_WC as usize));
        assert_eq!(define("LS_RM"), Some(LS_RM as usize));
        assert_eq!(define("LS_RN"), Some(LS_RN as usize));
        assert_eq!(define("LS_WARPS"), Some(LS_WARPS as usize));
        assert_eq!(define("MOE_TILE"), Some(ROWS_PER_TILE as usize));
        assert_eq!(define("TOPK_MAX"), Some(TOPK_MAX));
        assert_eq!(define("W4_RT"), Some(W4_RT as usize));
        assert_eq!(define("W4_WARPS"), Some(W4_WARPS as usize));
        assert!(define("W4_XS").unwrap() <= W4_XS_MAX);
        assert_eq!(define("W4_STAGES"), Some(W4_STAGES as usize));
        assert_eq!(define("W4_SLOT"), Some(W4_SLOT as usize));
        assert_eq!(define("W4_SEGS"), Some(W4_SEGS));
        assert_eq!(W4_SMEM, 73_728);
        assert_eq!(2 * w4_smem_with(4, 2), W4_SMEM);
        assert_eq!(define("W4_BSLOT"), Some(W4_BSLOT as usize));
        // Six bulk stages of eight warps still leave two blocks an SM (228 KB an SM on
        // sm_90, 1 KB of it reserved a block), and two hold the accumulators they overlay.
        const { assert!(2 * (w4_smem_bulk(8, 6) + 1024) <= 228 * 1024) };
        const { assert!(2 * W4_BSLOT * 16 >= 2 * W4_RT * 4 * 32 * 4) };
        assert_eq!(define("EXPERTS_MAX"), Some(EXPERTS_MAX));
        assert_eq!(define("HEAD_DIM_MAX"), Some(HEAD_DIM_MAX));
        assert_eq!(define("KC_MAX"), Some(KC_MAX));
    }

    #[test]
    fn moe_tile_bound_holds_for_every_assignment() {
        // Exhaustive over small (p, e) with a deterministic spread of assignments.
        for e in 1..=12usize {
            for p in 1..=40usize {
                for seed in 0..50usize {
                    let mut counts = vec![0usize; e];
                    for i in 0..p {
                        counts[(i * 7 + seed * 13 + i * i * seed) % e] += 1;
                    }
                    assert!(
                        moe_tiles_used(&counts) <= moe_max_tiles(p, e),
                        "p {p} e {e}"
                    );
                }
                // Worst case: as many experts as possible with one pair each.
                let mut counts = vec![0usize; e];
                for i in 0..p {
                    counts[i % e] += 1;
                }
                assert!(moe_tiles_used(&counts) <= moe_max_tiles(p, e));
            }
        }
        assert_eq!(moe_max_tiles(1, 288), 1);
        assert_eq!(moe_max_tiles(8, 288), 8);
        assert_eq!(moe_max_tiles(64 * 8, 288), (512 + 288 * 7usize).div_ceil(8));
    }

    /// Model of kernel `w4_mma`'s walk for `ntiles` real tiles: the kernel's K split
    /// `ks = split.ks(ntiles)` (linear.cu `w4_split`); block b < ntiles xneed is tile
    /// b / xneed, group bx = b % xneed; warp w owns row block `bx (W4_WARPS / ks) + w / ks`
    /// (real when below `rows / 64`) and half groups `[kw G / ks, (kw + 1) G / ks)` with
    /// `kw = w % ks`, `G = k / 64`. Counts each (tile, row block, half group); also returns
    /// the blocks the kernel needs.
    fn w4_owned(rows: usize, k: usize, ntiles: usize, split: &W4Split) -> (Vec<u8>, usize) {
        let (groups, nrb) = (k / 64, rows / 64);
        let ks = split.ks(ntiles);
        let per = w4_warps() as usize / ks;
        let xneed = nrb.div_ceil(per);
        let mut owned = vec![0u8; ntiles * nrb * groups];
        for b in 0..ntiles * xneed {
            let (tile, bx) = (b / xneed, b % xneed);
            for w in 0..w4_warps() as usize {
                let (kw, rb) = (w % ks, bx * per + w / ks);
                if rb < nrb {
                    for grp in kw * groups / ks..(kw + 1) * groups / ks {
                        owned[(tile * nrb + rb) * groups + grp] += 1;
                    }
                }
            }
        }
        (owned, ntiles * xneed)
    }

    #[test]
    fn wave_band_follows_the_activations_and_parses() {
        assert_eq!(WaveBand::for_xs(3, None).unwrap(), WaveBand::EXACT);
        assert_eq!(WaveBand::for_xs(2, None).unwrap(), WaveBand::EXACT);
        assert_eq!(WaveBand::for_xs(1, None).unwrap(), WaveBand::A16);
        assert_eq!(
            WaveBand::for_xs(3, Some(" 60, 110 ")).unwrap(),
            WaveBand { lo: 60, hi: 110 }
        );
        for bad in ["", "70", "x,1", "0,100", "90,80", "70,401", "70,100,3"] {
            let e = WaveBand::parse(bad).unwrap_err().to_string();
            assert!(e.contains(W4_BAND_ENV) && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn w4_blocks_cover_every_row_block_and_half_group_once() {
        let tl = |max, min| W4Tiles {
            max,
            min,
            target: W4_TARGET_BLOCKS,
            forced: None,
            waves: None,
        };
        assert_eq!(parse_w4_target(" 512").unwrap(), 512);
        assert!(opt_in(Some("1")) && opt_in(Some(" 1")));
        assert!(!opt_in(None) && !opt_in(Some("0")));
        for bad in ["0", "x", "-3", "70000", ""] {
            let e = parse_w4_target(bad).unwrap_err().to_string();
            assert!(e.contains(W4_TARGET_ENV) && e.contains("1 to 65536"), "{e}");
        }
        assert_eq!(moe_min_tiles(1, 8), 8);
        assert_eq!(moe_min_tiles(16, 8), 16);
        assert_eq!(moe_min_tiles(3, 2), 2);
        assert_eq!(w4_ks_max(4096), 8);
        assert_eq!(w4_ks_max(384), 4);
        assert_eq!(w4_ks_max(128), 2);
        // GLM-5.3-Flash M = 1 (8 tiles): K split 4 ways, 256 blocks (one wave at 2 a SM);
        // 106 real tiles (M = 16 uniform): whole-K walks; models/tiny: the most warps on K.
        assert_eq!(w4_ks(4096, 8, 8, 256), 4);
        assert_eq!(w4_ks(4096, 8, 8, 512), 8);
        assert_eq!(w4_ks(4096, 106, 8, 256), 1);
        assert_eq!(w4_ks(256, 2, 4, 256), 4);
        let (s, ks) = moe_w4(2048, 4096, 2, &tl(8, 8), "t").unwrap();
        assert_eq!((s.grid, ks.ks_hi, ks.ks(8)), ((256, 1, 1), 4, 4));
        // M = 16: at least 16 tiles, so ks_hi = 2, over the 128-tile bound.
        let (s, ks) = moe_w4(4096, 2048, 1, &tl(128, 16), "t").unwrap();
        assert_eq!(
            (s.grid, ks.ks_hi, ks.ks(16), ks.ks(106)),
            ((16 * 128, 1, 1), 2, 2, 1)
        );
        let (s, ks) = moe_w4(256, 128, 1, &tl(3, 2), "t").unwrap();
        assert_eq!(
            (s.grid, s.block, s.smem, ks.ks_hi),
            ((3, 1, 1), (256, 1, 1), W4_SMEM, 2)
        );
        // A forced split: whatever the tiles, at most k / 64 ways; the grid follows it.
        let forced = |ks| W4Tiles {
            forced: Some(ks),
            ..tl(128, 16)
        };
        let (s, ks) = moe_w4(4096, 2048, 1, &forced(8), "t").unwrap();
        assert_eq!((s.grid.0, ks.ks(1), ks.ks(128)), (64 * 128, 8, 8));
        let (s, ks) = moe_w4(256, 128, 1, &forced(8), "t").unwrap();
        assert_eq!((s.grid.0, ks.ks(1)), (128, 2));
        let (_, ks) = moe_w4(4096, 2048, 1, &forced(1), "t").unwrap();
        assert_eq!((ks.ks(1), ks.ks(500)), (1, 1));
        for (v, want) in [
            ("1", Some(1)),
            (" 8", Some(8)),
            ("3", None),
            ("16", None),
            ("", None),
        ] {
            assert_eq!(parse_w4_ks(v).ok(), want, "{v:?}");
        }
        let e = parse_w4_ks("0").unwrap_err().to_string();
        assert!(e.contains(W4_KS_ENV) && e.contains("1, 2, 4 or 8"), "{e}");
        assert_eq!(gemm(5, 8, "x").unwrap().smem, 0);
        // T K / 16 steps x 4 lanes-in-group, 128 threads a block.
        assert_eq!(moe_split(3, 256, "t").unwrap().grid, (2, 1, 1));
        assert_eq!(moe_split(64, 4096, "t").unwrap().grid, (512, 1, 1));
        for k in [128usize, 256, 384, 640, 1152, 2048, 4096] {
            for (n, nmat) in [(32, 2), (64, 1), (96, 2), (192, 1), (2048, 2), (4096, 1)] {
                for (max, min) in [(1, 1), (8, 8), (300, 8), (40, 20)] {
                    let rules = [None, Some(1), Some(2), Some(4), Some(8)]
                        .map(|f| (f, None))
                        .into_iter()
                        .chain(
                            [
                                (264, WaveBand::EXACT),
                                (132, WaveBand::A16),
                                (7, WaveBand::EXACT),
                            ]
                            .map(|w| (None, Some(w))),
                        );
                    for (f, slots) in rules {
                        let t = W4Tiles {
                            forced: f,
                            waves: slots,
                            ..tl(max, min)
                        };
                        let (s, split) = moe_w4(n, k, nmat, &t, "t").unwrap();
                        let ks_hi = split.ks_hi;
                        assert!(ks_hi.is_power_of_two() && ks_hi <= w4_ks_max(k));
                        for ntiles in [min, (min + max) / 2, max] {
                            let (owned, blocks) = w4_owned(n * nmat, k, ntiles, &split);
                            let at =
                                format!("n {n} k {k} nmat {nmat} tiles {ntiles} {f:?} {slots:?}");
                            assert!(blocks <= s.grid.0 as usize, "{at}");
                            assert!(owned.iter().all(|&c| c == 1), "{at}");
                        }
                    }
                }
            }
        }
        assert!(moe_w4(2048, 4000, 2, &tl(1, 1), "t").is_err());
        assert!(moe_w4(2044, 4096, 2, &tl(1, 1), "t").is_err());
        assert!(moe_w4(96, 4096, 1, &tl(1, 1), "t").is_err());
        assert!(moe_w4(2048, 4096, 3, &tl(1, 1), "t").is_err());
    }

    #[test]
    fn split_thresholds_reproduce_the_reaching_rule() {
        for rows in [64usize, 128, 192, 256, 512, 4096] {
            for target in [1usize, 7, 100, 256, 264, 1024] {
                for ks_hi in [1usize, 2, 4, 8] {
                    let split = W4Split::reaching(rows, ks_hi, target);
                    for tiles in 1..600 {
                        assert_eq!(
                            split.ks(tiles),
                            w4_ks(rows, tiles, ks_hi, target),
                            "rows {rows} target {target} ks_hi {ks_hi} tiles {tiles}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn wave_rule_segments_reproduce_the_rule() {
        // GLM-5.3-Flash (64 row blocks), 264 slots: one well-filled wave (8 tiles at 4
        // ways, 13-16 at 2, 31 whole-K), else the first split past 2.5 waves (21 and 37
        // tiles at 4, 60 at 2, 100 whole-K), as the sweep of runs/ab-210cbc4 measured
        // (the half-wave step, below, only where 4 ways make 1-1.5 waves).
        let glm = |t| w4_ks_waves(4096, t, 4, 264, WaveBand::EXACT);
        let got: Vec<usize> = [8, 13, 16, 21, 31, 37, 60, 100, 400].map(glm).to_vec();
        assert_eq!(got, [4, 2, 2, 4, 1, 4, 2, 1, 1]);
        // models/tiny's shapes (4 row blocks): below 93 tiles (its decode steps have at
        // most 48, 128 rows x top-2) never a filled wave, so the cap, which is what the
        // reaching rule gives them too (their blocks do not reach 256).
        for t in 1..93 {
            assert_eq!(w4_ks_waves(256, t, 4, 264, WaveBand::EXACT), 4);
            // Its down projection (K 128: at most 2 ways) likewise.
            assert_eq!(w4_ks_waves(256, t, 2, 264, WaveBand::EXACT), 2);
            assert_eq!(
                w4_ks_waves(256, t, 4, 264, WaveBand::A16),
                w4_ks(256, t, 4, W4_TARGET_BLOCKS)
            );
        }
        // bf16 activations: 10-13 tiles at 2 ways (61-79% of a wave; 10 by the half-wave
        // step), 17 at 4 (2 ways is 103%), 21 at 4 (whole-K is 64%); exact: 11 at 2 (the
        // half-wave step), 17 and 34 at 4 (2 ways and whole-K are 103%).
        let a16 = |t| w4_ks_waves(4096, t, 4, 264, WaveBand::A16);
        assert_eq!([8, 10, 11, 13, 17, 21].map(a16), [4, 2, 2, 2, 4, 4]);
        assert_eq!([11, 17, 34].map(glm), [2, 4, 4]);
        // The half-wave step: 9-12 tiles at 4 ways make 1.09-1.45 waves, so 2 ways (144-192
        // items, 55-73%); 13 at 4 ways is 1.58 waves, in band at 2 anyway; 18-20 at 4
        // ways make 2.18-2.42 waves and keep them (whole-K would be 55-61%).
        for band in [WaveBand::EXACT, WaveBand::A16] {
            let ks = |t| w4_ks_waves(4096, t, 4, 264, band);
            assert_eq!([9, 10, 11, 12].map(ks), [2, 2, 2, 2], "{band:?}");
            assert_eq!([18, 19, 20].map(ks), [4, 4, 4], "{band:?}");
        }
        let bands = [WaveBand::EXACT, WaveBand::A16, WaveBand { lo: 1, hi: 400 }];
        for (rows, band) in [64usize, 256, 512, 2048, 4096, 8192]
            .into_iter()
            .flat_map(|r| bands.map(|b| (r, b)))
        {
            for slots in [7usize, 132, 264, 528] {
                for cap in [1usize, 2, 4] {
                    let split = W4Split::waves(rows, cap, slots, band);
                    for t in 0..3000 {
                        let at = format!("rows {rows} slots {slots} cap {cap} tiles {t} {band:?}");
                        assert_eq!(split.ks(t), w4_ks_waves(rows, t, cap, slots, band), "{at}");
                    }
                    for (lo, hi) in [(0, 5), (8, 8), (8, 300), (17, 90), (1, 2999)] {
                        let want = (lo..=hi).map(|t| split.ks(t)).max().unwrap();
                        assert_eq!(
                            split.max_over(lo, hi),
                            want,
                            "{rows} {slots} {cap} {lo}..{hi} {band:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn shapes_and_checks() {
        let s = gemm(5, 8200, "lm_head").unwrap();
        assert_eq!(s.grid, (2050, 1, 1));
        assert_eq!(s.block, (128, 1, 1));
        assert_eq!(gemm(17, 256, "x").unwrap().grid, (64, 3, 1));
        assert!(gemm(0, 4, "x").is_err());
        assert!(grid_2d(1, 70_000, 128, "x").is_err());
        assert!(check_gemm_operands(64, 904, 768, "kda f_b").is_ok());
        assert!(check_gemm_operands(256, 900, 768, "x").is_err());
        assert!(check_gemm_operands(12, 16, 0, "x").is_err());
        assert!(check_gemm_operands(64, 258, 192, "x").is_err());
        assert_eq!(round_up(258, 8), 264);
        assert_eq!(per_warp(9, "x").unwrap().grid, (3, 1, 1));
    }
}
