//! Chunked KDA for prefill: the host reference of kda.cu's `kda_chunk_prep_{dl}` /
//! `kda_chunk_scan_{dl}`, and the slot arithmetic the kernels and the workspace share.
//!
//! Source: the chunkwise form of the gated delta rule (Yang, Kautz, Hatamizadeh, "Gated
//! Delta Networks", 2024, §3; the WY / UT-transform solve of fla's `chunk_gated_delta_rule`
//! and Kimi-Linear's `chunk_kda`, with a per-channel decay). Derivation for one head,
//! state `S [dk (key i), dv (value j)]`, one chunk of `L` tokens from `S0`
//! (engine/src/model/kda.rs is the per-token recurrence it must agree with):
//!
//! - per token: `S' = diag(alpha_t) S_{t-1}`, `u_t = v_t - S'^T k_t`,
//!   `S_t = S' + beta_t k_t u_t^T`, `o_t = S_t^T q_t`;
//! - `g_t = sum_{r <= t} log alpha_r` (inclusive, from the chunk's start, per channel) and
//!   `S_t = diag(e^{g_t}) X_t` give `X_t = X_{t-1} + beta_t e^{-g_t} k_t u_t^T`, so
//!   `u = T (V - K~ S0)` with `K~_t = e^{g_t} k_t`, `T = (I + A)^{-1}` and
//!   `A_ts = beta_s sum_i k_ti k_si e^{g_ti - g_si}` (s < t);
//! - `o_t = (e^{g_t} q_t)^T S0 + sum_{s <= t} B_ts u_s` with
//!   `B_ts = beta_s sum_i q_ti k_si e^{g_ti - g_si}`;
//! - `S_L = diag(e^{g_L}) S0 + sum_s (beta_s e^{g_L - g_s} k_s) u_s^T`.
//!
//! Every exponent is `g_t - g_s` with `s <= t` or `g_t` itself, never positive (log alpha
//! <= 0), so nothing overflows; the state-independent part (A, B, the triangular solve)
//! is computed for all chunks at once, and only `u = W~ - W S`, `o`, `S_L` walk the
//! chunks of a sequence in order.
//!
//! Invariants: a chunk covers at most [`chunk_len`] tokens of one span; chunk `c` of span
//! `s` (first row `r = row0[s] + c * BT`) owns workspace slot `s + r / BT`, unique among the
//! step's chunks and below [`slot_count`] (rows of spans are disjoint and increasing).
//! The reference sums in the kernels' orders; on CI it is checked against the per-token
//! recurrence, and on the device the kernels are checked against the CPU engine and the
//! per-token kernels (`crate::prefill`), not against this reference directly.

/// Value columns of the state one `kda_chunk_scan_{dl}` block owns (kda.cu `KDA_SCAN_JB`):
/// the scan's grid has `dl / SCAN_COLUMNS` blocks a (head, sequence).
pub const SCAN_COLUMNS: usize = 16;

/// Tokens of one chunk for head dim `dl`: 32, or 16 for `dl >= 128` (the prep kernel's
/// four `[BT, dl + 1]` shared arrays stay under 48 KiB).
pub const fn chunk_len(dl: usize) -> usize {
    if dl >= 128 {
        16
    } else {
        32
    }
}

/// Floats of one (chunk, head) in the chunk workspace: `W`, `U~`, `Q~`, `K-` (each
/// `[BT, dl]`), `B [BT, BT]`, `gamma [dl]`.
pub const fn chunk_floats(dl: usize) -> usize {
    let bt = chunk_len(dl);
    4 * bt * dl + bt * bt + dl
}

/// Workspace slots a step of `t` tokens in `s` spans can use (see the module invariant).
pub fn slot_count(t: usize, s: usize, dl: usize) -> usize {
    s + t.div_ceil(chunk_len(dl))
}

/// The slot of the chunk starting at row `r` of span `s`.
pub fn slot(s: usize, r: usize, dl: usize) -> usize {
    s + r / chunk_len(dl)
}

/// One head's inputs for a span of `n` tokens, after the conv, the norms and the gates.
pub struct HeadIn<'a> {
    pub dl: usize,
    /// `l2norm(q) * dl^-0.5`. Shape: [n, dl].
    pub q: &'a [f32],
    /// `l2norm(k)`. Shape: [n, dl].
    pub k: &'a [f32],
    /// Shape: [n, dl].
    pub v: &'a [f32],
    /// `log alpha = -exp(A_log) softplus(f + dt_bias)`. Shape: [n, dl].
    pub log_alpha: &'a [f32],
    /// `sigmoid(b)`. Shape: [n].
    pub beta: &'a [f32],
}

/// What the prep kernel stores for one (chunk, head): [`chunk_floats`] in this order.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkPrep {
    /// `T K~`. Shape: [L, dl].
    pub w: Vec<f32>,
    /// `T V`. Shape: [L, dl].
    pub u: Vec<f32>,
    /// `e^{g_t} q_t`. Shape: [L, dl].
    pub qt: Vec<f32>,
    /// `beta_s e^{g_L - g_s} k_s`. Shape: [L, dl].
    pub kb: Vec<f32>,
    /// `B` (zero above the diagonal). Shape: [L, L].
    pub b: Vec<f32>,
    /// `e^{g_L}`. Shape: [dl].
    pub gamma: Vec<f32>,
}

/// The state-independent part of chunk `[t0, t0 + l)` (kernel `kda_chunk_prep_{dl}` after
/// its conv and norms).
pub fn prep(x: &HeadIn<'_>, t0: usize, l: usize) -> ChunkPrep {
    let dl = x.dl;
    let at = |a: &[f32], t: usize, i: usize| a[(t0 + t) * dl + i];
    // Inclusive cumulative log-decay, ascending t.
    let mut g = vec![0.0f32; l * dl]; // [L, dl]
    for t in 0..l {
        for i in 0..dl {
            let prev = if t == 0 { 0.0 } else { g[(t - 1) * dl + i] };
            g[t * dl + i] = prev + at(x.log_alpha, t, i);
        }
    }
    let beta = |s: usize| x.beta[t0 + s];
    let mut a = vec![0.0f32; l * l]; // strictly lower
    let mut b = vec![0.0f32; l * l]; // lower, diagonal included
    for t in 0..l {
        for s in 0..=t {
            let (mut da, mut db) = (0.0f32, 0.0f32);
            for i in 0..dl {
                let kk = at(x.k, s, i) * (g[t * dl + i] - g[s * dl + i]).exp();
                da += at(x.k, t, i) * kk;
                db += at(x.q, t, i) * kk;
            }
            if s < t {
                a[t * l + s] = beta(s) * da;
            }
            b[t * l + s] = beta(s) * db;
        }
    }
    let last = (l - 1) * dl;
    let mut qt = vec![0.0f32; l * dl];
    let mut kb = vec![0.0f32; l * dl];
    let mut w = vec![0.0f32; l * dl];
    let mut u = vec![0.0f32; l * dl];
    for t in 0..l {
        for i in 0..dl {
            let e = g[t * dl + i].exp();
            qt[t * dl + i] = e * at(x.q, t, i);
            kb[t * dl + i] = beta(t) * (g[last + i] - g[t * dl + i]).exp() * at(x.k, t, i);
            w[t * dl + i] = e * at(x.k, t, i);
            u[t * dl + i] = at(x.v, t, i);
        }
    }
    // Forward substitution (I + A) X = R, column by column, ascending s.
    for m in [&mut w, &mut u] {
        for t in 0..l {
            for col in 0..dl {
                let mut r = m[t * dl + col];
                for s in 0..t {
                    r -= a[t * l + s] * m[s * dl + col];
                }
                m[t * dl + col] = r;
            }
        }
    }
    let gamma = (0..dl).map(|i| g[last + i].exp()).collect();
    ChunkPrep {
        w,
        u,
        qt,
        kb,
        b,
        gamma,
    }
}

/// One chunk of the scan (kernel `kda_chunk_scan_{dl}`): `S [dl, dl]` in place, `o [L, dl]`.
pub fn scan(p: &ChunkPrep, dl: usize, s: &mut [f32], o: &mut [f32]) {
    let l = p.w.len() / dl;
    let mut u = vec![0.0f32; l * dl];
    for t in 0..l {
        for j in 0..dl {
            let mut dot = 0.0f32;
            for i in 0..dl {
                dot += p.w[t * dl + i] * s[i * dl + j];
            }
            u[t * dl + j] = p.u[t * dl + j] - dot;
        }
    }
    for t in 0..l {
        for j in 0..dl {
            let mut acc = 0.0f32;
            for i in 0..dl {
                acc += p.qt[t * dl + i] * s[i * dl + j];
            }
            for q in 0..=t {
                acc += p.b[t * l + q] * u[q * dl + j];
            }
            o[t * dl + j] = acc;
        }
    }
    for i in 0..dl {
        for j in 0..dl {
            let mut acc = p.gamma[i] * s[i * dl + j];
            for q in 0..l {
                acc += p.kb[q * dl + i] * u[q * dl + j];
            }
            s[i * dl + j] = acc;
        }
    }
}

/// One head over a span of `n = x.beta.len()` tokens from state `s` (`[dl, dl]`, updated
/// in place), chunk by chunk. Returns `o [n, dl]`.
pub fn head(x: &HeadIn<'_>, s: &mut [f32]) -> Vec<f32> {
    let (dl, n) = (x.dl, x.beta.len());
    let bt = chunk_len(dl);
    let mut o = vec![0.0f32; n * dl];
    let mut t0 = 0;
    while t0 < n {
        let l = bt.min(n - t0);
        let p = prep(x, t0, l);
        scan(&p, dl, s, &mut o[t0 * dl..(t0 + l) * dl]);
        t0 += l;
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The per-token recurrence of engine/src/model/kda.rs `delta_span` (its two passes).
    fn sequential(x: &HeadIn<'_>, s: &mut [f32]) -> Vec<f32> {
        let (dl, n) = (x.dl, x.beta.len());
        let mut o = vec![0.0f32; n * dl];
        let mut u = vec![0.0f32; dl];
        for t in 0..n {
            u.fill(0.0);
            for i in 0..dl {
                let alpha = x.log_alpha[t * dl + i].exp();
                for j in 0..dl {
                    s[i * dl + j] *= alpha;
                    u[j] += s[i * dl + j] * x.k[t * dl + i];
                }
            }
            for (uj, vj) in u.iter_mut().zip(&x.v[t * dl..(t + 1) * dl]) {
                *uj = vj - *uj;
            }
            for i in 0..dl {
                for j in 0..dl {
                    s[i * dl + j] += x.beta[t] * (x.k[t * dl + i] * u[j]);
                    o[t * dl + j] += s[i * dl + j] * x.q[t * dl + i];
                }
            }
        }
        o
    }

    fn unit(rng: &mut ChaCha8Rng, dl: usize, scale: f32) -> Vec<f32> {
        let v: Vec<f32> = (0..dl).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt() + 1e-6;
        v.iter().map(|x| x / n * scale).collect()
    }

    struct Case {
        dl: usize,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        la: Vec<f32>,
        beta: Vec<f32>,
        s0: Vec<f32>,
    }

    fn case(seed: u64, dl: usize, n: usize, decay: f32) -> Case {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let qs = (dl as f32).powf(-0.5);
        let mut c = Case {
            dl,
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            la: Vec::new(),
            beta: Vec::new(),
            s0: (0..dl * dl)
                .map(|_| rng.random_range(-0.5f32..0.5))
                .collect(),
        };
        for _ in 0..n {
            c.q.extend(unit(&mut rng, dl, qs));
            c.k.extend(unit(&mut rng, dl, 1.0));
            c.v.extend((0..dl).map(|_| rng.random_range(-2.0f32..2.0)));
            c.la.extend((0..dl).map(|_| -rng.random_range(0.0f32..decay)));
            c.beta.push(rng.random_range(0.0f32..1.0));
        }
        c
    }

    impl Case {
        fn input(&self) -> HeadIn<'_> {
            HeadIn {
                dl: self.dl,
                q: &self.q,
                k: &self.k,
                v: &self.v,
                log_alpha: &self.la,
                beta: &self.beta,
            }
        }
    }

    fn rel(a: &[f32], b: &[f32]) -> f32 {
        let m = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        a.iter().zip(b).fold(0f32, |e, (x, y)| e.max((x - y).abs())) / m.max(1e-30)
    }

    #[test]
    fn chunked_equals_the_recurrence() {
        // Lengths around the chunk size and several chunks; mild and strong decay.
        for (seed, (dl, n, decay)) in [
            (32, 1, 0.5),
            (32, 31, 0.5),
            (32, 32, 0.05),
            (64, 33, 0.5),
            (64, 100, 3.0),
            (128, 17, 0.5),
            (128, 50, 0.01),
        ]
        .into_iter()
        .enumerate()
        {
            let c = case(seed as u64, dl, n, decay);
            let (mut s1, mut s2) = (c.s0.clone(), c.s0.clone());
            let o1 = head(&c.input(), &mut s1);
            let o2 = sequential(&c.input(), &mut s2);
            assert!(rel(&o1, &o2) < 2e-5, "dl {dl} n {n}: o {}", rel(&o1, &o2));
            assert!(rel(&s1, &s2) < 2e-5, "dl {dl} n {n}: S {}", rel(&s1, &s2));
        }
    }

    #[test]
    fn a_wrong_decay_is_caught() {
        // The comparison can fail: the chunked form with one token's decay doubled differs.
        let c = case(9, 64, 40, 0.5);
        let mut bad = c.la.clone();
        for x in &mut bad[35 * 64..36 * 64] {
            *x *= 2.0;
        }
        let x = HeadIn {
            log_alpha: &bad,
            ..c.input()
        };
        let (mut s1, mut s2) = (c.s0.clone(), c.s0.clone());
        let o1 = head(&x, &mut s1);
        let o2 = sequential(&c.input(), &mut s2);
        assert!(rel(&o1, &o2) > 1e-3);
    }

    #[test]
    fn slots_are_unique_and_bounded() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for dl in [32, 64, 128] {
            let bt = chunk_len(dl);
            for _ in 0..200 {
                let lens: Vec<usize> = (0..rng.random_range(1..6))
                    .map(|_| rng.random_range(1..4 * bt))
                    .collect();
                let t: usize = lens.iter().sum();
                let mut seen = std::collections::HashSet::new();
                let mut row0 = 0;
                for (s, &n) in lens.iter().enumerate() {
                    for c in 0..n.div_ceil(bt) {
                        let k = slot(s, row0 + c * bt, dl);
                        assert!(k < slot_count(t, lens.len(), dl));
                        assert!(seen.insert(k), "slot {k} twice");
                    }
                    row0 += n;
                }
            }
        }
        assert_eq!(chunk_floats(64), 4 * 32 * 64 + 32 * 32 + 64);
    }
}
