//! The W4A16 weight format: compressed-tensors `pack-quantized`, symmetric INT4, group 128.
//!
//! What: packing/unpacking of INT4 integers into int32 words, dequantization, and
//! [`W4A16Tensor`], the in-memory form of one quantized Linear weight.
//!
//! Source: `docs/model.md` §8 (the contract), which matches compressed-tensors 0.17
//! `pack_to_int32` / `unpack_from_int32` with `num_bits = 4`, `packed_dim = 1`.
//!
//! Invariants (checked on every constructor and function, errors otherwise):
//! - a weight is `[N, K]` (`out_features`, `in_features`), `K % 128 == 0`;
//! - `packed` is `[N, K/8]` int32: element `k` of row `n` is the nibble at bits
//!   `4*(k%8) .. 4*(k%8)+3` of word `[n, k/8]` (element 0 in the lowest nibble), stored as
//!   `q + 8`; the int32 is a bit container (shifts are done on its `u32` pattern);
//! - `scale` is `[N, K/128]` bf16, the symmetric scale of group `k/128` of row `n`;
//! - `q` is in `[-8, 7]`; dequantization is `w = f32(q) * f32(scale)`, exact in f32
//!   (a 4-bit integer times an 8-bit-mantissa bf16), never rounded to bf16.

use half::bf16;

use crate::error::{checked_len, expect_len, QuantError, Result};

/// Group size of the format (columns per scale).
pub const GROUP_SIZE: usize = 128;
/// INT4 values per int32 word.
pub const PACK_FACTOR: usize = 8;
/// Smallest INT4 value.
pub const QMIN: i8 = -8;
/// Largest INT4 value.
pub const QMAX: i8 = 7;

/// Check `n`, `k` for the format and return `n * k`.
fn check_nk(n: usize, k: usize) -> Result<usize> {
    if !k.is_multiple_of(GROUP_SIZE) {
        return Err(QuantError::GroupMisaligned { k });
    }
    checked_len(n, k, "weight [N, K]")
}

/// Pack INT4 values `q` (`[N, K]` row-major, each in `[-8, 7]`) into `[N, K/8]` int32 words.
///
/// Element `k` of row `n` goes to word `k/8` at bits `4*(k%8)`, stored as `q + 8`.
/// Errors: `q.len() != n*k`, `k % 128 != 0`, a value outside `[-8, 7]`.
pub fn pack_int4(q: &[i8], n: usize, k: usize) -> Result<Vec<i32>> {
    let len = check_nk(n, k)?;
    expect_len("q", q.len(), len)?;
    let mut out = Vec::with_capacity(len / PACK_FACTOR);
    for (w, chunk) in q.chunks_exact(PACK_FACTOR).enumerate() {
        let mut word: u32 = 0;
        for (j, &v) in chunk.iter().enumerate() {
            if !(QMIN..=QMAX).contains(&v) {
                return Err(QuantError::OutOfRange {
                    index: w * PACK_FACTOR + j,
                    value: v as i32,
                });
            }
            word |= ((v as i32 + 8) as u32) << (4 * j);
        }
        out.push(word as i32);
    }
    Ok(out)
}

/// Unpack `[N, K/8]` int32 words into INT4 values `[N, K]` (inverse of [`pack_int4`]).
///
/// Every nibble decodes to a valid value, so only the shape can be wrong.
pub fn unpack_int4(packed: &[i32], n: usize, k: usize) -> Result<Vec<i8>> {
    let len = check_nk(n, k)?;
    expect_len("packed", packed.len(), len / PACK_FACTOR)?;
    let mut out = Vec::with_capacity(len);
    for &word in packed {
        let u = word as u32;
        for j in 0..PACK_FACTOR {
            out.push(((u >> (4 * j)) & 0xF) as i8 - 8);
        }
    }
    Ok(out)
}

/// Dequantize a packed weight: `w[n, k] = f32(q[n, k]) * f32(scale[n, k/128])`, `[N, K]` f32.
pub fn dequantize(packed: &[i32], scale: &[bf16], n: usize, k: usize) -> Result<Vec<f32>> {
    let q = unpack_int4(packed, n, k)?;
    let groups = k / GROUP_SIZE;
    expect_len(
        "scale",
        scale.len(),
        checked_len(n, groups, "scale [N, K/128]")?,
    )?;
    let mut out = Vec::with_capacity(q.len());
    for (i, &v) in q.iter().enumerate() {
        let (row, col) = (i / k, i % k);
        out.push(v as f32 * scale[row * groups + col / GROUP_SIZE].to_f32());
    }
    Ok(out)
}

/// One quantized Linear weight in the compressed-tensors `pack-quantized` layout.
#[derive(Debug, Clone, PartialEq)]
pub struct W4A16Tensor {
    /// `[N, K/8]` int32 words (see the module docs for the bit layout).
    pub packed: Vec<i32>,
    /// `[N, K/128]` bf16 group scales.
    pub scale: Vec<bf16>,
    /// `[N, K]` (`weight_shape`).
    pub shape: [usize; 2],
}

impl W4A16Tensor {
    /// Validate and wrap already-packed data.
    pub fn new(packed: Vec<i32>, scale: Vec<bf16>, shape: [usize; 2]) -> Result<Self> {
        let [n, k] = shape;
        let len = check_nk(n, k)?;
        expect_len("packed", packed.len(), len / PACK_FACTOR)?;
        expect_len(
            "scale",
            scale.len(),
            checked_len(n, k / GROUP_SIZE, "scale")?,
        )?;
        Ok(Self {
            packed,
            scale,
            shape,
        })
    }

    /// Build from INT4 values `q` (`[N, K]`, in `[-8, 7]`) and scales (`[N, K/128]`).
    pub fn from_q(q: &[i8], scale: Vec<bf16>, n: usize, k: usize) -> Result<Self> {
        let packed = pack_int4(q, n, k)?;
        Self::new(packed, scale, [n, k])
    }

    /// Rows (`out_features`).
    pub fn n(&self) -> usize {
        self.shape[0]
    }

    /// Columns (`in_features`).
    pub fn k(&self) -> usize {
        self.shape[1]
    }

    /// The INT4 values, `[N, K]`.
    pub fn unpack(&self) -> Result<Vec<i8>> {
        unpack_int4(&self.packed, self.shape[0], self.shape[1])
    }

    /// The dequantized f32 weight, `[N, K]`.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        dequantize(&self.packed, &self.scale, self.shape[0], self.shape[1])
    }
}

/// The format's symmetric scale for a group with absolute maximum `amax`:
/// `bf16(amax / 7)` (f32 division, round-to-nearest-even to bf16), `1.0` when `amax == 0`.
///
/// Also `1.0` when `amax / 7` is so small (below bf16's smallest subnormal, ~9.2e-41)
/// that the bf16 rounds to 0 — a zero scale would make `w / scale` undefined;
/// `docs/model.md` §8 does not cover this case.
pub fn scale_from_amax(amax: f32) -> bf16 {
    if amax == 0.0 {
        return bf16::ONE;
    }
    let s = bf16::from_f32(amax / 7.0);
    if s.to_f32() == 0.0 {
        bf16::ONE
    } else {
        s
    }
}
