//! Exact bisection of the largest admissible prompt.
//!
//! "Admissible" means what vLLM's scheduler checks when it admits a waiting
//! request into an empty pool: `allocate_slots(num_new_tokens = first chunk =
//! min(prompt, max_num_batched_tokens), num_lookahead_tokens = lookahead,
//! full_sequence_must_fit = true)` succeeds (vLLM 0.33.0
//! `Scheduler.schedule` waiting loop + `KVCacheManager.allocate_slots`). The
//! admission check sizes `min(num_tokens, max_model_len)`, the per-step check
//! adds the lookahead to the chunk.
//!
//! Invariant relied on (and tested by proptest): admissibility is monotone in
//! the prompt length, so bisection over [1, max_model_len] is exact.

use speclab_engine::kv::manager::AllocArgs;
use speclab_engine::kv::{AllocOutcome, KvCacheManager, KvLayout};
use speclab_engine::{ReqSlot, RequestStatus, RequestView};

use crate::record::BoundRecord;
use crate::{ExperimentError, Result};

/// The settings the admission probe depends on.
#[derive(Debug, Clone, Copy)]
pub struct ProbeCtx<'a> {
    pub layout: &'a KvLayout,
    pub num_blocks: u32,
    pub max_num_batched_tokens: u64,
    pub lookahead: u64,
}

fn view(n: u64) -> RequestView {
    RequestView {
        slot: ReqSlot(0),
        num_computed_tokens: 0,
        num_tokens: n,
        num_prompt_tokens: n,
        status: RequestStatus::Waiting,
        num_in_flight_tokens: 0,
    }
}

/// Per-group blocks the admission gate needs for an `n`-token prompt.
pub fn admission_need(ctx: &ProbeCtx<'_>, n: u64) -> Result<Vec<u64>> {
    let kv = KvCacheManager::new(ctx.layout, ctx.num_blocks)
        .map_err(|e| ExperimentError::engine("bounds", e))?;
    Ok(kv.admission_need(&view(n)))
}

/// Whether an `n`-token prompt is admitted into an empty pool.
pub fn admissible(ctx: &ProbeCtx<'_>, n: u64) -> Result<bool> {
    let mut kv = KvCacheManager::new(ctx.layout, ctx.num_blocks)
        .map_err(|e| ExperimentError::engine("bounds", e))?;
    let args = AllocArgs {
        num_new_tokens: n.min(ctx.max_num_batched_tokens).max(1),
        num_lookahead_tokens: ctx.lookahead,
        full_sequence_must_fit: true,
        has_scheduled_reqs: false,
    };
    let out = kv
        .allocate_slots(&view(n), args)
        .map_err(|e| ExperimentError::engine("bounds", e))?;
    Ok(matches!(out, AllocOutcome::Allocated(_)))
}

/// Bisect the largest admissible prompt in [1, max_model_len], exact to the token.
pub fn find_bound(ctx: &ProbeCtx<'_>) -> Result<BoundRecord> {
    let mml = u64::from(ctx.layout.max_model_len);
    let names: Vec<String> = ctx.layout.groups.iter().map(|g| g.name.clone()).collect();
    let mut probes = 0u32;
    let mut probe = |n: u64| -> Result<bool> {
        probes += 1;
        admissible(ctx, n)
    };
    if probe(mml)? {
        let need = admission_need(ctx, mml)?;
        return Ok(BoundRecord {
            largest_admissible: Some(mml),
            unbounded: true,
            need_at_bound: need,
            need_above_bound: vec![],
            binding_group_above: None,
            probes,
        });
    }
    if !probe(1)? {
        let need = admission_need(ctx, 1)?;
        let bind = binding(&names, &need);
        return Ok(BoundRecord {
            largest_admissible: None,
            unbounded: false,
            need_at_bound: vec![],
            need_above_bound: need,
            binding_group_above: bind,
            probes,
        });
    }
    // Invariant: lo admissible, hi not.
    let (mut lo, mut hi) = (1u64, mml);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if probe(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let need_at = admission_need(ctx, lo)?;
    let need_above = admission_need(ctx, hi)?;
    let bind = binding(&names, &need_above);
    Ok(BoundRecord {
        largest_admissible: Some(lo),
        unbounded: false,
        need_at_bound: need_at,
        need_above_bound: need_above,
        binding_group_above: bind,
        probes,
    })
}

/// The group with the largest need (tied groups joined by " = ").
pub fn binding(names: &[String], need: &[u64]) -> Option<String> {
    speclab_engine::binding_group(names, need)
}

#[cfg(test)]
mod tests {
    use super::*;
    use speclab_engine::kv::presets::glm53_dflash2;
    use speclab_engine::kv::CapPolicy;

    #[test]
    fn card_bound_at_block_2304() {
        let layout = glm53_dflash2(2304, CapPolicy::None, 1012, 262_144, 8192);
        let ctx = ProbeCtx {
            layout: &layout,
            num_blocks: 1012,
            max_num_batched_tokens: 8192,
            lookahead: 8,
        };
        let b = find_bound(&ctx).unwrap();
        assert_eq!(b.largest_admissible, Some(15_536));
        assert_eq!(b.need_at_bound.iter().sum::<u64>(), 1011);
        assert_eq!(b.binding_group_above.as_deref(), Some("drafter_swa"));
        // Exactness: the bound is admissible, one more token is not.
        assert!(admissible(&ctx, 15_536).unwrap());
        assert!(!admissible(&ctx, 15_537).unwrap());
    }

    #[test]
    fn ties_name_every_binding_group() {
        let names: Vec<String> = ["full", "state", "swa"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(binding(&names, &[49, 8, 49]).as_deref(), Some("full = swa"));
        assert_eq!(binding(&names, &[7, 8, 971]).as_deref(), Some("swa"));
        assert_eq!(binding(&names, &[]), None);
    }

    #[test]
    fn window_plus_two_is_unbounded() {
        let layout = glm53_dflash2(2304, CapPolicy::WindowPlusTwo, 1012, 262_144, 8192);
        let ctx = ProbeCtx {
            layout: &layout,
            num_blocks: 1012,
            max_num_batched_tokens: 8192,
            lookahead: 8,
        };
        let b = find_bound(&ctx).unwrap();
        assert!(b.unbounded);
    }
}
