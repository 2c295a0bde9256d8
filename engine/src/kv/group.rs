//! One manager per KV cache group kind (vLLM `SingleTypeKVCacheManager`s).
//!
//! Ported from `vllm/v1/core/single_type_kv_cache_manager.py` (0.33.0) with
//! prefix caching disabled, which means the "running request fast path" is
//! never taken (vLLM only fills `num_cached_block` when caching) and every
//! count goes through the general formula
//! `new = max(required - max(skipped_blocks, held_blocks), 0)`.
//!
//! - [`FullAttention`]: `required = cdiv(tokens, bs)`, nothing skipped.
//! - [`SlidingWindow`]: skipped tokens `max(0, computed - window + 1 - extra)`;
//!   skipped blocks are replaced by the null block in place (the table stays
//!   positional). Cap `Upstream` clamps only the admission count (vLLM's
//!   `max_admission_blocks_per_request`); `WindowPlusTwo` makes the table a
//!   per-request ring of `cdiv(window, bs) + 2` blocks on both paths.
//! - [`RecurrentState`]: Mamba "none" mode: `tokens + bs * num_speculative_blocks`,
//!   skipped tokens `computed - 1`.
//! - [`RingBuffer`]: `CircularBufferManager`, one block per request.
//!
//! Invariant: a table only ever holds blocks obtained from the pool, each
//! once; `free` returns the non-null ones in reverse table order (tail first).
//! Counts are saturating: no token count, however large, wraps around.

use super::layout::{CapPolicy, GroupKind, ResolvedGroup};
use super::pool::{BlockId, BlockPool, NULL_BLOCK};
use crate::request::ReqSlot;
use crate::util::cdiv;
use crate::Result;

/// The question `get_num_blocks_to_allocate` answers, for one group.
#[derive(Debug, Clone, Copy)]
pub struct AllocQuery {
    pub slot: ReqSlot,
    /// Tokens that need a slot, including already-allocated ones.
    pub num_tokens: u64,
    /// Computed tokens (local + external) used for the skipped-token count.
    pub total_computed_tokens: u64,
    /// Tokens of the target model (num_tokens without lookahead).
    pub num_tokens_main_model: u64,
    /// Whether the recycling-aware admission cap applies (must-fit gate only).
    pub apply_admission_cap: bool,
}

/// A group's block manager. Four operations, as vLLM's coordinator calls them.
pub trait GroupManager: Send {
    /// Blocks this group must allocate to serve `q` (vLLM `get_num_blocks_to_allocate`).
    fn num_blocks_to_allocate(&self, q: &AllocQuery) -> u64;
    /// Allocate blocks so the request has slots for `num_tokens` tokens; returns the new ids.
    fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: ReqSlot,
        num_tokens: u64,
        out: &mut Vec<BlockId>,
    ) -> Result<()>;
    /// Replace blocks no longer needed by the null block and free them.
    fn remove_skipped_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: ReqSlot,
        processed_computed_tokens: u64,
    );
    /// Free every block of the request (tail first) and forget it.
    fn free(&mut self, pool: &mut BlockPool, slot: ReqSlot);
    /// The request's block table (null blocks included).
    fn table(&self, slot: ReqSlot) -> &[BlockId];
}

/// Per-request block tables indexed by slot.
#[derive(Debug, Default, Clone)]
struct Tables {
    /// Shape: [num_slots][blocks of that request].
    tables: Vec<Vec<BlockId>>,
}

impl Tables {
    fn get(&self, s: ReqSlot) -> &[BlockId] {
        self.tables
            .get(s.0 as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }
    fn get_mut(&mut self, s: ReqSlot) -> &mut Vec<BlockId> {
        let i = s.0 as usize;
        if i >= self.tables.len() {
            self.tables.resize_with(i + 1, Vec::new);
        }
        &mut self.tables[i]
    }
    /// vLLM `SingleTypeKVCacheManager.free`: pop, trim the leading nulls, free reversed.
    fn free(&mut self, pool: &mut BlockPool, s: ReqSlot) {
        if let Some(t) = self.tables.get_mut(s.0 as usize) {
            let nh = t.iter().take_while(|&&b| b == NULL_BLOCK).count();
            pool.free_blocks(t[nh..].iter().rev().copied().collect::<Vec<_>>());
            t.clear();
        }
    }
    /// Length-based allocation shared by every positional manager.
    fn grow_to(
        &mut self,
        pool: &mut BlockPool,
        s: ReqSlot,
        required: u64,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        let t = self.get_mut(s);
        let have = t.len() as u64;
        if required > have {
            let start = out.len();
            pool.get_new_blocks(required - have, out)?;
            t.extend_from_slice(&out[start..]);
        }
        Ok(())
    }
    /// vLLM `_remove_blocks_in_range(0, n)`: walk back from n-1, stop at the first null.
    fn null_prefix(&mut self, pool: &mut BlockPool, s: ReqSlot, n: u64) {
        let t = self.get_mut(s);
        let n = (n as usize).min(t.len());
        let mut freed = Vec::new();
        for i in (0..n).rev() {
            if t[i] == NULL_BLOCK {
                break;
            }
            freed.push(t[i]);
            t[i] = NULL_BLOCK;
        }
        if !freed.is_empty() {
            pool.free_blocks(freed);
        }
    }
}

/// The general no-caching count: `max(required - max(skipped_blocks, held), 0)`.
fn general_count(required: u64, skipped_tokens: u64, bs: u64, held: u64) -> u64 {
    required.saturating_sub((skipped_tokens / bs).max(held))
}

/// Full attention (vLLM `FullAttentionManager`).
#[derive(Debug, Clone)]
pub struct FullAttention {
    bs: u64,
    t: Tables,
}

impl GroupManager for FullAttention {
    fn num_blocks_to_allocate(&self, q: &AllocQuery) -> u64 {
        general_count(
            cdiv(q.num_tokens, self.bs),
            0,
            self.bs,
            self.t.get(q.slot).len() as u64,
        )
    }
    fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: ReqSlot,
        num_tokens: u64,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        self.t.grow_to(pool, slot, cdiv(num_tokens, self.bs), out)
    }
    fn remove_skipped_blocks(&mut self, _: &mut BlockPool, _: ReqSlot, _: u64) {}
    fn free(&mut self, pool: &mut BlockPool, slot: ReqSlot) {
        self.t.free(pool, slot)
    }
    fn table(&self, slot: ReqSlot) -> &[BlockId] {
        self.t.get(slot)
    }
}

/// Sliding window (vLLM `SlidingWindowManager`), with the three cap policies.
#[derive(Debug, Clone)]
pub struct SlidingWindow {
    bs: u64,
    window: u64,
    extra: u64,
    cap: CapPolicy,
    cap_blocks: Option<u64>,
    t: Tables,
}

impl SlidingWindow {
    fn skipped_tokens(&self, computed: u64) -> u64 {
        computed
            .saturating_add(1)
            .saturating_sub(self.window + self.extra)
    }
    fn held_real(&self, slot: ReqSlot) -> u64 {
        self.t
            .get(slot)
            .iter()
            .filter(|&&b| b != NULL_BLOCK)
            .count() as u64
    }
}

impl GroupManager for SlidingWindow {
    fn num_blocks_to_allocate(&self, q: &AllocQuery) -> u64 {
        let mut required = cdiv(q.num_tokens, self.bs);
        if self.cap == CapPolicy::WindowPlusTwo {
            // The ring holds at most `cap` physical blocks; nothing is positional.
            let cap = self.cap_blocks.unwrap_or(required);
            return required.min(cap).saturating_sub(self.held_real(q.slot));
        }
        if q.apply_admission_cap {
            if let Some(c) = self.cap_blocks {
                required = required.min(c);
            }
        }
        general_count(
            required,
            self.skipped_tokens(q.total_computed_tokens),
            self.bs,
            self.t.get(q.slot).len() as u64,
        )
    }
    fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: ReqSlot,
        num_tokens: u64,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        let mut required = cdiv(num_tokens, self.bs);
        if self.cap == CapPolicy::WindowPlusTwo {
            if let Some(c) = self.cap_blocks {
                required = required.min(c);
            }
        }
        self.t.grow_to(pool, slot, required, out)
    }
    fn remove_skipped_blocks(&mut self, pool: &mut BlockPool, slot: ReqSlot, processed: u64) {
        if self.cap == CapPolicy::WindowPlusTwo {
            return;
        }
        let skipped = self.skipped_tokens(processed);
        if skipped == 0 {
            return;
        }
        self.t.null_prefix(pool, slot, skipped / self.bs);
    }
    fn free(&mut self, pool: &mut BlockPool, slot: ReqSlot) {
        self.t.free(pool, slot)
    }
    fn table(&self, slot: ReqSlot) -> &[BlockId] {
        self.t.get(slot)
    }
}

/// Recurrent state, Mamba "none" mode (vLLM `MambaManager`).
#[derive(Debug, Clone)]
pub struct RecurrentState {
    bs: u64,
    spec_blocks: u64,
    t: Tables,
}

impl GroupManager for RecurrentState {
    fn num_blocks_to_allocate(&self, q: &AllocQuery) -> u64 {
        let n = q
            .num_tokens
            .saturating_add(self.bs.saturating_mul(self.spec_blocks));
        // vLLM MambaManager.get_num_skipped_tokens = num_computed_tokens - 1.
        let skipped = q.total_computed_tokens.saturating_sub(1);
        general_count(
            cdiv(n, self.bs),
            skipped,
            self.bs,
            self.t.get(q.slot).len() as u64,
        )
    }
    fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: ReqSlot,
        num_tokens: u64,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        let n = num_tokens.saturating_add(self.bs.saturating_mul(self.spec_blocks));
        self.t.grow_to(pool, slot, cdiv(n, self.bs), out)
    }
    fn remove_skipped_blocks(&mut self, pool: &mut BlockPool, slot: ReqSlot, processed: u64) {
        let skipped = processed.saturating_sub(1);
        if skipped == 0 {
            return;
        }
        self.t.null_prefix(pool, slot, skipped / self.bs);
    }
    fn free(&mut self, pool: &mut BlockPool, slot: ReqSlot) {
        self.t.free(pool, slot)
    }
    fn table(&self, slot: ReqSlot) -> &[BlockId] {
        self.t.get(slot)
    }
}

/// One block per request (vLLM `CircularBufferManager`).
#[derive(Debug, Clone)]
pub struct RingBuffer {
    t: Tables,
}

impl GroupManager for RingBuffer {
    fn num_blocks_to_allocate(&self, q: &AllocQuery) -> u64 {
        u64::from(self.t.get(q.slot).is_empty())
    }
    fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: ReqSlot,
        _: u64,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        self.t.grow_to(pool, slot, 1, out)
    }
    fn remove_skipped_blocks(&mut self, _: &mut BlockPool, _: ReqSlot, _: u64) {}
    fn free(&mut self, pool: &mut BlockPool, slot: ReqSlot) {
        self.t.free(pool, slot)
    }
    fn table(&self, slot: ReqSlot) -> &[BlockId] {
        self.t.get(slot)
    }
}

/// Build the manager for a resolved group.
pub fn manager_for(g: &ResolvedGroup) -> Box<dyn GroupManager> {
    let t = Tables::default();
    match g.kind {
        GroupKind::Full => Box::new(FullAttention {
            bs: g.block_size,
            t,
        }),
        GroupKind::SlidingWindow => Box::new(SlidingWindow {
            bs: g.block_size,
            window: g.sliding_window,
            extra: g.extra_retained_tokens,
            cap: g.cap,
            cap_blocks: g.admission_cap_blocks,
            t,
        }),
        GroupKind::State => Box::new(RecurrentState {
            bs: g.block_size,
            spec_blocks: g.num_speculative_blocks,
            t,
        }),
        GroupKind::RingBuffer => Box::new(RingBuffer { t }),
    }
}
