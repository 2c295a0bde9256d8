//! The hazard atlas: one page linking every admission hazard speclab reproduces.
//!
//! A manifest with a `hazard` section (symptom, mechanism, bound, fix, real-engine
//! status, source) becomes one atlas row; `speclab findings` writes `atlas.md` next to
//! the findings whenever any record it renders carries one, with each row's verdicts
//! (reference statements matched / not) read from that record. Invariant: the atlas
//! states only what a committed record shows, plus the manifest's own words.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::findings::judge;
use crate::manifest::Manifest;
use crate::record::RunRecord;

/// A hazard's atlas entry (manifest `hazard`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hazard {
    /// Short title (e.g. "max-num-seqs above the Mamba block count").
    pub title: String,
    /// Where it comes from (model card line, vLLM issue number).
    pub source: String,
    pub symptom: String,
    /// The binding accounting, with the vLLM function it lives in.
    pub mechanism: String,
    /// The boundary (e.g. "max_num_seqs <= num_blocks").
    pub bound: String,
    /// The fix or workaround and whether the simulator validates it.
    pub fix: String,
    /// Whether the real engine (models/tiny) confirms it, or why not.
    #[serde(default)]
    pub real_engine: String,
}

/// One rendered row: the hazard, its finding and its verdict counts.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub record: String,
    pub hazard: Hazard,
    pub matched: usize,
    pub total: usize,
}

/// The atlas entry of a record, if its manifest names a hazard.
pub fn entry(rec: &RunRecord, path: &Path) -> Option<Entry> {
    let m: Manifest = serde_json::from_value(rec.manifest.clone()).ok()?;
    let hazard = m.hazard.clone()?;
    let matched = m
        .expectations
        .iter()
        .filter(|e| judge(e, rec).1 == "matched")
        .count();
    Some(Entry {
        name: m.name.clone(),
        record: path.display().to_string(),
        hazard,
        matched,
        total: m.expectations.len(),
    })
}

/// The atlas page.
pub fn render(entries: &[Entry]) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# Hazard atlas\n");
    let _ = writeln!(md, "Admission hazards of hybrid (recurrent-state / sliding-window) models sharing one KV pool with speculative decoding, reproduced in speclab's simulator. Rendered by `speclab findings` from the records below; each finding names the binding mechanism and the fix. Reference statements: how many of the manifest's expectations the record matches.\n");
    let _ = writeln!(md, "| hazard | source | symptom | mechanism | bound | fix | real engine | statements matched | finding |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|");
    for e in entries {
        let h = &e.hazard;
        let _ =
            writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} / {} | [`{}.md`]({}.md) ([record](../{})) |",
            h.title,
            h.source,
            h.symptom,
            h.mechanism,
            h.bound,
            h.fix,
            if h.real_engine.is_empty() { "-" } else { &h.real_engine },
            e.matched,
            e.total,
            e.name,
            e.name,
            e.record
        );
    }
    md
}
