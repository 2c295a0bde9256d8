//! The scheduler crate's error enum.
//!
//! Every variant names the request or field and the offending numbers.
//! Invariant: `From<SchedulerError> for EngineError` maps each variant to the
//! closest engine variant (engine errors pass through unchanged), because the
//! `Scheduler` trait returns `speclab_engine::Result`.

use speclab_engine::{EngineError, RequestId};
use thiserror::Error;

/// Errors of the scheduler crate.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SchedulerError {
    /// An error from the KV manager or another engine component.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A configuration value is out of range.
    #[error("invalid scheduler config: {field}: {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    /// The request id is already live (waiting or running).
    #[error("request {id} already exists")]
    DuplicateRequest { id: RequestId },
    /// A request with no prompt tokens (vLLM rejects empty prompts).
    #[error("request {id}: empty prompt (prompt_len must be >= 1)")]
    EmptyPrompt { id: RequestId },
    /// A request that may generate nothing (vLLM requires max_tokens >= 1).
    #[error("request {id}: max_tokens must be >= 1")]
    ZeroMaxTokens { id: RequestId },
    /// The prompt leaves no room for one output token within max_model_len.
    #[error("request {id}: prompt of {prompt_len} tokens leaves no room for an output token within max_model_len {max_model_len}")]
    PromptTooLong {
        id: RequestId,
        prompt_len: u64,
        max_model_len: u64,
    },
    /// A result or operation named a request that is not running.
    #[error("request {id} is not a running request of this scheduler")]
    UnknownRequest { id: RequestId },
    /// The executor's result for a request is inconsistent with what was scheduled.
    #[error("step result for request {id}: {reason}")]
    BadStepResult { id: RequestId, reason: String },
    /// More live requests than `ReqSlot` can index.
    #[error("too many live requests: {live} (ReqSlot is a u32)")]
    TooManyRequests { live: usize },
}

impl From<SchedulerError> for EngineError {
    fn from(e: SchedulerError) -> Self {
        match e {
            SchedulerError::Engine(e) => e,
            SchedulerError::DuplicateRequest { id } => EngineError::DuplicateRequest {
                req: id.to_string(),
            },
            SchedulerError::UnknownRequest { id } => EngineError::UnknownRequest {
                req: id.to_string(),
            },
            SchedulerError::PromptTooLong {
                id,
                prompt_len,
                max_model_len,
            } => EngineError::PromptTooLong {
                req: id.to_string(),
                prompt_len,
                max_model_len,
            },
            e @ (SchedulerError::EmptyPrompt { id }
            | SchedulerError::ZeroMaxTokens { id }
            | SchedulerError::BadStepResult { id, .. }) => EngineError::BadTokenCount {
                req: id.to_string(),
                reason: e.to_string(),
            },
            e @ (SchedulerError::InvalidConfig { .. } | SchedulerError::TooManyRequests { .. }) => {
                EngineError::Unsupported(e.to_string())
            }
        }
    }
}
