//! Subcommand definitions and dispatch.
//!
//! Each subcommand's implementation sits in its own module (`kv`, `run`).
//! Invariant: every command accepts `--json` and then prints only JSON on stdout.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub mod kv;

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
}

/// Run the parsed command.
pub fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Kv { command } => kv::run(command),
    }
}
