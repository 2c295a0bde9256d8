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
//! Lazy: the free queue is always some freed blocks (a `VecDeque`) followed by the
//! never-touched tail `next_fresh..num_blocks` of the initial `1..num_blocks` order,
//! so a pool costs memory only for blocks that were handed out at least once. A
//! layout of 2^32 - 1 blocks builds instantly; memory grows with use. (vLLM's
//! queue has the same order: freed blocks are always prepended.)
//!
//! Invariant: every id in 1..num_blocks is either in the free queue or held
//! (`held[id]`), never both; the null block is neither.

use std::collections::VecDeque;

use crate::{EngineError, Result};

/// A block id (index into the KV cache tensors in real mode).
pub type BlockId = u32;

/// The null block's id.
pub const NULL_BLOCK: BlockId = 0;

/// The largest pool speclab builds: 2^24 blocks (an H200's whole KV memory in 16-token
/// blocks of a large model is about 10^6). Bounds the memory a layout can make the
/// manager use (ids, tables, held flags: under 200 MiB even with every block handed out).
pub const MAX_NUM_BLOCKS: u32 = 1 << 24;

/// The error for a pool above [`MAX_NUM_BLOCKS`].
pub fn too_many_blocks(num_blocks: u64) -> EngineError {
    EngineError::InvalidLayout {
        field: "num_blocks".into(),
        reason: format!(
            "{num_blocks} blocks is above the supported maximum {MAX_NUM_BLOCKS} (2^24); use a smaller pool or larger blocks"
        ),
    }
}

/// The shared block pool.
#[derive(Debug, Clone)]
pub struct BlockPool {
    num_blocks: u32,
    /// Freed block ids at the front of the free queue, front = next to allocate.
    freed: VecDeque<BlockId>,
    /// The untouched rest of the queue: ids `next_fresh..num_blocks`, in order.
    next_fresh: u32,
    /// Whether each block id below `next_fresh` is held. Shape: [next_fresh].
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
        if num_blocks > MAX_NUM_BLOCKS {
            return Err(too_many_blocks(u64::from(num_blocks)));
        }
        Ok(Self {
            num_blocks,
            freed: VecDeque::new(),
            next_fresh: 1,
            held: vec![false],
        })
    }

    /// Total blocks including the null block.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Free blocks (excludes the null block, as vLLM's `get_num_free_blocks`).
    #[inline]
    pub fn num_free(&self) -> u64 {
        self.freed.len() as u64 + u64::from(self.num_blocks - self.next_fresh)
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
            // Length checked above: either a freed block or a fresh one is left.
            let b = match self.freed.pop_front() {
                Some(b) => b,
                None => {
                    let b = self.next_fresh;
                    self.next_fresh += 1;
                    self.held.push(false);
                    b
                }
            };
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
            debug_assert!(self.is_held(b), "double free of block {b}");
            if let Some(h) = self.held.get_mut(b as usize) {
                *h = false;
            }
            self.freed.push_front(b);
        }
    }

    /// Whether a block is currently held.
    pub fn is_held(&self, b: BlockId) -> bool {
        self.held.get(b as usize).copied().unwrap_or(false)
    }

    /// Iterate the free queue front to back.
    pub fn free_ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.freed
            .iter()
            .copied()
            .chain(self.next_fresh..self.num_blocks)
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
    fn pools_are_built_lazily_and_bounded() {
        let e = BlockPool::new(u32::MAX).unwrap_err().to_string();
        assert!(e.contains("4294967295") && e.contains("16777216"), "{e}");
        let mut p = BlockPool::new(MAX_NUM_BLOCKS).unwrap();
        assert_eq!(p.num_free(), u64::from(MAX_NUM_BLOCKS) - 1);
        let mut v = vec![];
        p.get_new_blocks(3, &mut v).unwrap();
        assert_eq!(v, vec![1, 2, 3]);
        // Only what was handed out is tracked.
        assert!(p.held.len() <= 4 && p.freed.capacity() < 1024);
        p.free_blocks([2]);
        assert_eq!(p.free_ids().take(3).collect::<Vec<_>>(), vec![2, 4, 5]);
        assert_eq!(p.num_held(), 2);
    }

    #[test]
    fn zero_blocks_is_an_error() {
        assert!(BlockPool::new(0).is_err());
    }
}
