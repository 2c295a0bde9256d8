//! Full attention: GQA + rotate-half RoPE over a paged KV cache.
//!
//! Source: docs/model.md §3 and §3.1 (Llama / HF `LlamaAttention`, `rotate_half`,
//! `repeat_kv`: query head `h` uses KV head `h / (nh / nkv)`); RoPE tables in f64
//! rounded to f32; scores `(q . k) * d^-0.5`, causal by absolute position, softmax
//! subtracting the row max. The cache holds post-RoPE K and V (f32) in the pages of
//! `model/kv_store.rs`, addressed through the request's `full`-group block table.
//!
//! Invariants: a chunk of `T` tokens starting at position `p` first writes its K/V at
//! positions `p..p+T` (overwriting whatever a rejected draft left there), then attends
//! over positions `0..=p+t` for its token `t`; the caller has checked that the block
//! table covers `p+T` positions with real (non-null) blocks.

use crate::kv::BlockId;
use crate::model::config::ModelConfig;
use crate::model::kv_store::KvStore;
use crate::model::weights::AttnWeights;
use crate::Result;

/// One sequence's rows in a batch.
#[derive(Debug, Clone)]
pub(crate) struct Span<'a> {
    /// First row of the chunk in the batch's `[T_total, ...]` tensors.
    pub offset: usize,
    /// Tokens in the chunk.
    pub len: usize,
    /// Absolute position of the chunk's first token.
    pub start_pos: usize,
    /// The request's block table in the `full` group (empty when the model has none).
    pub full_table: &'a [BlockId],
    /// The request's block table in the `kda_state` group (empty when none).
    pub state_table: &'a [BlockId],
    /// Write per-position KDA state snapshots (speculative verify).
    pub snapshot: bool,
    /// RoPE tables of positions `start_pos..start_pos+len` ([`rope_tables`]), computed
    /// once per batch and shared by every attention layer. Shapes: [len, d] each.
    pub rope: (Vec<f32>, Vec<f32>),
}

/// RoPE `cos`, `sin` of positions `start..start+len`. Shapes: [len, d] each.
pub fn rope_tables(start: usize, len: usize, d: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let half = d / 2;
    let inv: Vec<f64> = (0..half)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / d as f64))
        .collect();
    let mut cos = vec![0.0f32; len * d];
    let mut sin = vec![0.0f32; len * d];
    for t in 0..len {
        let p = (start + t) as f64;
        for i in 0..half {
            let ang = p * inv[i];
            let (c, s) = (ang.cos() as f32, ang.sin() as f32);
            cos[t * d + i] = c;
            cos[t * d + half + i] = c;
            sin[t * d + i] = s;
            sin[t * d + half + i] = s;
        }
    }
    (cos, sin)
}

/// In place `x * cos + rotate_half(x) * sin` for `x [T, heads, d]`, with `cos`, `sin`
/// `[T, d]` from [`rope_tables`] (a precondition: the tables cover every row of `x`;
/// callers build both from the same chunk, never from user-supplied lengths).
pub fn apply_rope(x: &mut [f32], heads: usize, d: usize, cos: &[f32], sin: &[f32]) {
    let half = d / 2;
    let mut tmp = vec![0.0f32; d];
    for (t, row) in x.chunks_exact_mut(heads * d).enumerate() {
        let (c, s) = (&cos[t * d..(t + 1) * d], &sin[t * d..(t + 1) * d]);
        for hv in row.chunks_exact_mut(d) {
            for i in 0..d {
                let rh = if i < half {
                    -hv[i + half]
                } else {
                    hv[i - half]
                };
                tmp[i] = hv[i] * c[i] + rh * s[i];
            }
            hv.copy_from_slice(&tmp);
        }
    }
}

/// Full attention of one layer over a batch: `a [T_total, H] -> [T_total, H]`.
/// `layer` indexes the attention layers of the `full` group (MTP last).
pub(crate) fn full_attention(
    w: &AttnWeights,
    cfg: &ModelConfig,
    a: &[f32],
    spans: &[Span<'_>],
    store: &mut KvStore,
    layer: usize,
) -> Result<Vec<f32>> {
    let t_total = a.len() / cfg.hidden_size;
    let (nh, nkv, d) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let g = nh / nkv;
    let bs = store.block_size();
    let mut q = w.q.forward(a, t_total)?; // [T_total, nh, d]
    let mut k = w.k.forward(a, t_total)?; // [T_total, nkv, d]
    let v = w.v.forward(a, t_total)?; // [T_total, nkv, d]
    let scale = (d as f64).powf(-0.5) as f32;
    let mut o = vec![0.0f32; t_total * nh * d]; // [T_total, nh, d]
    let mut scores: Vec<f32> = Vec::new();
    for sp in spans {
        let (cos, sin) = (&sp.rope.0, &sp.rope.1);
        if cos.len() != sp.len * d || sin.len() != sp.len * d {
            return Err(crate::EngineError::ModelInput(format!(
                "RoPE tables of {} values for a chunk of {} tokens (internal)",
                cos.len(),
                sp.len
            )));
        }
        let qs = &mut q[sp.offset * nh * d..(sp.offset + sp.len) * nh * d];
        apply_rope(qs, nh, d, cos, sin);
        let ks = &mut k[sp.offset * nkv * d..(sp.offset + sp.len) * nkv * d];
        apply_rope(ks, nkv, d, cos, sin);
        for t in 0..sp.len {
            let pos = sp.start_pos + t;
            let row = (sp.offset + t) * nkv * d;
            store.write_kv(
                layer,
                sp.full_table[pos / bs],
                pos % bs,
                &k[row..row + nkv * d],
                &v[row..row + nkv * d],
            );
        }
        for t in 0..sp.len {
            let n_ctx = sp.start_pos + t + 1; // causal: positions 0..=p_t
            scores.resize(n_ctx, 0.0);
            for h in 0..nh {
                let kvh = h / g;
                let qv = &q[((sp.offset + t) * nh + h) * d..((sp.offset + t) * nh + h + 1) * d];
                let mut mx = f32::NEG_INFINITY;
                for (j, sc) in scores.iter_mut().enumerate() {
                    let (kb, _) = store.kv_block(layer, sp.full_table[j / bs]);
                    let kr = &kb[((j % bs) * nkv + kvh) * d..((j % bs) * nkv + kvh + 1) * d];
                    let dot: f32 = qv.iter().zip(kr).map(|(x, y)| x * y).sum();
                    *sc = dot * scale;
                    mx = mx.max(*sc);
                }
                let mut sum = 0.0f32;
                for sc in scores.iter_mut() {
                    *sc = (*sc - mx).exp();
                    sum += *sc;
                }
                let orow =
                    &mut o[((sp.offset + t) * nh + h) * d..((sp.offset + t) * nh + h + 1) * d];
                for (j, sc) in scores.iter().enumerate() {
                    let p = sc / sum;
                    let (_, vb) = store.kv_block(layer, sp.full_table[j / bs]);
                    let vr = &vb[((j % bs) * nkv + kvh) * d..((j % bs) * nkv + kvh + 1) * d];
                    for (ov, &vv) in orow.iter_mut().zip(vr) {
                        *ov += p * vv;
                    }
                }
            }
        }
    }
    w.o.forward(&o, t_total)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn rope_position_zero_is_identity() {
        let (c, s) = rope_tables(0, 1, 4, 10000.0);
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        apply_rope(&mut x, 1, 4, &c, &s);
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(s, vec![0.0; 4]);
    }
}
