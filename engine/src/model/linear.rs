//! Linear layers `y = x @ W^T`: dense f32, or W4A16 (INT4 weights dequantized on the fly).
//!
//! Source: docs/model.md §1.3, §1.5 and §8 (compressed-tensors 0.17 `pack-quantized`:
//! element `k` of row `n` is the nibble at bits `4*(k%8)` of word `[n, k/8]`, stored as
//! `q + 8`; `w[n,k] = q * scale[n, k/128]`, exact in f32, never rounded to bf16). The
//! f32 GEMM is the `gemm` crate (single-threaded, `Parallelism::None`). The format itself
//! (nibble decode, packing, RTN, the checkpoint form) is [`crate::model::w4a16`].
//!
//! Invariants: `Dense.w` is `[N, K]` row-major; `W4A16.packed` is `[N, K/8]` and
//! `W4A16.scale` is `[N, K/128]` f32 (bf16 values upcast exactly), `K % 128 == 0`.
//! The W4A16 kernel dequantizes [`W4A16_TILE_ROWS`] output rows at a time into a small
//! scratch tile and multiplies that tile, so no full f32 copy of the weight exists; the
//! dequantized values are bit-identical to [`Linear::dequantized`]'s, so both paths agree
//! to GEMM summation order (~1e-7 relative).

use crate::model::config::GROUP_SIZE;
use crate::model::w4a16::unpack_nibble;
use crate::{EngineError, Result};

/// Output rows dequantized per tile in the W4A16 kernel.
pub const W4A16_TILE_ROWS: usize = 64;

/// A bias-free linear layer.
#[derive(Debug, Clone, PartialEq)]
pub enum Linear {
    /// f32 weight.
    Dense {
        out_features: usize,
        in_features: usize,
        /// Shape: [N = out_features, K = in_features].
        w: Vec<f32>,
    },
    /// Symmetric INT4, group 128 along K, no zero point, no g_idx.
    W4A16 {
        out_features: usize,
        in_features: usize,
        /// Shape: [N, K/8]; nibble `k%8` of word `k/8` holds `q + 8`.
        packed: Vec<u32>,
        /// Shape: [N, K/128].
        scale: Vec<f32>,
    },
}

fn shape_err(what: String) -> EngineError {
    EngineError::ModelInput(what)
}

/// The shape of one [`gemm_xwt`]: `m` rows of x, `n` rows of w, inner size `k`; rows of w
/// strided by `w_rs`; y written at column offset `col0` of rows of length `y_rs`.
#[derive(Clone, Copy)]
struct GemmShape {
    m: usize,
    n: usize,
    k: usize,
    w_rs: usize,
    y_rs: usize,
    col0: usize,
}

/// `y[m, n] = sum_k x[m, k] * w[n, k]` with x `[m, k]`, w `[n, k]` ([`GemmShape`]).
///
/// Callers guarantee the slices hold the indexed elements (asserted: an internal invariant).
fn gemm_xwt(sh: GemmShape, x: &[f32], w: &[f32], y: &mut [f32]) {
    let GemmShape {
        m,
        n,
        k,
        w_rs,
        y_rs,
        col0,
    } = sh;
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        x.len() >= m * k && w.len() >= (n - 1) * w_rs + k && y.len() >= (m - 1) * y_rs + col0 + n
    );
    // SAFETY: the assert above bounds every element gemm touches: lhs x[i*k + l],
    // rhs w[j*w_rs + l] (i < m, j < n, l < k), dst y[i*y_rs + col0 + j]; the three
    // buffers are distinct borrows (y is &mut), so there is no aliasing.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y.as_mut_ptr().add(col0),
            1,
            y_rs as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            w_rs as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Dequantize rows `[r0, r0 + rows)` of a packed weight into `tile` (`[rows, K]`).
fn dequant_rows(packed: &[u32], scale: &[f32], k: usize, r0: usize, rows: usize, tile: &mut [f32]) {
    let kw = k / 8;
    let kg = k / GROUP_SIZE;
    for r in 0..rows {
        let prow = &packed[(r0 + r) * kw..(r0 + r + 1) * kw];
        let srow = &scale[(r0 + r) * kg..(r0 + r + 1) * kg];
        let trow = &mut tile[r * k..(r + 1) * k];
        for (g, &s) in srow.iter().enumerate() {
            let words = &prow[g * GROUP_SIZE / 8..(g + 1) * GROUP_SIZE / 8];
            let out = &mut trow[g * GROUP_SIZE..(g + 1) * GROUP_SIZE];
            for (w, o8) in words.iter().zip(out.chunks_exact_mut(8)) {
                for (i, o) in o8.iter_mut().enumerate() {
                    *o = unpack_nibble(*w, i) as f32 * s;
                }
            }
        }
    }
}

impl Linear {
    /// A dense layer from `[out, in]` f32 weights.
    pub fn dense(out_features: usize, in_features: usize, w: Vec<f32>) -> Result<Self> {
        if w.len() != out_features * in_features {
            return Err(shape_err(format!(
                "dense weight has {} values, expected {out_features} x {in_features}",
                w.len()
            )));
        }
        Ok(Self::Dense {
            out_features,
            in_features,
            w,
        })
    }

    /// A W4A16 layer from packed words `[N, K/8]` and scales `[N, K/128]`.
    pub fn w4a16(
        out_features: usize,
        in_features: usize,
        packed: Vec<u32>,
        scale: Vec<f32>,
    ) -> Result<Self> {
        if !in_features.is_multiple_of(GROUP_SIZE) {
            return Err(shape_err(format!(
                "W4A16 in_features {in_features} is not a multiple of {GROUP_SIZE}"
            )));
        }
        if packed.len() != out_features * in_features / 8
            || scale.len() != out_features * in_features / GROUP_SIZE
        {
            return Err(shape_err(format!(
                "W4A16 packed {} / scale {} values do not match [{out_features}, {in_features}]",
                packed.len(),
                scale.len()
            )));
        }
        Ok(Self::W4A16 {
            out_features,
            in_features,
            packed,
            scale,
        })
    }

    /// N.
    pub fn out_features(&self) -> usize {
        match self {
            Self::Dense { out_features, .. } | Self::W4A16 { out_features, .. } => *out_features,
        }
    }
    /// K.
    pub fn in_features(&self) -> usize {
        match self {
            Self::Dense { in_features, .. } | Self::W4A16 { in_features, .. } => *in_features,
        }
    }
    /// Whether the weight is INT4.
    pub fn is_quantized(&self) -> bool {
        matches!(self, Self::W4A16 { .. })
    }

    /// `x [T, K] -> y [T, N]`.
    pub fn forward(&self, x: &[f32], t: usize) -> Result<Vec<f32>> {
        let mut y = vec![0.0; t * self.out_features()];
        self.forward_into(x, t, &mut y)?;
        Ok(y)
    }

    /// `x [T, K] -> y [T, N]` into a caller buffer (overwritten).
    pub fn forward_into(&self, x: &[f32], t: usize, y: &mut [f32]) -> Result<()> {
        let (n, k) = (self.out_features(), self.in_features());
        if x.len() != t * k || y.len() != t * n {
            return Err(shape_err(format!(
                "linear [{n}, {k}]: input has {} values and output {} for T = {t}",
                x.len(),
                y.len()
            )));
        }
        match self {
            Self::Dense { w, .. } => {
                let sh = GemmShape {
                    m: t,
                    n,
                    k,
                    w_rs: k,
                    y_rs: n,
                    col0: 0,
                };
                gemm_xwt(sh, x, w, y)
            }
            Self::W4A16 { packed, scale, .. } => {
                let rows = W4A16_TILE_ROWS.min(n);
                let mut tile = vec![0.0f32; rows * k];
                let mut r0 = 0;
                while r0 < n {
                    let nb = rows.min(n - r0);
                    dequant_rows(packed, scale, k, r0, nb, &mut tile);
                    let sh = GemmShape {
                        m: t,
                        n: nb,
                        k,
                        w_rs: k,
                        y_rs: n,
                        col0: r0,
                    };
                    gemm_xwt(sh, x, &tile, y);
                    r0 += nb;
                }
            }
        }
        Ok(())
    }

    /// The f32 weight `[N, K]` (a copy; dequantized for W4A16).
    pub fn weight_f32(&self) -> Vec<f32> {
        match self {
            Self::Dense { w, .. } => w.clone(),
            Self::W4A16 {
                out_features,
                in_features,
                packed,
                scale,
            } => {
                let mut w = vec![0.0; out_features * in_features];
                dequant_rows(packed, scale, *in_features, 0, *out_features, &mut w);
                w
            }
        }
    }

    /// The same layer as a dense f32 layer (for side-by-side benchmarks and tests).
    pub fn dequantized(&self) -> Linear {
        Self::Dense {
            out_features: self.out_features(),
            in_features: self.in_features(),
            w: self.weight_f32(),
        }
    }

    /// Bytes the weight occupies in memory.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Self::Dense { w, .. } => 4 * w.len(),
            Self::W4A16 { packed, scale, .. } => 4 * packed.len() + 4 * scale.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], t: usize, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0.0; t * n];
        for i in 0..t {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum();
            }
        }
        y
    }

    #[test]
    fn dense_and_w4a16_match_naive() {
        let (t, n, k) = (5, 70, 256);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let x: Vec<f32> = (0..t * k)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0)
            .collect();
        let d = Linear::dense(n, k, w.clone()).unwrap();
        let y = d.forward(&x, t).unwrap();
        assert!(crate::model::ops::rel_err(&y, &naive(&x, &w, t, n, k)) < 1e-6);
        let q = crate::model::w4a16::quantize_rtn(&w, n, k)
            .unwrap()
            .to_linear()
            .unwrap();
        let wq = q.weight_f32();
        let yq = q.forward(&x, t).unwrap();
        assert!(crate::model::ops::rel_err(&yq, &naive(&x, &wq, t, n, k)) < 1e-6);
        let yd = q.dequantized().forward(&x, t).unwrap();
        assert!(crate::model::ops::rel_err(&yq, &yd) < 1e-6);
        assert!(Linear::dense(2, 2, vec![0.0; 3]).is_err());
        assert!(d.forward(&x[1..], t).is_err());
    }
}
