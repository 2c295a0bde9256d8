//! `speclab bench e2e`: decode throughput of the real engine (scheduler + KV manager +
//! drafter + target backend, the one step loop of `engine/src/run.rs`) at several
//! concurrencies, for each drafter, with CUDA graphs on and off, in one process.
//!
//! What a row measures (issue 11's protocol): `c` requests of the held-out prompts of
//! `models/tiny/data.safetensors` (`prompt_tokens`, the prompts the PyTorch anchors of
//! `../shared/anchors/` decode), `--prompt-len` tokens each, `--new-tokens` greedy tokens
//! each (EOS ignored). Decode throughput counts only steps with no prefill token:
//! output tokens of those steps / wall seconds of those loop iterations (schedule +
//! execute + update, so host work is in the number). Per step it splits the time into
//! the target forward, the drafter and the rest (scheduler, KV manager, verify), and
//! counts kernels executed (eager launches + replayed graph nodes, `speclab_cuda::ops::KERNELS`).
//! CUDA graphs are captured lazily, inside the step that first needs a shape, so
//! `decode_tok_s` holds the captures; `decode_tok_s_steady` takes their host time out,
//! the rate vLLM and the PyTorch anchor report (both capture before they time).
//!
//! Correctness in the same run: every leg's outputs must equal the no-drafter leg's at
//! the same concurrency and graph setting (greedy speculation is lossless), and legs at
//! concurrency <= `--cpu-check-max` must equal the CPU reference engine's output.
//! Beside each row: the physical floor (all weight bytes once at the copy bandwidth
//! measured in this run; kernels x the measured launch cost) and, when anchor JSONs are
//! given, the PyTorch reference's tok/s at the same concurrency and the ratios.
//!
//! Invariants: every ratio printed is computed from timings of this process (anchors
//! from files written in the same device call); the record is written atomically under
//! its lock (`speclab_experiments::record`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use serde::Serialize;
use speclab_engine::exec::{generate_observed, EngineRequest, EngineRun, GenerateParts, StepStats};
use speclab_engine::model::{Checkpoint, ModelWeights};
use speclab_engine::spec::SamplingParams;

use super::generate::{drafter_spec, fcfs, options, DeviceArg, EngineArgs};

/// Where sampled legs (`--temperature` above 0) verify.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum SamplerArg {
    /// On the device (speclab_cuda::sample): the logits stay there.
    Device,
    /// On the host: the logits of every verified row are copied out (the engine before
    /// the device sampler).
    Host,
    /// A row each (host first); the device rows' outputs must equal the host rows'.
    Both,
}

/// Which graph settings to run.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum GraphsArg {
    On,
    Off,
    Both,
}

#[derive(Debug, Args)]
pub struct E2eArgs {
    /// Target checkpoint (its data.safetensors holds the prompts).
    #[arg(long, default_value = "models/tiny")]
    pub model: PathBuf,
    /// DFlash2 checkpoint for `dflash2:N` legs.
    #[arg(long, default_value = "models/dflash2-tiny")]
    pub dflash2_dir: PathBuf,
    /// Concurrencies (requests decoded together).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
    pub concurrency: Vec<usize>,
    /// Drafters as KIND:N (none needs no N), e.g. none,mtp:2,dflash2:7; KIND:N@host on
    /// cuda drives the device from the host drafter instead of the device one (the MTP
    /// chain with a host round trip a pass, as before speclab_cuda::mtp), for comparison.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "none,mtp:1,mtp:2,mtp:3,mtp:4,dflash2:7"
    )]
    pub drafters: Vec<String>,
    #[arg(long, default_value_t = 256)]
    pub prompt_len: usize,
    #[arg(long, default_value_t = 128)]
    pub new_tokens: u64,
    /// CUDA graphs on, off, or both (one row each).
    #[arg(long, value_enum, default_value = "both")]
    pub graphs: GraphsArg,
    /// Where the target runs (cpu: the reference engine, for comparison only).
    #[arg(long, value_enum, default_value = "cuda")]
    pub device: DeviceArg,
    /// Legs at this concurrency or below are also run on the CPU engine and must match.
    #[arg(long, default_value_t = 1)]
    pub cpu_check_max: usize,
    /// PyTorch anchor JSONs (e2e_ref.py / e2e_graph.py outputs) to put beside the rows.
    #[arg(long, value_delimiter = ',')]
    pub anchors: Vec<PathBuf>,
    /// Runs of each leg (1..=15); the row is the run of median decode tok/s, beside every
    /// run's tok/s (`tok_s_runs`). Greedy runs must give the same tokens each time.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=15))]
    pub repeat: u64,
    /// The record (written atomically under its lock).
    #[arg(long, default_value = "runs/bench-e2e.json")]
    pub out: PathBuf,
    /// Target sampling temperature: 0 (the default) decodes greedily, the issue's
    /// protocol; above 0 every leg samples (rejection sampling against the drafter's q),
    /// and outputs are compared across samplers and with the CPU engine, not with the
    /// no-drafter leg (each drafter draws its own stream).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// With --temperature: keep the top-k logits (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// With --temperature: nucleus mass in (0, 1] (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// With --temperature on cuda: where sampled legs verify.
    #[arg(long, value_enum, default_value = "device")]
    pub sampler: SamplerArg,
    /// Commit to stamp into the record when the tree has no git metadata (device machine).
    #[arg(long)]
    pub commit: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// One leg's drafter.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Choice {
    kind: String,
    n: Option<usize>,
    /// `@host`: the spec's own drafter on a cuda leg (not `CudaDrafterSpec`'s).
    host: bool,
}

fn parse_choice(entry: &str) -> anyhow::Result<Choice> {
    let (s, host) = match entry.strip_suffix("@host") {
        Some(s) => (s, true),
        None => (entry, false),
    };
    let (kind, n) = match s.split_once(':') {
        Some((k, n)) => {
            let n: usize = n.parse().with_context(|| {
                format!("--drafters entry {s:?}: N after ':' must be a whole number")
            })?;
            (k, Some(n))
        }
        None => (s, None),
    };
    let parsed: speclab_drafters::DrafterKind = kind
        .parse()
        .with_context(|| format!("--drafters entry {s:?}"))?;
    if parsed != speclab_drafters::DrafterKind::None && n.is_none() {
        bail!("--drafters entry {s:?}: give the speculative tokens as {kind}:N");
    }
    if host && parsed == speclab_drafters::DrafterKind::None {
        bail!("--drafters entry {entry:?}: @host needs a drafter");
    }
    Ok(Choice {
        kind: kind.to_string(),
        n,
        host,
    })
}

/// One measured row.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub drafter: String,
    pub num_spec: usize,
    pub concurrency: usize,
    pub graphs: bool,
    /// `greedy`, or where a sampled leg verified: `device` / `host` (`--sampler`).
    pub sampler: String,
    pub decode_tok_s: f64,
    pub us_per_step: f64,
    pub forward_us_per_step: f64,
    pub draft_us_per_step: f64,
    pub host_us_per_step: f64,
    pub steps: u64,
    pub kernels_per_step: f64,
    pub tau: f64,
    pub acceptance_rate: f64,
    /// Tokens accepted per request per verify step.
    pub mean_accepted_per_step: f64,
    /// Target rows per decode step (requests x (1 + drafts)).
    pub verify_rows_per_step: f64,
    pub experts_touched_mean: Option<f64>,
    pub speedup_vs_none: Option<f64>,
    /// Requests whose output differs from the no-drafter leg's (same c and graphs).
    pub mismatch_vs_none: Option<usize>,
    /// Requests whose output differs from the CPU engine's (legs at c <= cpu_check_max).
    pub mismatch_vs_cpu: Option<usize>,
    /// Sampled legs with `--sampler both`: requests whose output on the device sampler
    /// differs from the same leg's on the host sampler.
    pub mismatch_vs_host: Option<usize>,
    /// Floors: all weight bytes once at the measured copy bandwidth; kernels x launch cost.
    pub floor_weights_us: f64,
    pub floor_launch_us: f64,
    pub anchor_eager_tok_s: Option<f64>,
    pub anchor_graph_tok_s: Option<f64>,
    /// The drafter's own layers ran on the benched device (MTP, and the DFlash drafters
    /// since speclab_cuda::CudaDFlash2); false without a drafter or on the CPU. The cost
    /// fit (experiments/src/cost_fit.rs) leaves host-drafted DFlash rows out.
    pub drafter_on_device: bool,
    /// The MTP drafter's passes were chained on the device (speclab_cuda::mtp::CudaMtp:
    /// one host read a step); false for an `@host` leg (a host round trip a pass, every
    /// MTP row of records before 2026-12-02) and for other drafters.
    pub mtp_chain_on_device: bool,
    /// An `@host` comparison leg (the drafter is named `KIND@host`).
    pub host_drafter: bool,
    /// CUDA graphs captured during the measured (decode) steps, and the host us a step
    /// their capture, instantiation and upload took (inside `us_per_step`: a shape seen
    /// for the first time is captured in the step that needs it).
    pub graph_captures: u64,
    pub capture_us_per_step: f64,
    /// Decode tok/s with the one-time graph captures taken out: output tokens / (loop
    /// seconds - capture seconds). vLLM captures its CUDA graphs at start-up, before it
    /// serves (`gpu_model_runner.py` `capture_model`), and the PyTorch anchor captures
    /// before its timed loop (`../shared/anchors/e2e_graph.py`); this engine captures
    /// lazily inside the step that first needs a shape, which `decode_tok_s` counts.
    /// Equal to `decode_tok_s` with graphs off.
    pub decode_tok_s_steady: f64,
    /// `decode_tok_s_steady` over the no-drafter leg's.
    pub speedup_vs_none_steady: Option<f64>,
    /// Decode tok/s of every run of the leg (`--repeat`), in run order; the row's other
    /// figures are the median run's.
    pub tok_s_runs: Vec<f64>,
}

/// Device facts measured once per run.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct DeviceFacts {
    pub copy_gb_s: f64,
    pub weight_bytes: usize,
    pub launch_us_eager: f64,
    pub launch_us_graph: f64,
    /// Kernels launched with programmatic dependent launch (sm_90+ unless
    /// `SPECLAB_PDL=0`: speclab_cuda::device::pdl_wanted).
    pub programmatic_launch: bool,
    /// The INT4 routed experts run as one fused kernel (`moe_experts_w4`, unless
    /// `SPECLAB_MOE_FUSED=0`: speclab_cuda::launch::moe_fused).
    pub moe_fused: bool,
}

/// Everything a leg needs.
struct LegCtx<'a> {
    a: &'a E2eArgs,
    /// The target's sampling (`--temperature`, `--top-k`, `--top-p`).
    sampling: SamplingParams,
    target: &'a ModelWeights,
    prompts: &'a [Vec<u32>],
}

/// The held-out prompts, `len` tokens each. Shape: [64][len].
fn load_prompts(model: &Path, len: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    let p = model.join("data.safetensors");
    let data = Checkpoint::open_file(&p).with_context(|| format!("opening {}", p.display()))?;
    let (vals, shape) = data
        .i32_any_shape("prompt_tokens")
        .with_context(|| format!("{}: tensor prompt_tokens", p.display()))?;
    let [rows, cols] = shape[..] else {
        bail!(
            "{}: prompt_tokens has shape {shape:?}, expected [rows, tokens]",
            p.display()
        );
    };
    if len == 0 || len > cols {
        bail!(
            "--prompt-len {len}: {} holds prompts of {cols} tokens",
            p.display()
        );
    }
    Ok((0..rows)
        .map(|r| {
            vals[r * cols..r * cols + len]
                .iter()
                .map(|&t| t as u32)
                .collect()
        })
        .collect())
}

fn engine_args(cx: &LegCtx<'_>, d: &Choice, c: usize) -> EngineArgs {
    let a = cx.a;
    EngineArgs {
        model: a.model.clone(),
        drafter: d.kind.clone(),
        drafter_dir: Some(a.dflash2_dir.clone()),
        num_spec: d.n,
        ngram_min: 3,
        ngram_max: 5,
        max_tokens: a.new_tokens,
        ignore_eos: true,
        block_size: 16,
        num_blocks: None,
        max_model_len: Some(a.prompt_len as u64 + a.new_tokens + 16),
        max_num_batched_tokens: 8192,
        max_num_seqs: c.max(1),
        drafter_block_size: 16,
        cap: super::generate::CapArg::Upstream,
        max_steps: 100_000,
        seed: 0,
        json: false,
    }
}

/// Per-step kernel counts and CUDA graph captures (the process-wide counters read after
/// each step).
struct KernelTap {
    last: u64,
    per_step: Vec<u64>,
    /// (captures, capture ns) at the last step.
    last_captures: (u64, u64),
    /// Per step: graphs captured, host ns they took.
    captures: Vec<(u64, u64)>,
}

impl KernelTap {
    fn new() -> Self {
        Self {
            last: speclab_cuda::ops::kernels_executed(),
            per_step: Vec::new(),
            last_captures: speclab_cuda::ops::graph_captures(),
            captures: Vec::new(),
        }
    }
}

impl speclab_engine::run::RunObserver for KernelTap {
    fn on_step(&mut self, _s: &StepStats) {
        let now = speclab_cuda::ops::kernels_executed();
        self.per_step.push(now - self.last);
        self.last = now;
        let c = speclab_cuda::ops::graph_captures();
        let l = self.last_captures;
        self.captures.push((c.0 - l.0, c.1 - l.1));
        self.last_captures = c;
    }
}

/// Run one leg on `device`; returns the run and the kernels of each step.
fn run_leg(
    cx: &LegCtx<'_>,
    d: &Choice,
    c: usize,
    device: DeviceArg,
    graphs: bool,
    device_sampling: bool,
) -> anyhow::Result<(EngineRun, KernelTap)> {
    let e = engine_args(cx, d, c);
    let spec = drafter_spec(&e, cx.target)?;
    let reqs: Vec<EngineRequest> = (0..c)
        .map(|i| EngineRequest {
            id: i as u64,
            prompt: cx.prompts[i % cx.prompts.len()].clone(),
            max_tokens: cx.a.new_tokens,
        })
        .collect();
    let mut opts = options(&e, cx.target, &reqs, &spec, cx.sampling, false);
    opts.check_allocator = false;
    let cuda = speclab_cuda::CudaFactory {
        opts: speclab_cuda::CudaOptions {
            device: 0,
            use_graphs: graphs,
            device_sampling,
        },
    };
    let cpu = speclab_engine::backend::CpuBackend;
    let backend: &dyn speclab_engine::backend::BackendFactory = match device {
        DeviceArg::Cuda => &cuda,
        DeviceArg::Cpu => &cpu,
    };
    // On the device the DFlash drafters run there too (speclab_cuda::CudaDFlash2).
    let on_device = speclab_cuda::CudaDrafterSpec(&spec);
    let drafter: &dyn speclab_engine::exec::DrafterFactory = match device {
        DeviceArg::Cuda if !d.host => &on_device,
        _ => &spec,
    };
    let parts = GenerateParts {
        backend,
        target: cx.target,
        drafter,
        requests: &reqs,
        opts: &opts,
    };
    let mut tap = KernelTap::new();
    let run = generate_observed(&parts, &mut fcfs(&e), &mut tap)?;
    if run.wedged.is_some() || run.hit_step_limit || !run.rejected.is_empty() {
        bail!(
            "leg {}:{:?} c={c}: the run did not finish (wedged {:?}, rejected {:?}, step limit {})",
            d.kind,
            d.n,
            run.wedged,
            run.rejected,
            run.hit_step_limit
        );
    }
    Ok((run, tap))
}

/// Decode-only sums of a run.
fn measure(
    run: &EngineRun,
    tap: &KernelTap,
    d: &Choice,
    c: usize,
    graphs: bool,
    sampler: &str,
) -> Row {
    let (mut n, mut out, mut loop_s, mut fwd, mut draft, mut rows, mut k) =
        (0u64, 0u64, 0.0, 0.0, 0.0, 0u64, 0u64);
    let (mut caps, mut cap_ns) = (0u64, 0u64);
    for (i, s) in run.steps.iter().enumerate() {
        if s.prefill_tokens > 0 {
            continue;
        }
        n += 1;
        out += s.output_tokens;
        loop_s += s.loop_s;
        fwd += s.forward_s;
        draft += s.draft_s;
        rows += s.verify_tokens;
        k += tap.per_step.get(i).copied().unwrap_or(0);
        let (nc, ns) = tap.captures.get(i).copied().unwrap_or((0, 0));
        caps += nc;
        cap_ns += ns;
    }
    let per = |x: f64| if n > 0 { x * 1e6 / n as f64 } else { 0.0 };
    let drafts = run.spec.num_drafts.max(1) as f64;
    Row {
        drafter: d.kind.clone(),
        num_spec: d.n.unwrap_or(0),
        concurrency: c,
        graphs,
        sampler: sampler.to_string(),
        decode_tok_s: if loop_s > 0.0 {
            out as f64 / loop_s
        } else {
            0.0
        },
        decode_tok_s_steady: steady_tok_s(out, loop_s, cap_ns),
        speedup_vs_none_steady: None,
        us_per_step: per(loop_s),
        forward_us_per_step: per(fwd),
        draft_us_per_step: per(draft),
        host_us_per_step: per(loop_s - fwd - draft),
        steps: n,
        kernels_per_step: if n > 0 { k as f64 / n as f64 } else { 0.0 },
        tau: run.tau,
        acceptance_rate: run.acceptance_rate,
        mean_accepted_per_step: run.spec.num_accepted_tokens as f64 / drafts,
        verify_rows_per_step: if n > 0 { rows as f64 / n as f64 } else { 0.0 },
        experts_touched_mean: None,
        speedup_vs_none: None,
        mismatch_vs_none: None,
        mismatch_vs_cpu: None,
        mismatch_vs_host: None,
        floor_weights_us: 0.0,
        floor_launch_us: 0.0,
        anchor_eager_tok_s: None,
        anchor_graph_tok_s: None,
        drafter_on_device: false,
        mtp_chain_on_device: false,
        host_drafter: false,
        graph_captures: caps,
        capture_us_per_step: if n > 0 {
            cap_ns as f64 / 1e3 / n as f64
        } else {
            0.0
        },
        tok_s_runs: Vec::new(),
    }
}

/// Output tokens per second of loop time less the graph captures' host time (`cap_ns`):
/// the steady-state rate once every shape is captured (0 when nothing is left to time).
fn steady_tok_s(out: u64, loop_s: f64, cap_ns: u64) -> f64 {
    let s = loop_s - cap_ns as f64 * 1e-9;
    if s > 0.0 {
        out as f64 / s
    } else {
        0.0
    }
}

/// A leg run `cx.a.repeat` times: the median run by decode tok/s (the lower middle of an
/// even count), its measured row with every run's tok/s. Every run must give the same
/// tokens (decoding on one engine is deterministic, sampled runs too: every request's RNG
/// is seeded).
fn median_leg(
    cx: &LegCtx<'_>,
    d: &Choice,
    c: usize,
    graphs: bool,
    device_sampling: bool,
) -> anyhow::Result<(EngineRun, KernelTap, Row)> {
    let sampler = match (cx.sampling.is_greedy(), device_sampling) {
        (true, _) => "greedy",
        (false, true) => "device",
        (false, false) => "host",
    };
    let mut runs = Vec::new();
    for i in 0..cx.a.repeat {
        let (run, tap) = run_leg(cx, d, c, cx.a.device, graphs, device_sampling)?;
        let row = measure(&run, &tap, d, c, graphs, sampler);
        if let Some((first, _, _)) = runs.first() {
            let m = mismatches(&outputs(&run), &outputs(first));
            if m > 0 {
                bail!(
                    "leg {}:{:?} c={c} graphs={graphs}: run {} gave other tokens than run 1 for {m} requests",
                    d.kind,
                    d.n,
                    i + 1
                );
            }
        }
        runs.push((run, tap, row));
    }
    let all: Vec<f64> = runs.iter().map(|r| r.2.decode_tok_s).collect();
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|&a, &b| all[a].total_cmp(&all[b]));
    let (run, tap, mut row) = runs.swap_remove(order[(order.len() - 1) / 2]);
    row.tok_s_runs = all;
    Ok((run, tap, row))
}

fn outputs(run: &EngineRun) -> Vec<Vec<u32>> {
    run.requests.iter().map(|r| r.output.clone()).collect()
}

fn mismatches(a: &[Vec<u32>], b: &[Vec<u32>]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
}

/// The PyTorch anchors by concurrency: (eager tok/s, CUDA-graph tok/s).
type Anchors = BTreeMap<usize, (Option<f64>, Option<f64>)>;

/// Read the anchor JSONs (rows with `batch` and `decode_tok_s` or `graph_tok_s`).
fn load_anchors(paths: &[PathBuf]) -> anyhow::Result<Anchors> {
    let mut m = Anchors::new();
    for p in paths {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not JSON", p.display()))?;
        let rows = v["rows"]
            .as_array()
            .with_context(|| format!("{}: expected a \"rows\" array", p.display()))?;
        for r in rows {
            let Some(b) = r["batch"].as_u64() else {
                bail!("{}: a row without a numeric \"batch\"", p.display());
            };
            let e = m.entry(b as usize).or_default();
            if let Some(x) = r["decode_tok_s"].as_f64() {
                e.0 = Some(x);
            }
            if let Some(x) = r["graph_tok_s"].as_f64() {
                e.1 = Some(x);
            }
        }
    }
    Ok(m)
}

/// Copy bandwidth, weight bytes and launch costs of device 0 (zeros on the CPU).
fn device_facts(a: &E2eArgs, target: &ModelWeights) -> anyhow::Result<DeviceFacts> {
    if !matches!(a.device, DeviceArg::Cuda) {
        return Ok(DeviceFacts::default());
    }
    let kv = speclab_engine::kv::KvCacheManager::from_layout(&target.cfg.kv_layout(16, 0, 64)?)?;
    let b = speclab_cuda::CudaBackend::new(target, &kv)?;
    let (launch_us_eager, launch_us_graph) = b.launch_cost_us()?;
    Ok(DeviceFacts {
        copy_gb_s: b.copy_bandwidth_gbs(1 << 30)?,
        weight_bytes: b.weight_bytes(),
        launch_us_eager,
        launch_us_graph,
        programmatic_launch: b.programmatic_launch(),
        moe_fused: speclab_cuda::launch::moe_fused(),
    })
}

/// `speclab bench e2e`.
pub fn e2e(a: E2eArgs) -> anyhow::Result<ExitCode> {
    let choices: Vec<Choice> = a
        .drafters
        .iter()
        .map(|s| parse_choice(s))
        .collect::<anyhow::Result<_>>()?;
    if a.concurrency.is_empty() || a.concurrency.contains(&0) {
        bail!("--concurrency: give positive request counts, e.g. 1,8,32,128");
    }
    let mut lock = speclab_experiments::record::RecordLock::open(&a.out)?;
    let _guard = lock.try_lock()?;
    let target = ModelWeights::load(&a.model)?;
    let prompts = load_prompts(&a.model, a.prompt_len)?;
    let anchors = load_anchors(&a.anchors)?;
    let facts = device_facts(&a, &target)?;
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
    };
    sampling
        .validate()
        .context("--temperature / --top-k / --top-p")?;
    let cx = LegCtx {
        a: &a,
        sampling,
        target: &target,
        prompts: &prompts,
    };
    let settings: Vec<bool> = match (a.graphs, a.device) {
        (_, DeviceArg::Cpu) | (GraphsArg::Off, _) => vec![false],
        (GraphsArg::On, _) => vec![true],
        (GraphsArg::Both, _) => vec![false, true],
    };
    // Host before device, so each device row finds its host twin's outputs.
    let samplers: Vec<bool> = match (sampling.is_greedy(), a.device, a.sampler) {
        (true, ..) | (_, DeviceArg::Cpu, _) | (_, _, SamplerArg::Host) => vec![false],
        (_, _, SamplerArg::Device) => vec![true],
        (_, _, SamplerArg::Both) => vec![false, true],
    };
    let mut rows = Vec::new();
    for &c in &a.concurrency {
        for &graphs in &settings {
            let mut host: Option<Vec<Vec<Vec<u32>>>> = None;
            for &on_device in &samplers {
                let (legs, outs): (Vec<Row>, Vec<_>) =
                    concurrency_rows(&cx, &choices, c, graphs, on_device, &facts)?
                        .into_iter()
                        .unzip();
                for (i, mut row) in legs.into_iter().enumerate() {
                    if on_device {
                        row.mismatch_vs_host = host.as_ref().map(|h| mismatches(&outs[i], &h[i]));
                    }
                    rows.push(row);
                }
                if !on_device {
                    host = Some(outs);
                }
            }
        }
    }
    for r in &mut rows {
        if let Some((e, g)) = anchors.get(&r.concurrency) {
            r.anchor_eager_tok_s = *e;
            r.anchor_graph_tok_s = *g;
        }
    }
    let ok = rows.iter().all(|r| {
        r.mismatch_vs_none.unwrap_or(0) == 0
            && r.mismatch_vs_cpu.unwrap_or(0) == 0
            && r.mismatch_vs_host.unwrap_or(0) == 0
    });
    write_record(&a, &facts, &rows, ok)?;
    print_rows(&a, &facts, &rows);
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Every drafter at one concurrency and graph setting (the no-drafter leg first, as the
/// reference of outputs and speedups); each row with its requests' outputs.
fn concurrency_rows(
    cx: &LegCtx<'_>,
    choices: &[Choice],
    c: usize,
    graphs: bool,
    device_sampling: bool,
    facts: &DeviceFacts,
) -> anyhow::Result<Vec<(Row, Vec<Vec<u32>>)>> {
    let none = Choice {
        kind: "none".into(),
        n: None,
        host: false,
    };
    let (base_run, _, base_row) = median_leg(cx, &none, c, graphs, device_sampling)?;
    let base_out = outputs(&base_run);
    let base_tok_s = base_row.decode_tok_s;
    let base_steady = base_row.decode_tok_s_steady;
    let mut rows = Vec::new();
    for d in choices {
        let leg;
        let (run, mut row) = if *d == none {
            (&base_run, base_row.clone())
        } else {
            leg = median_leg(cx, d, c, graphs, device_sampling)?;
            (&leg.0, leg.2)
        };
        let cuda = matches!(cx.a.device, DeviceArg::Cuda);
        row.drafter_on_device = cuda && !matches!(d.kind.as_str(), "none" | "ngram") && !d.host;
        row.mtp_chain_on_device = cuda && d.kind == "mtp" && !d.host;
        row.host_drafter = d.host;
        if d.host {
            row.drafter = format!("{}@host", d.kind);
        }
        let out = outputs(run);
        // A sampled drafter leg draws another stream than the no-drafter leg: only the
        // greedy legs must agree with it.
        row.mismatch_vs_none =
            (cx.sampling.is_greedy() || *d == none).then(|| mismatches(&out, &base_out));
        row.speedup_vs_none = (base_tok_s > 0.0).then(|| row.decode_tok_s / base_tok_s);
        row.speedup_vs_none_steady =
            (base_steady > 0.0).then(|| row.decode_tok_s_steady / base_steady);
        if matches!(cx.a.device, DeviceArg::Cuda) && c <= cx.a.cpu_check_max && !graphs {
            let (cpu, _) = run_leg(cx, d, c, DeviceArg::Cpu, false, false)?;
            row.mismatch_vs_cpu = Some(mismatches(&out, &outputs(&cpu)));
        }
        if facts.copy_gb_s > 0.0 {
            row.floor_weights_us = facts.weight_bytes as f64 / (facts.copy_gb_s * 1e3);
        }
        row.floor_launch_us = row.kernels_per_step * facts.launch_us_graph;
        tracing::info!(
            "{}:{} c={c} graphs={graphs}: {:.0} tok/s, {:.1} us/step",
            row.drafter,
            row.num_spec,
            row.decode_tok_s,
            row.us_per_step
        );
        rows.push((row, out));
    }
    Ok(rows)
}

/// The `SPECLAB_*` environment variables of this run (the A/B switches of cuda/README.md,
/// e.g. `SPECLAB_DEVICE_SAMPLE=0`), sorted, so a record says which variant it measured.
fn speclab_switches() -> std::collections::BTreeMap<String, String> {
    std::env::vars()
        .filter(|(k, _)| k.starts_with("SPECLAB_") && k != "SPECLAB_KERNEL_CACHE")
        .collect()
}

fn write_record(a: &E2eArgs, facts: &DeviceFacts, rows: &[Row], ok: bool) -> anyhow::Result<()> {
    let record = serde_json::json!({
        "kind": "bench-e2e",
        "git_commit": a.commit.clone().or_else(speclab_experiments::record::git_commit),
        "measured_unix_s": speclab_experiments::record::now_unix(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "switches": speclab_switches(),
        "device": format!("{:?}", a.device).to_lowercase(),
        "model": a.model.display().to_string(),
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "repeat": a.repeat,
        "sampling": {"temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p},
        "copy_gb_s": facts.copy_gb_s,
        "weight_bytes": facts.weight_bytes,
        "launch_us": facts.launch_us_graph,
        "launch_us_eager": facts.launch_us_eager,
        "outputs_all_match": ok,
        "rows": rows,
    });
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    speclab_experiments::record::write_atomic(&a.out, &serde_json::to_vec_pretty(&record)?)?;
    Ok(())
}

fn opt(x: Option<f64>, prec: usize) -> String {
    x.map(|v| format!("{v:.prec$}"))
        .unwrap_or_else(|| "-".into())
}

fn print_rows(a: &E2eArgs, f: &DeviceFacts, rows: &[Row]) {
    if a.json {
        println!("{}", serde_json::to_string(rows).unwrap_or_default());
        return;
    }
    println!(
        "copy {:.0} GB/s, weights {:.1} MB (floor {:.1} us/step), launch {:.2} us eager / {:.2} us in a graph; record {}",
        f.copy_gb_s,
        f.weight_bytes as f64 / 1e6,
        rows.first().map(|r| r.floor_weights_us).unwrap_or(0.0),
        f.launch_us_eager,
        f.launch_us_graph,
        a.out.display()
    );
    println!("| drafter | N | c | graphs | sampler | tok/s | us/step | fwd | draft | host | capture | kernels | floor launch us | tau | x none | tok/s, x none excl. capture | x eager ref | x graph ref | mismatch none/cpu/host |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} | {:.2} | {} | {:.0}, {} | {} | {} | {}/{}/{} |",
            r.drafter,
            r.num_spec,
            r.concurrency,
            if r.graphs { "on" } else { "off" },
            r.sampler,
            r.decode_tok_s,
            r.us_per_step,
            r.forward_us_per_step,
            r.draft_us_per_step,
            r.host_us_per_step,
            r.capture_us_per_step,
            r.kernels_per_step,
            r.floor_launch_us,
            r.tau,
            opt(r.speedup_vs_none, 2),
            r.decode_tok_s_steady,
            opt(r.speedup_vs_none_steady, 3),
            opt(r.anchor_eager_tok_s.map(|x| r.decode_tok_s / x), 1),
            opt(r.anchor_graph_tok_s.map(|x| r.decode_tok_s / x), 2),
            r.mismatch_vs_none.map(|x| x.to_string()).unwrap_or("-".into()),
            r.mismatch_vs_cpu.map(|x| x.to_string()).unwrap_or("-".into()),
            r.mismatch_vs_host.map(|x| x.to_string()).unwrap_or("-".into()),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafter_entries_parse_or_explain() {
        assert_eq!(
            parse_choice("mtp:2").unwrap(),
            Choice {
                kind: "mtp".into(),
                n: Some(2),
                host: false,
            }
        );
        let h = parse_choice("mtp:2@host").unwrap();
        assert!(h.host && h.kind == "mtp" && h.n == Some(2));
        assert!(parse_choice("none@host").is_err());
        assert_eq!(parse_choice("none").unwrap().n, None);
        let e = parse_choice("mtp").unwrap_err().to_string();
        assert!(e.contains("mtp:N"), "{e}");
        assert!(parse_choice("mtp:x").is_err());
        assert!(parse_choice("bogus:2").is_err());
    }

    #[test]
    fn steady_rate_takes_the_captures_out() {
        // 100 tokens in 0.5 s of which 0.1 s was capturing: 250 tok/s steady, 200 wall.
        assert!((steady_tok_s(100, 0.5, 100_000_000) - 250.0).abs() < 1e-9);
        assert!((steady_tok_s(100, 0.5, 0) - 200.0).abs() < 1e-9);
        // Nothing left to time: 0, not a division by zero or a negative rate.
        assert_eq!(steady_tok_s(100, 0.1, 100_000_000), 0.0);
        assert_eq!(steady_tok_s(0, 0.0, 0), 0.0);
    }

    #[test]
    fn mismatches_count_differing_and_missing_requests() {
        let a = vec![vec![1, 2], vec![3]];
        assert_eq!(mismatches(&a, &a), 0);
        assert_eq!(mismatches(&a, &[vec![1, 2], vec![4]]), 1);
        assert_eq!(mismatches(&a, &[vec![1, 2]]), 1);
    }
}
