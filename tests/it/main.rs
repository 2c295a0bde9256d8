//! The root package's integration tests, one module a former test file, linked into one
//! binary. Each test binary links the whole dependency tree: before this layout, with
//! line tables only, the test build's 42 executables (29 of them these tests) took 780 MB
//! of the 1.6 GB under target/ after `bash .ci/run`, and CI's disk ran out at stop 46.
//! One binary for this reason is the layout of matklad's "Delete Cargo Integration
//! Tests" (2021).
//!
//! `fuzz_inputs` stays its own binary: it installs a counting `#[global_allocator]`,
//! which would apply to every test linked beside it.
//!
//! Invariants: tests in different modules share one process, so any temporary path a test
//! makes carries its module's own prefix besides the process id, and no test sets
//! environment variables or the working directory of the process.

mod cli_bench_e2e;
mod cli_bench_moe;
mod cli_cuda;
mod cli_kv;
mod cli_real;
mod cli_run;
mod cli_shard;
mod dflash2_errors;
mod dflash2_parity;
mod engine_drafts;
mod engine_errors;
mod engine_lossless;
mod engine_sampling;
mod engine_support;
mod kv_golden;
mod kv_plan_golden;
mod kv_props;
mod model_config;
mod model_errors;
mod model_parity;
mod model_quantize;
mod model_tiny_parity;
mod model_tokenizer;
mod reliability;
mod run_loop;
mod spec_greedy;
mod spec_lossless;
