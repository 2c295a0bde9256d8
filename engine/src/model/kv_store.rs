//! Host-memory KV cache store indexed by the block ids of the engine's KV manager.
//!
//! Source: vLLM v1 hybrid KV cache (`vllm/v1/worker/gpu_model_runner.py`
//! `initialize_kv_cache`, `kv_cache_interface.py` `FullAttentionSpec` / `MambaSpec`): one
//! shared pool of block ids for every group; a block id held by a group indexes that
//! group's page of every one of its layers. As in vLLM's planning
//! (`kv/planning.rs::bytes_per_block`), one pool block is `max over groups of
//! (layers x page)` bytes, and a block belongs to one group at a time, so groups alias
//! the same memory: `floats_per_block = max(n_attn x full_page, n_kda x state_page)`.
//!
//! Layout of block `b` (f32, row-major), group `full` (block size `bs`): attention layer
//! `a` (the full-attention decoder layers in order, then the MTP layer) at
//! `b * fpb + a * 2*bs*nkv*d`: K `[bs, nkv, d]` (post-RoPE) then V `[bs, nkv, d]`;
//! token position `p` of a request lives in block `table[p / bs]` at offset `p % bs`.
//! Group `kda_state`: KDA layer `l` at `b * fpb + l * state_page`: conv states
//! `[3 (q, k, v), kc-1, C]` (pre-conv inputs, oldest first) then `S [nl, dl (key), dl
//! (value)]` (docs/model.md §4; vLLM stores S transposed). A request's state table
//! holds 1 + N blocks (Mamba "none" mode, N = num_speculative_tokens): block 0 is the
//! committed state; blocks 1..N receive the snapshots of a speculative verify (see
//! `model/forward.rs`).
//!
//! Invariants: the store is built for one `KvCacheManager`'s pool (`num_blocks`) and its
//! `full` / `kda_state` groups, whose `memory` must equal the model's page sizes; the
//! block accessors are crate-private and take a block id `< num_blocks` (the forward
//! pass checks every table first), never touching another block.

use crate::kv::{BlockId, GroupKind, KvCacheManager};
use crate::model::config::{ModelConfig, FULL_GROUP, STATE_GROUP};
use crate::{EngineError, Result};

/// The real-mode KV memory of the target model.
#[derive(Debug, Clone)]
pub struct KvStore {
    num_blocks: usize,
    /// Index of the `full` group in the manager's groups.
    full_group: Option<usize>,
    /// Index of the `kda_state` group.
    state_group: Option<usize>,
    /// Tokens per block of the `full` group.
    block_size: usize,
    /// Values of one token's K (or V): nkv * d.
    kv_row: usize,
    n_attn: usize,
    n_kda: usize,
    full_page: usize,
    conv_len: usize,
    state_page: usize,
    floats_per_block: usize,
    /// Shape: [num_blocks, floats_per_block] (see the module doc for the per-group layout).
    data: Vec<f32>,
}

fn bad(reason: String) -> EngineError {
    EngineError::InvalidLayout {
        field: "groups".into(),
        reason,
    }
}

/// Sizes and group indices of the target's KV memory for one [`KvCacheManager`]: the
/// rules the host store and a device pool share (same block ids, same page layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub num_blocks: usize,
    /// Index of the `full` group in the manager's groups.
    pub full_group: Option<usize>,
    /// Index of the `kda_state` group.
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

impl KvGeometry {
    /// The geometry of `kv` for `cfg`: its `full` / `kda_state` groups must be of the
    /// right kind, present when the model has such layers, and their `memory` must equal
    /// the model's page sizes.
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
                "the model has {n_attn} attention layers (incl. MTP) but the KV layout has no `{FULL_GROUP}` group (use ModelConfig::kv_layout)"
            )));
        }
        if n_kda > 0 && state_group.is_none() {
            return Err(bad(format!(
                "the model has {n_kda} KDA layers but the KV layout has no `{STATE_GROUP}` group (use ModelConfig::kv_layout)"
            )));
        }
        let block_size = full_group.map_or(0, |g| groups[g].block_size as usize);
        let full_page = cfg.full_page_floats(block_size);
        let state_page = cfg.state_page_floats();
        for (g, layers, page) in [
            (full_group, n_attn, full_page),
            (state_group, n_kda, state_page),
        ] {
            if let Some(g) = g {
                if let Some(m) = groups[g].memory {
                    if m.num_layers as usize != layers || m.page_size_bytes != 4 * page as u64 {
                        return Err(bad(format!(
                            "group `{}` memory ({} layers x {} B) does not match the model ({layers} layers x {} B f32 pages)",
                            groups[g].name,
                            m.num_layers,
                            m.page_size_bytes,
                            4 * page
                        )));
                    }
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
            .ok_or_else(|| bad("KV store size overflows".into()))
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

impl KvStore {
    /// Allocate the store for the pool and groups of `kv` (built from [`ModelConfig::kv_layout`]).
    pub fn new(cfg: &ModelConfig, kv: &KvCacheManager) -> Result<Self> {
        let geo = KvGeometry::new(cfg, kv)?;
        let (num_blocks, floats_per_block) = (geo.num_blocks, geo.floats_per_block);
        let total = geo.total_floats()?;
        let mut data = Vec::new();
        data.try_reserve_exact(total).map_err(|_| {
            EngineError::InsufficientKvMemory(format!(
                "cannot allocate {} bytes of host KV memory ({num_blocks} blocks x {} B)",
                4 * total as u128,
                4 * floats_per_block
            ))
        })?;
        data.resize(total, 0.0);
        Ok(Self {
            num_blocks,
            full_group: geo.full_group,
            state_group: geo.state_group,
            block_size: geo.block_size,
            kv_row: cfg.num_key_value_heads * cfg.head_dim,
            n_attn: geo.n_attn,
            n_kda: geo.n_kda,
            full_page: geo.full_page,
            conv_len: geo.conv_len,
            state_page: geo.state_page,
            floats_per_block,
            data,
        })
    }

    /// Blocks in the pool (null block included).
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Index of the `full` group.
    pub fn full_group(&self) -> Option<usize> {
        self.full_group
    }
    /// Index of the `kda_state` group.
    pub fn state_group(&self) -> Option<usize> {
        self.state_group
    }
    /// Tokens per block of the `full` group.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Bytes of host memory held.
    pub fn bytes(&self) -> usize {
        4 * self.data.len()
    }
    /// f32 values per pool block.
    pub fn floats_per_block(&self) -> usize {
        self.floats_per_block
    }

    fn attn_base(&self, layer: usize, block: BlockId) -> usize {
        debug_assert!(layer < self.n_attn && (block as usize) < self.num_blocks);
        block as usize * self.floats_per_block + layer * self.full_page
    }
    fn state_base(&self, layer: usize, block: BlockId) -> usize {
        debug_assert!(layer < self.n_kda && (block as usize) < self.num_blocks);
        block as usize * self.floats_per_block + layer * self.state_page
    }

    /// K and V of one block of attention layer `layer`. Shapes: [bs, nkv, d] each.
    pub(crate) fn kv_block(&self, layer: usize, block: BlockId) -> (&[f32], &[f32]) {
        let b = self.attn_base(layer, block);
        let half = self.full_page / 2;
        (&self.data[b..b + half], &self.data[b + half..b + 2 * half])
    }

    /// Write one token's K and V (`[nkv, d]` each) at `offset` of `block`.
    pub(crate) fn write_kv(
        &mut self,
        layer: usize,
        block: BlockId,
        offset: usize,
        k: &[f32],
        v: &[f32],
    ) {
        let b = self.attn_base(layer, block);
        let half = self.full_page / 2;
        let o = offset * self.kv_row;
        self.data[b + o..b + o + self.kv_row].copy_from_slice(k);
        self.data[b + half + o..b + half + o + self.kv_row].copy_from_slice(v);
    }

    /// Conv states `[3, kc-1, C]` and S `[nl, dl, dl]` of KDA layer `layer` in `block`.
    pub(crate) fn state(&self, layer: usize, block: BlockId) -> (&[f32], &[f32]) {
        let b = self.state_base(layer, block);
        (
            &self.data[b..b + self.conv_len],
            &self.data[b + self.conv_len..b + self.state_page],
        )
    }

    /// Mutable conv states and S of KDA layer `layer` in `block`.
    pub(crate) fn state_mut(&mut self, layer: usize, block: BlockId) -> (&mut [f32], &mut [f32]) {
        let b = self.state_base(layer, block);
        let (conv, s) = self.data[b..b + self.state_page].split_at_mut(self.conv_len);
        (conv, s)
    }

    /// Copy KDA layer `layer`'s state from block `from` to block `to`.
    pub(crate) fn copy_state(&mut self, layer: usize, from: BlockId, to: BlockId) {
        if from == to {
            return;
        }
        let src = self.state_base(layer, from);
        let dst = self.state_base(layer, to);
        self.data.copy_within(src..src + self.state_page, dst);
    }
}
