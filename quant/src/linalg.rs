//! Small dense f64 linear algebra for GPTQ: Cholesky and the upper Cholesky factor of an
//! inverse.
//!
//! What: [`cholesky_lower`] (`A = L L^T`), [`inverse_upper_cholesky`] (the upper `U` with
//! `U^T U = A^-1`, what GPTQ calls `Hinv`), triangular helpers. Row-major `[K, K]` `Vec<f64>`.
//!
//! Source: textbook (Golub & Van Loan, "Matrix Computations", §4.2 Cholesky; §3.1
//! triangular systems). `U` is computed without forming `A^-1`: with `J` the reversal
//! permutation, `J A J = L' L'^T` gives `A = R R^T` with `R = J L' J` upper, so
//! `A^-1 = R^-T R^-1 = U^T U` with `U = R^-1 = J L'^-1 J` (upper, positive diagonal, hence
//! *the* Cholesky factor by uniqueness). torch's `cholesky -> cholesky_inverse ->
//! cholesky(upper=True)` computes the same matrix with two more O(K^3) steps and more
//! rounding.
//!
//! Invariants: inputs are square `[K, K]` and symmetric (only the lower triangle is read by
//! [`cholesky_lower`]); a factorization fails (returns the failing pivot) on a non-positive
//! or non-finite pivot, never panics. K is at most a few thousand: plain loops, contiguous
//! row dot products, O(K^3 / 3) each.

/// Dot product of two equal-length slices.
#[inline]
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut s = 0.0;
    for (x, y) in a.iter().zip(b) {
        s += x * y;
    }
    s
}

/// Lower Cholesky factor `L` (row-major, upper triangle zero) of the symmetric `a`, or the
/// index of the first pivot that is not positive and finite.
pub fn cholesky_lower(a: &[f64], k: usize) -> Result<Vec<f64>, usize> {
    debug_assert_eq!(a.len(), k * k);
    let mut l = vec![0.0f64; k * k];
    for j in 0..k {
        let (done, rest) = l.split_at_mut(j * k);
        let row_j = &mut rest[..k];
        // Row j left of the diagonal: L[j][c] = (A[j][c] - <L[j][..c], L[c][..c]>) / L[c][c].
        for c in 0..j {
            let row_c = &done[c * k..c * k + c + 1];
            let s = a[j * k + c] - dot(&row_j[..c], &row_c[..c]);
            row_j[c] = s / row_c[c];
        }
        let d = a[j * k + j] - dot(&row_j[..j], &row_j[..j]);
        if d.is_finite() && d > 0.0 {
            row_j[j] = d.sqrt();
        } else {
            return Err(j);
        }
    }
    Ok(l)
}

/// Inverse of a lower-triangular `l` with positive diagonal, returned transposed: `Y = (L^-1)^T`
/// (upper triangular, row-major).
fn lower_inverse_transposed(l: &[f64], k: usize) -> Vec<f64> {
    // Y[j][i] = X[i][j], X = L^-1:  X[j][j] = 1 / L[j][j];
    // X[i][j] = -(sum_{m=j}^{i-1} L[i][m] X[m][j]) / L[i][i]  for i > j.
    let mut y = vec![0.0f64; k * k];
    for j in 0..k {
        let row = &mut y[j * k..(j + 1) * k];
        row[j] = 1.0 / l[j * k + j];
        for i in j + 1..k {
            let s = dot(&l[i * k + j..i * k + i], &row[j..i]);
            row[i] = -s / l[i * k + i];
        }
    }
    y
}

/// Upper Cholesky factor `U` of `a^-1` (`U^T U = a^-1`), row-major, or the failing pivot
/// index (in `a`'s indexing) when `a` is not numerically positive definite.
pub fn inverse_upper_cholesky(a: &[f64], k: usize) -> Result<Vec<f64>, usize> {
    // J A J: reverse rows and columns.
    let mut rev = vec![0.0f64; k * k];
    for i in 0..k {
        for j in 0..k {
            rev[i * k + j] = a[(k - 1 - i) * k + (k - 1 - j)];
        }
    }
    let lp = cholesky_lower(&rev, k).map_err(|p| k - 1 - p)?;
    // U = J L'^-1 J; with Y = (L'^-1)^T (upper), L'^-1[i][j] = Y[j][i], so
    // U[i][j] = L'^-1[k-1-i][k-1-j] = Y[k-1-j][k-1-i].
    let y = lower_inverse_transposed(&lp, k);
    let mut u = vec![0.0f64; k * k];
    for i in 0..k {
        for j in i..k {
            u[i * k + j] = y[(k - 1 - j) * k + (k - 1 - i)];
        }
    }
    Ok(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matmul_t(a: &[f64], b: &[f64], k: usize) -> Vec<f64> {
        // a^T b
        let mut c = vec![0.0; k * k];
        for i in 0..k {
            for j in 0..k {
                c[i * k + j] = (0..k).map(|m| a[m * k + i] * b[m * k + j]).sum();
            }
        }
        c
    }

    fn spd(k: usize) -> Vec<f64> {
        // B^T B + I with a deterministic B.
        let b: Vec<f64> = (0..k * k)
            .map(|i| ((i * 7919 % 97) as f64 - 48.0) / 31.0)
            .collect();
        let mut a = matmul_t(&b, &b, k);
        for i in 0..k {
            a[i * k + i] += 1.0;
        }
        a
    }

    #[test]
    fn cholesky_reconstructs() {
        let k = 9;
        let a = spd(k);
        let l = cholesky_lower(&a, k).unwrap();
        let mut lt = vec![0.0; k * k];
        for i in 0..k {
            for j in 0..k {
                lt[i * k + j] = l[j * k + i];
            }
        }
        // L L^T = (L^T)^T (L^T)
        let r = matmul_t(&lt, &lt, k);
        for (x, y) in r.iter().zip(&a) {
            assert!((x - y).abs() < 1e-9 * y.abs().max(1.0), "{x} vs {y}");
        }
    }

    #[test]
    fn inverse_upper_is_cholesky_of_inverse() {
        let k = 11;
        let a = spd(k);
        let u = inverse_upper_cholesky(&a, k).unwrap();
        for i in 0..k {
            assert!(u[i * k + i] > 0.0);
            for j in 0..i {
                assert_eq!(u[i * k + j], 0.0);
            }
        }
        // U^T U A = I
        let utu = matmul_t(&u, &u, k);
        for i in 0..k {
            for j in 0..k {
                let v: f64 = (0..k).map(|m| utu[i * k + m] * a[m * k + j]).sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-9, "({i},{j}) = {v}");
            }
        }
    }

    #[test]
    fn not_positive_definite_reports_pivot() {
        // [[1, 2], [2, 1]] has eigenvalues 3 and -1.
        assert_eq!(cholesky_lower(&[1.0, 2.0, 2.0, 1.0], 2), Err(1));
        assert_eq!(cholesky_lower(&[0.0, 0.0, 0.0, 1.0], 2), Err(0));
        assert_eq!(cholesky_lower(&[f64::NAN, 0.0, 0.0, 1.0], 2), Err(0));
        assert!(inverse_upper_cholesky(&[1.0, 2.0, 2.0, 1.0], 2).is_err());
    }
}
