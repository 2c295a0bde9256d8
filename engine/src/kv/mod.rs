//! vLLM-faithful KV cache manager (no prefix caching).
//!
//! Ported behaviour (not code) of vLLM 0.33.0 `vllm/v1/core/`:
//! `block_pool.py` ([`BlockPool`]), `single_type_kv_cache_manager.py`
//! ([`group`]: full attention, sliding window, Mamba-style recurrent state in
//! "none" mode, circular ring buffer), `kv_cache_coordinator.py` +
//! `kv_cache_manager.py` ([`KvCacheManager`]: the sum over groups, the
//! admission gate and the per-step allocation) and `kv_cache_planning.py`
//! ([`planning`]: pool sizing from bytes and the startup check).
//!
//! Invariants (tested by proptest and by golden traces from vLLM itself):
//! free + held + null = total; no block is held twice; freeing a request
//! returns every block it held; results and free counts equal vLLM's for the
//! same operation trace.

pub mod group;
pub mod hybrid;
pub mod layout;
pub mod manager;
pub mod planning;
pub mod pool;
pub mod presets;

pub use group::GroupManager;
pub use layout::{CapPolicy, GroupKind, GroupSpec, KvLayout};
pub use manager::{AllocOutcome, KvCacheManager, NewBlocks};
pub use pool::{BlockId, BlockPool, NULL_BLOCK};
