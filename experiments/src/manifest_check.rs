//! Manifest checks beyond types: every field takes effect, every size is bounded.
//!
//! A manifest field that would be read nowhere in the combination given (a
//! `drafter.sliding_window` next to an explicit layout, `acceptance` without a drafter,
//! `kv.kv_cache_memory_bytes` next to `num_blocks`, `real.ngram_min` without the
//! `ngram` drafter, ...) is refused, naming the field as the user wrote it and why it
//! would have no effect. User-driven sizes (generated prompts, legs, pools) are bounded
//! before anything is allocated, and the error states the numbers.
//!
//! Invariant: a manifest that passes these checks and `Manifest::validate` has no field
//! without effect and expands into at most [`MAX_LEGS`] legs of at most [`MAX_PROMPTS`]
//! prompts each.

use std::path::Path;

use speclab_engine::kv::{CapPolicy, GroupKind};

use crate::manifest::{DrafterKind, Manifest, PRESET_GLM53_DFLASH2, PRESET_GLM53_MTP};
use crate::real::{RealDrafter, RealSpec};
use crate::{ExperimentError, Result};

/// Most prompts a simulated workload may have (listed + generated).
pub const MAX_PROMPTS: u64 = 100_000;
/// Most legs a manifest may expand into.
pub const MAX_LEGS: u64 = 100_000;
/// Most tokens the generated prompts of a real manifest may hold (count x len).
pub const MAX_GENERATED_TOKENS: u64 = 16 << 20;

fn bad(path: &Path, field: &str, msg: impl Into<String>) -> ExperimentError {
    ExperimentError::Invalid {
        path: path.to_path_buf(),
        field: field.into(),
        msg: msg.into(),
    }
}

/// Sizes of a simulated manifest, checked before the sweep is expanded.
pub fn check_sizes(m: &Manifest, path: &Path) -> Result<()> {
    let listed = m.workload.prompts.len() as u64;
    let generated = m.workload.generate.map_or(0, |g| u64::from(g.count));
    let prompts = listed.saturating_add(generated);
    if prompts > MAX_PROMPTS {
        return Err(bad(
            path,
            if generated > 0 { "workload.generate.count" } else { "workload.prompts" },
            format!("{prompts} prompts ({listed} listed + {generated} generated) is above the supported maximum {MAX_PROMPTS}"),
        ));
    }
    let per_pool = if m.workload.each_prompt_alone {
        prompts.max(1)
    } else {
        1
    };
    let axis = |n: usize| (n as u64).max(1);
    let legs = axis(m.sweep.block_sizes.len())
        .saturating_mul(axis(m.sweep.caps.len()))
        .saturating_mul(axis(m.sweep.num_blocks.len()))
        .saturating_mul(per_pool);
    if legs > MAX_LEGS {
        return Err(bad(
            path,
            "sweep",
            format!("the sweep expands into {legs} legs ({} block sizes x {} caps x {} pools x {per_pool} prompt groups), above the supported maximum {MAX_LEGS}",
                axis(m.sweep.block_sizes.len()), axis(m.sweep.caps.len()), axis(m.sweep.num_blocks.len())),
        ));
    }
    if m.max_steps == 0 {
        return Err(bad(path, "max_steps", "must be > 0"));
    }
    if m.workload.output_len == 0 {
        return Err(bad(
            path,
            "workload.output_len",
            "must be >= 1 (output tokens per request)",
        ));
    }
    if let Some(g) = m.workload.generate {
        let mml = u64::from(m.kv.max_model_len);
        if g.max > mml {
            return Err(bad(
                path,
                "workload.generate.max",
                format!(
                    "{} is above kv.max_model_len {mml}: prompts must fit max_model_len",
                    g.max
                ),
            ));
        }
    }
    Ok(())
}

/// Fields of the `kv` section that would have no effect.
fn check_kv(m: &Manifest, path: &Path) -> Result<()> {
    let kv = &m.kv;
    let b = |f: &str, msg: &str| Err(bad(path, f, msg));
    if kv.preset.is_some() && kv.layout.is_some() {
        return b(
            "kv.layout",
            "given together with kv.preset, which builds its own layout; give one of them",
        );
    }
    if let Some(l) = &kv.layout {
        if kv.memory.is_some() {
            return b(
                "kv.memory",
                "is the preset's byte model; with kv.layout give each group's memory in the layout",
            );
        }
        if kv.kv_cache_memory_bytes.is_some() && l.kv_cache_memory_bytes.is_some() {
            return b(
                "kv.kv_cache_memory_bytes",
                "given in kv and in kv.layout; give it once",
            );
        }
        let sized_groups = l
            .groups
            .iter()
            .any(|g| matches!(g.kind, GroupKind::Full | GroupKind::RingBuffer));
        if !sized_groups && (kv.block_size.is_some() || !m.sweep.block_sizes.is_empty()) {
            return b(
                "kv.block_size",
                "sets the block size of full and ring_buffer groups, and kv.layout has none",
            );
        }
        if m.drafter.sliding_window.is_some() {
            return b("drafter.sliding_window", "kv.layout sets its sliding-window groups' windows itself (groups[i].sliding_window); leave this out or use kv.preset");
        }
    }
    if kv.preset.as_deref() == Some(PRESET_GLM53_DFLASH2) && m.drafter.kind != DrafterKind::Dflash2
    {
        return b("drafter.kind", "kv.preset glm53-flash-dflash2 models the DFlash2 drafter's sliding-window KV group; it needs drafter.kind dflash2 (or give kv.layout)");
    }
    if kv.preset.as_deref() == Some(PRESET_GLM53_MTP) && m.drafter.kind != DrafterKind::Mtp {
        return b(
            "drafter.kind",
            "kv.preset glm53-flash-mtp plans the MTP head's KV layers; it needs drafter.kind mtp",
        );
    }
    let pool_given = kv.num_blocks.is_some()
        || !m.sweep.num_blocks.is_empty()
        || kv.layout.as_ref().is_some_and(|l| l.num_blocks.is_some());
    let bytes_given = kv.kv_cache_memory_bytes.is_some()
        || kv
            .layout
            .as_ref()
            .is_some_and(|l| l.kv_cache_memory_bytes.is_some());
    if pool_given && bytes_given {
        return b("kv.kv_cache_memory_bytes", "num_blocks (or sweep.num_blocks) overrides it, as vLLM's num_gpu_blocks_override does, so it would be ignored; give one of them");
    }
    if kv.preset.is_some() && kv.memory.is_some() && !bytes_given {
        return b(
            "kv.memory",
            "the byte model only sizes the pool from kv.kv_cache_memory_bytes, which is not given",
        );
    }
    if let (Some(n), false) = (kv.num_blocks, m.sweep.num_blocks.is_empty()) {
        if !m.sweep.num_blocks.contains(&n) {
            return Err(bad(
                path,
                "kv.num_blocks",
                format!(
                    "{n} is not one of sweep.num_blocks {:?}, which replace it",
                    m.sweep.num_blocks
                ),
            ));
        }
    }
    if let (Some(bs), false) = (kv.block_size, m.sweep.block_sizes.is_empty()) {
        if !m.sweep.block_sizes.contains(&bs) {
            return Err(bad(
                path,
                "kv.block_size",
                format!(
                    "{bs} is not one of sweep.block_sizes {:?}, which replace it",
                    m.sweep.block_sizes
                ),
            ));
        }
    }
    if !m.sweep.caps.is_empty() && kv.cap != CapPolicy::default() && !m.sweep.caps.contains(&kv.cap)
    {
        return b("kv.cap", "is not one of sweep.caps, which replace it");
    }
    Ok(())
}

/// Fields of the drafter, acceptance, workload, measure and expectations sections that
/// would have no effect.
fn check_sim(m: &Manifest, path: &Path) -> Result<()> {
    let d = &m.drafter;
    if !d.kind.is_dflash() {
        for (f, given) in [
            ("drafter.block_size", d.block_size.is_some()),
            ("drafter.sliding_window", d.sliding_window.is_some()),
        ] {
            if given {
                return Err(bad(
                    path,
                    f,
                    format!(
                        "only DFlash drafters have it, and drafter.kind is {}",
                        d.kind.name()
                    ),
                ));
            }
        }
    }
    if d.sliding_window == Some(0) {
        return Err(bad(path, "drafter.sliding_window", "must be > 0 (tokens)"));
    }
    if d.kind == DrafterKind::None && d.num_speculative_tokens != 0 {
        return Err(bad(
            path,
            "drafter.num_speculative_tokens",
            "drafter.kind none drafts nothing; leave N out (0)",
        ));
    }
    check_n_axis(m, path)?;
    if m.measure.concurrency && !m.measure.simulate {
        return Err(bad(
            path,
            "measure.concurrency",
            "needs measure.simulate: true (concurrency is counted over simulated steps)",
        ));
    }
    if !m.measure.simulate && !m.measure.bound {
        return Err(bad(
            path,
            "measure",
            "simulate and bound are both off: the legs would measure nothing",
        ));
    }
    if !m.acceptance.is_empty() {
        if d.kind == DrafterKind::None {
            return Err(bad(
                path,
                "acceptance",
                "drafter.kind none drafts nothing, so acceptance rates are unused",
            ));
        }
        let max_n = m
            .sweep
            .num_speculative_tokens
            .iter()
            .copied()
            .max()
            .unwrap_or(d.num_speculative_tokens);
        if m.acceptance.len() as u64 > u64::from(max_n) {
            return Err(bad(path, "acceptance", format!("{} rates for drafter.num_speculative_tokens {max_n} (the largest N of the legs): positions beyond N are never drafted", m.acceptance.len())));
        }
        if !m.measure.simulate {
            return Err(bad(
                path,
                "acceptance",
                "measure.simulate is off, so acceptance rates are unused",
            ));
        }
    }
    if !m.measure.simulate
        && m.workload.output_len != crate::manifest::Workload::default().output_len
    {
        return Err(bad(
            path,
            "workload.output_len",
            "measure.simulate is off, so no request generates output",
        ));
    }
    Ok(())
}

/// `sweep.num_speculative_tokens`: a drafter to vary, no duplicates, N within a DFlash
/// drafter's block (N <= block_size - 1), N > 0 with `kv.plan` on the DFlash2 preset.
fn check_n_axis(m: &Manifest, path: &Path) -> Result<()> {
    let axis = &m.sweep.num_speculative_tokens;
    if axis.is_empty() {
        return Ok(());
    }
    let f = "sweep.num_speculative_tokens";
    if m.drafter.kind == DrafterKind::None {
        return Err(bad(
            path,
            f,
            "drafter.kind is none: give the drafter whose N the axis varies",
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for &n in axis {
        if !seen.insert(n) {
            return Err(bad(
                path,
                f,
                format!("{n} is listed twice (two legs with one id)"),
            ));
        }
        // The MTP preset plans N = 0 as the target alone (no head loaded); the DFlash2
        // preset always has the drafter's sliding-window group.
        let mtp = m.kv.preset.as_deref() == Some(PRESET_GLM53_MTP);
        if n == 0 && m.kv.plan.is_some() && !mtp {
            return Err(bad(path, f, "0 with kv.plan and the glm53-flash-dflash2 preset: its plan always has the DFlash2 drafter's sliding-window group; give N > 0 (the glm53-flash-mtp preset plans N = 0 without a drafter)"));
        }
        if let Some(b) = m.drafter.block_size.filter(|_| m.drafter.kind.is_dflash()) {
            if n + 1 > b {
                return Err(bad(path, f, format!("{n} exceeds the DFlash drafter's block: drafter.block_size {b} drafts at most {} tokens (N <= block_size - 1)", b - 1)));
            }
        }
    }
    Ok(())
}

/// Expectations must name a leg and say something comparable.
fn check_expectations(m: &Manifest, path: &Path, leg_ids: &[String]) -> Result<()> {
    const STATUSES: [&str; 6] = [
        "COMPLETED",
        "STEP_LIMIT",
        "WEDGED",
        "REJECTED",
        "BOUND_ONLY",
        "REFUSED_AT_STARTUP",
    ];
    for (i, e) in m.expectations.iter().enumerate() {
        let f = |k: &str| format!("expectations[{i}].{k}");
        let matches = leg_ids
            .iter()
            .any(|id| crate::findings::leg_matches(id, &e.leg));
        if !matches {
            let some: Vec<&str> = leg_ids.iter().take(3).map(String::as_str).collect();
            return Err(bad(path, &f("leg"), format!("{:?} matches no leg (leg ids look like {some:?}; every token of the pattern must be a token of the leg id)", e.leg)));
        }
        if e.bound_about.is_none()
            && e.no_wedge_in.is_none()
            && e.status.is_none()
            && e.peak_at_most.is_none()
            && e.max_concurrency_about.is_none()
            && e.kv_cache_tokens_about.is_none()
            && e.starts.is_none()
            && e.speedup.is_none()
            && e.peak_running.is_none()
            && e.outputs_equal_control.is_none()
        {
            return Err(bad(
                path,
                &format!("expectations[{i}]"),
                "states nothing to compare: give bound_about, no_wedge_in, status, peak_at_most, max_concurrency_about, kv_cache_tokens_about, starts, peak_running, speedup or (real manifests) outputs_equal_control",
            ));
        }
        if e.tolerance.is_some() && e.bound_about.is_none() && e.kv_cache_tokens_about.is_none() {
            return Err(bad(
                path,
                &f("tolerance"),
                "applies to bound_about or kv_cache_tokens_about, neither of which is given",
            ));
        }
        if e.peak_running.is_some() && !(m.measure.concurrency && m.measure.simulate) {
            return Err(bad(
                path,
                &f("peak_running"),
                "needs measure.concurrency: true and measure.simulate: true (no concurrency is measured)",
            ));
        }
        if e.bound_about.is_some() && !m.measure.bound {
            return Err(bad(
                path,
                &f("bound_about"),
                "needs measure.bound: true (no bound is measured)",
            ));
        }
        if let Some(s) = &e.status {
            if !STATUSES.contains(&s.as_str()) {
                return Err(bad(
                    path,
                    &f("status"),
                    format!("{s:?}: expected one of {}", STATUSES.join(", ")),
                ));
            }
        }
    }
    Ok(())
}

/// Expectations of a real manifest: only `status` and `outputs_equal_control` (the other
/// kinds read simulated measurements), each naming some real leg.
pub fn check_real_expectations(
    m: &Manifest,
    real: &crate::real::RealSpec,
    path: &Path,
) -> Result<()> {
    for (i, e) in m.expectations.iter().enumerate() {
        let sim_only = [
            ("bound_about", e.bound_about.is_some()),
            ("tolerance", e.tolerance.is_some()),
            ("no_wedge_in", e.no_wedge_in.is_some()),
            ("peak_at_most", e.peak_at_most.is_some()),
            ("max_concurrency_about", e.max_concurrency_about.is_some()),
            ("kv_cache_tokens_about", e.kv_cache_tokens_about.is_some()),
            ("speedup", e.speedup.is_some()),
            ("starts", e.starts.is_some()),
            ("peak_running", e.peak_running.is_some()),
        ];
        if let Some((k, _)) = sim_only.iter().find(|(_, g)| *g) {
            return Err(bad(
                path,
                &format!("expectations[{i}].{k}"),
                "reads simulated measurements; a real manifest's expectations give status or outputs_equal_control",
            ));
        }
    }
    let ids: Vec<String> = real.legs().into_iter().map(|l| l.id).collect();
    check_expectations(m, path, &ids)
}

/// Every simulated-manifest field takes effect (module doc), and every leg's pool (also
/// one sized from bytes) is within [`speclab_engine::kv::pool::MAX_NUM_BLOCKS`].
pub fn check_fields(m: &Manifest, path: &Path, legs: &[crate::manifest::Leg]) -> Result<()> {
    check_sim(m, path)?;
    check_kv(m, path)?;
    let max = speclab_engine::kv::pool::MAX_NUM_BLOCKS;
    if let Some(l) = legs.iter().find(|l| l.num_blocks > max) {
        return Err(bad(
            path,
            "kv.kv_cache_memory_bytes",
            format!(
                "leg {}: the pool would have {} blocks, above the supported maximum {max}",
                l.id, l.num_blocks
            ),
        ));
    }
    if let Some(i) = m
        .expectations
        .iter()
        .position(|e| e.outputs_equal_control.is_some())
    {
        return Err(bad(
            path,
            &format!("expectations[{i}].outputs_equal_control"),
            "compares real legs' outputs; a simulated manifest has none",
        ));
    }
    let ids: Vec<String> = legs.iter().map(|l| l.id.clone()).collect();
    check_expectations(m, path, &ids)
}

/// Top-level fields a manifest with `real` does not read (`real` has its own).
pub fn check_real_top(m: &Manifest, path: &Path) -> Result<()> {
    let defaults: Manifest = crate::manifest::parse_ron(Path::new("<defaults>"), "(name: \"d\")")?;
    if m.seed != defaults.seed {
        return Err(bad(
            path,
            "seed",
            "the simulator's seed; a manifest with `real` takes its seed in real.seed",
        ));
    }
    if m.max_steps != defaults.max_steps {
        return Err(bad(
            path,
            "max_steps",
            "the simulator's step backstop; a manifest with `real` takes it in real.max_steps",
        ));
    }
    Ok(())
}

/// Fields of a `real` section that would have no effect, and its bounded sizes.
pub fn check_real(r: &RealSpec, path: &Path) -> Result<()> {
    let has = |d: RealDrafter| r.drafters.contains(&d);
    let dflash = r.drafters.iter().any(|d| d.is_dflash());
    let defaults: RealSpec =
        crate::manifest::parse_ron(Path::new("<defaults>"), "(model: \"\", prompts: ())")?;
    if r.ngram_min == 0 {
        return Err(bad(
            path,
            "real.ngram_min",
            "must be >= 1 (shortest n-gram the prompt lookup matches)",
        ));
    }
    if r.ngram_max < r.ngram_min {
        return Err(bad(
            path,
            "real.ngram_max",
            format!("{} is below real.ngram_min {}", r.ngram_max, r.ngram_min),
        ));
    }
    if !has(RealDrafter::Ngram) {
        for (f, differs) in [
            ("real.ngram_min", r.ngram_min != defaults.ngram_min),
            ("real.ngram_max", r.ngram_max != defaults.ngram_max),
        ] {
            if differs {
                return Err(bad(
                    path,
                    f,
                    "no `ngram` drafter in real.drafters, so the n-gram bounds are unused",
                ));
            }
        }
    }
    if !dflash {
        for (f, differs) in [
            (
                "real.drafter_block_size",
                r.drafter_block_size != defaults.drafter_block_size,
            ),
            ("real.cap", r.cap != defaults.cap),
            ("real.skip_missing_drafters", r.skip_missing_drafters),
        ] {
            if differs {
                return Err(bad(path, f, "applies to DFlash drafters only, and real.drafters has neither dflash2 nor dflash1"));
            }
        }
    }
    for k in r.drafter_dirs.keys() {
        let used = match RealDrafter::from_name(k) {
            Some(RealDrafter::Dflash2) => {
                has(RealDrafter::Dflash2)
                    || (has(RealDrafter::Dflash1) && !r.drafter_dirs.contains_key("dflash1"))
            }
            Some(d) => has(d),
            None => true, // reported by RealSpec::validate with the kinds it knows
        };
        if !used {
            return Err(bad(
                path,
                &format!("real.drafter_dirs.{k}"),
                format!("`{k}` is not in real.drafters, so this directory is unused"),
            ));
        }
    }
    let shared_used = r
        .drafters
        .iter()
        .any(|d| *d != RealDrafter::None && !r.num_speculative_tokens_for.contains_key(d.name()));
    if !r.num_speculative_tokens.is_empty() && !shared_used {
        return Err(bad(path, "real.num_speculative_tokens", "every drafter in real.drafters is `none` or has its own list in num_speculative_tokens_for, so this list is unused"));
    }
    check_real_sizes(r, path, &defaults)
}

/// Bounded sizes of a `real` section, and its sampling seed's use.
fn check_real_sizes(r: &RealSpec, path: &Path, defaults: &RealSpec) -> Result<()> {
    if let Some(n) = r.num_blocks {
        if n > speclab_engine::kv::pool::MAX_NUM_BLOCKS {
            return Err(bad(
                path,
                "real.num_blocks",
                format!(
                    "{n} blocks is above the supported maximum {}",
                    speclab_engine::kv::pool::MAX_NUM_BLOCKS
                ),
            ));
        }
    }
    if let Some(g) = r.prompts.generated {
        let tokens = (g.count as u64).saturating_mul(g.len as u64);
        if tokens > MAX_GENERATED_TOKENS {
            return Err(bad(path, "real.prompts.generated", format!("count {} x len {} = {tokens} tokens is above the supported maximum {MAX_GENERATED_TOKENS}", g.count, g.len)));
        }
    }
    if let Some(c) = r.prompts.count {
        if r.prompts.offset.checked_add(c).is_none() {
            return Err(bad(
                path,
                "real.prompts.count",
                format!("offset {} + count {c} overflows", r.prompts.offset),
            ));
        }
    }
    if r.temperatures.iter().all(|&t| t == 0.0) && r.seed != defaults.seed {
        return Err(bad(
            path,
            "real.seed",
            "every temperature is 0 (greedy), so the sampling seed is unused",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A valid manifest with `body` added; a `kv:` or `workload:` in `body` replaces the base one.
    fn sim(body: &str) -> String {
        let kv = "kv: (preset: Some(\"glm53-flash-dflash2\"), block_size: Some(2304), cap: none, num_blocks: Some(1012)), ";
        let wl = "workload: (prompts: [1000]), ";
        let text = format!(
            "(name: \"t\", {}drafter: (kind: dflash2, num_speculative_tokens: 7, block_size: Some(8)), {}{body})",
            if body.contains("kv:") { "" } else { kv },
            if body.contains("workload:") { "" } else { wl },
        );
        let p = Path::new("m.ron");
        match crate::manifest::parse_ron::<Manifest>(p, &text).and_then(|m| m.validate(p)) {
            Ok(()) => "ok".into(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn the_base_manifest_is_valid() {
        assert_eq!(sim("seed: 0"), "ok");
    }

    #[test]
    fn fields_without_effect_are_refused_by_name() {
        for (body, field) in [
            ("acceptance: [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]", "acceptance"),
            ("kv: (preset: Some(\"glm53-flash-dflash2\"), block_size: Some(2304), num_blocks: Some(1012), kv_cache_memory_bytes: Some(1000000))", "kv.kv_cache_memory_bytes"),
            ("kv: (preset: Some(\"glm53-flash-dflash2\"), block_size: Some(999), num_blocks: Some(1012)), sweep: (block_sizes: [2304])", "kv.block_size"),
            ("measure: (simulate: false, bound: false)", "measure"),
            ("expectations: [(leg: \"bs=16\", source: \"x\", status: Some(\"WEDGED\"))]", "expectations[0].leg"),
            ("expectations: [(leg: \"bs=2304\", source: \"x\")]", "expectations[0]"),
            ("workload: (prompts: [1000], output_len: 0)", "workload.output_len"),
            ("workload: (generate: Some((count: 4000000000, min: 1, max: 10)))", "workload.generate.count"),
        ] {
            let e = sim(body);
            assert!(e.starts_with(&format!("m.ron: {field}: ")), "{body}: {e}");
        }
    }

    #[test]
    fn real_manifests_refuse_fields_they_do_not_read() {
        let p = Path::new("r.ron");
        for (body, field) in [
            ("seed: 3, real: (model: \"m\", prompts: ())", "seed"),
            ("real: (model: \"m\", prompts: (), ngram_min: 2)", "real.ngram_min"),
            ("real: (model: \"m\", prompts: (), ngram_min: 0, drafters: [ngram], num_speculative_tokens: [1])", "real.ngram_min"),
            ("real: (model: \"m\", prompts: (), cap: none)", "real.cap"),
            ("real: (model: \"m\", prompts: (), num_speculative_tokens: [3])", "real.num_speculative_tokens"),
            ("real: (model: \"m\", prompts: (generated: (count: 100000, len: 100000)))", "real.prompts.generated"),
        ] {
            let m: Manifest = crate::manifest::parse_ron(p, &format!("(name: \"r\", {body})")).unwrap();
            let e = m.validate(p).unwrap_err().to_string();
            assert!(e.starts_with(&format!("r.ron: {field}: ")), "{body}: {e}");
        }
    }

    #[test]
    fn drafter_window_takes_effect_with_the_preset() {
        let p = Path::new("m.ron");
        let text = |w: u32| {
            format!(
            "(name: \"t\", kv: (preset: Some(\"glm53-flash-dflash2\"), block_size: Some(2304), cap: window_plus_two, num_blocks: Some(1012)), \
             drafter: (kind: dflash2, num_speculative_tokens: 3, sliding_window: Some({w})), workload: (prompts: [1000]))"
        )
        };
        let window = |w: u32| {
            let m: Manifest = crate::manifest::parse_ron(p, &text(w)).unwrap();
            m.validate(p).unwrap();
            let leg = m.legs().unwrap().remove(0);
            let g = leg
                .layout
                .groups
                .iter()
                .find(|g| g.name == "drafter_swa")
                .cloned()
                .unwrap();
            let state = leg
                .layout
                .groups
                .iter()
                .find(|g| g.name == "kda0")
                .cloned()
                .unwrap();
            (g.sliding_window, state.num_speculative_blocks)
        };
        assert_eq!(window(512), (Some(512), 3));
        assert_eq!(window(2048), (Some(2048), 3));
    }
}
