//! A drafter's q: the distributions its drafts were sampled from, dense or sparse.
//!
//! What it holds: [`DraftProbs`], one q row per draft token, either over the whole
//! vocabulary ([`DraftProbs::Dense`], the CPU drafters) or as `k` (token, probability)
//! pairs a row with every other token at probability 0 ([`DraftProbs::Sparse`]). A
//! drafter that samples from a candidate set, as DFlash2's selector does over its top-k
//! candidates (docs/dflash2.md §6.2), has a sparse q by construction; sending it dense
//! costs a vocabulary of floats a draft (29 MB a step for DFlash2 N = 7 at c = 128 with
//! vocab 8,200), which is why the sparse form exists.
//!
//! Where it comes from: vLLM 0.33.0's rejection sampler takes `draft_probs` as a dense
//! `[num_tokens, vocab]` tensor (`vllm/v1/sample/rejection_sampler.py`); the sparse rows
//! here are the same q with its zeros left out.
//!
//! Invariant: both forms mean the same numbers. A sparse row's entries are exactly the
//! dense row's at its ids and `0.0` elsewhere, so verification over either gives the same
//! bits (`max(0, p - 0.0) == p` for every `p >= 0`), and [`check_draft_probs`] holds both
//! to the same rules: finite, non-negative entries, ids below the vocabulary and, in a
//! sparse row, distinct.

use std::collections::HashSet;

use crate::{EngineError, Result};

/// A drafter's q rows, one a draft token ([`crate::Proposal::probs`]).
#[derive(Debug, Clone, PartialEq)]
pub enum DraftProbs {
    /// Every row over the vocabulary. Shape: [num_draft][vocab].
    Dense(Vec<Vec<f32>>),
    /// `k` (id, probability) pairs a row; every other token has probability 0.
    Sparse(SparseProbs),
}

/// Sparse q rows: row `i` gives probability `p[i k + m]` to token `ids[i k + m]`.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseProbs {
    /// Pairs a row (> 0).
    pub k: usize,
    /// Token ids. Shape: [rows, k].
    pub ids: Vec<u32>,
    /// Their probabilities. Shape: [rows, k].
    pub p: Vec<f32>,
}

impl DraftProbs {
    /// Rows held (one a draft).
    pub fn rows(&self) -> usize {
        match self {
            Self::Dense(q) => q.len(),
            Self::Sparse(s) => s.ids.len().checked_div(s.k).unwrap_or(0),
        }
    }

    /// Whether the rows have q's shape for `num_draft` drafts over `vocab` tokens (dense:
    /// that many rows of `vocab`; sparse: that many rows of `k > 0` pairs). Entries are
    /// [`check_draft_probs`]'s to check.
    pub fn shape_matches(&self, num_draft: usize, vocab: usize) -> bool {
        match self {
            Self::Dense(q) => q.len() == num_draft && q.iter().all(|r| r.len() == vocab),
            Self::Sparse(s) => {
                s.k > 0 && s.ids.len() == num_draft * s.k && s.p.len() == s.ids.len()
            }
        }
    }

    /// Keep the first `n` rows.
    pub fn truncate(&mut self, n: usize) {
        match self {
            Self::Dense(q) => q.truncate(n),
            Self::Sparse(s) => {
                s.ids.truncate(n * s.k);
                s.p.truncate(n * s.k);
            }
        }
    }

    /// `q_i(x)`: row `i`'s probability of token `x` (0 outside a row or a sparse row's ids).
    pub fn at(&self, i: usize, x: usize) -> f32 {
        match self {
            Self::Dense(q) => q.get(i).and_then(|r| r.get(x)).copied().unwrap_or(0.0),
            Self::Sparse(s) => s
                .row(i)
                .find(|&(id, _)| id as usize == x)
                .map_or(0.0, |(_, p)| p),
        }
    }

    /// The unnormalized residual `max(0, p - q_i)` of row `i` over a target distribution
    /// `p` (the weights a rejected position samples from).
    pub fn residual(&self, i: usize, p: &[f64]) -> Vec<f64> {
        match self {
            Self::Dense(q) => {
                let row = q.get(i).map_or(&[][..], Vec::as_slice);
                p.iter()
                    .enumerate()
                    .map(|(j, &pj)| (pj - f64::from(row.get(j).copied().unwrap_or(0.0))).max(0.0))
                    .collect()
            }
            Self::Sparse(s) => {
                let mut r: Vec<f64> = p.iter().map(|&pj| (pj - 0.0).max(0.0)).collect();
                for (id, qv) in s.row(i) {
                    if let Some(rj) = r.get_mut(id as usize) {
                        *rj = (p[id as usize] - f64::from(qv)).max(0.0);
                    }
                }
                r
            }
        }
    }

    /// Every row over the vocabulary (the dense form of either).
    pub fn to_dense(&self, vocab: usize) -> Vec<Vec<f32>> {
        match self {
            Self::Dense(q) => q.clone(),
            Self::Sparse(s) => (0..self.rows())
                .map(|i| {
                    let mut row = vec![0.0f32; vocab];
                    for (id, p) in s.row(i) {
                        if let Some(v) = row.get_mut(id as usize) {
                            *v = p;
                        }
                    }
                    row
                })
                .collect(),
        }
    }
}

impl SparseProbs {
    /// Row `i`'s (id, probability) pairs (empty past the rows).
    pub fn row(&self, i: usize) -> impl Iterator<Item = (u32, f32)> + '_ {
        let r = (i * self.k).min(self.ids.len())..((i + 1) * self.k).min(self.ids.len());
        self.ids[r.clone()]
            .iter()
            .copied()
            .zip(self.p.get(r).unwrap_or(&[]).iter().copied())
    }
}

fn bad(reason: String) -> EngineError {
    EngineError::InvalidVerifyInput { reason }
}

/// The checks verification makes of a drafter's q: `num_draft` rows; dense rows of
/// `vocab` entries, sparse rows of `k > 0` pairs with distinct ids below `vocab`; every
/// probability finite and non-negative (the device sampler takes only q that passes).
pub fn check_draft_probs(q: &DraftProbs, num_draft: usize, vocab: usize) -> Result<()> {
    if let DraftProbs::Sparse(s) = q {
        if !q.shape_matches(num_draft, vocab) {
            return Err(bad(format!(
                "sparse draft probs: {} ids and {} probabilities are not {num_draft} rows of k = {} pairs",
                s.ids.len(),
                s.p.len(),
                s.k
            )));
        }
    }
    if q.rows() != num_draft {
        return Err(bad(format!(
            "draft probs have {} rows for {num_draft} draft tokens",
            q.rows()
        )));
    }
    match q {
        DraftProbs::Dense(rows) => check_dense(rows, vocab),
        DraftProbs::Sparse(s) => check_sparse(s, vocab),
    }
}

fn check_dense(rows: &[Vec<f32>], vocab: usize) -> Result<()> {
    for (i, row) in rows.iter().enumerate() {
        if row.len() != vocab {
            return Err(bad(format!(
                "draft probs row {i} has vocab {}, target vocab is {vocab}",
                row.len()
            )));
        }
        if let Some(j) = row.iter().position(|x| !x.is_finite() || *x < 0.0) {
            return Err(bad(format!("draft probs row {i} entry {j} is {}", row[j])));
        }
    }
    Ok(())
}

fn check_sparse(s: &SparseProbs, vocab: usize) -> Result<()> {
    let mut seen = HashSet::with_capacity(s.k);
    for (n, (ids, ps)) in s.ids.chunks(s.k).zip(s.p.chunks(s.k)).enumerate() {
        seen.clear();
        for (&id, &p) in ids.iter().zip(ps) {
            if id as usize >= vocab {
                return Err(bad(format!(
                    "sparse draft probs row {n}: token {id} is not below vocab {vocab}"
                )));
            }
            if !seen.insert(id) {
                return Err(bad(format!(
                    "sparse draft probs row {n}: token {id} appears twice"
                )));
            }
            if !p.is_finite() || p < 0.0 {
                return Err(bad(format!(
                    "sparse draft probs row {n}: token {id} has probability {p}"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sparse() -> DraftProbs {
        DraftProbs::Sparse(SparseProbs {
            k: 2,
            ids: vec![3, 1, 0, 4],
            p: vec![0.75, 0.25, 0.5, 0.5],
        })
    }

    #[test]
    fn sparse_rows_mean_their_dense_rows() {
        let s = sparse();
        let d = DraftProbs::Dense(s.to_dense(5));
        assert_eq!(
            d,
            DraftProbs::Dense(vec![
                vec![0.0, 0.25, 0.0, 0.75, 0.0],
                vec![0.5, 0.0, 0.0, 0.0, 0.5],
            ])
        );
        let p = [0.1, 0.2, 0.3, 0.4, 0.0];
        for i in 0..2 {
            for x in 0..5 {
                assert_eq!(s.at(i, x), d.at(i, x), "row {i} token {x}");
            }
            let (rs, rd) = (s.residual(i, &p), d.residual(i, &p));
            assert_eq!(
                rs.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                rd.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
        assert_eq!(s.residual(0, &p)[3], 0.0);
        assert_eq!(s.rows(), 2);
        let mut t = s.clone();
        t.truncate(1);
        assert_eq!((t.rows(), t.at(0, 3), t.at(1, 0)), (1, 0.75, 0.0));
    }

    #[test]
    fn checks_refuse_what_verification_cannot_use() {
        assert!(check_draft_probs(&sparse(), 2, 5).is_ok());
        assert!(check_draft_probs(&sparse(), 1, 5).is_err());
        assert!(
            check_draft_probs(&sparse(), 2, 4).is_err(),
            "id 4 >= vocab 4"
        );
        let with = |k: usize, ids: Vec<u32>, p: Vec<f32>| {
            check_draft_probs(&DraftProbs::Sparse(SparseProbs { k, ids, p }), 1, 5)
        };
        assert!(with(2, vec![1, 1], vec![0.5, 0.5]).is_err(), "duplicate id");
        assert!(with(2, vec![1, 2], vec![0.5, -0.5]).is_err(), "negative");
        assert!(with(2, vec![1, 2], vec![f32::NAN, 0.5]).is_err(), "NaN");
        assert!(with(0, vec![], vec![]).is_err(), "k = 0");
        assert!(with(2, vec![1, 2], vec![0.5]).is_err(), "ragged");
        assert!(with(2, vec![1, 2], vec![0.5, 0.5]).is_ok());
        let dense = DraftProbs::Dense(vec![vec![0.5, f32::INFINITY]]);
        assert!(check_draft_probs(&dense, 1, 2).is_err());
        assert!(check_draft_probs(&dense, 1, 3).is_err());
    }
}
