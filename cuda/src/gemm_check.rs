//! Bit-for-bit parity of the register-tiled bf16 GEMMs (`linear_tiled_bf16`,
//! `linear_norm_tiled_bf16`, `linear_pair_tiled_bf16`, `swiglu_tiled_bf16`) and of their
//! skinny twins (`linear_skinny_bf16` and kin, the default up to
//! [`crate::launch::SKINNY_MAX_ROWS`] rows; checked here at every row count) against the
//! warp-per-column kernels they replace.
//!
//! Source: cuda/kernels/linear.cu (the tiled kernels keep each lane's summation order and
//! warp_sum's butterfly pairs, so the results must be identical, not merely close).
//!
//! Also the router kernel with the post-attention rmsnorm fused in against kernel
//! `rmsnorm` then the router ([`router_norm_parity`]): normalized rows, logits, expert ids
//! and weights, bit for bit, with the router's last block doing `moe_align`'s sort
//! against the `moe_align` launch; and the shared expert's down-projection with the MoE
//! combine as its epilogue against `linear` + `moe_combine` ([`combine_parity`]); and
//! `moe_align` against its host model ([`align_parity`]).
//!
//! Invariants: both kernels of a pair run on the same device inputs (seeded, models/tiny's
//! shapes plus ragged ones that exercise the clamped edge rows / columns, a strided and
//! offset x, accumulate into a nonzero y); a line counts the output elements whose bit
//! patterns differ, so its bound is 0.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::buf::DevBuf;
use crate::check::{line, CheckLine};
use crate::device::Gpu;
use crate::error::Result;
use crate::ops::{self, Linear, Mat, Router, Routing, Swiglu};

/// (M rows, N output columns, K) of the checked GEMMs: models/tiny's projections (hidden
/// 256, qkv 768, dense intermediate 768, shared expert 128, vocab 8196), GLM-5.3's router
/// (288 x 4096), and ragged edges (K / 8 = 513 words: a skinny lane's last group is partial).
const SHAPES: &[(usize, usize, usize)] = &[
    (1, 8196, 256),
    (1, 288, 4096),
    (3, 300, 4104),
    (5, 100, 768),
    (1, 100, 768),
    (2, 768, 256),
    (9, 768, 256),
    (16, 256, 768),
    (33, 8196, 256),
    (128, 256, 128),
    (136, 100, 264),
    (64, 768, 256),
];

/// Which kernel family a case runs.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Linear,
    Norm,
    Pair,
    Swiglu,
}

/// Device inputs of one shape: x [M, K + 8] (used from column 8), W [2N, K] bf16,
/// W1 [N, K] bf16 (the pair's second matrix), g [K].
struct Inputs {
    x: DevBuf<f32>,
    w: DevBuf<u16>,
    w1: DevBuf<u16>,
    g: DevBuf<f32>,
    y0: Vec<f32>,
}

fn inputs(gpu: &Gpu, rng: &mut ChaCha8Rng, (m, n, k): (usize, usize, usize)) -> Result<Inputs> {
    let s = &gpu.stream;
    let mut f =
        |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let bf = |v: Vec<f32>| -> Vec<u16> { v.iter().map(|x| (x.to_bits() >> 16) as u16).collect() };
    Ok(Inputs {
        x: DevBuf::upload(s, &f(m * (k + 8)), "tiled check x")?,
        w: DevBuf::upload(s, &bf(f(2 * n * k)), "tiled check W")?,
        w1: DevBuf::upload(s, &bf(f(n * k)), "tiled check W1")?,
        g: DevBuf::upload(s, &f(k), "tiled check g")?,
        y0: f(m * n),
    })
}

/// Which kernel of a family runs.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// The warp-per-column reference.
    Base,
    Tiled,
    Skinny,
}

/// Run `kind` on `inp` with the kernels of `path`; the outputs, read back (the pair's are
/// concatenated).
fn run(
    gpu: &mut Gpu,
    kind: Kind,
    inp: &Inputs,
    shape: (usize, usize, usize),
    path: Path,
) -> Result<Vec<f32>> {
    let (m, n, k) = shape;
    (gpu.tiled_min_rows, gpu.skinny_max_rows) = match path {
        Path::Base => (usize::MAX, 0),
        Path::Tiled => (1, 0),
        Path::Skinny => (1, usize::MAX),
    };
    let s = gpu.stream.clone();
    let y = DevBuf::upload(&s, &inp.y0, "tiled check y")?;
    let y1 = DevBuf::zeros(&s, m * n, "tiled check y1")?;
    let x = Mat::rows(&inp.x, k + 8).col(8);
    let lin = |y, w, accumulate| Linear {
        y: Mat::rows(y, n),
        x,
        w,
        m,
        n,
        k,
        accumulate,
    };
    match kind {
        Kind::Linear => ops::linear(gpu, &lin(&y, &inp.w, true))?,
        Kind::Norm => ops::linear_norm(gpu, &lin(&y, &inp.w, false), &inp.g, 1e-6)?,
        Kind::Pair => ops::linear_pair(gpu, &lin(&y, &inp.w, false), &lin(&y1, &inp.w1, false))?,
        Kind::Swiglu => ops::swiglu(
            gpu,
            &Swiglu {
                h: &y,
                x,
                w13: &inp.w,
                m,
                n,
                k,
            },
        )?,
    }
    let mut out = y.read(&s, 0, m * n, "tiled check y")?;
    if matches!(kind, Kind::Pair) {
        out.extend(y1.read(&s, 0, m * n, "tiled check y1")?);
    }
    Ok(out)
}

/// Two lines per (kind, shape): elements whose bits differ between the tiled kernel and
/// the warp-per-column kernel, and between the skinny kernel (forced at every row count)
/// and it. Restores the device's own `tiled_min_rows` / `skinny_max_rows` afterwards.
pub fn tiled_parity(gpu: &mut Gpu, out: &mut Vec<CheckLine>) -> Result<()> {
    let keep = (gpu.tiled_min_rows, gpu.skinny_max_rows);
    let mut rng = ChaCha8Rng::seed_from_u64(0x711e);
    let result = (|| {
        for &shape in SHAPES {
            let inp = inputs(gpu, &mut rng, shape)?;
            for kind in [Kind::Linear, Kind::Norm, Kind::Pair, Kind::Swiglu] {
                let base = run(gpu, kind, &inp, shape, Path::Base)?;
                for (what, path) in [("tiled", Path::Tiled), ("skinny", Path::Skinny)] {
                    let got = run(gpu, kind, &inp, shape, path)?;
                    let differ = base
                        .iter()
                        .zip(&got)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    let (m, n, k) = shape;
                    let name =
                        format!("{what} {kind:?} M={m} N={n} K={k}: elements differing in bits");
                    line(out, name, differ as f64, 0.0);
                }
            }
        }
        Ok(())
    })();
    (gpu.tiled_min_rows, gpu.skinny_max_rows) = keep;
    result
}

/// The fused-norm, fused-align router (`Router::norm`, `Router::ticket`) against
/// `rmsnorm`, the router and `moe_align`, on seeded rows of `t` tokens, hidden `h`, `e` experts
/// top-`k`, both writing the INT4 split: one line per output (normed rows, logits, ids,
/// weights, split words, sorted pairs, tile experts) counting differing elements. The
/// fused router runs twice, so a ticket left nonzero by the first launch fails the lines.
pub fn router_norm_parity(gpu: &Gpu, out: &mut Vec<CheckLine>) -> Result<()> {
    let s = gpu.stream.clone();
    let mut rng = ChaCha8Rng::seed_from_u64(0x4e04);
    for &(t, h, e, k) in &[
        (1usize, 256usize, 16usize, 2usize),
        (37, 256, 16, 2),
        (300, 256, 16, 2),
        (5, 4096, 256, 8),
    ] {
        let mut f = |len: usize, a: f32| -> Vec<f32> {
            (0..len).map(|_| rng.random_range(-a..a)).collect()
        };
        let resid = DevBuf::upload(&s, &f(t * h, 3.0), "router check residual")?;
        let nw = DevBuf::upload(&s, &f(h, 1.5), "router check norm")?;
        let w: Vec<u16> = f(e * h, 0.2)
            .iter()
            .map(|x| (x.to_bits() >> 16) as u16)
            .collect();
        let w = DevBuf::upload(&s, &w, "router check W")?;
        let bias = DevBuf::upload(&s, &f(e, 0.1), "router check bias")?;
        let max_tiles = crate::launch::moe_max_tiles(t * k, e);
        let mut outs: Vec<[Vec<u32>; 7]> = Vec::new();
        let ticket = DevBuf::<i32>::zeros(&s, 1, "router check ticket")?;
        let words = |v: Vec<i32>| -> Vec<u32> { v.iter().map(|&i| i as u32).collect() };
        for fused in [false, true] {
            let xn = DevBuf::<f32>::zeros(&s, t * h, "router check xn")?;
            let logits = DevBuf::<f32>::zeros(&s, t * e, "router check logits")?;
            let xs = DevBuf::<f32>::zeros(&s, t * h * crate::launch::W4_XS_MAX / 2, "xs")?;
            let ids = DevBuf::<i32>::zeros(&s, t * k, "router check ids")?;
            let wts = DevBuf::<f32>::zeros(&s, t * k, "router check wts")?;
            let sorted = DevBuf::<i32>::zeros(&s, 8 * max_tiles, "router check sorted")?;
            let tiles = DevBuf::<i32>::zeros(&s, max_tiles + 1, "router check tiles")?;
            if !fused {
                ops::rmsnorm(
                    gpu,
                    Mat::rows(&xn, h),
                    Mat::rows(&resid, h),
                    &nw,
                    t,
                    h,
                    1e-6,
                )?;
            }
            let r = Routing {
                ids: &ids,
                wts: &wts,
                sorted: &sorted,
                tile_expert: &tiles,
                t,
                k,
                e,
                max_tiles,
            };
            let rt = Router {
                x: &xn,
                w: &w,
                k_dim: h,
                logits: &logits,
                bias: &bias,
                xs: Some(&xs),
                norm: fused.then_some((&resid, &nw, 1e-6)),
                ticket: fused.then_some(&ticket),
                pre: fused && gpu.router_pre,
            };
            if fused {
                // A first launch into scratch tiles: the measured one below only aligns if
                // this one's last block reset the ticket.
                let sorted0 = DevBuf::<i32>::zeros(&s, 8 * max_tiles, "router check sorted0")?;
                let tiles0 = DevBuf::<i32>::zeros(&s, max_tiles + 1, "router check tiles0")?;
                let r0 = Routing {
                    sorted: &sorted0,
                    tile_expert: &tiles0,
                    ..r
                };
                ops::moe_route_fused(gpu, &r0, &rt, true, 2.5)?;
            }
            ops::moe_route_fused(gpu, &r, &rt, true, 2.5)?;
            let bits = |v: Vec<f32>| -> Vec<u32> { v.iter().map(|x| x.to_bits()).collect() };
            outs.push([
                bits(xn.read(&s, 0, t * h, "xn")?),
                bits(logits.read(&s, 0, t * e, "logits")?),
                ids.read(&s, 0, t * k, "ids")?
                    .iter()
                    .map(|&i| i as u32)
                    .collect(),
                bits(wts.read(&s, 0, t * k, "wts")?),
                bits(xs.read(&s, 0, t * h * crate::launch::W4_XS_MAX / 2, "xs")?),
                words(sorted.read(&s, 0, 8 * max_tiles, "sorted")?),
                words(tiles.read(&s, 0, max_tiles + 1, "tiles")?),
            ]);
        }
        let names = [
            "normed rows",
            "logits",
            "ids",
            "weights",
            "split",
            "sorted",
            "tiles",
        ];
        for (i, what) in names.iter().enumerate() {
            let differ = outs[0][i]
                .iter()
                .zip(&outs[1][i])
                .filter(|(a, b)| a != b)
                .count();
            let name = format!("router norm+align fused T={t} H={h} E={e}: {what} differing");
            line(out, name, differ as f64, 0.0);
        }
    }
    Ok(())
}

/// `moe_align` against its host model ([`crate::launch::moe_align_model`]) on seeded
/// routings of `t` tokens, top-`k` of `e` distinct experts a token: GLM-5.3-Flash's 288
/// experts from one token to 300 (more pairs than the kernel's threads) and to 1,100 (more
/// than it stages in shared memory), models/tiny's 16, and the kernel's 1024. Two lines per case: sorted positions and tile entries (the count
/// of used tiles included) that differ.
pub fn align_parity(gpu: &Gpu, out: &mut Vec<CheckLine>) -> Result<()> {
    let s = gpu.stream.clone();
    let mut rng = ChaCha8Rng::seed_from_u64(0xa119);
    for &(t, k, e) in &[
        (1usize, 8usize, 288usize),
        (8, 8, 288),
        (64, 8, 288),
        (300, 8, 288),
        (37, 2, 16),
        (5, 8, 1024),
        // More pairs than moe_align stages in shared memory (moe.cu ALIGN_STAGE): L2 reads.
        (1100, 8, 288),
    ] {
        // k distinct experts a token, skewed toward low ids (hot experts take several tiles).
        let mut ids = Vec::with_capacity(t * k);
        for _ in 0..t {
            let mut pick: Vec<i32> = Vec::with_capacity(k);
            while pick.len() < k {
                let u: f64 = rng.random_range(0.0..1.0);
                let ex = ((u * u * u) * e as f64) as i32;
                if !pick.contains(&ex) {
                    pick.push(ex);
                }
            }
            ids.extend(pick);
        }
        let max_tiles = crate::launch::moe_max_tiles(t * k, e);
        let (want_sorted, want_tiles) = crate::launch::moe_align_model(&ids, e, max_tiles);
        let ids_d = DevBuf::upload(&s, &ids, "align check ids")?;
        let wts = DevBuf::<f32>::zeros(&s, t * k, "align check wts")?;
        let sorted = DevBuf::<i32>::zeros(&s, 8 * max_tiles, "align check sorted")?;
        let tiles = DevBuf::<i32>::zeros(&s, max_tiles + 1, "align check tiles")?;
        let r = Routing {
            ids: &ids_d,
            wts: &wts,
            sorted: &sorted,
            tile_expert: &tiles,
            t,
            k,
            e,
            max_tiles,
        };
        ops::moe_align(gpu, &r)?;
        let got_sorted = sorted.read(&s, 0, 8 * max_tiles, "align check sorted")?;
        let got_tiles = tiles.read(&s, 0, max_tiles + 1, "align check tiles")?;
        let differ = |a: &[i32], b: &[i32]| a.iter().zip(b).filter(|(x, y)| x != y).count();
        let case = format!("moe_align T={t} k={k} E={e}");
        line(
            out,
            format!("{case}: sorted positions differing from the host model"),
            differ(&got_sorted, &want_sorted) as f64,
            0.0,
        );
        line(
            out,
            format!("{case}: tile entries differing from the host model"),
            differ(&got_tiles, &want_tiles) as f64,
            0.0,
        );
    }
    Ok(())
}

/// The shared expert's down-projection with the MoE combine fused in
/// (`ops::linear_combine`) against `linear` into a shared buffer then `moe_combine`, on
/// seeded rows of `t` tokens, hidden `h`, shared intermediate `inter`, top-`k` of `e`
/// distinct experts per token: lines counting the residual elements whose bits differ,
/// for the fused kernel waiting first and running its dot before the wait. Up to
/// [`Gpu::skinny_max_rows`] tokens both sides run the skinny kernels (their own parity
/// against the reference is [`tiled_parity`]'s).
pub fn combine_parity(gpu: &Gpu, out: &mut Vec<CheckLine>) -> Result<()> {
    let s = gpu.stream.clone();
    let mut rng = ChaCha8Rng::seed_from_u64(0xc0b1);
    for &(t, h, inter, e, k) in &[
        (1usize, 256usize, 128usize, 16usize, 2usize),
        (37, 256, 128, 16, 2),
        (9, 520, 136, 64, 8),
        (3, 4096, 2048, 288, 8),
    ] {
        let mut f = |len: usize, a: f32| -> Vec<f32> {
            (0..len).map(|_| rng.random_range(-a..a)).collect()
        };
        let x0 = f(t * h, 2.0);
        let y = DevBuf::upload(&s, &f(t * k * h, 1.0), "combine check y")?;
        let hid = DevBuf::upload(&s, &f(t * inter, 1.0), "combine check h")?;
        let w: Vec<u16> = f(h * inter, 0.2)
            .iter()
            .map(|v| (v.to_bits() >> 16) as u16)
            .collect();
        let w = DevBuf::upload(&s, &w, "combine check W")?;
        // Distinct, unsorted expert ids per token: a rotation of a descending run.
        let ids: Vec<i32> = (0..t * k)
            .map(|p| ((e - 1 - (p % k) * (e / k)) + p / k) as i32 % e as i32)
            .collect();
        let ids = DevBuf::upload(&s, &ids, "combine check ids")?;
        let wts = DevBuf::<f32>::zeros(&s, t * k, "combine check wts")?;
        let max_tiles = crate::launch::moe_max_tiles(t * k, e);
        let sorted = DevBuf::<i32>::zeros(&s, 8 * max_tiles, "combine check sorted")?;
        let tiles = DevBuf::<i32>::zeros(&s, max_tiles + 1, "combine check tiles")?;
        let r = Routing {
            ids: &ids,
            wts: &wts,
            sorted: &sorted,
            tile_expert: &tiles,
            t,
            k,
            e,
            max_tiles,
        };
        let mut res = Vec::new();
        // The reference, then the fused kernel waiting first, then running its dot before
        // the wait (`settled`: the inputs were uploaded long before).
        for (fused, settled) in [(false, false), (true, false), (true, true)] {
            let x = DevBuf::upload(&s, &x0, "combine check x")?;
            let shared = DevBuf::<f32>::zeros(&s, t * h, "combine check shared")?;
            let down = Linear {
                y: Mat::rows(if fused { &x } else { &shared }, h),
                x: Mat::rows(&hid, inter),
                w: &w,
                m: t,
                n: h,
                k: inter,
                accumulate: false,
            };
            if fused {
                ops::linear_combine(gpu, &down, &r, &y, settled)?;
            } else {
                ops::linear(gpu, &down)?;
                ops::moe_combine(gpu, &r, &x, &y, &shared, h)?;
            }
            let v = x.read(&s, 0, t * h, "combine check x")?;
            res.push(v.iter().map(|v| v.to_bits()).collect::<Vec<u32>>());
        }
        for (i, how) in [(1, ""), (2, ", dot before the wait")] {
            let differ = res[0].iter().zip(&res[i]).filter(|(a, b)| a != b).count();
            let name =
                format!("combine fused T={t} H={h} I={inter} k={k}{how}: residual differing");
            line(out, name, differ as f64, 0.0);
        }
    }
    Ok(())
}
