//! The speed sections of simulated manifests: the step-cost model (`cost`: hardware
//! profile, target and drafter shapes, routing), the acceptance profile
//! (`acceptance_profile`: stated rates, a geometric profile from a draft acceptance rate,
//! or the per-position rates of a leg of a record) and speed-up expectations.
//!
//! Where the design comes from: issue 14 ("manifests for the simulator take a hardware
//! profile ... and the acceptance profile (per-position rates) from a record or from
//! stated numbers"); the cost model is [`speclab_engine::cost`].
//!
//! Invariants: every field given takes effect or is refused with the file, the field as
//! written and what was expected ([`check`]); an acceptance profile resolves to a
//! validated non-increasing vector of rates in [0, 1] or to an error.

use std::path::Path;

use serde::{Deserialize, Serialize};
use speclab_engine::sim::AcceptanceModel;

use crate::manifest::{DrafterKind, Manifest};
use crate::record::RunRecord;
use crate::{ExperimentError, Result};

/// Where the per-position acceptance rates come from (instead of `acceptance`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum AcceptanceProfile {
    /// Rates stated directly, with their source.
    Stated { rates: Vec<f64>, source: String },
    /// A constant conditional acceptance `c` (`a_i = c^(i+1)`, unconditional) solved so
    /// that the draft acceptance rate at `at_num_speculative_tokens` drafts,
    /// `mean_{i<N} a_i`, is `draft_acceptance_rate`; `positions` rates are produced.
    Geometric {
        draft_acceptance_rate: f64,
        at_num_speculative_tokens: u32,
        positions: u32,
        source: String,
    },
    /// `acceptance_per_position` of leg `leg` (its id exactly) of a real record.
    FromRecord { record: String, leg: String },
}

/// The reference says: this leg's simulated output tok/s over the `baseline` leg's is
/// `about` (within `within`, absolute on the ratio), or above `more_than`, or below
/// `less_than` (at least one of the three).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeedupExpectation {
    /// Baseline leg pattern (tokens, like `leg`).
    pub baseline: String,
    #[serde(default)]
    pub about: Option<f64>,
    #[serde(default = "default_within")]
    pub within: f64,
    #[serde(default)]
    pub more_than: Option<f64>,
    #[serde(default)]
    pub less_than: Option<f64>,
}

impl SpeedupExpectation {
    /// Whether a ratio satisfies every bound given.
    pub fn holds(&self, r: f64) -> bool {
        self.about.is_none_or(|a| (r - a).abs() <= self.within)
            && self.more_than.is_none_or(|m| r > m)
            && self.less_than.is_none_or(|l| r < l)
    }
}

fn default_within() -> f64 {
    0.05
}

fn invalid(path: &Path, field: &str, msg: impl Into<String>) -> ExperimentError {
    ExperimentError::Invalid {
        path: path.to_path_buf(),
        field: field.into(),
        msg: msg.into(),
    }
}

/// The constant conditional rate `c` with `mean_{i=1..n} c^i = rate` (bisection; the
/// mean is increasing in `c`).
pub fn geometric_conditional(rate: f64, n: u32) -> f64 {
    let mean = |c: f64| (1..=n).map(|i| c.powi(i as i32)).sum::<f64>() / f64::from(n.max(1));
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        if mean(mid) < rate {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

impl AcceptanceProfile {
    /// The per-position rates (validated). `path`: the manifest, for errors.
    pub fn rates(&self, path: &Path) -> Result<Vec<f64>> {
        let at = "acceptance_profile";
        let rates = match self {
            Self::Stated { rates, .. } => rates.clone(),
            Self::Geometric {
                draft_acceptance_rate: r,
                at_num_speculative_tokens: n,
                positions,
                ..
            } => {
                if !(r.is_finite() && *r > 0.0 && *r < 1.0) || *n == 0 || *positions == 0 {
                    return Err(invalid(path, &format!("{at}.geometric"), format!("draft_acceptance_rate {r} must be in (0, 1), at_num_speculative_tokens {n} and positions {positions} >= 1")));
                }
                let c = geometric_conditional(*r, *n);
                (1..=*positions).map(|i| c.powi(i as i32)).collect()
            }
            Self::FromRecord { record, leg } => from_record(path, record, leg)?,
        };
        AcceptanceModel::new(rates.clone()).map_err(|e| invalid(path, at, e.to_string()))?;
        Ok(rates)
    }
}

fn from_record(path: &Path, record: &str, leg: &str) -> Result<Vec<f64>> {
    let field = "acceptance_profile.from_record";
    let rec = RunRecord::load(Path::new(record)).map_err(|e| {
        invalid(
            path,
            &format!("{field}.record"),
            format!("{record:?} (paths are relative to the current directory): {e}"),
        )
    })?;
    let Some(l) = rec.leg(leg) else {
        let ids: Vec<&str> = rec.legs.iter().take(4).map(|l| l.id.as_str()).collect();
        return Err(invalid(
            path,
            &format!("{field}.leg"),
            format!("{leg:?} is not a leg of {record} (its ids look like {ids:?})"),
        ));
    };
    match &l.real {
        Some(r) if !r.acceptance_per_position.is_empty() => Ok(r.acceptance_per_position.clone()),
        _ => Err(invalid(path, &format!("{field}.leg"), format!("leg {leg:?} of {record} has no acceptance_per_position (a real leg with a drafter is expected)"))),
    }
}

/// The manifest's per-position rates: `acceptance`, or the resolved profile.
pub fn acceptance_rates(m: &Manifest, path: &Path) -> Result<Vec<f64>> {
    match &m.acceptance_profile {
        Some(p) => p.rates(path),
        None => Ok(m.acceptance.clone()),
    }
}

/// The largest N any leg drafts.
pub fn max_num_speculative(m: &Manifest) -> u32 {
    m.sweep
        .num_speculative_tokens
        .iter()
        .copied()
        .max()
        .unwrap_or(m.drafter.num_speculative_tokens)
}

/// Checks of the speed sections (module doc).
pub fn check(m: &Manifest, path: &Path) -> Result<()> {
    if m.acceptance_profile.is_some() && !m.acceptance.is_empty() {
        return Err(invalid(
            path,
            "acceptance_profile",
            "give either acceptance (stated rates) or acceptance_profile, not both",
        ));
    }
    if m.acceptance_profile.is_some() {
        if m.drafter.kind == DrafterKind::None {
            return Err(invalid(
                path,
                "acceptance_profile",
                "drafter.kind none drafts nothing, so acceptance rates are unused",
            ));
        }
        acceptance_rates(m, path)?;
    }
    if !m.sweep.num_speculative_tokens.is_empty() && m.drafter.kind == DrafterKind::None {
        return Err(invalid(path, "sweep.num_speculative_tokens", "drafter.kind none drafts nothing; set drafter.kind (N = 0 legs run without the drafter)"));
    }
    if let Some(c) = &m.cost {
        if !m.measure.simulate {
            return Err(invalid(
                path,
                "cost",
                "measure.simulate is off, so no step is priced",
            ));
        }
        c.validate()
            .map_err(|e| invalid(path, "cost", e.to_string()))?;
        let drafts = max_num_speculative(m) > 0 && m.drafter.kind != DrafterKind::None;
        if c.drafter.is_some() && !drafts {
            return Err(invalid(
                path,
                "cost.drafter",
                "no leg drafts (drafter.kind none or N = 0), so the drafter's cost is unused",
            ));
        }
        if c.drafter.is_none() && drafts {
            return Err(invalid(
                path,
                "cost.drafter",
                "legs draft tokens but the drafter's forward has no cost: give cost.drafter",
            ));
        }
    }
    if let Some(r) = m.workload.requests_per_seq {
        if r == 0 || m.workload.each_prompt_alone || m.prompt_lengths().is_empty() {
            return Err(invalid(
                path,
                "workload.requests_per_seq",
                format!("{r}: must be >= 1, with each_prompt_alone: false and prompts to repeat"),
            ));
        }
    }
    for (i, e) in m.expectations.iter().enumerate() {
        if e.speedup.is_some() && m.cost.is_none() {
            return Err(invalid(
                path,
                &format!("expectations[{i}].speedup"),
                "needs a cost model (cost): without one no leg has simulated tok/s",
            ));
        }
        if let Some(sp) = &e.speedup {
            if sp.about.is_none() && sp.more_than.is_none() && sp.less_than.is_none() {
                return Err(invalid(
                    path,
                    &format!("expectations[{i}].speedup"),
                    "states nothing: give about, more_than or less_than",
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometric_profile_reproduces_its_rate() {
        let c = geometric_conditional(0.535, 2);
        assert!(((c + c * c) / 2.0 - 0.535).abs() < 1e-9);
        let p = AcceptanceProfile::Geometric {
            draft_acceptance_rate: 0.535,
            at_num_speculative_tokens: 2,
            positions: 5,
            source: "t".into(),
        };
        let r = p.rates(Path::new("m.ron")).unwrap();
        assert_eq!(r.len(), 5);
        assert!(r.windows(2).all(|w| w[1] < w[0]));
        assert!(((r[0] + r[1]) / 2.0 - 0.535).abs() < 1e-9);
    }

    #[test]
    fn from_record_errors_name_the_field() {
        let p = AcceptanceProfile::FromRecord {
            record: "runs/no-such.json".into(),
            leg: "x".into(),
        };
        let e = p.rates(Path::new("m.ron")).unwrap_err().to_string();
        assert!(
            e.contains("m.ron") && e.contains("from_record.record"),
            "{e}"
        );
    }

    #[test]
    fn the_glm_manifest_expands_and_prices_its_legs() {
        let path = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/glm53-mtp-speedup.ron"
        ));
        let m = Manifest::load(path).unwrap();
        let legs = m.legs().unwrap();
        assert_eq!(legs.len(), 18);
        let l = legs
            .iter()
            .find(|l| crate::findings::leg_matches(&l.id, "n=2 seqs=8"))
            .unwrap();
        assert_eq!(l.prompts.len(), 32, "requests_per_seq 4 x 8 slots");
        assert_eq!(m.drafter_for(l).num_speculative_tokens, 2);
        let base = legs
            .iter()
            .find(|l| crate::findings::leg_matches(&l.id, "n=0 seqs=1"))
            .unwrap();
        assert_eq!(m.drafter_for(base).kind, DrafterKind::None);
        let mut q = crate::runner::Quiet;
        let r0 = crate::runner::run_leg(&m, base, &mut q).unwrap();
        let t0 = r0.sim_time.unwrap();
        assert_eq!(t0.output_tokens, 4 * 1024);
        assert!(t0.terms_us.drafter == 0.0 && t0.output_tok_s > 0.0);
        let one = legs
            .iter()
            .find(|l| crate::findings::leg_matches(&l.id, "n=2 seqs=1"))
            .unwrap();
        let t2 = crate::runner::run_leg(&m, one, &mut q)
            .unwrap()
            .sim_time
            .unwrap();
        assert!(t2.terms_us.drafter > 0.0);
        assert!(
            t2.decode_terms_us.experts / t2.decode_steps as f64
                > t0.decode_terms_us.experts / t0.decode_steps as f64
        );
    }

    #[test]
    fn speed_fields_without_effect_are_refused() {
        let base = "(name: \"t\", kv: (layout: Some((num_blocks: Some(64), max_model_len: 4096, groups: [(name: \"f\", kind: full, block_size: Some(16))])), max_model_len: 4096), workload: (prompts: [100], output_len: 4, each_prompt_alone: false), {})";
        let hw = "hardware: (hbm_gb_s: 100.0, launch_us: 1.0, compute_tflops: 1.0), target: (kernels: 1.0, dense_bytes: 1.0)";
        for (body, field) in [
            (format!("cost: ({hw}), measure: (simulate: false, bound: true)"), "cost"),
            (format!("drafter: (kind: mtp, num_speculative_tokens: 2), acceptance: [0.5], cost: ({hw})"), "cost.drafter"),
            ("drafter: (kind: mtp, num_speculative_tokens: 2), acceptance: [0.5], acceptance_profile: stated(rates: [0.5], source: \"x\")".to_string(), "acceptance_profile"),
            ("sweep: (num_speculative_tokens: [0, 1])".to_string(), "sweep.num_speculative_tokens"),
        ] {
            let text = base.replace("{}", &body);
            let p = Path::new("t.ron");
            let m: Manifest = crate::manifest::parse_ron(p, &text).unwrap();
            let e = m.validate(p).unwrap_err().to_string();
            assert!(e.contains(field), "{body}: {e}");
        }
    }
}
