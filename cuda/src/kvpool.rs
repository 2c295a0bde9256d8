//! Device KV memory: one f32 pool of `num_blocks` blocks, addressed by the KV manager's
//! block ids exactly as `engine/src/model/kv_store.rs` addresses host pages.
//!
//! Source: engine/src/model/kv_store.rs (the layout and its sizing rule: the engine's
//! `KvGeometry`, which the host store is built from too; the test compares it with
//! `KvStore::new` on the same manager), vLLM v1 hybrid KV cache (one pool; a block
//! belongs to one group at a time, so groups alias the same memory:
//! `floats_per_block = max(n_attn x full_page, n_kda x state_page)`).
//!
//! Invariants: the geometry is built for one `KvCacheManager` (its pool size and its
//! `full` / `kda_state` groups, whose declared memory must equal the model's pages);
//! attention layer `a` (full-attention layers in order, then MTP) sits at float
//! `a * full_page` of a block, KDA layer `l` at `l * state_page`.

/// Sizes and group indices of the device KV pool: the engine's [`KvGeometry`], the same
/// rules the host store (`speclab_engine::model::KvStore`) uses, so the same block ids index
/// both.
pub use speclab_engine::model::kv_store::KvGeometry;

#[cfg(test)]
mod tests {
    use super::*;
    use speclab_engine::kv::KvCacheManager;
    use speclab_engine::model::{KvStore, ModelConfig};

    #[test]
    fn geometry_matches_the_host_store() {
        for (cfg, bs, spec, blocks) in [
            (ModelConfig::micro(), 16u32, 3u32, 64u32),
            (ModelConfig::tiny(), 16, 7, 40),
            (ModelConfig::tiny(), 32, 0, 9),
        ] {
            let kv =
                KvCacheManager::from_layout(&cfg.kv_layout(bs, spec, blocks).unwrap()).unwrap();
            let g = KvGeometry::new(&cfg, &kv).unwrap();
            let host = KvStore::new(&cfg, &kv).unwrap();
            assert_eq!(g.num_blocks, host.num_blocks());
            assert_eq!(g.floats_per_block, host.floats_per_block());
            assert_eq!(g.block_size, host.block_size());
            assert_eq!(g.full_group, host.full_group());
            assert_eq!(g.state_group, host.state_group());
            assert_eq!(g.state_blocks, 1 + spec as usize);
            assert_eq!(4 * g.total_floats().unwrap(), host.bytes());
        }
    }

    #[test]
    fn mismatched_manager_is_rejected() {
        let kv = KvCacheManager::from_layout(&ModelConfig::micro().kv_layout(16, 0, 8).unwrap())
            .unwrap();
        assert!(KvGeometry::new(&ModelConfig::tiny(), &kv).is_err());
    }
}
