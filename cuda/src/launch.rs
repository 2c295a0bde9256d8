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
/// Weight rows a lane group of the INT4 expert GEMMs streams per batch (`W4_U`).
pub const W4_U: u32 = 4;
/// Tokens whose activations an INT4 expert GEMM lane holds in registers (`W4_TS`).
pub const W4_TS: u32 = 2;
/// Threads per block of the INT4 expert GEMMs (`W4_BLOCK`).
pub const W4_BLOCK: u32 = 128;
/// Blocks an INT4 expert GEMM launch aims at (about 4 resident per SM on the H200's 132
/// SMs): fewer batches per block until the grid reaches it, so small M still fills the GPU.
pub const W4_TARGET_BLOCKS: usize = 512;
/// Most batches one lane group walks (bounds a block's serial work at large M).
pub const W4_MAX_BATCHES: usize = 16;
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
}

impl Shape {
    /// As cudarc's config.
    pub fn cfg(self) -> cudarc::driver::LaunchConfig {
        cudarc::driver::LaunchConfig {
            grid_dim: self.grid,
            block_dim: self.block,
            shared_mem_bytes: 0,
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

/// MoE expert GEMMs: grid (ceil(N / 4), max_tiles), block 128.
pub fn moe_gemm(n: usize, max_tiles: usize, what: &str) -> Result<Shape> {
    grid_2d(
        n.div_ceil(LIN_WARPS as usize),
        max_tiles,
        32 * LIN_WARPS,
        what,
    )
}

/// Lanes per group of the INT4 expert GEMMs for rows of `k` weights (kernel `w4_lanes`):
/// the largest power of two `<= min(128, k / 32)` (a row has `k / 32` 16-byte chunks).
pub fn w4_lanes(k: usize) -> usize {
    let chunks = k / 32;
    let mut l = 1;
    while l < W4_BLOCK as usize && 2 * l <= chunks {
        l *= 2;
    }
    l
}

/// Batches of `W4_U` rows each lane group of a block walks (kernel `w4_gemv` derives the
/// same from `gridDim.x`): the largest power of two `<= W4_MAX_BATCHES` that still gives
/// `W4_TARGET_BLOCKS` blocks over `max_tiles` tiles, at least 1.
pub fn w4_batches(rows: usize, k: usize, max_tiles: usize) -> usize {
    let groups = W4_BLOCK as usize / w4_lanes(k);
    let slots = rows / W4_U as usize;
    let mut nb = 1;
    while 2 * nb <= W4_MAX_BATCHES
        && slots.div_ceil(groups * 2 * nb) * max_tiles >= W4_TARGET_BLOCKS
    {
        nb *= 2;
    }
    nb
}

/// INT4 expert GEMMs (`moe_gate_up_w4` with `nmat` 2, `moe_down_w4` with 1) over
/// `n * nmat` weight rows of `k` weights: grid (ceil(slots / (groups * nb)), max_tiles,
/// ROWS_PER_TILE token groups), block 128. Needs K % 128 == 0 (one scale per 16-byte chunk) and N % 8 == 0 (a batch of
/// `W4_U` rows is all real or all past the end).
pub fn moe_w4(n: usize, k: usize, nmat: usize, max_tiles: usize, what: &str) -> Result<Shape> {
    if k == 0
        || !k.is_multiple_of(128)
        || n == 0
        || !n.is_multiple_of(8)
        || !(1..=2).contains(&nmat)
    {
        return Err(CudaError::Unsupported(format!(
            "{what}: INT4 expert GEMM with N = {n}, K = {k} (needs K % 128 == 0, N % 8 == 0)"
        )));
    }
    let rows = n * nmat;
    let groups = W4_BLOCK as usize / w4_lanes(k);
    let nb = w4_batches(rows, k, max_tiles);
    let mut s = grid_2d(
        (rows / W4_U as usize).div_ceil(groups * nb),
        max_tiles,
        W4_BLOCK,
        what,
    )?;
    // z: the tile's token groups (ROWS_PER_TILE / W4_TS of them do work; the rest exit).
    s.grid.2 = ROWS_PER_TILE;
    Ok(s)
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

/// The tiles `moe_align` actually uses for per-expert counts `counts` (the host model).
pub fn moe_tiles_used(counts: &[usize]) -> usize {
    let t = ROWS_PER_TILE as usize;
    counts.iter().map(|c| c.div_ceil(t)).sum()
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

    fn define(name: &str) -> Option<usize> {
        SOURCES.iter().find_map(|s| {
            s.source.lines().find_map(|l| {
                let rest = l.strip_prefix("#define ")?;
                let mut it = rest.split_whitespace();
                (it.next()? == name).then(|| it.next()?.parse().ok())?
            })
        })
    }

    #[test]
    fn constants_mirror_the_kernels() {
        assert_eq!(define("LIN_WARPS"), Some(LIN_WARPS as usize));
        assert_eq!(define("ROWS_PER_TILE"), Some(ROWS_PER_TILE as usize));
        assert_eq!(define("MOE_TILE"), Some(ROWS_PER_TILE as usize));
        assert_eq!(define("TOPK_MAX"), Some(TOPK_MAX));
        assert_eq!(define("W4_U"), Some(W4_U as usize));
        assert_eq!(define("W4_TS"), Some(W4_TS as usize));
        assert_eq!(define("W4_BLOCK"), Some(W4_BLOCK as usize));
        assert_eq!(define("W4_MAX_BATCHES"), Some(W4_MAX_BATCHES));
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

    /// Model of kernel `w4_gemv`'s walk: `nb` from the grid as the kernel derives it, then
    /// slot `(bx * nb + b) * G + g` of block `bx`, batch `b`, group `g` (real when below
    /// `rows / W4_U`). Returns how often each row is owned.
    fn w4_rows_owned(rows: usize, k: usize, grid_x: usize) -> Vec<u8> {
        let groups = W4_BLOCK as usize / w4_lanes(k);
        let slots = rows / W4_U as usize;
        let nb = slots.div_ceil(groups * grid_x);
        // The kernel's shared partials hold W4_MAX_BATCHES batches.
        assert!(nb <= W4_MAX_BATCHES, "rows {rows} k {k}: nb {nb}");
        let mut owned = vec![0u8; rows];
        for bx in 0..grid_x {
            for b in 0..nb {
                for g in 0..groups {
                    let slot = (bx * nb + b) * groups + g;
                    if slot < slots {
                        let r0 = slot * W4_U as usize;
                        owned[r0..r0 + W4_U as usize]
                            .iter_mut()
                            .for_each(|o| *o += 1);
                    }
                }
            }
        }
        owned
    }

    #[test]
    fn w4_blocks_cover_every_row_once() {
        // GLM-5.3-Flash: a group of 128 lanes for K = 4096 (one chunk a lane), 64 for
        // K = 2048; models/tiny: 8 / 4 lanes.
        assert_eq!(w4_lanes(4096), 128);
        assert_eq!(w4_lanes(2048), 64);
        assert_eq!(w4_lanes(256), 8);
        assert_eq!(w4_lanes(128), 4);
        assert_eq!(w4_lanes(384), 8);
        assert_eq!(w4_lanes(8192), 128);
        // M = 1 at GLM shapes: 8 tiles x 64 blocks, 16 batches of 4 rows a block.
        assert_eq!(moe_w4(2048, 4096, 2, 8, "t").unwrap().grid, (64, 8, 8));
        assert_eq!(moe_w4(4096, 2048, 1, 8, "t").unwrap().grid, (64, 8, 8));
        assert_eq!(w4_batches(4096, 4096, 8), 16);
        assert_eq!(w4_batches(4096, 2048, 8), 8);
        // models/tiny decode (2 tiles): one batch a group.
        assert_eq!(w4_batches(256, 256, 2), 1);
        for k in (128..=8192).step_by(128) {
            let l = w4_lanes(k);
            assert!(l.is_power_of_two() && l <= 128 && l <= k / 32, "k {k}");
            assert!(l == 128 || 2 * l > k / 32, "k {k}: not the largest");
            for nmat in [1, 2] {
                for n in (8..=600).step_by(8) {
                    for tiles in [1, 3, 40] {
                        let s = moe_w4(n, k, nmat, tiles, "t").unwrap();
                        assert_eq!(s.grid.1 as usize, tiles);
                        let owned = w4_rows_owned(n * nmat, k, s.grid.0 as usize);
                        assert!(owned.iter().all(|&o| o == 1), "n {n} k {k} nmat {nmat}");
                    }
                }
            }
        }
        assert!(moe_w4(2048, 4000, 2, 1, "t").is_err());
        assert!(moe_w4(2044, 4096, 2, 1, "t").is_err());
        assert!(moe_w4(2048, 4096, 3, 1, "t").is_err());
    }

    /// Host model of the INT4 kernels' walk over one weight row (linear.cu `w4_gemv`): lane
    /// g of a group of L takes chunks g, g + L, ... of `k / 32`; chunk c's scale is scale
    /// `row * k/128 + c/4`; words dequantized by the kernel's bit trick. Returns the row's
    /// dot product with `x`, summed as the group does.
    fn w4_row_dot_model(q: &[u32], s: &[u16], row: usize, k: usize, x: &[f32]) -> f64 {
        let l = w4_lanes(k);
        let mut total = 0.0f64;
        for g in 0..l {
            for c in (g..k / 32).step_by(l) {
                let sc = f32::from_bits(u32::from(s[row * (k / 128) + c / 4]) << 16);
                for j in 0..4 {
                    let w = crate::repack::dequant8_model(q[row * (k / 8) + c * 4 + j], sc);
                    for (t, wt) in w.iter().enumerate() {
                        total += f64::from(x[c * 32 + j * 8 + t]) * f64::from(*wt);
                    }
                }
            }
        }
        total
    }

    #[test]
    fn w4_chunk_walk_covers_every_weight_once_with_its_scale() {
        use speclab_engine::model::w4a16::unpack_nibble;
        for k in [128usize, 256, 384, 1152, 2048, 4096] {
            // 8 rows: scale buffers hold N % 8 == 0 rows, so the aligned pair never leaves them.
            let rows = 8;
            let words: Vec<u32> = (0..rows * k / 8)
                .map(|i| (i as u32).wrapping_mul(0x9e37_79b9) ^ 0x5bd1_e995)
                .collect();
            let q: Vec<u32> = words
                .iter()
                .map(|&w| crate::repack::repack_word(w))
                .collect();
            // Distinct power-of-two-ish scales per group, so a wrong group shows.
            let s: Vec<u16> = (0..rows * k / 128)
                .map(|i| 0x3b80u16 + (i % 13) as u16 * 0x10)
                .collect();
            let x: Vec<f32> = (0..k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
                .collect();
            for row in 0..rows {
                let mut want = 0.0f64;
                for kk in 0..k {
                    let sc = f32::from_bits(u32::from(s[row * (k / 128) + kk / 128]) << 16);
                    let wv = unpack_nibble(words[row * (k / 8) + kk / 8], kk % 8) as f32 * sc;
                    want += f64::from(x[kk]) * f64::from(wv);
                }
                let got = w4_row_dot_model(&q, &s, row, k, &x);
                assert!(
                    (got - want).abs() <= 1e-9 * want.abs().max(1.0),
                    "k {k} row {row}: {got} vs {want}"
                );
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
