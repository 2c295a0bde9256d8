//! Findings of simulated legs priced by a step-cost model: simulated throughput, speed-up
//! against the N = 0 leg of the same concurrency, and where a decode step's time goes.
//!
//! Every number comes from the record's `sim_time` of each leg
//! ([`crate::record::SimTimeRecord`]); speed-up expectations (`speedup`) are judged on
//! the ratio of output tok/s of a leg to its baseline leg.
//!
//! Invariant: a record without `sim_time` renders nothing here.

use std::fmt::Write;

use crate::findings::leg_matches;
use crate::manifest_cost::SpeedupExpectation;
use crate::record::{LegRecord, RunRecord, SimTimeRecord};

/// The baseline of a leg: the leg whose id is this one's with `n=0` for its `n=N`.
fn baseline<'a>(rec: &'a RunRecord, l: &LegRecord) -> Option<&'a SimTimeRecord> {
    let toks: Vec<String> =
        l.id.split(' ')
            .map(|t| {
                if t.starts_with("n=") {
                    "n=0".to_string()
                } else {
                    t.to_string()
                }
            })
            .collect();
    let id = toks.join(" ");
    (id != l.id)
        .then(|| rec.leg(&id).and_then(|b| b.sim_time.as_ref()))
        .flatten()
}

fn pct(x: f64) -> String {
    format!("{:+.1}%", 100.0 * (x - 1.0))
}

/// The simulated-speed tables (nothing without priced legs).
pub fn render(md: &mut String, rec: &RunRecord) {
    let legs: Vec<(&LegRecord, &SimTimeRecord)> = rec
        .legs
        .iter()
        .filter_map(|l| l.sim_time.as_ref().map(|t| (l, t)))
        .collect();
    if legs.is_empty() {
        return;
    }
    let _ = writeln!(md, "## Simulated speed (step-cost model)\n");
    let _ = writeln!(md, "Output tok/s = output tokens / simulated time of every step (prefill included); decode tok/s = tokens of the decode-only steps / their time; speed-up = output tok/s / the `n=0` leg's at the same concurrency.\n");
    let _ = writeln!(md, "| leg | tau | output tok/s | speed-up | decode tok/s | decode speed-up | decode step (us) | rows/step | prefill share of time |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|");
    for (l, t) in &legs {
        let b = baseline(rec, l);
        let sp = b.map_or("-".into(), |b| pct(t.output_tok_s / b.output_tok_s));
        let dsp = b
            .and_then(|b| Some(t.decode_tok_s? / b.decode_tok_s?))
            .map_or("-".into(), pct);
        let prefill_share = 1.0 - t.decode_terms_us.total() / t.terms_us.total().max(1e-12);
        let _ = writeln!(
            md,
            "| `{}` | {} | {:.1} | {} | {} | {} | {} | {} | {:.1}% |",
            l.id,
            l.spec
                .mean_acceptance_length
                .map_or("-".into(), |x| format!("{x:.3}")),
            t.output_tok_s,
            sp,
            t.decode_tok_s.map_or("-".into(), |x| format!("{x:.1}")),
            dsp,
            t.mean_decode_step_us
                .map_or("-".into(), |x| format!("{x:.0}")),
            t.mean_decode_rows.map_or("-".into(), |x| format!("{x:.1}")),
            100.0 * prefill_share
        );
    }
    render_terms(md, &legs);
}

/// Mean us per decode-only step, by term.
fn render_terms(md: &mut String, legs: &[(&LegRecord, &SimTimeRecord)]) {
    let names: Vec<&str> = legs[0]
        .1
        .decode_terms_us
        .terms()
        .iter()
        .map(|t| t.0)
        .collect();
    let _ = writeln!(
        md,
        "\nMean microseconds of a decode-only step, by term of the cost model:\n"
    );
    let _ = writeln!(md, "| leg | {} | total |", names.join(" | "));
    let _ = writeln!(md, "|---|{}---|", "---|".repeat(names.len()));
    for (l, t) in legs {
        if t.decode_steps == 0 {
            continue;
        }
        let n = t.decode_steps as f64;
        let cells: Vec<String> = t
            .decode_terms_us
            .terms()
            .iter()
            .map(|(_, v)| format!("{:.0}", v / n))
            .collect();
        let _ = writeln!(
            md,
            "| `{}` | {} | {:.0} |",
            l.id,
            cells.join(" | "),
            t.decode_terms_us.total() / n
        );
    }
    let _ = writeln!(md);
}

/// The reference column of a speed-up expectation.
pub fn speedup_reference(sp: &SpeedupExpectation) -> String {
    let mut parts = Vec::new();
    if let Some(a) = sp.about {
        parts.push(format!(
            "{} (within {:.0} points)",
            pct(a),
            100.0 * sp.within
        ));
    }
    if let Some(m) = sp.more_than {
        parts.push(format!("above {}", pct(m)));
    }
    if let Some(l) = sp.less_than {
        parts.push(format!("below {}", pct(l)));
    }
    format!("{} vs `{}`", parts.join(", "), sp.baseline)
}

/// Judge a speed-up expectation: (observed, verdict).
pub fn judge_speedup(
    sp: &SpeedupExpectation,
    rec: &RunRecord,
    legs: &[&LegRecord],
) -> (String, &'static str) {
    let base = rec
        .legs
        .iter()
        .find(|l| leg_matches(&l.id, &sp.baseline))
        .and_then(|l| l.sim_time.as_ref());
    let this = legs.iter().find_map(|l| l.sim_time.as_ref());
    let (Some(b), Some(t)) = (base, this) else {
        return ("no simulated time".into(), "not measured");
    };
    let r = t.output_tok_s / b.output_tok_s;
    let ok = sp.holds(r);
    (
        format!(
            "{} ({:.1} vs {:.1} tok/s)",
            pct(r),
            t.output_tok_s,
            b.output_tok_s
        ),
        if ok { "matched" } else { "NOT matched" },
    )
}
