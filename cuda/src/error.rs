//! The crate's one error type.
//!
//! Design: every fallible function of speclab-cuda returns [`Result`]; driver and NVRTC
//! failures keep their message, the kernel or buffer they concern, and engine errors
//! (batch validation against the KV manager) pass through unchanged.
//!
//! Invariants: no panics on user input; a missing library or device is an error value
//! ([`CudaError::NoDriver`], [`CudaError::NoNvrtc`], [`CudaError::NoDevice`]), never a
//! panic inside cudarc's dynamic loader (callers probe with [`crate::device`] first).

/// Errors of the CUDA engine.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// libcuda (the driver) cannot be loaded.
    #[error(
        "no CUDA driver: libcuda could not be loaded (set LD_LIBRARY_PATH or run on a GPU machine)"
    )]
    NoDriver,
    /// The driver loads but reports no device.
    #[error("CUDA device unavailable: {0}")]
    NoDevice(String),
    /// libnvrtc cannot be loaded.
    #[error("no NVRTC: libnvrtc could not be loaded (pip install nvidia-cuda-nvrtc==13.0.88 and put its nvidia/cu13/lib on LD_LIBRARY_PATH; see cuda/README.md)")]
    NoNvrtc,
    /// NVRTC rejected a kernel source.
    #[error("NVRTC could not compile `{source_name}` for {arch} (options {options:?}):\n{log}")]
    Compile {
        source_name: String,
        arch: String,
        options: Vec<String>,
        log: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver error in {context}: {message}")]
    Driver { context: String, message: String },
    /// The kernel cache directory could not be used.
    #[error("kernel cache {path}: {reason}")]
    Cache { path: String, reason: String },
    /// A model or batch the CUDA engine does not support (yet), or a shape it cannot launch.
    #[error("unsupported by the CUDA engine: {0}")]
    Unsupported(String),
    /// A batch, table or argument that does not fit the backend's buffers or rules.
    #[error("CUDA engine input: {0}")]
    Input(String),
    /// An engine error (validation shared with the CPU engine).
    #[error(transparent)]
    Engine(#[from] speclab_engine::EngineError),
}

impl CudaError {
    /// A driver error with the call site's context.
    pub fn driver(context: impl Into<String>, e: impl std::fmt::Debug) -> Self {
        Self::Driver {
            context: context.into(),
            message: format!("{e:?}"),
        }
    }
}

/// Result of the crate.
pub type Result<T> = std::result::Result<T, CudaError>;
