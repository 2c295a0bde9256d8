//! Host-side weight layouts of the device: bf16 bit patterns and the repacked INT4 experts.
//!
//! Source: docs/model.md §1.1 (bf16 -> f32 exact), §8 (compressed-tensors
//! `pack-quantized`: element `k` of row `n` is nibble `k % 8` of word `[n, k / 8]`,
//! element 0 lowest, stored as `q + 8`; scale `[n, k / 128]`); Marlin's interleave and
//! lop3 dequantization (vLLM `csrc/quantization/gptq_marlin/dequant.h`,
//! `marlin_repack`), adapted to the engine's f32 CUDA-core kernels.
//!
//! **The device INT4 layout** (built once at load, `cuda/kernels/linear.cu` reads it):
//! - Words: the compressed-tensors word of elements `8w .. 8w + 8` of a row, with its
//!   nibbles permuted so that nibble slot `s` holds element [`INTERLEAVE`]`[s]`
//!   (`[0, 2, 4, 6, 1, 3, 5, 7]`), still as `q + 8`. Then `(word >> 4j) & 0x000f000f`
//!   holds elements `2j` (low half) and `2j + 1` (high half) (Marlin's bf16-pair trick).
//!   The engine's f32 kernels use the order differently (issue 12, kernels/common.cuh
//!   `dequant8`): the views `r << 8`, `r`, `r >> 12` put every slot at bit 8, 12 or 16,
//!   one `lop3` ORs a nibble into the mantissa of f32 128.0, and one FMA with exact
//!   per-group constants gives `q * scale` exactly: 1 LOP3 + 1 FFMA per weight.
//! - Routed experts' gate and up are fused: `q13 [E, N, 2, K / 8]` (for output column n,
//!   the gate row, then the up row, so one warp streams both), scales
//!   `s13 [E, N, 2, K / 128]` as bf16 bits; down `qd [E, H, Im / 8]`, `sd [E, H, Im / 128]`.
//! - Every value is exactly the checkpoint's: [`unpack_experts`] inverts the repack
//!   bit for bit (tested), so `w = (q) * scale` on the device equals the CPU's
//!   dequantized f32 weight exactly.
//!
//! Dense weights travel as bf16 bit patterns (`u16`), which requires each f32 weight to
//! be bf16-exact (true for every weight loaded from a checkpoint or made by
//! `ModelWeights::random`); anything else is an error naming the tensor, never a
//! silent rounding.

use speclab_engine::model::Linear;

use crate::error::{CudaError, Result};

/// Nibble slot `s` of a repacked word holds element `INTERLEAVE[s]` of its 8 elements.
pub const INTERLEAVE: [u32; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// Group size of the INT4 scales along K (docs/model.md §8).
pub const GROUP: usize = 128;

/// Repack one compressed-tensors word into the device nibble order.
pub fn repack_word(w: u32) -> u32 {
    let mut r = 0u32;
    for (s, &e) in INTERLEAVE.iter().enumerate() {
        r |= ((w >> (4 * e)) & 0xF) << (4 * s as u32);
    }
    r
}

/// Inverse of [`repack_word`].
pub fn unpack_word(r: u32) -> u32 {
    let mut w = 0u32;
    for (s, &e) in INTERLEAVE.iter().enumerate() {
        w |= ((r >> (4 * s as u32)) & 0xF) << (4 * e);
    }
    w
}

/// The exact per-group constants of the kernel's `w4_scale` (kernels/common.cuh):
/// `(c16, c12, c8, k16, k12, k8)` with `c_b = s 2^(16-b)`, `k_b = 128 c_b + 8 s`.
pub fn w4_scale_model(s: f32) -> [f32; 6] {
    [s, s * 16.0, s * 256.0, s * 136.0, s * 2056.0, s * 32776.0]
}

/// One weight as the kernel's `w4_at` computes it: the nibble under `mask` of `a` ORed
/// into the mantissa of 128.0, then one fused multiply-add.
fn w4_at_model(a: u32, mask: u32, c: f32, k: f32) -> f32 {
    f32::from_bits((a & mask) | 0x4300_0000).mul_add(c, -k)
}

/// Host model of the kernel's `dequant8` (the same bit operations and the same fused
/// multiply-adds): 8 f32 weights in natural element order from a repacked word and its
/// f32 scale.
pub fn dequant8_model(r: u32, scale: f32) -> [f32; 8] {
    let [c16, c12, c8, k16, k12, k8] = w4_scale_model(scale);
    let (a, c) = (r << 8, r >> 12);
    [
        w4_at_model(a, 0x0000_0f00, c8, k8),
        w4_at_model(r, 0x000f_0000, c16, k16),
        w4_at_model(a, 0x0000_f000, c12, k12),
        w4_at_model(c, 0x0000_0f00, c8, k8),
        w4_at_model(r, 0x0000_0f00, c8, k8),
        w4_at_model(c, 0x0000_f000, c12, k12),
        w4_at_model(r, 0x0000_f000, c12, k12),
        w4_at_model(c, 0x000f_0000, c16, k16),
    ]
}

/// The bf16 bit pattern of `x`, if `x` is exactly a bf16 value.
pub fn bf16_bits_exact(x: f32) -> Option<u16> {
    let b = x.to_bits();
    (b & 0xffff == 0).then_some((b >> 16) as u16)
}

/// Host model of the kernel's folded dequantization (`W4_FOLD`, kernels/linear.cu
/// `w4_fma_fold`): `sum_e x[e] w[e]` of one repacked word with scale `s`, from the views
/// `r << 15, r << 7, r >> 1, r >> 9`, `v = 128 + n / 2` (bit 15) or `128 + 8 n` (bit 19),
/// and `s (2 A15 + A19 / 8 - (264 X15 + 24 X19))`, in f32 as the kernel rounds it.
pub fn fold_dot_model(r: u32, scale: f32, x: &[f32; 8]) -> f32 {
    let v = |a: u32, mask: u32| f32::from_bits((a & mask) | 0x4300_0000);
    let (v0, v1, v2, v3) = (r << 15, r << 7, r >> 1, r >> 9);
    let (m15, m19) = (0x0007_8000, 0x0078_0000);
    let f = [
        v(v0, m15),
        v(v2, m15),
        v(v0, m19),
        v(v2, m19),
        v(v1, m15),
        v(v3, m15),
        v(v1, m19),
        v(v3, m19),
    ];
    let (mut a15, mut a19) = (0.0f32, 0.0f32);
    for e in [0, 1, 4, 5] {
        a15 = x[e].mul_add(f[e], a15);
    }
    for e in [2, 3, 6, 7] {
        a19 = x[e].mul_add(f[e], a19);
    }
    let c = 264.0 * (x[0] + x[4] + x[1] + x[5]) + 24.0 * (x[2] + x[6] + x[3] + x[7]);
    scale * 2.0f32.mul_add(a15, 0.125f32.mul_add(a19, -c))
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
    /// Shape: [e, n, nmat, k / 8] repacked words.
    pub q: Vec<u32>,
    /// Shape: [e, n, nmat, k / 128] bf16 bits.
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
    if k % GROUP != 0 {
        return Err(CudaError::Unsupported(format!(
            "{what}: K = {k} is not a multiple of {GROUP}"
        )));
    }
    let (kw, kg) = (k / 8, k / GROUP);
    let e = mats.len();
    let mut q = vec![0u32; e * n * nmat * kw];
    let mut s = vec![0u16; e * n * nmat * kg];
    for (ei, ms) in mats.iter().enumerate() {
        if ms.len() != nmat {
            return Err(CudaError::Input(format!(
                "{what}: expert {ei} has {} matrices, expected {nmat}",
                ms.len()
            )));
        }
        for (mi, l) in ms.iter().enumerate() {
            if l.out_features() != n || l.in_features() != k {
                return Err(CudaError::Input(format!(
                    "{what}: expert {ei} matrix {mi} is not [{n}, {k}]"
                )));
            }
            let (packed, scale) = w4_parts(l, what)?;
            for r in 0..n {
                let row = (ei * n + r) * nmat + mi;
                for (d, &w) in q[row * kw..(row + 1) * kw]
                    .iter_mut()
                    .zip(&packed[r * kw..(r + 1) * kw])
                {
                    *d = repack_word(w);
                }
                let sb = to_bf16(&scale[r * kg..(r + 1) * kg], what)?;
                s[row * kg..(row + 1) * kg].copy_from_slice(&sb);
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
    let (kw, kg) = (x.k / 8, x.k / GROUP);
    let mut words = Vec::with_capacity(x.n * kw);
    let mut scales = Vec::with_capacity(x.n * kg);
    for r in 0..x.n {
        let row = (e * x.n + r) * x.nmat + m;
        words.extend(
            x.q[row * kw..(row + 1) * kw]
                .iter()
                .map(|&w| unpack_word(w)),
        );
        scales.extend(
            x.s[row * kg..(row + 1) * kg]
                .iter()
                .map(|&b| f32::from_bits(u32::from(b) << 16)),
        );
    }
    (words, scales)
}

#[cfg(test)]
mod tests {
    use super::*;
    use speclab_engine::model::w4a16::{quantize_rtn, unpack_nibble};

    #[test]
    fn word_repack_is_a_bijection_with_marlin_order() {
        // Element e stored as value e: the repacked word lists [0,2,4,6,1,3,5,7].
        let w = 0x7654_3210u32;
        assert_eq!(repack_word(w), 0x7531_6420);
        for w in [0u32, 1, 0xdead_beef, 0xffff_ffff, 0x1234_5678, 0x8000_0001] {
            assert_eq!(unpack_word(repack_word(w)), w);
            assert_eq!(repack_word(unpack_word(w)), w);
        }
    }

    #[test]
    fn folded_dequant_model_matches_the_exact_dot_closely() {
        use speclab_engine::model::w4a16::unpack_nibble;
        let mut worst = 0.0f64;
        for i in 0..20_000u32 {
            let w = i.wrapping_mul(0x9e37_79b9) ^ (i << 7);
            let scale = f32::from_bits((0x3b80u32 + (i % 29) * 0x10) << 16);
            let x: [f32; 8] =
                std::array::from_fn(|e| (((i as usize * 31 + e * 17) % 97) as f32 - 48.0) / 16.0);
            let exact: f64 = (0..8)
                .map(|e| f64::from(x[e]) * f64::from(unpack_nibble(w, e) as f32 * scale))
                .sum();
            let mag: f64 = (0..8)
                .map(|e| (f64::from(x[e]) * f64::from(unpack_nibble(w, e) as f32 * scale)).abs())
                .sum();
            let got = f64::from(fold_dot_model(repack_word(w), scale, &x));
            worst = worst.max((got - exact).abs() / mag.max(1e-30));
        }
        // A wrong slot or constant is off by O(1); the rounding bound is ~2^-16.
        assert!(worst < 1e-4, "worst relative error {worst}");
    }

    #[test]
    fn kernel_dequant_model_equals_the_cpu_dequant() {
        let mut scales = vec![1.0f32, 0.0078125, 3.5, half_bf16(0.013), -half_bf16(0.37)];
        // Every bf16 mantissa at a few exponents, both signs, and tiny / huge ones.
        for m in 0..128u32 {
            for e in [100u32, 120, 127, 131] {
                let b = (e << 23) | (m << 16);
                scales.push(f32::from_bits(b));
                scales.push(-f32::from_bits(b));
            }
        }
        let mut words = vec![0x7654_3210u32, 0xfedc_ba98, 0x0f1e_2d3c, 0x8888_8888, 0];
        // Every nibble value in every element position.
        for v in 0..16u32 {
            words.push(v * 0x1111_1111);
            words.push(v | ((15 - v) << 28) | (v << 12));
        }
        for &w in &words {
            for &s in &scales {
                let got = dequant8_model(repack_word(w), s);
                for (i, g) in got.iter().enumerate() {
                    let want = unpack_nibble(w, i) as f32 * s;
                    // Bit for bit, except that a zero weight may be +0 where the CPU has -0.
                    assert!(
                        g.to_bits() == want.to_bits() || (*g == 0.0 && want == 0.0),
                        "word {w:#x} elem {i} scale {s}: {g} vs {want}"
                    );
                }
            }
        }
    }

    fn half_bf16(x: f32) -> f32 {
        f32::from_bits(x.to_bits() & 0xffff_0000)
    }

    #[test]
    fn experts_repack_roundtrip_and_layout() {
        let (n, k) = (6, 256);
        let mk = |seed: usize| {
            let w: Vec<f32> = (0..n * k)
                .map(|i| half_bf16((((i * 31 + seed * 17) % 97) as f32 - 48.0) / 40.0))
                .collect();
            quantize_rtn(&w, n, k).unwrap().to_linear().unwrap()
        };
        let ls: Vec<Linear> = (0..6).map(mk).collect();
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
        // Row (e=1, col 2, up) sits at ((1 * n + 2) * 2 + 1) in the fused layout.
        let row = (n + 2) * 2 + 1;
        if let Linear::W4A16 { packed, .. } = &ls[3] {
            assert_eq!(x.q[row * k / 8], repack_word(packed[2 * k / 8]));
        }
        let dense = Linear::dense(n, k, vec![0.0; n * k]).unwrap();
        assert!(repack_experts(&[vec![&dense]], "mixed").is_err());
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
