//! Pool sizing from bytes and vLLM's startup check.
//!
//! From `vllm/v1/core/kv_cache_planning.py` (0.33.0): groups alias one shared
//! pool; one block costs the *largest* group's bytes per block
//! (`_get_kv_cache_bytes_per_block`: max over groups of the sum of the group's
//! layer page sizes), so `num_blocks = available_memory // bytes_per_block`,
//! then `num_gpu_blocks_override` replaces it if set (`may_override_num_blocks`).
//!
//! The startup check (`check_enough_kv_cache_memory`) refuses a config where one
//! request of max_model_len tokens cannot fit. vLLM sizes that request with each
//! spec's `max_memory_usage_bytes`, where a sliding-window spec always uses the
//! recycling-aware bound (`max_admission_blocks_per_request`, the Upstream
//! formula), whatever the runtime admission does: that mismatch is the root
//! of the DFlash2 wedge. Here the check is done in blocks of the shared pool.
//!
//! [`plan_pool`] is the one place a byte budget (vLLM `--kv-cache-memory-bytes`)
//! becomes a pool: per group the page bytes the engine's stores allocate for one block
//! (`num_layers x page_size_bytes`, the `memory` the model and drafter declare and their
//! stores check), `bytes_per_block` = the largest group's page, and `num_blocks =
//! bytes // bytes_per_block` (vLLM `vllm/v1/core/kv_cache_utils.py::get_kv_cache_configs`
//! -> `kv_cache_planning.py::_get_kv_cache_bytes_per_block` / `get_num_blocks`).
//!
//! Invariant: `resolve_num_blocks` and `plan_pool` never return 0 blocks.

use serde::{Deserialize, Serialize};

use super::layout::{GroupKind, KvLayout, ResolvedGroup};
use crate::util::cdiv;
use crate::{EngineError, Result};

/// One KV group's page in a pool plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupPage {
    pub name: String,
    /// Layers whose page one block id of this group indexes.
    pub num_layers: u32,
    /// Bytes of one layer's page (one block).
    pub page_size_bytes: u64,
    /// `num_layers x page_size_bytes`: this group's bytes of one pool block.
    pub bytes_per_block: u64,
}

/// A pool sized from a byte budget ([`plan_pool`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolPlan {
    /// The budget (vLLM `kv_cache_memory_bytes`).
    pub kv_cache_memory_bytes: u64,
    /// Per group, in layout order.
    pub groups: Vec<GroupPage>,
    /// The largest group's bytes per block (vLLM `_get_kv_cache_bytes_per_block`).
    pub bytes_per_block: u64,
    /// `kv_cache_memory_bytes // bytes_per_block` (null block included, as in vLLM).
    pub num_blocks: u32,
}

/// Size the pool of `layout` from `kv_cache_memory_bytes` the way vLLM sizes a hybrid
/// model's shared pool (module doc); `layout.num_blocks` is ignored.
///
/// Source: vLLM 0.33.0 `vllm/v1/core/kv_cache_utils.py::get_kv_cache_configs` (groups of
/// one unified pool), `vllm/v1/core/kv_cache_planning.py::_get_kv_cache_bytes_per_block`
/// (max over groups of the sum of the group's layer page sizes) and `get_num_blocks`
/// (`available_memory // bytes_per_block`).
pub fn plan_pool(layout: &KvLayout, kv_cache_memory_bytes: u64) -> Result<PoolPlan> {
    let mut l = layout.clone();
    l.num_blocks = None;
    l.kv_cache_memory_bytes = Some(kv_cache_memory_bytes);
    let resolved = l.resolve_groups()?;
    let bytes_per_block = bytes_per_block(&resolved)?;
    let groups = resolved
        .iter()
        .filter_map(|g| {
            g.memory.map(|m| GroupPage {
                name: g.name.clone(),
                num_layers: m.num_layers,
                page_size_bytes: m.page_size_bytes,
                bytes_per_block: u64::from(m.num_layers).saturating_mul(m.page_size_bytes),
            })
        })
        .collect();
    let num_blocks = resolve_num_blocks(&l)?;
    Ok(PoolPlan {
        kv_cache_memory_bytes,
        groups,
        bytes_per_block,
        num_blocks,
    })
}

/// Bytes of one pool block: max over groups of `num_layers * page_size_bytes`.
pub fn bytes_per_block(groups: &[ResolvedGroup]) -> Result<u64> {
    let mut best = 0u64;
    for g in groups {
        let m = g.memory.ok_or_else(|| EngineError::InvalidLayout {
            field: format!("groups ({}).memory", g.name),
            reason: "pool sizing from bytes needs num_layers and page_size_bytes for every group"
                .into(),
        })?;
        best = best.max(u64::from(m.num_layers).saturating_mul(m.page_size_bytes));
    }
    Ok(best)
}

/// The pool size of a layout: `num_blocks` if given (vLLM's override), else bytes / bytes_per_block.
pub fn resolve_num_blocks(layout: &KvLayout) -> Result<u32> {
    let groups = layout.resolve_groups()?;
    let n = match (layout.num_blocks, layout.kv_cache_memory_bytes) {
        (Some(n), _) => u64::from(n),
        (None, Some(bytes)) => {
            let bpb = bytes_per_block(&groups)?;
            if bpb == 0 {
                return Err(EngineError::InvalidLayout {
                    field: "groups".into(),
                    reason: "every group has 0 bytes per block: nothing to size the pool by"
                        .into(),
                });
            }
            bytes / bpb
        }
        (None, None) => {
            return Err(EngineError::InvalidLayout {
                field: "num_blocks".into(),
                reason: "give num_blocks (vLLM num_gpu_blocks_override) or kv_cache_memory_bytes with per-group memory".into(),
            })
        }
    };
    if n == 0 {
        return Err(EngineError::InsufficientKvMemory(format!(
            "no KV cache blocks: {} bytes of KV memory hold 0 blocks (vLLM: 'No available memory for the cache blocks')",
            layout.kv_cache_memory_bytes.unwrap_or(0)
        )));
    }
    u32::try_from(n).map_err(|_| EngineError::InvalidLayout {
        field: "num_blocks".into(),
        reason: format!("{n} blocks exceeds u32"),
    })
}

/// Blocks vLLM's startup sizer reserves for one max_model_len request in a group
/// (`spec.max_memory_usage_bytes / page_size`).
pub fn startup_blocks(g: &ResolvedGroup, max_model_len: u64, max_in_flight_tokens: u64) -> u64 {
    match g.kind {
        GroupKind::Full => cdiv(max_model_len, g.block_size),
        GroupKind::SlidingWindow => {
            cdiv(
                (g.sliding_window - 1 + g.extra_retained_tokens + max_in_flight_tokens)
                    .min(max_model_len),
                g.block_size,
            ) + 1
        }
        // MambaSpec reserves the state plus its speculative blocks.
        GroupKind::State => cdiv(
            max_model_len + g.block_size * g.num_speculative_blocks,
            g.block_size,
        ),
        GroupKind::RingBuffer => 1,
    }
}

/// The startup check: refuse a layout whose pool cannot hold one max_model_len request.
pub fn check_startup(layout: &KvLayout, num_blocks: u32) -> Result<()> {
    let groups = layout.resolve_groups()?;
    let mml = u64::from(layout.max_model_len);
    let in_flight = u64::from(layout.max_in_flight_tokens.unwrap_or(layout.max_model_len));
    let per: Vec<(String, u64)> = groups
        .iter()
        .map(|g| (g.name.clone(), startup_blocks(g, mml, in_flight)))
        .collect();
    let need: u64 = per.iter().map(|p| p.1).sum();
    let usable = u64::from(num_blocks).saturating_sub(1);
    if need > usable {
        let detail: Vec<String> = per.iter().map(|(n, b)| format!("{n}={b}")).collect();
        return Err(EngineError::InsufficientKvMemory(format!(
            "to serve one request of max_model_len {mml} tokens, {need} KV blocks are needed ({}), \
             but the pool has {usable} usable blocks ({num_blocks} including the null block); \
             increase KV memory or decrease max_model_len",
            detail.join(", ")
        )));
    }
    Ok(())
}
