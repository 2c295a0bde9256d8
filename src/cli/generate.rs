//! `speclab generate` and `speclab verify-lossless`: the real engine from the command line.
//!
//! `generate` loads a target checkpoint (and a drafter), runs the vLLM-faithful FCFS
//! scheduler + model executor over one KV manager (`speclab_engine::exec::generate`) and
//! prints the text (with `tokenizer.json` in the model directory), the acceptance of every
//! step, tokens/s, TTFT and vLLM's acceptance metrics. `verify-lossless` runs the same
//! prompts greedily with and without the drafter and reports, per mismatching request, the
//! first diverging index, both tokens and the target's top1 - top2 logit margin there
//! (`speclab_engine::exec::verify_lossless`); it exits 1 on any mismatch.
//! Invariant: `--json` prints only JSON on stdout.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use speclab_drafters::{DFlash2Weights, DraftMode, DrafterKind, DrafterSpec};
use speclab_engine::exec::{
    generate as run_generate, verify_lossless, EngineOptions, EngineRequest, EngineRun,
    SchedulerParams,
};
use speclab_engine::kv::{CapPolicy, KvCacheManager};
use speclab_engine::model::{ModelWeights, Tokenizer};
use speclab_engine::spec::SamplingParams;
use speclab_engine::Scheduler;

/// Sliding-window cap policy of the DFlash drafter's KV group.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum CapArg {
    None,
    Upstream,
    /// Manifests' spelling; the older CLI spelling `window-plus-two` is accepted too.
    #[value(name = "window_plus_two", alias = "window-plus-two")]
    WindowPlusTwo,
}

impl From<CapArg> for CapPolicy {
    fn from(c: CapArg) -> Self {
        match c {
            CapArg::None => CapPolicy::None,
            CapArg::Upstream => CapPolicy::Upstream,
            CapArg::WindowPlusTwo => CapPolicy::WindowPlusTwo,
        }
    }
}

/// A count flag that must be >= 1 (the error names the flag as written).
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be >= 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("expected a whole number >= 1: {e}")),
    }
}

/// Engine knobs shared by both commands.
#[derive(Debug, Args)]
pub struct EngineArgs {
    /// Target checkpoint directory (config.json, model.safetensors, optional tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// Drafter: none, ngram, mtp, dflash2, dflash1.
    #[arg(long, default_value = "none")]
    pub drafter: String,
    /// DFlash checkpoint directory (dflash2 / dflash1).
    #[arg(long)]
    pub drafter_dir: Option<PathBuf>,
    /// Speculative tokens per step (vLLM num_speculative_tokens); required with a drafter.
    #[arg(long)]
    pub num_spec: Option<usize>,
    /// n-gram bounds (vLLM prompt_lookup_min / max).
    #[arg(long, default_value_t = 5, value_parser = at_least_one)]
    pub ngram_min: usize,
    #[arg(long, default_value_t = 5, value_parser = at_least_one)]
    pub ngram_max: usize,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u64,
    /// Keep generating past EOS (vLLM ignore_eos).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Block size of the target's full-attention group.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Blocks in the pool (default: every request at max_model_len fits at once).
    #[arg(long)]
    pub num_blocks: Option<u32>,
    /// Cap below the model's max_position_embeddings.
    #[arg(long)]
    pub max_model_len: Option<u64>,
    /// vLLM max_num_batched_tokens (the chunked-prefill budget per step).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: u64,
    /// vLLM max_num_seqs.
    #[arg(long, default_value_t = 128)]
    pub max_num_seqs: usize,
    /// Block size of the DFlash drafter's sliding-window group.
    #[arg(long, default_value_t = 16)]
    pub drafter_block_size: u32,
    /// Sliding-window cap policy of the DFlash drafter's group.
    #[arg(long, value_enum, default_value = "upstream")]
    pub cap: CapArg,
    /// Stop after this many engine steps.
    #[arg(long, default_value_t = 100_000)]
    pub max_steps: u64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long)]
    pub json: bool,
}

/// Where the target model runs.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum DeviceArg {
    /// The CPU reference engine (engine/src/model).
    Cpu,
    /// The CUDA engine (speclab-cuda): needs a GPU, libcuda and libnvrtc.
    Cuda,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Target backend: the CPU reference or the CUDA engine.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
    /// Prompt text (needs tokenizer.json in the model directory).
    #[arg(long, conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Record the distinct experts each step's verify pass routed to.
    #[arg(long)]
    pub experts: bool,
}

#[derive(Debug, Args)]
// The manifest form needs no --model: it comes from the manifest's `real` section.
#[command(mut_arg("model", |a| a
    .required(false)
    .default_value("")
    .hide_default_value(true)
    .value_parser(clap::builder::TypedValueParser::map(clap::builder::OsStringValueParser::new(), PathBuf::from))))]
pub struct VerifyLosslessArgs {
    /// Manifest form: a RON manifest with a `real` section; checks every drafter x N x
    /// concurrency there (greedy) instead of the flags below (speclab run's verify_manifest).
    #[arg(conflicts_with_all = ["model", "prompts", "random_prompts", "drafter", "num_spec"])]
    pub manifest: Option<PathBuf>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Where both runs' target runs: the CPU reference or the CUDA engine.
    #[arg(long, value_enum, default_value = "cpu", conflicts_with = "manifest")]
    pub device: DeviceArg,
    /// One prompt as text (tokenized with the model's tokenizer.json), as `generate --prompt`.
    #[arg(long, conflicts_with_all = ["prompts", "random_prompts", "manifest"])]
    pub prompt: Option<String>,
    /// Prompts: a .json list of strings or of token-id lists, or a text file (one prompt a line).
    #[arg(long, conflicts_with = "random_prompts")]
    pub prompts: Option<PathBuf>,
    /// K random prompts of LEN tokens each (K:LEN), seeded by --seed.
    #[arg(long)]
    pub random_prompts: Option<String>,
}

fn tokenizer(model: &Path) -> anyhow::Result<Option<Tokenizer>> {
    let p = model.join("tokenizer.json");
    if p.exists() {
        Ok(Some(Tokenizer::from_file(&p)?))
    } else {
        Ok(None)
    }
}

pub(crate) fn drafter_spec(a: &EngineArgs, target: &ModelWeights) -> anyhow::Result<DrafterSpec> {
    if a.ngram_max < a.ngram_min {
        bail!(
            "--ngram-max {} is below --ngram-min {}",
            a.ngram_max,
            a.ngram_min
        );
    }
    let kind: DrafterKind = a.drafter.parse()?;
    if kind == DrafterKind::None {
        return Ok(DrafterSpec::none());
    }
    let n = a.num_spec.with_context(|| {
        format!(
            "--drafter {} needs --num-spec N (speculative tokens per step)",
            kind.name()
        )
    })?;
    let cfg = &target.cfg;
    Ok(match kind {
        DrafterKind::None => DrafterSpec::none(),
        DrafterKind::Ngram => DrafterSpec::ngram(n, a.ngram_min, a.ngram_max)?,
        DrafterKind::Mtp => DrafterSpec::mtp(cfg, n)?,
        DrafterKind::Dflash2 | DrafterKind::Dflash1 => {
            let dir = a.drafter_dir.as_deref().with_context(|| {
                format!(
                    "--drafter {} needs --drafter-dir DIR (the DFlash checkpoint)",
                    kind.name()
                )
            })?;
            let w = DFlash2Weights::load_for_target(dir, cfg)?;
            let mode = if kind == DrafterKind::Dflash2 {
                DraftMode::V2
            } else {
                DraftMode::V1
            };
            DrafterSpec::dflash(w, cfg, n, mode, a.drafter_block_size, a.cap.into())?
        }
    })
}

pub(crate) fn options(
    a: &EngineArgs,
    target: &ModelWeights,
    reqs: &[EngineRequest],
    spec: &DrafterSpec,
    sampling: SamplingParams,
    collect_router: bool,
) -> EngineOptions {
    let mml = a
        .max_model_len
        .unwrap_or(target.cfg.max_position_embeddings as u64);
    // Default pool: the drafter factory's (every request at its full length at once).
    let default_blocks = spec.default_num_blocks(a.block_size, mml, reqs);
    EngineOptions {
        block_size: a.block_size,
        num_blocks: a.num_blocks.unwrap_or(default_blocks),
        max_model_len: a.max_model_len,
        sampling,
        seed: a.seed,
        ignore_eos: a.ignore_eos,
        collect_router,
        max_steps: a.max_steps,
        check_allocator: true,
    }
}

pub(crate) fn fcfs(
    a: &EngineArgs,
) -> impl FnMut(
    &KvCacheManager,
    &SchedulerParams,
    &[EngineRequest],
) -> speclab_engine::Result<Box<dyn Scheduler>> {
    speclab_schedulers::fcfs_factory(a.max_num_seqs, a.max_num_batched_tokens)
}

fn summary_line(run: &EngineRun) -> String {
    let ttft: Vec<String> = run
        .requests
        .iter()
        .map(|r| match (r.ttft_steps, r.ttft_s) {
            (Some(s), Some(t)) => format!("{s} steps / {:.3} s", t),
            _ => "-".into(),
        })
        .collect();
    format!(
        "{} tokens in {} steps, {:.3} s ({:.1} tok/s); TTFT {}; drafts {}, draft tokens {}, accepted {} ({:.1}%), tau {:.3}, per position [{}]",
        run.output_tokens,
        run.num_steps,
        run.wall_s,
        run.tokens_per_s,
        ttft.join(", "),
        run.spec.num_drafts,
        run.spec.num_draft_tokens,
        run.spec.num_accepted_tokens,
        100.0 * run.acceptance_rate,
        run.tau,
        run.per_position.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(", ")
    )
}

/// `speclab generate`.
pub fn generate(a: GenerateArgs) -> anyhow::Result<ExitCode> {
    let e = &a.engine;
    let target = ModelWeights::load(&e.model)?;
    let tok = tokenizer(&e.model)?;
    let prompt: Vec<u32> = match (&a.prompt, &a.prompt_ids) {
        (Some(text), None) => {
            let t = tok.as_ref().with_context(|| {
                format!(
                    "--prompt TEXT needs {}; give --prompt-ids instead",
                    e.model.join("tokenizer.json").display()
                )
            })?;
            t.encode(text, true)?
        }
        (None, Some(ids)) => ids.clone(),
        _ => bail!("give --prompt TEXT or --prompt-ids 1,2,3"),
    };
    let spec = drafter_spec(e, &target)?;
    let sampling = SamplingParams::random(a.temperature);
    sampling.validate()?;
    let n_spec = speclab_engine::exec::DrafterFactory::num_speculative_tokens(&spec);
    let reqs = [EngineRequest {
        id: 0,
        prompt: prompt.clone(),
        max_tokens: e.max_tokens,
    }];
    let opts = options(e, &target, &reqs, &spec, sampling, a.experts);
    let mut make = fcfs(e);
    let run = match a.device {
        DeviceArg::Cpu => run_generate(&target, &spec, &reqs, &opts, &mut make)?,
        DeviceArg::Cuda => speclab_engine::exec::generate_on(
            &speclab_cuda::CudaFactory::default(),
            &target,
            &speclab_cuda::CudaDrafterSpec(&spec),
            &reqs,
            &opts,
            &mut make,
        )?,
    };
    let out = run.output(0).unwrap_or(&[]).to_vec();
    let text = match &tok {
        Some(t) => Some(t.decode(&out, true)?),
        None => None,
    };
    if e.json {
        println!(
            "{}",
            serde_json::json!({
                "drafter": spec.kind.name(), "num_spec": n_spec, "prompt_ids": prompt, "output_ids": out, "text": text, "run": run,
            })
        );
    } else {
        println!(
            "drafter {} (N = {n_spec}), prompt of {} tokens, temperature {}",
            spec.kind.name(),
            prompt.len(),
            a.temperature
        );
        match &text {
            Some(t) => println!("{t}"),
            None => println!("{out:?}"),
        }
        for s in &run.steps {
            let experts = s
                .verify_experts
                .map(|x| format!(", verify experts {x}"))
                .unwrap_or_default();
            if s.prefill_tokens > 0 {
                println!(
                    "step {:>4}: prefill {:>4} tokens -> {} out{experts}",
                    s.step, s.prefill_tokens, s.output_tokens
                );
            } else {
                println!(
                    "step {:>4}: verify width {:>2}, accepted {}/{} -> {} out{experts}",
                    s.step,
                    s.verify_tokens,
                    s.num_accepted_tokens,
                    s.num_draft_tokens,
                    s.output_tokens
                );
            }
        }
        if let Some(r) = run.requests.first() {
            // Plain words, as records spell them (`length`, `eos`, `max_model_len`).
            let finish = serde_json::to_value(r.finish)?;
            println!("finish: {}", finish.as_str().unwrap_or("unfinished"));
        }
        if let Some(w) = &run.wedged {
            println!("wedged: {w}");
        }
        println!("{}", summary_line(&run));
    }
    Ok(ExitCode::SUCCESS)
}

fn read_prompts(p: &Path, tok: Option<&Tokenizer>) -> anyhow::Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
    let encode = |s: &str| -> anyhow::Result<Vec<u32>> {
        let t = tok.with_context(|| {
            format!(
                "{}: text prompts need tokenizer.json in the model directory",
                p.display()
            )
        })?;
        Ok(t.encode(s, true)?)
    };
    if p.extension().and_then(|e| e.to_str()) == Some("json") {
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not JSON", p.display()))?;
        let items = v
            .as_array()
            .with_context(|| format!("{}: expected a JSON list of prompts", p.display()))?;
        items
            .iter()
            .enumerate()
            .map(|(i, x)| match x {
                serde_json::Value::String(s) => encode(s),
                serde_json::Value::Array(_) => serde_json::from_value::<Vec<u32>>(x.clone())
                    .with_context(|| format!("{}: prompt {i}: expected token ids", p.display())),
                _ => bail!(
                    "{}: prompt {i}: expected a string or a list of token ids",
                    p.display()
                ),
            })
            .collect()
    } else {
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(encode)
            .collect()
    }
}

/// `speclab verify-lossless`.
pub fn verify(a: VerifyLosslessArgs) -> anyhow::Result<ExitCode> {
    if let Some(m) = &a.manifest {
        return super::run::verify_manifest(m, a.engine.json);
    }
    let e = &a.engine;
    if e.model.as_os_str().is_empty() {
        bail!("give --model DIR (with --drafter, --num-spec, --prompts or --random-prompts), or a manifest with a `real` section");
    }
    let target = ModelWeights::load(&e.model)?;
    let tok = tokenizer(&e.model)?;
    let prompts = verify_prompts(&a, &target, tok.as_ref())?;
    if prompts.is_empty() {
        bail!("no prompts");
    }
    let spec = drafter_spec(e, &target)?;
    let n_spec = speclab_engine::exec::DrafterFactory::num_speculative_tokens(&spec);
    let reqs: Vec<EngineRequest> = prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| EngineRequest {
            id: i as u64,
            prompt: p,
            max_tokens: e.max_tokens,
        })
        .collect();
    let opts = options(e, &target, &reqs, &spec, SamplingParams::GREEDY, false);
    let mut make = fcfs(e);
    let report = match a.device {
        DeviceArg::Cpu => verify_lossless(&target, &spec, &reqs, &opts, &mut make)?,
        DeviceArg::Cuda => speclab_engine::exec::verify_lossless_on(
            &speclab_cuda::CudaFactory::default(),
            &target,
            &speclab_cuda::CudaDrafterSpec(&spec),
            &reqs,
            &opts,
            &mut make,
        )?,
    };
    print_lossless(&report, spec.kind.name(), n_spec, e.json);
    Ok(if report.is_lossless() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The prompts of `verify-lossless` (`--prompt`, `--prompts`, or seeded `--random-prompts`).
fn verify_prompts(
    a: &VerifyLosslessArgs,
    target: &ModelWeights,
    tok: Option<&Tokenizer>,
) -> anyhow::Result<Vec<Vec<u32>>> {
    let e = &a.engine;
    Ok(match (&a.prompts, &a.random_prompts) {
        _ if a.prompt.is_some() => {
            let t = tok.with_context(|| {
                format!(
                    "--prompt TEXT needs {}; give --prompts FILE with token ids instead",
                    e.model.join("tokenizer.json").display()
                )
            })?;
            vec![t.encode(a.prompt.as_deref().unwrap_or_default(), true)?]
        }
        (Some(p), None) => read_prompts(p, tok)?,
        (None, Some(spec)) => {
            let (k, len) = spec
                .split_once(':')
                .and_then(|(k, l)| Some((k.parse::<usize>().ok()?, l.parse::<usize>().ok()?)))
                .with_context(|| format!("--random-prompts {spec:?}: expected K:LEN, e.g. 4:32"))?;
            use rand::{Rng, SeedableRng};
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(e.seed);
            // Ordinary tokens only (the special ids sit at the end of the vocab).
            let hi = target
                .cfg
                .vocab_size
                .saturating_sub(speclab_engine::model::config::NUM_SPECIAL)
                .max(1) as u32;
            (0..k)
                .map(|_| (0..len).map(|_| rng.random_range(0..hi)).collect())
                .collect()
        }
        _ => bail!("give --prompt TEXT, --prompts FILE or --random-prompts K:LEN"),
    })
}

/// Print a lossless report (JSON with `--json`).
fn print_lossless(
    report: &speclab_engine::exec::LosslessReport,
    drafter: &str,
    n_spec: usize,
    json: bool,
) {
    if json {
        println!(
            "{}",
            serde_json::json!({
                "drafter": drafter, "num_spec": n_spec, "lossless": report.is_lossless(),
                "num_requests": report.num_requests, "num_tokens_compared": report.num_tokens_compared,
                "mismatches": report.mismatches,
                "reference": {"tokens_per_s": report.reference.tokens_per_s, "steps": report.reference.num_steps},
                "candidate": {"tokens_per_s": report.candidate.tokens_per_s, "steps": report.candidate.num_steps,
                              "spec": report.candidate.spec, "acceptance_rate": report.candidate.acceptance_rate, "tau": report.candidate.tau},
            })
        );
    } else {
        println!(
            "drafter {} (N = {n_spec}): {} requests, {} tokens compared: {}",
            drafter,
            report.num_requests,
            report.num_tokens_compared,
            if report.is_lossless() {
                "LOSSLESS (token for token)"
            } else {
                "MISMATCH"
            }
        );
        for m in &report.mismatches {
            let verdict = if m.margin <= 1e-3 {
                "near tie: numeric drift likely"
            } else {
                "clear margin: logic bug likely"
            };
            println!(
                "  request {}: first divergence at output {}: reference {:?} vs drafter {:?}; target top1 {} ({:.6}) top2 {} ({:.6}), margin {:.3e} -> {verdict}",
                m.request, m.index, m.reference_token, m.candidate_token, m.top1_token, m.top1_logit, m.top2_token, m.top2_logit, m.margin
            );
        }
        println!("reference: {}", summary_line(&report.reference));
        println!("drafter:   {}", summary_line(&report.candidate));
    }
}
