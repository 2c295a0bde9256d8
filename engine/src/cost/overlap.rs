//! Expert overlap: how many distinct routed experts a batch of rows touches.
//!
//! What it computes: `E[distinct experts]` of one MoE layer with `E` experts and top-`k`
//! routing for a batch whose rows come from sequences ([`Routing::expected_distinct`]),
//! under three routings that combine:
//!
//! - uniform: every row draws a uniformly random `k`-subset (without replacement), so a
//!   row misses a given expert with probability `q = 1 - k/E` and, rows independent,
//!   `E[distinct] = E (1 - q^R)` for `R` rows (exact; DESIGN.md: 1 / 4 / 16 rows touch
//!   about 8 / 31 / 104 of 288 experts at top-8);
//! - skewed (`zipf > 0`): expert `e` (0-based popularity rank) has weight
//!   `(e + 1)^-zipf`; its per-row inclusion probability is approximated by
//!   `pi_e = 1 - (1 - p_e)^t` with `t` chosen so that `sum pi_e = k` (the usual
//!   approximation of successive sampling; checked against Monte Carlo in the tests);
//! - sequence-correlated (`reuse > 0`): within one sequence each row after the first
//!   reuses the previous row's experts with probability `reuse`, else draws afresh. A
//!   sequence of `r` rows then makes `F = 1 + Binomial(r - 1, 1 - reuse)` fresh draws and
//!   `E[(1 - pi)^F] = (1 - pi) (reuse + (1 - reuse)(1 - pi))^(r - 1)` (exact), so a batch
//!   of `S` sequences and `R` rows misses expert `e` with probability
//!   `(1 - pi_e)^S (reuse + (1 - reuse)(1 - pi_e))^(R - S)`.
//!
//! [`monte_carlo`] samples the same process with a seeded RNG (the closed forms are
//! checked against it), and [`fit_reuse`] solves for the `reuse` that explains a measured
//! count (e.g. `mean_verify_experts` of a real record of models/tiny).
//!
//! Invariants: `expected_distinct` is in `[min(E, k), E]` for a non-empty batch and 0
//! for an empty one, non-decreasing in rows and non-increasing in `reuse`.

use rand::seq::index::sample;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::{EngineError, Result};

/// Routing statistics of a MoE target (module doc). Default: uniform, independent rows.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Routing {
    /// Zipf exponent of expert popularity (0 = uniform).
    #[serde(default)]
    pub zipf: f64,
    /// Probability that a row reuses the previous row's experts of the same sequence.
    #[serde(default)]
    pub reuse: f64,
}

impl Routing {
    /// Uniform, independent rows.
    pub const UNIFORM: Routing = Routing {
        zipf: 0.0,
        reuse: 0.0,
    };

    /// `zipf` finite and >= 0, `reuse` in [0, 1].
    pub fn validate(&self) -> Result<()> {
        if !(self.zipf.is_finite() && self.zipf >= 0.0) {
            return Err(EngineError::Unsupported(format!(
                "cost model: routing.zipf: {} must be a finite number >= 0",
                self.zipf
            )));
        }
        if !(0.0..=1.0).contains(&self.reuse) {
            return Err(EngineError::Unsupported(format!(
                "cost model: routing.reuse: {} must be a probability in [0, 1]",
                self.reuse
            )));
        }
        Ok(())
    }

    /// Per-row inclusion probability of each expert. Shape: [experts].
    pub fn inclusion(&self, experts: u32, top_k: u32) -> Vec<f64> {
        let e = experts as usize;
        let k = f64::from(top_k.min(experts));
        if self.zipf == 0.0 || e == 0 {
            return vec![k / e.max(1) as f64; e];
        }
        let w: Vec<f64> = (0..e).map(|i| ((i + 1) as f64).powf(-self.zipf)).collect();
        let sum: f64 = w.iter().sum();
        let p: Vec<f64> = w.iter().map(|x| x / sum).collect();
        let incl = |t: f64| -> Vec<f64> { p.iter().map(|pi| 1.0 - (1.0 - pi).powf(t)).collect() };
        // sum_e pi_e(t) is increasing in t: bisect for sum = k.
        let (mut lo, mut hi) = (0.0f64, 1.0f64);
        while incl(hi).iter().sum::<f64>() < k && hi < 1e12 {
            hi *= 2.0;
        }
        for _ in 0..200 {
            let mid = 0.5 * (lo + hi);
            if incl(mid).iter().sum::<f64>() < k {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        incl(hi)
    }

    /// Expected distinct experts of one layer for a batch whose sequence `s` has
    /// `seq_rows[s]` rows (module doc).
    pub fn expected_distinct(&self, experts: u32, top_k: u32, seq_rows: &[u64]) -> f64 {
        let seqs = seq_rows.iter().filter(|&&r| r > 0).count() as f64;
        let rows: u64 = seq_rows.iter().sum();
        self.expected_distinct_sr(experts, top_k, seqs, rows as f64)
    }

    /// Sum over experts of `h (1 - h)`, `h` the probability that the batch touches the
    /// expert: the variance of the distinct count were the experts' hits independent
    /// (used for the busiest expert-parallel rank, `cost::busiest_rank`).
    pub fn distinct_variance(&self, experts: u32, top_k: u32, seq_rows: &[u64]) -> f64 {
        let seqs = seq_rows.iter().filter(|&&r| r > 0).count() as f64;
        let rows = seq_rows.iter().sum::<u64>() as f64;
        if rows <= 0.0 || seqs <= 0.0 {
            return 0.0;
        }
        let hit = |pi: f64| {
            let q = 1.0 - pi;
            1.0 - q.powf(seqs) * (self.reuse + (1.0 - self.reuse) * q).powf(rows - seqs)
        };
        if self.zipf == 0.0 {
            let h = hit(f64::from(top_k.min(experts)) / f64::from(experts.max(1)));
            return f64::from(experts) * h * (1.0 - h);
        }
        self.inclusion(experts, top_k)
            .iter()
            .map(|&pi| hit(pi) * (1.0 - hit(pi)))
            .sum()
    }

    /// [`Self::expected_distinct`] from the counts alone: `seqs` sequences, `rows` rows.
    pub fn expected_distinct_sr(&self, experts: u32, top_k: u32, seqs: f64, rows: f64) -> f64 {
        if rows <= 0.0 || seqs <= 0.0 {
            return 0.0;
        }
        let rho = self.reuse;
        let miss = |pi: f64| {
            let q = 1.0 - pi;
            q.powf(seqs) * (rho + (1.0 - rho) * q).powf(rows - seqs)
        };
        if self.zipf == 0.0 {
            let pi = f64::from(top_k.min(experts)) / f64::from(experts.max(1));
            return f64::from(experts) * (1.0 - miss(pi));
        }
        self.inclusion(experts, top_k)
            .iter()
            .map(|&pi| 1.0 - miss(pi))
            .sum()
    }
}

/// Draw one row's experts: uniform `k`-subset, or successive weighted sampling.
fn draw<R: Rng>(rng: &mut R, weights: &[f64], top_k: usize) -> Vec<usize> {
    let e = weights.len();
    if weights.iter().all(|&w| w == weights[0]) {
        return sample(rng, e, top_k.min(e)).into_vec();
    }
    let mut left: Vec<f64> = weights.to_vec();
    let mut out = Vec::with_capacity(top_k);
    for _ in 0..top_k.min(e) {
        let total: f64 = left.iter().sum();
        let mut u = rng.random::<f64>() * total;
        let mut pick = e - 1;
        for (i, &w) in left.iter().enumerate() {
            if w > 0.0 && u < w {
                pick = i;
                break;
            }
            u -= w;
        }
        out.push(pick);
        left[pick] = 0.0;
    }
    out
}

/// Monte Carlo estimate of [`Routing::expected_distinct`] over `trials` batches, seeded.
pub fn monte_carlo(
    routing: &Routing,
    experts: u32,
    top_k: u32,
    seq_rows: &[u64],
    trials: u32,
    seed: u64,
) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let e = experts as usize;
    let weights: Vec<f64> = (0..e)
        .map(|i| ((i + 1) as f64).powf(-routing.zipf))
        .collect();
    let mut total = 0u64;
    for _ in 0..trials {
        let mut seen = vec![false; e];
        for &r in seq_rows {
            let mut prev: Vec<usize> = Vec::new();
            for row in 0..r {
                if row == 0 || rng.random::<f64>() >= routing.reuse {
                    prev = draw(&mut rng, &weights, top_k as usize);
                }
                for &x in &prev {
                    seen[x] = true;
                }
            }
        }
        total += seen.iter().filter(|&&s| s).count() as u64;
    }
    total as f64 / f64::from(trials.max(1))
}

/// The `reuse` in [0, 1] at which `layers x expected_distinct` of one sequence of `rows`
/// rows equals `measured` (uniform popularity); None when no reuse explains it (the
/// measured count is above the independent-rows value or below one row's).
pub fn fit_reuse(experts: u32, top_k: u32, layers: u32, rows: f64, measured: f64) -> Option<f64> {
    let at = |rho: f64| {
        f64::from(layers)
            * Routing {
                zipf: 0.0,
                reuse: rho,
            }
            .expected_distinct_sr(experts, top_k, 1.0, rows)
    };
    let (hi_val, lo_val) = (at(0.0), at(1.0));
    if measured > hi_val + 1e-9 || measured < lo_val - 1e-9 || rows <= 1.0 {
        return None;
    }
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        if at(mid) > measured {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(0.5 * (lo + hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_matches_design_numbers_and_monte_carlo() {
        let u = Routing::UNIFORM;
        // DESIGN.md: 1 / 4 / 16 tokens touch about 8 / 31 / 104 of 288 experts at top-8.
        for (rows, about) in [(1u64, 8.0), (4, 31.0), (16, 104.0)] {
            let seqs = vec![1u64; rows as usize];
            let d = u.expected_distinct(288, 8, &seqs);
            assert!((d - about).abs() < 1.0, "{rows} rows: {d}");
            let mc = monte_carlo(&u, 288, 8, &seqs, 4000, 7);
            assert!(
                (mc - d).abs() < 0.01 * d + 0.3,
                "{rows} rows: mc {mc} vs {d}"
            );
        }
        assert_eq!(u.expected_distinct(288, 8, &[]), 0.0);
    }

    #[test]
    fn correlated_closed_form_matches_monte_carlo() {
        for reuse in [0.3, 0.7] {
            let r = Routing { zipf: 0.0, reuse };
            for seqs in [vec![6u64], vec![3, 3, 3, 3], vec![1, 8, 2]] {
                let d = r.expected_distinct(64, 4, &seqs);
                let mc = monte_carlo(&r, 64, 4, &seqs, 6000, 11);
                assert!(
                    (mc - d).abs() < 0.01 * d + 0.2,
                    "{reuse} {seqs:?}: mc {mc} vs {d}"
                );
            }
        }
        // More reuse, fewer experts; reuse 1 = one draw per sequence.
        let a = Routing {
            zipf: 0.0,
            reuse: 0.2,
        }
        .expected_distinct(288, 8, &[6]);
        let b = Routing {
            zipf: 0.0,
            reuse: 0.8,
        }
        .expected_distinct(288, 8, &[6]);
        assert!(a > b);
        let one = Routing {
            zipf: 0.0,
            reuse: 1.0,
        }
        .expected_distinct(288, 8, &[6]);
        assert!((one - 8.0).abs() < 1e-9);
    }

    #[test]
    fn zipf_approximation_is_close_to_monte_carlo() {
        let z = Routing {
            zipf: 1.0,
            reuse: 0.0,
        };
        let incl = z.inclusion(64, 4);
        assert!((incl.iter().sum::<f64>() - 4.0).abs() < 1e-6);
        assert!(incl[0] > incl[63]);
        for rows in [1u64, 4, 16, 64] {
            let seqs = vec![1u64; rows as usize];
            let d = z.expected_distinct(64, 4, &seqs);
            let mc = monte_carlo(&z, 64, 4, &seqs, 3000, 5);
            assert!((mc - d).abs() < 0.04 * d, "{rows} rows: mc {mc} vs {d}");
            // Skew means fewer distinct experts than uniform (beyond one row).
            let u = Routing::UNIFORM.expected_distinct(64, 4, &seqs);
            assert!(rows == 1 || d < u, "{d} {u}");
        }
    }

    #[test]
    fn fit_reuse_inverts_the_closed_form() {
        let truth = Routing {
            zipf: 0.0,
            reuse: 0.4,
        };
        let measured = 7.0 * truth.expected_distinct(16, 2, &[5]);
        let got = fit_reuse(16, 2, 7, 5.0, measured).unwrap();
        assert!((got - 0.4).abs() < 1e-6, "{got}");
        assert!(fit_reuse(16, 2, 7, 5.0, 7.0 * 16.0).is_none());
    }
}
