//! The one error type of `speclab-quant`.
//!
//! What: every fallible operation in this crate returns [`Result<T>`] = `Result<T, QuantError>`.
//! Source: none (crate-local).
//! Invariants: user input (shapes, values, configs, files) never panics; it yields one of
//! these variants, each naming what was wrong and where. Errors of the engine (whose
//! format, config and checkpoint code this crate uses) convert with `From`.

use std::path::PathBuf;

/// Errors of `speclab-quant`.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    /// Buffer length or shape mismatch (or a size that overflows `usize`).
    #[error("shape error: {0}")]
    Shape(String),
    /// `K` (in_features) is not a multiple of the group size 128.
    #[error("K = {k} is not a multiple of the W4A16 group size 128")]
    GroupMisaligned { k: usize },
    /// A quantized integer outside the INT4 range `[-8, 7]`.
    #[error("quantized value {value} at flat index {index} is outside [-8, 7]")]
    OutOfRange { index: usize, value: i32 },
    /// NaN or infinity in an input.
    #[error("non-finite value {value} at flat index {index} of {what}")]
    NonFinite {
        what: &'static str,
        index: usize,
        value: f64,
    },
    /// An invalid configuration value.
    #[error("invalid config: {0}")]
    Config(String),
    /// Cholesky failed for every dampening of the retry schedule (see `gptq`).
    #[error(
        "Hessian not positive definite after {attempts} dampening attempts \
         (last dampening fraction {last_dampening})"
    )]
    NotPositiveDefinite { attempts: u32, last_dampening: f64 },
    /// A checkpoint is malformed or inconsistent (missing tensor, wrong dtype, shard too big...).
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// An `ignore` entry `re:...` that the `regex` crate cannot compile.
    #[error("invalid ignore regex {entry:?}: {source}")]
    Regex {
        entry: String,
        #[source]
        source: regex::Error,
    },
    /// I/O on a named path.
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// From `serde_json`.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}

/// Engine errors: the W4A16 format's own refusals keep their variant here; every other
/// engine error (loading, running or writing a model) becomes [`QuantError::Checkpoint`]
/// with the engine's message.
impl From<speclab_engine::EngineError> for QuantError {
    fn from(e: speclab_engine::EngineError) -> Self {
        use speclab_engine::EngineError as E;
        match e {
            E::W4a16Shape(s) => Self::Shape(s),
            E::GroupMisaligned { k } => Self::GroupMisaligned { k },
            E::Int4OutOfRange { index, value } => Self::OutOfRange { index, value },
            E::NonFinite { what, index, value } => Self::NonFinite { what, index, value },
            other => Self::Checkpoint(other.to_string()),
        }
    }
}

/// `Result` with [`QuantError`].
pub type Result<T> = std::result::Result<T, QuantError>;

/// `a * b` or a [`QuantError::Shape`] on overflow.
pub(crate) fn checked_len(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| QuantError::Shape(format!("{what}: {a} x {b} overflows usize")))
}

/// Error unless `len == expected`.
pub(crate) fn expect_len(what: &str, len: usize, expected: usize) -> Result<()> {
    if len != expected {
        return Err(QuantError::Shape(format!(
            "{what} has {len} elements, expected {expected}"
        )));
    }
    Ok(())
}

/// First non-finite element of `v`, as an error.
pub(crate) fn check_finite_f32(what: &'static str, v: &[f32]) -> Result<()> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(QuantError::NonFinite {
            what,
            index,
            value: v[index] as f64,
        }),
        None => Ok(()),
    }
}

/// First non-finite element of `v`, as an error.
pub(crate) fn check_finite_f64(what: &'static str, v: &[f64]) -> Result<()> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(QuantError::NonFinite {
            what,
            index,
            value: v[index],
        }),
        None => Ok(()),
    }
}
