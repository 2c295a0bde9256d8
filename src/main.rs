//! speclab: the command-line interface.
//!
//! Thin by design (DESIGN.md): parsing, progress bars and output formatting
//! live here; every behaviour lives in the library crates. Logs go through
//! `tracing` (set `RUST_LOG`), machine-readable output through `--json`.
//! Invariant: user errors exit non-zero with a message, never a panic.

mod cli;

use clap::Parser;

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    cli::out::install_broken_pipe_hook();
    let args = cli::Cli::parse();
    match cli::dispatch(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}
