//! Elementwise and row-wise f32 functions of the model.
//!
//! Source: docs/model.md §1 ("Elementwise functions"): `sigmoid`, `silu`, `softplus`
//! with PyTorch's threshold 20, Llama-style `rmsnorm` (the weight multiplies, not
//! `1 + w`), `l2norm` with `+1e-6` inside the square root (fla / vLLM KDA kernels);
//! `argmax` ties go to the lowest index (§1.7).
//!
//! Invariants: all compute is f32 (§1.2); row functions take `[rows, dim]` row-major
//! slices whose length is a multiple of `dim` (callers guarantee it; they never see
//! user-controlled lengths).

/// `1 / (1 + exp(-x))`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `x if x > 20 else log(1 + exp(x))`.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

/// RMSNorm of every row of `x` (`[rows, w.len()]`) into `out`: `x / sqrt(mean(x^2) + eps) * w`.
pub fn rmsnorm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum();
        let r = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, &v), &wi) in or.iter_mut().zip(xr).zip(w) {
            *o = v * r * wi;
        }
    }
}

/// RMSNorm of every row (allocating).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    rmsnorm_into(x, w, eps, &mut out);
    out
}

/// In-place `x / sqrt(sum(x^2) + 1e-6)` of one vector.
pub fn l2norm_inplace(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let r = (ss + 1e-6).sqrt();
    for v in x.iter_mut() {
        *v /= r;
    }
}

/// Index of the largest value, lowest index on ties (NaN never wins).
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// `max|a - b| / max|b|` (the parity metric of docs/model.md §1.6); `inf` on a length mismatch.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    let den = b.iter().map(|y| y.abs()).fold(0.0f32, f32::max);
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn basics() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(softplus(30.0), 30.0);
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
        let y = rmsnorm(&[3.0, 4.0], &[1.0, 2.0], 0.0);
        let r = (12.5f32).sqrt();
        assert!((y[0] - 3.0 / r).abs() < 1e-6 && (y[1] - 8.0 / r).abs() < 1e-6);
    }
}
