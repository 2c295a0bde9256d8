//! `speclab kv ...`: the KV cache manager's machine interface.
//!
//! `speclab kv replay <layout.(ron|json)> <ops.jsonl> [--json] [--summary]
//! [--check-startup]` replays a trace (formats: `docs/kv-replay-format.md`)
//! through `speclab_experiments::replay::Replayer` and prints one JSON line per
//! op on stdout. `--summary` appends one `{"summary": {...}}` JSON line on
//! stdout and a one-line human summary on stderr.
//!
//! Invariants: stdout carries only JSON; user errors (bad files, bad ops) go to
//! stderr with the file and place and exit non-zero, never a panic; a closed
//! stdout (e.g. `| head`) ends the replay quietly.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::Subcommand;
use speclab_experiments::replay::{self, ReplayOptions, Replayer};
use speclab_experiments::ExperimentError;

#[derive(Debug, Subcommand)]
pub enum KvCommand {
    /// Replay an operation trace through the KV cache manager (vLLM 0.33.0 semantics).
    Replay {
        /// Layout file, `.ron` or `.json` (docs/kv-replay-format.md).
        layout: PathBuf,
        /// Operations, one JSON object per line.
        ops: PathBuf,
        /// Machine output (the default; accepted for uniformity with other commands).
        #[arg(long)]
        json: bool,
        /// After the records, print a summary (JSON line on stdout, human line on stderr).
        #[arg(long)]
        summary: bool,
        /// Run vLLM's startup check (refuse a pool that cannot hold one max_model_len request).
        #[arg(long)]
        check_startup: bool,
    },
}

pub fn run(c: KvCommand) -> anyhow::Result<ExitCode> {
    match c {
        KvCommand::Replay {
            layout,
            ops,
            json: _,
            summary,
            check_startup,
        } => replay_cmd(&layout, &ops, summary, check_startup),
    }
}

/// An experiments error as one anyhow message. Its Display already names the
/// place and the cause; keeping the source chain would print the cause twice
/// under `{:#}`.
fn flat(e: ExperimentError) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}

/// Whether an io error is a closed stdout.
fn is_broken_pipe(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::BrokenPipe
}

fn replay_cmd(
    layout_path: &Path,
    ops_path: &Path,
    summary: bool,
    check_startup: bool,
) -> anyhow::Result<ExitCode> {
    let layout = replay::load_layout(layout_path).map_err(flat)?;
    let trace = replay::parse_ops(ops_path).map_err(flat)?;
    let mut r = Replayer::with_options(&layout, ReplayOptions { check_startup })
        .map_err(|e| flat(replay::locate(e, &layout_path.display().to_string())))?;

    let stdout = std::io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let mut pipe_closed = false;
    let res = r.run(&trace, |rec| {
        serde_json::to_writer(&mut out, rec)
            .map_err(std::io::Error::from)
            .and_then(|()| out.write_all(b"\n"))
            .map_err(|e| ExperimentError::io("<stdout>", e))
    });
    if let Err(e) = res {
        if let ExperimentError::Io { error: source, .. } = &e {
            if is_broken_pipe(source) {
                pipe_closed = true;
            }
        }
        if !pipe_closed {
            // Flush what was replayed before the bad op, then report it.
            let _ = out.flush();
            return Err(flat(e));
        }
    }
    if pipe_closed {
        return Ok(ExitCode::SUCCESS);
    }
    if summary {
        let s = r.summary();
        let line = serde_json::json!({ "summary": s });
        let w = writeln!(out, "{line}");
        if let Err(e) = w {
            if !is_broken_pipe(&e) {
                return Err(e).context("writing to stdout");
            }
        }
        eprintln!(
            "replayed {} ops: {} allocations, {} failed (NoFit), {} blocks handed out; {} live requests; {} of {} blocks free",
            s.ops, s.allocations, s.failures, s.blocks_allocated, s.live_requests, s.final_free, s.usable_blocks
        );
    }
    match out.flush() {
        Err(e) if !is_broken_pipe(&e) => Err(e).context("writing to stdout"),
        _ => Ok(ExitCode::SUCCESS),
    }
}
