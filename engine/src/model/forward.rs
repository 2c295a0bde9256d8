//! The target model's forward pass in real mode, with KV through the engine's KV manager.
//!
//! Source: docs/model.md §2 (embedding, pre-norm blocks, final norm, untied lm_head),
//! §3-§5 (the blocks, in `attention.rs`, `kda.rs`, `moe.rs`), §11 (one code path for
//! prefill, decode and speculative verify, as `recipes/model.py::Model.forward`); KV and
//! state memory are the pages of `kv_store.rs` indexed by `KvCacheManager::table(group,
//! slot)` (the same block ids the scheduler allocates; no private cache).
//!
//! Protocol of [`ModelRunner::forward`] for a [`SeqChunk`] `{slot, tokens (T), start_pos
//! p, snapshot}`:
//! - the caller has allocated the request's slots with `KvCacheManager::allocate_slots`
//!   so that its `full` table covers positions `0..p+T` and its `kda_state` table has
//!   1 + N blocks (`N = num_speculative_tokens`); otherwise an error names the request;
//! - positions `0..p` must have been computed by earlier chunks of the same request (a
//!   chunk with `p == 0` starts a fresh sequence: zero KDA state);
//! - without `snapshot` the KDA state after the chunk's last token becomes the
//!   committed state (state block 0); prefill, chunked prefill and plain decode use this;
//! - with `snapshot` (speculative verify of `[last token, d_1..d_{T-1}]`, `T - 1 <= N`)
//!   the state after token `j < T-1` is also written to state block `j + 1`, and the
//!   request must then call [`ModelRunner::commit_state`]`(slot, accepted)` before its
//!   next chunk: the state after `accepted + 1` tokens becomes the committed one, and
//!   the next chunk starts at `p + accepted + 1` (attention K/V of rejected positions are
//!   simply overwritten). vLLM instead reads the next initial state from block
//!   `accepted` without copying; the copy keeps block 0 canonical for our store.
//!
//! Invariants: errors (never panics) for a bad token id, an empty chunk, a slot twice
//! in one batch, a table too short or holding the null block, a manager other than the
//! one the store was built for, or a chunk on a slot with an uncommitted snapshot.

use std::collections::HashMap;

use crate::kv::{BlockId, KvCacheManager, NULL_BLOCK};
use crate::model::attention::{full_attention, rope_tables, Span};
use crate::model::config::{LayerKind, ModelConfig};
use crate::model::kda::kda;
use crate::model::kv_store::KvStore;
use crate::model::moe::{mlp, moe, ExpertObserver, RouterTrace, Taps};
use crate::model::ops::rmsnorm;
use crate::model::weights::{Ffn, LayerWeights, Mixer, ModelWeights};
use crate::request::ReqSlot;
use crate::{EngineError, Result};

/// One request's tokens in a forward batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub slot: ReqSlot,
    /// Shape: [T].
    pub tokens: &'a [u32],
    /// Absolute position of `tokens[0]`.
    pub start_pos: usize,
    /// Write per-position KDA state snapshots (speculative verify); see the module doc.
    pub snapshot: bool,
}

/// Which logits rows to compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogitsRows {
    /// Every token: `[T_total, V]`.
    #[default]
    All,
    /// Only each chunk's last token: `[num_chunks, V]` (prefill without sampling every row).
    LastPerChunk,
}

/// Options of a forward pass.
#[derive(Debug, Clone, Copy, Default)]
pub struct ForwardOptions {
    pub logits: LogitsRows,
    /// Fill [`ForwardOut::per_layer_hidden`].
    pub collect_hidden: bool,
    /// With `collect_hidden`: the per-layer states are read on the device by a drafter
    /// running there ([`crate::traits::LayerHidden::Device`]); a device backend keeps
    /// them in its buffer and may leave `per_layer_hidden` empty. The CPU ignores it.
    pub hidden_on_device: bool,
    /// Fill [`ForwardOut::router`].
    pub collect_router: bool,
    /// Fill [`ForwardOut::argmax`] (greedy decoding needs only the argmax of each
    /// logits row). A device backend may then leave `logits` empty and keep the
    /// logits on the device; the CPU reference fills both.
    pub greedy_ids: bool,
    /// The caller needs no [`ForwardOut::hidden`] (no drafter reads it): a device
    /// backend may leave it empty instead of copying it out; the CPU fills it anyway.
    pub skip_hidden: bool,
    /// The caller samples through the backend's [`crate::backend::DeviceSampler`]: a
    /// device backend may leave `logits` empty and keep them on the device until the
    /// sampler has read them. The CPU ignores it.
    pub logits_on_device: bool,
}

/// Output of [`ModelRunner::forward`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForwardOut {
    /// Shape: [T_total, V] (or [num_chunks, V] with `LogitsRows::LastPerChunk`).
    pub logits: Vec<f32>,
    /// Final hidden after `model.norm` (the MTP input). Shape: [T_total, H].
    pub hidden: Vec<f32>,
    /// Embeddings then the residual stream after each decoder layer. Shape: [L+1, T_total, H].
    pub per_layer_hidden: Option<Vec<f32>>,
    /// Routing of each MoE layer in order.
    pub router: Option<Vec<RouterTrace>>,
    /// Tokens in the batch (T_total).
    pub num_tokens: usize,
    /// With `greedy_ids`: the argmax of each logits row (first maximum, as
    /// `ops::argmax`), in the rows `logits` would hold. Shape: [rows].
    pub argmax: Option<Vec<u32>>,
}

/// Runs the target model (and its MTP layer, `mtp.rs`) against a [`KvCacheManager`].
#[derive(Debug)]
pub struct ModelRunner {
    pub(crate) weights: ModelWeights,
    pub(crate) store: KvStore,
    /// Slots whose last chunk was a snapshot verify: slot -> chunk length.
    pending: HashMap<ReqSlot, usize>,
}

/// Where each layer's cache lives.
#[derive(Debug, Clone, Copy)]
pub(crate) enum CacheIndex {
    /// Attention layer index in the `full` group.
    Attn(usize),
    /// KDA layer index in the `kda_state` group.
    Kda(usize),
}

fn input_err(msg: String) -> EngineError {
    EngineError::ModelInput(msg)
}

/// Which decoder layer to run and where its cache lives.
#[derive(Clone, Copy)]
pub(crate) struct LayerCall<'a> {
    pub lw: &'a LayerWeights,
    /// Decoder layer index (the MTP layer is `num_hidden_layers`).
    pub layer: usize,
    pub cache: CacheIndex,
}

/// Run one decoder layer (§2 body) in place on `x [T, H]`.
pub(crate) fn decoder_layer(
    call: LayerCall<'_>,
    cfg: &ModelConfig,
    x: &mut [f32],
    spans: &[Span<'_>],
    store: &mut KvStore,
    taps: &mut Taps<'_>,
) -> Result<()> {
    let LayerCall { lw, layer, cache } = call;
    let eps = cfg.rms_norm_eps as f32;
    let t = x.len() / cfg.hidden_size;
    let a = rmsnorm(x, &lw.input_norm, eps);
    let mixed = match (&lw.mixer, cache) {
        (Mixer::Full(w), CacheIndex::Attn(i)) => full_attention(w, cfg, &a, spans, store, i)?,
        (Mixer::Kda(w), CacheIndex::Kda(i)) => kda(w, cfg, &a, spans, store, i)?,
        _ => {
            return Err(input_err(format!(
                "layer {layer}: mixer and cache kind disagree (internal)"
            )))
        }
    };
    for (xv, m) in x.iter_mut().zip(&mixed) {
        *xv += m;
    }
    let fin = rmsnorm(x, &lw.post_norm, eps);
    let ff = match &lw.ffn {
        Ffn::Dense(m) => mlp(m, &fin, t)?,
        Ffn::Moe(m) => moe(m, cfg, &fin, t, layer, taps)?,
    };
    for (xv, f) in x.iter_mut().zip(&ff) {
        *xv += f;
    }
    Ok(())
}

impl ModelRunner {
    /// A runner whose KV store is allocated for `kv`'s pool and groups (built from
    /// [`ModelConfig::kv_layout`]).
    pub fn new(weights: ModelWeights, kv: &KvCacheManager) -> Result<Self> {
        weights.cfg.validate()?;
        let store = KvStore::new(&weights.cfg, kv)?;
        Ok(Self {
            weights,
            store,
            pending: HashMap::new(),
        })
    }

    /// The weights.
    pub fn weights(&self) -> &ModelWeights {
        &self.weights
    }
    /// The config.
    pub fn config(&self) -> &ModelConfig {
        &self.weights.cfg
    }
    /// The KV store.
    pub fn store(&self) -> &KvStore {
        &self.store
    }

    /// Forget a request's pending snapshot (call when the request is freed or preempted).
    pub fn release(&mut self, slot: ReqSlot) {
        self.pending.remove(&slot);
    }

    pub(crate) fn check_manager(&self, kv: &KvCacheManager) -> Result<()> {
        let g = kv.groups();
        let ok_group = |i: Option<usize>, name: &str| {
            i.is_none_or(|i| g.get(i).is_some_and(|x| x.name == name))
        };
        if kv.pool().num_blocks() as usize != self.store.num_blocks()
            || !ok_group(self.store.full_group(), crate::model::config::FULL_GROUP)
            || !ok_group(self.store.state_group(), crate::model::config::STATE_GROUP)
        {
            return Err(input_err(format!(
                "this KvCacheManager ({} blocks) is not the one the ModelRunner's KV store was built for ({} blocks)",
                kv.pool().num_blocks(),
                self.store.num_blocks()
            )));
        }
        Ok(())
    }

    /// Check a request's table covers `need` blocks, all real and in the pool.
    pub(crate) fn check_table(
        &self,
        table: &[BlockId],
        need: usize,
        slot: ReqSlot,
        group: &str,
        what: &str,
    ) -> Result<()> {
        if table.len() < need {
            return Err(input_err(format!(
                "request slot {}: KV group `{group}` table has {} blocks, {what} needs {need}; allocate with KvCacheManager::allocate_slots first",
                slot.0,
                table.len()
            )));
        }
        if let Some(b) = table[..need]
            .iter()
            .find(|&&b| b == NULL_BLOCK || b as usize >= self.store.num_blocks())
        {
            return Err(input_err(format!(
                "request slot {}: KV group `{group}` table holds block {b}, which is the null block or outside the pool",
                slot.0
            )));
        }
        Ok(())
    }

    /// Build the spans of a batch: validation of tokens, slots and tables.
    fn plan<'k>(
        &self,
        kv: &'k KvCacheManager,
        batch: &[SeqChunk<'_>],
        need_full: bool,
    ) -> Result<Vec<Span<'k>>> {
        let cfg = &self.weights.cfg;
        let mut spans = Vec::with_capacity(batch.len());
        let mut offset = 0;
        for (ci, ch) in batch.iter().enumerate() {
            if ch.tokens.is_empty() {
                return Err(input_err(format!(
                    "request slot {}: empty chunk",
                    ch.slot.0
                )));
            }
            if batch[..ci].iter().any(|o| o.slot == ch.slot) {
                return Err(input_err(format!(
                    "request slot {} appears twice in one batch",
                    ch.slot.0
                )));
            }
            if let Some(&bad) = ch.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(input_err(format!(
                    "request slot {}: token id {bad} is not below vocab_size {}",
                    ch.slot.0, cfg.vocab_size
                )));
            }
            if ch.start_pos > 0 && self.pending.contains_key(&ch.slot) {
                return Err(input_err(format!(
                    "request slot {}: the last chunk was a speculative verify with snapshot; call commit_state before the next chunk",
                    ch.slot.0
                )));
            }
            let end = ch
                .start_pos
                .checked_add(ch.tokens.len())
                .ok_or_else(|| input_err("position overflow".into()))?;
            let full_table: &[BlockId] = match self.store.full_group() {
                Some(g) => kv.table(g, ch.slot),
                None => &[],
            };
            if need_full && self.store.full_group().is_some() {
                let bs = self.store.block_size();
                self.check_table(
                    full_table,
                    end.div_ceil(bs),
                    ch.slot,
                    crate::model::config::FULL_GROUP,
                    &format!("positions 0..{end}"),
                )?;
            }
            let state_table: &[BlockId] = match self.store.state_group() {
                Some(g) => kv.table(g, ch.slot),
                None => &[],
            };
            if self.store.state_group().is_some() {
                let need = if ch.snapshot { ch.tokens.len() } else { 1 };
                let what = if ch.snapshot {
                    format!("a snapshot verify of {} tokens (1 + num_speculative_tokens >= chunk length)", ch.tokens.len())
                } else {
                    "the committed state".to_string()
                };
                self.check_table(
                    state_table,
                    need,
                    ch.slot,
                    crate::model::config::STATE_GROUP,
                    &what,
                )?;
            }
            let rope = if cfg.num_full_layers() > 0 {
                rope_tables(ch.start_pos, ch.tokens.len(), cfg.head_dim, cfg.rope_theta)
            } else {
                (Vec::new(), Vec::new())
            };
            spans.push(Span {
                offset,
                len: ch.tokens.len(),
                start_pos: ch.start_pos,
                full_table,
                state_table,
                snapshot: ch.snapshot,
                rope,
            });
            offset += ch.tokens.len();
        }
        Ok(spans)
    }

    /// Forward a batch with default options (logits of every token).
    pub fn forward(&mut self, kv: &KvCacheManager, batch: &[SeqChunk<'_>]) -> Result<ForwardOut> {
        self.forward_with(kv, batch, &ForwardOptions::default())
    }

    /// Forward a batch: see the module doc for the KV / state protocol.
    pub fn forward_with(
        &mut self,
        kv: &KvCacheManager,
        batch: &[SeqChunk<'_>],
        opts: &ForwardOptions,
    ) -> Result<ForwardOut> {
        self.forward_inner(kv, batch, opts, None)
    }

    /// [`Self::forward_with`], showing every routed expert's projection inputs to
    /// `observer` (GPTQ calibration). The outputs are identical.
    pub fn forward_observed(
        &mut self,
        kv: &KvCacheManager,
        batch: &[SeqChunk<'_>],
        opts: &ForwardOptions,
        observer: &mut dyn ExpertObserver,
    ) -> Result<ForwardOut> {
        self.forward_inner(kv, batch, opts, Some(observer))
    }

    fn forward_inner(
        &mut self,
        kv: &KvCacheManager,
        batch: &[SeqChunk<'_>],
        opts: &ForwardOptions,
        observer: Option<&mut dyn ExpertObserver>,
    ) -> Result<ForwardOut> {
        self.check_manager(kv)?;
        let need_full = self.weights.cfg.num_full_layers() > 0;
        let spans = self.plan(kv, batch, need_full)?;
        let Self {
            weights,
            store,
            pending,
        } = self;
        let cfg = &weights.cfg;
        let h = cfg.hidden_size;
        let t_total: usize = batch.iter().map(|c| c.tokens.len()).sum();
        let mut x = Vec::with_capacity(t_total * h); // [T_total, H]
        for ch in batch {
            for &tok in ch.tokens {
                x.extend_from_slice(&weights.embed[tok as usize * h..(tok as usize + 1) * h]);
            }
        }
        let mut per_layer = opts.collect_hidden.then(|| {
            let mut v = Vec::with_capacity((cfg.num_hidden_layers + 1) * x.len());
            v.extend_from_slice(&x);
            v
        });
        let mut taps = Taps {
            router: opts.collect_router.then(Vec::new),
            experts: observer,
        };
        let (mut ai, mut ki) = (0, 0);
        for (i, lw) in weights.layers.iter().enumerate() {
            let cache = match cfg.layer_kind(i) {
                LayerKind::FullAttention => {
                    ai += 1;
                    CacheIndex::Attn(ai - 1)
                }
                LayerKind::Kda => {
                    ki += 1;
                    CacheIndex::Kda(ki - 1)
                }
            };
            let call = LayerCall {
                lw,
                layer: i,
                cache,
            };
            decoder_layer(call, cfg, &mut x, &spans, store, &mut taps)?;
            if let Some(p) = per_layer.as_mut() {
                p.extend_from_slice(&x);
            }
        }
        let hidden = rmsnorm(&x, &weights.norm, cfg.rms_norm_eps as f32);
        let logits = match opts.logits {
            LogitsRows::All => weights.lm_head.forward(&hidden, t_total)?,
            LogitsRows::LastPerChunk => {
                let mut last = Vec::with_capacity(spans.len() * h);
                for sp in &spans {
                    let r = sp.offset + sp.len - 1;
                    last.extend_from_slice(&hidden[r * h..(r + 1) * h]);
                }
                weights.lm_head.forward(&last, spans.len())?
            }
        };
        for ch in batch {
            if ch.snapshot {
                pending.insert(ch.slot, ch.tokens.len());
            } else {
                pending.remove(&ch.slot);
            }
        }
        let argmax = opts.greedy_ids.then(|| row_argmax(&logits, cfg.vocab_size));
        Ok(ForwardOut {
            logits,
            hidden,
            per_layer_hidden: per_layer,
            router: taps.router,
            num_tokens: t_total,
            argmax,
        })
    }

    /// After a snapshot verify of `T` tokens, keep the first `accepted + 1` of them: the
    /// KDA state after token `accepted` becomes the committed state (block 0). The next
    /// chunk of the request starts at `start_pos + accepted + 1`.
    pub fn commit_state(
        &mut self,
        kv: &KvCacheManager,
        slot: ReqSlot,
        accepted: usize,
    ) -> Result<()> {
        self.check_manager(kv)?;
        let len = match self.pending.get(&slot) {
            Some(&l) => l,
            None => {
                return Err(input_err(format!(
                    "request slot {}: commit_state without a pending snapshot verify",
                    slot.0
                )));
            }
        };
        if accepted + 1 > len {
            return Err(input_err(format!(
                "request slot {}: accepted = {accepted} but the verified chunk had {len} tokens (at most {} drafts)",
                slot.0,
                len - 1
            )));
        }
        if accepted + 1 < len {
            if let Some(g) = self.store.state_group() {
                let table = kv.table(g, slot);
                self.check_table(
                    table,
                    len,
                    slot,
                    crate::model::config::STATE_GROUP,
                    "commit_state",
                )?;
                let (src, dst) = (table[accepted + 1], table[0]);
                for l in 0..self.weights.cfg.num_kda_layers() {
                    self.store.copy_state(l, src, dst);
                }
            }
        }
        self.pending.remove(&slot);
        Ok(())
    }
}

/// The argmax (first maximum) of each `vocab`-wide row of `logits`. Shape: [rows].
pub fn row_argmax(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits
        .chunks_exact(vocab.max(1))
        .map(|r| crate::model::ops::argmax(r) as u32)
        .collect()
}
