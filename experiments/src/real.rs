//! The `real` section of a manifest: the real engine's sweep.
//!
//! A real manifest names a target checkpoint directory, drafter checkpoint directories
//! (DFlash), the prompts (rows of an int32 tensor of a `.safetensors` file, or seeded
//! random tokens), sampling and the engine's knobs, and four sweep axes: drafters x
//! `num_speculative_tokens` x concurrency (vLLM `max_num_seqs`) x temperature. It expands
//! into [`RealLeg`]s in that order, with stable ids (`drafter=mtp n=3 c=4 t=1.0`); `N`
//! collapses to 0 for the `none` drafter (one leg per concurrency x temperature), and a
//! per-drafter N list (`num_speculative_tokens_for`) can replace the shared one. A cap
//! axis (`caps`) runs each DFlash leg once per cap (` cap=<name>` ends its id). The pool is
//! `num_blocks`, or planned per leg from `kv_cache_memory_bytes` (vLLM
//! `--kv-cache-memory-bytes`; `speclab_engine::exec::plan_run_pool`), never both.
//!
//! Paths in the manifest are relative to the current directory of the `speclab`
//! process (run from the repository root), not to the manifest file.
//!
//! Invariants: [`RealSpec::validate`] checks everything that can be checked without
//! running the model — the target directory and its config, each drafter's checkpoint
//! config (and N against the DFlash block), the prompt file and tensor and every prompt
//! against the target's vocabulary and `max_model_len` — and names the file and the field
//! (`real.num_speculative_tokens`, `real.prompts.tensor`, ...); nothing panics on input.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use speclab_drafters::DFlash2Config;
use speclab_engine::kv::CapPolicy;
use speclab_engine::model::checkpoint::Checkpoint;
use speclab_engine::model::ModelConfig;

use crate::{ExperimentError, Result};

/// Drafter kinds of real legs: the one drafter vocabulary, `speclab_drafters::DrafterKind`.
pub use speclab_drafters::DrafterKind as RealDrafter;

/// Seeded random prompts: `count` prompts of `len` ordinary tokens (the special ids at
/// the end of the vocabulary excluded), ChaCha8 seeded with `seed` — the same prompts as
/// `speclab verify-lossless --random-prompts count:len --seed seed`. With `min_len`,
/// prompt `i` has `min_len + i (len - min_len) / (count - 1)` tokens instead (lengths
/// spread evenly from `min_len` up to `len`, drawn from the same seeded stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GeneratedPrompts {
    pub count: usize,
    pub len: usize,
    #[serde(default)]
    pub seed: u64,
    /// The shortest prompt's length (lengths spread up to `len`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_len: Option<usize>,
}

impl GeneratedPrompts {
    /// The length of prompt `i`.
    pub fn len_of(&self, i: usize) -> usize {
        match self.min_len {
            Some(lo) if self.count > 1 && lo < self.len => {
                lo + i * (self.len - lo) / (self.count - 1)
            }
            _ => self.len,
        }
    }
}

/// Where the prompts come from: `file` (+ `tensor`, `offset`, `count`, `truncate`) or
/// `generated`, exactly one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptSource {
    /// A `.safetensors` file with an int32 tensor of shape [rows, len] (one prompt a row).
    #[serde(default)]
    pub file: Option<String>,
    /// The tensor's name.
    #[serde(default = "default_tensor")]
    pub tensor: String,
    /// First row to use.
    #[serde(default)]
    pub offset: usize,
    /// Rows to use (default: all from `offset`).
    #[serde(default)]
    pub count: Option<usize>,
    /// Keep only the first `truncate` tokens of each row.
    #[serde(default)]
    pub truncate: Option<usize>,
    /// Seeded random prompts instead of a file.
    #[serde(default)]
    pub generated: Option<GeneratedPrompts>,
}

fn default_tensor() -> String {
    "prompt_tokens".into()
}

/// The real engine's sweep (module doc).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RealSpec {
    /// Target checkpoint directory (`config.json`, `model.safetensors`).
    pub model: String,
    /// DFlash checkpoint directories by drafter kind (`dflash2`, `dflash1`); `dflash1`
    /// falls back to the `dflash2` directory (v1 is the same checkpoint, conv and selector off).
    #[serde(default)]
    pub drafter_dirs: BTreeMap<String, String>,
    /// A DFlash drafter whose checkpoint directory does not exist expands to no legs (the
    /// record notes it) instead of failing validation.
    #[serde(default)]
    pub skip_missing_drafters: bool,
    pub prompts: PromptSource,
    /// Output tokens per request (vLLM `max_tokens`).
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u64,
    /// Sweep axis 1: drafters.
    #[serde(default = "default_drafters")]
    pub drafters: Vec<RealDrafter>,
    /// Sweep axis 2: N (vLLM `num_speculative_tokens`) for every drafter but `none`.
    #[serde(default)]
    pub num_speculative_tokens: Vec<u32>,
    /// Per-drafter N lists replacing `num_speculative_tokens` (e.g. `{"dflash2": [7]}`).
    #[serde(default)]
    pub num_speculative_tokens_for: BTreeMap<String, Vec<u32>>,
    /// Sweep axis 3: concurrency (vLLM `max_num_seqs`; every prompt is queued at once).
    #[serde(default = "default_concurrency")]
    pub concurrency: Vec<usize>,
    /// Sweep axis 4: sampling temperatures in [0, 2] (0 = greedy).
    #[serde(default = "default_temperatures")]
    pub temperatures: Vec<f32>,
    /// Run seed (each request samples from an RNG seeded by (seed, request id)).
    #[serde(default)]
    pub seed: u64,
    /// Block size of the target's full-attention KV group.
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// Blocks in the pool (default: every request at its full length at once, as
    /// `speclab generate` sizes it). Exclusive with `kv_cache_memory_bytes`.
    #[serde(default)]
    pub num_blocks: Option<u32>,
    /// The pool from a byte budget instead (vLLM `--kv-cache-memory-bytes`): each leg's
    /// layout (the target's groups + the drafter's) is planned by
    /// `speclab_engine::exec::plan_run_pool` — the largest group's page per block, `num_blocks
    /// = bytes // bytes_per_block` — and the leg records the plan. Exclusive with `num_blocks`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_memory_bytes: Option<u64>,
    /// Cap below the model's `max_position_embeddings`.
    #[serde(default)]
    pub max_model_len: Option<u64>,
    /// vLLM `max_num_batched_tokens` (chunked-prefill budget per step).
    #[serde(default = "default_mnbt")]
    pub max_num_batched_tokens: u64,
    /// Keep generating past EOS (vLLM `ignore_eos`).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Record the distinct (MoE layer, expert) pairs each verify step routes to.
    #[serde(default)]
    pub collect_router: bool,
    /// Block size of the DFlash drafter's sliding-window group.
    #[serde(default = "default_block_size")]
    pub drafter_block_size: u32,
    /// Cap policy of the DFlash drafter's sliding-window group.
    #[serde(default = "default_cap")]
    pub cap: CapPolicy,
    /// A cap axis instead of `cap`: every DFlash leg runs once per listed cap (its id ends
    /// in ` cap=<name>`); legs without a DFlash drafter run once. Empty: `cap` alone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub caps: Vec<CapPolicy>,
    /// n-gram bounds (vLLM `prompt_lookup_min` / `prompt_lookup_max`).
    #[serde(default = "default_ngram")]
    pub ngram_min: usize,
    #[serde(default = "default_ngram")]
    pub ngram_max: usize,
    /// Backstop on executed engine steps per leg.
    #[serde(default = "default_max_steps")]
    pub max_steps: u64,
    /// Record requests scheduled per step and output tokens per step
    /// (`LegRecord::concurrency`, the finding's "Concurrency" table).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub record_concurrency: bool,
    /// Where the target runs: `cpu` (the reference engine, default) or `cuda` (the
    /// speclab-cuda engine; needs a GPU, libcuda and libnvrtc).
    #[serde(default, skip_serializing_if = "RealDevice::is_cpu")]
    pub device: RealDevice,
}

/// The target backend of a real manifest (`real.device`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RealDevice {
    #[default]
    Cpu,
    Cuda,
}

impl RealDevice {
    /// The default (kept out of serialized specs, so existing records stay identical).
    pub fn is_cpu(&self) -> bool {
        *self == RealDevice::Cpu
    }
}

fn default_max_tokens() -> u64 {
    64
}
fn default_drafters() -> Vec<RealDrafter> {
    vec![RealDrafter::None]
}
fn default_concurrency() -> Vec<usize> {
    vec![1]
}
fn default_temperatures() -> Vec<f32> {
    vec![0.0]
}
fn default_block_size() -> u32 {
    16
}
fn default_mnbt() -> u64 {
    2048
}
fn default_cap() -> CapPolicy {
    CapPolicy::Upstream
}
fn default_ngram() -> usize {
    5
}
fn default_max_steps() -> u64 {
    100_000
}

/// One expanded real leg.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RealLeg {
    /// Stable id, e.g. `drafter=mtp n=3 c=4 t=1.0`.
    pub id: String,
    pub drafter: RealDrafter,
    /// 0 for `none`.
    pub num_speculative_tokens: u32,
    pub concurrency: usize,
    pub temperature: f32,
    /// Cap policy of the DFlash drafter's sliding-window group in this leg.
    pub cap: CapPolicy,
}

/// A temperature as written in leg ids: `0.0`, `1.0`, `0.7`.
pub fn temp_label(t: f32) -> String {
    if t.fract() == 0.0 {
        format!("{t:.1}")
    } else {
        format!("{t}")
    }
}

/// The id of a leg.
pub fn leg_id(d: RealDrafter, n: u32, c: usize, t: f32) -> String {
    format!("drafter={} n={n} c={c} t={}", d.name(), temp_label(t))
}

fn invalid(path: &Path, field: &str, msg: impl Into<String>) -> ExperimentError {
    ExperimentError::Invalid {
        path: path.to_path_buf(),
        field: field.into(),
        msg: msg.into(),
    }
}

/// `p` with a note on where relative paths are resolved.
fn missing(p: &str, what: &str) -> String {
    let cwd = std::env::current_dir()
        .map(|d| d.display().to_string())
        .unwrap_or_else(|_| "?".into());
    format!("{p}: no such {what} (manifest paths are relative to the current directory, {cwd})")
}

impl RealSpec {
    /// The target directory.
    pub fn model_dir(&self) -> PathBuf {
        PathBuf::from(&self.model)
    }

    /// The checkpoint directory of a DFlash drafter (`dflash1` falls back to `dflash2`'s).
    pub fn drafter_dir(&self, d: RealDrafter) -> Option<PathBuf> {
        let dir = self.drafter_dirs.get(d.name()).or_else(|| match d {
            RealDrafter::Dflash1 => self.drafter_dirs.get(RealDrafter::Dflash2.name()),
            _ => None,
        });
        dir.map(PathBuf::from)
    }

    /// DFlash drafters whose directory is missing while `skip_missing_drafters` is on.
    pub fn skipped_drafters(&self) -> Vec<(RealDrafter, String)> {
        if !self.skip_missing_drafters {
            return vec![];
        }
        self.drafters
            .iter()
            .filter(|d| d.is_dflash())
            .filter_map(|&d| match self.drafter_dir(d) {
                Some(p) if p.is_dir() => None,
                Some(p) => Some((
                    d,
                    format!(
                        "{} skipped: its checkpoint directory {} does not exist",
                        d.name(),
                        p.display()
                    ),
                )),
                None => Some((d, format!("{} skipped: no drafter_dirs entry", d.name()))),
            })
            .collect()
    }

    /// N values of a drafter (`[0]` for `none`).
    pub fn ns_for(&self, d: RealDrafter) -> Vec<u32> {
        if d == RealDrafter::None {
            return vec![0];
        }
        self.num_speculative_tokens_for
            .get(d.name())
            .cloned()
            .unwrap_or_else(|| self.num_speculative_tokens.clone())
    }

    /// What a leg id adds for its cap: ` cap=<name>` for a DFlash drafter under a `caps`
    /// axis, else nothing (`speclab run` and `verify-lossless` name legs alike).
    pub fn cap_suffix(&self, d: RealDrafter, cap: CapPolicy) -> String {
        if self.caps.is_empty() || !d.is_dflash() {
            String::new()
        } else {
            format!(" cap={}", crate::manifest::cap_name(cap))
        }
    }

    /// Expand into legs: drafter x N x concurrency x temperature (skipped drafters left out).
    pub fn legs(&self) -> Vec<RealLeg> {
        let skipped: Vec<RealDrafter> = self
            .skipped_drafters()
            .into_iter()
            .map(|(d, _)| d)
            .collect();
        let mut legs = Vec::new();
        for &d in self.drafters.iter().filter(|d| !skipped.contains(d)) {
            // (cap, id suffix): the cap axis applies to DFlash drafters only.
            let caps: Vec<(CapPolicy, String)> = if self.caps.is_empty() || !d.is_dflash() {
                vec![(self.cap, String::new())]
            } else {
                self.caps
                    .iter()
                    .map(|&c| (c, self.cap_suffix(d, c)))
                    .collect()
            };
            for n in self.ns_for(d) {
                for (cap, suffix) in &caps {
                    for &c in &self.concurrency {
                        for &t in &self.temperatures {
                            legs.push(RealLeg {
                                id: format!("{}{suffix}", leg_id(d, n, c, t)),
                                drafter: d,
                                num_speculative_tokens: n,
                                concurrency: c,
                                temperature: t,
                                cap: *cap,
                            });
                        }
                    }
                }
            }
        }
        legs
    }

    /// Check the section (module doc); `path` is the manifest, named in every error.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |f: &str, m: String| invalid(path, f, m);
        let (cfg, mml) = self.check_target(path)?;
        self.check_scalars(path)?;
        self.check_kv_bytes(path, &cfg)?;
        self.check_axes(path)?;
        let skipped: Vec<RealDrafter> = self
            .skipped_drafters()
            .into_iter()
            .map(|(d, _)| d)
            .collect();
        for &d in &self.drafters {
            if d != RealDrafter::None {
                self.check_drafter(path, d, &cfg, &skipped)?;
            }
        }
        if self.legs().is_empty() {
            return Err(bad(
                "real.drafters",
                "every drafter was skipped (missing checkpoints): no leg to run".into(),
            ));
        }
        // Prompts: load them once (checks the file, tensor, shape, ids, lengths).
        let prompts = self.load_prompts(path, &cfg)?;
        for (i, p) in prompts.iter().enumerate() {
            if p.len() as u64 >= mml {
                return Err(bad(
                    "real.prompts",
                    format!("prompt {i} has {} tokens; the target's max_model_len is {mml} (prompts must be shorter; use truncate)", p.len()),
                ));
            }
        }
        Ok(())
    }

    /// The target directory and config; returns the config and the effective max_model_len.
    fn check_target(&self, path: &Path) -> Result<(ModelConfig, u64)> {
        let bad = |f: &str, m: String| invalid(path, f, m);
        let model = self.model_dir();
        if !model.is_dir() {
            return Err(bad("real.model", missing(&self.model, "directory")));
        }
        let cfg_path = model.join("config.json");
        if !cfg_path.is_file() {
            return Err(bad(
                "real.model",
                format!("{}: no config.json in the target directory", self.model),
            ));
        }
        let cfg =
            ModelConfig::from_file(&cfg_path).map_err(|e| bad("real.model", e.to_string()))?;
        let model_mml = cfg.max_position_embeddings as u64;
        if let Some(m) = self.max_model_len {
            if m == 0 || m > model_mml {
                return Err(bad(
                    "real.max_model_len",
                    format!(
                        "{m} must be in 1..={model_mml} (the target's max_position_embeddings)"
                    ),
                ));
            }
        }
        Ok((cfg, self.max_model_len.unwrap_or(model_mml)))
    }

    /// Scalar fields.
    fn check_scalars(&self, path: &Path) -> Result<()> {
        let bad = |f: &str, m: String| invalid(path, f, m);
        if self.max_tokens == 0 {
            return Err(bad("real.max_tokens", "must be >= 1".into()));
        }
        if self.block_size == 0 {
            return Err(bad("real.block_size", "must be > 0".into()));
        }
        if self.drafter_block_size == 0 {
            return Err(bad("real.drafter_block_size", "must be > 0".into()));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(bad("real.max_num_batched_tokens", "must be > 0".into()));
        }
        if self.max_steps == 0 {
            return Err(bad("real.max_steps", "must be > 0".into()));
        }
        if self.num_blocks == Some(0) {
            return Err(bad("real.num_blocks", "must be > 0".into()));
        }
        if let (Some(n), Some(b)) = (self.num_blocks, self.kv_cache_memory_bytes) {
            return Err(bad(
                "real.kv_cache_memory_bytes",
                format!("given with real.num_blocks ({n}); give one of them: num_blocks (vLLM num_gpu_blocks_override) or kv_cache_memory_bytes ({b}, vLLM --kv-cache-memory-bytes, planned into blocks)"),
            ));
        }
        if self.kv_cache_memory_bytes == Some(0) {
            return Err(bad("real.kv_cache_memory_bytes", "must be > 0".into()));
        }
        for (i, c) in self.caps.iter().enumerate() {
            if self.caps[..i].contains(c) {
                return Err(bad(
                    &format!("real.caps[{i}]"),
                    format!("`{}` is listed twice", crate::manifest::cap_name(*c)),
                ));
            }
        }
        Ok(())
    }

    /// The pool of a byte budget for the target alone (spec-off layout): at least one
    /// block, or an error naming `real.kv_cache_memory_bytes`.
    fn check_kv_bytes(&self, path: &Path, cfg: &ModelConfig) -> Result<()> {
        let Some(bytes) = self.kv_cache_memory_bytes else {
            return Ok(());
        };
        let bad = |m: String| invalid(path, "real.kv_cache_memory_bytes", m);
        let layout = cfg
            .kv_layout(self.block_size, 0, 1)
            .map_err(|e| bad(e.to_string()))?;
        speclab_engine::kv::planning::plan_pool(&layout, bytes)
            .map(|_| ())
            .map_err(|e| bad(e.to_string()))
    }

    /// The sweep axes and the per-drafter maps.
    fn check_axes(&self, path: &Path) -> Result<()> {
        let bad = |f: &str, m: String| invalid(path, f, m);
        if self.drafters.is_empty() {
            return Err(bad(
                "real.drafters",
                format!("no drafter; list some of {}", names()),
            ));
        }
        for (i, d) in self.drafters.iter().enumerate() {
            if self.drafters[..i].contains(d) {
                return Err(bad(
                    &format!("real.drafters[{i}]"),
                    format!("`{}` is listed twice", d.name()),
                ));
            }
        }
        if self.concurrency.is_empty() {
            return Err(bad(
                "real.concurrency",
                "empty; give at least one concurrency (vLLM max_num_seqs), e.g. [1]".into(),
            ));
        }
        if let Some(i) = self.concurrency.iter().position(|&c| c == 0) {
            return Err(bad(
                &format!("real.concurrency[{i}]"),
                "concurrency 0: must be >= 1 (vLLM max_num_seqs)".into(),
            ));
        }
        if self.temperatures.is_empty() {
            return Err(bad(
                "real.temperatures",
                "empty; give at least one temperature, e.g. [0.0]".into(),
            ));
        }
        for (i, &t) in self.temperatures.iter().enumerate() {
            if !t.is_finite() || !(0.0..=2.0).contains(&t) {
                return Err(bad(
                    &format!("real.temperatures[{i}]"),
                    format!("temperature {t} is out of [0, 2] (vLLM's range; 0 = greedy)"),
                ));
            }
        }
        for k in self.drafter_dirs.keys() {
            match RealDrafter::from_name(k) {
                Some(d) if d.is_dflash() => {}
                _ => return Err(bad(&format!("real.drafter_dirs.{k}"), format!("unknown drafter kind `{k}` here; only dflash2 and dflash1 take a checkpoint directory"))),
            }
        }
        for (k, ns) in &self.num_speculative_tokens_for {
            match RealDrafter::from_name(k) {
                None => {
                    return Err(bad(
                        &format!("real.num_speculative_tokens_for.{k}"),
                        format!("unknown drafter kind `{k}`; expected one of {}", names()),
                    ))
                }
                Some(RealDrafter::None) => {
                    return Err(bad(
                        &format!("real.num_speculative_tokens_for.{k}"),
                        "the `none` drafter has N = 0".into(),
                    ))
                }
                Some(d) if !self.drafters.contains(&d) => {
                    return Err(bad(
                        &format!("real.num_speculative_tokens_for.{k}"),
                        format!("`{k}` is not in real.drafters"),
                    ))
                }
                Some(_) if ns.is_empty() => {
                    return Err(bad(
                        &format!("real.num_speculative_tokens_for.{k}"),
                        "empty N list".into(),
                    ))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// One drafter's N list and, for DFlash, its checkpoint against the target.
    fn check_drafter(
        &self,
        path: &Path,
        d: RealDrafter,
        cfg: &ModelConfig,
        skipped: &[RealDrafter],
    ) -> Result<()> {
        let bad = |f: &str, m: String| invalid(path, f, m);
        let field = if self.num_speculative_tokens_for.contains_key(d.name()) {
            format!("real.num_speculative_tokens_for.{}", d.name())
        } else {
            "real.num_speculative_tokens".to_string()
        };
        let ns = self.ns_for(d);
        if ns.is_empty() {
            return Err(bad(
                &field,
                format!(
                    "drafter `{}` needs at least one N (vLLM num_speculative_tokens >= 1)",
                    d.name()
                ),
            ));
        }
        if ns.contains(&0) {
            return Err(bad(
                &field,
                format!(
                    "N = 0 with drafter `{}`: N must be >= 1 (only `none` runs with N = 0)",
                    d.name()
                ),
            ));
        }
        for (i, n) in ns.iter().enumerate() {
            if ns[..i].contains(n) {
                return Err(bad(&field, format!("N = {n} is listed twice")));
            }
        }
        if d.is_dflash() && !skipped.contains(&d) {
            let dir = self.drafter_dir(d).ok_or_else(|| {
                bad("real.drafter_dirs", format!("drafter `{}` needs its checkpoint directory, e.g. drafter_dirs: {{\"{}\": \"models/dflash2-tiny\"}}", d.name(), d.name()))
            })?;
            let key = if self.drafter_dirs.contains_key(d.name()) {
                d.name()
            } else {
                RealDrafter::Dflash2.name()
            };
            let dfield = format!("real.drafter_dirs.{key}");
            if !dir.is_dir() {
                return Err(bad(
                    &dfield,
                    format!(
                        "{} (or set skip_missing_drafters: true)",
                        missing(&dir.display().to_string(), "directory")
                    ),
                ));
            }
            let dcfg = DFlash2Config::from_file(&dir.join("config.json"))
                .map_err(|e| bad(&dfield, e.to_string()))?;
            dcfg.check_target(cfg).map_err(|e| {
                bad(
                    &dfield,
                    format!("does not fit the target {}: {e}", self.model),
                )
            })?;
            let max_n = dcfg.block_size.saturating_sub(1);
            if let Some(&n) = ns.iter().find(|&&n| n as usize > max_n) {
                return Err(bad(
                    &field,
                    format!(
                        "N = {n} exceeds what `{}` drafts per block: block_size {} allows N <= {max_n}; give `{}` its own list, e.g. num_speculative_tokens_for: {{\"{}\": [{max_n}]}}",
                        d.name(),
                        dcfg.block_size,
                        d.name(),
                        d.name()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The prompts (token ids), checked against the target's vocabulary.
    pub fn load_prompts(&self, path: &Path, cfg: &ModelConfig) -> Result<Vec<Vec<u32>>> {
        let bad = |f: &str, m: String| invalid(path, f, m);
        let p = &self.prompts;
        let mut prompts: Vec<Vec<u32>> = match (&p.file, &p.generated) {
            (Some(_), Some(_)) => return Err(bad("real.prompts", "give `file` or `generated`, not both".into())),
            (None, None) => {
                return Err(bad("real.prompts", "give `file: \"data.safetensors\"` (+ tensor, count, truncate) or `generated: (count: 4, len: 32, seed: 0)`".into()))
            }
            (None, Some(g)) => {
                if p.count.is_some() || p.offset != 0 || p.tensor != default_tensor() {
                    return Err(bad("real.prompts", "`tensor`, `offset` and `count` go with `file`; `generated` has its own count".into()));
                }
                if g.count == 0 || g.len == 0 {
                    return Err(bad("real.prompts.generated", format!("need count >= 1 and len >= 1, got count {} len {}", g.count, g.len)));
                }
                if let Some(lo) = g.min_len {
                    if lo == 0 || lo > g.len {
                        return Err(bad("real.prompts.generated.min_len", format!("{lo} must be in 1..={} (len, the longest prompt)", g.len)));
                    }
                }
                use rand::{Rng, SeedableRng};
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(g.seed);
                let hi = cfg.vocab_size.saturating_sub(speclab_engine::model::config::NUM_SPECIAL).max(1) as u32;
                (0..g.count).map(|i| (0..g.len_of(i)).map(|_| rng.random_range(0..hi)).collect()).collect()
            }
            (Some(file), None) => {
                let fp = Path::new(file);
                if !fp.is_file() {
                    return Err(bad("real.prompts.file", missing(file, "file")));
                }
                let ck = Checkpoint::open_file(fp).map_err(|e| bad("real.prompts.file", e.to_string()))?;
                let Some(shape) = ck.shape(&p.tensor).map(|s| s.to_vec()) else {
                    let names: Vec<&str> = ck.names().collect();
                    let more = names.len().saturating_sub(12);
                    let shown = names[..names.len().min(12)].join(", ");
                    let more = if more > 0 { format!(" and {more} more") } else { String::new() };
                    return Err(bad("real.prompts.tensor", format!("{file} has no tensor `{}` (it has: {shown}{more})", p.tensor)));
                };
                if shape.len() != 2 || shape[1] == 0 {
                    return Err(bad("real.prompts.tensor", format!("{file}: `{}` has shape {shape:?}; expected [prompts, tokens]", p.tensor)));
                }
                let (rows, len) = (shape[0], shape[1]);
                let count = p.count.unwrap_or(rows.saturating_sub(p.offset));
                if count == 0 || p.offset + count > rows {
                    return Err(bad(
                        "real.prompts.count",
                        format!("rows {}..{} of `{}` requested, but it has {rows} rows", p.offset, p.offset + count, p.tensor),
                    ));
                }
                let (flat, _) = ck.i32_any_shape(&p.tensor).map_err(|e| bad("real.prompts.tensor", e.to_string()))?;
                let mut out = Vec::with_capacity(count);
                for r in p.offset..p.offset + count {
                    let row = &flat[r * len..(r + 1) * len];
                    let ids: std::result::Result<Vec<u32>, _> = row.iter().map(|&t| u32::try_from(t)).collect();
                    out.push(ids.map_err(|_| bad("real.prompts.tensor", format!("{file}: `{}` row {r} has a negative token id", p.tensor)))?);
                }
                out
            }
        };
        if let Some(t) = p.truncate {
            if t == 0 {
                return Err(bad("real.prompts.truncate", "must be >= 1".into()));
            }
            for q in &mut prompts {
                q.truncate(t);
            }
        }
        for (i, q) in prompts.iter().enumerate() {
            if let Some(&t) = q.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(bad(
                    "real.prompts",
                    format!(
                        "prompt {i}: token id {t} is not below the target's vocab_size {}",
                        cfg.vocab_size
                    ),
                ));
            }
        }
        Ok(prompts)
    }
}

fn names() -> String {
    RealDrafter::ALL
        .iter()
        .map(|d| d.name())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> RealSpec {
        crate::manifest::parse_ron(
            Path::new("t.ron"),
            r#"(model: "m", prompts: (generated: (count: 2, len: 4)), drafters: [none, mtp, ngram],
                num_speculative_tokens: [1, 2], num_speculative_tokens_for: {"ngram": [3]},
                concurrency: [1, 2], temperatures: [0.0, 0.7])"#,
        )
        .unwrap()
    }

    #[test]
    fn legs_expand_in_order_with_stable_ids() {
        let s = spec();
        let ids: Vec<String> = s.legs().into_iter().map(|l| l.id).collect();
        assert_eq!(ids.len(), 2 * 2 + 2 * 2 * 2 + 2 * 2);
        assert_eq!(ids[0], "drafter=none n=0 c=1 t=0.0");
        assert_eq!(ids[1], "drafter=none n=0 c=1 t=0.7");
        assert_eq!(ids[4], "drafter=mtp n=1 c=1 t=0.0");
        assert_eq!(ids[11], "drafter=mtp n=2 c=2 t=0.7");
        assert_eq!(ids[12], "drafter=ngram n=3 c=1 t=0.0");
    }

    #[test]
    fn unknown_drafter_names_the_field() {
        let e = crate::manifest::parse_ron::<RealSpec>(
            Path::new("t.ron"),
            "(model: \"m\", prompts: (), drafters: [none, eagle])",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("t.ron:1:") && e.contains("drafters[1]") && e.contains("eagle"),
            "{e}"
        );
    }

    #[test]
    fn shipped_real_manifests_parse_and_expand() {
        use crate::manifest::Manifest;
        let m: Manifest = crate::manifest::parse_ron(
            Path::new("acceptance-tiny.ron"),
            include_str!("../acceptance-tiny.ron"),
        )
        .unwrap();
        let r = m.real.as_ref().unwrap();
        // Expansion without skipping (skip_missing_drafters only drops legs whose checkpoint is absent).
        let all = RealSpec {
            skip_missing_drafters: false,
            ..r.clone()
        }
        .legs();
        let ids: Vec<&str> = all.iter().map(|l| l.id.as_str()).collect();
        assert_eq!(ids.len(), 2 + 7 * 2 + 2 + 2);
        assert_eq!(ids[2], "drafter=mtp n=1 c=1 t=0.0");
        assert_eq!(ids[17], "drafter=dflash2 n=7 c=1 t=1.0");
        assert_eq!(ids[19], "drafter=dflash1 n=7 c=1 t=1.0");
        assert_eq!(
            r.drafter_dir(RealDrafter::Dflash1),
            Some(PathBuf::from("models/dflash2-tiny"))
        );
        let q: Manifest = crate::manifest::parse_ron(
            Path::new("quality-spot.ron"),
            include_str!("../quality-spot.ron"),
        )
        .unwrap();
        let q = q.real.unwrap();
        assert_eq!((q.prompts.offset, q.prompts.count), (16, Some(24)));
        let ids: Vec<String> = RealSpec {
            skip_missing_drafters: false,
            ..q
        }
        .legs()
        .into_iter()
        .map(|l| l.id)
        .collect();
        assert_eq!(
            ids,
            [
                "drafter=none n=0 c=1 t=0.0",
                "drafter=mtp n=2 c=1 t=0.0",
                "drafter=dflash2 n=7 c=1 t=0.0"
            ]
        );
    }

    #[test]
    fn six_manifests_expand_a_cap_axis_and_spread_prompt_lengths() {
        use crate::manifest::Manifest;
        for (name, text) in [
            ("df2w-real-six.ron", include_str!("../df2w-real-six.ron")),
            (
                "df2w-real-six-cuda.ron",
                include_str!("../df2w-real-six-cuda.ron"),
            ),
        ] {
            let m: Manifest = crate::manifest::parse_ron(Path::new(name), text).unwrap();
            let r = m.real.unwrap();
            assert_eq!(
                (r.num_blocks, r.kv_cache_memory_bytes),
                (None, Some(180_000_000))
            );
            let legs = r.legs();
            let ids: Vec<&str> = legs.iter().map(|l| l.id.as_str()).collect();
            assert_eq!(
                ids,
                [
                    "drafter=none n=0 c=6 t=0.0",
                    "drafter=dflash2 n=7 c=6 t=0.0 cap=none",
                    "drafter=dflash2 n=7 c=6 t=0.0 cap=window_plus_two"
                ]
            );
            assert_eq!(legs[1].cap, CapPolicy::None);
            assert_eq!(legs[2].cap, CapPolicy::WindowPlusTwo);
            // verify-lossless checks each cap of the axis (its ids as the run's).
            let checks = crate::real_run::lossless_legs(&r);
            let caps: Vec<(CapPolicy, &str)> = checks
                .iter()
                .map(|l| (l.cap, l.id_suffix.as_str()))
                .collect();
            assert_eq!(
                caps,
                [
                    (CapPolicy::None, " cap=none"),
                    (CapPolicy::WindowPlusTwo, " cap=window_plus_two")
                ]
            );
            let g = r.prompts.generated.unwrap();
            let lens: Vec<usize> = (0..g.count).map(|i| g.len_of(i)).collect();
            assert_eq!(lens, [2048, 2438, 2828, 3219, 3609, 4000]);
            // Both fields together, and a repeated cap, name the file and the field.
            let both = RealSpec {
                num_blocks: Some(64),
                ..r.clone()
            };
            let e = both.check_scalars(Path::new(name)).unwrap_err().to_string();
            assert!(
                e.contains(name) && e.contains("real.kv_cache_memory_bytes"),
                "{e}"
            );
            let twice = RealSpec {
                caps: vec![CapPolicy::None, CapPolicy::None],
                ..r
            };
            let e = twice
                .check_scalars(Path::new(name))
                .unwrap_err()
                .to_string();
            assert!(e.contains("real.caps[1]"), "{e}");
        }
        // Without min_len every prompt has `len` tokens (old manifests unchanged).
        let g = GeneratedPrompts {
            count: 3,
            len: 9,
            seed: 0,
            min_len: None,
        };
        assert_eq!((0..3).map(|i| g.len_of(i)).collect::<Vec<_>>(), [9, 9, 9]);
    }

    #[test]
    fn temperature_labels() {
        assert_eq!(temp_label(0.0), "0.0");
        assert_eq!(temp_label(1.0), "1.0");
        assert_eq!(temp_label(0.7), "0.7");
    }
}
