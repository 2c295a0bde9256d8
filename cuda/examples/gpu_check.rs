//! The device check in one process: parity (speclab_cuda::check::parity) then decode
//! timing at batch 1 / 8 / 32 / 128 with CUDA graphs off and on; JSON to the path given
//! by `--json PATH` (default `gpu_check.json`), a short table last on stdout.
//! `--parity-only` skips the timing (for runs under compute-sanitizer); `--steps N`
//! sets the timed decode steps (default 50).
//!
//! Built here in release and carried to the GPU machine (no cargo there): see
//! cuda/README.md and recipes/gpu_check.sh. Exit code 1 when a parity line fails,
//! 2 when no device is usable.

use std::path::PathBuf;

use serde::Serialize;
use speclab_cuda::check::{self, CheckLine, ProfileRow, TimingRow};

#[derive(Serialize)]
struct Report {
    device: Option<String>,
    model: String,
    parity: Vec<CheckLine>,
    parity_error: Option<String>,
    all_pass: bool,
    timing: Vec<TimingRow>,
    timing_error: Option<String>,
    copy_gb_s: f64,
    weight_bytes: usize,
    profile: Vec<ProfileRow>,
}

fn arg(name: &str) -> Option<String> {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1).cloned())
}

fn main() {
    let model = PathBuf::from(arg("--model").unwrap_or_else(|| "models/tiny".into()));
    let json = PathBuf::from(arg("--json").unwrap_or_else(|| "gpu_check.json".into()));
    let steps: usize = arg("--steps").and_then(|s| s.parse().ok()).unwrap_or(50);
    let parity_only = std::env::args().any(|a| a == "--parity-only");
    if let Some(why) = speclab_cuda::device::skip_reason() {
        eprintln!("skipping: {why}");
        std::process::exit(2);
    }
    let t0 = std::time::Instant::now();
    let caught = std::panic::catch_unwind(|| check::parity(&model));
    let (parity, parity_error) = match caught {
        Ok(Ok(l)) => (l, None),
        Ok(Err(e)) => (Vec::new(), Some(e.to_string())),
        Err(_) => (Vec::new(), Some("parity panicked (see stderr)".to_string())),
    };
    println!("parity ({:.1} s):", t0.elapsed().as_secs_f64());
    for l in &parity {
        println!(
            "  {} {:<72} {:.3e} (bound {:.1e})",
            if l.pass { "ok  " } else { "FAIL" },
            l.name,
            l.value,
            l.bound
        );
    }
    if let Some(e) = &parity_error {
        println!("  parity ERROR: {e}");
    }
    let all_pass = parity_error.is_none() && parity.iter().all(|l| l.pass);
    let batches: &[usize] = if parity_only { &[] } else { &[1, 8, 32, 128] };
    let caught = std::panic::catch_unwind(|| check::timing(&model, batches, steps));
    let ((timing, copy_gb_s, weight_bytes, profile), timing_error) = match caught {
        Ok(Ok(t)) => (t, None),
        Ok(Err(e)) => ((Vec::new(), 0.0, 0, Vec::new()), Some(e.to_string())),
        Err(_) => (
            (Vec::new(), 0.0, 0, Vec::new()),
            Some("timing panicked (see stderr)".to_string()),
        ),
    };
    let report = Report {
        device: speclab_cuda::device::device_count()
            .ok()
            .map(|n| format!("{n} device(s)")),
        model: model.display().to_string(),
        parity,
        parity_error,
        all_pass,
        timing,
        timing_error: timing_error.clone(),
        copy_gb_s,
        weight_bytes,
        profile,
    };
    match serde_json::to_string_pretty(&report) {
        Ok(s) => {
            if let Err(e) = std::fs::write(&json, s) {
                eprintln!("cannot write {}: {e}", json.display());
            }
        }
        Err(e) => eprintln!("cannot serialize the report: {e}"),
    }
    println!("\ncopy bandwidth {copy_gb_s:.0} GB/s; weights on device {:.1} MB; floor per step (all weights once) {:.1} us",
        weight_bytes as f64 / 1e6, weight_bytes as f64 / (copy_gb_s * 1e3).max(1e-9));
    if let Some(e) = timing_error {
        println!("timing ERROR: {e}");
    }
    print_profile(&report.profile);
    println!("\n| batch | graphs | us/step | GPU us/step (graph replay) | host meta / upload / launch / read-back us | tok/s | kernels/step |");
    println!("|---|---|---|---|---|---|---|");
    for r in &report.timing {
        let h = r.host_us;
        let gpu = r.gpu_us_per_step.map(|x| format!("{x:.1}"));
        println!(
            "| {} | {} | {:.1} | {} | {:.1} / {:.1} / {:.1} / {:.1} | {:.0} | {:.0} |",
            r.batch,
            if r.graphs { "on" } else { "off" },
            r.us_per_step,
            gpu.unwrap_or("-".into()),
            h[0],
            h[1],
            h[2],
            h[3],
            r.tok_per_s,
            r.kernels_per_step
        );
    }
    println!("\nparity: {}", if all_pass { "PASS" } else { "FAIL" });
    if !all_pass {
        std::process::exit(1);
    }
}

/// The per-kernel GPU time of one eager decode step, per batch (top 10 names).
fn print_profile(rows: &[ProfileRow]) {
    let mut batches: Vec<usize> = rows.iter().map(|r| r.batch).collect();
    batches.dedup();
    for b in batches {
        let of: Vec<&ProfileRow> = rows.iter().filter(|r| r.batch == b).collect();
        let total: f64 = of.iter().map(|r| r.us).sum();
        let n: usize = of.iter().map(|r| r.launches).sum();
        let top: Vec<String> = of
            .iter()
            .take(10)
            .map(|r| format!("{} x{} {:.1}", r.kernel, r.launches, r.us))
            .collect();
        println!(
            "profile batch {b}: {n} launches, {total:.1} us eager GPU time: {}",
            top.join("; ")
        );
    }
}
