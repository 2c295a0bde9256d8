//! The experiments crate's one error enum.
//!
//! Errors name the file, the place (line:col, op index, leg) and what was
//! expected. Invariant: no user input reaches a panic; it reaches one of these.

use std::path::PathBuf;

use thiserror::Error;

/// Errors of the experiments crate.
#[derive(Debug, Error)]
pub enum ExperimentError {
    /// Reading or writing a file failed.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A file could not be parsed; `at` is `line:col` or `line N`.
    #[error("{path}:{at}: {msg}")]
    Parse {
        path: PathBuf,
        at: String,
        msg: String,
    },
    /// A value parsed but is not acceptable.
    #[error("{path}: {field}: {msg}")]
    Invalid {
        path: PathBuf,
        field: String,
        msg: String,
    },
    /// A command-line flag or environment variable (`what`) has an unusable value.
    #[error("{what}: {msg}")]
    Config { what: String, msg: String },
    /// The engine refused an operation.
    // Not marked as `#[source]`: the message already includes it, and a
    // source would print twice in anyhow's `{:#}` chains.
    #[error("{context}: {error}")]
    Engine {
        context: String,
        error: speclab_engine::EngineError,
    },
}

impl ExperimentError {
    /// Wrap an io error with its path.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            error: source,
        }
    }
    /// Wrap an engine error with where it happened.
    pub fn engine(context: impl Into<String>, source: speclab_engine::EngineError) -> Self {
        Self::Engine {
            context: context.into(),
            error: source,
        }
    }
}
