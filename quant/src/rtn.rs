//! Round-to-nearest (RTN) W4A16 quantization.
//!
//! What: the fixture quantizer `quantize_rtn` of `docs/model.md` §8, bit for bit: the
//! engine's one implementation (`speclab_engine::model::w4a16::quantize_rtn`, also what
//! `speclab init-model --w4a16` uses), with errors as [`QuantError`](crate::QuantError).
//! Source: `docs/model.md` §8 (and `recipes/model.py`'s `quantize_rtn`).
//!
//! Invariants: for each row `n` and group `g` (128 consecutive columns):
//! `amax = max |w|` (f32), `scale = bf16(amax / 7)` (f32 division, round-to-nearest-even
//! to bf16; `1.0` if `amax == 0`, see [`scale_from_amax`](crate::scale_from_amax)),
//! `q = clamp(round_half_even(w / f32(scale)), -8, 7)` with an f32 division.
//! Inputs must be finite; `K % 128 == 0`.

use speclab_engine::model::w4a16;

pub use speclab_engine::model::w4a16::quantize_value;

use crate::error::Result;
use crate::w4a16::W4A16Tensor;

/// RTN-quantize `w` (`[N, K]` row-major f32, usually the f32 of a bf16 weight).
pub fn quantize_rtn(w: &[f32], n: usize, k: usize) -> Result<W4A16Tensor> {
    Ok(w4a16::quantize_rtn(w, n, k)?)
}
