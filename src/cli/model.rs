//! `speclab init-model` and `speclab quantize`.
//!
//! `init-model` writes a random-weight checkpoint of a preset (docs/model.md
//! §10) in the real on-disk format (bf16, or W4A16 routed experts with
//! `--w4a16`), for tests and benchmarks. `quantize` turns a bf16 checkpoint
//! into a W4A16 compressed-tensors `pack-quantized` one with sequential
//! per-layer GPTQ (or RTN) on calibration tokens (`speclab_quant::pipeline`),
//! and prints / writes the per-matrix GPTQ-vs-RTN error report.
//! Invariant: `--json` prints only JSON on stdout.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use speclab_engine::model::{Checkpoint, ModelConfig, ModelWeights};
use speclab_quant::pipeline::{quantize_model, Method, QuantizeJob};
use speclab_quant::GptqConfig;

#[derive(Debug, Args)]
pub struct InitModelArgs {
    /// Preset: micro, tiny, glm53-flash.
    #[arg(long)]
    pub preset: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Quantize the routed experts (RTN) and write a W4A16 checkpoint.
    #[arg(long)]
    pub w4a16: bool,
    /// Shard tensor files above this many MiB.
    #[arg(long)]
    pub max_shard_mib: Option<usize>,
    /// Replace a checkpoint already in --out.
    #[arg(long)]
    pub force: bool,
    #[arg(long)]
    pub json: bool,
}

/// Refuse to write a checkpoint over an existing one without `--force`.
fn check_out_dir(out: &Path, force: bool) -> anyhow::Result<()> {
    if out.is_file() {
        bail!(
            "{}: --out must be a directory, and this is a file",
            out.display()
        );
    }
    let has_checkpoint = out.join("config.json").exists()
        || std::fs::read_dir(out).is_ok_and(|d| {
            d.filter_map(Result::ok)
                .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        });
    if has_checkpoint && !force {
        bail!(
            "{}: already holds a checkpoint (config.json / *.safetensors); refusing to replace it without --force",
            out.display()
        );
    }
    Ok(())
}

/// Whether two paths name the same existing directory.
fn same_dir(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum MethodArg {
    Gptq,
    Rtn,
}

#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// bf16 checkpoint directory.
    pub model: PathBuf,
    /// Output directory for the W4A16 checkpoint.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, value_enum, default_value = "gptq")]
    pub method: MethodArg,
    /// Calibration tokens: a .safetensors file (int32 [n, len], tensor --calib-tensor)
    /// or a .json list of token-id lists.
    #[arg(long)]
    pub calib: Option<PathBuf>,
    #[arg(long, default_value = "calib_tokens")]
    pub calib_tensor: String,
    /// Use only the first N calibration sequences.
    #[arg(long)]
    pub calib_limit: Option<usize>,
    /// Random calibration tokens instead of a file: N:LEN (tests only).
    #[arg(long)]
    pub calib_random: Option<String>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// GPTQ dampening (fraction of the mean Hessian diagonal).
    #[arg(long, default_value_t = 0.01)]
    pub dampening: f64,
    /// GPTQ: compute group scales from the original weights up front (llm-compressor).
    #[arg(long)]
    pub static_groups: bool,
    /// Shard tensor files above this many MiB.
    #[arg(long)]
    pub max_shard_mib: Option<usize>,
    /// Write the per-matrix report (JSON) here too.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Replace a checkpoint already in --out (never the source itself).
    #[arg(long)]
    pub force: bool,
    #[arg(long)]
    pub json: bool,
}

/// `speclab init-model`.
pub fn init_model(a: InitModelArgs) -> anyhow::Result<ExitCode> {
    let cfg = ModelConfig::preset(&a.preset)?;
    if cfg.num_parameters() > 2_000_000_000 {
        bail!("preset {} has {} parameters: random weights that large are for memory planning only, not written", a.preset, cfg.num_parameters());
    }
    let cfg = if a.w4a16 {
        cfg.with_quantization()
    } else {
        cfg
    };
    check_out_dir(&a.out, a.force)?;
    let w = ModelWeights::random(&cfg, a.seed, a.w4a16)?;
    let files = w.save_sharded(&a.out, a.max_shard_mib.map(|m| m << 20))?;
    if a.json {
        outln!(
            "{}",
            serde_json::json!({"out": a.out, "preset": a.preset, "seed": a.seed, "w4a16": a.w4a16, "files": files, "parameters": cfg.num_parameters()})
        );
    } else {
        outln!(
            "wrote {} ({} parameters, {}) to {}",
            a.preset,
            cfg.num_parameters(),
            if a.w4a16 { "W4A16 experts" } else { "bf16" },
            a.out.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn load_calib(a: &QuantizeArgs, vocab: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    let mut seqs: Vec<Vec<u32>> = match (&a.calib, &a.calib_random) {
        (Some(_), Some(_)) => bail!("give --calib or --calib-random, not both"),
        (None, None) => match a.method {
            MethodArg::Gptq => bail!(
                "GPTQ needs calibration tokens: --calib FILE (or --calib-random N:LEN for tests)"
            ),
            MethodArg::Rtn => vec![],
        },
        (None, Some(spec)) => {
            let (n, len) = spec
                .split_once(':')
                .and_then(|(n, l)| Some((n.parse::<usize>().ok()?, l.parse::<usize>().ok()?)))
                .with_context(|| format!("--calib-random {spec:?}: expected N:LEN, e.g. 16:256"))?;
            use rand::{Rng, SeedableRng};
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(a.seed);
            (0..n)
                .map(|_| {
                    (0..len)
                        .map(|_| rng.random_range(0..vocab as u32))
                        .collect()
                })
                .collect()
        }
        (Some(p), None) => read_calib_file(p, &a.calib_tensor)?,
    };
    if let Some(l) = a.calib_limit {
        seqs.truncate(l);
    }
    Ok(seqs)
}

fn read_calib_file(p: &Path, tensor: &str) -> anyhow::Result<Vec<Vec<u32>>> {
    match p.extension().and_then(|e| e.to_str()) {
        Some("json") => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let v: Vec<Vec<u32>> = serde_json::from_str(&text).map_err(|e| {
                anyhow::anyhow!(
                    "{}:{}:{}: expected a JSON list of token-id lists: {e}",
                    p.display(),
                    e.line(),
                    e.column()
                )
            })?;
            Ok(v)
        }
        Some("safetensors") => {
            let ck = Checkpoint::open_file(p)?;
            let names: Vec<&str> = ck.names().collect();
            let shape = ck.shape(tensor).with_context(|| {
                format!("{}: no tensor {tensor:?} (names: {names:?})", p.display())
            })?;
            if shape.len() != 2 {
                bail!(
                    "{}: tensor {tensor:?} has shape {shape:?}, expected [n, len]",
                    p.display()
                );
            }
            let (flat, _) = ck.i32_any_shape(tensor)?;
            let len = shape[1];
            flat.chunks(len.max(1))
                .map(|row| {
                    row.iter()
                        .map(|&t| {
                            u32::try_from(t).map_err(|_| {
                                anyhow::anyhow!("{}: {tensor}: negative token id {t}", p.display())
                            })
                        })
                        .collect()
                })
                .collect()
        }
        _ => bail!(
            "{}: calibration file must be .safetensors or .json",
            p.display()
        ),
    }
}

/// `speclab quantize`.
pub fn quantize(a: QuantizeArgs) -> anyhow::Result<ExitCode> {
    if same_dir(&a.model, &a.out) {
        bail!(
            "{}: --out is the source checkpoint itself; quantizing in place would replace the bf16 weights it reads (give another --out)",
            a.out.display()
        );
    }
    check_out_dir(&a.out, a.force)?;
    let cfg = ModelConfig::from_file(&a.model.join("config.json"))?;
    let calib = load_calib(&a, cfg.vocab_size)?;
    let method = match a.method {
        MethodArg::Gptq => Method::Gptq(GptqConfig {
            dampening: a.dampening,
            static_groups: a.static_groups,
            ..GptqConfig::default()
        }),
        MethodArg::Rtn => Method::Rtn,
    };
    let job = QuantizeJob {
        model_dir: &a.model,
        out_dir: &a.out,
        calib: &calib,
        method,
        max_shard_bytes: a.max_shard_mib.map(|m| m << 20),
    };
    let quiet = a.json;
    let report = quantize_model(&job, &mut |line| {
        if !quiet {
            eprintln!("{line}");
        }
    })?;
    if let Some(p) = &a.report {
        speclab_experiments::record::write_atomic(p, &serde_json::to_vec_pretty(&report)?)?;
    }
    if a.json {
        outln!("{}", serde_json::to_string(&report)?);
    } else {
        outln!(
            "{} on {} calibration sequences ({} tokens) -> {}",
            report.method,
            report.calib_sequences,
            report.calib_tokens,
            a.out.display()
        );
        outln!(
            "{:<46} {:>10} {:>12} {:>12} {:>7}",
            "matrix",
            "rows",
            "proxy loss",
            "RTN proxy",
            "ratio"
        );
        for m in &report.matrices {
            outln!(
                "{:<46} {:>10} {:>12.4e} {:>12.4e} {:>7.3}",
                m.module,
                m.calib_rows,
                m.proxy_loss,
                m.rtn_proxy_loss,
                m.proxy_loss / m.rtn_proxy_loss
            );
        }
        outln!(
            "total proxy loss vs RTN: {:.3}",
            report.total_proxy_ratio_vs_rtn
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Args)]
pub struct EvalPplArgs {
    /// Checkpoint directories to evaluate (bf16 or W4A16), side by side.
    #[arg(required = true)]
    pub models: Vec<PathBuf>,
    /// Token file: .safetensors (int32 [n, len], tensor --tensor) or .json lists.
    #[arg(long)]
    pub data: PathBuf,
    #[arg(long, default_value = "eval_tokens")]
    pub tensor: String,
    /// Use only the first N sequences.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Where the model runs: the CPU reference or the CUDA engine.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: super::generate::DeviceArg,
    #[arg(long)]
    pub json: bool,
}

/// Mean next-token cross-entropy (nats) of a model over sequences (teacher forcing, f32),
/// with the target on `backend` (the CPU reference or the CUDA engine).
pub fn eval_ce(
    weights: &ModelWeights,
    seqs: &[Vec<u32>],
    backend: &dyn speclab_engine::backend::BackendFactory,
) -> anyhow::Result<(f64, u64, f64)> {
    use speclab_engine::kv::{AllocOutcome, KvCacheManager};
    use speclab_engine::model::{ForwardOptions, SeqChunk};
    use speclab_engine::ReqSlot;
    let cfg = &weights.cfg;
    let longest = seqs.iter().map(Vec::len).max().unwrap_or(1) as u32;
    let mut kv = KvCacheManager::from_layout(&cfg.kv_layout(16, 0, longest.div_ceil(16) + 8)?)?;
    let mut runner = backend.build(weights, &kv)?;
    let v = cfg.vocab_size;
    let (mut nll, mut n, mut correct) = (0f64, 0u64, 0u64);
    for (i, s) in seqs.iter().enumerate() {
        if s.len() < 2 {
            continue;
        }
        if let Some(&bad) = s.iter().find(|&&t| t as usize >= v) {
            bail!("sequence {i}: token id {bad} >= vocab_size {v}");
        }
        let len = s.len() as u64;
        let slot = ReqSlot(0);
        match kv.allocate_whole(slot, len)? {
            AllocOutcome::Allocated(_) => {}
            AllocOutcome::NoFit => bail!("sequence {i} does not fit the KV pool"),
        }
        let out = runner.forward(
            &kv,
            &[SeqChunk {
                slot,
                tokens: s,
                start_pos: 0,
                snapshot: false,
            }],
            &ForwardOptions::default(),
        )?;
        for t in 0..s.len() - 1 {
            let row = &out.logits[t * v..(t + 1) * v];
            if let Some(x) = row.iter().find(|x| !x.is_finite()) {
                bail!("sequence {i}, position {t}: non-finite logit {x}: the checkpoint's weights give NaN or inf (check them for non-finite values)");
            }
            let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let lse = m + row
                .iter()
                .map(|&x| ((x as f64) - m).exp())
                .sum::<f64>()
                .ln();
            let target = s[t + 1] as usize;
            nll += lse - row[target] as f64;
            let arg = row
                .iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |(bi, bv), (j, &x)| {
                    if x > bv {
                        (j, x)
                    } else {
                        (bi, bv)
                    }
                })
                .0;
            correct += u64::from(arg == target);
            n += 1;
        }
        kv.free(slot);
        runner.release(slot);
    }
    if n == 0 {
        bail!("no sequence of at least 2 tokens to evaluate");
    }
    Ok((nll / n as f64, n, correct as f64 / n as f64))
}

/// `speclab eval-ppl`: held-out loss / perplexity of several checkpoints side by side.
pub fn eval_ppl(a: EvalPplArgs) -> anyhow::Result<ExitCode> {
    let mut seqs = read_calib_file(&a.data, &a.tensor)?;
    if let Some(l) = a.limit {
        seqs.truncate(l);
    }
    let mut rows = Vec::new();
    for m in &a.models {
        let w = ModelWeights::load(m).with_context(|| format!("loading {}", m.display()))?;
        let t0 = std::time::Instant::now();
        let cuda = speclab_cuda::CudaFactory::default();
        let backend: &dyn speclab_engine::backend::BackendFactory = match a.device {
            super::generate::DeviceArg::Cpu => &speclab_engine::backend::CpuBackend,
            super::generate::DeviceArg::Cuda => &cuda,
        };
        let (ce, n, top1) =
            eval_ce(&w, &seqs, backend).with_context(|| format!("evaluating {}", m.display()))?;
        if !ce.is_finite() {
            bail!(
                "{}: cross-entropy is {ce}: the checkpoint's weights give non-finite logits (NaN or inf weights?)",
                m.display()
            );
        }
        let row = serde_json::json!({
            "model": m, "quantized": w.cfg.quantization_config.is_some(), "ce_nats": ce, "ppl": ce.exp(),
            "top1": top1, "positions": n, "seconds": t0.elapsed().as_secs_f64(),
            "device": format!("{:?}", a.device).to_lowercase(),
        });
        if !a.json {
            outln!(
                "{:<40} ce {:.4} nats  ppl {:.3}  top1 {:.4}  ({} positions, {:.1} s)",
                m.display(),
                ce,
                ce.exp(),
                top1,
                n,
                t0.elapsed().as_secs_f64()
            );
        }
        rows.push(row);
    }
    if a.json {
        outln!("{}", serde_json::to_string(&rows)?);
    }
    Ok(ExitCode::SUCCESS)
}
