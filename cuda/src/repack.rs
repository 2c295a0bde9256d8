//! Host-side weight layouts of the device: bf16 bit patterns and the repacked INT4 experts.
//!
//! Source: docs/model.md §1.1 (bf16 -> f32 exact), §8 (compressed-tensors
//! `pack-quantized`: element `k` of row `n` is nibble `k % 8` of word `[n, k / 8]`,
//! element 0 lowest, stored as `q + 8`; scale `[n, k / 128]`); Marlin's interleave and
//! lop3 dequantization (vLLM `csrc/quantization/gptq_marlin/dequant.h`,
//! `marlin_repack`), adapted to the engine's f32 CUDA-core kernels.
//!
//! **The device INT4 layout** (built once at load, `cuda/kernels/linear.cu` `w4_mma` reads
//! it): the A fragments of `mma.sync.m16n8k16` (PTX ISA, "Matrix Fragments for
//! mma.m16n8k16 with floating point type"), pre-shuffled so that one lane loads its
//! fragments of four 16-row mma tiles with one 16-byte load (Marlin's idea, vLLM
//! `marlin_repack`; the details here are the engine's own):
//! - Each expert matrix has `R` rows (`R % 64 == 0`) of `K` weights (`K % 128 == 0`).
//!   Row `r` lies in row block `r / 64`, mma tile `i = r % 64 / 16`, fragment row
//!   `g = r % 8`, half `h = r % 16 / 8` (rows `g` and `g + 8` of the tile).
//! - Weight `k` lies in k16 step `k / 16`, lane-in-group `t = k % 8 / 2`, fragment
//!   register `j = h + 2 (k % 16 / 8)`, half `e = k % 2` (the PTX table: a0..a7 of lane
//!   `4 g + t`).
//! - Words: `q [E, R / 64, K / 16, 32 lanes, 4 tiles]` u32; word `(lane 4 g + t, tile i)`
//!   holds register `j`'s element `e` in nibble slot `j + 4 e` as `q + 8`, so
//!   `(w >> 4 j) & 0x000f000f | 0x43004300` is the bf16 pair `128 + n` of register `j`
//!   (Marlin's bf16 trick, `dequant.h`).
//! - Scales: `s [E, R / 64, K / 128, 8 (g), 8 (2 i + h)]` bf16 bits: one 16-byte load
//!   gives a lane the scales of its eight rows for one 128-group.
//! - gate and up are fused into one matrix of `2 N` rows ([`fused_row`]): tile rows `g`
//!   hold gates and `g + 8` ups of output column `32 (r / 64) + 8 i + g`, so one lane
//!   holds both halves of a SwiGLU output. Down has `R = H` rows in natural order.
//! - Every value is exactly the checkpoint's: [`unpack_experts`] inverts the repack bit
//!   for bit (tested), and the kernel's bf16 weights `n - 8` are exact, its activations
//!   split into bf16 terms that sum to the f32 value (3 terms; [`split_model`]), so the
//!   device computes the f32 dot product of docs/model.md §1.3 up to summation order.
//!
//! Dense weights travel as bf16 bit patterns (`u16`), which requires each f32 weight to
//! be bf16-exact (true for every weight loaded from a checkpoint or made by
//! `ModelWeights::random`); anything else is an error naming the tensor, never a
//! silent rounding.

use speclab_engine::model::Linear;

use crate::error::{CudaError, Result};

/// Group size of the INT4 scales along K (docs/model.md §8).
pub const GROUP: usize = 128;

/// Weight rows of one row block (4 mma tiles of 16; a warp's rows in `w4_mma`).
pub const ROW_BLOCK: usize = 64;

/// Row of the device matrix holding matrix `m` (< `nmat`) of output column `n`: for
/// `nmat` 2 (gate 0, up 1) tile rows `g` are gates and `g + 8` ups of column
/// `32 (row / 64) + 8 (row % 64 / 16) + g`; for `nmat` 1 the row is `n`.
pub fn fused_row(n: usize, m: usize, nmat: usize) -> usize {
    if nmat == 1 {
        n
    } else {
        n / 32 * 64 + n % 32 / 8 * 16 + m * 8 + n % 8
    }
}

/// Word index (in one expert matrix of `r` rows of `k`) and nibble slot of weight
/// `(row, kidx)`.
pub fn word_slot(k: usize, row: usize, kidx: usize) -> (usize, u32) {
    let (rb, i, h, g) = (row / 64, row % 64 / 16, row % 16 / 8, row % 8);
    let kk = kidx % 16;
    let (t, j, e) = (kk % 8 / 2, h + 2 * (kk / 8), kk % 2);
    let word = ((rb * (k / 16) + kidx / 16) * 32 + 4 * g + t) * 4 + i;
    (word, (j + 4 * e) as u32)
}

/// Scale index (in one expert matrix) of row `row`, 128-group `grp`.
pub fn scale_index(k: usize, row: usize, grp: usize) -> usize {
    let (rb, i, h, g) = (row / 64, row % 64 / 16, row % 16 / 8, row % 8);
    ((rb * (k / GROUP) + grp) * 8 + g) * 8 + 2 * i + h
}

/// Host model of the kernel's `w4_frag`: the two weights `(n - 8)` of register `j` of a
/// fragment word, via the bf16 pair `128 + n` and an exact subtraction of 136.
pub fn frag_model(w: u32, j: u32) -> [f32; 2] {
    let p = ((w >> (4 * j)) & 0x000f_000f) | 0x4300_4300;
    let lo = f32::from_bits((p & 0xffff) << 16);
    let hi = f32::from_bits(p & 0xffff_0000);
    [lo - 136.0, hi - 136.0]
}

/// Round-to-nearest-even f32 -> bf16 (the kernel's `cvt.rn.bf16x2.f32`), widened back.
pub fn bf16_rn(x: f32) -> f32 {
    let b = x.to_bits();
    let r = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(r)
}

/// Host model of the kernel's `split_bf2`: `terms` bf16 values whose sum approximates `x`
/// (exactly for 3 terms and any normal `x`).
pub fn split_model(x: f32, terms: usize) -> Vec<f32> {
    let mut r = x;
    (0..terms)
        .map(|_| {
            let t = bf16_rn(r);
            r -= t;
            t
        })
        .collect()
}

/// Host mirror of linear.cu `w4_h_word`: the u32 index of term `x` of element `kidx` of
/// row `p` in the split activations (rows of `k` elements, `terms` terms); the element is
/// half `kidx % 2` of that word.
pub fn h_word(p: usize, kidx: usize, k: usize, x: usize, terms: usize) -> usize {
    let kk = kidx % 16;
    ((p * (k / 16) + kidx / 16) * 4 + kk % 8 / 2) * (2 * terms) + 2 * x + kk / 8
}

/// The bf16 bit pattern of `x`, if `x` is exactly a bf16 value.
pub fn bf16_bits_exact(x: f32) -> Option<u16> {
    let b = x.to_bits();
    (b & 0xffff == 0).then_some((b >> 16) as u16)
}

/// bf16 bit patterns of a slice; an error names `what` and the first inexact index.
pub fn to_bf16(xs: &[f32], what: &str) -> Result<Vec<u16>> {
    xs.iter()
        .enumerate()
        .map(|(i, &x)| {
            bf16_bits_exact(x).ok_or_else(|| {
                CudaError::Unsupported(format!(
                    "{what}: value {x:e} at flat index {i} is not bf16-exact (the device stores dense weights as bf16; docs/model.md §1.1)"
                ))
            })
        })
        .collect()
}

/// The dense f32 weight `[N, K]` of a non-quantized Linear.
pub fn dense_weight<'a>(l: &'a Linear, what: &str) -> Result<&'a [f32]> {
    match l {
        Linear::Dense { w, .. } => Ok(w),
        Linear::W4A16 { .. } => Err(CudaError::Unsupported(format!(
            "{what}: a W4A16 Linear where the engine expects bf16 (only routed experts may be quantized)"
        ))),
    }
}

/// Rows of several dense Linears with equal K stacked (`[sum N_i + pad_rows, K]`, the
/// padding rows zero), as bf16 bits.
pub fn stack_rows(ls: &[&Linear], pad_rows: usize, what: &str) -> Result<Vec<u16>> {
    let k = ls.first().map_or(0, |l| l.in_features());
    let mut out = Vec::new();
    for l in ls {
        if l.in_features() != k {
            return Err(CudaError::Input(format!(
                "{what}: stacked Linears disagree on in_features ({} vs {k})",
                l.in_features()
            )));
        }
        out.extend(to_bf16(dense_weight(l, what)?, what)?);
    }
    out.resize(out.len() + pad_rows * k, 0);
    Ok(out)
}

/// Gate and up (`[N, K]` each) fused per output column: `[N, 2, K]` bf16 bits.
pub fn fuse_gate_up_bf16(gate: &Linear, up: &Linear, what: &str) -> Result<Vec<u16>> {
    let (n, k) = (gate.out_features(), gate.in_features());
    if up.out_features() != n || up.in_features() != k {
        return Err(CudaError::Input(format!(
            "{what}: gate and up shapes differ"
        )));
    }
    let g = to_bf16(dense_weight(gate, what)?, what)?;
    let u = to_bf16(dense_weight(up, what)?, what)?;
    let mut out = Vec::with_capacity(2 * n * k);
    for r in 0..n {
        out.extend_from_slice(&g[r * k..(r + 1) * k]);
        out.extend_from_slice(&u[r * k..(r + 1) * k]);
    }
    Ok(out)
}

/// A set of expert matrices in the device INT4 layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Int4Experts {
    /// Experts.
    pub e: usize,
    /// Output features of each matrix.
    pub n: usize,
    /// Input features (multiple of 128).
    pub k: usize,
    /// Matrices per expert and column: 2 (gate, up fused) or 1 (down).
    pub nmat: usize,
    /// Shape: [e, n nmat / 64, k / 16, 32, 4] fragment words (module docs).
    pub q: Vec<u32>,
    /// Shape: [e, n nmat / 64, k / 128, 8, 8] bf16 bits (module docs).
    pub s: Vec<u16>,
}

/// The packed words `[N, K/8]` and f32 scales `[N, K/128]` of a W4A16 Linear.
fn w4_parts<'a>(l: &'a Linear, what: &str) -> Result<(&'a [u32], &'a [f32])> {
    match l {
        Linear::W4A16 { packed, scale, .. } => Ok((packed, scale)),
        Linear::Dense { .. } => Err(CudaError::Unsupported(format!(
            "{what}: mixed dense and W4A16 routed experts in one layer"
        ))),
    }
}

/// Repack experts: `mats[e][m]` is matrix `m` (< nmat) of expert `e`, all `[n, k]` W4A16.
pub fn repack_experts(mats: &[Vec<&Linear>], what: &str) -> Result<Int4Experts> {
    let first = mats
        .first()
        .and_then(|m| m.first())
        .ok_or_else(|| CudaError::Input(format!("{what}: no experts")))?;
    let (n, k, nmat) = (first.out_features(), first.in_features(), mats[0].len());
    if k % GROUP != 0 || (n * nmat) % ROW_BLOCK != 0 {
        return Err(CudaError::Unsupported(format!(
            "{what}: INT4 experts of {nmat} x [{n}, {k}] (the device layout needs K % {GROUP} == 0 and {nmat} N % {ROW_BLOCK} == 0)"
        )));
    }
    let (kw, kg, rows) = (k / 8, k / GROUP, n * nmat);
    let e = mats.len();
    let mut q = vec![0u32; e * rows * kw];
    let mut s = vec![0u16; e * rows * kg];
    for (ei, ms) in mats.iter().enumerate() {
        if ms.len() != nmat {
            return Err(CudaError::Input(format!(
                "{what}: expert {ei} has {} matrices, expected {nmat}",
                ms.len()
            )));
        }
        let (qe, se) = (ei * rows * kw, ei * rows * kg);
        for (mi, l) in ms.iter().enumerate() {
            if l.out_features() != n || l.in_features() != k {
                return Err(CudaError::Input(format!(
                    "{what}: expert {ei} matrix {mi} is not [{n}, {k}]"
                )));
            }
            let (packed, scale) = w4_parts(l, what)?;
            for r in 0..n {
                let row = fused_row(r, mi, nmat);
                for kidx in 0..k {
                    let nib = (packed[r * kw + kidx / 8] >> (4 * (kidx % 8))) & 0xF;
                    let (w, slot) = word_slot(k, row, kidx);
                    q[qe + w] |= nib << (4 * slot);
                }
                let sb = to_bf16(&scale[r * kg..(r + 1) * kg], what)?;
                for (grp, &b) in sb.iter().enumerate() {
                    s[se + scale_index(k, row, grp)] = b;
                }
            }
        }
    }
    Ok(Int4Experts {
        e,
        n,
        k,
        nmat,
        q,
        s,
    })
}

/// Inverse of [`repack_experts`] for one matrix: the compressed-tensors words `[n, k/8]`
/// and f32 scales `[n, k/128]` of matrix `m` of expert `e`.
pub fn unpack_experts(x: &Int4Experts, e: usize, m: usize) -> (Vec<u32>, Vec<f32>) {
    let (kw, kg, rows) = (x.k / 8, x.k / GROUP, x.n * x.nmat);
    let (qe, se) = (e * rows * kw, e * rows * kg);
    let mut words = vec![0u32; x.n * kw];
    let mut scales = Vec::with_capacity(x.n * kg);
    for r in 0..x.n {
        let row = fused_row(r, m, x.nmat);
        for kidx in 0..x.k {
            let (w, slot) = word_slot(x.k, row, kidx);
            let nib = (x.q[qe + w] >> (4 * slot)) & 0xF;
            words[r * kw + kidx / 8] |= nib << (4 * (kidx % 8));
        }
        scales.extend(
            (0..kg)
                .map(|grp| f32::from_bits(u32::from(x.s[se + scale_index(x.k, row, grp)]) << 16)),
        );
    }
    (words, scales)
}

#[cfg(test)]
mod tests {
    use super::*;
    use speclab_engine::model::w4a16::quantize_rtn;

    fn half_bf16(x: f32) -> f32 {
        f32::from_bits(x.to_bits() & 0xffff_0000)
    }

    fn w4_linear(n: usize, k: usize, seed: usize) -> Linear {
        let w: Vec<f32> = (0..n * k)
            .map(|i| half_bf16((((i * 31 + seed * 17) % 97) as f32 - 48.0) / 40.0))
            .collect();
        quantize_rtn(&w, n, k).unwrap().to_linear().unwrap()
    }

    #[test]
    fn layout_indices_are_bijections() {
        let (rows, k) = (128, 256);
        let mut seen = vec![0u8; rows * k];
        for row in 0..rows {
            for kidx in 0..k {
                let (w, slot) = word_slot(k, row, kidx);
                seen[w * 8 + slot as usize] += 1;
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
        let mut seen = vec![0u8; rows * k / GROUP];
        for row in 0..rows {
            for grp in 0..k / GROUP {
                seen[scale_index(k, row, grp)] += 1;
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
        let mut seen = vec![0u8; 2 * (2 * 128 * 3 / 2)];
        for p in 0..2 {
            for kidx in 0..128 {
                for x in 0..3 {
                    seen[2 * h_word(p, kidx, 128, x, 3) + kidx % 2] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
        let mut rows_seen = [0u8; 128];
        for n in 0..64 {
            for m in 0..2 {
                rows_seen[fused_row(n, m, 2)] += 1;
            }
        }
        assert!(rows_seen.iter().all(|&c| c == 1));
    }

    #[test]
    fn three_bf16_terms_are_exact_two_are_close() {
        let mut worst2 = 0.0f64;
        for i in 0..100_000u32 {
            let x = f32::from_bits(0x3000_0000 + i.wrapping_mul(0x9e37_79b9) % 0x1e00_0000)
                * if i % 2 == 0 { 1.0 } else { -1.0 };
            let t3 = split_model(x, 3);
            assert!(t3.iter().all(|&t| half_bf16(t) == t));
            assert_eq!(t3[0] + t3[1] + t3[2], x, "{x:e}");
            let t2 = split_model(x, 2);
            let e = f64::from(x) - f64::from(t2[0]) - f64::from(t2[1]);
            worst2 = worst2.max(e.abs() / f64::from(x.abs()));
        }
        assert!(worst2 <= 2f64.powi(-16), "{worst2:e}");
        assert_eq!(bf16_rn(1.0 + 1.0 / 256.0), 1.0); // tie to even
        assert_eq!(bf16_rn(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
    }

    /// The kernel's walk (linear.cu `w4_mma`) simulated lane by lane on the host: each
    /// lane's fragment words read at the kernel's indices, dequantized by the model of
    /// `w4_frag`, assembled into the mma's A and B matrices by the PTX ISA's fragment
    /// tables (a_i: row g + 8 (i / 2 % 2), column 2 t + i % 2 + 8 (i / 4); b_i: row
    /// 2 t + i % 2 + 8 (i / 2), column g; c_i: row g + 8 (i / 2), column 2 t + i % 2),
    /// multiplied, scaled per 128-group by the lane's scale word, and stored by the kernel's
    /// epilogue mapping; compared with the CPU's dequantized dot products.
    // Index loops on purpose: they mirror the kernel's (lane, tile, register) indices.
    #[allow(clippy::needless_range_loop)]
    fn simulate(x: &Int4Experts, e: usize, act: &[Vec<f64>]) -> Vec<Vec<f64>> {
        let (k, rows, kg) = (x.k, x.n * x.nmat, x.k / GROUP);
        let (qe, se) = (e * rows * k / 8, e * rows * kg);
        // out[slot][output row of the matrix pair]: raw accumulators per fused row.
        let mut acc = vec![vec![0.0f64; rows]; 8];
        for rb in 0..rows / 64 {
            for grp in 0..kg {
                let mut part = vec![[[0.0f64; 4]; 4]; 32];
                for u in 0..8 {
                    let st = grp * 8 + u;
                    for i in 0..4 {
                        let mut a = [[0.0f64; 16]; 16];
                        let mut b = [[0.0f64; 8]; 16];
                        for lane in 0..32 {
                            let (g, t) = (lane / 4, lane % 4);
                            let w = x.q[qe + ((rb * (k / 16) + st) * 32 + lane) * 4 + i];
                            for ai in 0..8 {
                                let v = frag_model(w, (ai / 2) as u32)[ai % 2];
                                a[g + 8 * (ai / 2 % 2)][2 * t + ai % 2 + 8 * (ai / 4)] =
                                    f64::from(v);
                            }
                            for bi in 0..4 {
                                let kk = 2 * t + bi % 2 + 8 * (bi / 2);
                                b[kk][g] = act[g][st * 16 + kk];
                            }
                        }
                        for lane in 0..32 {
                            let (g, t) = (lane / 4, lane % 4);
                            for ci in 0..4 {
                                let (r, c) = (g + 8 * (ci / 2), 2 * t + ci % 2);
                                part[lane][i][ci] +=
                                    (0..16).map(|kk| a[r][kk] * b[kk][c]).sum::<f64>();
                            }
                        }
                    }
                }
                for lane in 0..32 {
                    let (g, t) = (lane / 4, lane % 4);
                    let sc = |i: usize, h: usize| {
                        let b = x.s[se + ((rb * kg + grp) * 8 + g) * 8 + 2 * i + h];
                        f64::from(f32::from_bits(u32::from(b) << 16))
                    };
                    for i in 0..4 {
                        for ci in 0..4 {
                            let h = ci / 2;
                            let row = rb * 64 + 16 * i + 8 * h + g;
                            acc[2 * t + ci % 2][row] += sc(i, h) * part[lane][i][ci];
                        }
                    }
                }
            }
        }
        // The epilogue: nmat 2: row 64 rb + 16 i + 8 h + g is matrix h of column
        // 32 rb + 8 i + g; nmat 1: output column = row.
        let mut out = vec![vec![0.0f64; x.n * x.nmat]; 8];
        for (slot, a) in acc.iter().enumerate() {
            for (row, &v) in a.iter().enumerate() {
                let (rb, i, h, g) = (row / 64, row % 64 / 16, row % 16 / 8, row % 8);
                let idx = if x.nmat == 2 {
                    (32 * rb + 8 * i + g) * 2 + h
                } else {
                    row
                };
                out[slot][idx] = v;
            }
        }
        out
    }

    #[test]
    fn simulated_kernel_walk_equals_the_cpu_dot_products() {
        for (n, k, nmat) in [(32, 256, 2), (64, 128, 1), (128, 384, 1)] {
            let ls: Vec<Linear> = (0..2 * nmat).map(|j| w4_linear(n, k, j)).collect();
            let mats: Vec<Vec<&Linear>> = (0..2)
                .map(|e| (0..nmat).map(|m| &ls[e * nmat + m]).collect())
                .collect();
            let x = repack_experts(&mats, "test").unwrap();
            let act: Vec<Vec<f64>> = (0..8)
                .map(|p| {
                    (0..k)
                        .map(|j| (((p * 13 + j * 7) % 23) as f64 - 11.0) / 8.0)
                        .collect()
                })
                .collect();
            for e in 0..2 {
                let got = simulate(&x, e, &act);
                for m in 0..nmat {
                    let w = ls[e * nmat + m].weight_f32();
                    for (p, a) in act.iter().enumerate() {
                        for c in 0..n {
                            let want: f64 = (0..k).map(|j| a[j] * f64::from(w[c * k + j])).sum();
                            let idx = if nmat == 2 { c * 2 + m } else { c };
                            let g = got[p][idx];
                            assert!(
                                (g - want).abs() < 1e-9,
                                "n {n} k {k} e {e} m {m} p {p} c {c}: {g} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn experts_repack_roundtrip_and_errors() {
        let (n, k) = (32, 256);
        let ls: Vec<Linear> = (0..6).map(|s| w4_linear(n, k, s)).collect();
        let mats: Vec<Vec<&Linear>> = vec![
            vec![&ls[0], &ls[1]],
            vec![&ls[2], &ls[3]],
            vec![&ls[4], &ls[5]],
        ];
        let x = repack_experts(&mats, "test").unwrap();
        assert_eq!(x.q.len(), 3 * n * 2 * k / 8);
        assert_eq!(x.s.len(), 3 * n * 2 * k / 128);
        for e in 0..3 {
            for m in 0..2 {
                let (words, scales) = unpack_experts(&x, e, m);
                match &ls[2 * e + m] {
                    Linear::W4A16 { packed, scale, .. } => {
                        assert_eq!(&words, packed);
                        assert_eq!(&scales, scale);
                    }
                    Linear::Dense { .. } => unreachable!(),
                }
            }
        }
        let dense = Linear::dense(64, k, vec![0.0; 64 * k]).unwrap();
        assert!(repack_experts(&[vec![&dense]], "mixed").is_err());
        // 2 x 24 rows is not a whole row block of 64.
        let odd = w4_linear(24, k, 9);
        let err = repack_experts(&[vec![&odd, &odd]], "odd")
            .unwrap_err()
            .to_string();
        assert!(err.contains("odd") && err.contains("64"), "{err}");
    }

    #[test]
    fn bf16_exactness_is_enforced() {
        assert_eq!(bf16_bits_exact(1.0), Some(0x3f80));
        assert_eq!(bf16_bits_exact(1.0 + 1.0 / 1024.0), None);
        assert!(to_bf16(&[1.0, 0.1], "t").is_err());
        let g = Linear::dense(2, 8, (0..16).map(|i| i as f32).collect()).unwrap();
        let u = Linear::dense(2, 8, (16..32).map(|i| i as f32).collect()).unwrap();
        let f = fuse_gate_up_bf16(&g, &u, "t").unwrap();
        // [N, 2, K]: column 1's up row starts at (1 * 2 + 1) * 8.
        assert_eq!(f[3 * 8], bf16_bits_exact(24.0).unwrap());
        let st = stack_rows(&[&g, &u], 3, "t").unwrap();
        assert_eq!(st.len(), (2 + 2 + 3) * 8);
        assert!(st[4 * 8..].iter().all(|&b| b == 0));
    }
}
