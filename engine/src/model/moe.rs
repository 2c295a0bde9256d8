//! FFNs: dense SwiGLU and the sigmoid-routed MoE with a shared expert.
//!
//! Source: docs/model.md §5 (DeepSeek-V3 HF `MoEGate` with `noaux_tc` and sigmoid
//! scoring, `DeepseekV3MoE`): router logits in f32, `s = sigmoid(r)`, top-k of
//! `s + e_score_correction_bias` (selection only), weights `s[sel]`, normalised with
//! `+1e-20` when `norm_topk_prob`, times `routed_scaling_factor` always; plus the shared
//! expert with weight 1. `n_group = topk_group = 1`: no group-limited routing.
//!
//! Invariants: top-k ties go to the lower expert index (a stable descending sort, as
//! the reference); selected experts are reported in descending biased-score order;
//! routed outputs are accumulated per expert in ascending expert order from zero, then
//! the shared expert is added (the reference's `index_add_` order). Each expert runs
//! once per batch over the rows routed to it (gathered), so W4A16 weights are
//! dequantized once per tile per expert per step.

use crate::model::config::ModelConfig;
use crate::model::ops::{sigmoid, silu};
use crate::model::weights::{Mlp, MoeWeights};
use crate::Result;

/// The routing decisions of one MoE layer for a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterTrace {
    /// Layer index (`num_hidden_layers` for the MTP layer).
    pub layer: usize,
    /// Selected experts, descending biased score. Shape: [T, k].
    pub ids: Vec<u32>,
    /// Their final weights (normalised, scaled). Shape: [T, k].
    pub weights: Vec<f32>,
}

/// Which projection's input an [`ExpertObserver`] sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertInput {
    /// The input of `gate_proj` and `up_proj` (the rows routed to the expert). Shape: [rows, H].
    GateUp,
    /// The input of `down_proj`: `silu(x Wg^T) * (x Wu^T)`. Shape: [rows, Im].
    Down,
}

/// Sees the inputs of every routed expert's projections during a forward pass
/// (GPTQ calibration: the Hessian of each quantized matrix is built from them).
pub trait ExpertObserver {
    /// `x` holds `rows` input rows of expert `expert` of MoE layer `layer`.
    fn observe(&mut self, layer: usize, expert: usize, input: ExpertInput, x: &[f32], rows: usize);
}

/// Optional taps of a forward pass through the MoE layers.
#[derive(Default)]
pub(crate) struct Taps<'a> {
    pub router: Option<Vec<RouterTrace>>,
    pub experts: Option<&'a mut dyn ExpertObserver>,
}

/// SwiGLU `(silu(x Wg^T) * (x Wu^T)) Wd^T`: `x [T, H] -> [T, H]`.
pub fn mlp(m: &Mlp, x: &[f32], t: usize) -> Result<Vec<f32>> {
    let mut g = m.gate.forward(x, t)?; // [T, I]
    let u = m.up.forward(x, t)?; // [T, I]
    for (gv, uv) in g.iter_mut().zip(&u) {
        *gv = silu(*gv) * uv;
    }
    m.down.forward(&g, t)
}

/// Top-k of `biased` (one row), ties to the lower index, in descending order.
pub fn topk_desc(biased: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..biased.len()).collect();
    // Stable sort on descending score: equal scores keep ascending index order.
    idx.sort_by(|&a, &b| {
        biased[b]
            .partial_cmp(&biased[a])
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    idx.truncate(k);
    idx
}

/// MoE of one layer: `f [T, H] -> [T, H]`; appends the routing to `trace` when given.
pub(crate) fn moe(
    m: &MoeWeights,
    cfg: &ModelConfig,
    f: &[f32],
    t: usize,
    layer: usize,
    taps: &mut Taps<'_>,
) -> Result<Vec<f32>> {
    let h = cfg.hidden_size;
    let e = cfg.n_routed_experts;
    let k = cfg.num_experts_per_tok;
    let r = m.router.forward(f, t)?; // [T, E]
    let mut sel = vec![0usize; t * k]; // [T, k]
    let mut wts = vec![0.0f32; t * k]; // [T, k]
    let mut biased = vec![0.0f32; e];
    for row in 0..t {
        let s: Vec<f32> = r[row * e..(row + 1) * e]
            .iter()
            .map(|&x| sigmoid(x))
            .collect();
        for (b, (sv, bias)) in biased.iter_mut().zip(s.iter().zip(&m.bias)) {
            *b = sv + bias;
        }
        let top = topk_desc(&biased, k);
        let mut w: Vec<f32> = top.iter().map(|&j| s[j]).collect();
        if cfg.norm_topk_prob {
            let sum: f32 = w.iter().sum::<f32>() + 1e-20;
            for x in &mut w {
                *x /= sum;
            }
        }
        let rsf = cfg.routed_scaling_factor as f32;
        for x in &mut w {
            *x *= rsf;
        }
        sel[row * k..(row + 1) * k].copy_from_slice(&top);
        wts[row * k..(row + 1) * k].copy_from_slice(&w);
    }
    let mut out = vec![0.0f32; t * h];
    let mut rows: Vec<(usize, f32)> = Vec::new();
    let mut xg: Vec<f32> = Vec::new();
    for (j, ex) in m.experts.iter().enumerate() {
        rows.clear();
        for row in 0..t {
            for slot in 0..k {
                if sel[row * k + slot] == j {
                    rows.push((row, wts[row * k + slot]));
                }
            }
        }
        if rows.is_empty() {
            continue;
        }
        xg.clear();
        for &(row, _) in &rows {
            xg.extend_from_slice(&f[row * h..(row + 1) * h]);
        }
        let y = match taps.experts.as_mut() {
            None => mlp(ex, &xg, rows.len())?, // [n_j, H]
            Some(obs) => {
                // The same computation as `mlp`, with its two inputs observed.
                let n = rows.len();
                obs.observe(layer, j, ExpertInput::GateUp, &xg, n);
                let mut g = ex.gate.forward(&xg, n)?;
                let u = ex.up.forward(&xg, n)?;
                for (gv, uv) in g.iter_mut().zip(&u) {
                    *gv = silu(*gv) * uv;
                }
                obs.observe(layer, j, ExpertInput::Down, &g, n);
                ex.down.forward(&g, n)?
            }
        };
        for (i, &(row, wt)) in rows.iter().enumerate() {
            for (o, &yv) in out[row * h..(row + 1) * h]
                .iter_mut()
                .zip(&y[i * h..(i + 1) * h])
            {
                *o += wt * yv;
            }
        }
    }
    let shared = mlp(&m.shared, f, t)?;
    for (o, s) in out.iter_mut().zip(&shared) {
        *o += s;
    }
    if let Some(tr) = taps.router.as_mut() {
        tr.push(RouterTrace {
            layer,
            ids: sel.iter().map(|&x| x as u32).collect(),
            weights: wts,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn topk_ties_lower_index() {
        assert_eq!(topk_desc(&[0.5, 0.9, 0.9, 0.1], 2), vec![1, 2]);
        assert_eq!(topk_desc(&[0.7, 0.7, 0.7, 0.7], 3), vec![0, 1, 2]);
        assert_eq!(topk_desc(&[0.1, 0.2, 0.3], 1), vec![2]);
    }
}
