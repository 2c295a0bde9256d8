//! Scheduler configuration and request specs.
//!
//! Mirrors the fields of vLLM 0.33.0 `SchedulerConfig`
//! (`vllm/config/scheduler.py`: `max_num_seqs`, `max_num_batched_tokens`) and
//! the spec-decode numbers the scheduler reads from `VllmConfig`
//! (`num_speculative_tokens`, `num_lookahead_tokens`: N for MTP/EAGLE, N + 1
//! for DFlash, 0 without a KV-writing drafter, `vllm/config/vllm.py`).
//!
//! Invariant after [`SchedulerConfig::validate`]: every budget is >= 1, so a
//! step with work always has room to schedule something.

use serde::{Deserialize, Serialize};

use crate::error::SchedulerError;
use speclab_engine::RequestId;

/// Which requests the waiting queue admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionPolicy {
    /// vLLM-faithful FCFS: full sequence must fit, head-of-line blocking; a
    /// request that can never fit wedges the queue (reported as `wedged`).
    #[default]
    Fcfs,
    /// FCFS, but a request whose admission need exceeds the whole usable pool
    /// is removed and reported in `SchedulerOutput::rejected`.
    RejectImpossible,
}

/// Scheduler knobs (vLLM names).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// Max running requests (vLLM `max_num_seqs`).
    pub max_num_seqs: usize,
    /// Token budget per step (vLLM `max_num_batched_tokens`).
    pub max_num_batched_tokens: u64,
    /// Draft tokens per decode step (vLLM `num_speculative_tokens`).
    pub num_speculative_tokens: u64,
    /// KV lookahead slots per allocation (vLLM `VllmConfig.num_lookahead_tokens`):
    /// N for MTP/EAGLE, N + 1 for DFlash, 0 without a drafter or with n-gram.
    pub lookahead: u64,
    /// Admission policy.
    pub policy: AdmissionPolicy,
    /// Backstop: report a wedge after this many consecutive steps that
    /// schedule nothing while work is left (0 disables the backstop).
    pub max_steps_without_progress: u64,
}

impl Default for SchedulerConfig {
    /// vLLM defaults without a drafter (`SchedulerConfig`: 128 seqs, 2048 tokens).
    fn default() -> Self {
        Self {
            max_num_seqs: 128,
            max_num_batched_tokens: 2048,
            num_speculative_tokens: 0,
            lookahead: 0,
            policy: AdmissionPolicy::Fcfs,
            max_steps_without_progress: 100,
        }
    }
}

impl SchedulerConfig {
    /// Budgets must be >= 1 (vLLM: `Field(ge=1)`).
    pub fn validate(&self) -> Result<(), SchedulerError> {
        if self.max_num_seqs == 0 {
            return Err(SchedulerError::InvalidConfig {
                field: "max_num_seqs",
                reason: "must be >= 1".into(),
            });
        }
        if self.max_num_batched_tokens == 0 {
            return Err(SchedulerError::InvalidConfig {
                field: "max_num_batched_tokens",
                reason: "must be >= 1".into(),
            });
        }
        Ok(())
    }
}

/// A request to serve: prompt length and output budget (token ids do not
/// matter to scheduling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestSpec {
    pub id: RequestId,
    /// Prompt tokens (>= 1, and < max_model_len so one output token fits).
    pub prompt_len: u64,
    /// Output tokens to generate (>= 1; vLLM `SamplingParams.max_tokens`).
    pub max_tokens: u64,
}
