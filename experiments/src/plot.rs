//! SVG plots for findings: tau and draft acceptance rate vs N, one line per drafter.
//!
//! Rendered with `plotters`' SVG backend only (no fonts: text is left to the SVG viewer),
//! from the real legs of a record: every point is a recorded leg's `tau` or
//! `draft_acceptance_rate`. A series is one drafter (and temperature / concurrency when
//! the record has several); a drafter measured at a single N is a single marker.
//!
//! Invariant: a pure function of the record (same record, same bytes).

use std::collections::BTreeMap;

use plotters::prelude::*;

use crate::record::{RealLegRecord, RunRecord};

/// One line of the plot: its label and (N, tau, acceptance rate) points sorted by N.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(u32, f64, f64)>,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// The series of a record's real legs with drafts (drafter, then temperature, then concurrency).
pub fn tau_series(rec: &RunRecord) -> Vec<Series> {
    let reals: Vec<&RealLegRecord> = rec
        .legs
        .iter()
        .filter_map(|l| l.real.as_ref())
        .filter(|r| r.tau.is_some() && r.num_speculative_tokens > 0)
        .collect();
    let temps: std::collections::BTreeSet<String> = reals
        .iter()
        .map(|r| crate::real::temp_label(r.temperature))
        .collect();
    let concs: std::collections::BTreeSet<usize> = reals.iter().map(|r| r.concurrency).collect();
    // Key keeps the record's leg order for drafters (first appearance).
    let mut order: Vec<String> = Vec::new();
    let mut by: BTreeMap<String, Vec<(u32, f64, f64)>> = BTreeMap::new();
    for r in reals {
        let mut label = r.drafter.clone();
        if temps.len() > 1 {
            label.push_str(&format!(" T={}", crate::real::temp_label(r.temperature)));
        }
        if concs.len() > 1 {
            label.push_str(&format!(" c={}", r.concurrency));
        }
        if !by.contains_key(&label) {
            order.push(label.clone());
        }
        by.entry(label).or_default().push((
            r.num_speculative_tokens,
            r.tau.unwrap_or(1.0),
            r.draft_acceptance_rate.unwrap_or(0.0),
        ));
    }
    order
        .into_iter()
        .map(|label| {
            let mut points = by.remove(&label).unwrap_or_default();
            points.sort_by_key(|p| p.0);
            Series { label, points }
        })
        .collect()
}

/// A plot is drawn when some series has two or more distinct N values (a sweep over N;
/// legs at one N that differ only in their cap are no sweep).
pub fn has_n_sweep(rec: &RunRecord) -> bool {
    tau_series(rec).iter().any(|s| {
        let ns: std::collections::BTreeSet<u32> = s.points.iter().map(|p| p.0).collect();
        ns.len() >= 2
    })
}

/// Render the two-panel SVG (tau vs N, acceptance rate vs N); None without an N sweep.
pub fn tau_svg(rec: &RunRecord, title: &str) -> Option<String> {
    if !has_n_sweep(rec) {
        return None;
    }
    let series = tau_series(rec);
    let mut out = String::new();
    draw(&mut out, &series, title).ok()?;
    Some(out)
}

fn draw(
    out: &mut String,
    series: &[Series],
    title: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let max_n = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .max()
        .unwrap_or(1)
        .max(1);
    let max_tau = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(1.0f64, f64::max);
    let root = SVGBackend::with_string(out, (960, 400)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 18))?;
    let panels = root.split_evenly((1, 2));
    let x_range = 0.5f64..(f64::from(max_n) + 0.5);
    for (pi, area) in panels.iter().enumerate() {
        let (caption, y_desc, y_range) = if pi == 0 {
            (
                "mean acceptance length tau vs N",
                "tau = 1 + accepted / drafts",
                0.9f64..(max_tau * 1.08 + 0.1),
            )
        } else {
            (
                "draft acceptance rate vs N",
                "accepted / drafted tokens",
                0.0f64..1.05,
            )
        };
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(48)
            .build_cartesian_2d(x_range.clone(), y_range)?;
        chart
            .configure_mesh()
            .max_light_lines(1)
            .x_desc("N (num_speculative_tokens)")
            .y_desc(y_desc)
            .x_labels(max_n as usize + 1)
            .x_label_formatter(&|x| {
                if (x.fract()).abs() < 1e-9 {
                    format!("{}", *x as i64)
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|y| format!("{y:.2}"))
            .draw()?;
        for (si, s) in series.iter().enumerate() {
            let color = COLORS[si % COLORS.len()];
            let pts: Vec<(f64, f64)> = s
                .points
                .iter()
                .map(|p| (f64::from(p.0), if pi == 0 { p.1 } else { p.2 }))
                .collect();
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(2)).point_size(4))?
                .label(s.label.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(if pi == 0 {
                SeriesLabelPosition::UpperLeft
            } else {
                SeriesLabelPosition::UpperRight
            })
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
