//! The real half of speclab: the model executor, the engine run loop, and the lossless check.
//!
//! What it holds:
//! - [`ModelExecutor`] ([`executor`]): the [`Executor`](crate::Executor) that runs the real
//!   target ([`ModelRunner`](crate::model::ModelRunner)) and a [`Drafter`](crate::Drafter)
//!   over the scheduler's batch and the one [`KvCacheManager`](crate::kv::KvCacheManager)
//!   of the run. Per step: one batched target forward over every scheduled chunk (prefill
//!   chunks and `[last token, drafts...]` verify chunks), verification of each sampling
//!   request (greedy or rejection sampling, [`crate::spec`]), KDA-state rollback to the
//!   accepted prefix ([`ModelRunner::commit_state`](crate::model::ModelRunner::commit_state);
//!   attention K/V of rejected positions are simply overwritten later), stop checks
//!   (max_tokens, max_model_len, EOS), then the drafter observes the committed rows and
//!   proposes the next step's drafts, which the executor reports as
//!   [`StepResult::next_drafts`](crate::StepResult) so the scheduler schedules exactly them.
//! - [`run_engine`] ([`run`]): the step loop (vLLM `EngineCore.step`: schedule ->
//!   execute -> update) with allocator checks after every schedule, and [`generate`], which
//!   builds the KV layout (target groups + the drafter's groups), the runner, the drafter
//!   (through a [`DrafterFactory`]) and the scheduler (through a caller's closure: the
//!   engine knows the `Scheduler` trait, never a policy) and returns an [`EngineRun`]:
//!   outputs per request, metrics per step / request / run.
//! - [`verify_lossless`] ([`lossless`]): greedy output with a drafter must equal the output
//!   without it, token for token; a mismatch reports the first diverging index, both
//!   tokens and the target's top1 - top2 logit margin there (from a teacher-forced target
//!   pass), so numeric drift (margin ~ 0) and logic bugs (large margin) can be told apart.
//!
//! Sources (behaviour, not code) — vLLM 0.33.0:
//! - `vllm/v1/worker/gpu_model_runner.py` (`execute_model`, `propose_draft_token_ids`:
//!   drafts are proposed right after sampling, from the target's hidden states of the
//!   tokens this step committed; rejected tokens are excluded from the drafter's input);
//! - `vllm/v1/spec_decode/eagle.py` (EAGLE / MTP proposer: first pass over the committed
//!   positions with the next tokens shifted in, then `num_speculative_tokens - 1`
//!   autoregressive steps feeding back the drafter's own hidden state, greedy drafts, no
//!   draft probs), `dflash` (block drafting from the anchor), `ngram_proposer.py`;
//! - `vllm/v1/sample/rejection_sampler.py` (greedy / random verification, one-hot q when
//!   the drafter gives no probs);
//! - `vllm/v1/core/sched/scheduler.py` `update_from_output` and `sched/utils.py`
//!   `check_stop` (accepted + 1 tokens appended one by one; stop at EOS, max_tokens,
//!   max_model_len), `vllm/v1/spec_decode/metrics.py` (`SpecDecodingStats`).
//!
//! Deviations: the drafter runs per request (vLLM batches the proposer across requests;
//! results are the same up to GEMM row grouping); each request samples from its own RNG
//! seeded from (run seed, request id), as vLLM does for requests with a seed, so outputs do
//! not depend on which requests share a batch; MTP drafts greedily (vLLM's EAGLE/MTP
//! proposer argmaxes; q is one-hot in rejection sampling).
//!
//! Invariants: the executor returns one `StepResult` per scheduled request with
//! `accepted <= num_draft` and `next_drafts` = the drafts it holds for that request; the
//! tokens it keeps per request are exactly what the scheduler committed (same stop rules;
//! the executor additionally cuts the output right after an EOS); a request whose chunk
//! starts at position 0 starts afresh (first prefill or recompute after preemption); every
//! error (bad batch, bad drafter output, bad input) is an [`EngineError`](crate::EngineError),
//! never a panic.

pub mod executor;
pub mod lossless;
pub mod run;

pub use crate::request::FinishReason;
pub use crate::run::StepStats;
pub use executor::{ExecConfig, ModelExecutor};
pub use lossless::{
    first_divergence, mismatch_at, teacher_forced_logits, verify_lossless, verify_lossless_on,
    LosslessReport, Mismatch,
};
pub use run::{
    generate, generate_observed, generate_on, plan_run_pool, DrafterFactory, EngineOptions,
    EngineRequest, EngineRun, GenerateParts, RequestStats, RunPoolPlan, SchedulerFactory,
    SchedulerParams,
};
