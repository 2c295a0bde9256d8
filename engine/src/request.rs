//! Request bookkeeping as vLLM's KV cache manager sees it.
//!
//! Mirrors the fields of `vllm.v1.request.Request` that
//! `KVCacheManager.allocate_slots` reads (vLLM 0.33.0): computed tokens,
//! total tokens (prompt + committed outputs, never unverified drafts), prompt
//! length, status, tokens in flight. Invariant: `num_computed_tokens` may run
//! ahead of `num_tokens` by the drafted tokens of the last scheduled step, and
//! is rolled back by rejections; it is never negative.

use serde::{Deserialize, Serialize};

/// Dense index of a live request inside a KV manager (reused after free).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ReqSlot(pub u32);

/// vLLM `RequestStatus`, the subset the KV manager distinguishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestStatus {
    Waiting,
    Running,
    Preempted,
    Finished,
}

/// The view of a request that `allocate_slots` needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestView {
    /// Slot of the request in the KV manager.
    pub slot: ReqSlot,
    /// Tokens whose KV has been computed (vLLM `num_computed_tokens`).
    pub num_computed_tokens: u64,
    /// Prompt + committed output tokens (vLLM `num_tokens`).
    pub num_tokens: u64,
    /// Prompt length (vLLM `num_prompt_tokens`).
    pub num_prompt_tokens: u64,
    /// Scheduling status.
    pub status: RequestStatus,
    /// Tokens scheduled but not yet settled (async scheduling); 0 when synchronous.
    pub num_in_flight_tokens: u64,
}
