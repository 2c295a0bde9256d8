//! The MTP (multi-token prediction) layer: one DeepSeek-V3-style draft step.
//!
//! Source: docs/model.md §6 (DeepSeek-V3 paper §2.2, vLLM `deepseek_mtp.py`): for
//! target position `t` with final (post-`model.norm`) hidden `h_t` and the following
//! token `tok_{t+1}`: `x = [enorm(embed(tok_{t+1})), hnorm(h_t)] @ eh_proj^T`, then
//! decoder layer `N = num_hidden_layers` (full attention at RoPE position `p_t` with
//! its own K/V, MoE), `logits = lm_head(shared_head.norm(x))`, predicting `tok_{t+2}`.
//! Embedding and lm_head are the target's.
//!
//! KV: the MTP layer's K/V is the last attention layer of the `full` group and uses the
//! request's `full` block table (the same blocks as the target's full-attention
//! layers: MTP position `t` sits next to target position `t`). A chunk at `start_pos p`
//! writes MTP K/V at `p..p+T` and attends over MTP positions `0..=p+t`, so the MTP
//! cache must have been filled for positions `0..p` by earlier MTP calls.
//!
//! Invariants: the same validation as the target forward (tokens, slots, tables); the
//! returned `hidden` is `x` before `shared_head.norm` (what vLLM feeds back when one
//! MTP layer drafts several tokens).

use crate::kv::KvCacheManager;
use crate::model::attention::{rope_tables, Span};
use crate::model::config::ModelConfig;
use crate::model::config::FULL_GROUP;
use crate::model::forward::{
    decoder_layer, CacheIndex, ForwardOptions, LayerCall, LogitsRows, ModelRunner,
};
use crate::model::moe::{RouterTrace, Taps};
use crate::model::ops::rmsnorm;
use crate::request::ReqSlot;
use crate::{EngineError, Result};

/// One request's MTP inputs.
#[derive(Debug, Clone, Copy)]
pub struct MtpChunk<'a> {
    pub slot: ReqSlot,
    /// Target final hidden (post-norm) at positions `start_pos..start_pos+T`. Shape: [T, H].
    pub hidden: &'a [f32],
    /// The token following each of those positions. Shape: [T].
    pub next_tokens: &'a [u32],
    /// Position of the first row.
    pub start_pos: usize,
}

/// Output of [`ModelRunner::mtp_forward`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MtpOut {
    /// Row `t` predicts the token after `next_tokens[t]`. Shape: [T_total, V]
    /// (or [num_chunks, V] with `LogitsRows::LastPerChunk`).
    pub logits: Vec<f32>,
    /// The MTP layer's output before `shared_head.norm`. Shape: [T_total, H].
    pub hidden: Vec<f32>,
    /// Routing of the MTP layer's MoE.
    pub router: Option<Vec<RouterTrace>>,
    /// With `ForwardOptions::greedy_ids`: the argmax of each logits row. Shape: [rows].
    pub argmax: Option<Vec<u32>>,
}

fn input_err(msg: String) -> EngineError {
    EngineError::ModelInput(msg)
}

impl ModelRunner {
    /// Run the MTP layer over a batch (§6). Requires `num_nextn_predict_layers = 1`.
    pub fn mtp_forward(
        &mut self,
        kv: &KvCacheManager,
        batch: &[MtpChunk<'_>],
        opts: &ForwardOptions,
    ) -> Result<MtpOut> {
        self.check_manager(kv)?;
        let cfg = self.weights.cfg.clone();
        let h = cfg.hidden_size;
        let n = cfg.mtp_layer_index().ok_or_else(|| {
            input_err(
                "mtp_forward: the model has no MTP layer (num_nextn_predict_layers = 0)".into(),
            )
        })?;
        let spans = self.mtp_spans(kv, batch, &cfg)?;
        let t_total: usize = spans.iter().map(|sp| sp.len).sum();
        let Some(mtp) = self.weights.mtp.as_ref() else {
            return Err(input_err("mtp_forward: MTP weights are absent".into()));
        };
        let eps = cfg.rms_norm_eps as f32;
        // cat = [enorm(embed(next)), hnorm(hidden)]: [T_total, 2H]
        let mut cat = vec![0.0f32; t_total * 2 * h];
        let mut row = 0;
        for ch in batch {
            for (i, &tok) in ch.next_tokens.iter().enumerate() {
                let e = rmsnorm(
                    &self.weights.embed[tok as usize * h..(tok as usize + 1) * h],
                    &mtp.enorm,
                    eps,
                );
                let hh = rmsnorm(&ch.hidden[i * h..(i + 1) * h], &mtp.hnorm, eps);
                cat[row * 2 * h..row * 2 * h + h].copy_from_slice(&e);
                cat[row * 2 * h + h..(row + 1) * 2 * h].copy_from_slice(&hh);
                row += 1;
            }
        }
        let mut x = mtp.eh_proj.forward(&cat, t_total)?; // [T_total, H]
        let mut taps = Taps {
            router: opts.collect_router.then(Vec::new),
            experts: None,
        };
        let attn_index = cfg.num_full_layers();
        let call = LayerCall {
            lw: &mtp.layer,
            layer: n,
            cache: CacheIndex::Attn(attn_index),
        };
        decoder_layer(call, &cfg, &mut x, &spans, &mut self.store, &mut taps)?;
        let m = rmsnorm(&x, &mtp.head_norm, eps);
        let logits = match opts.logits {
            LogitsRows::All => self.weights.lm_head.forward(&m, t_total)?,
            LogitsRows::LastPerChunk => {
                let mut last = Vec::with_capacity(spans.len() * h);
                for sp in &spans {
                    let r = sp.offset + sp.len - 1;
                    last.extend_from_slice(&m[r * h..(r + 1) * h]);
                }
                self.weights.lm_head.forward(&last, spans.len())?
            }
        };
        let argmax = opts
            .greedy_ids
            .then(|| super::forward::row_argmax(&logits, cfg.vocab_size));
        Ok(MtpOut {
            logits,
            hidden: x,
            router: taps.router,
            argmax,
        })
    }

    /// Validate an MTP batch against the `full` group's tables and build its spans.
    fn mtp_spans<'k>(
        &self,
        kv: &'k KvCacheManager,
        batch: &[MtpChunk<'_>],
        cfg: &ModelConfig,
    ) -> Result<Vec<Span<'k>>> {
        let h = cfg.hidden_size;
        let full = self
            .store
            .full_group()
            .ok_or_else(|| input_err("mtp_forward: no `full` KV group".into()))?;
        let bs = self.store.block_size();
        let mut spans = Vec::with_capacity(batch.len());
        let mut offset = 0;
        for (ci, ch) in batch.iter().enumerate() {
            let t = ch.next_tokens.len();
            if t == 0 || ch.hidden.len() != t * h {
                return Err(input_err(format!(
                    "request slot {}: MTP chunk with {t} next tokens and {} hidden values (needs [T, {h}], T > 0)",
                    ch.slot.0,
                    ch.hidden.len()
                )));
            }
            if batch[..ci].iter().any(|o| o.slot == ch.slot) {
                return Err(input_err(format!(
                    "request slot {} appears twice in one MTP batch",
                    ch.slot.0
                )));
            }
            if let Some(&bad) = ch
                .next_tokens
                .iter()
                .find(|&&x| x as usize >= cfg.vocab_size)
            {
                return Err(input_err(format!(
                    "request slot {}: token id {bad} is not below vocab_size {}",
                    ch.slot.0, cfg.vocab_size
                )));
            }
            let table = kv.table(full, ch.slot);
            let end = ch.start_pos.checked_add(t).ok_or_else(|| {
                input_err(format!("request slot {}: MTP position overflow", ch.slot.0))
            })?;
            self.check_table(
                table,
                end.div_ceil(bs),
                ch.slot,
                FULL_GROUP,
                &format!("MTP positions 0..{end}"),
            )?;
            let rope = rope_tables(ch.start_pos, t, cfg.head_dim, cfg.rope_theta);
            spans.push(Span {
                offset,
                len: t,
                start_pos: ch.start_pos,
                full_table: table,
                state_table: &[],
                snapshot: false,
                rope,
            });
            offset += t;
        }
        Ok(spans)
    }
}
