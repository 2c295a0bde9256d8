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
    #[error(
        "request {req}: prompt of {prompt_len} tokens does not fit max_model_len {max_model_len}"
    )]
    PromptTooLong {
        req: String,
        prompt_len: u64,
        max_model_len: u64,
    },
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
    /// A drafter's configuration is invalid (e.g. n-gram min > max).
    #[error("invalid {drafter} drafter config: {reason}")]
    InvalidDrafterConfig { drafter: String, reason: String },
    /// A sampling parameter is out of range (vLLM `SamplingParams` checks).
    #[error("invalid sampling params: {field}: {reason}")]
    InvalidSamplingParams { field: String, reason: String },
    /// Verification inputs disagree (shapes, vocabulary sizes, token ids, non-finite values).
    #[error("speculative verification: {reason}")]
    InvalidVerifyInput { reason: String },
    // ---- model/ (docs/model.md) -------------------------------------------------
    /// A file could not be opened, mapped or read.
    #[error("{path}: {reason}")]
    Io { path: String, reason: String },
    /// A safetensors file (or its shard index) is malformed: bad header, truncated data.
    #[error("{file}: corrupt or truncated checkpoint: {reason}")]
    CorruptCheckpoint { file: String, reason: String },
    /// A tensor the model needs is absent.
    #[error("{file}: missing tensor `{tensor}`")]
    MissingTensor { file: String, tensor: String },
    /// A tensor has the wrong shape (`detail`: "shape [..], expected [..]").
    #[error("{file}: tensor `{tensor}` has {detail}")]
    TensorShape {
        file: String,
        tensor: String,
        detail: String,
    },
    /// A tensor has the wrong dtype (`detail`: "dtype X, expected Y").
    #[error("{file}: tensor `{tensor}` has {detail}")]
    TensorDtype {
        file: String,
        tensor: String,
        detail: String,
    },
    /// config.json could not be parsed.
    #[error("{file}: cannot parse model config: {reason}")]
    ConfigParse { file: String, reason: String },
    /// A config value is invalid or unsupported (names the key and the allowed values).
    #[error("config key `{key}`: {reason}")]
    InvalidConfig { key: String, reason: String },
    /// The config does not describe the checkpoint's tensors.
    #[error("config key `{key}` does not match the checkpoint: {reason} (tensor `{tensor}`)")]
    ConfigMismatch {
        key: String,
        tensor: String,
        reason: String,
    },
    /// A quantized module is inconsistent with `quantization_config` or malformed.
    #[error("quantized module `{module}`: {reason}")]
    Quantization { module: String, reason: String },
    /// A W4A16 buffer does not have the length its `[N, K]` shape implies (or a size
    /// overflows `usize`), see `model/w4a16.rs`.
    #[error("shape error: {0}")]
    W4a16Shape(String),
    /// A W4A16 weight's `K` (in_features) is not a multiple of the group size 128.
    #[error("K = {k} is not a multiple of the W4A16 group size 128")]
    GroupMisaligned { k: usize },
    /// A quantized integer outside the INT4 range `[-8, 7]`.
    #[error("quantized value {value} at flat index {index} is outside [-8, 7]")]
    Int4OutOfRange { index: usize, value: i32 },
    /// NaN or infinity in a weight to quantize.
    #[error("non-finite value {value} at flat index {index} of {what}")]
    NonFinite {
        what: &'static str,
        index: usize,
        value: f64,
    },
    /// A forward-pass input is invalid (token out of range, KV not allocated, ...).
    #[error("model input: {0}")]
    ModelInput(String),
    /// A tokenizer file is invalid or an operation failed.
    #[error("tokenizer {path}: {reason}")]
    Tokenizer { path: String, reason: String },
}
