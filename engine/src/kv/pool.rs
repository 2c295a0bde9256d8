//! The block pool: one shared pool of block ids for every KV cache group.
//!
//! Mirrors `vllm/v1/core/block_pool.py` with caching disabled: block 0 is the
//! null block (never handed out, never freed; vLLM's placeholder for skipped
//! sliding-window positions), so usable = num_blocks - 1. The free list is
//! vLLM's `FreeKVCacheBlockQueue`: allocation pops from the front; freed blocks
//! without a hash (all of them, without prefix caching) are *prepended* in the
//! order given (LIFO reuse). Matching that order exactly makes block ids equal
//! to vLLM's for the same trace. Allocation and free are O(1) per block.
//!
//! Invariant: every id in 1..num_blocks is either in the free queue or held
//! (`held[id]`), never both; the null block is neither.

use std::collections::VecDeque;

use crate::{EngineError, Result};

/// A block id (index into the KV cache tensors in real mode).
pub type BlockId = u32;

/// The null block's id.
pub const NULL_BLOCK: BlockId = 0;

/// The shared block pool.
#[derive(Debug, Clone)]
pub struct BlockPool {
    num_blocks: u32,
    /// Free block ids, front = next to allocate. Shape: [num_free].
    free: VecDeque<BlockId>,
    /// Whether each block id is held by some request. Shape: [num_blocks].
    held: Vec<bool>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks including the null block (vLLM `num_gpu_blocks`).
    pub fn new(num_blocks: u32) -> Result<Self> {
        if num_blocks < 1 {
            return Err(EngineError::InvalidLayout {
                field: "num_blocks".into(),
                reason: "must be at least 1 (the null block); vLLM asserts num_gpu_blocks > 0"
                    .into(),
            });
        }
        Ok(Self {
            num_blocks,
            free: (1..num_blocks).collect(),
            held: vec![false; num_blocks as usize],
        })
    }

    /// Total blocks including the null block.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Free blocks (excludes the null block, as vLLM's `get_num_free_blocks`).
    #[inline]
    pub fn num_free(&self) -> u64 {
        self.free.len() as u64
    }

    /// Blocks currently held by requests.
    pub fn num_held(&self) -> u64 {
        u64::from(self.num_blocks) - 1 - self.num_free()
    }

    /// Pop `n` blocks from the front of the free queue.
    pub fn get_new_blocks(&mut self, n: u64, out: &mut Vec<BlockId>) -> Result<()> {
        if n > self.num_free() {
            return Err(EngineError::PoolExhausted {
                wanted: n,
                free: self.num_free(),
            });
        }
        out.reserve(n as usize);
        for _ in 0..n {
            // Length checked above.
            let b = self.free.pop_front().unwrap_or(NULL_BLOCK);
            self.held[b as usize] = true;
            out.push(b);
        }
        Ok(())
    }

    /// Return blocks, given in eviction order (first = reused first), to the
    /// front of the free queue. The null block is skipped, as in vLLM.
    pub fn free_blocks<I>(&mut self, ordered: I)
    where
        I: IntoIterator<Item = BlockId>,
        I::IntoIter: DoubleEndedIterator,
    {
        for b in ordered.into_iter().rev() {
            if b == NULL_BLOCK {
                continue;
            }
            debug_assert!(self.held[b as usize], "double free of block {b}");
            self.held[b as usize] = false;
            self.free.push_front(b);
        }
    }

    /// Whether a block is currently held.
    pub fn is_held(&self, b: BlockId) -> bool {
        self.held.get(b as usize).copied().unwrap_or(false)
    }

    /// Iterate the free queue front to back.
    pub fn free_ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.free.iter().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_block_is_excluded_and_lifo_reuse() {
        let mut p = BlockPool::new(5).unwrap();
        assert_eq!(p.num_free(), 4);
        let mut v = vec![];
        p.get_new_blocks(3, &mut v).unwrap();
        assert_eq!(v, vec![1, 2, 3]);
        // vLLM frees a request's blocks in reverse order: tail first.
        p.free_blocks(v.iter().rev().copied().collect::<Vec<_>>());
        let mut w = vec![];
        p.get_new_blocks(4, &mut w).unwrap();
        assert_eq!(w, vec![3, 2, 1, 4]);
        assert!(p.get_new_blocks(1, &mut w).is_err());
    }

    #[test]
    fn zero_blocks_is_an_error() {
        assert!(BlockPool::new(0).is_err());
    }
}
