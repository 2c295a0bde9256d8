//! The device check in one process: parity (speclab_cuda::check::parity) then decode
//! timing at batch 1 / 8 / 32 / 128 with CUDA graphs off and on; JSON to the path given
//! by `--json PATH` (default `gpu_check.json`), a short table last on stdout.
//! Parity includes the DFlash2 drafter on the device (`speclab_cuda::CudaDFlash2`, checkpoint
//! `--drafter DIR`, default models/dflash2-tiny) against the CPU drafter, and the MTP chain
//! on the device (`speclab_cuda::mtp::CudaMtp`) against the host MTP drafter and the CPU,
//! through the step loop.
//! `--parity-only` skips the timing (for runs under compute-sanitizer), `--timing-only`
//! the parity (an A/B timing of a launch setting, e.g. `SPECLAB_PDL=0`); `--steps N`
//! sets the timed decode steps (default 50).
//!
//! Built here in release and carried to the GPU machine (no cargo there): see
//! cuda/README.md and recipes/gpu_check.sh. Exit code 1 when a parity line fails,
//! 2 when no device is usable.

use std::path::PathBuf;

use serde::Serialize;
use speclab_cuda::check::{self, CheckLine, ProfileRow, TimingRow};
use speclab_cuda::prefill::PrefillRow;
use speclab_drafters::DrafterSpec;
use speclab_engine::exec::{generate_on, EngineOptions, EngineRequest, EngineRun};
use speclab_engine::kv::CapPolicy;
use speclab_engine::model::ModelWeights;
use speclab_engine::spec::SamplingParams;

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
    /// Prefill steps with the chunked KDA kernels off and on (`speclab_cuda::prefill`).
    prefill: Vec<PrefillRow>,
    prefill_error: Option<String>,
    /// `SPECLAB_PDL` as this run saw it (programmatic dependent launch unless 0 / off).
    pdl_env: Option<String>,
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
    let timing_only = std::env::args().any(|a| a == "--timing-only");
    if let Some(why) = speclab_cuda::device::skip_reason() {
        eprintln!("skipping: {why}");
        std::process::exit(2);
    }
    let t0 = std::time::Instant::now();
    let drafter = PathBuf::from(arg("--drafter").unwrap_or_else(|| "models/dflash2-tiny".into()));
    let caught = std::panic::catch_unwind(|| {
        if timing_only {
            return Ok(Vec::new());
        }
        let mut l = check::parity(&model)?;
        speclab_cuda::prefill::parity(&model, &mut l)?;
        l.extend(drafter_parity(&model, &drafter)?);
        Ok::<_, Box<dyn std::error::Error>>(l)
    });
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
    let all_pass = parity_error.is_none() && parity.iter().all(|l| l.pass) && !timing_only;
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
    let shapes: &[(usize, usize)] = if parity_only {
        &[]
    } else {
        &[(1, 256), (1, 1024), (1, 4000), (8, 512), (6, 4000)]
    };
    let caught = std::panic::catch_unwind(|| speclab_cuda::prefill::timing(&model, shapes, 3));
    let (prefill, prefill_error) = match caught {
        Ok(Ok(r)) => (r, None),
        Ok(Err(e)) => (Vec::new(), Some(e.to_string())),
        Err(_) => (
            Vec::new(),
            Some("prefill timing panicked (see stderr)".to_string()),
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
        prefill,
        prefill_error,
        pdl_env: std::env::var("SPECLAB_PDL").ok(),
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
    print_prefill(&report);
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
    if timing_only {
        println!("\nparity: not run (--timing-only)");
        return;
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

/// Where a parity run's target and drafter run.
#[derive(Clone, Copy, PartialEq)]
enum Engine {
    /// Both on the CPU.
    Cpu,
    /// The CUDA target, the spec's own (host) drafter.
    CudaHostDrafter,
    /// The CUDA target, the drafter on the device (`speclab_cuda::CudaDrafterSpec`).
    CudaDevice,
    /// The CUDA target, the MTP chain on the device with its first pass unpadded.
    CudaMtpUnpadded,
    /// The CUDA target, the MTP chain on the device with a graph a pass
    /// (`CudaMtp::one_graph` off).
    CudaMtpPerPass,
    /// The CUDA target, DFlash2 on the device sampling with the CPU picker over its
    /// prediction rows (`CudaDFlash2::host_sampled_walk`).
    CudaHostPicker,
    /// The CUDA target, DFlash2 on the device with its context append outside the block's
    /// graph (`CudaDFlash2::append_in_graph` off).
    CudaAppendEager,
}

/// A spec's KV groups and N, with its drafter built by `.1` (a device drafter with one of
/// its switches set).
type BuildFn = fn(
    &DrafterSpec,
    &speclab_engine::model::ModelConfig,
    &speclab_engine::kv::KvCacheManager,
) -> speclab_engine::Result<Box<dyn speclab_engine::Drafter>>;
struct Switched<'a>(&'a DrafterSpec, BuildFn);

impl speclab_engine::exec::DrafterFactory for Switched<'_> {
    fn num_speculative_tokens(&self) -> usize {
        self.0.num_speculative_tokens()
    }
    fn kv_groups(&self) -> speclab_engine::Result<Vec<speclab_engine::kv::GroupSpec>> {
        self.0.kv_groups()
    }
    fn build(
        &self,
        target: &speclab_engine::model::ModelConfig,
        kv: &speclab_engine::kv::KvCacheManager,
    ) -> speclab_engine::Result<Box<dyn speclab_engine::Drafter>> {
        (self.1)(self.0, target, kv)
    }
}

/// The device MTP chain with its first pass unpadded (the host drafter's exact rows).
fn unpadded_mtp(
    spec: &DrafterSpec,
    target: &speclab_engine::model::ModelConfig,
    _kv: &speclab_engine::kv::KvCacheManager,
) -> speclab_engine::Result<Box<dyn speclab_engine::Drafter>> {
    let mut d = speclab_cuda::mtp::CudaMtp::new(target, spec.num_speculative_tokens)?;
    d.pad_first_pass = false;
    Ok(Box::new(d))
}

/// The device MTP chain with each pass uploaded and replayed on its own (not one graph).
fn per_pass_mtp(
    spec: &DrafterSpec,
    target: &speclab_engine::model::ModelConfig,
    _kv: &speclab_engine::kv::KvCacheManager,
) -> speclab_engine::Result<Box<dyn speclab_engine::Drafter>> {
    let mut d = speclab_cuda::mtp::CudaMtp::new(target, spec.num_speculative_tokens)?;
    d.one_graph = false;
    Ok(Box::new(d))
}

/// The device DFlash2 (v2) drafter with the CPU picker for sampled drafts.
fn host_picker_df2(
    spec: &DrafterSpec,
    target: &speclab_engine::model::ModelConfig,
    kv: &speclab_engine::kv::KvCacheManager,
) -> speclab_engine::Result<Box<dyn speclab_engine::Drafter>> {
    let w = spec.dflash.clone().ok_or_else(|| {
        speclab_engine::EngineError::Unsupported("host_picker_df2 needs a DFlash2 spec".into())
    })?;
    let n = spec.num_speculative_tokens;
    let v2 = speclab_drafters::dflash2::DraftMode::V2;
    let mut d = speclab_cuda::CudaDFlash2::new(w, target, kv, n, v2)?;
    d.host_sampled_walk = true;
    Ok(Box::new(d))
}

/// The device DFlash2 (v2) drafter with its context append launched eagerly, outside the
/// block's graph (`SPECLAB_DF2_APPEND_GRAPH=0`).
fn append_eager_df2(
    spec: &DrafterSpec,
    target: &speclab_engine::model::ModelConfig,
    kv: &speclab_engine::kv::KvCacheManager,
) -> speclab_engine::Result<Box<dyn speclab_engine::Drafter>> {
    let w = spec.dflash.clone().ok_or_else(|| {
        speclab_engine::EngineError::Unsupported("append_eager_df2 needs a DFlash2 spec".into())
    })?;
    let n = spec.num_speculative_tokens;
    let v2 = speclab_drafters::dflash2::DraftMode::V2;
    let mut d = speclab_cuda::CudaDFlash2::new(w, target, kv, n, v2)?;
    d.append_in_graph = false;
    Ok(Box::new(d))
}

/// One step-loop run of `spec` (greedy unless `temperature`), 5 requests at 3
/// concurrent, prompts past the DFlash drafter's window, 40 new tokens each (so the
/// last steps draft fewer than N).
fn drafter_run(
    target: &ModelWeights,
    spec: &DrafterSpec,
    engine: Engine,
    temperature: f32,
) -> Result<EngineRun, Box<dyn std::error::Error>> {
    let v = target.cfg.vocab_size as u32;
    let reqs: Vec<EngineRequest> = (0..5u32)
        .map(|i| {
            // A repeated phrase (so drafts get accepted) after a seeded prefix; lengths
            // 40 .. 340 cross the 256-token window.
            let len = 40 + 75 * i as usize;
            let prompt = (0..len as u32)
                .map(|t| {
                    if t % 3 == 0 {
                        (7 + 131 * (t % 17) + 11 * i) % v
                    } else {
                        (t.wrapping_mul(2654435761u32) ^ i) % v
                    }
                })
                .collect();
            EngineRequest {
                id: i as u64,
                prompt,
                max_tokens: 40,
            }
        })
        .collect();
    let opts = EngineOptions {
        num_blocks: spec.default_num_blocks(16, target.cfg.max_position_embeddings as u64, &reqs),
        sampling: if temperature > 0.0 {
            SamplingParams::random(temperature)
        } else {
            SamplingParams::GREEDY
        },
        seed: 3,
        ignore_eos: true,
        ..EngineOptions::default()
    };
    let mut make = speclab_schedulers::fcfs_factory(3, 8192);
    let f = speclab_cuda::CudaFactory::default();
    let run = match engine {
        Engine::CudaDevice => generate_on(
            &f,
            target,
            &speclab_cuda::CudaDrafterSpec(spec),
            &reqs,
            &opts,
            &mut make,
        )?,
        Engine::CudaHostDrafter => generate_on(&f, target, spec, &reqs, &opts, &mut make)?,
        Engine::CudaMtpUnpadded => generate_on(
            &f,
            target,
            &Switched(spec, unpadded_mtp),
            &reqs,
            &opts,
            &mut make,
        )?,
        Engine::CudaMtpPerPass => generate_on(
            &f,
            target,
            &Switched(spec, per_pass_mtp),
            &reqs,
            &opts,
            &mut make,
        )?,
        Engine::CudaHostPicker => generate_on(
            &f,
            target,
            &Switched(spec, host_picker_df2),
            &reqs,
            &opts,
            &mut make,
        )?,
        Engine::CudaAppendEager => generate_on(
            &f,
            target,
            &Switched(spec, append_eager_df2),
            &reqs,
            &opts,
            &mut make,
        )?,
        Engine::Cpu => generate_on(
            &speclab_engine::backend::CpuBackend,
            target,
            spec,
            &reqs,
            &opts,
            &mut make,
        )?,
    };
    Ok(run)
}

/// The DFlash2 (v2) and DFlash v1 drafters on the device against the CPU drafters, and
/// the MTP chain on the device against the host MTP drafter and the CPU: equal outputs,
/// and as many drafts accepted at every step (the rejected tails are not compared); a
/// sampled device run of each completes.
fn drafter_parity(
    model: &std::path::Path,
    drafter: &std::path::Path,
) -> Result<Vec<CheckLine>, Box<dyn std::error::Error>> {
    let target = ModelWeights::load(model)?;
    let mut out = Vec::new();
    let mut push = |name: String, value: f64| check::line(&mut out, name, value, 0.0);
    for kind in ["dflash2", "dflash1"] {
        let spec = DrafterSpec::load(
            kind,
            Some(drafter),
            &target.cfg,
            7,
            CapPolicy::WindowPlusTwo,
        )?;
        let cpu = drafter_run(&target, &spec, Engine::Cpu, 0.0)?;
        let dev = drafter_run(&target, &spec, Engine::CudaDevice, 0.0)?;
        compare_runs(&mut push, &format!("{kind} N=7"), ("CPU", &cpu), &dev);
        let hot = drafter_run(&target, &spec, Engine::CudaDevice, 0.8)?;
        let unfinished = hot.requests.iter().filter(|r| r.finish.is_none()).count();
        push(
            format!(
                "{kind} N=7 sampled (T 0.8) on the device: unfinished requests (tau {:.3})",
                hot.tau
            ),
            unfinished as f64,
        );
        if kind == "dflash2" {
            // The context append inside the block's graph (padded; the default) against
            // the append launched before it.
            let eager = drafter_run(&target, &spec, Engine::CudaAppendEager, 0.0)?;
            compare_runs(
                &mut push,
                &format!("{kind} N=7, context append in the step's graph"),
                ("eager append", &eager),
                &dev,
            );
            // The sampled walk over the device's candidates (q sparse) against the CPU
            // picker over the prediction rows read back (q dense), same target and seed.
            let host = drafter_run(&target, &spec, Engine::CudaHostPicker, 0.8)?;
            compare_runs(
                &mut push,
                &format!("{kind} N=7 sampled (T 0.8), walk over the device's candidates"),
                ("CPU picker", &host),
                &hot,
            );
        }
    }
    // MTP chained on the device (speclab_cuda::mtp): unpadded against the host MTP
    // drafter on the same CUDA target (the same drafts bit for bit), padded (the default)
    // against the CPU engine.
    let spec = DrafterSpec::mtp(&target.cfg, 3)?;
    let dev = drafter_run(&target, &spec, Engine::CudaDevice, 0.0)?;
    let unpadded = drafter_run(&target, &spec, Engine::CudaMtpUnpadded, 0.0)?;
    let host = drafter_run(&target, &spec, Engine::CudaHostDrafter, 0.0)?;
    let cpu = drafter_run(&target, &spec, Engine::Cpu, 0.0)?;
    compare_runs(
        &mut push,
        "mtp N=3 chained, unpadded",
        ("host MTP", &host),
        &unpadded,
    );
    compare_runs(&mut push, "mtp N=3 chained, padded", ("CPU", &cpu), &dev);
    // The chain as one upload and one graph (the default) against a graph a pass: the
    // same launches on the same inputs, so the same drafts.
    let per_pass = drafter_run(&target, &spec, Engine::CudaMtpPerPass, 0.0)?;
    compare_runs(
        &mut push,
        "mtp N=3 chained, one graph",
        ("a graph a pass", &per_pass),
        &dev,
    );
    let hot = drafter_run(&target, &spec, Engine::CudaDevice, 0.8)?;
    let unfinished = hot.requests.iter().filter(|r| r.finish.is_none()).count();
    push(
        format!(
            "mtp N=3 chained, sampled (T 0.8) target: unfinished requests (tau {:.3})",
            hot.tau
        ),
        unfinished as f64,
    );
    Ok(out)
}

/// Two lines: requests whose output differs between `base` and the device run `dev`, and
/// steps whose accepted-draft count differs.
fn compare_runs(
    push: &mut impl FnMut(String, f64),
    what: &str,
    (base_name, base): (&str, &EngineRun),
    dev: &EngineRun,
) {
    let differ = base
        .requests
        .iter()
        .zip(&dev.requests)
        .filter(|(a, b)| a.output != b.output)
        .count()
        + base.requests.len().abs_diff(dev.requests.len());
    push(
        format!("{what} on the device: requests whose output differs from the {base_name}'s"),
        differ as f64,
    );
    let acc = |r: &EngineRun| {
        r.steps
            .iter()
            .map(|s| s.num_accepted_tokens)
            .collect::<Vec<_>>()
    };
    let (a, b) = (acc(base), acc(dev));
    let steps = a.iter().zip(&b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len());
    push(
        format!(
            "{what}: steps whose accepted drafts differ from the {base_name}'s (tau {:.3} / {:.3})",
            base.tau, dev.tau
        ),
        steps as f64,
    );
}

/// The prefill table: per-token KDA recurrence against the chunked kernels.
fn print_prefill(r: &Report) {
    if let Some(e) = &r.prefill_error {
        println!("prefill timing ERROR: {e}");
    }
    if r.prefill.is_empty() {
        return;
    }
    println!("\n| prompts x tokens | prefill ms (per-token KDA, paged_attention) | prefill ms (chunked KDA, prefill_attention) | x | KDA kernels ms old / new | attention ms old / new | prompt tok/s (new) |");
    println!("|---|---|---|---|---|---|---|");
    for p in &r.prefill {
        println!(
            "| {} x {} | {:.2} | {:.2} | {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | {:.0} |",
            p.prompts,
            p.tokens,
            p.ms_recurrent,
            p.ms_chunked,
            p.ms_recurrent / p.ms_chunked.max(1e-9),
            p.kda_ms_recurrent,
            p.kda_ms_chunked,
            p.att_ms_recurrent,
            p.att_ms_chunked,
            p.tok_per_s_chunked
        );
    }
    for p in &r.prefill {
        let top: Vec<String> = p
            .top_kernels_chunked
            .iter()
            .map(|(k, ms)| format!("{k} {ms:.2}"))
            .collect();
        println!(
            "prefill {} x {} (chunked), longest kernels ms: {}",
            p.prompts,
            p.tokens,
            top.join(", ")
        );
    }
}
