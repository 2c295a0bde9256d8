//! The W4A16 weight format: compressed-tensors `pack-quantized`, symmetric INT4, group 128.
//!
//! What: this crate's face of the engine's format module (`speclab_engine::model::w4a16`,
//! the one implementation of packing, unpacking and dequantization, and of
//! [`W4A16Tensor`]), with errors as [`QuantError`].
//!
//! Source: `docs/model.md` §8 (the contract), which matches compressed-tensors 0.17
//! `pack_to_int32` / `unpack_from_int32` with `num_bits = 4`, `packed_dim = 1`.
//!
//! Invariants: those of the engine module — a weight is `[N, K]` with `K % 128 == 0`;
//! `packed` is `[N, K/8]` int32 (element `k` of row `n` in the nibble at bits
//! `4*(k%8)` of word `[n, k/8]`, stored as `q + 8`); `scale` is `[N, K/128]` bf16;
//! `q` is in `[-8, 7]`; dequantization is `f32(q) * f32(scale)`, exact in f32.

use half::bf16;
use speclab_engine::model::w4a16;

pub use speclab_engine::model::config::GROUP_SIZE;
pub use speclab_engine::model::w4a16::{scale_from_amax, W4A16Tensor, PACK_FACTOR, QMAX, QMIN};

use crate::error::Result;

/// Pack INT4 values `q` (`[N, K]` row-major, each in `[-8, 7]`) into `[N, K/8]` int32 words.
///
/// Errors: `q.len() != n*k`, `k % 128 != 0`, a value outside `[-8, 7]`.
pub fn pack_int4(q: &[i8], n: usize, k: usize) -> Result<Vec<i32>> {
    Ok(w4a16::pack_int4(q, n, k)?)
}

/// Unpack `[N, K/8]` int32 words into INT4 values `[N, K]` (inverse of [`pack_int4`]).
pub fn unpack_int4(packed: &[i32], n: usize, k: usize) -> Result<Vec<i8>> {
    Ok(w4a16::unpack_int4(packed, n, k)?)
}

/// Dequantize a packed weight: `w[n, k] = f32(q[n, k]) * f32(scale[n, k/128])`, `[N, K]` f32.
pub fn dequantize(packed: &[i32], scale: &[bf16], n: usize, k: usize) -> Result<Vec<f32>> {
    Ok(w4a16::dequantize(packed, scale, n, k)?)
}
