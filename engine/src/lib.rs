//! speclab-engine: the core of speclab.
//!
//! What it holds: request bookkeeping, the vLLM-faithful KV cache manager
//! (`kv`), and the three seams every other crate plugs into: [`Drafter`],
//! [`Scheduler`] and [`Executor`] (`traits`). The engine knows traits, never
//! concrete drafters or scheduling policies (dependency direction in
//! DESIGN.md: engine <- drafters, schedulers <- experiments <- CLI).
//!
//! Invariant: nothing in this crate panics on user input; every fallible
//! operation returns [`EngineError`].

pub mod error;
pub mod exec;
pub mod kv;
pub mod model;
pub mod request;
pub mod sim;
pub mod spec;
pub mod traits;
pub mod util;

pub use error::EngineError;
pub use request::{ReqSlot, RequestStatus, RequestView};
pub use traits::*;

/// Result alias for the engine crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
