//! The FCFS scheduler factory the model engine asks for (`speclab_engine::exec::SchedulerFactory`).
//!
//! One place builds a vLLM-default [`FcfsScheduler`] for a real-engine run (only
//! `max_num_seqs` and `max_num_batched_tokens` set, speculative tokens, lookahead and
//! the EOS token from the engine) and queues the run's requests, with their token ids
//! (the scheduler owns them), in order; the CLI, the
//! experiments runner, tests and benches all call this. Invariant: requests are added
//! in the order given, so FCFS order is request order.

use speclab_engine::exec::{EngineRequest, SchedulerParams};
use speclab_engine::kv::KvCacheManager;
use speclab_engine::{EngineError, Scheduler};

use crate::{FcfsScheduler, SchedulerConfig};

/// A factory of FCFS schedulers with `max_num_seqs` and `max_num_batched_tokens`.
pub fn fcfs_factory(
    max_num_seqs: usize,
    max_num_batched_tokens: u64,
) -> impl FnMut(
    &KvCacheManager,
    &SchedulerParams,
    &[EngineRequest],
) -> speclab_engine::Result<Box<dyn Scheduler>> {
    move |kv, p, reqs| {
        let cfg = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens,
            num_speculative_tokens: p.num_speculative_tokens,
            lookahead: p.lookahead,
            ..SchedulerConfig::default()
        };
        let mut s = FcfsScheduler::new(cfg);
        for r in reqs {
            s.add_request_with_tokens(kv, r.id, r.prompt.clone(), r.max_tokens, p.eos_token_id)
                .map_err(EngineError::from)?;
        }
        Ok(Box::new(s) as Box<dyn Scheduler>)
    }
}
