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

/// Why a request stopped (vLLM `RequestStatus.FINISHED_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model emitted EOS (included in the output; vLLM `FINISHED_STOPPED`).
    Eos,
    /// `max_tokens` outputs (vLLM `FINISHED_LENGTH_CAPPED`).
    Length,
    /// The sequence reached `max_model_len` (vLLM `FINISHED_LENGTH_CAPPED`).
    MaxModelLen,
}

impl FinishReason {
    /// The lower-case name used in records (`eos`, `length`, `max_model_len`).
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Length => "length",
            FinishReason::MaxModelLen => "max_model_len",
        }
    }
}

/// What ends a request: its output budget, the model's length and (unless ignored) EOS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopRule {
    /// vLLM `SamplingParams.max_tokens`.
    pub max_tokens: u64,
    /// vLLM `max_model_len`.
    pub max_model_len: u64,
    /// The EOS token; `None` when EOS does not stop (vLLM `ignore_eos`, or no token ids
    /// at all as in simulation).
    pub eos_token_id: Option<u32>,
}

/// vLLM `check_stop` (`vllm/v1/core/sched/utils.py`), applied after each appended token
/// by the scheduler's update (the one place the stop rule runs).
///
/// `num_tokens` = prompt + outputs after the append, `last` = the token just appended
/// (`None` when token ids are not tracked). Order: EOS, then `max_tokens`, then
/// `max_model_len` (see the note below).
///
/// Note on order: vLLM's `check_stop` tests the length caps before EOS, so an EOS that
/// is also the `max_tokens`-th token is reported there as length-capped. speclab keeps
/// EOS first, the order its records were made with; both stop at the same token, only
/// the reason differs in that corner.
pub fn check_stop(
    num_tokens: u64,
    num_output_tokens: u64,
    last: Option<u32>,
    rule: &StopRule,
) -> Option<FinishReason> {
    if last.is_some() && last == rule.eos_token_id {
        return Some(FinishReason::Eos);
    }
    if num_output_tokens >= rule.max_tokens {
        return Some(FinishReason::Length);
    }
    if num_tokens >= rule.max_model_len {
        return Some(FinishReason::MaxModelLen);
    }
    None
}
