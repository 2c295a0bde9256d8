//! KDA (Kimi Delta Attention) linear attention, per-token recurrence with state blocks.
//!
//! Source: docs/model.md §4 (Kimi-Linear `KimiDeltaAttention`; the loop body is vLLM /
//! fla `fused_recurrent_kda` with `use_qk_l2norm_in_kernel`, the fused gate and
//! `sigmoid` on beta, written out per token, no chunking): q/k/v projections, a causal
//! depthwise conv (kc taps, left-padded with the conv state) + SiLU, l2norm of q
//! (times `dl^-0.5`) and k, channel-wise decay `alpha = exp(-exp(A_log) *
//! softplus(f + dt_bias))` through the low-rank f projection, `beta = sigmoid(b)`, the
//! gated delta rule on `S [nl, dl (key), dl (value)]`, then the gated output norm
//! `rmsnorm(o, o_norm) * sigmoid(g)` and `o_proj`.
//!
//! State blocks (see `model/kv_store.rs`): a chunk of `T` tokens at position `p` starts
//! from the zero state when `p == 0`, else from the committed state in state block
//! `table[0]`. The state after the chunk's last token is written to `table[0]`. With
//! `snapshot`, the state after token `j` (`j < T-1`) is also written to `table[j+1]`,
//! so that `commit_state(accepted)` can make the state after `accepted + 1` tokens the
//! committed one by one copy (or none when all were accepted).
//!
//! Invariants: conv states hold the last `kc-1` *pre-conv* projection outputs, oldest
//! first; the conv sums taps `j = 0..kc-1` in order from 0 (as the reference); the
//! caller has checked the state table (1 block, or `T` blocks with `snapshot`).

use crate::kv::BlockId;
use crate::model::attention::Span;
use crate::model::config::ModelConfig;
use crate::model::kv_store::KvStore;
use crate::model::ops::{l2norm_inplace, rmsnorm_into, sigmoid, silu, softplus};
use crate::model::weights::KdaWeights;
use crate::Result;

/// Shapes and per-batch gate inputs shared by the steps of one KDA layer.
struct KdaCtx<'a> {
    w: &'a KdaWeights,
    /// Heads, head dim, conv taps, channels (`nl * dl`).
    nl: usize,
    dl: usize,
    kc: usize,
    c: usize,
    /// Decay gate input `f_b(f_a(x))`. Shape: [T_total, C].
    f: &'a [f32],
    /// Beta logits. Shape: [T_total, nl].
    b: &'a [f32],
    /// `-exp(A_log)`. Shape: [nl].
    neg_a: &'a [f32],
    qscale: f32,
}

/// KDA of one layer over a batch: `a [T_total, H] -> [T_total, H]`; `layer` indexes the
/// KDA layers (0..num_kda_layers).
pub(crate) fn kda(
    w: &KdaWeights,
    cfg: &ModelConfig,
    a: &[f32],
    spans: &[Span<'_>],
    store: &mut KvStore,
    layer: usize,
) -> Result<Vec<f32>> {
    let h = cfg.hidden_size;
    let t_total = a.len() / h;
    let (nl, dl, kc) = (
        cfg.linear_num_heads,
        cfg.linear_head_dim,
        cfg.linear_conv_kernel_dim,
    );
    let c = nl * dl;
    let eps = cfg.rms_norm_eps as f32;
    let xs = [
        w.q.forward(a, t_total)?,
        w.k.forward(a, t_total)?,
        w.v.forward(a, t_total)?,
    ]; // 3 x [T_total, C]
    let f = w.f_b.forward(&w.f_a.forward(a, t_total)?, t_total)?; // [T_total, C]
    let gout = w.g_b.forward(&w.g_a.forward(a, t_total)?, t_total)?; // [T_total, C]
    let b = w.b.forward(a, t_total)?; // [T_total, nl]
    let neg_a: Vec<f32> = w.a_log.iter().map(|x| -x.exp()).collect(); // [nl]
    let ctx = KdaCtx {
        w,
        nl,
        dl,
        kc,
        c,
        f: &f,
        b: &b,
        neg_a: &neg_a,
        qscale: (dl as f64).powf(-0.5) as f32,
    };
    let mut o = vec![0.0f32; t_total * c]; // [T_total, nl, dl]
    let win_len = (kc - 1) * c;
    for sp in spans {
        // Working state: conv windows [3, kc-1, C] and S [nl, dl, dl].
        let (mut conv, mut s) = if sp.start_pos == 0 {
            (vec![0.0f32; 3 * win_len], vec![0.0f32; nl * dl * dl])
        } else {
            let (cv, sv) = store.state(layer, sp.state_table[0]);
            (cv.to_vec(), sv.to_vec())
        };
        let qkv = conv_span(&ctx, &xs, sp, &mut conv, store, layer);
        delta_span(&ctx, sp, &qkv, &mut s, &mut o, store, layer);
        let committed: BlockId = sp.state_table[0];
        let (cv, sv) = store.state_mut(layer, committed);
        cv.copy_from_slice(&conv);
        sv.copy_from_slice(&s);
    }
    // 3. gated output norm per (token, head), then o_proj.
    let mut normed = vec![0.0f32; o.len()];
    rmsnorm_into(&o, &w.o_norm, eps, &mut normed);
    for (x, g) in normed.iter_mut().zip(&gout) {
        *x *= sigmoid(*g);
    }
    w.o.forward(&normed, t_total)
}

/// Step 1: causal conv + SiLU per token of one span over q, k, v (`xs`: 3 x [T_total, C]),
/// advancing the conv windows `conv` [3, kc-1, C] and writing the conv snapshots of a
/// verify span. Returns [3, T, C].
fn conv_span(
    ctx: &KdaCtx<'_>,
    xs: &[Vec<f32>; 3],
    sp: &Span<'_>,
    conv: &mut [f32],
    store: &mut KvStore,
    layer: usize,
) -> Vec<f32> {
    let (c, kc, w) = (ctx.c, ctx.kc, ctx.w);
    let win_len = (kc - 1) * c;
    let base = sp.offset;
    let mut qkv = vec![0.0f32; 3 * sp.len * c]; // [3, T, C]
    for t in 0..sp.len {
        for (which, x) in xs.iter().enumerate() {
            let xt = &x[(base + t) * c..(base + t + 1) * c];
            let win = &mut conv[which * win_len..(which + 1) * win_len];
            let taps = &w.conv[which]; // [C, kc]
            let out = &mut qkv[(which * sp.len + t) * c..(which * sp.len + t + 1) * c];
            for ch in 0..c {
                let mut y = 0.0f32;
                for j in 0..kc - 1 {
                    y += taps[ch * kc + j] * win[j * c + ch];
                }
                y += taps[ch * kc + kc - 1] * xt[ch];
                out[ch] = silu(y);
            }
            if kc > 1 {
                win.copy_within(c.., 0);
                win[(kc - 2) * c..].copy_from_slice(xt);
            }
        }
        if sp.snapshot && t + 1 < sp.len {
            let (cv, _) = store.state_mut(layer, sp.state_table[t + 1]);
            cv.copy_from_slice(conv);
        }
    }
    qkv
}

/// Step 2: the gated delta rule per token and head of one span: updates S [nl, dl, dl] and writes
/// the span's rows of `o` [T_total, nl, dl]; state snapshots of a verify span. S is
/// walked row by row (key i), two fused passes, each per-element sum still in ascending
/// i from 0. Pass one: `S[i,:] *= alpha_i; acc += S[i,:] * k_i` (`u = v - acc = v - S^T k`);
/// pass two: `S[i,:] += beta * (k_i * u); o += S[i,:] * q_i` (`o = S^T q`).
fn delta_span(
    ctx: &KdaCtx<'_>,
    sp: &Span<'_>,
    qkv: &[f32],
    s: &mut [f32],
    o: &mut [f32],
    store: &mut KvStore,
    layer: usize,
) {
    let (nl, dl, c) = (ctx.nl, ctx.dl, ctx.c);
    let mut u = vec![0.0f32; dl];
    let mut qv = vec![0.0f32; dl];
    let mut kv = vec![0.0f32; dl];
    for t in 0..sp.len {
        let row = sp.offset + t;
        for hd in 0..nl {
            qv.copy_from_slice(&qkv[t * c + hd * dl..t * c + (hd + 1) * dl]);
            kv.copy_from_slice(&qkv[(sp.len + t) * c + hd * dl..(sp.len + t) * c + (hd + 1) * dl]);
            let vv = &qkv[(2 * sp.len + t) * c + hd * dl..(2 * sp.len + t) * c + (hd + 1) * dl];
            l2norm_inplace(&mut qv);
            for x in qv.iter_mut() {
                *x *= ctx.qscale;
            }
            l2norm_inplace(&mut kv);
            let beta = sigmoid(ctx.b[row * nl + hd]);
            let sh = &mut s[hd * dl * dl..(hd + 1) * dl * dl]; // [key, value]
            u.fill(0.0);
            for (i, srow) in sh.chunks_exact_mut(dl).enumerate() {
                let ch = hd * dl + i;
                let alpha =
                    (ctx.neg_a[hd] * softplus(ctx.f[row * c + ch] + ctx.w.dt_bias[ch])).exp();
                let ki = kv[i];
                for (x, acc) in srow.iter_mut().zip(u.iter_mut()) {
                    *x *= alpha;
                    *acc += *x * ki;
                }
            }
            for (uv, &v) in u.iter_mut().zip(vv) {
                *uv = v - *uv;
            }
            let orow = &mut o[row * c + hd * dl..row * c + (hd + 1) * dl];
            orow.fill(0.0);
            for (i, srow) in sh.chunks_exact_mut(dl).enumerate() {
                let (ki, qi) = (kv[i], qv[i]);
                for ((x, &uv), ov) in srow.iter_mut().zip(&u).zip(orow.iter_mut()) {
                    *x += beta * (ki * uv);
                    *ov += *x * qi;
                }
            }
        }
        if sp.snapshot && t + 1 < sp.len {
            let (_, sv) = store.state_mut(layer, sp.state_table[t + 1]);
            sv.copy_from_slice(s);
        }
    }
}
