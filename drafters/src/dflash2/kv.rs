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
//! Invariant: accessors take a block id `< num_blocks` and an offset `< bs` (callers
//! resolve them from a block table and check them first).

use speclab_engine::kv::BlockId;
use speclab_engine::{EngineError, Result};

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
