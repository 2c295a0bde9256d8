//! Findings sections for planned records: the vLLM 0.33.0 pool plan of each assumption
//! set x block size, and, when a record holds several assumption sets, a matrix judging
//! every reference statement under every set (which sets make all of them hold at once).
//!
//! Everything rendered here is read from the record (`RunRecord.plans` and the legs'
//! bounds), never recomputed. Invariant: a set's cell judges only legs whose id carries
//! all of the set's tokens and the expectation's tokens.

use std::fmt::Write as _;

use crate::findings::{judge, leg_matches, thousands};
use crate::manifest::{Expectation, Manifest};
use crate::record::{LegRecord, LegStatus, RunRecord};

/// The reference column for the plan-only expectation kinds.
pub fn reference_text(e: &Expectation) -> Option<String> {
    if let Some(c) = e.max_concurrency_about {
        return Some(format!("maximum concurrency {c:.2}x"));
    }
    if let Some(t) = e.kv_cache_tokens_about {
        return Some(format!("KV cache {} tokens", thousands(t)));
    }
    e.starts
        .map(|s| if s { "vLLM starts" } else { "vLLM refuses" }.to_string())
}

/// Judge the plan-only expectation kinds (None when `e` is another kind).
pub fn judge_plan(
    e: &Expectation,
    rec: &RunRecord,
    legs: &[&LegRecord],
) -> Option<(String, &'static str)> {
    let verdict = |ok: bool| if ok { "matched" } else { "NOT matched" };
    let plan = legs.iter().find_map(|l| rec.plan_of(&l.id));
    if let Some(about) = e.max_concurrency_about {
        let Some(p) = plan else {
            return Some(("no plan recorded".into(), "not measured"));
        };
        let got = p.plan.max_concurrency;
        let ok = (got * 100.0).round() == (about * 100.0).round();
        return Some((format!("{got:.3}x"), verdict(ok)));
    }
    if let Some(about) = e.kv_cache_tokens_about {
        let Some(p) = plan else {
            return Some(("no plan recorded".into(), "not measured"));
        };
        let got = p.plan.kv_cache_tokens;
        let ok = got.abs_diff(about) <= e.tolerance.unwrap_or(about / 50);
        return Some((thousands(got), verdict(ok)));
    }
    if let Some(want) = e.starts {
        let got = match plan {
            Some(p) => p.plan.starts,
            None => legs.iter().all(|l| l.status != LegStatus::RefusedAtStartup),
        };
        let word = if got { "starts" } else { "refused" };
        return Some((word.into(), verdict(got == want)));
    }
    None
}

fn block_text(requested: u64, effective: u64) -> String {
    if requested == effective {
        requested.to_string()
    } else {
        format!("{requested} -> **{effective}**")
    }
}

/// Render the plan sections; returns true when the record holds several assumption sets
/// (the per-set matrix then replaces the flat comparison table).
pub fn render(md: &mut String, rec: &RunRecord, m: Option<&Manifest>) -> bool {
    if rec.plans.is_empty() {
        return false;
    }
    let mml = m.map(|m| u64::from(m.kv.max_model_len)).unwrap_or(0);
    let _ = writeln!(
        md,
        "## Pool planning (vLLM 0.33.0 rules, `speclab_engine::kv::hybrid`)\n"
    );
    let _ = writeln!(md, "Per assumption set and requested `--block-size`: the block size vLLM uses (bold when `Platform._align_hybrid_block_size` changes it), bytes of one pool block (largest group), KV memory per rank, `num_blocks` (incl. the null block), blocks one {}-token request needs (sum over groups), and vLLM's boot line \"GPU KV cache size: N tokens, Maximum concurrency: Cx\"; `starts` = the startup check passes (that sum <= num_blocks - 1).\n", thousands(mml));
    let _ = writeln!(md, "| assumption set | --block-size | groups (kind:layers) | bytes per block | KV memory | num_blocks | blocks per request | max concurrency | KV cache tokens | starts |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|");
    // One row per distinct plan of a set and block size: a swept N changes the KDA pages
    // and the state blocks a request holds (the row then names the first leg's N).
    let mut seen = Vec::new();
    for p in &rec.plans {
        let key = (p.set.clone(), p.plan.requested_block_size, &p.plan);
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        let base = if p.set.is_empty() { "(base)" } else { &p.set };
        let swept_n = m.is_some_and(|m| !m.sweep.num_speculative_tokens.is_empty());
        let label = match p.leg.split(' ').find(|t| t.starts_with("n=")) {
            Some(n) if swept_n => format!("{base} {n}"),
            _ => base.to_string(),
        };
        let groups: Vec<String> = p
            .plan
            .groups
            .iter()
            .map(|g| format!("{}:{}", kind_word(g.kind), g.num_layers))
            .collect();
        let _ = writeln!(
            md,
            "| `{}` | {} | {} | {} | {}{} | {} | {} | {:.3}x | {} | {} |",
            label,
            block_text(p.plan.requested_block_size, p.plan.effective_block_size),
            groups.join(" "),
            thousands(p.plan.bytes_per_block),
            thousands(p.kv_cache_memory_bytes),
            if p.overridden { " (override)" } else { "" },
            thousands(p.plan.num_blocks),
            thousands(p.plan.blocks_per_request),
            p.plan.max_concurrency,
            thousands(p.plan.kv_cache_tokens),
            if p.plan.starts { "yes" } else { "**no**" }
        );
    }
    let _ = writeln!(md);
    let mut sets: Vec<&str> = Vec::new();
    for p in &rec.plans {
        if !sets.contains(&p.set.as_str()) {
            sets.push(&p.set);
        }
    }
    let Some(m) = m else { return false };
    if sets.len() < 2 || m.expectations.is_empty() {
        return false;
    }
    matrix(md, rec, m, &sets);
    true
}

fn kind_word(k: speclab_engine::kv::GroupKind) -> &'static str {
    use speclab_engine::kv::GroupKind;
    match k {
        GroupKind::Full => "full",
        GroupKind::SlidingWindow => "swa",
        GroupKind::State => "state",
        GroupKind::RingBuffer => "ring",
    }
}

/// The per-set verdict matrix.
fn matrix(md: &mut String, rec: &RunRecord, m: &Manifest, sets: &[&str]) {
    let _ = writeln!(md, "## Reference statements under every assumption set\n");
    for (i, e) in m.expectations.iter().enumerate() {
        let what = reference_text(e)
            .or_else(|| e.bound_about.map(|b| format!("bound ~{}", thousands(b))))
            .or_else(|| {
                e.no_wedge_in
                    .map(|(lo, hi)| format!("no wedge across {}-{}", thousands(lo), thousands(hi)))
            })
            .or_else(|| e.status.clone())
            .unwrap_or_default();
        let _ = writeln!(md, "- **S{}** `{}`: {what} ({})", i + 1, e.leg, e.source);
    }
    let heads: Vec<String> = (1..=m.expectations.len())
        .map(|i| format!("S{i}"))
        .collect();
    let _ = writeln!(
        md,
        "\n| assumption set | {} | all hold |",
        heads.join(" | ")
    );
    let _ = writeln!(md, "|---|{}---|", "---|".repeat(heads.len()));
    let mut winners = Vec::new();
    for set in sets {
        let mut sub = rec.clone();
        sub.legs.retain(|l| leg_matches(&l.id, set));
        let mut cells = Vec::new();
        let mut all = true;
        for e in &m.expectations {
            let (obs, v) = judge(e, &sub);
            all &= v == "matched";
            let mark = if v == "matched" { "ok" } else { "**no**" };
            cells.push(format!("{obs} {mark}"));
        }
        if all {
            winners.push(*set);
        }
        let _ = writeln!(
            md,
            "| `{set}` | {} | {} |",
            cells.join(" | "),
            if all { "**yes**" } else { "no" }
        );
    }
    let _ = writeln!(md);
    if winners.is_empty() {
        let _ = writeln!(
            md,
            "**No assumption set makes every statement hold at once** ({} sets searched).\n",
            sets.len()
        );
    } else {
        let list: Vec<String> = winners.iter().map(|w| format!("`{w}`")).collect();
        let _ = writeln!(
            md,
            "**Every statement holds under {} of {} sets:** {}.\n",
            winners.len(),
            sets.len(),
            list.join(", ")
        );
    }
}
