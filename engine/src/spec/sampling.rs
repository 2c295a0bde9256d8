//! Target-side sampling: parameters, logits processing, seeded draws.
//!
//! What it does: [`SamplingParams`] are vLLM's temperature / top-k / top-p with
//! vLLM's ranges and "off" values; [`target_probs`] turns one row of logits
//! into the distribution the target samples from (vLLM
//! `apply_sampling_constraints`: divide by temperature, top-k mask, top-p
//! mask, softmax); [`argmax`] is the greedy choice (ties -> lowest index, like
//! `torch.argmax`); [`uniform`] and [`sample_index`] are the only places
//! randomness is drawn, always from a caller-owned RNG (no global state), so
//! drafters that sample from q can share them.
//!
//! Where it comes from: vLLM 0.33.0 `vllm/sampling_params.py` (ranges,
//! `_SAMPLING_EPS`), `vllm/v1/sample/rejection_sampler.py`
//! (`apply_sampling_constraints`) and `vllm/v1/sample/ops/topk_topp_sampler.py`
//! (`apply_top_k_top_p_pytorch`).
//!
//! Deviations: probabilities are computed in f64 (vLLM: f32), and top-p sorts
//! ties by index (torch's sort order for ties is unspecified), so boundary
//! cases of top-p can differ from vLLM in the last bits. vLLM draws categorical
//! samples with exponential noise (`argmax(p / Exp(1))`); here it is one
//! uniform through the inverse CDF: the same distribution, not the same
//! stream (RNG streams cannot match torch's anyway).
//!
//! Invariant: every function here is a pure function of its inputs and the
//! RNG state; none panics on user input.

use rand::{Rng, RngCore};
use serde::{Deserialize, Serialize};

use crate::{EngineError, Result};

/// vLLM `_SAMPLING_EPS`: a temperature below it means greedy.
pub const SAMPLING_EPS: f32 = 1e-5;

/// How the target samples (vLLM `SamplingParams`, the subset verification uses).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// In [0, 2]; below [`SAMPLING_EPS`] means greedy.
    pub temperature: f32,
    /// Keep the `top_k` largest logits (ties at the threshold kept); 0 = off.
    pub top_k: usize,
    /// Keep the smallest top set with mass >= `top_p`; in (0, 1], 1 = off.
    pub top_p: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::GREEDY
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0).
    pub const GREEDY: Self = Self {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
    };

    /// Plain temperature sampling, no top-k / top-p.
    pub fn random(temperature: f32) -> Self {
        Self {
            temperature,
            top_k: 0,
            top_p: 1.0,
        }
    }

    /// Whether these params decode greedily (vLLM: temperature < `_SAMPLING_EPS`).
    pub fn is_greedy(&self) -> bool {
        self.temperature < SAMPLING_EPS
    }

    /// vLLM's checks: temperature finite in [0, 2], top_p in (0, 1].
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, reason: String| {
            Err(EngineError::InvalidSamplingParams {
                field: field.into(),
                reason,
            })
        };
        if !self.temperature.is_finite() || !(0.0..=2.0).contains(&self.temperature) {
            return bad(
                "temperature",
                format!(
                    "must be a finite number in [0, 2], got {}",
                    self.temperature
                ),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("must be in (0, 1], got {}", self.top_p));
        }
        Ok(())
    }
}

fn bad_input(reason: String) -> EngineError {
    EngineError::InvalidVerifyInput { reason }
}

/// Check one row of logits: non-empty, no NaN, no +inf, at least one finite
/// value (-inf entries are masked tokens).
pub fn check_logits(logits: &[f32]) -> Result<()> {
    if logits.is_empty() {
        return Err(bad_input("empty logits row".into()));
    }
    if let Some(i) = logits
        .iter()
        .position(|x| x.is_nan() || *x == f32::INFINITY)
    {
        return Err(bad_input(format!("logit {i} is {}", logits[i])));
    }
    if logits.iter().all(|x| *x == f32::NEG_INFINITY) {
        return Err(bad_input("every logit is -inf".into()));
    }
    Ok(())
}

/// Greedy choice: the index of the largest logit, the lowest index on ties
/// (`torch.argmax`). Errors on a row [`check_logits`] refuses.
pub fn argmax(logits: &[f32]) -> Result<usize> {
    check_logits(logits)?;
    let mut best = 0usize;
    for (i, &x) in logits.iter().enumerate().skip(1) {
        if x > logits[best] {
            best = i;
        }
    }
    Ok(best)
}

/// The distribution the target samples from for one row of logits: logits /
/// temperature, then vLLM's top-k and top-p masks, then softmax (f64). For
/// greedy params it is the one-hot of [`argmax`]. Shape: `[vocab]`.
pub fn target_probs(logits: &[f32], params: &SamplingParams) -> Result<Vec<f64>> {
    params.validate()?;
    check_logits(logits)?;
    let v = logits.len();
    if params.is_greedy() {
        let mut p = vec![0.0; v];
        p[argmax(logits)?] = 1.0;
        return Ok(p);
    }
    let t = f64::from(params.temperature);
    let mut x: Vec<f64> = logits.iter().map(|&l| f64::from(l) / t).collect();
    // Ascending order, ties by index (torch sorts ascending; tie order unspecified).
    let needs_sort = (params.top_k > 0 && params.top_k < v) || params.top_p < 1.0;
    if needs_sort {
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|&a, &b| x[a].total_cmp(&x[b]).then(a.cmp(&b)));
        if params.top_k > 0 && params.top_k < v {
            // vLLM: mask logits strictly below the k-th largest value.
            let threshold = x[order[v - params.top_k]];
            for xi in x.iter_mut() {
                if *xi < threshold {
                    *xi = f64::NEG_INFINITY;
                }
            }
        }
        if params.top_p < 1.0 {
            // vLLM: softmax in ascending order, cumsum, mask where
            // cumsum <= 1 - p, always keep the largest.
            let mut sorted: Vec<f64> = order.iter().map(|&i| x[i]).collect();
            softmax_in_place(&mut sorted);
            let cut = 1.0 - f64::from(params.top_p);
            let mut cum = 0.0;
            for (j, &i) in order.iter().enumerate() {
                cum += sorted[j];
                if cum <= cut && j + 1 < v {
                    x[i] = f64::NEG_INFINITY;
                }
            }
        }
    }
    softmax_in_place(&mut x);
    Ok(x)
}

/// Softmax of f64 logits in place, -inf entries getting zero mass. Expects
/// at least one finite value.
fn softmax_in_place(x: &mut [f64]) {
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut s = 0.0;
    for xi in x.iter_mut() {
        *xi = if *xi == f64::NEG_INFINITY {
            0.0
        } else {
            (*xi - m).exp()
        };
        s += *xi;
    }
    for xi in x.iter_mut() {
        *xi /= s;
    }
}

/// One uniform draw in [0, 1) (53 random bits).
pub fn uniform(rng: &mut dyn RngCore) -> f64 {
    rng.random::<f64>()
}

/// Draw an index with probability proportional to `weights` (non-negative;
/// zero-weight entries are never drawn), with one uniform through the
/// inverse CDF. `None` when the weights have no positive finite mass.
pub fn sample_index(weights: &[f64], rng: &mut dyn RngCore) -> Option<usize> {
    sample_index_with(weights, &mut || uniform(rng))
}

/// [`sample_index`] with the uniform taken from `draw`, which is called once, and only
/// when the weights have positive finite mass (so a caller counting calls knows how
/// many uniforms the draw consumed: the device sampler's uniforms are drawn ahead).
pub fn sample_index_with(weights: &[f64], draw: &mut dyn FnMut() -> f64) -> Option<usize> {
    let total: f64 = weights.iter().filter(|w| **w > 0.0).sum();
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    let target = draw() * total;
    let mut cum = 0.0;
    let mut last = None;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            cum += w;
            last = Some(i);
            if target < cum {
                return Some(i);
            }
        }
    }
    // Rounding left the target at the very top: the last positive entry.
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12)
    }

    #[test]
    fn params_validation() {
        assert!(SamplingParams::GREEDY.validate().is_ok());
        assert!(SamplingParams::GREEDY.is_greedy());
        assert!(SamplingParams::random(1e-6).is_greedy());
        assert!(!SamplingParams::random(0.7).is_greedy());
        for p in [
            SamplingParams::random(-0.1),
            SamplingParams::random(2.5),
            SamplingParams::random(f32::NAN),
            SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.0,
            },
            SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.5,
            },
        ] {
            assert!(
                matches!(p.validate(), Err(EngineError::InvalidSamplingParams { .. })),
                "{p:?}"
            );
        }
    }

    #[test]
    fn argmax_ties_lowest_and_bad_rows() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]).unwrap(), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, -5.0]).unwrap(), 1);
        assert!(argmax(&[]).is_err());
        assert!(argmax(&[0.0, f32::NAN]).is_err());
        assert!(argmax(&[0.0, f32::INFINITY]).is_err());
        assert!(argmax(&[f32::NEG_INFINITY; 3]).is_err());
    }

    #[test]
    fn temperature_top_k_top_p() {
        let l = [2.0f32, 1.0, 0.0, 1.0];
        // Temperature 1: plain softmax.
        let e: Vec<f64> = l.iter().map(|&x| f64::from(x).exp()).collect();
        let s: f64 = e.iter().sum();
        let want: Vec<f64> = e.iter().map(|x| x / s).collect();
        assert!(close(
            &target_probs(&l, &SamplingParams::random(1.0)).unwrap(),
            &want
        ));
        // Temperature 0.5 doubles the logits.
        let e: Vec<f64> = l.iter().map(|&x| (2.0 * f64::from(x)).exp()).collect();
        let s: f64 = e.iter().sum();
        let want: Vec<f64> = e.iter().map(|x| x / s).collect();
        assert!(close(
            &target_probs(&l, &SamplingParams::random(0.5)).unwrap(),
            &want
        ));
        // Greedy: one-hot argmax.
        assert_eq!(
            target_probs(&l, &SamplingParams::GREEDY).unwrap(),
            vec![1.0, 0.0, 0.0, 0.0]
        );
        // top-k 2: the two 1.0 logits tie at the threshold, both kept.
        let p = target_probs(
            &l,
            &SamplingParams {
                temperature: 1.0,
                top_k: 2,
                top_p: 1.0,
            },
        )
        .unwrap();
        assert_eq!(p[2], 0.0);
        assert!(p[0] > 0.0 && p[1] > 0.0 && p[3] > 0.0);
        // top-k 1 keeps only the max.
        let p = target_probs(
            &l,
            &SamplingParams {
                temperature: 1.0,
                top_k: 1,
                top_p: 1.0,
            },
        )
        .unwrap();
        assert_eq!(p, vec![1.0, 0.0, 0.0, 0.0]);
        // top-p: probs ~[0.535, 0.197, 0.072, 0.197]; ascending cumsum
        // 0.072 (idx 2), 0.269 (idx 1), 0.466 (idx 3), 1.0 (idx 0).
        // top_p 0.6: cut 0.4 masks idx 2 and 1, keeps {3, 0}.
        let p = target_probs(
            &l,
            &SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.6,
            },
        )
        .unwrap();
        assert_eq!((p[1], p[2]), (0.0, 0.0));
        assert!((p[0] + p[3] - 1.0).abs() < 1e-12 && p[3] > 0.0);
        // top_p tiny: always keeps the largest.
        let p = target_probs(
            &l,
            &SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1e-6,
            },
        )
        .unwrap();
        assert_eq!(p, vec![1.0, 0.0, 0.0, 0.0]);
        // Masked (-inf) logits get zero mass.
        let p = target_probs(&[f32::NEG_INFINITY, 0.0, 0.0], &SamplingParams::random(1.0)).unwrap();
        assert!(close(&p, &[0.0, 0.5, 0.5]));
    }

    #[test]
    fn sample_index_respects_zero_weights_and_is_seeded() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let w = [0.0, 2.0, 0.0, 1.0, 0.0];
        let mut counts = [0u32; 5];
        for _ in 0..30_000 {
            counts[sample_index(&w, &mut rng).unwrap()] += 1;
        }
        assert_eq!((counts[0], counts[2], counts[4]), (0, 0, 0));
        let f = f64::from(counts[1]) / 30_000.0;
        assert!((f - 2.0 / 3.0).abs() < 0.015, "{f}");
        assert_eq!(sample_index(&[0.0, 0.0], &mut rng), None);
        assert_eq!(sample_index(&[], &mut rng), None);
        assert_eq!(sample_index(&[-1.0, f64::NAN], &mut rng), None);
        let mut a = ChaCha8Rng::seed_from_u64(9);
        let mut b = ChaCha8Rng::seed_from_u64(9);
        let xs: Vec<_> = (0..50).map(|_| sample_index(&w, &mut a)).collect();
        let ys: Vec<_> = (0..50).map(|_| sample_index(&w, &mut b)).collect();
        assert_eq!(xs, ys);
    }
}
