//! Run records: what a run measured, written atomically after every leg.
//!
//! A record holds the manifest (verbatim text and parsed), the git commit, and
//! every finished leg's measured outputs (per-group blocks at admission,
//! status ADMITTED / COMPLETED / WEDGED / REJECTED, steps, bound, peaks,
//! acceptance metrics, timings). It is JSON, written to a temp file in the same
//! directory and renamed over the target, so a crash mid-sweep leaves the
//! previous legs intact; `speclab run` resumes by skipping legs whose id is
//! already recorded for the same manifest text.
//!
//! Invariant: a record on disk is always a complete, parseable JSON document.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{ExperimentError, Result};

/// Outcome of one leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum LegStatus {
    /// Every request was admitted and ran to completion.
    Completed,
    /// Admitted but the step budget ran out first.
    StepLimit,
    /// The head request can never be admitted (faithful mode).
    Wedged,
    /// The policy refused at least one impossible request; the rest completed.
    Rejected,
    /// Only the bound was measured.
    BoundOnly,
    /// vLLM's startup check refuses the config (one max_model_len request cannot fit).
    RefusedAtStartup,
}

/// Blocks the admission gate sized, per group, for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmissionRecord {
    pub request: u64,
    pub prompt_len: u64,
    /// Shape: [num_groups].
    pub need_per_group: Vec<u64>,
    pub total: u64,
    pub usable: u64,
    pub binding_group: String,
    /// Step at which it was admitted; None when never admitted.
    pub admitted_at_step: Option<u64>,
}

/// Speculative-decoding metrics with vLLM's definitions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct SpecRecord {
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    pub accepted_per_position: Vec<u64>,
    pub draft_acceptance_rate: Option<f64>,
    /// tau = 1 + accepted / drafts.
    pub mean_acceptance_length: Option<f64>,
}

/// The largest admissible prompt of a leg.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoundRecord {
    /// Largest admissible prompt length; None if even 1 token does not fit.
    pub largest_admissible: Option<u64>,
    /// True when every length up to max_model_len is admissible (no bound).
    pub unbounded: bool,
    /// Per-group need at the bound and one token above it.
    pub need_at_bound: Vec<u64>,
    pub need_above_bound: Vec<u64>,
    pub binding_group_above: Option<String>,
    /// Admission probes the bisection made.
    pub probes: u32,
}

/// One leg's measured outputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LegRecord {
    pub id: String,
    pub block_size: Option<u32>,
    pub cap: String,
    pub num_blocks: u32,
    pub usable_blocks: u64,
    pub group_names: Vec<String>,
    pub prompts: Vec<u64>,
    pub status: LegStatus,
    /// One entry per request of the leg (admitted ones and the wedged/rejected ones).
    pub admissions: Vec<AdmissionRecord>,
    pub steps: u64,
    pub preemptions: u64,
    pub finished: u64,
    /// Max blocks any single request held in each group. Shape: [num_groups].
    pub peak_held_per_group: Vec<u64>,
    /// Max blocks held in total at any step.
    pub peak_total_held: u64,
    pub spec: SpecRecord,
    pub bound: Option<BoundRecord>,
    /// The wedge/reject explanation, verbatim.
    pub note: Option<String>,
    pub wall_ms: f64,
    /// What a real-engine leg measured (absent in simulated legs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub real: Option<RealLegRecord>,
    /// Simulated time under the manifest's cost model (absent without one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sim_time: Option<SimTimeRecord>,
    /// Requests scheduled per step and output tokens per step (manifests with
    /// `measure.concurrency`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<ConcurrencyRecord>,
}

/// Simulated time of a leg under a step-cost model ([`speclab_engine::cost`]).
///
/// `output_tok_s` = output tokens / simulated time of every step (prefill included: a
/// serving benchmark's throughput); `decode_tok_s` = tokens of the decode-only steps /
/// their time. Term sums are microseconds ([`speclab_engine::cost::StepCost`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimTimeRecord {
    /// N the drafter proposed per step (0: no drafter).
    pub num_speculative_tokens: u32,
    pub steps: u64,
    pub total_s: f64,
    pub output_tokens: u64,
    pub output_tok_s: f64,
    pub decode_steps: u64,
    pub decode_tok_s: Option<f64>,
    pub mean_decode_step_us: Option<f64>,
    /// Mean verify rows and decode requests of a decode-only step.
    pub mean_decode_rows: Option<f64>,
    pub mean_decode_reqs: Option<f64>,
    /// Per-term us over all steps, and over the decode-only steps.
    pub terms_us: speclab_engine::cost::StepCost,
    pub decode_terms_us: speclab_engine::cost::StepCost,
}

impl SimTimeRecord {
    /// From the executor's accumulated time and the run's output tokens.
    pub fn of(t: &speclab_engine::sim::SimTime, n: u32, output_tokens: u64) -> Self {
        let ds = t.decode_steps as f64;
        let per_step = |x: f64| (t.decode_steps > 0).then(|| x / ds);
        Self {
            num_speculative_tokens: n,
            steps: t.steps,
            total_s: t.total_us * 1e-6,
            output_tokens,
            output_tok_s: if t.total_us > 0.0 {
                output_tokens as f64 / (t.total_us * 1e-6)
            } else {
                0.0
            },
            decode_steps: t.decode_steps,
            decode_tok_s: (t.decode_us > 0.0)
                .then(|| t.decode_tokens as f64 / (t.decode_us * 1e-6)),
            mean_decode_step_us: per_step(t.decode_us),
            mean_decode_rows: per_step(t.decode_rows as f64),
            mean_decode_reqs: per_step(t.decode_reqs as f64),
            terms_us: t.terms,
            decode_terms_us: t.decode_terms,
        }
    }
}

/// One real-engine leg's measurements (vLLM's spec-decode definitions).
///
/// Acceptance: `num_drafts` = verify chunks with at least one draft, `num_draft_tokens`,
/// `num_accepted_tokens`, `accepted_per_position[k]` = drafts whose position k was
/// accepted; `acceptance_per_position[k]` = that / `num_drafts` (unconditional);
/// `draft_acceptance_rate` = accepted / drafted; `tau` = 1 + accepted / drafts (the mean
/// acceptance length). Verify width: tokens the target verified in one decode step,
/// summed over the batch (`1 + drafts` per decode request), over steps with decode rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RealLegRecord {
    pub drafter: String,
    /// N (0 for `none`).
    pub num_speculative_tokens: u32,
    /// vLLM `max_num_seqs`.
    pub concurrency: usize,
    pub temperature: f32,
    pub num_requests: u64,
    /// Prompt tokens over all requests.
    pub prompt_tokens: u64,
    pub max_tokens: u64,
    /// Pool blocks (incl. the null block) and the KV block size of the target.
    pub num_blocks: u32,
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    pub accepted_per_position: Vec<u64>,
    pub acceptance_per_position: Vec<f64>,
    /// None without drafts.
    pub draft_acceptance_rate: Option<f64>,
    /// Mean acceptance length, 1 + accepted / drafts; None without drafts.
    pub tau: Option<f64>,
    pub output_tokens: u64,
    /// Executed engine steps, and those with decode (verify) rows.
    pub steps: u64,
    pub decode_steps: u64,
    /// Output tokens per wall second of the engine loop.
    pub tokens_per_s: f64,
    /// Wall seconds of the engine loop (model and drafter loading excluded).
    pub wall_s: f64,
    pub mean_verify_width: Option<f64>,
    pub max_verify_width: u64,
    /// Distinct (MoE layer, expert) pairs the verify rows of a step routed to, mean and
    /// max over decode steps (with `collect_router`), out of `expert_slots` = MoE layers x
    /// routed experts.
    pub mean_verify_experts: Option<f64>,
    pub max_verify_experts: Option<u64>,
    pub expert_slots: u64,
    /// Time to first token, mean over requests: executed steps and seconds from the run start.
    pub mean_ttft_steps: Option<f64>,
    pub mean_ttft_s: Option<f64>,
    pub max_ttft_s: Option<f64>,
    /// Every request finished (nothing wedged, rejected or cut by the step limit).
    pub complete: bool,
    pub wedged: Option<String>,
    pub hit_step_limit: bool,
    pub preemptions: u64,
    /// Requests per finish reason (`length`, `eos`, `max_model_len`, `unfinished`).
    pub finish: std::collections::BTreeMap<String, u64>,
    /// FNV-1a 64 of each request's output token ids (hex), in request order: greedy legs
    /// with a drafter are compared with the spec-off leg through these.
    pub output_digests: Vec<String>,
    /// The engine's allocator check, if it failed.
    pub allocator_violation: Option<String>,
    /// The pool planned from `real.kv_cache_memory_bytes` (per-group pages,
    /// bytes_per_block, num_blocks, the stores' bytes per block); absent with `num_blocks`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_plan: Option<speclab_engine::exec::RunPoolPlan>,
}

/// FNV-1a 64 of token ids (little-endian u32 bytes), as 16 hex digits.
pub fn digest_tokens(tokens: &[u32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in tokens {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// A whole run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    pub speclab_version: String,
    pub git_commit: Option<String>,
    pub manifest_path: String,
    /// The manifest file's text, verbatim.
    pub manifest_text: String,
    pub manifest: serde_json::Value,
    pub started_unix_s: u64,
    pub updated_unix_s: u64,
    pub legs: Vec<LegRecord>,
    /// Set when every leg of the manifest is recorded.
    pub complete: bool,
    /// Run-level notes (e.g. drafters skipped because their checkpoint is missing).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// vLLM 0.33.0 pool plans of the legs (manifests with `kv.plan`), in leg order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plans: Vec<crate::plan::LegPlan>,
    /// The shard of a sharded run (`speclab run --shard I/N`): the record holds only the
    /// legs this shard owns. Absent in unsharded and merged records (old records load).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<crate::shard::Shard>,
}

impl RunRecord {
    /// The plan of a leg, if the manifest planned it.
    pub fn plan_of(&self, leg: &str) -> Option<&crate::plan::LegPlan> {
        self.plans.iter().find(|p| p.leg == leg)
    }
}

/// Seconds since the epoch (0 if the clock is before it).
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The current git commit of the working directory, if any; `-dirty` when tracked
/// files other than records and findings (`runs/`, `findings/`) have changes.
/// `SPECLAB_GIT_COMMIT`, when set and not empty, wins: a binary built here and run on a
/// machine whose copy of the tree has a stale `.git` (the device machine) records the
/// commit it was built from (`recipes/ab_session.sh` sets it from `COMMIT`).
pub fn git_commit() -> Option<String> {
    if let Some(c) = std::env::var("SPECLAB_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
    {
        return Some(c.trim().to_string());
    }
    let out = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    let dirty = std::process::Command::new("git")
        .args([
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ".",
            ":(exclude)runs",
            ":(exclude)findings",
        ])
        .output()
        .ok()
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(false);
    Some(if dirty { format!("{s}-dirty") } else { s })
}

/// Write `bytes` to `path` atomically: a temp file in the same directory, fsync, rename.
///
/// The temp file (`tempfile::NamedTempFile`, unique name) is removed on every error path
/// (write, fsync or rename failing, e.g. on a full disk), so a failed write never leaves
/// a partial file behind and never blocks a retry; the previous file at `path` stays whole.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = parent_dir(path);
    std::fs::create_dir_all(dir).map_err(|e| ExperimentError::io(dir, e))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "record".into());
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| ExperimentError::io(dir, e))?;
    let tmp_path = tmp.path().to_path_buf();
    tmp.write_all(bytes)
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(|e| ExperimentError::io(&tmp_path, e))?;
    // On failure `persist` hands the temp file back; dropping it deletes it.
    tmp.persist(path)
        .map_err(|e| ExperimentError::io(path, e.error))?;
    Ok(())
}

/// The directory of `path` (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// `dir/.<file name><suffix>`: the hidden sidecar files of a record.
fn sidecar(path: &Path, suffix: &str) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "record".into());
    parent_dir(path).join(format!(".{name}{suffix}"))
}

/// Where an unfinished run keeps its progress: `dir/.<record>.partial` (renamed over the
/// record only once every leg is done, so a killed run never replaces a complete record).
pub fn partial_path(record: &Path) -> PathBuf {
    sidecar(record, ".partial")
}

/// The lock file of a record: `dir/.<record>.lock`.
pub fn lock_path(record: &Path) -> PathBuf {
    sidecar(record, ".lock")
}

/// The timings of the last run over a record: `dir/<stem>.timings.json` (gitignored, so
/// re-measured wall times never dirty the tracked research record).
pub fn timings_path(record: &Path) -> PathBuf {
    let stem = record
        .file_stem()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "record".into());
    parent_dir(record).join(format!("{stem}.timings.json"))
}

/// An exclusive lock on a record (`fd-lock` on its `.lock` sidecar), held while a run
/// writes it. A second run over the same record fails fast instead of racing.
pub struct RecordLock {
    lock: fd_lock::RwLock<std::fs::File>,
    path: PathBuf,
}

impl RecordLock {
    /// Create the lock file (and the record's directory), proving the directory is
    /// writable before any leg runs. Errors name the record and the lock file.
    pub fn open(record: &Path) -> Result<Self> {
        if record.is_dir() {
            return Err(ExperimentError::Invalid {
                path: record.to_path_buf(),
                field: "--out".into(),
                msg: "is a directory; give a record file path such as runs/name.json".into(),
            });
        }
        let dir = parent_dir(record);
        std::fs::create_dir_all(dir).map_err(|e| unwritable(record, dir, e))?;
        let path = lock_path(record);
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| unwritable(record, &path, e))?;
        Ok(Self {
            lock: fd_lock::RwLock::new(f),
            path,
        })
    }

    /// Take the lock without waiting; refuse if another process holds it.
    pub fn try_lock(&mut self) -> Result<fd_lock::RwLockWriteGuard<'_, std::fs::File>> {
        let path = self.path.clone();
        self.lock.try_write().map_err(|e| ExperimentError::Invalid {
            path: path.clone(),
            field: "record lock".into(),
            msg: format!(
                "another speclab run is writing this record ({e}); wait for it to finish or pass --out for a separate record"
            ),
        })
    }
}

fn unwritable(record: &Path, at: &Path, e: std::io::Error) -> ExperimentError {
    ExperimentError::Invalid {
        path: record.to_path_buf(),
        field: "record".into(),
        msg: format!("cannot write the record here ({}: {e})", at.display()),
    }
}

/// Leg fields that are measurements of time, not research results: excluded from
/// reproduction checks and written to the timings file.
pub const TIMING_FIELDS: [&str; 5] = [
    "wall_ms",
    "tokens_per_s",
    "wall_s",
    "mean_ttft_s",
    "max_ttft_s",
];

/// A leg as JSON with its timing fields removed (also inside `real`).
fn results_only(l: &LegRecord) -> serde_json::Value {
    let mut v = serde_json::to_value(l).unwrap_or(serde_json::Value::Null);
    strip_timings(&mut v);
    v
}

fn strip_timings(v: &mut serde_json::Value) {
    if let Some(m) = v.as_object_mut() {
        for k in TIMING_FIELDS {
            m.remove(k);
        }
        if let Some(r) = m.get_mut("real") {
            strip_timings(r);
        }
    }
}

/// The first field where two legs' results differ (timings ignored), as
/// `field: old -> new`; `None` when the results are the same.
pub fn result_difference(old: &LegRecord, new: &LegRecord) -> Option<String> {
    first_difference("", &results_only(old), &results_only(new))
}

fn first_difference(at: &str, a: &serde_json::Value, b: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let null = Value::Null;
                let p = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                first_difference(&p, x.get(k).unwrap_or(&null), y.get(k).unwrap_or(&null))
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (p, q))| first_difference(&format!("{at}[{i}]"), p, q)),
        _ if a == b => None,
        _ => Some(format!("{at}: {} -> {}", short(a), short(b))),
    }
}

fn short(v: &serde_json::Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        format!("{}...", s.chars().take(77).collect::<String>())
    } else {
        s
    }
}

/// Concurrency of a simulated leg, from the step loop's per-step counts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConcurrencyRecord {
    /// Most requests scheduled in one step (prefill chunks and decodes: vLLM's
    /// "Running" at that step).
    pub peak_running: u64,
    /// Steps that scheduled `peak_running` requests.
    pub steps_at_peak: u64,
    /// Requests scheduled per step, averaged over the leg's steps.
    pub mean_running: Option<f64>,
    /// Output tokens committed over the leg.
    pub output_tokens: u64,
    /// Output tokens per step (the throughput proxy without a cost model).
    pub tokens_per_step: Option<f64>,
}

/// Requests scheduled per step and output tokens, counted step by step (simulated or real).
#[derive(Debug, Default)]
pub struct ConcurrencyCounter {
    steps: u64,
    peak: u64,
    sum: u64,
    steps_at_peak: u64,
    output_tokens: u64,
}

impl ConcurrencyCounter {
    /// Count one executed step.
    pub fn observe(&mut self, s: &speclab_engine::run::StepStats) {
        let n = s.num_reqs as u64;
        self.steps += 1;
        self.sum += n;
        self.output_tokens += s.output_tokens;
        match n.cmp(&self.peak) {
            std::cmp::Ordering::Greater => {
                self.peak = n;
                self.steps_at_peak = 1;
            }
            std::cmp::Ordering::Equal => self.steps_at_peak += 1,
            std::cmp::Ordering::Less => {}
        }
    }

    /// The record of the steps seen so far.
    pub fn record(&self) -> ConcurrencyRecord {
        let per_step = |x: u64| (self.steps > 0).then(|| x as f64 / self.steps as f64);
        ConcurrencyRecord {
            peak_running: self.peak,
            steps_at_peak: self.steps_at_peak,
            mean_running: per_step(self.sum),
            output_tokens: self.output_tokens,
            tokens_per_step: per_step(self.output_tokens),
        }
    }
}

/// The timings of one run over a record (the `.timings.json` file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimingsRecord {
    /// The record these timings belong to.
    pub record: String,
    pub measured_unix_s: u64,
    pub git_commit: Option<String>,
    /// Per leg: its id and every timing field it has.
    pub legs: Vec<serde_json::Value>,
}

impl TimingsRecord {
    /// The timing fields of each leg of a run.
    pub fn of(record: &Path, legs: &[LegRecord]) -> Self {
        let legs = legs
            .iter()
            .map(|l| {
                let full = serde_json::to_value(l).unwrap_or(serde_json::Value::Null);
                let mut m = serde_json::Map::new();
                m.insert("id".into(), serde_json::Value::String(l.id.clone()));
                for src in [Some(&full), full.get("real")].into_iter().flatten() {
                    for k in TIMING_FIELDS {
                        if let Some(x) = src.get(k) {
                            m.insert(k.into(), x.clone());
                        }
                    }
                }
                serde_json::Value::Object(m)
            })
            .collect();
        Self {
            record: record.display().to_string(),
            measured_unix_s: now_unix(),
            git_commit: git_commit(),
            legs,
        }
    }
    /// Save atomically next to the record.
    pub fn save(&self, path: &Path) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| ExperimentError::Invalid {
            path: path.to_path_buf(),
            field: "timings".into(),
            msg: e.to_string(),
        })?;
        write_atomic(path, &bytes)
    }
}

/// serde_json's message without its " at line L column C" suffix.
fn json_msg(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(k) if e.line() != 0 => s[..k].to_string(),
        _ => s,
    }
}

impl RunRecord {
    /// Save atomically as pretty JSON.
    pub fn save(&self, path: &Path) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| ExperimentError::Invalid {
            path: path.to_path_buf(),
            field: "record".into(),
            msg: e.to_string(),
        })?;
        write_atomic(path, &bytes)
    }

    /// Load a record, with `path:line:col` on malformed JSON.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ExperimentError::io(path, e))?;
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        serde_json::from_str(text).map_err(|e| ExperimentError::Parse {
            path: path.to_path_buf(),
            at: format!("{}:{}", e.line(), e.column()),
            msg: format!("not a readable run record: {}", json_msg(&e)),
        })
    }

    /// The recorded leg with this id.
    pub fn leg(&self, id: &str) -> Option<&LegRecord> {
        self.legs.iter().find(|l| l.id == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_whole_file() {
        let dir = std::env::temp_dir().join(format!("speclab-rec-{}", std::process::id()));
        let p = dir.join("r.json");
        write_atomic(&p, b"{\"a\":1}").unwrap();
        write_atomic(&p, b"{\"b\":2}").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{\"b\":2}");
        // No temp files left behind.
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[cfg(test)]
mod concurrency_tests {
    use speclab_engine::run::StepStats;

    use super::ConcurrencyCounter;

    #[test]
    fn counter_tracks_peak_steps_at_peak_and_means() {
        let mut c = ConcurrencyCounter::default();
        assert_eq!(c.record().mean_running, None);
        for (n, out) in [(2, 2), (3, 3), (3, 4), (1, 1)] {
            c.observe(&StepStats {
                num_reqs: n,
                output_tokens: out,
                ..StepStats::default()
            });
        }
        let r = c.record();
        assert_eq!((r.peak_running, r.steps_at_peak), (3, 2));
        assert_eq!(r.mean_running, Some(9.0 / 4.0));
        assert_eq!((r.output_tokens, r.tokens_per_step), (10, Some(2.5)));
    }
}
