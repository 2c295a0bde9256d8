//! Subcommand definitions and dispatch.
//!
//! Each subcommand's implementation sits in its own module (`kv`, `run`).
//! Invariant: every command accepts `--json` and then prints only JSON on stdout.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[macro_use]
pub mod out;

pub mod bench;
pub mod bench_e2e;
pub mod cost;
pub mod generate;
pub mod kv;
pub mod model;
pub mod run;

/// speclab: a speculative-decoding research framework.
#[derive(Debug, Parser)]
#[command(name = "speclab", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// The KV cache manager's machine interface.
    Kv {
        #[command(subcommand)]
        command: kv::KvCommand,
    },
    /// Run an experiment manifest and record it (default: the embedded df2w-wedge, then the quality spot-suite on models/tiny).
    Run(run::RunArgs),
    /// Merge the shard records of a sharded run (`run --shard I/N`) into one record.
    Merge(run::MergeArgs),
    /// Bisect the largest admissible prompt for each layout of a manifest.
    Bounds(run::BoundsArgs),
    /// Render run records into markdown findings.
    Findings(run::FindingsArgs),
    /// Write a random-weight checkpoint of a model preset.
    InitModel(model::InitModelArgs),
    /// Quantize a bf16 checkpoint's routed experts to W4A16 (GPTQ or RTN).
    Quantize(model::QuantizeArgs),
    /// Held-out loss / perplexity of checkpoints side by side (teacher forcing).
    EvalPpl(model::EvalPplArgs),
    /// Generate with the real target (+ a drafter) through the FCFS scheduler and model executor.
    Generate(generate::GenerateArgs),
    /// Check that greedy output with a drafter equals the output without it, token for token.
    VerifyLossless(generate::VerifyLosslessArgs),
    /// The step-cost model: fit it to GPU bench records, expert overlap.
    Cost {
        #[command(subcommand)]
        command: cost::CostCommand,
    },
    /// Side-by-side benchmarks against the reference implementations.
    Bench {
        #[command(subcommand)]
        command: bench::BenchCommand,
    },
}

/// Run the parsed command.
pub fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Kv { command } => kv::run(command),
        Command::Run(a) => run::run(a),
        Command::Merge(a) => run::merge(a),
        Command::Bounds(a) => run::bounds(a),
        Command::Findings(a) => run::findings(a),
        Command::Bench { command } => bench::run(command),
        Command::Cost { command } => cost::run(command),
        Command::Generate(a) => generate::generate(a),
        Command::VerifyLossless(a) => generate::verify(a),
        Command::InitModel(a) => model::init_model(a),
        Command::Quantize(a) => model::quantize(a),
        Command::EvalPpl(a) => model::eval_ppl(a),
    }
}
