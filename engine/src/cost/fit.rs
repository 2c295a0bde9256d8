//! Non-negative least squares for the cost model's parameters.
//!
//! What it does: [`nnls`] minimises `|X theta - y|^2` subject to `theta >= 0` with the
//! Lawson-Hanson active-set method (Lawson & Hanson, "Solving Least Squares Problems",
//! 1974, ch. 23), solving each passive-set subproblem through the normal equations with
//! partial-pivot Gaussian elimination. The cost model's parameters (us per kernel, us
//! per row, us per expert, ...) are physical costs, so negative values are refused by
//! construction rather than clipped afterwards.
//!
//! Invariants: the result is >= 0 element-wise, has one entry per column of `X`, and
//! for a consistent system with a non-negative exact solution reproduces it (tests).
//! A column that never enters the passive set stays exactly 0.

use crate::{EngineError, Result};

fn bad(reason: String) -> EngineError {
    EngineError::Unsupported(format!("least squares: {reason}"))
}

/// Solve the square system `a x = b` (partial pivoting); None if singular.
fn solve(mut a: Vec<Vec<f64>>, mut b: Vec<f64>) -> Option<Vec<f64>> {
    let n = b.len();
    for c in 0..n {
        let p = (c..n).max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs()))?;
        if a[p][c].abs() < 1e-300 {
            return None;
        }
        a.swap(c, p);
        b.swap(c, p);
        let pivot = a[c].clone();
        for r in c + 1..n {
            let f = a[r][c] / pivot[c];
            for (x, p) in a[r][c..].iter_mut().zip(&pivot[c..]) {
                *x -= f * p;
            }
            b[r] -= f * b[c];
        }
    }
    let mut x = vec![0.0; n];
    for r in (0..n).rev() {
        let s: f64 = (r + 1..n).map(|k| a[r][k] * x[k]).sum();
        x[r] = (b[r] - s) / a[r][r];
    }
    Some(x)
}

/// Unconstrained least squares restricted to the columns in `cols`.
fn ls_on(x: &[Vec<f64>], y: &[f64], cols: &[usize], n: usize) -> Option<Vec<f64>> {
    let m = cols.len();
    let mut ata = vec![vec![0.0; m]; m];
    let mut aty = vec![0.0; m];
    for (row, &yi) in x.iter().zip(y) {
        for (i, &ci) in cols.iter().enumerate() {
            aty[i] += row[ci] * yi;
            for (j, &cj) in cols.iter().enumerate() {
                ata[i][j] += row[ci] * row[cj];
            }
        }
    }
    let z = solve(ata, aty)?;
    let mut full = vec![0.0; n];
    for (i, &c) in cols.iter().enumerate() {
        full[c] = z[i];
    }
    Some(full)
}

/// `argmin |X theta - y|` with `theta >= 0` (module doc). `x`: rows of features.
pub fn nnls(x: &[Vec<f64>], y: &[f64]) -> Result<Vec<f64>> {
    let n = x.first().map_or(0, Vec::len);
    if x.len() != y.len() || x.iter().any(|r| r.len() != n) || n == 0 {
        return Err(bad(format!(
            "{} rows of features (widths {:?}) for {} targets",
            x.len(),
            x.iter().map(Vec::len).collect::<Vec<_>>(),
            y.len()
        )));
    }
    if x.iter().flatten().chain(y).any(|v| !v.is_finite()) {
        return Err(bad("a feature or target is not finite".into()));
    }
    let scale: f64 = x
        .iter()
        .flatten()
        .map(|v| v.abs())
        .fold(0.0, f64::max)
        .max(1.0);
    let tol = 1e-10 * scale * scale * y.iter().map(|v| v.abs()).fold(1.0, f64::max);
    let mut theta = vec![0.0; n];
    let mut passive: Vec<usize> = Vec::new();
    for _outer in 0..(3 * n + 10) {
        let grad: Vec<f64> = (0..n)
            .map(|j| {
                x.iter()
                    .zip(y)
                    .map(|(r, &yi)| r[j] * (yi - dot(r, &theta)))
                    .sum()
            })
            .collect();
        let cand = (0..n)
            .filter(|j| !passive.contains(j) && grad[*j] > tol)
            .max_by(|&a, &b| grad[a].total_cmp(&grad[b]));
        let Some(j) = cand else { break };
        passive.push(j);
        loop {
            let Some(z) = ls_on(x, y, &passive, n) else {
                passive.retain(|&c| c != j);
                break;
            };
            if passive.iter().all(|&c| z[c] > 0.0) {
                theta = z;
                break;
            }
            // Step from theta toward z until the first passive coefficient hits 0.
            let alpha = passive
                .iter()
                .filter(|&&c| z[c] <= 0.0)
                .map(|&c| theta[c] / (theta[c] - z[c]))
                .fold(1.0, f64::min);
            for (t, zc) in theta.iter_mut().zip(&z) {
                *t += alpha * (zc - *t);
            }
            passive.retain(|&c| theta[c] > 1e-15);
            for (c, t) in theta.iter_mut().enumerate() {
                if !passive.contains(&c) {
                    *t = 0.0;
                }
            }
        }
    }
    Ok(theta)
}

/// `a . b`.
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_an_exact_nonnegative_solution() {
        let truth = [2.5, 0.0, 7.0];
        let x: Vec<Vec<f64>> = (0..6)
            .map(|i| {
                let t = f64::from(i);
                vec![1.0, t, t * t + 1.0]
            })
            .collect();
        let y: Vec<f64> = x.iter().map(|r| dot(r, &truth)).collect();
        let got = nnls(&x, &y).unwrap();
        for (g, t) in got.iter().zip(truth) {
            assert!((g - t).abs() < 1e-6, "{got:?}");
        }
    }

    #[test]
    fn negative_unconstrained_solution_is_clamped_to_the_best_feasible_one() {
        // y = 3 - t: the unconstrained slope is -1; with theta >= 0 the best fit is the
        // mean of y on the constant column alone.
        let x: Vec<Vec<f64>> = (0..5).map(|i| vec![1.0, f64::from(i)]).collect();
        let y: Vec<f64> = (0..5).map(|i| 3.0 - f64::from(i)).collect();
        let got = nnls(&x, &y).unwrap();
        assert_eq!(got[1], 0.0);
        assert!((got[0] - 1.0).abs() < 1e-9, "{got:?}");
        assert!(nnls(&x, &y[..3]).is_err());
    }
}
