//! Round-to-nearest (RTN) W4A16 quantization.
//!
//! What: the fixture quantizer `quantize_rtn` of `docs/model.md` §8, bit for bit.
//! Source: `docs/model.md` §8 (and `recipes/model.py`'s `quantize_rtn`).
//!
//! Invariants: for each row `n` and group `g` (128 consecutive columns):
//! `amax = max |w|` (f32), `scale = bf16(amax / 7)` (f32 division, round-to-nearest-even
//! to bf16; `1.0` if `amax == 0`, see [`scale_from_amax`]),
//! `q = clamp(round_half_even(w / f32(scale)), -8, 7)` with an f32 division.
//! Inputs must be finite; `K % 128 == 0`.

use half::bf16;

use crate::error::{check_finite_f32, checked_len, expect_len, QuantError, Result};
use crate::w4a16::{scale_from_amax, W4A16Tensor, GROUP_SIZE, QMAX, QMIN};

/// INT4 value of `w` under scale `s` (f32): `clamp(round_half_even(w / s), -8, 7)`.
pub fn quantize_value(w: f32, s: f32) -> i8 {
    (w / s).round_ties_even().clamp(QMIN as f32, QMAX as f32) as i8
}

/// RTN-quantize `w` (`[N, K]` row-major f32, usually the f32 of a bf16 weight).
pub fn quantize_rtn(w: &[f32], n: usize, k: usize) -> Result<W4A16Tensor> {
    if !k.is_multiple_of(GROUP_SIZE) {
        return Err(QuantError::GroupMisaligned { k });
    }
    expect_len("w", w.len(), checked_len(n, k, "weight [N, K]")?)?;
    check_finite_f32("w", w)?;
    let groups = k / GROUP_SIZE;
    let mut q = vec![0i8; w.len()];
    let mut scale = Vec::with_capacity(n * groups);
    for (row_w, row_q) in w.chunks_exact(k.max(1)).zip(q.chunks_exact_mut(k.max(1))) {
        for (gw, gq) in row_w
            .chunks_exact(GROUP_SIZE)
            .zip(row_q.chunks_exact_mut(GROUP_SIZE))
        {
            let amax = gw.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let s: bf16 = scale_from_amax(amax);
            let sf = s.to_f32();
            for (qv, &wv) in gq.iter_mut().zip(gw) {
                *qv = quantize_value(wv, sf);
            }
            scale.push(s);
        }
    }
    W4A16Tensor::from_q(&q, scale, n, k)
}
