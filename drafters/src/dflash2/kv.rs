//! Host memory of the drafter's context K/V, indexed by the block ids of its own
//! sliding-window KV cache group.
//!
//! Source: docs/dflash2.md §7 ("Mapping onto the allocator": a position-`p` row lives at
//! slot `block_table[p // bs] * bs + p % bs` of the drafter group), vLLM's per-layer KV
//! cache tensors (`[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V).
//!
//! Layout: per drafter layer `l`, `k[l]` and `v[l]` are f32 `[num_blocks, bs, nkv, d]`
//! (K after `k_norm` + RoPE, §4). The store is sized for every block id of the pool (a
//! block belongs to one group at a time; this engine keeps the drafter's pages separate
//! from the target's `KvStore` instead of aliasing them).
//!
//! [`DraftGroup`] is the drafter group's geometry and its block-table mapping, shared by
//! the host drafter and the CUDA engine's (which keeps the same pages in device memory):
//! positional (`table[p / bs]`, vLLM) for cap policies `None` and `Upstream`; a
//! per-request ring of `cdiv(W, bs) + 2` blocks (`table[(p / bs) % ring]`) for
//! `WindowPlusTwo` (the live context spans at most `cdiv(W - 1, bs) + 1` blocks, so live
//! rows never alias).
//!
//! Invariant: accessors take a block id `< num_blocks` and an offset `< bs` (callers
//! resolve them from a block table with [`DraftGroup::locate`], which checks them).

use speclab_engine::kv::{BlockId, CapPolicy, GroupKind, KvCacheManager, NULL_BLOCK};
use speclab_engine::model::ModelConfig;
use speclab_engine::{EngineError, ReqSlot, Result};

use super::config::DFlash2Config;

/// The drafter's sliding-window group in a KV manager: which group, its block size, the
/// ring length, the pool size; validated against the drafter's config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftGroup {
    /// Index in the manager's groups.
    pub index: usize,
    pub name: String,
    /// Tokens per block.
    pub block_size: usize,
    /// Ring length in blocks (cap policy `WindowPlusTwo`), else positional tables.
    pub ring_blocks: Option<usize>,
    /// Blocks of the pool (null block included).
    pub num_blocks: usize,
}

fn input_err(msg: String) -> EngineError {
    EngineError::ModelInput(msg)
}

impl DraftGroup {
    /// Group `group` of `kv` for a drafter of `cfg` over `target_cfg`: it must be a
    /// sliding-window group with the drafter's window (e.g. [`DFlash2Config::kv_group`]).
    pub fn new(
        cfg: &DFlash2Config,
        target_cfg: &ModelConfig,
        kv: &KvCacheManager,
        group: usize,
    ) -> Result<Self> {
        cfg.validate()?;
        cfg.check_target(target_cfg)?;
        let groups = kv.groups();
        let bad = |reason: String| EngineError::InvalidLayout {
            field: format!("groups[{group}]"),
            reason,
        };
        let g = groups.get(group).ok_or_else(|| {
            bad(format!(
                "the KV layout has {} groups; the DFlash2 drafter needs its own sliding-window group",
                groups.len()
            ))
        })?;
        if g.kind != GroupKind::SlidingWindow {
            return Err(bad(format!(
                "group `{}` is {:?}; the DFlash2 drafter's K/V need a sliding_window group (DFlash2Config::kv_group)",
                g.name, g.kind
            )));
        }
        if g.sliding_window != cfg.sliding_window as u64 {
            return Err(bad(format!(
                "group `{}` has sliding_window {}, the drafter's config sliding_window is {}",
                g.name, g.sliding_window, cfg.sliding_window
            )));
        }
        if let Some(m) = g.memory {
            let page = 4 * cfg.kv_page_floats(g.block_size as usize) as u64;
            if m.num_layers as usize != cfg.num_hidden_layers || m.page_size_bytes != page {
                return Err(bad(format!(
                    "group `{}` memory ({} layers x {} B) does not match the drafter ({} layers x {page} B f32 pages)",
                    g.name, m.num_layers, m.page_size_bytes, cfg.num_hidden_layers
                )));
            }
        }
        let block_size =
            usize::try_from(g.block_size).map_err(|_| bad("block_size exceeds usize".into()))?;
        let ring_blocks = match g.cap {
            CapPolicy::WindowPlusTwo => Some(g.admission_cap_blocks.unwrap_or(u64::MAX) as usize),
            _ => None,
        };
        Ok(Self {
            index: group,
            name: g.name.clone(),
            block_size,
            ring_blocks,
            num_blocks: kv.pool().num_blocks() as usize,
        })
    }

    /// Check that `kv` is the manager this group was resolved in (same pool, same group).
    pub fn check_manager(&self, kv: &KvCacheManager) -> Result<()> {
        let ok = kv.pool().num_blocks() as usize == self.num_blocks
            && kv
                .groups()
                .get(self.index)
                .is_some_and(|g| g.name == self.name && g.block_size as usize == self.block_size);
        if !ok {
            return Err(input_err(format!(
                "this KvCacheManager ({} blocks) is not the one the DFlash2 drafter was built for ({} blocks, group {} `{}`)",
                kv.pool().num_blocks(),
                self.num_blocks,
                self.index,
                self.name
            )));
        }
        Ok(())
    }

    /// Block and offset of position `pos` in a request's drafter-group table; an error
    /// (never a read) for a missing, null (evicted) or out-of-pool block.
    pub fn locate(&self, table: &[BlockId], slot: ReqSlot, pos: usize) -> Result<(BlockId, usize)> {
        let bi = pos / self.block_size;
        let idx = match self.ring_blocks {
            Some(r) if r > 0 => bi % r,
            _ => bi,
        };
        let b = *table.get(idx).ok_or_else(|| {
            input_err(format!(
                "request slot {}: DFlash2 KV group `{}` table has {} blocks, position {pos} needs block index {idx}; allocate with KvCacheManager::allocate_slots (lookahead N + 1) first",
                slot.0,
                self.name,
                table.len()
            ))
        })?;
        if b == NULL_BLOCK {
            return Err(input_err(format!(
                "request slot {}: DFlash2 context position {pos} is in block index {idx} of group `{}`, which the allocator replaced by the null block (evicted), but the drafter's window still needs it",
                slot.0, self.name
            )));
        }
        if b as usize >= self.num_blocks {
            return Err(input_err(format!(
                "request slot {}: group `{}` table holds block {b}, outside the pool of {} blocks",
                slot.0, self.name, self.num_blocks
            )));
        }
        Ok((b, pos % self.block_size))
    }
}

/// The drafter's KV pages.
#[derive(Debug, Clone)]
pub struct DraftKvStore {
    num_blocks: usize,
    block_size: usize,
    /// nkv * d.
    row: usize,
    /// Per layer. Shape: [num_blocks, bs, nkv, d].
    k: Vec<Vec<f32>>,
    /// Per layer. Shape: [num_blocks, bs, nkv, d].
    v: Vec<Vec<f32>>,
}

fn alloc(n: usize, what: &str) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        EngineError::InsufficientKvMemory(format!(
            "cannot allocate {} bytes of host memory for the DFlash2 drafter's {what}",
            4 * n as u128
        ))
    })?;
    v.resize(n, 0.0);
    Ok(v)
}

impl DraftKvStore {
    /// Zeroed pages for `num_layers` layers over a pool of `num_blocks` blocks.
    pub fn new(
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        row: usize,
    ) -> Result<Self> {
        let per = num_blocks
            .checked_mul(block_size)
            .and_then(|x| x.checked_mul(row))
            .ok_or_else(|| {
                EngineError::InsufficientKvMemory("DFlash2 KV store size overflows".into())
            })?;
        let mut k = Vec::with_capacity(num_layers);
        let mut v = Vec::with_capacity(num_layers);
        for l in 0..num_layers {
            k.push(alloc(per, &format!("layer {l} K cache"))?);
            v.push(alloc(per, &format!("layer {l} V cache"))?);
        }
        Ok(Self {
            num_blocks,
            block_size,
            row,
            k,
            v,
        })
    }

    /// Blocks in the pool (null block included).
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Bytes of host memory held.
    pub fn bytes(&self) -> usize {
        4 * self.k.iter().chain(&self.v).map(Vec::len).sum::<usize>()
    }

    fn at(&self, block: BlockId, offset: usize) -> usize {
        debug_assert!((block as usize) < self.num_blocks && offset < self.block_size);
        (block as usize * self.block_size + offset) * self.row
    }

    /// Write one token's K and V (`[nkv, d]` each) of `layer`.
    pub fn write(&mut self, layer: usize, block: BlockId, offset: usize, k: &[f32], v: &[f32]) {
        let a = self.at(block, offset);
        self.k[layer][a..a + self.row].copy_from_slice(k);
        self.v[layer][a..a + self.row].copy_from_slice(v);
    }

    /// One token's K and V of `layer`. Shapes: [nkv, d] each.
    pub fn read(&self, layer: usize, block: BlockId, offset: usize) -> (&[f32], &[f32]) {
        let a = self.at(block, offset);
        (
            &self.k[layer][a..a + self.row],
            &self.v[layer][a..a + self.row],
        )
    }
}
