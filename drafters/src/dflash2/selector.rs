//! The candidate selector: top-k candidates, rank-r pair scores, and the sampling helpers.
//!
//! Source: docs/dflash2.md §6.2 (vLLM `qwen3_dflash2.py` `CandidateSelector`,
//! `_score_edges`; `dflash2/speculator.py` `_selector_walk_kernel`) and §1.6 (ties:
//! `top-k` sorts by value descending, equal values by lower token id; `argmax` takes the
//! lowest index):
//!
//! ```text
//! C_j = top-k(logits_j);  U_j = logits_j[C_j];  g_j = h_j @ W_h^T
//! S_j[p, c] = U_j[c] + sum_e (A[pred_j[p], e] * g_j[e]) * Bc[C_j[c], e]
//! ```
//!
//! Invariants: all compute f32; comparisons are total (`f32::total_cmp`), so a NaN score
//! (only possible from non-finite weights) can reorder candidates but never panics.

use std::cmp::Ordering;

use rand::{Rng, RngCore};
use speclab_engine::model::ops::argmax;

use super::weights::SelectorWeights;

/// The `k` largest entries of `row`, value-descending, equal values by lower index.
pub fn topk_ids(row: &[f32], k: usize) -> Vec<u32> {
    let k = k.min(row.len());
    let cmp = |a: &usize, b: &usize| -> Ordering { row[*b].total_cmp(&row[*a]).then(a.cmp(b)) };
    let mut idx: Vec<usize> = (0..row.len()).collect();
    if k < idx.len() && k > 0 {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_unstable_by(cmp);
    idx.truncate(k);
    idx.into_iter().map(|i| i as u32).collect()
}

/// `sorted[i] - sorted[i + 1]` of the values of `row` sorted descending (the margin of a
/// top-`i+1` boundary: `i = 0` is top-1 minus top-2). `inf` when `row` has no `i + 2` entries.
pub fn sorted_gap(row: &[f32], i: usize) -> f32 {
    if row.len() < i + 2 {
        return f32::INFINITY;
    }
    let ids = topk_ids(row, i + 2);
    row[ids[i] as usize] - row[ids[i + 1] as usize]
}

/// Pair scores `S [P, k]` of one position: `unary [k]` (`U_j`), candidates `cand [k]`
/// (`C_j`), `g [r]` (`g_j`), predecessors `pred [P]`.
pub fn edge_scores(
    sel: &SelectorWeights,
    r: usize,
    cand: &[u32],
    unary: &[f32],
    g: &[f32],
    pred: &[u32],
) -> Vec<f32> {
    let k = cand.len();
    let mut s = vec![0.0f32; pred.len() * k];
    let mut ag = vec![0.0f32; r];
    for (pi, &p) in pred.iter().enumerate() {
        let a = &sel.predecessor[p as usize * r..(p as usize + 1) * r];
        for ((o, &av), &gv) in ag.iter_mut().zip(a).zip(g) {
            *o = av * gv;
        }
        for (ci, &c) in cand.iter().enumerate() {
            let b = &sel.successor[c as usize * r..(c as usize + 1) * r];
            let dot: f32 = ag.iter().zip(b).map(|(x, y)| x * y).sum();
            s[pi * k + ci] = unary[ci] + dot;
        }
    }
    s
}

/// The walk of §6.2 over candidates computed elsewhere (the CUDA engine's device top-k and
/// `hidden_projection`): `cand` and `unary` [N, k] (value-descending, ties to the lower id,
/// as [`topk_ids`]), `g` [N, r]. Each row's pair scores from the previous pick (the anchor
/// first), [`edge_scores`], go to `choose`, which returns the candidate index taken.
fn walk(
    sel: &SelectorWeights,
    r: usize,
    anchor: u32,
    (cand, unary, g): (&[u32], &[f32], &[f32]),
    k: usize,
    choose: &mut dyn FnMut(&[f32]) -> usize,
) -> Vec<u32> {
    let nn = cand.len().checked_div(k).unwrap_or(0);
    let mut out = Vec::with_capacity(nn);
    let mut pred = anchor;
    for j in 0..nn {
        let cj = &cand[j * k..(j + 1) * k];
        let s = edge_scores(
            sel,
            r,
            cj,
            &unary[j * k..(j + 1) * k],
            &g[j * r..(j + 1) * r],
            &[pred],
        );
        let c = choose(&s);
        out.push(cj[c]);
        pred = cj[c];
    }
    out
}

/// The greedy walk over candidates computed elsewhere ([`walk`]'s inputs); returns the N
/// draft tokens. Given the same candidates this is exactly the greedy pick of
/// `DFlash2::draft` (same [`edge_scores`], same first-maximum argmax).
pub fn walk_greedy(
    sel: &SelectorWeights,
    r: usize,
    anchor: u32,
    cand: &[u32],
    unary: &[f32],
    g: &[f32],
    k: usize,
) -> Vec<u32> {
    walk(sel, r, anchor, (cand, unary, g), k, &mut |s| argmax(s))
}

/// The sampled walk over candidates computed elsewhere ([`walk`]'s inputs): each row's
/// `softmax(S / temperature)` over its k candidates and one `rng.random::<f32>()` draw, as
/// `DFlash2::draft`'s sampled pick. Returns the N tokens and q's nonzero entries: the
/// probabilities [N, k] of `cand`'s ids (every other token has q = 0). Given the same
/// candidates, the tokens, q and the RNG's position equal `DFlash2::draft`'s.
pub fn walk_sampled(
    sel: &SelectorWeights,
    r: usize,
    anchor: u32,
    (cand, unary, g): (&[u32], &[f32], &[f32]),
    k: usize,
    temperature: f32,
    rng: &mut dyn RngCore,
) -> (Vec<u32>, Vec<f32>) {
    let mut q = Vec::with_capacity(cand.len());
    let tokens = walk(sel, r, anchor, (cand, unary, g), k, &mut |s| {
        let p = softmax_temp(s, temperature);
        let c = sample_index(&p, rng.random::<f32>());
        q.extend_from_slice(&p);
        c
    });
    (tokens, q)
}

/// `softmax(row / temp)` (max subtracted).
pub fn softmax_temp(row: &[f32], temp: f32) -> Vec<f32> {
    let mx = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v / temp));
    let mut out: Vec<f32> = row.iter().map(|&v| (v / temp - mx).exp()).collect();
    let sum: f32 = out.iter().sum();
    for v in &mut out {
        *v /= sum;
    }
    out
}

/// Draw an index from the distribution `p` with a uniform `u` in [0, 1) (inverse CDF;
/// the last index with positive mass absorbs rounding).
pub fn sample_index(p: &[f32], u: f32) -> usize {
    let mut acc = 0.0f32;
    let mut last = 0;
    for (i, &pi) in p.iter().enumerate() {
        if pi > 0.0 {
            last = i;
            acc += pi;
            if u < acc {
                return i;
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topk_ties_to_lower_id() {
        let row = [1.0, 3.0, 3.0, 2.0, 3.0];
        assert_eq!(topk_ids(&row, 3), vec![1, 2, 4]);
        assert_eq!(topk_ids(&row, 4), vec![1, 2, 4, 3]);
        assert_eq!(topk_ids(&row, 9), vec![1, 2, 4, 3, 0]);
        assert_eq!(sorted_gap(&row, 2), 1.0);
        assert_eq!(sorted_gap(&row, 0), 0.0);
    }

    #[test]
    fn softmax_and_sampling() {
        let p = softmax_temp(&[0.0, 0.0], 1.0);
        assert_eq!(p, vec![0.5, 0.5]);
        assert_eq!(sample_index(&p, 0.25), 0);
        assert_eq!(sample_index(&p, 0.75), 1);
        assert_eq!(sample_index(&[0.0, 1.0, 0.0], 0.9999), 1);
    }
}
