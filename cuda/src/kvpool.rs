//! Device KV memory: one f32 pool of `num_blocks` blocks, addressed by the KV manager's
//! block ids exactly as `engine/src/model/kv_store.rs` addresses host pages.
//!
//! Source: engine/src/model/kv_store.rs (the layout and its sizing rule, reproduced
//! here; [`KvGeometry::new`] makes the same checks and the test compares it with
//! `KvStore::new` on the same manager), vLLM v1 hybrid KV cache (one pool; a block
//! belongs to one group at a time, so groups alias the same memory:
//! `floats_per_block = max(n_attn x full_page, n_kda x state_page)`).
//!
//! Invariants: the geometry is built for one `KvCacheManager` (its pool size and its
//! `full` / `kda_state` groups, whose declared memory must equal the model's pages);
//! attention layer `a` (full-attention layers in order, then MTP) sits at float
//! `a * full_page` of a block, KDA layer `l` at `l * state_page`.

use speclab_engine::kv::{GroupKind, KvCacheManager};
use speclab_engine::model::config::{FULL_GROUP, STATE_GROUP};
use speclab_engine::model::ModelConfig;

use crate::error::{CudaError, Result};

/// Sizes and group indices of the device KV pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub num_blocks: usize,
    pub full_group: Option<usize>,
    pub state_group: Option<usize>,
    /// Tokens per block of the `full` group (0 without one).
    pub block_size: usize,
    /// Attention layers with K/V (full-attention layers + MTP).
    pub n_attn: usize,
    pub n_kda: usize,
    /// f32 of one attention layer's page: 2 bs nkv d.
    pub full_page: usize,
    /// f32 of one KDA layer's page: 3 (kc-1) C + nl dl^2.
    pub state_page: usize,
    /// f32 of the conv part of a state page: 3 (kc-1) C.
    pub conv_len: usize,
    pub floats_per_block: usize,
    /// Blocks of the `kda_state` group a request holds: 1 + num_speculative_tokens.
    pub state_blocks: usize,
}

fn bad(reason: String) -> CudaError {
    CudaError::Input(format!("KV layout: {reason}"))
}

impl KvGeometry {
    /// The geometry of `kv` for `cfg` (KvStore::new's rules).
    pub fn new(cfg: &ModelConfig, kv: &KvCacheManager) -> Result<Self> {
        let groups = kv.groups();
        let find = |name: &str, kind: GroupKind| -> Result<Option<usize>> {
            match groups.iter().position(|g| g.name == name) {
                Some(i) if groups[i].kind == kind => Ok(Some(i)),
                Some(i) => Err(bad(format!(
                    "group `{name}` must be of kind {kind:?}, found {:?}",
                    groups[i].kind
                ))),
                None => Ok(None),
            }
        };
        let full_group = find(FULL_GROUP, GroupKind::Full)?;
        let state_group = find(STATE_GROUP, GroupKind::State)?;
        let n_attn = cfg.num_attention_kv_layers();
        let n_kda = cfg.num_kda_layers();
        if n_attn > 0 && full_group.is_none() {
            return Err(bad(format!(
                "the model has {n_attn} attention layers but no `{FULL_GROUP}` group"
            )));
        }
        if n_kda > 0 && state_group.is_none() {
            return Err(bad(format!(
                "the model has {n_kda} KDA layers but no `{STATE_GROUP}` group"
            )));
        }
        let block_size = full_group.map_or(0, |g| groups[g].block_size as usize);
        let full_page = cfg.full_page_floats(block_size);
        let state_page = cfg.state_page_floats();
        for (g, layers, page) in [
            (full_group, n_attn, full_page),
            (state_group, n_kda, state_page),
        ] {
            if let Some(m) = g.and_then(|g| groups[g].memory) {
                if m.num_layers as usize != layers || m.page_size_bytes != 4 * page as u64 {
                    return Err(bad(format!(
                        "group memory ({} layers x {} B) does not match the model ({layers} x {} B)",
                        m.num_layers,
                        m.page_size_bytes,
                        4 * page
                    )));
                }
            }
        }
        let state_blocks = state_group.map_or(1, |g| 1 + groups[g].num_speculative_blocks as usize);
        Ok(Self {
            num_blocks: kv.pool().num_blocks() as usize,
            full_group,
            state_group,
            block_size,
            n_attn,
            n_kda,
            full_page,
            state_page,
            conv_len: 3 * (cfg.linear_conv_kernel_dim - 1) * cfg.kda_channels(),
            floats_per_block: (n_attn * full_page).max(n_kda * state_page).max(1),
            state_blocks,
        })
    }

    /// f32 values of the whole pool.
    pub fn total_floats(&self) -> Result<usize> {
        self.num_blocks
            .checked_mul(self.floats_per_block)
            .ok_or_else(|| bad("pool size overflows".into()))
    }

    /// Float offset of attention layer `a`'s page within a block.
    pub fn attn_off(&self, a: usize) -> usize {
        a * self.full_page
    }

    /// Float offset of KDA layer `l`'s page within a block.
    pub fn state_off(&self, l: usize) -> usize {
        l * self.state_page
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use speclab_engine::model::KvStore;

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
