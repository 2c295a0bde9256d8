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
}

/// Seconds since the epoch (0 if the clock is before it).
pub fn now_unix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The current git commit of the working directory, if any.
pub fn git_commit() -> Option<String> {
    let out = std::process::Command::new("git").args(["rev-parse", "HEAD"]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    let dirty = std::process::Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .output()
        .ok()
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(false);
    Some(if dirty { format!("{s}-dirty") } else { s })
}

/// Write `bytes` to `path` atomically (temp file in the same directory + fsync + rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| ExperimentError::io(dir, e))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "record".into());
    let tmp: PathBuf = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(|e| ExperimentError::io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| ExperimentError::io(&tmp, e))?;
    f.sync_all().map_err(|e| ExperimentError::io(&tmp, e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| ExperimentError::io(path, e))
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
        serde_json::from_str(&text).map_err(|e| ExperimentError::Parse {
            path: path.to_path_buf(),
            at: format!("{}:{}", e.line(), e.column()),
            msg: e.to_string(),
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
        let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".tmp")).collect();
        assert!(leftovers.is_empty());
        std::fs::remove_dir_all(&dir).ok();
    }
}
