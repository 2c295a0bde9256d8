//! speclab-schedulers: admission and scheduling policies (implement the
//! engine's [`Scheduler`](speclab_engine::Scheduler) seam).
//!
//! What it holds: [`FcfsScheduler`], a port of vLLM 0.33.0's v1 scheduler
//! (`vllm/v1/core/sched/scheduler.py`: `schedule`, `_preempt_request`,
//! `update_from_output`) in synchronous mode without prefix caching, with two
//! admission policies ([`AdmissionPolicy`]): `Fcfs` (vLLM-faithful: the full
//! sequence must fit, head-of-line blocking; an impossible request wedges the
//! queue, which is reported instead of retried forever) and `RejectImpossible`.
//! Design: DESIGN.md "Core seams" (the vLLM-faithful FCFS policy is the
//! default because reproducing vLLM is the point).
//!
//! Invariants: no KV is allocated outside `KvCacheManager`; when the scheduler
//! has no running requests it holds no blocks; nothing here panics on user input.

pub mod config;
pub mod error;
pub mod factory;
pub mod fcfs;

pub use config::{AdmissionPolicy, RequestSpec, SchedulerConfig};
pub use error::SchedulerError;
pub use factory::fcfs_factory;
pub use fcfs::{FcfsScheduler, RequestState};

#[cfg(test)]
mod tests;
