//! Speculative sampling is lossless: chi-square tests of the emitted tokens.
//!
//! On a small vocabulary (V = 6) with fixed target logits and fixed draft
//! distributions q, a drafter samples k = 2 draft tokens from q and
//! `VerifyCtx::verify` checks them against the target. Over many seeded draws
//! the first emitted token must be distributed as the target's p (row 0), the
//! second, given the first draft was accepted, as p (row 1), and the bonus,
//! given both were accepted, as p (row 2); and each draft position must be
//! accepted at the rate sum_x min(p, q) (sum_x q p for a one-hot q), which
//! catches a verifier that is lossless but wasteful (e.g. one that rejects
//! every draft and samples p: its first token is still distributed as p).
//! Each test rejects at p-value 1e-4:
//! the runs are seeded (deterministic), so the threshold only decides how
//! strong a bug must be to be caught, and the negative controls show that
//! a verifier sampling the correction from p (instead of norm(max(0, p - q)))
//! or from the sign-flipped residual fails by orders of magnitude.
//!
//! Statistics are printed (`cargo test --test spec_lossless -- --nocapture`).

use speclab_engine::spec::sampling::{sample_index, target_probs, uniform};
use speclab_engine::spec::{
    seeded_rng, DraftProbs, SamplingParams, SparseProbs, SpecRng, VerifyCtx,
};
use speclab_engine::Proposal;

const V: usize = 6;
/// 100k draws per test keeps the file under 3 s in a debug build even run
/// serially; the critical value depends only on the degrees of freedom.
const DRAWS: usize = 100_000;
const ALPHA: f64 = 1e-4;

/// Target logits for the k + 1 = 3 positions of a verify pass.
const LOGITS: [[f32; V]; 3] = [
    [1.2, 0.3, -0.5, 0.8, -1.0, 0.1],
    [-0.2, 0.9, 0.4, -0.7, 0.6, 0.0],
    [0.5, -0.3, 1.1, 0.2, -0.8, 0.7],
];

/// Draft distributions for the 2 draft positions; each has one zero where p > 0 (so the
/// sparse form below leaves a token out of every row).
const Q: [[f32; V]; 2] = [
    [0.30, 0.0, 0.25, 0.05, 0.25, 0.15],
    [0.05, 0.10, 0.40, 0.25, 0.0, 0.20],
];

fn flat_logits() -> Vec<f32> {
    LOGITS.concat()
}

fn q_rows() -> Vec<Vec<f32>> {
    Q.iter().map(|r| r.to_vec()).collect()
}

/// Regularized upper incomplete gamma Q(a, x) (series / continued fraction).
fn gamma_q(a: f64, x: f64) -> f64 {
    let ln_gamma_a = ln_gamma(a);
    if x <= 0.0 {
        return 1.0;
    }
    if x < a + 1.0 {
        let (mut ap, mut sum, mut del) = (a, 1.0 / a, 1.0 / a);
        for _ in 0..10_000 {
            ap += 1.0;
            del *= x / ap;
            sum += del;
            if del.abs() < sum.abs() * 1e-15 {
                break;
            }
        }
        1.0 - sum * (-x + a * x.ln() - ln_gamma_a).exp()
    } else {
        let tiny = 1e-300;
        let (mut b, mut c) = (x + 1.0 - a, 1.0 / tiny);
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let del = d * c;
            h *= del;
            if (del - 1.0).abs() < 1e-15 {
                break;
            }
        }
        (-x + a * x.ln() - ln_gamma_a).exp() * h
    }
}

/// ln Gamma(a) for a = df / 2 (half-integers and integers).
fn ln_gamma(a: f64) -> f64 {
    // Lanczos (g = 7, n = 9).
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    let x = a - 1.0;
    let t = x + 7.5;
    let mut s = C[0];
    for (i, c) in C.iter().enumerate().skip(1) {
        s += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + s.ln()
}

/// Pearson chi-square of `counts` against `probs`: (statistic, df, p-value).
/// Cells with zero expected probability must have zero counts and are left
/// out of the statistic and the degrees of freedom.
fn chi_square(counts: &[u64], probs: &[f64]) -> (f64, usize, f64) {
    let n: u64 = counts.iter().sum();
    assert!(n > 0, "no observations");
    let mut stat = 0.0;
    let mut cells = 0usize;
    for (&c, &p) in counts.iter().zip(probs) {
        if p == 0.0 {
            assert_eq!(c, 0, "a token with target probability 0 was emitted");
            continue;
        }
        let e = n as f64 * p;
        assert!(
            e >= 5.0,
            "expected count {e} too small for the chi-square approximation"
        );
        stat += (c as f64 - e).powi(2) / e;
        cells += 1;
    }
    let df = cells - 1;
    (stat, df, gamma_q(df as f64 / 2.0, stat / 2.0))
}

/// Emitted-token histograms of a spec-sampling process.
#[derive(Default)]
struct Hist {
    first: [u64; V],
    second_given_first_accepted: [u64; V],
    third_given_both_accepted: [u64; V],
    accepted: u64,
    /// Steps whose draft 0 was accepted, and whose drafts 0 and 1 were.
    accepted_pos: [u64; 2],
}

impl Hist {
    fn add(&mut self, accepted: usize, tokens: &[u32]) {
        assert_eq!(tokens.len(), accepted + 1);
        self.accepted += accepted as u64;
        for (i, c) in self.accepted_pos.iter_mut().enumerate() {
            if accepted > i {
                *c += 1;
            }
        }
        self.first[tokens[0] as usize] += 1;
        if accepted >= 1 {
            self.second_given_first_accepted[tokens[1] as usize] += 1;
        }
        if accepted >= 2 {
            self.third_given_both_accepted[tokens[2] as usize] += 1;
        }
    }
}

/// How the drafter hands q to the verifier.
#[derive(Clone, Copy)]
enum QForm {
    /// No q (one-hot of the draft).
    None,
    /// Dense rows over the vocabulary.
    Dense,
    /// Sparse (id, p) rows holding the same numbers, ids in a shuffled order.
    Sparse,
}

/// Q as sparse rows: each row's nonzero entries (5 of 6), in the order 3, 0, 5, 1, 4, 2.
fn sparse_q_rows() -> DraftProbs {
    let order = [3usize, 0, 5, 1, 4, 2];
    let (mut ids, mut p) = (Vec::new(), Vec::new());
    for row in &Q {
        for &i in order.iter().filter(|&&i| row[i] > 0.0) {
            ids.push(i as u32);
            p.push(row[i]);
        }
    }
    assert_eq!(
        ids.len(),
        2 * (V - 1),
        "every row of Q has exactly one zero"
    );
    DraftProbs::Sparse(SparseProbs { k: V - 1, ids, p })
}

/// Run `DRAWS` draft + verify steps of the real verifier.
fn run_real(params: SamplingParams, form: QForm, seed: u64) -> Hist {
    let logits = flat_logits();
    let q = match form {
        QForm::None => None,
        QForm::Dense => Some(DraftProbs::Dense(q_rows())),
        QForm::Sparse => Some(sparse_q_rows()),
    };
    let q64: Vec<Vec<f64>> = Q
        .iter()
        .map(|r| r.iter().map(|&x| f64::from(x)).collect())
        .collect();
    let mut rng = seeded_rng(seed);
    let mut h = Hist::default();
    let mut proposal = Proposal {
        tokens: Vec::new(),
        probs: q,
    };
    for _ in 0..DRAWS {
        // The drafter samples each draft token from its q.
        proposal.tokens.clear();
        proposal.tokens.extend(
            q64.iter()
                .map(|qi| sample_index(qi, &mut rng).unwrap() as u32),
        );
        let v = VerifyCtx::new(params, &mut rng)
            .verify(&logits, V, &proposal)
            .unwrap();
        h.add(v.accepted, &v.tokens);
    }
    h
}

fn target(params: SamplingParams) -> Vec<Vec<f64>> {
    LOGITS
        .iter()
        .map(|row| target_probs(row, &params).unwrap())
        .collect()
}

/// Acceptance probability of draft position i given the earlier ones were
/// accepted: sum_x min(p(x), q(x)) with the drafter's q, or sum_x q(x) p(x)
/// when the verifier treats q as the one-hot of the sampled draft.
fn expected_acceptance(p: &[Vec<f64>], one_hot: bool) -> [f64; 2] {
    let mut a = [0.0; 2];
    for (i, ai) in a.iter_mut().enumerate() {
        *ai = Q[i]
            .iter()
            .zip(&p[i])
            .map(|(&q, &pp)| {
                if one_hot {
                    f64::from(q) * pp
                } else {
                    f64::from(q).min(pp)
                }
            })
            .sum();
    }
    a
}

/// Two-sided binomial z-test of `hits` out of `n` against rate `a`; fails
/// beyond |z| = 3.891 (p-value 1e-4). Catches a verifier that is lossless but
/// wasteful (e.g. one that rejects too often).
fn check_rate(name: &str, label: &str, hits: u64, n: u64, a: f64) {
    let got = hits as f64 / n as f64;
    let z = (got - a) / (a * (1.0 - a) / n as f64).sqrt();
    eprintln!("{name}: {label}: acceptance {got:.4} vs expected {a:.4} (n = {n}, z = {z:.2})");
    assert!(
        z.abs() < 3.891,
        "{name}: {label}: acceptance {got} vs {a}, z = {z}"
    );
}

/// Check the three histograms against the target rows and the per-position
/// acceptance against `a`; returns the chi-square p-values.
fn check_lossless(name: &str, h: &Hist, p: &[Vec<f64>], a: [f64; 2]) -> [f64; 3] {
    check_rate(
        name,
        "draft 0 accepted",
        h.accepted_pos[0],
        DRAWS as u64,
        a[0],
    );
    check_rate(
        name,
        "draft 1 accepted | draft 0 accepted",
        h.accepted_pos[1],
        h.accepted_pos[0],
        a[1],
    );
    let mut out = [0.0; 3];
    for (i, (counts, label)) in [
        (&h.first, "first emitted"),
        (&h.second_given_first_accepted, "second | first accepted"),
        (&h.third_given_both_accepted, "bonus | both accepted"),
    ]
    .into_iter()
    .enumerate()
    {
        let (stat, df, pv) = chi_square(counts, &p[i]);
        let n: u64 = counts.iter().sum();
        eprintln!("{name}: {label}: n = {n}, chi2 = {stat:.3}, df = {df}, p-value = {pv:.4}");
        assert!(pv > ALPHA, "{name}: {label} is not distributed as the target (chi2 {stat:.2}, df {df}, p {pv:.2e})");
        out[i] = pv;
    }
    eprintln!(
        "{name}: draft acceptance rate = {:.4}",
        h.accepted as f64 / (2 * DRAWS) as f64
    );
    out
}

#[test]
fn chi_square_helper_is_calibrated() {
    // Known critical values at 1e-4: df 3 -> 21.108, df 5 -> 25.745.
    assert!((gamma_q(1.5, 21.108 / 2.0) - 1e-4).abs() < 1e-7);
    assert!((gamma_q(2.5, 25.745 / 2.0) - 1e-4).abs() < 1e-7);
    // Median of chi2(2) is 2 ln 2; Q(1, x) = exp(-x).
    assert!((gamma_q(1.0, 2.0_f64.ln()) - 0.5).abs() < 1e-12);
    // Half-integer closed form: Q(2.5, 1) = erfc(1) + e^-1 (1/G(1.5) + 1/G(2.5)).
    assert!((gamma_q(2.5, 1.0) - 0.849_145_036_084_609_6).abs() < 1e-10);
}

#[test]
fn temperature_with_draft_probs_is_lossless() {
    let params = SamplingParams::random(0.8);
    let h = run_real(params, QForm::Dense, 0x5eed_0001);
    let p = target(params);
    check_lossless("T=0.8, q given", &h, &p, expected_acceptance(&p, false));
}

#[test]
fn sparse_draft_probs_are_lossless() {
    // The same q as (id, p) pairs (DFlash2's candidate-set q on the CUDA engine).
    let params = SamplingParams::random(0.8);
    let h = run_real(params, QForm::Sparse, 0x5eed_0005);
    let p = target(params);
    check_lossless("T=0.8, sparse q", &h, &p, expected_acceptance(&p, false));
}

#[test]
fn one_hot_q_without_draft_probs_is_lossless() {
    // An n-gram-like drafter gives no probs: q is the one-hot of the draft
    // token whatever distribution actually produced it.
    let params = SamplingParams::random(1.0);
    let h = run_real(params, QForm::None, 0x5eed_0002);
    let p = target(params);
    check_lossless(
        "T=1, no probs (one-hot q)",
        &h,
        &p,
        expected_acceptance(&p, true),
    );
}

#[test]
fn top_k_top_p_target_is_lossless() {
    // The target's processed distribution (top-k 5 then top-p 0.85) has
    // zero-mass tokens the drafter still proposes.
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 5,
        top_p: 0.85,
    };
    let p = target(params);
    assert!(
        p.iter()
            .all(|row| row.iter().filter(|x| **x == 0.0).count() >= 1),
        "{p:?}"
    );
    let h = run_real(params, QForm::Dense, 0x5eed_0003);
    check_lossless(
        "T=0.9 top-k 5 top-p 0.85, q given",
        &h,
        &p,
        expected_acceptance(&p, false),
    );
}

/// The negative controls' bugs.
#[derive(Clone, Copy)]
enum Bug {
    /// Sample the correction from p instead of norm(max(0, p - q)).
    CorrectionFromP,
    /// Sample the correction from norm(max(0, q - p)) (sign flipped).
    FlippedResidual,
}

/// A deliberately wrong verifier, otherwise the same algorithm.
fn verify_buggy(
    p: &[Vec<f64>],
    q: &[Vec<f64>],
    draft: &[u32],
    rng: &mut SpecRng,
    bug: Bug,
) -> (usize, Vec<u32>) {
    let mut out = Vec::new();
    for (i, &x) in draft.iter().enumerate() {
        let x = x as usize;
        if q[i][x] > 0.0 && uniform(rng) < p[i][x] / q[i][x] {
            out.push(x as u32);
            continue;
        }
        let w: Vec<f64> = match bug {
            Bug::CorrectionFromP => p[i].clone(),
            Bug::FlippedResidual => q[i]
                .iter()
                .zip(&p[i])
                .map(|(a, b)| (a - b).max(0.0))
                .collect(),
        };
        out.push(sample_index(&w, rng).unwrap() as u32);
        return (i, out);
    }
    out.push(sample_index(&p[draft.len()], rng).unwrap() as u32);
    (draft.len(), out)
}

fn first_token_p_value_of_buggy(bug: Bug, seed: u64) -> (f64, f64) {
    let p = target(SamplingParams::random(0.8));
    let q: Vec<Vec<f64>> = Q
        .iter()
        .map(|r| r.iter().map(|&x| f64::from(x)).collect())
        .collect();
    let mut rng = seeded_rng(seed);
    let mut h = Hist::default();
    for _ in 0..DRAWS {
        let draft: Vec<u32> = q
            .iter()
            .map(|qi| sample_index(qi, &mut rng).unwrap() as u32)
            .collect();
        let (a, t) = verify_buggy(&p, &q, &draft, &mut rng, bug);
        h.add(a, &t);
    }
    let (stat, df, pv) = chi_square(&h.first, &p[0]);
    eprintln!("negative control: first emitted: chi2 = {stat:.1}, df = {df}, p-value = {pv:.3e}");
    (stat, pv)
}

#[test]
fn negative_control_correction_from_p_fails() {
    let (stat, pv) = first_token_p_value_of_buggy(Bug::CorrectionFromP, 0x5eed_0004);
    assert!(pv < ALPHA, "the buggy verifier passed (chi2 {stat})");
    // Expected noncentrality at these p, q and 100k draws is ~12,000: far
    // beyond the 25.7 critical value.
    assert!(stat > 1_000.0, "chi2 {stat}");
}

#[test]
fn negative_control_flipped_residual_fails() {
    let (stat, pv) = first_token_p_value_of_buggy(Bug::FlippedResidual, 0x5eed_0005);
    assert!(pv < ALPHA, "the buggy verifier passed (chi2 {stat})");
    assert!(stat > 1_000.0, "chi2 {stat}");
}
