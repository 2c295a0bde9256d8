//! speclab-engine: the core of speclab.
//!
//! What it holds: request bookkeeping and the stop rule (`request`), the
//! vLLM-faithful KV cache manager (`kv`), the seams every other crate plugs into:
//! [`Drafter`], [`Scheduler`] and [`Executor`] (`traits`) and the model seam
//! ([`backend::TargetBackend`]), the one step loop (`run`) with its metrics
//! (`metrics`), the simulated executor (`sim`) and its step-cost model (`cost`), the CPU target model (`model`) and
//! the model executor (`exec`). The engine knows traits, never
//! concrete drafters or scheduling policies (dependency direction in
//! DESIGN.md: engine <- drafters, schedulers <- experiments <- CLI).
//!
//! Invariant: nothing in this crate panics on user input; every fallible
//! operation returns [`EngineError`].

pub mod backend;
pub mod cost;
pub mod error;
pub mod exec;
pub mod kv;
pub mod metrics;
pub mod model;
pub mod request;
pub mod run;
pub mod sim;
pub mod spec;
pub mod traits;
pub mod util;

pub use error::EngineError;
pub use request::{check_stop, FinishReason, ReqSlot, RequestStatus, RequestView, StopRule};
pub use traits::*;

/// Result alias for the engine crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
