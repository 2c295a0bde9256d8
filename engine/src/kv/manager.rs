//! The KV cache manager: the sum over groups, the admission gate and the
//! per-step allocation.
//!
//! Behaviour of vLLM 0.33.0 `KVCacheManager.allocate_slots` with
//! `KVCacheCoordinatorNoPrefixCache` (`vllm/v1/core/kv_cache_manager.py`,
//! `kv_cache_coordinator.py`), step by step:
//! 1. zero new tokens -> error (vLLM raises ValueError);
//! 2. watermark applies only to WAITING/PREEMPTED requests when others are scheduled;
//! 3. `full_sequence_must_fit`: size `min(num_tokens, max_model_len)` with the
//!    admission cap; if it exceeds the free blocks, return `None` with no side effects;
//! 4. `remove_skipped_blocks(computed - in_flight)`: runs even if the allocation
//!    then fails, so a failed step can *raise* the free count;
//! 5. size `min(computed + new + lookahead, max_model_len)` without the cap;
//!    fail with `None` if it exceeds the free blocks;
//! 6. allocate per group in group order.
//!
//! Invariant: a `None` result from the must-fit check changes nothing.

use super::group::{manager_for, AllocQuery, GroupManager};
use super::layout::{KvLayout, ResolvedGroup};
use super::pool::{BlockId, BlockPool};
use crate::request::{ReqSlot, RequestStatus, RequestView};
use crate::{EngineError, Result};

/// Newly allocated block ids per group, in group order. Shape: [num_groups][new blocks].
pub type NewBlocks = Vec<Vec<BlockId>>;

/// Outcome of `allocate_slots`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocOutcome {
    /// Allocated; the new block ids per group.
    Allocated(NewBlocks),
    /// Not enough free blocks (vLLM returns None).
    NoFit,
}

/// Arguments of one `allocate_slots` call beyond the request.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllocArgs {
    pub num_new_tokens: u64,
    pub num_lookahead_tokens: u64,
    pub full_sequence_must_fit: bool,
    pub has_scheduled_reqs: bool,
}

/// vLLM-faithful KV cache manager over a shared block pool.
pub struct KvCacheManager {
    groups: Vec<ResolvedGroup>,
    managers: Vec<Box<dyn GroupManager>>,
    pool: BlockPool,
    max_model_len: u64,
    watermark_blocks: u64,
}

impl std::fmt::Debug for KvCacheManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCacheManager")
            .field("groups", &self.groups)
            .field("num_blocks", &self.pool.num_blocks())
            .field("free", &self.pool.num_free())
            .finish()
    }
}

impl KvCacheManager {
    /// Build a manager for a layout with an explicit pool size (including the null block).
    pub fn new(layout: &KvLayout, num_blocks: u32) -> Result<Self> {
        let groups = layout.resolve_groups()?;
        let pool = BlockPool::new(num_blocks)?;
        let managers = groups.iter().map(manager_for).collect();
        // vLLM: int(watermark * kv_cache_config.num_blocks).
        let watermark_blocks = (layout.watermark * f64::from(num_blocks)) as u64;
        Ok(Self {
            groups,
            managers,
            pool,
            max_model_len: u64::from(layout.max_model_len),
            watermark_blocks,
        })
    }

    /// Build from a layout that names its pool (`num_blocks`, or bytes via planning).
    pub fn from_layout(layout: &KvLayout) -> Result<Self> {
        let n = super::planning::resolve_num_blocks(layout)?;
        Self::new(layout, n)
    }

    /// The resolved groups.
    pub fn groups(&self) -> &[ResolvedGroup] {
        &self.groups
    }
    /// The block pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
    /// Free blocks (excluding the null block).
    pub fn num_free_blocks(&self) -> u64 {
        self.pool.num_free()
    }
    /// Usable blocks (num_blocks - 1).
    pub fn usable_blocks(&self) -> u64 {
        u64::from(self.pool.num_blocks()) - 1
    }
    /// Max model length.
    pub fn max_model_len(&self) -> u64 {
        self.max_model_len
    }
    /// The request's table in group `g` (null blocks included).
    pub fn table(&self, g: usize, slot: ReqSlot) -> &[BlockId] {
        self.managers.get(g).map(|m| m.table(slot)).unwrap_or(&[])
    }

    /// Per-group blocks the must-fit admission check would require for this
    /// request right now (vLLM `get_num_blocks_to_allocate(..., apply_admission_cap=True)`).
    pub fn admission_need(&self, req: &RequestView) -> Vec<u64> {
        let total_computed = req.num_computed_tokens.min(self.max_model_len);
        let full = req.num_tokens.min(self.max_model_len);
        let q = AllocQuery {
            slot: req.slot,
            num_tokens: full,
            total_computed_tokens: total_computed,
            num_tokens_main_model: full,
            apply_admission_cap: true,
        };
        self.managers
            .iter()
            .map(|m| m.num_blocks_to_allocate(&q))
            .collect()
    }

    /// The sum of [`Self::admission_need`] (saturating).
    pub fn admission_total(&self, req: &RequestView) -> u64 {
        self.admission_need(req)
            .into_iter()
            .fold(0, u64::saturating_add)
    }

    /// vLLM `allocate_slots` (no prefix caching, no connector, no encoder).
    pub fn allocate_slots(&mut self, req: &RequestView, a: AllocArgs) -> Result<AllocOutcome> {
        if a.num_new_tokens == 0 {
            return Err(EngineError::ZeroTokenAllocation {
                req: format!("slot {}", req.slot.0),
            });
        }
        let local_computed = req.num_computed_tokens;
        let total_computed = local_computed.min(self.max_model_len);
        let watermark = if a.has_scheduled_reqs
            && matches!(
                req.status,
                RequestStatus::Waiting | RequestStatus::Preempted
            ) {
            self.watermark_blocks
        } else {
            0
        };
        // Checked: the counts come from traces and manifests (a lookahead of u64::MAX must
        // be refused, not wrap around to a small request).
        let overflow = || {
            EngineError::BadTokenCount {
            req: format!("slot {}", req.slot.0),
            reason: format!(
                "num_computed_tokens {total_computed} + num_new_tokens {} + lookahead {} overflows a 64-bit token count",
                a.num_new_tokens, a.num_lookahead_tokens
            ),
        }
        };
        let main = total_computed
            .checked_add(a.num_new_tokens)
            .ok_or_else(overflow)?;
        let need_slot = main
            .checked_add(a.num_lookahead_tokens)
            .ok_or_else(overflow)?
            .min(self.max_model_len);
        if a.full_sequence_must_fit {
            let need = self.admission_total(req);
            if need.saturating_add(watermark) > self.pool.num_free() {
                return Ok(AllocOutcome::NoFit);
            }
        }
        let processed = total_computed.saturating_sub(req.num_in_flight_tokens);
        for m in &mut self.managers {
            m.remove_skipped_blocks(&mut self.pool, req.slot, processed);
        }
        let q = AllocQuery {
            slot: req.slot,
            num_tokens: need_slot,
            total_computed_tokens: local_computed,
            num_tokens_main_model: main,
            apply_admission_cap: false,
        };
        let need = self
            .managers
            .iter()
            .map(|m| m.num_blocks_to_allocate(&q))
            .fold(0u64, u64::saturating_add);
        if need.saturating_add(watermark) > self.pool.num_free() {
            return Ok(AllocOutcome::NoFit);
        }
        let mut out = Vec::with_capacity(self.managers.len());
        for m in &mut self.managers {
            let mut v = Vec::new();
            m.allocate_new_blocks(&mut self.pool, req.slot, need_slot, &mut v)?;
            out.push(v);
        }
        Ok(AllocOutcome::Allocated(out))
    }

    /// Admit a fresh `n`-token sequence in one step: the must-fit allocation of a
    /// WAITING request with nothing computed (what a whole-prompt prefill, a
    /// calibration pass or a teacher-forced scoring pass needs).
    pub fn allocate_whole(&mut self, slot: ReqSlot, n: u64) -> Result<AllocOutcome> {
        let view = RequestView {
            slot,
            num_computed_tokens: 0,
            num_tokens: n,
            num_prompt_tokens: n,
            status: RequestStatus::Waiting,
            num_in_flight_tokens: 0,
        };
        let args = AllocArgs {
            num_new_tokens: n,
            num_lookahead_tokens: 0,
            full_sequence_must_fit: true,
            has_scheduled_reqs: false,
        };
        self.allocate_slots(&view, args)
    }

    /// vLLM `KVCacheManager.free`: every group in order, each tail first.
    pub fn free(&mut self, slot: ReqSlot) {
        for m in &mut self.managers {
            m.free(&mut self.pool, slot);
        }
    }

    /// Blocks held by a request per group (non-null).
    pub fn held_blocks(&self, slot: ReqSlot) -> Vec<u64> {
        self.managers
            .iter()
            .map(|m| {
                m.table(slot)
                    .iter()
                    .filter(|&&b| b != super::NULL_BLOCK)
                    .count() as u64
            })
            .collect()
    }
}
