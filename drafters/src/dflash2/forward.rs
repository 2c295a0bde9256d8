//! DFlash2 inference: context append into the drafter's sliding-window KV group, and the
//! one-pass draft of a block.
//!
//! Source: docs/dflash2.md §3 (features), §4 (context K/V: `fc` -> `hidden_norm` -> per
//! layer `k_proj`, `k_norm`, RoPE / `v_proj`), §5 (the block forward: Qwen3 layers,
//! non-causal sliding-window attention over context + block, grouped dynamic conv, shared
//! `lm_head`), §6 (v1: argmax / softmax per position; v2: the selector walk with `q`
//! scattered over the candidates), §7 (the per-request protocol and the allocator
//! mapping). Reference: `recipes/dflash2.py` (`Drafter.append_context`, `draft_block`).
//!
//! Protocol for one request (slot `s`), with `n` = positions appended so far (the next
//! anchor's position):
//! - the caller allocates the request's slots with `KvCacheManager::allocate_slots`
//!   (lookahead `N + 1`, [`DFlash2Config::lookahead_slots`]) so the drafter group's table
//!   covers every position it appends;
//! - [`DFlash2::append_context`]`(kv, s, start_pos, features)` appends the target
//!   features of positions `start_pos .. start_pos + T` (`start_pos <= n`; `0` starts a
//!   fresh sequence; `< n` rewrites from there). Rows that can never be visible again
//!   (positions `<= start_pos + T - W`) are neither computed nor written, so a long
//!   prefill chunk never touches evicted or ring-recycled blocks;
//! - [`DFlash2::draft`] drafts with the anchor at position `n` (its feature does not
//!   exist yet), reading context rows `n - W + 1 .. n - 1` through the block table; a
//!   needed row in a null (evicted) or unallocated block is an error, never a read;
//! - after verification, append the features of the anchor and the accepted drafts
//!   (positions `n .. n + A`), as §7 step 4 says; [`DFlash2::release`] forgets the request.
//!
//! Block-table mapping: positional (`table[p / bs]`, vLLM) for cap policies `None` and
//! `Upstream`; for `WindowPlusTwo` the group keeps a per-request ring of
//! `cdiv(W, bs) + 2` blocks and the row lives in `table[(p / bs) % ring]` (the live
//! context spans at most `cdiv(W - 1, bs) + 1` blocks, so live rows never alias).
//!
//! Invariants: all compute f32 (§1); the block's own K/V are not stored (§14); the cache
//! is never modified by a draft; errors (never panics) for bad slots, tokens, positions,
//! `num_speculative_tokens`, modes, temperatures, shapes and block tables.

use std::collections::HashMap;
use std::ops::Range;

use rand::{Rng, RngCore};
use speclab_engine::backend::SharedHead;
use speclab_engine::kv::{BlockId, KvCacheManager};
use speclab_engine::model::attention::{apply_rope, rope_tables};
use speclab_engine::model::moe::mlp;
use speclab_engine::model::ops::{argmax, rmsnorm};
use speclab_engine::model::{ForwardOut, ModelConfig};
use speclab_engine::spec::DraftProbs;
use speclab_engine::{EngineError, Proposal, ReqSlot, Result};

use super::config::{DFlash2Config, KV_GROUP_NAME};
use super::conv::grouped_conv;
use super::kv::{DraftGroup, DraftKvStore};
#[cfg(test)]
use super::selector::walk_greedy;
use super::selector::{edge_scores, sample_index, softmax_temp, sorted_gap, topk_ids};
use super::weights::{ConvWeights, DFlash2Weights, DraftLayer};

/// Drafting mode (one checkpoint serves both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DraftMode {
    /// DFlash v1: no convolutions, no selector; per-position argmax / softmax (§6.1).
    V1,
    /// DFlash2: grouped dynamic conv + candidate-selector walk (§5.1, §6.2).
    #[default]
    V2,
}

/// One draft step of one request.
#[derive(Debug, Clone, Copy)]
pub struct DraftRequest {
    pub slot: ReqSlot,
    /// The anchor: the last committed (bonus) token, whose feature does not exist yet.
    pub anchor_token: u32,
    /// Its position; must equal the positions appended so far (§7 invariant).
    pub anchor_pos: usize,
    /// `N`, `1 <= N <= block_size - 1`.
    pub num_speculative_tokens: usize,
    pub mode: DraftMode,
    /// `0` = greedy; `> 0` samples with the RNG given to [`DFlash2::draft`].
    pub temperature: f32,
    /// Fill the debugging outputs of [`Draft`] (hidden, all logits, per-layer residuals,
    /// margins, selector trace) and `q` even when greedy (then at temperature 1, as the
    /// reference reports it).
    pub trace: bool,
}

/// The selector's intermediate values of one draft (§6.2), row-major.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SelectorTrace {
    /// `C_j`. Shape: [N, k].
    pub cand_ids: Vec<u32>,
    /// `U_j`. Shape: [N, k].
    pub cand_unary: Vec<f32>,
    /// `S_j[p, c]`. Shape: [N, k, k].
    pub edge_scores: Vec<f32>,
    /// Walk choices `c*`. Shape: [N].
    pub choice: Vec<u32>,
    /// `row_j = S_j[prev, :]` (vLLM's cached draft logits, pre-temperature). Shape: [N, k].
    pub realized: Vec<f32>,
    /// 8th minus 9th (`k`-th minus `k+1`-th) largest logit of row `j`. Shape: [N].
    pub topk_gap: Vec<f32>,
}

/// Output of one draft step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Draft {
    /// `d_1..d_N` for positions `anchor_pos + 1 ..`. Shape: [N].
    pub tokens: Vec<u32>,
    /// The distributions the drafts were drawn from (§6; v2: zero off the candidates),
    /// at the request's temperature (temperature 1 when greedy). Present when
    /// `temperature > 0` or `trace`. Shape: [N][V].
    pub q: Option<Vec<Vec<f32>>>,
    /// Block hidden `h` after `norm`, rows 0..Q-1 (trace). Shape: [Q, H].
    pub hidden: Option<Vec<f32>>,
    /// Block logits, row 0 = the anchor row (trace). Shape: [Q, V].
    pub logits: Option<Vec<f32>>,
    /// Residual stream after each drafter layer (trace). Shape: [Ld, Q, H].
    pub layer_out: Option<Vec<f32>>,
    /// Top-1 minus top-2 of the row each draft was chosen from (trace; v1 `logits_j`,
    /// v2 `row_j`). Shape: [N].
    pub margin: Option<Vec<f32>>,
    /// v2 selector values (trace).
    pub selector: Option<SelectorTrace>,
}

/// The features of §3 for `rows` of a target forward: `per_layer_hidden` is
/// `ForwardOut::per_layer_hidden` (`[L+1, T, H]`, index 0 = embeddings), so the output of
/// layer `i` is index `i + 1`. Returns `[rows.len(), m * H]`, layers in `layer_ids` order.
pub fn target_features(
    per_layer_hidden: &[f32],
    num_tokens: usize,
    hidden: usize,
    layer_ids: &[usize],
    rows: Range<usize>,
) -> Result<Vec<f32>> {
    let plane = num_tokens * hidden;
    if plane == 0 || !per_layer_hidden.len().is_multiple_of(plane) {
        return Err(EngineError::ModelInput(format!(
            "target features: per-layer hidden states of {} values are not [L+1, {num_tokens}, {hidden}]",
            per_layer_hidden.len()
        )));
    }
    let n_layers = per_layer_hidden.len() / plane - 1;
    if let Some(&bad) = layer_ids.iter().find(|&&i| i >= n_layers) {
        return Err(EngineError::ModelInput(format!(
            "target features: target layer {bad} does not exist (the forward collected {n_layers} decoder layers)"
        )));
    }
    if rows.start > rows.end || rows.end > num_tokens {
        return Err(EngineError::ModelInput(format!(
            "target features: rows {rows:?} out of the forward's {num_tokens} tokens"
        )));
    }
    let mut out = Vec::with_capacity(rows.len() * layer_ids.len() * hidden);
    for t in rows {
        for &i in layer_ids {
            let a = (i + 1) * plane + t * hidden;
            out.extend_from_slice(&per_layer_hidden[a..a + hidden]);
        }
    }
    Ok(out)
}

/// In v2, a conv module and its dynamic taps `kernel_projection(y)` `[Q, 2*K*G]`.
fn conv_taps<'a>(
    v2: bool,
    cw: &'a Option<ConvWeights>,
    y: &[f32],
    q_rows: usize,
) -> Result<Option<(&'a ConvWeights, Vec<f32>)>> {
    match (v2, cw) {
        (true, Some(cw)) => Ok(Some((cw, cw.proj.forward(y, q_rows)?))),
        _ => Ok(None),
    }
}

fn input_err(msg: String) -> EngineError {
    EngineError::ModelInput(msg)
}

/// The DFlash2 drafter over one `KvCacheManager`'s drafter group.
#[derive(Debug)]
pub struct DFlash2 {
    w: DFlash2Weights,
    /// The drafter's sliding-window group and its block-table mapping.
    grp: DraftGroup,
    store: DraftKvStore,
    /// Per request: positions appended (`n`).
    ctx_len: HashMap<ReqSlot, usize>,
}

impl DFlash2 {
    /// Index of the group named `drafter_swa` ([`KV_GROUP_NAME`]) in `kv`, if any.
    pub fn find_group(kv: &KvCacheManager) -> Option<usize> {
        kv.groups().iter().position(|g| g.name == KV_GROUP_NAME)
    }

    /// A drafter whose context K/V live in group `group` of `kv` (a sliding-window group
    /// with the drafter's window, e.g. [`DFlash2Config::kv_group`]); the KV pages are
    /// allocated for the whole pool. Checks the drafter fits `target_cfg`.
    pub fn new(
        weights: DFlash2Weights,
        target_cfg: &ModelConfig,
        kv: &KvCacheManager,
        group: usize,
    ) -> Result<Self> {
        let grp = DraftGroup::new(&weights.cfg, target_cfg, kv, group)?;
        let store = DraftKvStore::new(
            weights.cfg.num_hidden_layers,
            grp.num_blocks,
            grp.block_size,
            weights.cfg.kv_row(),
        )?;
        Ok(Self {
            w: weights,
            grp,
            store,
            ctx_len: HashMap::new(),
        })
    }

    /// The config.
    pub fn config(&self) -> &DFlash2Config {
        &self.w.cfg
    }
    /// The weights.
    pub fn weights(&self) -> &DFlash2Weights {
        &self.w
    }
    /// Index of the drafter's group in the KV manager.
    pub fn group(&self) -> usize {
        self.grp.index
    }
    /// The KV pages.
    pub fn store(&self) -> &DraftKvStore {
        &self.store
    }
    /// Positions appended for a request (`n`, the next anchor's position), if known.
    pub fn context_len(&self, slot: ReqSlot) -> Option<usize> {
        self.ctx_len.get(&slot).copied()
    }
    /// Forget a request (call when it is freed or preempted; its blocks belong to the
    /// KV manager and are freed there).
    pub fn release(&mut self, slot: ReqSlot) {
        self.ctx_len.remove(&slot);
    }

    /// The features of §3 (`[rows.len(), F]`) for `rows` of a target forward run with
    /// `ForwardOptions { collect_hidden: true }`.
    pub fn features(&self, out: &ForwardOut, rows: Range<usize>) -> Result<Vec<f32>> {
        let ph = out.per_layer_hidden.as_deref().ok_or_else(|| {
            input_err(
                "target features need a forward with ForwardOptions { collect_hidden: true }"
                    .into(),
            )
        })?;
        let cfg = &self.w.cfg;
        target_features(
            ph,
            out.num_tokens,
            cfg.target_hidden_size,
            &cfg.dflash_config.target_layer_ids,
            rows,
        )
    }

    /// Append the target features (`[T, m * H]`, §3) of positions `start_pos ..
    /// start_pos + T` of request `slot`: compute their context K/V (§4) and write them into
    /// the drafter group's blocks (module doc for the protocol).
    pub fn append_context(
        &mut self,
        kv: &KvCacheManager,
        slot: ReqSlot,
        start_pos: usize,
        features: &[f32],
    ) -> Result<()> {
        self.grp.check_manager(kv)?;
        let cfg = &self.w.cfg;
        let f = cfg.feature_dim();
        if features.is_empty() || !features.len().is_multiple_of(f) {
            return Err(input_err(format!(
                "request slot {}: DFlash2 features have {} values, expected [T >= 1, {f}] (m = {} target layers x H = {})",
                slot.0,
                features.len(),
                cfg.num_feature_layers(),
                cfg.target_hidden_size
            )));
        }
        let t = features.len() / f;
        let n = self.ctx_len.get(&slot).copied().unwrap_or(0);
        if start_pos > n {
            return Err(input_err(format!(
                "request slot {}: append_context at position {start_pos}, but only positions 0..{n} have features: context must be appended in order (start_pos <= {n}; 0 restarts)",
                slot.0
            )));
        }
        let end = start_pos
            .checked_add(t)
            .ok_or_else(|| input_err("position overflow".into()))?;
        // Rows at positions <= end - W are never visible to a future query (§7).
        let keep_from = start_pos.max((end + 1).saturating_sub(cfg.sliding_window));
        let rows = end - keep_from;
        let table = kv.table(self.grp.index, slot);
        let slots: Vec<(BlockId, usize)> = (keep_from..end)
            .map(|p| self.grp.locate(table, slot, p))
            .collect::<Result<_>>()?;
        let eps = cfg.rms_norm_eps as f32;
        let (nkv, d) = (cfg.num_key_value_heads, cfg.head_dim);
        let x = &features[(keep_from - start_pos) * f..];
        let c = rmsnorm(&self.w.fc.forward(x, rows)?, &self.w.hidden_norm, eps); // [rows, H]
        let (cos, sin) = rope_tables(keep_from, rows, d, cfg.rope_theta);
        for (l, lw) in self.w.layers.iter().enumerate() {
            let mut k = rmsnorm(&lw.k.forward(&c, rows)?, &lw.k_norm, eps); // [rows, nkv, d]
            apply_rope(&mut k, nkv, d, &cos, &sin);
            let v = lw.v.forward(&c, rows)?;
            let row = nkv * d;
            for (i, &(b, off)) in slots.iter().enumerate() {
                self.store.write(
                    l,
                    b,
                    off,
                    &k[i * row..(i + 1) * row],
                    &v[i * row..(i + 1) * row],
                );
            }
        }
        self.ctx_len.insert(slot, end);
        Ok(())
    }

    /// Context K (after `k_norm` + RoPE) and V of one position of one layer, read through
    /// the block table (for tests and inspection). Shapes: [nkv, d] each.
    pub fn context_kv(
        &self,
        kv: &KvCacheManager,
        slot: ReqSlot,
        layer: usize,
        pos: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        self.grp.check_manager(kv)?;
        if layer >= self.w.cfg.num_hidden_layers {
            return Err(input_err(format!(
                "drafter layer {layer} does not exist ({} layers)",
                self.w.cfg.num_hidden_layers
            )));
        }
        let n = self.ctx_len.get(&slot).copied().unwrap_or(0);
        if pos >= n {
            return Err(input_err(format!(
                "request slot {}: position {pos} has no context row (positions 0..{n} appended)",
                slot.0
            )));
        }
        let (b, off) = self.grp.locate(kv.table(self.grp.index, slot), slot, pos)?;
        let (k, v) = self.store.read(layer, b, off);
        Ok((k.to_vec(), v.to_vec()))
    }

    /// One draft step (§5, §6): the block `[anchor, MASK x N]` at positions `anchor_pos ..`,
    /// over the context rows the window lets it see. `target` supplies the shared
    /// `embed_tokens` and `lm_head`; `rng` is required when `temperature > 0`.
    pub fn draft(
        &self,
        kv: &KvCacheManager,
        target: &dyn SharedHead,
        req: &DraftRequest,
        rng: Option<&mut dyn RngCore>,
    ) -> Result<Draft> {
        self.grp.check_manager(kv)?;
        let n = self.check_draft(target, req, rng.is_some())?;
        let cfg = &self.w.cfg;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let nn = req.num_speculative_tokens;
        let q_rows = nn + 1;
        let ctx_start = (n + 1).saturating_sub(cfg.sliding_window);
        let table = kv.table(self.grp.index, req.slot);
        let ctx_slots: Vec<(BlockId, usize)> = (ctx_start..n)
            .map(|p| self.grp.locate(table, req.slot, p))
            .collect::<Result<_>>()?;
        // x = embed_tokens[[anchor, MASK x N]]
        let mask = cfg.dflash_config.mask_token_id;
        let mut block = Vec::with_capacity(q_rows);
        block.push(req.anchor_token);
        block.extend(std::iter::repeat_n(mask, nn));
        let mut x = target.embed(&block)?;
        let (cos, sin) = rope_tables(n, q_rows, cfg.head_dim, cfg.rope_theta);
        let at = AttnCtx {
            q_rows,
            p0: n,
            ctx_start,
            cos: &cos,
            sin: &sin,
        };
        let layer_out = self.layers(&mut x, &ctx_slots, &at, req)?;
        let hid = rmsnorm(&x, &self.w.norm, cfg.rms_norm_eps as f32); // [Q, H]
                                                                      // Rows 1..Q predict positions P_1..P_N; row 0 (the anchor) only for the trace.
        let (logits, first) = if req.trace {
            (target.lm_head(&hid, q_rows)?, 1)
        } else {
            (target.lm_head(&hid[h..], nn)?, 0)
        };
        let rows = &logits[first * v..(first + nn) * v];
        let mut pick = Picked::new(req, nn);
        pick_into(&self.w, &hid[h..], rows, req, rng, &mut pick)?;
        Ok(Draft {
            tokens: pick.tokens,
            q: pick.q,
            hidden: req.trace.then_some(hid),
            logits: req.trace.then_some(logits),
            layer_out,
            margin: pick.margin,
            selector: pick.selector,
        })
    }

    /// The checks of a draft request; returns the context length `n` (the anchor's position).
    fn check_draft(
        &self,
        target: &dyn SharedHead,
        req: &DraftRequest,
        has_rng: bool,
    ) -> Result<usize> {
        let cfg = &self.w.cfg;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let slot = req.slot;
        cfg.check_num_speculative_tokens(req.num_speculative_tokens)?;
        if req.mode == DraftMode::V2 && !self.w.has_v2() {
            return Err(EngineError::InvalidDrafterConfig {
                drafter: "dflash2".into(),
                reason: "mode v2 needs the conv + candidate-selector tensors, which this checkpoint does not have (v1-only)".into(),
            });
        }
        if !(req.temperature.is_finite() && req.temperature >= 0.0) {
            return Err(EngineError::InvalidSamplingParams {
                field: "temperature".into(),
                reason: format!("{} must be finite and >= 0", req.temperature),
            });
        }
        if req.temperature > 0.0 && !has_rng {
            return Err(EngineError::InvalidSamplingParams {
                field: "temperature".into(),
                reason: "sampling drafts (temperature > 0) needs an RNG".into(),
            });
        }
        if req.anchor_token as usize >= v {
            return Err(input_err(format!(
                "request slot {}: anchor token id {} is not below vocab_size {v}",
                slot.0, req.anchor_token
            )));
        }
        let (th, tv) = target.head_dims();
        if th != h || tv != v {
            return Err(EngineError::InvalidConfig {
                key: "hidden_size / vocab_size".into(),
                reason: format!(
                    "the target weights (hidden {}, vocab {}) do not match the drafter (hidden {h}, vocab {v}): embed_tokens and lm_head are shared",
                    th, tv
                ),
            });
        }
        let n = self.ctx_len.get(&slot).copied().ok_or_else(|| {
            input_err(format!(
                "request slot {}: no DFlash2 context; append the prompt's target features (append_context) before drafting",
                slot.0
            ))
        })?;
        if req.anchor_pos != n {
            return Err(input_err(format!(
                "request slot {}: anchor at position {}, but {n} positions of context are appended: the anchor must sit at position n = {n} (docs/dflash2.md §7)",
                slot.0, req.anchor_pos
            )));
        }
        Ok(n)
    }

    /// The drafter's layer stack over the block `x` [Q, H] in place (§5), reading each
    /// layer's context K/V rows at `ctx_slots`; the per-layer outputs when tracing.
    fn layers(
        &self,
        x: &mut [f32],
        ctx_slots: &[(BlockId, usize)],
        at: &AttnCtx<'_>,
        req: &DraftRequest,
    ) -> Result<Option<Vec<f32>>> {
        let cfg = &self.w.cfg;
        let (h, q_rows) = (cfg.hidden_size, at.q_rows);
        let v2 = req.mode == DraftMode::V2;
        let eps = cfg.rms_norm_eps as f32;
        let mut layer_out = req
            .trace
            .then(|| Vec::with_capacity(cfg.num_hidden_layers * q_rows * h));
        let row = cfg.kv_row();
        let mut ck = vec![0.0f32; ctx_slots.len() * row];
        let mut cv = vec![0.0f32; ctx_slots.len() * row];
        for (l, lw) in self.w.layers.iter().enumerate() {
            for (i, &(b, off)) in ctx_slots.iter().enumerate() {
                let (kr, vr) = self.store.read(l, b, off);
                ck[i * row..(i + 1) * row].copy_from_slice(kr);
                cv[i * row..(i + 1) * row].copy_from_slice(vr);
            }
            let a1 = rmsnorm(x, &lw.input_norm, eps);
            let k_taps = cfg.dflash_config.conv_kernel_size;
            let gs = cfg.dflash_config.conv_group_size;
            let ac = conv_taps(v2, &lw.attn_conv, &a1, q_rows)?;
            let a2 = match &ac {
                Some((cw, d)) => grouped_conv(&a1, h, d, &cw.base, 0, k_taps, gs),
                None => a1,
            };
            let o = self.attention(lw, &a2, &ck, &cv, at)?;
            let o = match &ac {
                Some((cw, d)) => grouped_conv(&o, h, d, &cw.base, 1, k_taps, gs),
                None => o,
            };
            for (xv, ov) in x.iter_mut().zip(&o) {
                *xv += ov;
            }
            let f1 = rmsnorm(x, &lw.post_norm, eps);
            let mc = conv_taps(v2, &lw.mlp_conv, &f1, q_rows)?;
            let f2 = match &mc {
                Some((cw, d)) => grouped_conv(&f1, h, d, &cw.base, 0, k_taps, gs),
                None => f1,
            };
            let m = mlp(&lw.mlp, &f2, q_rows)?;
            let m = match &mc {
                Some((cw, d)) => grouped_conv(&m, h, d, &cw.base, 1, k_taps, gs),
                None => m,
            };
            for (xv, mv) in x.iter_mut().zip(&m) {
                *xv += mv;
            }
            if let Some(lo) = layer_out.as_mut() {
                lo.extend_from_slice(x);
            }
        }
        Ok(layer_out)
    }

    /// §5.2 for one layer: `a2 [Q, H]` -> `o_proj(attention) [Q, H]`. Context rows
    /// `ctx_k`/`ctx_v` `[S, nkv, d]` hold positions `ctx_start .. p0`.
    fn attention(
        &self,
        lw: &DraftLayer,
        a2: &[f32],
        ctx_k: &[f32],
        ctx_v: &[f32],
        at: &AttnCtx<'_>,
    ) -> Result<Vec<f32>> {
        let AttnCtx {
            q_rows,
            p0,
            ctx_start,
            cos,
            sin,
        } = *at;
        let cfg = &self.w.cfg;
        let (nh, nkv, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let eps = cfg.rms_norm_eps as f32;
        let gq = nh / nkv;
        let row = nkv * d;
        let mut q = rmsnorm(&lw.q.forward(a2, q_rows)?, &lw.q_norm, eps); // [Q, nh, d]
        apply_rope(&mut q, nh, d, cos, sin);
        let mut k = rmsnorm(&lw.k.forward(a2, q_rows)?, &lw.k_norm, eps); // [Q, nkv, d]
        apply_rope(&mut k, nkv, d, cos, sin);
        let v = lw.v.forward(a2, q_rows)?; // [Q, nkv, d]
        let s_ctx = ctx_k.len() / row;
        let scale = (d as f64).powf(-0.5) as f32;
        let mut o = vec![0.0f32; q_rows * nh * d];
        let mut scores = vec![0.0f32; s_ctx + q_rows];
        for j in 0..q_rows {
            // Visible context: P_j - pc <= W - 1.
            let lo = (p0 + j + 1)
                .saturating_sub(cfg.sliding_window)
                .max(ctx_start)
                - ctx_start;
            for hh in 0..nh {
                let g = hh / gq;
                let qv = &q[(j * nh + hh) * d..(j * nh + hh + 1) * d];
                let key = |s: usize| -> &[f32] {
                    if s < s_ctx {
                        &ctx_k[s * row + g * d..s * row + (g + 1) * d]
                    } else {
                        &k[(s - s_ctx) * row + g * d..(s - s_ctx) * row + (g + 1) * d]
                    }
                };
                let val = |s: usize| -> &[f32] {
                    if s < s_ctx {
                        &ctx_v[s * row + g * d..s * row + (g + 1) * d]
                    } else {
                        &v[(s - s_ctx) * row + g * d..(s - s_ctx) * row + (g + 1) * d]
                    }
                };
                let vis = lo..s_ctx + q_rows;
                let mut mx = f32::NEG_INFINITY;
                for s in vis.clone() {
                    let dot: f32 = qv.iter().zip(key(s)).map(|(a, b)| a * b).sum();
                    scores[s] = dot * scale;
                    mx = mx.max(scores[s]);
                }
                let mut sum = 0.0f32;
                for s in vis.clone() {
                    scores[s] = (scores[s] - mx).exp();
                    sum += scores[s];
                }
                let orow = &mut o[(j * nh + hh) * d..(j * nh + hh + 1) * d];
                for s in vis {
                    let p = scores[s] / sum;
                    for (ov, &vv) in orow.iter_mut().zip(val(s)) {
                        *ov += p * vv;
                    }
                }
            }
        }
        lw.o.forward(&o, q_rows)
    }
}

/// The block's attention inputs shared by every drafter layer: `q_rows` block rows at
/// positions `p0 ..`, context positions `ctx_start .. p0`, RoPE tables [Q, d/2].
struct AttnCtx<'a> {
    q_rows: usize,
    p0: usize,
    ctx_start: usize,
    cos: &'a [f32],
    sin: &'a [f32],
}

/// What the pickers produce: tokens, q and the trace parts.
struct Picked {
    tokens: Vec<u32>,
    /// Shape: [N][V] when sampling or tracing.
    q: Option<Vec<Vec<f32>>>,
    margin: Option<Vec<f32>>,
    selector: Option<SelectorTrace>,
}

impl Picked {
    fn new(req: &DraftRequest, nn: usize) -> Self {
        let want_q = req.temperature > 0.0 || req.trace;
        Self {
            tokens: Vec::with_capacity(nn),
            q: want_q.then(|| Vec::with_capacity(nn)),
            margin: req.trace.then(|| Vec::with_capacity(nn)),
            selector: None,
        }
    }
}

/// v2 (§6.2): the selector walk over the top-k candidates of each row, with q.
/// `hid_rows` [N, H] and `rows` [N, V] are the block's prediction rows.
fn pick_v2(
    w: &DFlash2Weights,
    hid_rows: &[f32],
    rows: &[f32],
    req: &DraftRequest,
    mut rng: Option<&mut dyn RngCore>,
    out: &mut Picked,
) -> Result<()> {
    let cfg = &w.cfg;
    let (v, nn) = (cfg.vocab_size, req.num_speculative_tokens);
    let sample_t = sample_temperature(req);
    let lrow = |j: usize| &rows[j * v..(j + 1) * v];
    let sel = w
        .selector
        .as_ref()
        .ok_or_else(|| input_err("selector weights missing (internal)".into()))?;
    let k = cfg.dflash_config.selector_top_k;
    let r = cfg.dflash_config.selector_rank;
    let g = sel.hidden_proj.forward(hid_rows, nn)?; // [N, r]
    let mut tr = SelectorTrace::default();
    let mut prev_cand: Vec<u32> = vec![req.anchor_token; k];
    let mut prev = 0usize;
    for j in 0..nn {
        let lr = lrow(j);
        let cand = topk_ids(lr, k);
        let unary: Vec<f32> = cand.iter().map(|&c| lr[c as usize]).collect();
        let gj = &g[j * r..(j + 1) * r];
        let realized = if req.trace {
            let s = edge_scores(sel, r, &cand, &unary, gj, &prev_cand);
            let row = s[prev * k..(prev + 1) * k].to_vec();
            tr.edge_scores.extend_from_slice(&s);
            row
        } else {
            edge_scores(sel, r, &cand, &unary, gj, &prev_cand[prev..prev + 1])
        };
        let p = softmax_temp(&realized, sample_t);
        let c = match rng.as_deref_mut() {
            Some(gen) if req.temperature > 0.0 => sample_index(&p, gen.random::<f32>()),
            _ => argmax(&realized),
        };
        out.tokens.push(cand[c]);
        if let Some(m) = out.margin.as_mut() {
            m.push(sorted_gap(&realized, 0));
        }
        if let Some(qo) = out.q.as_mut() {
            let mut qv = vec![0.0f32; v];
            for (&ci, &pi) in cand.iter().zip(&p) {
                qv[ci as usize] = pi;
            }
            qo.push(qv);
        }
        if req.trace {
            tr.cand_ids.extend_from_slice(&cand);
            tr.cand_unary.extend_from_slice(&unary);
            tr.choice.push(c as u32);
            tr.realized.extend_from_slice(&realized);
            tr.topk_gap.push(sorted_gap(lr, k - 1));
        }
        prev = c;
        prev_cand = cand;
    }
    if req.trace {
        out.selector = Some(tr);
    }
    Ok(())
}

/// §6 over prediction rows computed elsewhere (a device engine's block forward):
/// `hid_rows` [N, H] (rows 1..=N of the block hidden) and `rows` [N, V] (their logits);
/// the tokens and, when sampling, q (as a [`Proposal`]). The same code as
/// [`DFlash2::draft`]'s picker.
pub fn pick_rows(
    w: &DFlash2Weights,
    hid_rows: &[f32],
    rows: &[f32],
    req: &DraftRequest,
    rng: Option<&mut dyn RngCore>,
) -> Result<Proposal> {
    let (h, v, nn) = (
        w.cfg.hidden_size,
        w.cfg.vocab_size,
        req.num_speculative_tokens,
    );
    if hid_rows.len() != nn * h || rows.len() != nn * v {
        return Err(input_err(format!(
            "pick_rows: {} hidden and {} logits values for N = {nn} rows (H = {h}, V = {v})",
            hid_rows.len(),
            rows.len()
        )));
    }
    let mut pick = Picked::new(
        &DraftRequest {
            trace: false,
            ..*req
        },
        nn,
    );
    pick_into(w, hid_rows, rows, req, rng, &mut pick)?;
    Ok(Proposal {
        tokens: pick.tokens,
        probs: pick.q.map(DraftProbs::Dense),
    })
}

fn pick_into(
    w: &DFlash2Weights,
    hid_rows: &[f32],
    rows: &[f32],
    req: &DraftRequest,
    rng: Option<&mut dyn RngCore>,
    out: &mut Picked,
) -> Result<()> {
    if req.mode == DraftMode::V2 {
        pick_v2(w, hid_rows, rows, req, rng, out)
    } else {
        pick_v1(rows, w.cfg.vocab_size, req, rng, out);
        Ok(())
    }
}

/// The temperature the pickers' softmax uses (1 when greedy).
fn sample_temperature(req: &DraftRequest) -> f32 {
    if req.temperature > 0.0 {
        req.temperature
    } else {
        1.0
    }
}

/// v1 (§6.1): argmax (or a sample) per prediction row `rows` [N, V], with q.
fn pick_v1(
    rows: &[f32],
    v: usize,
    req: &DraftRequest,
    mut rng: Option<&mut dyn RngCore>,
    out: &mut Picked,
) {
    let nn = req.num_speculative_tokens;
    let sample_t = sample_temperature(req);
    let want_q = out.q.is_some();
    let lrow = |j: usize| &rows[j * v..(j + 1) * v];
    for j in 0..nn {
        let r = lrow(j);
        let p = want_q.then(|| softmax_temp(r, sample_t));
        let tok = match (&p, rng.as_deref_mut()) {
            (Some(p), Some(g)) if req.temperature > 0.0 => sample_index(p, g.random::<f32>()),
            _ => argmax(r),
        };
        out.tokens.push(tok as u32);
        if let Some(m) = out.margin.as_mut() {
            m.push(sorted_gap(r, 0));
        }
        if let (Some(qo), Some(p)) = (out.q.as_mut(), p) {
            qo.push(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    use speclab_engine::kv::manager::AllocArgs;
    use speclab_engine::kv::AllocOutcome;
    use speclab_engine::kv::CapPolicy;
    use speclab_engine::model::ModelWeights;
    use speclab_engine::{RequestStatus, RequestView};

    fn setup() -> (KvCacheManager, ModelWeights, DFlash2) {
        let tcfg = ModelConfig::micro();
        let target = ModelWeights::random(&tcfg, 3, false).unwrap();
        let dcfg = DFlash2Config::preset("dflash2-micro").unwrap();
        let mut layout = tcfg.kv_layout(16, 7, 32).unwrap();
        layout
            .groups
            .push(dcfg.kv_group(8, CapPolicy::None).unwrap());
        let mut kv = KvCacheManager::new(&layout, 32).unwrap();
        let view = RequestView {
            slot: ReqSlot(0),
            num_computed_tokens: 0,
            num_tokens: 20,
            num_prompt_tokens: 20,
            status: RequestStatus::Waiting,
            num_in_flight_tokens: 0,
        };
        let args = AllocArgs {
            num_new_tokens: 20,
            num_lookahead_tokens: 8,
            full_sequence_must_fit: true,
            has_scheduled_reqs: false,
        };
        assert!(matches!(
            kv.allocate_slots(&view, args).unwrap(),
            AllocOutcome::Allocated(_)
        ));
        let g = DFlash2::find_group(&kv).unwrap();
        let mut d = DFlash2::new(DFlash2Weights::random(&dcfg, 7).unwrap(), &tcfg, &kv, g).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let feats: Vec<f32> = (0..20 * dcfg.feature_dim())
            .map(|_| rng.random::<f32>() * 2.0 - 1.0)
            .collect();
        d.append_context(&kv, ReqSlot(0), 0, &feats).unwrap();
        (kv, target, d)
    }

    #[test]
    fn picks_from_rows_computed_elsewhere_equal_the_draft() {
        let (kv, target, d) = setup();
        let cfg = d.config().clone();
        let (h, v, nn) = (cfg.hidden_size, cfg.vocab_size, 7);
        for mode in [DraftMode::V1, DraftMode::V2] {
            let req = DraftRequest {
                slot: ReqSlot(0),
                anchor_token: 11,
                anchor_pos: 20,
                num_speculative_tokens: nn,
                mode,
                temperature: 0.0,
                trace: true,
            };
            let t = d.draft(&kv, &target, &req, None).unwrap();
            let (hid, logits) = (t.hidden.unwrap(), t.logits.unwrap());
            let (hid, rows) = (&hid[h..], &logits[v..]);
            let plain = DraftRequest {
                trace: false,
                ..req
            };
            let p = pick_rows(d.weights(), hid, rows, &plain, None).unwrap();
            assert_eq!(p.tokens, t.tokens, "{mode:?}");
            assert!(p.probs.is_none());
            // The sampled pick reproduces the draft's sample with the same seed.
            let hot = DraftRequest {
                temperature: 0.7,
                ..plain
            };
            let mut r1 = ChaCha8Rng::seed_from_u64(9);
            let a = d.draft(&kv, &target, &hot, Some(&mut r1)).unwrap();
            let mut r2 = ChaCha8Rng::seed_from_u64(9);
            let b = pick_rows(d.weights(), hid, rows, &hot, Some(&mut r2)).unwrap();
            assert_eq!(
                (a.tokens, a.q.map(DraftProbs::Dense)),
                (b.tokens, b.probs),
                "{mode:?}"
            );
            assert!(pick_rows(d.weights(), &hid[1..], rows, &plain, None).is_err());
            if mode == DraftMode::V2 {
                let sel = d.weights().selector.as_ref().unwrap();
                let (k, r) = (
                    cfg.dflash_config.selector_top_k,
                    cfg.dflash_config.selector_rank,
                );
                let mut cand = Vec::new();
                let mut unary = Vec::new();
                for j in 0..nn {
                    let row = &rows[j * v..(j + 1) * v];
                    let c = super::super::selector::topk_ids(row, k);
                    unary.extend(c.iter().map(|&i| row[i as usize]));
                    cand.extend(c);
                }
                let g = sel.hidden_proj.forward(hid, nn).unwrap();
                let w = walk_greedy(sel, r, 11, &cand, &unary, &g, k);
                assert_eq!(w, t.tokens);
                // A different anchor changes the first edge scores' predecessor.
                assert_eq!(
                    walk_greedy(sel, r, 11, &cand, &unary, &g, 0),
                    Vec::<u32>::new()
                );
                // The sampled walk over the same candidates: the draft's tokens, its q as
                // the candidates' probabilities (zero elsewhere), the RNG where it left it.
                let mut r3 = ChaCha8Rng::seed_from_u64(9);
                let (tok, qs) = super::super::selector::walk_sampled(
                    sel,
                    r,
                    11,
                    (&cand, &unary, &g),
                    k,
                    0.7,
                    &mut r3,
                );
                let mut r1 = ChaCha8Rng::seed_from_u64(9);
                let a = d.draft(&kv, &target, &hot, Some(&mut r1)).unwrap();
                assert_eq!(tok, a.tokens);
                let sparse = DraftProbs::Sparse(speclab_engine::spec::SparseProbs {
                    k,
                    ids: cand.clone(),
                    p: qs,
                });
                assert_eq!(Some(sparse.to_dense(v)), a.q);
                assert_eq!(r1.random::<u64>(), r3.random::<u64>());
            }
        }
    }

    #[test]
    fn sampling_draws_from_q() {
        let (kv, target, d) = setup();
        for mode in [DraftMode::V1, DraftMode::V2] {
            let req = DraftRequest {
                slot: ReqSlot(0),
                anchor_token: 11,
                anchor_pos: 20,
                num_speculative_tokens: 7,
                mode,
                temperature: 0.8,
                trace: mode == DraftMode::V2,
            };
            let mut r1 = ChaCha8Rng::seed_from_u64(5);
            let a = d.draft(&kv, &target, &req, Some(&mut r1)).unwrap();
            let mut r2 = ChaCha8Rng::seed_from_u64(5);
            let b = d.draft(&kv, &target, &req, Some(&mut r2)).unwrap();
            assert_eq!(a.tokens, b.tokens, "same seed, same drafts");
            let q = a.q.as_ref().unwrap();
            for (j, row) in q.iter().enumerate() {
                let s: f32 = row.iter().sum();
                assert!((s - 1.0).abs() < 1e-5, "q row sums to {s}");
                assert!(row[a.tokens[j] as usize] > 0.0, "a sampled draft has q > 0");
            }
            if let Some(sel) = &a.selector {
                let k = sel.cand_ids.len() / 7;
                for (j, &t) in a.tokens.iter().enumerate() {
                    assert_eq!(sel.cand_ids[j * k + sel.choice[j] as usize], t);
                    let nz = q[j].iter().filter(|&&p| p > 0.0).count();
                    assert!(nz <= k);
                }
            }
            // Greedy without trace carries no q.
            let g = d
                .draft(
                    &kv,
                    &target,
                    &DraftRequest {
                        temperature: 0.0,
                        trace: false,
                        ..req
                    },
                    None,
                )
                .unwrap();
            assert!(g.q.is_none() && g.logits.is_none());
            // Greedy equals the traced greedy run.
            let gt = d
                .draft(
                    &kv,
                    &target,
                    &DraftRequest {
                        temperature: 0.0,
                        trace: true,
                        ..req
                    },
                    None,
                )
                .unwrap();
            assert_eq!(g.tokens, gt.tokens);
        }
    }

    #[test]
    fn features_from_per_layer_hidden() {
        // [L+1 = 3, T = 2, H = 2]: layer i output = index i + 1.
        let ph: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let f = target_features(&ph, 2, 2, &[1, 0], 1..2).unwrap();
        assert_eq!(f, vec![10.0, 11.0, 6.0, 7.0]);
        assert!(target_features(&ph, 2, 2, &[2], 0..1).is_err());
        assert!(target_features(&ph, 2, 2, &[0], 0..3).is_err());
        assert!(target_features(&ph[1..], 2, 2, &[0], 0..1).is_err());
    }
}
