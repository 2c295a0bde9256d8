//! GPTQ W4A16 quantization (symmetric INT4, group 128) and reconstruction-error metrics.
//!
//! What: [`Hessian`] (streaming `H = 2/n * sum_x x x^T` over calibration rows), [`gptq_quantize`]
//! (one Linear weight `[N, K]` -> [`W4A16Tensor`]), [`reconstruction_error`] (the GPTQ
//! objective and friends, to compare GPTQ with RTN per matrix).
//!
//! Source: Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
//! Pre-trained Transformers", Algorithm 1 (Cholesky-based inverse Hessian, blocks of 128
//! columns, column-wise error propagation inside the block, lazy batch update of the rest),
//! and the reference implementation's `GPTQ.fasterquant` as AutoGPTQ and llm-compressor
//! (`quantize_weight`) use it. `recipes/gptq_ref.py` is the executable reference this file
//! is tested against (`tests/fixtures/quant/gptq_golden.safetensors`).
//!
//! Algorithm (all arithmetic in f64; `W` is copied from f32):
//! 1. `H` = the accumulated Hessian. Dead columns (`H[i,i] == 0`): `H[i,i] = 1`,
//!    `W[:, i] = 0` (they quantize to 0).
//! 2. Dampening: `H += d * mean(diag(H)) * I`, `d = cfg.dampening` (0.01). If the Cholesky
//!    factorization fails, retry from the undamped `H` with `d_r = max(d, 1e-3) * 10^r`,
//!    `r = 1..=4` (so 0.01 -> 0.1, 1, 10, 100); the fraction used and the retry count are in
//!    [`GptqOutput`]. All five failing -> [`QuantError::NotPositiveDefinite`]. (llm-compressor
//!    instead falls back to RTN with `Hinv = I`; at `d = 100` GPTQ is already close to RTN.)
//! 3. `Hinv` = upper Cholesky factor of `H^-1` ([`crate::linalg::inverse_upper_cholesky`]).
//! 4. For each block of `block_size` columns `[i1, i2)`: for each column `i` in it, when
//!    `i % 128 == 0` compute the scales of group `i / 128` from the current weights of that
//!    group, `scale = bf16(f32(amax) / 7)` (the same rule as RTN, [`scale_from_amax`], so
//!    GPTQ and RTN checkpoints differ only in the choice of integers); then
//!    `q = clamp(round_half_even(w / scale), -8, 7)`, `err = (w - q*scale) / Hinv[i,i]`,
//!    `W[:, i..i2] -= err * Hinv[i, i..i2]`; after the block, `W[:, i2..] -= Err @ Hinv[i1..i2, i2..]`.
//!    "Current weights" are, as in `fasterquant` (`find_params(W[:, i:i+groupsize])`), the
//!    values as of the start of the current block: with `block_size = 128 = group_size` (the
//!    default) these are exactly the error-updated weights; with other block sizes a group
//!    starting mid-block does not see that block's pending updates, as in the reference.
//! 5. `static_groups` (AutoGPTQ's name) computes all scales up front from the original `W`
//!    (before dead-column zeroing) as llm-compressor's `quantize_weight` does.
//!    `act_order` processes columns in decreasing `H[i,i]` order (ties: lower index first) and
//!    forces static groups (llm-compressor's `actorder = "weight"`): scales stay per original
//!    group, so the output needs no `g_idx` and stays in the `pack-quantized` format.
//!
//! Invariants: `K % 128 == 0`, `group_size == 128` (the format), `block_size >= 1`,
//! `0 <= dampening` finite, `w` and `H` finite; violations are errors, never panics.
//! The Hessian's scale (`2/n` with `n` = rows, where llm-compressor counts sequences) does
//! not change the result (`err / Hinv[i,i] * Hinv[i, j]` is scale-free); it only scales the
//! reported proxy loss.

use half::bf16;

use crate::error::{
    check_finite_f32, check_finite_f64, checked_len, expect_len, QuantError, Result,
};
use crate::linalg::inverse_upper_cholesky;
use crate::w4a16::{scale_from_amax, W4A16Tensor, GROUP_SIZE, QMAX, QMIN};

/// Number of dampening retries after the first attempt (see the module docs).
pub const DAMPENING_RETRIES: u32 = 4;

/// Streaming accumulator of the GPTQ Hessian `H = 2/n * sum x x^T` over calibration rows
/// (`n` = number of rows added), accumulated in f64.
#[derive(Debug, Clone, PartialEq)]
pub struct Hessian {
    k: usize,
    /// `sum x x^T` (upper triangle only while accumulating), or the explicit matrix.
    acc: Vec<f64>,
    rows: u64,
    explicit: bool,
}

impl Hessian {
    /// An empty accumulator for inputs of width `k` (`in_features`).
    pub fn new(k: usize) -> Result<Self> {
        let len = checked_len(k, k, "Hessian [K, K]")?;
        Ok(Self {
            k,
            acc: vec![0.0; len],
            rows: 0,
            explicit: false,
        })
    }

    /// Wrap an explicit symmetric `[K, K]` matrix (already scaled; e.g. a stored Hessian).
    /// It is used as given: [`Hessian::add_batch`] is then an error.
    pub fn from_matrix(h: Vec<f64>, k: usize) -> Result<Self> {
        expect_len("H", h.len(), checked_len(k, k, "Hessian [K, K]")?)?;
        check_finite_f64("H", &h)?;
        for i in 0..k {
            for j in 0..i {
                if h[i * k + j] != h[j * k + i] {
                    return Err(QuantError::Shape(format!(
                        "H is not symmetric at ({i}, {j})"
                    )));
                }
            }
        }
        Ok(Self {
            k,
            acc: h,
            rows: 0,
            explicit: true,
        })
    }

    /// Add calibration rows `x` (`[rows, K]` row-major f32; `x.len()` a multiple of `K`).
    pub fn add_batch(&mut self, x: &[f32]) -> Result<()> {
        if self.explicit {
            return Err(QuantError::Config(
                "add_batch on an explicit Hessian".into(),
            ));
        }
        let k = self.k;
        if k == 0 || !x.len().is_multiple_of(k) {
            return Err(QuantError::Shape(format!(
                "x has {} elements, not a multiple of K = {k}",
                x.len()
            )));
        }
        check_finite_f32("x", x)?;
        // Tiles of rows: each accumulator row stays in cache across the tile. For every
        // (a, b) the rows are still added in input order, so the result does not depend on
        // the tiling or on how the rows were split into batches.
        const TILE: usize = 32;
        let mut tile = vec![0.0f64; TILE * k];
        for xt in x.chunks(TILE * k) {
            let rows = xt.len() / k;
            for (d, &s) in tile.iter_mut().zip(xt) {
                *d = s as f64;
            }
            for a in 0..k {
                let dst = &mut self.acc[a * k + a..(a + 1) * k];
                for r in 0..rows {
                    let row = &tile[r * k..(r + 1) * k];
                    let xa = row[a];
                    if xa == 0.0 {
                        continue;
                    }
                    for (d, &xb) in dst.iter_mut().zip(&row[a..]) {
                        *d += xa * xb;
                    }
                }
            }
        }
        self.rows += (x.len() / k) as u64;
        Ok(())
    }

    /// Width `K`.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Calibration rows added so far (0 for an explicit matrix).
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// The full symmetric `H` (`[K, K]` row-major): `2/n * sum x x^T`, zeros if no rows yet.
    pub fn matrix(&self) -> Vec<f64> {
        if self.explicit {
            return self.acc.clone();
        }
        let k = self.k;
        let mut h = vec![0.0f64; k * k];
        if self.rows == 0 {
            return h;
        }
        let f = 2.0 / self.rows as f64;
        for i in 0..k {
            for j in i..k {
                let v = self.acc[i * k + j] * f;
                h[i * k + j] = v;
                h[j * k + i] = v;
            }
        }
        h
    }
}

/// GPTQ settings. Defaults: block 128, dampening 0.01, group 128, no act-order, dynamic groups.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptqConfig {
    /// Columns per lazy-batch block.
    pub block_size: usize,
    /// Dampening as a fraction of the mean of `diag(H)`.
    pub dampening: f64,
    /// Must be 128 (the format's group size).
    pub group_size: usize,
    /// Process columns in decreasing `H[i,i]` (implies static groups; see the module docs).
    pub act_order: bool,
    /// Compute group scales from the original weights up front instead of at group start.
    pub static_groups: bool,
}

impl Default for GptqConfig {
    fn default() -> Self {
        Self {
            block_size: 128,
            dampening: 0.01,
            group_size: 128,
            act_order: false,
            static_groups: false,
        }
    }
}

/// Result of [`gptq_quantize`].
#[derive(Debug, Clone, PartialEq)]
pub struct GptqOutput {
    /// The quantized weight.
    pub tensor: W4A16Tensor,
    /// Dampening fraction that gave a positive-definite `H` (== `cfg.dampening` unless retried).
    pub dampening_used: f64,
    /// Cholesky retries with a larger dampening (0 normally).
    pub retries: u32,
    /// Indices of dead columns (`H[i,i] == 0`), quantized to 0.
    pub dead_columns: Vec<usize>,
    /// The reference implementation's loss: `sum (w - q*s)^2 / Hinv[i,i]^2 / 2`.
    pub gptq_loss: f64,
}

/// GPTQ-quantize `w` (`[N, K]` row-major f32) with Hessian `h` (`[K, K]`).
pub fn gptq_quantize(
    w: &[f32],
    n: usize,
    k: usize,
    h: &Hessian,
    cfg: &GptqConfig,
) -> Result<GptqOutput> {
    if !k.is_multiple_of(GROUP_SIZE) {
        return Err(QuantError::GroupMisaligned { k });
    }
    if cfg.group_size != GROUP_SIZE {
        return Err(QuantError::Config(format!(
            "group_size {} unsupported: the pack-quantized format here is group 128",
            cfg.group_size
        )));
    }
    if cfg.block_size == 0 {
        return Err(QuantError::Config("block_size must be >= 1".into()));
    }
    if !(cfg.dampening.is_finite() && cfg.dampening >= 0.0) {
        return Err(QuantError::Config(format!(
            "dampening {} must be finite and >= 0",
            cfg.dampening
        )));
    }
    if h.k() != k {
        return Err(QuantError::Shape(format!(
            "Hessian is for K = {}, weight has K = {k}",
            h.k()
        )));
    }
    expect_len("w", w.len(), checked_len(n, k, "weight [N, K]")?)?;
    check_finite_f32("w", w)?;
    let groups = k / GROUP_SIZE;
    let static_groups = cfg.static_groups || cfg.act_order;

    let mut hm = h.matrix();
    check_finite_f64("H", &hm)?;

    // Static scales come from the original weights (before dead-column zeroing).
    let static_scale: Option<Vec<bf16>> = static_groups.then(|| {
        let mut s = Vec::with_capacity(n * groups);
        for row in w.chunks_exact(k.max(1)) {
            for g in row.chunks_exact(GROUP_SIZE) {
                s.push(scale_from_amax(
                    g.iter().fold(0.0f32, |m, x| m.max(x.abs())),
                ));
            }
        }
        s
    });

    // Processing order: perm[p] = original column processed at position p.
    let perm: Vec<usize> = if cfg.act_order {
        let mut p: Vec<usize> = (0..k).collect();
        // Decreasing diagonal, ties by lower index (sort_by is stable).
        p.sort_by(|&a, &b| hm[b * k + b].total_cmp(&hm[a * k + a]));
        p
    } else {
        (0..k).collect()
    };
    let identity = !cfg.act_order;

    // W (f64) and H in processing order.
    let mut wp = vec![0.0f64; n * k];
    for r in 0..n {
        for (p, &c) in perm.iter().enumerate() {
            wp[r * k + p] = w[r * k + c] as f64;
        }
    }
    if !identity {
        let mut hp = vec![0.0f64; k * k];
        for (a, &ca) in perm.iter().enumerate() {
            for (b, &cb) in perm.iter().enumerate() {
                hp[a * k + b] = hm[ca * k + cb];
            }
        }
        hm = hp;
    }

    // Dead columns.
    let mut dead_columns = Vec::new();
    for p in 0..k {
        if hm[p * k + p] == 0.0 {
            hm[p * k + p] = 1.0;
            for r in 0..n {
                wp[r * k + p] = 0.0;
            }
            dead_columns.push(perm[p]);
        }
    }
    dead_columns.sort_unstable();

    // Dampening with the retry schedule.
    let mean_diag = if k == 0 {
        0.0
    } else {
        (0..k).map(|i| hm[i * k + i]).sum::<f64>() / k as f64
    };
    let mut hinv = None;
    let mut frac = cfg.dampening;
    let mut retries = 0u32;
    for r in 0..=DAMPENING_RETRIES {
        frac = if r == 0 {
            cfg.dampening
        } else {
            cfg.dampening.max(1e-3) * 10f64.powi(r as i32)
        };
        let mut hd = hm.clone();
        let damp = frac * mean_diag;
        for i in 0..k {
            hd[i * k + i] += damp;
        }
        if let Ok(u) = inverse_upper_cholesky(&hd, k) {
            hinv = Some(u);
            retries = r;
            break;
        }
    }
    let hinv = hinv.ok_or(QuantError::NotPositiveDefinite {
        attempts: DAMPENING_RETRIES + 1,
        last_dampening: frac,
    })?;

    let mut q = vec![0i8; n * k]; // in processing order
    let mut scale: Vec<bf16> = static_scale.unwrap_or_else(|| vec![bf16::ONE; n * groups]);
    let mut gptq_loss = 0.0f64;
    let bs = cfg.block_size;
    let mut i1 = 0;
    while i1 < k {
        let i2 = (i1 + bs).min(k);
        let cnt = i2 - i1;
        // W1 = W[:, i1:i2] (block copy; `wp` keeps the block-start state for group scales).
        let mut w1 = vec![0.0f64; n * cnt];
        for r in 0..n {
            w1[r * cnt..(r + 1) * cnt].copy_from_slice(&wp[r * k + i1..r * k + i2]);
        }
        let mut err1 = vec![0.0f64; n * cnt];
        for i in 0..cnt {
            let col = i1 + i;
            let orig = perm[col];
            let g = orig / GROUP_SIZE;
            if !static_groups && col % GROUP_SIZE == 0 {
                for r in 0..n {
                    let seg = &wp[r * k + col..r * k + col + GROUP_SIZE];
                    let amax = seg.iter().fold(0.0f64, |m, x| m.max(x.abs()));
                    scale[r * groups + g] = scale_from_amax(amax as f32);
                }
            }
            let hrow = &hinv[col * k + col..col * k + i2];
            let d = hrow[0];
            for r in 0..n {
                let s = scale[r * groups + g].to_f64();
                let row = &mut w1[r * cnt..(r + 1) * cnt];
                let wv = row[i];
                let qv = (wv / s).round_ties_even().clamp(QMIN as f64, QMAX as f64);
                let dq = qv * s;
                q[r * k + col] = qv as i8;
                let e = (wv - dq) / d;
                gptq_loss += e * e / 2.0;
                for (x, &hv) in row[i..].iter_mut().zip(hrow) {
                    *x -= e * hv;
                }
                err1[r * cnt + i] = e;
            }
        }
        // Lazy batch update of the remaining columns: W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:].
        if i2 < k {
            for r in 0..n {
                let dst = &mut wp[r * k + i2..(r + 1) * k];
                for j in 0..cnt {
                    let e = err1[r * cnt + j];
                    if e == 0.0 {
                        continue;
                    }
                    let hr = &hinv[(i1 + j) * k + i2..(i1 + j + 1) * k];
                    for (x, &hv) in dst.iter_mut().zip(hr) {
                        *x -= e * hv;
                    }
                }
            }
        }
        i1 = i2;
    }

    // Back to the original column order.
    let q_orig: Vec<i8> = if identity {
        q
    } else {
        let mut out = vec![0i8; n * k];
        for r in 0..n {
            for (p, &c) in perm.iter().enumerate() {
                out[r * k + c] = q[r * k + p];
            }
        }
        out
    };
    let tensor = W4A16Tensor::from_q(&q_orig, scale, n, k)?;
    Ok(GptqOutput {
        tensor,
        dampening_used: frac,
        retries,
        dead_columns,
        gptq_loss,
    })
}

/// Reconstruction error of `w_hat` against `w` (both `[N, K]`) under Hessian `h`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReconError {
    /// `mean((W - W_hat)^2)`.
    pub mse_weight: f64,
    /// `tr((W - W_hat) H (W - W_hat)^T) / N`: the GPTQ objective, per output row
    /// (with `H = 2/n X^T X`: `2/(n N) * ||X (W - W_hat)^T||_F^2`).
    pub proxy_loss: f64,
    /// `||W - W_hat||_F / ||W||_F` (0 when both are zero, infinite when only `W` is zero).
    pub rel_frobenius: f64,
}

/// Compute [`ReconError`]; `h` is used as accumulated (no dead-column fix, no dampening).
pub fn reconstruction_error(
    w: &[f32],
    w_hat: &[f32],
    n: usize,
    k: usize,
    h: &Hessian,
) -> Result<ReconError> {
    let len = checked_len(n, k, "weight [N, K]")?;
    expect_len("w", w.len(), len)?;
    expect_len("w_hat", w_hat.len(), len)?;
    if h.k() != k {
        return Err(QuantError::Shape(format!(
            "Hessian is for K = {}, weight has K = {k}",
            h.k()
        )));
    }
    let hm = h.matrix();
    let mut sq = 0.0f64;
    let mut wsq = 0.0f64;
    let mut proxy = 0.0f64;
    let mut d = vec![0.0f64; k];
    let mut hd = vec![0.0f64; k];
    for r in 0..n {
        for c in 0..k {
            let a = w[r * k + c] as f64;
            d[c] = a - w_hat[r * k + c] as f64;
            sq += d[c] * d[c];
            wsq += a * a;
        }
        for (i, v) in hd.iter_mut().enumerate() {
            let hr = &hm[i * k..(i + 1) * k];
            *v = hr.iter().zip(&d).map(|(x, y)| x * y).sum();
        }
        proxy += d.iter().zip(&hd).map(|(x, y)| x * y).sum::<f64>();
    }
    let mse_weight = if len == 0 { 0.0 } else { sq / len as f64 };
    let proxy_loss = if n == 0 { 0.0 } else { proxy / n as f64 };
    let rel_frobenius = if wsq == 0.0 {
        if sq == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (sq / wsq).sqrt()
    };
    Ok(ReconError {
        mse_weight,
        proxy_loss,
        rel_frobenius,
    })
}
