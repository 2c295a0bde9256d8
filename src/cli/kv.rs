//! `speclab kv ...` (stub, being written).
use std::process::ExitCode;

use clap::Subcommand;

#[derive(Debug, Subcommand)]
pub enum KvCommand {}

pub fn run(c: KvCommand) -> anyhow::Result<ExitCode> {
    match c {}
}
