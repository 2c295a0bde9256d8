//! speclab-experiments: RON manifests, sweeps expanded into legs, the runner,
//! exact bisection of admission bounds, run records, the findings renderer,
//! and the `kv replay` machine interface.
//!
//! Dependency direction (DESIGN.md): engine <- drafters, schedulers <- experiments <- CLI.
//! Invariant: every record is written atomically (temp file + rename), and a
//! crash mid-sweep leaves the finished legs intact and resumable.

pub mod atlas;
pub mod bounds;
pub mod cost_fit;
pub mod error;
pub mod findings;
pub mod findings_cost;
pub mod findings_plan;
pub mod manifest;
pub mod manifest_check;
pub mod manifest_cost;
pub mod plan;
pub mod plot;
pub mod real;
pub mod real_run;
pub mod record;
pub mod replay;
pub mod runner;
pub mod shard;

pub use error::ExperimentError;

/// Result alias for the experiments crate.
pub type Result<T, E = ExperimentError> = std::result::Result<T, E>;
