//! Manifest-side pool planning: assumption sets (`kv.plan` + the plan sweep axes)
//! turned into legs whose layout and pool come from `speclab_engine::kv::hybrid::plan`.
//!
//! A manifest states its assumptions (tensor parallel size, KV dtype, the drafter's
//! block size, the indexer's kernel alignment, `max_in_flight_tokens`) instead of
//! free page sizes; each combination of the swept values is one assumption set, and
//! every leg of a set is planned the way vLLM 0.33.0 plans it (effective block size,
//! groups, bytes per block, num_blocks, capacity, startup verdict). The KV memory is
//! given (`kv.kv_cache_memory_bytes`), calibrated (`kv.calibrate`: the memory that gives
//! a stated pool at a stated block size under the same set; the card pins 1,012 blocks
//! at --block-size 2304) or replaced by an override (`kv.num_blocks`, vLLM's
//! `num_gpu_blocks_override`).
//!
//! Invariants: a set id lists only the axes the manifest sweeps (`tp=4 kv=auto`), so
//! leg ids without plan axes are unchanged; every plan field either takes effect or
//! is refused naming it (checked by [`check`]).

use serde::{Deserialize, Serialize};
use speclab_engine::kv::hybrid::{self, PlanAssumptions, PlanDrafter, PlanInput, PoolPlan};
use speclab_engine::kv::{CapPolicy, KvLayout};

use crate::manifest::{Manifest, PRESET_GLM53_DFLASH2, PRESET_GLM53_MTP};
use crate::{ExperimentError, Result};

/// The memory that gives `num_blocks` at `block_size` under the same assumption set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    pub block_size: u32,
    pub num_blocks: u32,
    /// The N the stated pool was seen at (the KDA pages grow with N, so the memory is
    /// calibrated once at this N and shared by every leg); None: each leg's own N.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_speculative_tokens: Option<u32>,
}

/// One assumption set: the plan (if any) and the in-flight tokens, with its id tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Variant {
    pub plan: Option<PlanAssumptions>,
    pub max_in_flight_tokens: u32,
    pub id: Vec<String>,
}

/// A leg's plan as recorded (`RunRecord.plans`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LegPlan {
    pub leg: String,
    /// The assumption set's id (the leg id's plan tokens).
    pub set: String,
    pub assumptions: PlanAssumptions,
    pub max_in_flight_tokens: u32,
    pub kv_cache_memory_bytes: u64,
    /// True when `kv.num_blocks` overrode the planned pool.
    pub overridden: bool,
    pub plan: PoolPlan,
}

fn invalid(field: &str, msg: impl Into<String>) -> ExperimentError {
    ExperimentError::Invalid {
        path: "manifest".into(),
        field: field.into(),
        msg: msg.into(),
    }
}

/// Refuse plan fields that would not take effect.
pub fn check(m: &Manifest) -> Result<()> {
    let kv = &m.kv;
    let s = &m.sweep;
    let axes = [
        ("sweep.tps", !s.tps.is_empty()),
        ("sweep.kv_dtypes", !s.kv_dtypes.is_empty()),
        (
            "sweep.drafter_block_sizes",
            !s.drafter_block_sizes.is_empty(),
        ),
        (
            "sweep.indexer_block_alignment",
            !s.indexer_block_alignment.is_empty(),
        ),
        ("kv.calibrate", kv.calibrate.is_some()),
    ];
    if kv.plan.is_none() {
        if let Some((f, _)) = axes.iter().find(|a| a.1) {
            return Err(invalid(f, "needs kv.plan (the assumption set it varies)"));
        }
        return Ok(());
    }
    if drafter_of(m).is_none() {
        return Err(invalid(
            "kv.plan",
            format!("plans the {PRESET_GLM53_DFLASH2} and {PRESET_GLM53_MTP} presets only; set kv.preset"),
        ));
    }
    if let Some(PlanDrafter::Mtp { .. }) = drafter_of(m) {
        if !s.drafter_block_sizes.is_empty() {
            return Err(invalid(
                "sweep.drafter_block_sizes",
                "the MTP head has no sliding-window group",
            ));
        }
    }
    if kv.memory.is_some() {
        return Err(invalid(
            "kv.memory",
            "kv.plan derives every page from the architecture; leave kv.memory out",
        ));
    }
    let sources = [
        kv.kv_cache_memory_bytes.is_some(),
        kv.calibrate.is_some(),
        kv.num_blocks.is_some() || !s.num_blocks.is_empty(),
    ];
    if sources.iter().filter(|x| **x).count() != 1 {
        return Err(invalid(
            "kv.kv_cache_memory_bytes",
            "with kv.plan give exactly one of kv.kv_cache_memory_bytes, kv.calibrate or kv.num_blocks / sweep.num_blocks (override)",
        ));
    }
    if m.drafter.num_speculative_tokens == 0 {
        return Err(invalid(
            "drafter.num_speculative_tokens",
            "kv.plan sizes the KDA conv state and spec blocks from N; give N > 0",
        ));
    }
    Ok(())
}

fn axis<T: Clone>(v: &[T], base: T) -> Vec<T> {
    if v.is_empty() {
        vec![base]
    } else {
        v.to_vec()
    }
}

/// The assumption sets of a manifest, in order tp, kv dtype, in-flight, drafter block,
/// indexer alignment.
pub fn variants(m: &Manifest) -> Vec<Variant> {
    let s = &m.sweep;
    let base_flight =
        m.kv.max_in_flight_tokens
            .unwrap_or(m.scheduler.max_num_batched_tokens);
    let flights = axis(&s.max_in_flight_tokens, base_flight);
    let Some(base) = m.kv.plan else {
        return flights
            .iter()
            .map(|&f| Variant {
                plan: None,
                max_in_flight_tokens: f,
                id: (!s.max_in_flight_tokens.is_empty())
                    .then(|| format!("inflight={f}"))
                    .into_iter()
                    .collect(),
            })
            .collect();
    };
    let mut out = Vec::new();
    for tp in axis(&s.tps, base.tp) {
        for kv in axis(&s.kv_dtypes, base.kv_dtype) {
            for &f in &flights {
                for dbs in axis(&s.drafter_block_sizes, base.drafter_block_size) {
                    for al in axis(&s.indexer_block_alignment, base.indexer_block_alignment) {
                        let mut id = Vec::new();
                        let mut tok = |on: bool, t: String| {
                            if on {
                                id.push(t)
                            }
                        };
                        tok(!s.tps.is_empty(), format!("tp={tp}"));
                        tok(!s.kv_dtypes.is_empty(), format!("kv={}", kv.name()));
                        tok(!s.max_in_flight_tokens.is_empty(), format!("inflight={f}"));
                        let d = dbs.map(|b| b.to_string()).unwrap_or_else(|| "vllm".into());
                        tok(!s.drafter_block_sizes.is_empty(), format!("drafter_bs={d}"));
                        let a = if al { "on" } else { "off" };
                        tok(
                            !s.indexer_block_alignment.is_empty(),
                            format!("idx_align={a}"),
                        );
                        out.push(Variant {
                            plan: Some(PlanAssumptions {
                                tp,
                                kv_dtype: kv,
                                drafter_block_size: dbs,
                                indexer_block_alignment: al,
                                ..base
                            }),
                            max_in_flight_tokens: f,
                            id,
                        });
                    }
                }
            }
        }
    }
    out
}

/// The drafter a planned preset includes (GLM-5.3-Flash's MTP head is one layer,
/// `num_nextn_predict_layers` 1 in the GLM-5 / DeepSeek-V3 configs); None: not a
/// planned preset.
fn drafter_of(m: &Manifest) -> Option<PlanDrafter> {
    match m.kv.preset.as_deref() {
        Some(PRESET_GLM53_DFLASH2) => Some(PlanDrafter::Dflash2),
        Some(PRESET_GLM53_MTP) => Some(PlanDrafter::Mtp { layers: 1 }),
        _ => None,
    }
}

fn input(m: &Manifest, a: PlanAssumptions, f: u32, bs: u32, mem: u64) -> PlanInput {
    PlanInput {
        assumptions: a,
        block_size: bs,
        num_speculative_tokens: m.drafter.num_speculative_tokens,
        max_model_len: m.kv.max_model_len,
        max_in_flight_tokens: f,
        drafter_window: m.drafter.sliding_window.unwrap_or(2048),
        kv_cache_memory_bytes: mem,
        drafter: drafter_of(m).unwrap_or_default(),
    }
}

fn engine(ctx: &str, e: speclab_engine::EngineError) -> ExperimentError {
    ExperimentError::engine(ctx.to_string(), e)
}

/// Plan one leg: the layout (pool resolved) and the record entry's parts.
pub fn planned_layout(
    m: &Manifest,
    a: PlanAssumptions,
    max_in_flight_tokens: u32,
    block_size: u32,
    cap: CapPolicy,
    pool_override: Option<u32>,
) -> Result<(KvLayout, PoolPlan, u64, bool)> {
    let ctx = format!("kv.plan (tp {}, block_size {block_size})", a.tp);
    let f = max_in_flight_tokens;
    let mem = match (m.kv.kv_cache_memory_bytes, m.kv.calibrate) {
        (Some(b), _) => b,
        (None, Some(c)) => {
            let mut at = input(m, a, f, c.block_size, 0);
            at.num_speculative_tokens = c
                .num_speculative_tokens
                .unwrap_or(at.num_speculative_tokens);
            let p = hybrid::plan(&at).map_err(|e| engine(&ctx, e))?;
            u64::from(c.num_blocks) * p.bytes_per_block
        }
        // Override only: size the plan's memory as exactly the override pool.
        (None, None) => 0,
    };
    // A leg without speculation loads no drafter: its weights' bytes are KV memory.
    let unloaded = if m.drafter.num_speculative_tokens == 0 && mem > 0 {
        a.drafter_weight_bytes
    } else {
        0
    };
    let mut inp = input(m, a, f, block_size, mem + unloaded);
    let mut p = hybrid::plan(&inp).map_err(|e| engine(&ctx, e))?;
    let over = pool_override.or(m.kv.num_blocks);
    if let Some(n) = over {
        // vLLM get_kv_cache_configs: available memory becomes override x bytes per block.
        inp.kv_cache_memory_bytes = u64::from(n) * p.bytes_per_block;
        p = hybrid::plan(&inp).map_err(|e| engine(&ctx, e))?;
    }
    let mut layout = p.layout(&inp, cap).map_err(|e| engine(&ctx, e))?;
    layout.watermark = m.kv.watermark;
    Ok((layout, p, inp.kv_cache_memory_bytes, over.is_some()))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::manifest::{parse_ron, Manifest};
    use crate::record::LegStatus;
    use crate::runner::{run_leg, Quiet};

    fn load(name: &str, text: &str) -> Manifest {
        let p = Path::new(name);
        let m: Manifest = parse_ron(p, text).unwrap();
        m.validate(p).unwrap();
        m
    }

    #[test]
    fn upstream_cap_follows_in_flight_tokens() {
        let m = load(
            "df2w-upstream-inflight.ron",
            include_str!("../df2w-upstream-inflight.ron"),
        );
        let legs = m.legs().unwrap();
        let run = |id: &str| {
            let leg = legs.iter().find(|l| l.id == id).unwrap();
            run_leg(&m, leg, &mut Quiet).unwrap()
        };
        let sync = run("inflight=8192 bs=2304 cap=upstream prompt=63734");
        assert_eq!(sync.status, LegStatus::Completed);
        // Async scheduling: vLLM refuses the pool; past the check the cap is no better than none.
        let asy = run("inflight=16384 bs=2304 cap=upstream prompt=63734");
        assert_eq!(asy.status, LegStatus::RefusedAtStartup);
        assert_eq!(asy.bound.unwrap().largest_admissible, Some(15_536));
    }

    #[test]
    fn full_cudagraphs_refuse_more_seqs_than_blocks() {
        let m = load(
            "hazard-max-num-seqs.ron",
            include_str!("../hazard-max-num-seqs.ron"),
        );
        let legs = m.legs().unwrap();
        assert_eq!(legs.len(), 3);
        let r = run_leg(&m, &legs[1], &mut Quiet).unwrap();
        assert_eq!(legs[1].max_num_seqs, Some(513));
        assert_eq!(r.status, LegStatus::RefusedAtStartup);
        assert!(r
            .note
            .unwrap()
            .contains("exceeds available Mamba cache blocks (512)"));
    }

    #[test]
    fn leg_tokens_match_in_any_order() {
        use crate::findings::leg_matches;
        assert!(leg_matches(
            "tp=4 kv=auto bs=1024 cap=none",
            "bs=1024 cap=none"
        ));
        assert!(leg_matches("tp=4 bs=1024 cap=none", ""));
        assert!(!leg_matches("tp=4 bs=10240 cap=none", "bs=1024"));
    }
}

#[cfg(test)]
mod n_axis_tests {
    use std::path::Path;

    use speclab_engine::kv::GroupKind;

    use crate::manifest::{parse_ron, DrafterKind, Manifest};
    use crate::runner::{run_leg, Quiet};

    const GDN: &str = include_str!("../hazard-gdn-mtp-27b.ron");

    fn load(text: &str) -> crate::Result<Manifest> {
        let p = Path::new("x.ron");
        let m: Manifest = parse_ron(p, text)?;
        m.validate(p)?;
        Ok(m)
    }

    #[test]
    fn swept_n_sets_state_blocks_lookahead_and_window() {
        let m = load(GDN).unwrap();
        let legs = m.legs().unwrap();
        assert_eq!(legs.len(), 10);
        let leg = |id: &str| legs.iter().find(|l| l.id.contains(id)).unwrap();
        let off = leg("n=0 cap=upstream blocks=22");
        let on = leg("n=1 cap=upstream blocks=22");
        let spec = |l: &crate::manifest::Leg| {
            l.layout
                .groups
                .iter()
                .filter(|g| g.kind == GroupKind::State)
                .map(|g| g.num_speculative_blocks)
                .collect::<Vec<_>>()
        };
        assert_eq!(spec(off), vec![0, 0, 0]);
        assert_eq!(spec(on), vec![1, 1, 1]);
        assert_eq!(m.drafter_for(off).kind, DrafterKind::None);
        assert_eq!(m.drafter_for(on).lookahead(), 1);
        // 21 usable blocks: 7 a request with MTP (3 run), 4 without (5 run).
        let peak = |l| {
            run_leg(&m, l, &mut Quiet)
                .unwrap()
                .concurrency
                .unwrap()
                .peak_running
        };
        assert_eq!(peak(on), 3);
        assert_eq!(peak(off), 5);
        assert_eq!(peak(leg("n=1 cap=upstream blocks=57")), 8);
    }

    #[test]
    fn n_axis_and_concurrency_fields_are_checked() {
        let cases = [
            (
                GDN.replace("drafter: (kind: mtp, num_speculative_tokens: 1),", "")
                    .replace("acceptance: [0.8],", ""),
                "sweep.num_speculative_tokens",
            ),
            (
                GDN.replace(
                    "num_speculative_tokens: [0, 1]",
                    "num_speculative_tokens: [1, 1]",
                ),
                "listed twice",
            ),
            (
                GDN.replace(", concurrency: true", ""),
                "expectations[0].peak_running",
            ),
            (
                GDN.replace(
                    "simulate: true, bound: false",
                    "simulate: false, bound: true",
                ),
                "measure.concurrency",
            ),
        ];
        for (text, want) in cases {
            let e = load(&text).unwrap_err().to_string();
            assert!(e.starts_with("x.ron") && e.contains(want), "{want}: {e}");
        }
    }

    /// The MTP preset: calibrated once at the stated N, the same memory at every other
    /// N > 0, and the drafter's weight bytes added back where N = 0 loads no head.
    #[test]
    fn mtp_pool_memory_is_calibrated_once_and_n0_gets_the_head_bytes() {
        let text = "(name: \"t\", kv: (preset: Some(\"glm53-flash-mtp\"), block_size: Some(64), max_model_len: 262144, \
            plan: Some((tp: 4, drafter_weight_bytes: 3720000000)), \
            calibrate: Some((block_size: 64, num_blocks: 512, num_speculative_tokens: Some(2)))), \
            drafter: (kind: mtp, num_speculative_tokens: 5), workload: (prompts: [8192], output_len: 8), \
            sweep: (num_speculative_tokens: [0, 2, 5]))";
        let m = load(text).unwrap();
        let legs = m.legs().unwrap();
        let mem = |i: usize| legs[i].plan.as_ref().unwrap().kv_cache_memory_bytes;
        assert_eq!(legs[1].num_blocks, 512);
        assert_eq!(mem(2), mem(1));
        assert_eq!(mem(0), mem(1) + 3_720_000_000);
        assert!(legs[0].num_blocks > 512);
        assert!(legs.iter().all(|l| l
            .layout
            .groups
            .iter()
            .all(|g| g.kind != GroupKind::SlidingWindow)));
        // Without the calibration N each leg calibrates at its own N: N = 5 still 512.
        let own = load(&text.replace(", num_speculative_tokens: Some(2)", "")).unwrap();
        assert_eq!(own.legs().unwrap()[2].num_blocks, 512);
        // The preset needs the MTP drafter, and a plan.
        for (bad, field) in [
            (text.replace("kind: mtp", "kind: dflash2"), "drafter.kind"),
            (text.replace("plan: Some((tp: 4, drafter_weight_bytes: 3720000000)), ", "")
                .replace("calibrate: Some((block_size: 64, num_blocks: 512, num_speculative_tokens: Some(2)))", "num_blocks: Some(512)"),
                "kv.preset"),
        ] {
            let e = load(&bad)
                .and_then(|m| m.legs())
                .map(|_| ())
                .unwrap_err()
                .to_string();
            assert!(e.contains(field), "{field}: {e}");
        }
    }

    #[test]
    fn dflash_n_above_its_block_is_refused() {
        let text = "(name: \"t\", kv: (preset: Some(\"glm53-flash-dflash2\"), block_size: Some(2304), num_blocks: Some(1012)), \
            drafter: (kind: dflash2, num_speculative_tokens: 7, block_size: Some(8)), workload: (prompts: [1000]), \
            sweep: (num_speculative_tokens: [7, 8]))";
        let e = load(text).unwrap_err().to_string();
        assert!(
            e.contains("sweep.num_speculative_tokens") && e.contains("N <= block_size - 1"),
            "{e}"
        );
        let ok = load(&text.replace("[7, 8]", "[1, 7]")).unwrap();
        let legs = ok.legs().unwrap();
        assert_eq!(legs[0].id, "n=1 bs=2304 cap=upstream prompt=1000");
        // The preset's KDA groups hold 1 + N blocks, DFlash2's lookahead is N + 1.
        let kda = |i: usize| {
            legs[i]
                .layout
                .groups
                .iter()
                .find(|g| g.kind == GroupKind::State)
                .unwrap()
                .num_speculative_blocks
        };
        assert_eq!((kda(0), kda(1)), (1, 7));
        assert_eq!(ok.drafter_for(&legs[0]).lookahead(), 2);
    }
}

#[cfg(test)]
mod hazard_manifests {
    use std::path::Path;

    use crate::manifest::{parse_ron, Manifest};
    use crate::record::LegStatus;
    use crate::runner::{run_leg, Quiet};

    fn load(name: &str, text: &str) -> Manifest {
        let p = Path::new(name);
        let m: Manifest = parse_ron(p, text).unwrap();
        m.validate(p).unwrap();
        m
    }

    /// Stock planning boots the Spark config at every N and the bound shrinks as N grows.
    #[test]
    fn spark_plans_every_n_and_n_tightens_the_bound() {
        let m = load(
            "hazard-spark-dflash2.ron",
            include_str!("../hazard-spark-dflash2.ron"),
        );
        let legs = m.legs().unwrap();
        assert_eq!(legs.len(), 2 * 7 * 2);
        let leg = |id: &str| legs.iter().find(|l| l.id == id).unwrap();
        let n1 = leg("drafter_bs=vllm n=1 bs=2304 cap=none prompt=310000");
        let n7 = leg("drafter_bs=vllm n=7 bs=2304 cap=none prompt=310000");
        assert!(n1.plan.as_ref().unwrap().plan.starts && n7.plan.as_ref().unwrap().plan.starts);
        let mut sim = m.clone();
        sim.measure.simulate = false;
        let b = |l| {
            run_leg(&sim, l, &mut Quiet)
                .unwrap()
                .bound
                .unwrap()
                .largest_admissible
                .unwrap()
        };
        let (b1, b7) = (b(n1), b(n7));
        assert!(b1 > b7 && b7 > 320_000, "{b1} {b7}");
    }

    #[test]
    fn impossible_head_blocks_fcfs_and_is_rejected_by_the_fix() {
        let fcfs = load(
            "hazard-hol-deadlock.ron",
            include_str!("../hazard-hol-deadlock.ron"),
        );
        let fix = load(
            "hazard-hol-deadlock-reject.ron",
            include_str!("../hazard-hol-deadlock-reject.ron"),
        );
        let first = |m: &Manifest| {
            let legs = m.legs().unwrap();
            run_leg(m, &legs[0], &mut Quiet).unwrap()
        };
        let wedged = first(&fcfs);
        assert_eq!(wedged.status, LegStatus::Wedged);
        assert_eq!(wedged.finished, 0);
        let fixed = first(&fix);
        assert_eq!(fixed.status, LegStatus::Rejected);
        assert_eq!(fixed.finished, 3);
    }
}
