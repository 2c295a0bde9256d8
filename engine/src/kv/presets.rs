//! Named KV layouts.
//!
//! `glm53_dflash2`: GLM-5.3-Flash + DFlash2 as DESIGN.md pins it to reproduce
//! vLLM issue #55800 / the model card's wedge numbers: a full-attention group
//! at the serving block size, a one-block ring buffer (the sparse-attention
//! indexer tail, vLLM `CircularBufferSpec`), four recurrent-state groups
//! (KDA, Mamba "none" mode, 1 + 7 blocks for 7 speculative tokens) and the
//! drafter's sliding-window group (block 16, window 2048). Invariant: the
//! group order is the one the golden traces use.

use super::layout::{CapPolicy, GroupSpec, KvLayout};

/// GLM-5.3-Flash + DFlash2 (n = 7) at `block_size`, with the drafter cap policy and pool.
pub fn glm53_dflash2(
    block_size: u32,
    cap: CapPolicy,
    num_blocks: u32,
    max_model_len: u32,
    max_num_batched_tokens: u32,
) -> KvLayout {
    let mut groups = vec![
        GroupSpec::full("target_full", block_size),
        GroupSpec::ring_buffer("indexer_ring", block_size),
    ];
    for i in 0..4 {
        groups.push(GroupSpec::state(&format!("kda{i}"), 7));
    }
    groups.push(GroupSpec::sliding_window("drafter_swa", 16, 2048, cap));
    KvLayout {
        num_blocks: Some(num_blocks),
        kv_cache_memory_bytes: None,
        max_model_len,
        max_in_flight_tokens: Some(max_num_batched_tokens),
        watermark: 0.0,
        groups,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvCacheManager;
    use crate::{ReqSlot, RequestStatus, RequestView};

    fn need(cap: CapPolicy, n: u64) -> Vec<u64> {
        let kv =
            KvCacheManager::from_layout(&glm53_dflash2(2304, cap, 1012, 262_144, 8192)).unwrap();
        kv.admission_need(&RequestView {
            slot: ReqSlot(0),
            num_computed_tokens: 0,
            num_tokens: n,
            num_prompt_tokens: n,
            status: RequestStatus::Waiting,
            num_in_flight_tokens: 0,
        })
    }

    #[test]
    fn card_wedge_numbers() {
        // Model card: 15,523 tokens need exactly 1,011 blocks; ~15,556 need 1,013.
        assert_eq!(need(CapPolicy::None, 15_523).iter().sum::<u64>(), 1011);
        assert_eq!(need(CapPolicy::None, 15_556).iter().sum::<u64>(), 1013);
        assert_eq!(need(CapPolicy::None, 15_536).iter().sum::<u64>(), 1011);
        assert_eq!(need(CapPolicy::None, 15_537).iter().sum::<u64>(), 1012);
        // The other groups need 40 blocks at these lengths; the drafter SW group binds.
        let n = need(CapPolicy::None, 15_523);
        assert_eq!(n[..6].iter().sum::<u64>(), 40);
        assert_eq!(n[6], 971);
        // The card's fix caps the drafter group at cdiv(2048, 16) + 2 = 130.
        assert_eq!(need(CapPolicy::WindowPlusTwo, 256_388)[6], 130);
    }
}
