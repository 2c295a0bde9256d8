//! The engine's one error enum.
//!
//! Every variant carries enough context (request, group, numbers) for a
//! researcher to act on it without a debugger. Invariant: constructing an
//! error never panics and never loses the offending value.

use thiserror::Error;

/// Errors of the engine crate.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum EngineError {
    /// A KV layout or pool parameter is invalid.
    #[error("invalid KV layout: {field}: {reason}")]
    InvalidLayout { field: String, reason: String },
    /// vLLM raises ValueError for a zero-token allocation with nothing computed to adopt.
    #[error("request {req}: allocate_slots with num_new_tokens = 0 (vLLM raises ValueError: num_new_tokens must be greater than 0)")]
    ZeroTokenAllocation { req: String },
    /// A request longer than the model can serve.
    #[error("request {req}: prompt of {prompt_len} tokens exceeds max_model_len {max_model_len}")]
    PromptTooLong { req: String, prompt_len: u64, max_model_len: u64 },
    /// An operation named a request the manager does not know.
    #[error("unknown request {req}")]
    UnknownRequest { req: String },
    /// A request id was added twice.
    #[error("request {req} already exists")]
    DuplicateRequest { req: String },
    /// Token bookkeeping went out of range (e.g. computed tokens below zero).
    #[error("request {req}: {reason}")]
    BadTokenCount { req: String, reason: String },
    /// The pool was asked for more blocks than it has free (a manager bug if reached).
    #[error("block pool: cannot get {wanted} free blocks, {free} free")]
    PoolExhausted { wanted: u64, free: u64 },
    /// Startup check: one max_model_len request cannot fit in the pool (vLLM refuses to start).
    #[error("{0}")]
    InsufficientKvMemory(String),
    /// A configuration value is unsupported.
    #[error("unsupported: {0}")]
    Unsupported(String),
}
