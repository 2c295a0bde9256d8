//! The W4A16 weight format: compressed-tensors `pack-quantized`, symmetric INT4, group 128.
//!
//! What: the one implementation of INT4 packing / unpacking, dequantization and
//! round-to-nearest quantization (`quantize_rtn`) in speclab, and [`W4A16Tensor`], one
//! quantized Linear weight in its checkpoint layout (converted to and from the kernel's
//! [`Linear::W4A16`] and to the three checkpoint tensors). `speclab-quant` (GPTQ, the
//! quantize pipeline, the pack-quantized writer) builds on these.
//!
//! Source: docs/model.md §8 (the contract), which matches compressed-tensors 0.17
//! `pack_to_int32` / `unpack_from_int32` with `num_bits = 4`, `packed_dim = 1`, and
//! `recipes/model.py`'s `quantize_rtn`.
//!
//! Invariants (checked on every constructor and function, errors otherwise):
//! - a weight is `[N, K]` (`out_features`, `in_features`), `K % 128 == 0`
//!   ([`EngineError::GroupMisaligned`]), `N * K` fits `usize` ([`EngineError::W4a16Shape`]);
//! - `packed` is `[N, K/8]` int32: element `k` of row `n` is the nibble at bits
//!   `4*(k%8) .. 4*(k%8)+3` of word `[n, k/8]` (element 0 in the lowest nibble), stored as
//!   `q + 8`; the int32 is a bit container (shifts are done on its `u32` pattern);
//! - `scale` is `[N, K/128]` bf16, the symmetric scale of group `k/128` of row `n`;
//! - `q` is in `[-8, 7]` ([`EngineError::Int4OutOfRange`]); dequantization is
//!   `w = f32(q) * f32(scale)`, exact in f32 (a 4-bit integer times an 8-bit-mantissa
//!   bf16), never rounded to bf16;
//! - RTN, per row `n` and group `g`: `amax = max |w|` (f32), `scale = bf16(amax / 7)`
//!   (f32 division, round-to-nearest-even; `1.0` if that is 0, see [`scale_from_amax`]),
//!   `q = clamp(round_half_even(w / f32(scale)), -8, 7)`; inputs must be finite
//!   ([`EngineError::NonFinite`]).

use half::bf16;

use super::checkpoint::NamedTensor;
use super::config::GROUP_SIZE;
use super::linear::Linear;
use crate::{EngineError, Result};

/// INT4 values per int32 word.
pub const PACK_FACTOR: usize = 8;
/// Smallest INT4 value.
pub const QMIN: i8 = -8;
/// Largest INT4 value.
pub const QMAX: i8 = 7;

fn shape_err(what: String) -> EngineError {
    EngineError::W4a16Shape(what)
}

/// `a * b` or a [`EngineError::W4a16Shape`] on overflow.
fn checked_len(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| shape_err(format!("{what}: {a} x {b} overflows usize")))
}

/// Error unless `len == expected`.
fn expect_len(what: &str, len: usize, expected: usize) -> Result<()> {
    if len != expected {
        return Err(shape_err(format!(
            "{what} has {len} elements, expected {expected}"
        )));
    }
    Ok(())
}

/// Check `n`, `k` for the format and return `n * k`.
fn check_nk(n: usize, k: usize) -> Result<usize> {
    if !k.is_multiple_of(GROUP_SIZE) {
        return Err(EngineError::GroupMisaligned { k });
    }
    checked_len(n, k, "weight [N, K]")
}

/// Decode one nibble of a packed word: `((word >> 4*(k%8)) & 0xF) - 8`.
#[inline]
pub fn unpack_nibble(word: u32, i: usize) -> i32 {
    ((word >> (4 * i)) & 0xF) as i32 - 8
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
                return Err(EngineError::Int4OutOfRange {
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
        for j in 0..PACK_FACTOR {
            out.push(unpack_nibble(word as u32, j) as i8);
        }
    }
    Ok(out)
}

/// Dequantize a packed weight: `w[n, k] = f32(q[n, k]) * f32(scale[n, k/128])`, `[N, K]` f32.
pub fn dequantize(packed: &[i32], scale: &[bf16], n: usize, k: usize) -> Result<Vec<f32>> {
    W4A16Tensor::new(packed.to_vec(), scale.to_vec(), [n, k])?.dequantize()
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
        let t = Self {
            packed,
            scale,
            shape,
        };
        t.check()?;
        Ok(t)
    }

    /// Build from INT4 values `q` (`[N, K]`, in `[-8, 7]`) and scales (`[N, K/128]`).
    pub fn from_q(q: &[i8], scale: Vec<bf16>, n: usize, k: usize) -> Result<Self> {
        let packed = pack_int4(q, n, k)?;
        Self::new(packed, scale, [n, k])
    }

    /// The checkpoint form of a [`Linear::W4A16`] layer (`None` for a dense layer).
    /// Its f32 scales hold bf16 values, so the bf16 conversion is exact.
    pub fn from_linear(l: &Linear) -> Option<Self> {
        match l {
            Linear::Dense { .. } => None,
            Linear::W4A16 {
                out_features,
                in_features,
                packed,
                scale,
            } => Some(Self {
                packed: packed.iter().map(|&w| w as i32).collect(),
                scale: scale.iter().map(|&s| bf16::from_f32(s)).collect(),
                shape: [*out_features, *in_features],
            }),
        }
    }

    /// Re-check the (public) fields against the format.
    fn check(&self) -> Result<()> {
        let [n, k] = self.shape;
        let len = check_nk(n, k)?;
        expect_len("packed", self.packed.len(), len / PACK_FACTOR)?;
        expect_len(
            "scale",
            self.scale.len(),
            checked_len(n, k / GROUP_SIZE, "scale")?,
        )
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

    /// The kernel's layer (`Linear::W4A16`: `u32` words, f32 scales upcast exactly).
    pub fn to_linear(&self) -> Result<Linear> {
        self.check()?;
        Linear::w4a16(
            self.shape[0],
            self.shape[1],
            self.packed.iter().map(|&w| w as u32).collect(),
            self.scale.iter().map(|s| s.to_f32()).collect(),
        )
    }

    /// The dequantized f32 weight, `[N, K]` (the kernel's own dequantization).
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        Ok(self.to_linear()?.weight_f32())
    }

    /// The three checkpoint tensors of module `module` (§8): `weight_packed` int32
    /// `[N, K/8]`, `weight_scale` bf16 `[N, K/128]`, `weight_shape` int64 `[2]`.
    pub fn to_named(&self, module: &str) -> [NamedTensor; 3] {
        let [n, k] = self.shape;
        let scale = NamedTensor::from_bf16(
            &format!("{module}.weight_scale"),
            vec![n, k / GROUP_SIZE],
            &self.scale,
        );
        [
            NamedTensor::i32(
                &format!("{module}.weight_packed"),
                vec![n, k / PACK_FACTOR],
                &self.packed,
            ),
            scale,
            NamedTensor::i64(
                &format!("{module}.weight_shape"),
                vec![2],
                &[n as i64, k as i64],
            ),
        ]
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

/// INT4 value of `w` under scale `s` (f32): `clamp(round_half_even(w / s), -8, 7)`.
pub fn quantize_value(w: f32, s: f32) -> i8 {
    (w / s).round_ties_even().clamp(QMIN as f32, QMAX as f32) as i8
}

/// Round-to-nearest INT4 of one `[N, K]` row-major f32 weight (usually the f32 of a bf16
/// weight), docs/model.md §8 `quantize_rtn` bit for bit (rule in the module docs).
pub fn quantize_rtn(w: &[f32], n: usize, k: usize) -> Result<W4A16Tensor> {
    let len = check_nk(n, k)?;
    expect_len("w", w.len(), len)?;
    if let Some(index) = w.iter().position(|x| !x.is_finite()) {
        return Err(EngineError::NonFinite {
            what: "w",
            index,
            value: w[index] as f64,
        });
    }
    let mut q = vec![0i8; w.len()];
    let mut scale = Vec::with_capacity(n * (k / GROUP_SIZE));
    for (row_w, row_q) in w.chunks_exact(k.max(1)).zip(q.chunks_exact_mut(k.max(1))) {
        for (gw, gq) in row_w
            .chunks_exact(GROUP_SIZE)
            .zip(row_q.chunks_exact_mut(GROUP_SIZE))
        {
            let amax = gw.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let s = scale_from_amax(amax);
            let sf = s.to_f32();
            for (qv, &wv) in gq.iter_mut().zip(gw) {
                *qv = quantize_value(wv, sf);
            }
            scale.push(s);
        }
    }
    W4A16Tensor::from_q(&q, scale, n, k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nibble_order_element_zero_lowest() {
        // q = [-8, -7, ..., -1] -> stored 0..7: word = 0x76543210.
        let word = 0x7654_3210u32;
        for i in 0..8 {
            assert_eq!(unpack_nibble(word, i), i as i32 - 8);
        }
    }

    #[test]
    fn linear_round_trip_keeps_bits() {
        let (n, k) = (3, 256);
        let w: Vec<f32> = (0..n * k)
            .map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 50.0).to_f32())
            .collect();
        let t = quantize_rtn(&w, n, k).unwrap();
        let l = t.to_linear().unwrap();
        assert_eq!(W4A16Tensor::from_linear(&l).unwrap(), t);
        assert_eq!(l.weight_f32(), t.dequantize().unwrap());
        let named = t.to_named("m");
        assert_eq!(named[0].name, "m.weight_packed");
        assert_eq!(named[1].shape, vec![3, 2]);
        assert_eq!(named[2].data.len(), 16);
    }
}
