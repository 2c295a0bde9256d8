//! RON experiment manifests and their expansion into legs.
//!
//! A manifest names a KV layout (a preset with a stated memory model, or an
//! explicit layout), a scheduler, a drafter, an acceptance model, a workload,
//! and sweep axes (block sizes, cap policies, pools, prompt lengths). Sweeps
//! are expanded in a fixed order (block size, cap, pool, then workload) into
//! [`Leg`]s, each a self-contained simulation input with a stable id, so a
//! record can be resumed leg by leg. Field names follow vLLM's flags
//! (`max_num_seqs`, `max_num_batched_tokens`, `num_speculative_tokens`,
//! `num_gpu_blocks_override` -> `num_blocks`).
//!
//! Invariants: `Manifest::load` either returns a manifest whose every leg
//! builds a valid `KvLayout`, or an error naming the file, `line:col` and the
//! field; nothing here panics on user input.

use std::path::Path;

use serde::{Deserialize, Serialize};
use speclab_engine::kv::hybrid::{KvDtype, PlanAssumptions};
use speclab_engine::kv::layout::GroupMemory;
use speclab_engine::kv::{CapPolicy, GroupKind, GroupSpec, KvLayout};

use crate::plan::{Calibration, LegPlan, Variant};
use crate::{ExperimentError, Result};

/// A whole experiment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Short name; the default record is `runs/<name>.json`.
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// The assumptions behind the model (rendered into findings verbatim).
    #[serde(default)]
    pub assumptions: Vec<String>,
    /// KV layout of simulated legs (not used with `real`).
    #[serde(default)]
    pub kv: KvSpec,
    /// Scheduler of simulated legs (not used with `real`, which sets its own).
    #[serde(default)]
    pub scheduler: SchedulerSpec,
    #[serde(default)]
    pub drafter: DrafterSpec,
    /// Per-position acceptance rates (vLLM's unconditional definition).
    #[serde(default)]
    pub acceptance: Vec<f64>,
    /// The rates from a profile instead ([`crate::manifest_cost::AcceptanceProfile`]:
    /// stated, geometric from a draft acceptance rate, or a leg of a real record).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acceptance_profile: Option<crate::manifest_cost::AcceptanceProfile>,
    /// Step-cost model of simulated legs (hardware profile, target and drafter shapes,
    /// routing; [`speclab_engine::cost`]): legs then record simulated time and tok/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<speclab_engine::cost::CostModel>,
    #[serde(default)]
    pub workload: Workload,
    #[serde(default)]
    pub sweep: Sweep,
    #[serde(default)]
    pub measure: Measure,
    /// Reference numbers to compare against (rendered as matched / not matched).
    #[serde(default)]
    pub expectations: Vec<Expectation>,
    /// Discussion paragraphs rendered into the finding after the tables.
    #[serde(default)]
    pub discussion: Vec<String>,
    #[serde(default)]
    pub seed: u64,
    /// Backstop on simulated steps per leg.
    #[serde(default = "default_max_steps")]
    pub max_steps: u64,
    /// The real engine: target checkpoint, drafters, prompts, sampling, concurrency
    /// ([`crate::real`]). With it, the legs are real runs (drafter x N x concurrency x
    /// temperature) and the simulated sections must be left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub real: Option<crate::real::RealSpec>,
    /// Hazard-atlas entry: `speclab findings` lists every record carrying one in
    /// `findings/atlas.md` ([`crate::atlas`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hazard: Option<crate::atlas::Hazard>,
}

fn default_max_steps() -> u64 {
    1_000_000
}

/// Where the KV layout comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvSpec {
    /// A named preset (`glm53-flash-dflash2`), or None with `layout` given.
    #[serde(default)]
    pub preset: Option<String>,
    /// An explicit layout (groups and pool), used when `preset` is None.
    #[serde(default)]
    pub layout: Option<KvLayout>,
    /// Serving block size (vLLM `--block-size`) for the preset's attention groups.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Cap policy of the sliding-window groups.
    #[serde(default)]
    pub cap: CapPolicy,
    /// Pool size including the null block (vLLM `num_gpu_blocks_override`).
    #[serde(default)]
    pub num_blocks: Option<u32>,
    /// KV memory in bytes, with `memory` page sizes, when `num_blocks` is not given.
    #[serde(default)]
    pub kv_cache_memory_bytes: Option<u64>,
    /// Per-token / per-state byte model of the preset (for pool sizing from bytes).
    #[serde(default)]
    pub memory: Option<PresetMemory>,
    #[serde(default = "default_mml")]
    pub max_model_len: u32,
    #[serde(default)]
    pub watermark: f64,
    /// Plan the pool the way vLLM 0.33.0 does from GLM-5.3-Flash's architecture under
    /// these assumptions ([`crate::plan`]); the preset's layout, page sizes and pool
    /// then come from the plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<PlanAssumptions>,
    /// With `plan`: the KV memory that gives this pool at this block size (per set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibrate: Option<Calibration>,
    /// vLLM `max_in_flight_tokens` = max_concurrent_batches x max_num_batched_tokens
    /// (async scheduling, vLLM 0.33.0's default for DFlash, doubles it). It sizes the
    /// `upstream` sliding-window cap and the startup check. Default: one batch,
    /// `scheduler.max_num_batched_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight_tokens: Option<u32>,
}

fn default_mml() -> u32 {
    262_144
}

impl Default for KvSpec {
    fn default() -> Self {
        Self {
            preset: None,
            layout: None,
            block_size: None,
            cap: CapPolicy::default(),
            num_blocks: None,
            kv_cache_memory_bytes: None,
            memory: None,
            max_model_len: default_mml(),
            watermark: 0.0,
            plan: None,
            calibrate: None,
            max_in_flight_tokens: None,
        }
    }
}

/// The byte model of the GLM-5.3-Flash + DFlash2 preset: per-layer page sizes
/// derived from the architecture (assumptions stated in the manifest).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PresetMemory {
    /// Full-attention (DSA/MLA) layers in the target's full-attention group.
    pub full_layers: u32,
    /// KV bytes per token per full-attention layer.
    pub full_bytes_per_token: u64,
    /// Layers in the indexer ring-buffer group.
    pub ring_layers: u32,
    /// Ring-buffer bytes per token per layer (indexer keys).
    pub ring_bytes_per_token: u64,
    /// Layers per recurrent-state group (the preset has 4 such groups).
    pub state_layers_per_group: u32,
    /// Bytes of one recurrent state (one layer, one request).
    pub state_bytes: u64,
    /// Drafter sliding-window layers.
    pub drafter_layers: u32,
    /// Drafter KV bytes per token per layer.
    pub drafter_bytes_per_token: u64,
}

/// A reference number for one leg (e.g. the model card's measured bound).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expectation {
    /// Leg id, exactly as expanded (e.g. `bs=1024 cap=none`).
    pub leg: String,
    /// Where the number comes from (e.g. "model card, Research-stack known issue").
    pub source: String,
    /// The reference says: the bound is about this many tokens...
    #[serde(default)]
    pub bound_about: Option<u64>,
    /// ...within this many tokens (default 2% of `bound_about`).
    #[serde(default)]
    pub tolerance: Option<u64>,
    /// The reference says: no wedge across this prompt range [lo, hi].
    #[serde(default)]
    pub no_wedge_in: Option<(u64, u64)>,
    /// The reference says: the leg ends with this status (e.g. "WEDGED", "COMPLETED").
    #[serde(default)]
    pub status: Option<String>,
    /// The reference says: no request ever holds more than this many blocks of this group.
    #[serde(default)]
    pub peak_at_most: Option<(String, u64)>,
    /// The reference says: vLLM logs "Maximum concurrency ... Cx" with C this, to 2 decimals
    /// (needs `kv.plan`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency_about: Option<f64>,
    /// The reference says: "GPU KV cache size: N tokens", within `tolerance` (needs `kv.plan`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_tokens_about: Option<u64>,
    /// The reference says: simulated output tok/s is `about` x the baseline leg's (needs `cost`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speedup: Option<crate::manifest_cost::SpeedupExpectation>,
    /// The reference says: vLLM starts with this config (true) or refuses it (false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starts: Option<bool>,
    /// The reference says: at most this many requests are scheduled in one step, and some
    /// step schedules this many (needs `measure.concurrency`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_running: Option<u64>,
    /// The reference says: this many requests of the (real, greedy) leg give the spec-off
    /// leg's output, token for token (the record's output digests; real manifests).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outputs_equal_control: Option<u64>,
}

/// Scheduler settings (vLLM names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerSpec {
    /// `fcfs` (vLLM-faithful) or `reject_impossible`.
    #[serde(default)]
    pub policy: PolicyName,
    #[serde(default = "default_max_num_seqs")]
    pub max_num_seqs: usize,
    #[serde(default = "default_mnbt")]
    pub max_num_batched_tokens: u32,
    /// FULL decode CUDA graphs (vLLM's default FULL_AND_PIECEWISE for models with Mamba /
    /// KDA state; false = `--enforce-eager`). With state groups vLLM then refuses to start
    /// when max_num_seqs exceeds the pool's num_blocks (`CompilationConfig`,
    /// vllm/config/compilation.py: "max_num_seqs (N) exceeds available Mamba cache blocks").
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub full_cudagraphs: bool,
}

impl Default for SchedulerSpec {
    fn default() -> Self {
        Self {
            full_cudagraphs: false,
            policy: PolicyName::default(),
            max_num_seqs: default_max_num_seqs(),
            max_num_batched_tokens: default_mnbt(),
        }
    }
}

fn default_max_num_seqs() -> usize {
    256
}
fn default_mnbt() -> u32 {
    8192
}

/// Scheduling policy names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PolicyName {
    #[default]
    Fcfs,
    RejectImpossible,
}

/// Drafter kinds known to manifests: the one drafter vocabulary.
pub use speclab_drafters::DrafterKind;

/// Drafter settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct DrafterSpec {
    #[serde(default)]
    pub kind: DrafterKind,
    #[serde(default)]
    pub num_speculative_tokens: u32,
    /// DFlash2 block size (tokens drafted per pass).
    #[serde(default)]
    pub block_size: Option<u32>,
    /// DFlash2 sliding window.
    #[serde(default)]
    pub sliding_window: Option<u32>,
}

impl DrafterSpec {
    /// KV lookahead slots per step, as vLLM `VllmConfig.num_lookahead_tokens`:
    /// N + 1 for DFlash (bonus query + one per draft), N for MTP/EAGLE, 0 otherwise.
    pub fn lookahead(&self) -> u64 {
        self.kind.lookahead(self.num_speculative_tokens as usize) as u64
    }
    /// Drafts per decode step.
    pub fn drafts_per_step(&self) -> u64 {
        self.kind
            .drafts_per_step(self.num_speculative_tokens as usize) as u64
    }
}

/// The requests of a leg.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// Prompt lengths. With `each_prompt_alone` every length is its own leg.
    #[serde(default)]
    pub prompts: Vec<u64>,
    /// Generated prompts (appended to `prompts`).
    #[serde(default)]
    pub generate: Option<Generator>,
    /// Output tokens per request.
    #[serde(default = "default_output_len")]
    pub output_len: u64,
    /// True: one leg per prompt (the card's single-prompt legs). False: all
    /// prompts arrive together in one leg.
    #[serde(default = "yes")]
    pub each_prompt_alone: bool,
    /// With `each_prompt_alone: false`: a leg runs this many requests per sequence slot
    /// (`requests_per_seq x max_num_seqs` requests, the prompts repeated in order), so
    /// a concurrency sweep keeps every slot busy (a serving benchmark at concurrency c).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_seq: Option<u32>,
}

impl Default for Workload {
    fn default() -> Self {
        Self {
            prompts: vec![],
            generate: None,
            output_len: default_output_len(),
            each_prompt_alone: true,
            requests_per_seq: None,
        }
    }
}

fn default_output_len() -> u64 {
    256
}
fn yes() -> bool {
    true
}

/// A prompt-length generator: `count` lengths uniform in [min, max], seeded.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Generator {
    pub count: u32,
    pub min: u64,
    pub max: u64,
}

/// Sweep axes; an empty axis means "the base value only".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Sweep {
    #[serde(default)]
    pub block_sizes: Vec<u32>,
    #[serde(default)]
    pub caps: Vec<CapPolicy>,
    #[serde(default)]
    pub num_blocks: Vec<u32>,
    /// `max_in_flight_tokens` values (ids gain `inflight=N`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub max_in_flight_tokens: Vec<u32>,
    /// Plan axes (need `kv.plan`): tensor parallel sizes, KV dtypes, drafter block sizes
    /// (`None` = vLLM's rule), indexer kernel alignment on/off.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tps: Vec<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv_dtypes: Vec<KvDtype>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drafter_block_sizes: Vec<Option<u32>>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub indexer_block_alignment: Vec<bool>,
    /// `scheduler.max_num_seqs` values (ids gain `seqs=N`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub max_num_seqs: Vec<usize>,
    /// `drafter.num_speculative_tokens` values (ids gain `n=N`). Each leg's N sets the
    /// lookahead, the drafts per step, the state groups' speculative blocks (vLLM
    /// `MambaSpec.num_speculative_blocks = num_speculative_tokens`, also in explicit
    /// layouts) and, with `kv.plan`, the planned pages; N = 0 runs the leg without
    /// speculation (drafter `none`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub num_speculative_tokens: Vec<u32>,
}

/// What to measure per leg.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measure {
    /// Simulate the workload to completion (or WEDGED).
    #[serde(default = "yes")]
    pub simulate: bool,
    /// Bisect the largest admissible prompt (exact to the token).
    #[serde(default)]
    pub bound: bool,
    /// Bisect the bound even when vLLM's startup check refuses the config (status stays
    /// REFUSED_AT_STARTUP): what admission would do if the check were skipped.
    #[serde(default)]
    pub bound_if_refused: bool,
    /// Record per-step concurrency (requests scheduled per step: peak and mean) and
    /// output tokens per step (`LegRecord::concurrency`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub concurrency: bool,
}

impl Default for Measure {
    fn default() -> Self {
        Self {
            simulate: true,
            bound: false,
            bound_if_refused: false,
            concurrency: false,
        }
    }
}

/// One expanded leg.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Leg {
    /// Stable id, e.g. `bs=2304 cap=none prompt=15523`.
    pub id: String,
    pub block_size: Option<u32>,
    pub cap: CapPolicy,
    /// The layout this leg runs on (pool resolved).
    pub layout: KvLayout,
    pub num_blocks: u32,
    /// Prompt lengths of the leg's requests.
    pub prompts: Vec<u64>,
    /// The vLLM pool plan of the leg (manifests with `kv.plan`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<LegPlan>,
    /// `max_num_seqs` of this leg when swept (else `scheduler.max_num_seqs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_num_seqs: Option<usize>,
    /// `num_speculative_tokens` of this leg when swept (else `drafter.num_speculative_tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_speculative_tokens: Option<u32>,
}

/// The preset's name.
pub const PRESET_GLM53_DFLASH2: &str = "glm53-flash-dflash2";
/// GLM-5.3-Flash with its MTP head (`speclab_engine::kv::hybrid::PlanDrafter::Mtp`): a
/// plan-only preset, its layout always comes from `kv.plan`.
pub const PRESET_GLM53_MTP: &str = "glm53-flash-mtp";

/// Parse RON with positions and the field path: `path:line:col: field `a.b[2]`: message`.
/// `Option` fields may be written bare (RON's `implicit_some`): `truncate: 128` and
/// `truncate: Some(128)` both work.
/// A UTF-8 byte-order mark at the start is accepted (skipped).
pub fn parse_ron<T: for<'de> Deserialize<'de>>(path: &Path, text: &str) -> Result<T> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let opts =
        ron::Options::default().with_default_extension(ron::extensions::Extensions::IMPLICIT_SOME);
    let err = |e: ron::error::SpannedError, field: Option<String>| ExperimentError::Parse {
        path: path.to_path_buf(),
        at: format!("{}:{}", e.position.line, e.position.col),
        msg: match field {
            Some(f) => format!("field `{f}`: {}", e.code),
            None => e.code.to_string(),
        },
    };
    let mut de = ron::Deserializer::from_str_with_options(text, &opts).map_err(|e| err(e, None))?;
    let v: T = match serde_path_to_error::deserialize(&mut de) {
        Ok(v) => v,
        Err(e) => {
            let field = field_path(e.path());
            let spanned = de.span_error(e.into_inner());
            return Err(err(spanned, field));
        }
    };
    de.end().map_err(|code| err(de.span_error(code), None))?;
    Ok(v)
}

/// The field path of a deserialization error (`real.drafters[2]`), without the trailing
/// unknown segments (`?`) serde_path_to_error adds.
fn field_path(p: &serde_path_to_error::Path) -> Option<String> {
    let mut s = p.to_string();
    while let Some(t) = s.strip_suffix('?') {
        s = t.strip_suffix('.').unwrap_or(t).to_string();
    }
    (!s.is_empty() && s != ".").then_some(s)
}

impl Manifest {
    /// Read and validate a manifest file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ExperimentError::io(path, e))?;
        let m: Manifest = parse_ron(path, &text)?;
        m.validate(path)?;
        Ok(m)
    }

    fn invalid(path: &Path, field: &str, msg: impl Into<String>) -> ExperimentError {
        ExperimentError::Invalid {
            path: path.to_path_buf(),
            field: field.into(),
            msg: msg.into(),
        }
    }

    /// Check values serde cannot: sizes, lengths, acceptance rates; build every leg once.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |f: &str, m: String| Self::invalid(path, f, m);
        if self.name.trim().is_empty() || self.name.contains(['/', '\\']) {
            return Err(bad(
                "name",
                format!(
                    "must be a non-empty file-name-safe string, got {:?}",
                    self.name
                ),
            ));
        }
        if let Some(real) = &self.real {
            self.check_no_sim_sections(path)?;
            crate::manifest_check::check_real_top(self, path)?;
            crate::manifest_check::check_real(real, path)?;
            crate::manifest_check::check_real_expectations(self, real, path)?;
            return real.validate(path);
        }
        crate::manifest_check::check_sizes(self, path)?;
        self.check_sim_values(path)?;
        crate::manifest_cost::check(self, path)?;
        crate::plan::check(self).map_err(|e| match e {
            ExperimentError::Invalid { field, msg, .. } => bad(&field, msg),
            other => other,
        })?;
        if self.kv.max_in_flight_tokens == Some(0) {
            return Err(bad("kv.max_in_flight_tokens", "must be > 0".into()));
        }
        if self.sweep.max_num_seqs.contains(&0) {
            return Err(bad("sweep.max_num_seqs", "values must be > 0".into()));
        }
        if self.sweep.max_in_flight_tokens.contains(&0) {
            return Err(bad(
                "sweep.max_in_flight_tokens",
                "values must be > 0".into(),
            ));
        }
        let legs = self.legs().map_err(|e| match e {
            ExperimentError::Engine { context, error } => bad(&context, error.to_string()),
            // Plan errors are raised without the file; name it here.
            ExperimentError::Invalid { field, msg, .. } => bad(&field, msg),
            other => other,
        })?;
        crate::manifest_check::check_fields(self, path, &legs)
    }

    /// The simulated sections' values: scheduler budgets, acceptance rates, drafter N,
    /// workload prompts and generator, sweep block sizes.
    fn check_sim_values(&self, path: &Path) -> Result<()> {
        let bad = |f: &str, m: String| Self::invalid(path, f, m);
        if self.scheduler.max_num_seqs == 0 {
            return Err(bad("scheduler.max_num_seqs", "must be > 0".into()));
        }
        if self.scheduler.max_num_batched_tokens == 0 {
            return Err(bad(
                "scheduler.max_num_batched_tokens",
                "must be > 0".into(),
            ));
        }
        let mut prev = 1.0;
        for (i, &a) in self.acceptance.iter().enumerate() {
            if !(0.0..=1.0).contains(&a) || a > prev {
                return Err(bad(
                    &format!("acceptance[{i}]"),
                    format!("rates must be in [0, 1] and non-increasing, got {a}"),
                ));
            }
            prev = a;
        }
        if self.drafter.kind != DrafterKind::None && self.drafter.num_speculative_tokens == 0 {
            return Err(bad(
                "drafter.num_speculative_tokens",
                "must be > 0 with a drafter".into(),
            ));
        }
        if let Some(b) = self.drafter.block_size {
            if self.drafter.kind.is_dflash() && (b == 0 || self.drafter.num_speculative_tokens > b)
            {
                return Err(bad(
                    "drafter.num_speculative_tokens",
                    format!(
                        "{} exceeds the DFlash2 block size {b}",
                        self.drafter.num_speculative_tokens
                    ),
                ));
            }
        }
        if let Some(g) = self.workload.generate {
            if g.min == 0 || g.min > g.max {
                return Err(bad(
                    "workload.generate",
                    format!("need 0 < min <= max, got min {} max {}", g.min, g.max),
                ));
            }
        }
        let mml = u64::from(self.kv.max_model_len);
        for (i, &p) in self.workload.prompts.iter().enumerate() {
            if p == 0 || p > mml {
                return Err(bad(
                    &format!("workload.prompts[{i}]"),
                    format!("prompt of {p} tokens must be in 1..=max_model_len ({mml})"),
                ));
            }
        }
        if self.workload.prompts.is_empty()
            && self.workload.generate.is_none()
            && self.measure.simulate
        {
            return Err(bad(
                "workload",
                "no prompts and no generator, but measure.simulate is on".into(),
            ));
        }
        for b in &self.sweep.block_sizes {
            if *b == 0 {
                return Err(bad("sweep.block_sizes", "block sizes must be > 0".into()));
            }
        }
        Ok(())
    }

    /// A manifest with `real` must leave the simulated sections out (they would be ignored).
    fn check_no_sim_sections(&self, path: &Path) -> Result<()> {
        let given = [
            ("kv", self.kv != KvSpec::default()),
            ("scheduler", self.scheduler != SchedulerSpec::default()),
            ("drafter", self.drafter != DrafterSpec::default()),
            ("acceptance", !self.acceptance.is_empty()),
            ("acceptance_profile", self.acceptance_profile.is_some()),
            ("cost", self.cost.is_some()),
            ("workload", self.workload != Workload::default()),
            ("sweep", self.sweep != Sweep::default()),
            ("measure", self.measure != Measure::default()),
        ];
        match given.iter().find(|(_, g)| *g) {
            Some((f, _)) => Err(Self::invalid(
                path,
                f,
                "belongs to simulated manifests; a manifest with `real` runs the real engine (its drafters, N, concurrency, prompts and pool are set in `real`), so leave this section out",
            )),
            None => Ok(()),
        }
    }

    /// The drafter of one leg: `drafter` with the leg's swept N (`sweep.num_speculative_tokens`);
    /// N = 0 is a leg without speculation (kind `none`).
    pub fn drafter_for(&self, leg: &Leg) -> DrafterSpec {
        match leg.num_speculative_tokens {
            None => self.drafter.clone(),
            Some(0) => DrafterSpec::default(),
            Some(n) => DrafterSpec {
                num_speculative_tokens: n,
                ..self.drafter.clone()
            },
        }
    }

    /// The manifest as one value of the N axis sees it (drafter N replaced).
    fn with_num_speculative_tokens(&self, n: Option<u32>) -> std::borrow::Cow<'_, Manifest> {
        match n {
            None => std::borrow::Cow::Borrowed(self),
            Some(n) => {
                let mut m = self.clone();
                m.drafter.num_speculative_tokens = n;
                std::borrow::Cow::Owned(m)
            }
        }
    }

    /// True when the legs run the real engine.
    pub fn is_real(&self) -> bool {
        self.real.is_some()
    }

    /// All prompt lengths: the listed ones, then the generated ones (seeded).
    pub fn prompt_lengths(&self) -> Vec<u64> {
        let mut v = self.workload.prompts.clone();
        if let Some(g) = self.workload.generate {
            use rand::{Rng, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed ^ 0x5eed);
            for _ in 0..g.count {
                v.push(rng.random_range(g.min..=g.max.min(u64::from(self.kv.max_model_len))));
            }
        }
        v
    }

    /// A leg's requests: `prompts`, or with `workload.requests_per_seq` that many per
    /// sequence slot (the prompts repeated in order).
    fn requests_for(&self, prompts: &[u64], seqs: Option<usize>) -> Vec<u64> {
        match self.workload.requests_per_seq {
            Some(r) if !prompts.is_empty() => {
                let n = r as usize * seqs.unwrap_or(self.scheduler.max_num_seqs);
                prompts.iter().copied().cycle().take(n).collect()
            }
            _ => prompts.to_vec(),
        }
    }

    /// Build the KV layout for a block size / cap / pool.
    pub fn layout_for(
        &self,
        block_size: Option<u32>,
        cap: CapPolicy,
        num_blocks: Option<u32>,
    ) -> Result<KvLayout> {
        let kv = &self.kv;
        let mut layout = match (&kv.preset, &kv.layout) {
            (Some(p), _) if p == PRESET_GLM53_DFLASH2 => {
                let bs = block_size.or(kv.block_size).ok_or_else(|| {
                    ExperimentError::engine(
                        "kv.block_size",
                        speclab_engine::EngineError::InvalidLayout {
                            field: "block_size".into(),
                            reason: "the preset needs a block size".into(),
                        },
                    )
                })?;
                let mut l = speclab_engine::kv::presets::glm53_dflash2(
                    bs,
                    cap,
                    1,
                    kv.max_model_len,
                    self.scheduler.max_num_batched_tokens,
                );
                // The drafter's window and N take effect in the preset: the DFlash2 SW
                // group's window, and the KDA state groups' speculative blocks (vLLM
                // MambaSpec.num_speculative_blocks = num_speculative_tokens).
                for g in &mut l.groups {
                    match g.kind {
                        GroupKind::SlidingWindow => {
                            if let Some(w) = self.drafter.sliding_window {
                                g.sliding_window = Some(w);
                            }
                        }
                        GroupKind::State => {
                            g.num_speculative_blocks = self.drafter.num_speculative_tokens
                        }
                        _ => {}
                    }
                }
                if let Some(m) = kv.memory {
                    attach_memory(&mut l, &m, bs);
                }
                l.num_blocks = None;
                l
            }
            (Some(p), _) => {
                let why = if p == PRESET_GLM53_MTP {
                    format!("preset {p:?} is planned only: give kv.plan")
                } else {
                    format!("unknown preset {p:?}; known: {PRESET_GLM53_DFLASH2}, {PRESET_GLM53_MTP} (with kv.plan)")
                };
                return Err(ExperimentError::engine(
                    "kv.preset",
                    speclab_engine::EngineError::Unsupported(why),
                ));
            }
            (None, Some(l)) => {
                let mut l = l.clone();
                let swept_n = !self.sweep.num_speculative_tokens.is_empty();
                for g in &mut l.groups {
                    if g.kind == GroupKind::SlidingWindow {
                        g.cap = cap;
                    }
                    if swept_n && g.kind == GroupKind::State {
                        g.num_speculative_blocks = self.drafter.num_speculative_tokens;
                    }
                    if let Some(bs) = block_size {
                        if matches!(g.kind, GroupKind::Full | GroupKind::RingBuffer) {
                            g.block_size = Some(bs);
                        }
                    }
                }
                l
            }
            (None, None) => {
                return Err(ExperimentError::engine(
                    "kv",
                    speclab_engine::EngineError::InvalidLayout {
                        field: "kv".into(),
                        reason: "give a preset or a layout".into(),
                    },
                ))
            }
        };
        layout.max_model_len = kv.max_model_len;
        layout.watermark = kv.watermark;
        if let Some(f) = self.kv.max_in_flight_tokens {
            layout.max_in_flight_tokens = Some(f);
        }
        if layout.max_in_flight_tokens.is_none() {
            layout.max_in_flight_tokens = Some(self.scheduler.max_num_batched_tokens);
        }
        if let Some(n) = num_blocks.or(kv.num_blocks) {
            layout.num_blocks = Some(n);
        }
        if layout.kv_cache_memory_bytes.is_none() {
            layout.kv_cache_memory_bytes = kv.kv_cache_memory_bytes;
        }
        Ok(layout)
    }

    /// The layout, pool and (with `kv.plan`) vLLM plan of one assumption set x block size
    /// x cap x pool.
    fn leg_layout(
        &self,
        v: &Variant,
        bs: Option<u32>,
        cap: CapPolicy,
        pool: Option<u32>,
    ) -> Result<(KvLayout, u32, Option<LegPlan>)> {
        let ctx = format!("kv (block_size {bs:?}, cap {cap:?})");
        if let Some(a) = v.plan {
            let b = bs
                .or(self.kv.block_size)
                .ok_or_else(|| ExperimentError::Invalid {
                    path: "manifest".into(),
                    field: "kv.block_size".into(),
                    msg: "kv.plan needs a block size (kv.block_size or sweep.block_sizes)".into(),
                })?;
            let f = v.max_in_flight_tokens;
            let (layout, plan, mem, over) = crate::plan::planned_layout(self, a, f, b, cap, pool)?;
            let n = layout.num_blocks.unwrap_or(1);
            let lp = LegPlan {
                leg: String::new(),
                set: v.id.join(" "),
                assumptions: a,
                max_in_flight_tokens: f,
                kv_cache_memory_bytes: mem,
                overridden: over,
                plan,
            };
            return Ok((layout, n, Some(lp)));
        }
        let mut layout = self.layout_for(bs, cap, pool)?;
        if !self.sweep.max_in_flight_tokens.is_empty() {
            layout.max_in_flight_tokens = Some(v.max_in_flight_tokens);
        }
        let num_blocks = speclab_engine::kv::planning::resolve_num_blocks(&layout)
            .map_err(|e| ExperimentError::engine(ctx, e))?;
        Ok((layout, num_blocks, None))
    }

    /// Expand the sweep into simulated legs, in order: assumption set (plan axes,
    /// in-flight tokens), block size, cap, pool, workload.
    /// A real manifest has none (its legs are [`crate::real::RealSpec::legs`]).
    pub fn legs(&self) -> Result<Vec<Leg>> {
        if self.real.is_some() {
            return Ok(Vec::new());
        }
        let bss: Vec<Option<u32>> = if self.sweep.block_sizes.is_empty() {
            vec![self.kv.block_size]
        } else {
            self.sweep.block_sizes.iter().map(|&b| Some(b)).collect()
        };
        let caps = if self.sweep.caps.is_empty() {
            vec![self.kv.cap]
        } else {
            self.sweep.caps.clone()
        };
        let pools: Vec<Option<u32>> = if self.sweep.num_blocks.is_empty() {
            vec![None]
        } else {
            self.sweep.num_blocks.iter().map(|&n| Some(n)).collect()
        };
        let prompts = self.prompt_lengths();
        let groups: Vec<Vec<u64>> = if self.workload.each_prompt_alone {
            if prompts.is_empty() {
                vec![vec![]]
            } else {
                prompts.iter().map(|&p| vec![p]).collect()
            }
        } else {
            vec![prompts.clone()]
        };
        let seqs_axis: Vec<Option<usize>> = if self.sweep.max_num_seqs.is_empty() {
            vec![None]
        } else {
            self.sweep.max_num_seqs.iter().map(|&n| Some(n)).collect()
        };
        let n_axis: Vec<Option<u32>> = if self.sweep.num_speculative_tokens.is_empty() {
            vec![None]
        } else {
            self.sweep
                .num_speculative_tokens
                .iter()
                .map(|&n| Some(n))
                .collect()
        };
        let axes = Axes {
            bss,
            caps,
            pools,
            seqs: seqs_axis,
            groups,
        };
        let mut legs = Vec::new();
        for v in crate::plan::variants(self) {
            for &nst in &n_axis {
                let mn = self.with_num_speculative_tokens(nst);
                legs.extend(mn.legs_of(&v, nst, &axes)?);
            }
        }
        Ok(legs)
    }

    /// The legs of one assumption set and one N (block size, cap, pool, max_num_seqs,
    /// workload).
    fn legs_of(&self, v: &Variant, nst: Option<u32>, axes: &Axes) -> Result<Vec<Leg>> {
        let Axes {
            bss,
            caps,
            pools,
            seqs: seqs_axis,
            groups,
        } = axes;
        let mut legs = Vec::new();
        {
            for &bs in bss {
                for &cap in caps {
                    for &pool in pools {
                        let (layout, num_blocks, plan) = self.leg_layout(v, bs, cap, pool)?;
                        for (seqs, ps) in seqs_axis
                            .iter()
                            .flat_map(|s| groups.iter().map(move |g| (*s, g)))
                        {
                            let ps = &self.requests_for(ps, seqs);
                            let mut id = v.id.clone();
                            if let Some(n) = nst {
                                id.push(format!("n={n}"));
                            }
                            if let Some(n) = seqs {
                                id.push(format!("seqs={n}"));
                            }
                            if let Some(b) = bs {
                                id.push(format!("bs={b}"));
                            }
                            id.push(format!("cap={}", cap_name(cap)));
                            if pool.is_some() || !self.sweep.num_blocks.is_empty() {
                                id.push(format!("blocks={num_blocks}"));
                            }
                            match ps.len() {
                                0 => {}
                                1 => id.push(format!("prompt={}", ps[0])),
                                n => id.push(format!("prompts={n}")),
                            }
                            let id = id.join(" ");
                            let plan = plan.clone().map(|p| LegPlan {
                                leg: id.clone(),
                                ..p
                            });
                            legs.push(Leg {
                                id,
                                block_size: bs,
                                cap,
                                layout: layout.clone(),
                                num_blocks,
                                prompts: ps.clone(),
                                plan,
                                max_num_seqs: seqs,
                                num_speculative_tokens: nst,
                            });
                        }
                    }
                }
            }
        }
        Ok(legs)
    }
}

/// The sweep axes below the assumption set and N, in expansion order.
struct Axes {
    bss: Vec<Option<u32>>,
    caps: Vec<CapPolicy>,
    pools: Vec<Option<u32>>,
    seqs: Vec<Option<usize>>,
    groups: Vec<Vec<u64>>,
}

/// Snake-case name of a cap policy (as in manifests).
pub fn cap_name(c: CapPolicy) -> &'static str {
    match c {
        CapPolicy::None => "none",
        CapPolicy::Upstream => "upstream",
        CapPolicy::WindowPlusTwo => "window_plus_two",
    }
}

/// Attach per-group byte sizes to the preset layout (group order of `glm53_dflash2`).
fn attach_memory(l: &mut KvLayout, m: &PresetMemory, bs: u32) {
    let bs = u64::from(bs);
    for g in &mut l.groups {
        g.memory = Some(match g.kind {
            GroupKind::Full => GroupMemory {
                num_layers: m.full_layers,
                page_size_bytes: bs * m.full_bytes_per_token,
            },
            GroupKind::RingBuffer => GroupMemory {
                num_layers: m.ring_layers,
                page_size_bytes: bs * m.ring_bytes_per_token,
            },
            GroupKind::State => GroupMemory {
                num_layers: m.state_layers_per_group,
                page_size_bytes: m.state_bytes,
            },
            GroupKind::SlidingWindow => GroupMemory {
                num_layers: m.drafter_layers,
                page_size_bytes: u64::from(g.block_size.unwrap_or(16)) * m.drafter_bytes_per_token,
            },
        });
    }
}

/// Re-exported for manifests that build layouts by hand.
pub type Group = GroupSpec;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_wedge_manifest_parses_and_expands() {
        let p = Path::new("df2w-wedge.ron");
        let m: Manifest = parse_ron(p, include_str!("../df2w-wedge.ron")).unwrap();
        m.validate(p).unwrap();
        let legs = m.legs().unwrap();
        assert_eq!(legs.len(), 30);
        assert_eq!(legs[0].id, "bs=2304 cap=none prompt=15523");
        assert_eq!(legs[0].num_blocks, 1012);
        assert_eq!(m.drafter.lookahead(), 8);
    }

    #[test]
    fn ron_errors_name_line_and_column() {
        let p = Path::new("bad.ron");
        let e = parse_ron::<Manifest>(p, "(\n  name: \"x\",\n  kv: (bogus: 1),\n)")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("bad.ron:3:"), "{e}");
        assert!(e.contains("bogus"), "{e}");
    }
}

#[cfg(test)]
mod shipped {
    use super::*;

    #[test]
    fn block_size_manifest_plans_pools_per_assumption_set() {
        let p = Path::new("df2w-block-size.ron");
        let m: Manifest = parse_ron(p, include_str!("../df2w-block-size.ron")).unwrap();
        m.validate(p).unwrap();
        let legs = m.legs().unwrap();
        assert_eq!(legs.len(), 4 * 2 * 2 * 2 * 2 * 3);
        let set = "tp=4 kv=auto inflight=16384 drafter_bs=16 idx_align=off";
        let leg = |bs: u32| {
            legs.iter()
                .find(|l| l.id == format!("{set} bs={bs} cap=none"))
                .unwrap()
        };
        // Calibrated: block 2304 gets the card's pool under every set.
        assert_eq!(leg(2304).num_blocks, 1012);
        // vLLM raises 1024 to 2048 at TP 4 (KDA page > 1024-token MLA page): 1012 x 2304 / 2048.
        let p1024 = leg(1024).plan.as_ref().unwrap();
        assert_eq!(p1024.plan.effective_block_size, 2048);
        assert_eq!(leg(1024).num_blocks, 1138);
        assert_eq!(leg(1536).num_blocks, 1518);
        // Stock vLLM (indexer alignment on) runs 2304 as 2560.
        let stock = legs
            .iter()
            .find(|l| {
                l.id == "tp=4 kv=auto inflight=16384 drafter_bs=16 idx_align=on bs=2304 cap=none"
            })
            .unwrap();
        assert_eq!(stock.plan.as_ref().unwrap().plan.effective_block_size, 2560);
    }

    #[test]
    fn plan_fields_that_would_not_take_effect_are_refused() {
        let p = Path::new("x.ron");
        let text = include_str!("../df2w-block-size.ron");
        let no_plan = text.replace(
            "plan: Some((tp: 4, kv_dtype: auto, drafter_block_size: Some(16), indexer_block_alignment: false)),",
            "",
        );
        let m: Manifest = parse_ron(p, &no_plan).unwrap();
        let e = m.validate(p).unwrap_err().to_string();
        assert!(e.contains("sweep.tps") && e.contains("kv.plan"), "{e}");
        let two = text.replace(
            "max_model_len: 262144,",
            "max_model_len: 262144, kv_cache_memory_bytes: Some(1),",
        );
        let m: Manifest = parse_ron(p, &two).unwrap();
        let e = m.validate(p).unwrap_err().to_string();
        assert!(e.contains("kv.kv_cache_memory_bytes"), "{e}");
        // TP 3 does not divide the 64 KDA heads: refused, naming the file and the field.
        let tp3 = text.replace("tps: [1, 2, 4, 8]", "tps: [1, 3]");
        let m: Manifest = parse_ron(p, &tp3).unwrap();
        let e = m.validate(p).unwrap_err().to_string();
        assert!(e.starts_with("x.ron") && e.contains("plan.tp"), "{e}");
    }

    #[test]
    fn implied_pools_manifest_expands() {
        let p = Path::new("df2w-implied-pools.ron");
        let m: Manifest = parse_ron(p, include_str!("../df2w-implied-pools.ron")).unwrap();
        m.validate(p).unwrap();
        assert_eq!(m.legs().unwrap().len(), 21);
    }
}
