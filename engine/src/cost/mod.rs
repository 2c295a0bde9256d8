//! The step-cost model: simulated time of one engine step on a stated machine.
//!
//! What it computes: [`CostModel::step`] turns a step's shape ([`StepShape`]: prefill
//! tokens, decode/verify rows grouped by sequence, decode requests, KV context read,
//! speculative tokens) into microseconds on one tensor-parallel rank, split into named
//! terms ([`StepCost`]) so a finding can say which term decides a result:
//!
//! | term | formula (per rank) | source of the form |
//! |---|---|---|
//! | `launch` | `launch_us x kernels` | DESIGN.md "small models are launch-bound" (~1.3 us a kernel in a graph, 4-6 us without); fitted on `runs/gpu-check-h200.json` |
//! | `weights` | `dense_bytes / bw` | every decode step streams the dense weights once (memory-bound decode) |
//! | `experts` | `moe_layers x D x (expert_bytes / bw + expert_us)`, `D` = distinct experts a rank touches ([`overlap`]): the mean `E[distinct] / ep`, or with `ep_busiest` the expected busiest of the `ep` ranks ([`busiest_rank`]) | DESIGN.md "Speculation on MoE targets"; Marlin MoE reads only routed experts; a layer waits for its slowest expert-parallel rank |
//! | `kv` | `context_tokens x kv_bytes_per_token / bw` | decode attention reads each request's KV once per step, for all its verify rows |
//! | `state` | `decode_reqs x state_bytes x (2 + N) / bw` | KDA state read once, written per speculative position (vLLM state groups of 1 + N blocks) |
//! | `compute` | `max(0, rows x flops_per_token / flop_rate - dense_bytes / bw) + rows x row_us` | 2 x active parameters per token; roofline (a GEMM takes max(bytes, flops), the weights term already holds the bytes); `row_us` a fitted per-row overhead |
//! | `allreduce` | `allreduces x (allreduce_us + rows x allreduce_bytes_per_row x 2 (tp - 1) / tp / allreduce_gb_s)` when `tp > 1` (the bytes part only when `allreduce_gb_s > 0`) | one all-reduce after attention and one after the MoE per layer (Megatron TP); a ring all-reduce moves `2 (tp - 1) / tp` of the message through each link (NCCL's "bus bandwidth", nccl-tests doc/PERFORMANCE.md) |
//! | `drafter` | the same terms for the drafter's forwards (N sequential for MTP, one for a block drafter), + `overhead_us` a forward | vLLM's MTP proposer runs its one layer N times |
//!
//! `bw` is [`HardwareProfile::hbm_gb_s`] (GB/s = 1e3 bytes per us). Every term is
//! linear in one hardware parameter, so the parameters can be fitted by least squares
//! ([`fit`], `speclab cost fit`).
//!
//! Invariants: `step` is a pure function of its inputs; every term is finite and >= 0
//! for a validated model ([`CostModel::validate`]); an empty step costs 0.

pub mod fit;
pub mod overlap;

use serde::{Deserialize, Serialize};

pub use overlap::Routing;

use crate::{EngineError, Result};

/// The machine (one rank of a tensor-parallel group).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareProfile {
    /// Sustained HBM bandwidth in GB/s (a measured device copy, not the vendor peak).
    pub hbm_gb_s: f64,
    /// Microseconds per kernel launch (inside a CUDA graph when decode is captured).
    pub launch_us: f64,
    /// Microseconds per all-reduce of a layer's activations at this TP degree.
    #[serde(default)]
    pub allreduce_us: f64,
    /// Tensor-parallel degree (1 = no all-reduce).
    #[serde(default = "one")]
    pub tp: u32,
    /// Expert-parallel degree: routed experts are split over this many ranks (1 = none).
    #[serde(default = "one")]
    pub ep: u32,
    /// Sustained dense matrix throughput in TFLOP/s (prefill and batched rows).
    pub compute_tflops: f64,
    /// Fitted fixed cost per processed row (token) in us (default 0).
    #[serde(default)]
    pub row_us: f64,
    /// Fitted fixed cost per distinct expert per MoE layer in us (default 0).
    #[serde(default)]
    pub expert_us: f64,
    /// Price the busiest expert-parallel rank's experts instead of the mean rank's
    /// ([`busiest_rank`]; default false: the mean, `E[distinct] / ep`).
    #[serde(default)]
    pub ep_busiest: bool,
    /// All-reduce bus bandwidth in GB/s for the bytes part of an all-reduce (default 0:
    /// an all-reduce costs `allreduce_us` whatever its size).
    #[serde(default)]
    pub allreduce_gb_s: f64,
}

fn one() -> u32 {
    1
}

/// The routed experts of a forward.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeShape {
    /// MoE layers in the forward.
    pub layers: u32,
    /// Routed experts per layer (all ranks together).
    pub experts: u32,
    /// Experts each token routes to.
    pub top_k: u32,
    /// Bytes of one routed expert (all its matrices, incl. scales).
    pub expert_bytes: f64,
}

/// One forward pass of a network (the target, or one drafter forward), per rank.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForwardShape {
    /// Kernels launched per forward.
    pub kernels: f64,
    /// Bytes of non-routed weights this rank reads per forward.
    pub dense_bytes: f64,
    /// Routed experts (None for a dense network).
    #[serde(default)]
    pub moe: Option<MoeShape>,
    /// FLOPs per token on this rank (about 2 x active parameters / tp).
    #[serde(default)]
    pub flops_per_token: f64,
    /// All-reduces per forward (about 2 per layer under TP).
    #[serde(default)]
    pub allreduces: f64,
    /// KV bytes read per context token of a decode request (all full-attention layers).
    #[serde(default)]
    pub kv_bytes_per_token: f64,
    /// Recurrent (KDA) state bytes of one request on this rank (all linear layers).
    #[serde(default)]
    pub state_bytes: f64,
    /// Bytes one row adds to each all-reduce (hidden size x activation bytes; priced only
    /// with `hardware.allreduce_gb_s > 0`).
    #[serde(default)]
    pub allreduce_bytes_per_row: f64,
}

/// How a drafter runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterShape {
    /// One drafter forward.
    pub forward: ForwardShape,
    /// True: N sequential forwards per step (MTP, EAGLE); false: one forward (DFlash).
    pub sequential: bool,
    /// Fixed microseconds per drafter forward beyond its kernels and bytes (host-side
    /// proposal work, an ungraphed launch path; default 0).
    #[serde(default)]
    pub overhead_us: f64,
}

/// A step as the cost model sees it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StepShape {
    /// Tokens of prefill chunks.
    pub prefill_tokens: u64,
    /// Decode/verify rows (1 + drafts per decode request).
    pub decode_rows: u64,
    /// Decode requests.
    pub decode_reqs: u64,
    /// Context tokens the decode requests' attention reads (sum over requests).
    pub context_tokens: u64,
    /// Rows of each sequence in the batch (prefill chunks and verify groups), for the
    /// expert overlap. Shape: [sequences].
    pub seq_rows: Vec<u64>,
    /// Speculative tokens the drafter proposes per request this step (0: no drafter).
    pub num_speculative: u64,
    /// Requests that sample this step (decode requests and final prefill chunks).
    pub sampling_reqs: u64,
}

/// Microseconds of one step, by term (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct StepCost {
    pub launch: f64,
    pub weights: f64,
    pub experts: f64,
    pub kv: f64,
    pub state: f64,
    pub compute: f64,
    pub allreduce: f64,
    pub drafter: f64,
}

impl StepCost {
    /// All terms.
    pub fn total(&self) -> f64 {
        self.launch
            + self.weights
            + self.experts
            + self.kv
            + self.state
            + self.compute
            + self.allreduce
            + self.drafter
    }
    /// Element-wise sum (accumulating a run).
    pub fn add(&mut self, o: &StepCost) {
        self.launch += o.launch;
        self.weights += o.weights;
        self.experts += o.experts;
        self.kv += o.kv;
        self.state += o.state;
        self.compute += o.compute;
        self.allreduce += o.allreduce;
        self.drafter += o.drafter;
    }
    /// (name, us) of every term, in a fixed order.
    pub fn terms(&self) -> [(&'static str, f64); 8] {
        [
            ("launch", self.launch),
            ("weights", self.weights),
            ("experts", self.experts),
            ("kv", self.kv),
            ("state", self.state),
            ("compute", self.compute),
            ("allreduce", self.allreduce),
            ("drafter", self.drafter),
        ]
    }
}

/// Hardware + target (+ drafter) + routing: everything [`CostModel::step`] needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostModel {
    pub hardware: HardwareProfile,
    pub target: ForwardShape,
    #[serde(default)]
    pub drafter: Option<DrafterShape>,
    #[serde(default)]
    pub routing: Routing,
}

fn bad(field: &str, reason: impl Into<String>) -> EngineError {
    EngineError::Unsupported(format!("cost model: {field}: {}", reason.into()))
}

fn check_nonneg(field: &str, x: f64) -> Result<()> {
    if x.is_finite() && x >= 0.0 {
        Ok(())
    } else {
        Err(bad(field, format!("{x} is not a finite number >= 0")))
    }
}

fn check_forward(at: &str, f: &ForwardShape, ep: u32) -> Result<()> {
    for (k, v) in [
        ("kernels", f.kernels),
        ("dense_bytes", f.dense_bytes),
        ("flops_per_token", f.flops_per_token),
        ("allreduces", f.allreduces),
        ("kv_bytes_per_token", f.kv_bytes_per_token),
        ("state_bytes", f.state_bytes),
        ("allreduce_bytes_per_row", f.allreduce_bytes_per_row),
    ] {
        check_nonneg(&format!("{at}.{k}"), v)?;
    }
    if let Some(m) = &f.moe {
        check_nonneg(&format!("{at}.moe.expert_bytes"), m.expert_bytes)?;
        if m.experts == 0 || m.top_k == 0 || m.top_k > m.experts {
            return Err(bad(
                &format!("{at}.moe"),
                format!("top_k {} must be in 1..=experts ({})", m.top_k, m.experts),
            ));
        }
        if m.experts % ep != 0 {
            return Err(bad(
                "hardware.ep",
                format!("{} experts do not split over ep = {ep} ranks", m.experts),
            ));
        }
    }
    Ok(())
}

impl CostModel {
    /// Every number finite and >= 0, bandwidth and compute > 0, tp/ep >= 1, top_k <= experts.
    pub fn validate(&self) -> Result<()> {
        let h = &self.hardware;
        for (k, v) in [
            ("launch_us", h.launch_us),
            ("allreduce_us", h.allreduce_us),
            ("row_us", h.row_us),
            ("expert_us", h.expert_us),
            ("allreduce_gb_s", h.allreduce_gb_s),
        ] {
            check_nonneg(&format!("hardware.{k}"), v)?;
        }
        for (k, v) in [
            ("hbm_gb_s", h.hbm_gb_s),
            ("compute_tflops", h.compute_tflops),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(&format!("hardware.{k}"), format!("{v} must be > 0")));
            }
        }
        if h.tp == 0 || h.ep == 0 {
            return Err(bad("hardware", "tp and ep must be >= 1"));
        }
        check_forward("target", &self.target, h.ep)?;
        if let Some(d) = &self.drafter {
            check_forward("drafter.forward", &d.forward, h.ep)?;
            check_nonneg("drafter.overhead_us", d.overhead_us)?;
        }
        self.routing.validate()
    }

    /// Microseconds of one step, by term (module doc).
    pub fn step(&self, s: &StepShape) -> StepCost {
        let rows = s.prefill_tokens + s.decode_rows;
        if rows == 0 {
            return StepCost::default();
        }
        let h = &self.hardware;
        let t = &self.target;
        let bw = h.hbm_gb_s * 1e3; // bytes per us
        let mut c = self.forward(t, &s.seq_rows, rows);
        c.kv = s.context_tokens as f64 * t.kv_bytes_per_token / bw;
        c.state = (s.decode_reqs * (2 + s.num_speculative)) as f64 * t.state_bytes / bw;
        c.drafter = self.drafter_us(s);
        c
    }

    /// Launch, weights, experts, compute and all-reduce terms of one forward over `rows`
    /// rows grouped by sequence as `seq_rows`.
    fn forward(&self, f: &ForwardShape, seq_rows: &[u64], rows: u64) -> StepCost {
        let h = &self.hardware;
        let bw = h.hbm_gb_s * 1e3;
        let experts = f.moe.map_or(0.0, |m| {
            let d = if h.ep_busiest && h.ep > 1 {
                busiest_rank(&self.routing, &m, h.ep, seq_rows)
            } else {
                self.routing.expected_distinct(m.experts, m.top_k, seq_rows) / f64::from(h.ep)
            };
            f64::from(m.layers) * d * (m.expert_bytes / bw + h.expert_us)
        });
        let flop_rate = h.compute_tflops * 1e6; // FLOP per us
        StepCost {
            launch: h.launch_us * f.kernels,
            weights: f.dense_bytes / bw,
            experts,
            // Roofline: a GEMM takes max(bytes, flops); the dense weights are already
            // counted, so only the excess of compute time over them is added.
            compute: (rows as f64 * f.flops_per_token / flop_rate - f.dense_bytes / bw).max(0.0)
                + rows as f64 * h.row_us,
            allreduce: if h.tp > 1 {
                f.allreduces * (h.allreduce_us + self.allreduce_bytes_us(f, rows))
            } else {
                0.0
            },
            ..StepCost::default()
        }
    }

    /// The bytes part of one all-reduce over `rows` rows (module doc; 0 unless
    /// `allreduce_gb_s > 0`).
    fn allreduce_bytes_us(&self, f: &ForwardShape, rows: u64) -> f64 {
        let h = &self.hardware;
        if h.allreduce_gb_s <= 0.0 || h.tp <= 1 {
            return 0.0;
        }
        let tp = f64::from(h.tp);
        rows as f64 * f.allreduce_bytes_per_row * 2.0 * (tp - 1.0) / tp / (h.allreduce_gb_s * 1e3)
    }

    /// The drafter's forwards: a block drafter runs once over the sampling requests; a
    /// sequential one runs N times, its first forward over every row of the step (the
    /// MTP layer needs every position's hidden state), the others over one row per
    /// sampling request.
    fn drafter_us(&self, s: &StepShape) -> f64 {
        let Some(d) = &self.drafter else { return 0.0 };
        if s.num_speculative == 0 || s.sampling_reqs == 0 {
            return 0.0;
        }
        let singles = vec![1u64; s.sampling_reqs as usize];
        let one_row = self.forward(&d.forward, &singles, s.sampling_reqs).total() + d.overhead_us;
        if !d.sequential {
            return one_row;
        }
        let rows = s.prefill_tokens + s.decode_rows;
        let first = self.forward(&d.forward, &s.seq_rows, rows).total() + d.overhead_us;
        first + one_row * (s.num_speculative - 1) as f64
    }
}

/// Expected maximum of `n` independent standard normal variables (n >= 1): the exact
/// values for n <= 8 (Harter 1961, "Expected values of normal order statistics",
/// Biometrika 48), Blom's approximation `Phi^-1((n - 0.375) / (n + 0.25))` beyond.
pub fn expected_max_normal(n: u32) -> f64 {
    const EXACT: [f64; 8] = [
        0.0, 0.56419, 0.84628, 1.02938, 1.16296, 1.26721, 1.35218, 1.42360,
    ];
    match n {
        0 => 0.0,
        1..=8 => EXACT[n as usize - 1],
        _ => inverse_normal_cdf((f64::from(n) - 0.375) / (f64::from(n) + 0.25)),
    }
}

/// Phi^-1(p) by bisection on the normal CDF of Abramowitz & Stegun 26.2.17 (absolute
/// error < 7.5e-8), enough for an order-statistic estimate.
fn inverse_normal_cdf(p: f64) -> f64 {
    let cdf = |x: f64| {
        let t = 1.0 / (1.0 + 0.2316419 * x.abs());
        let poly = t
            * (0.319381530
                + t * (-0.356563782 + t * (1.781477937 + t * (-1.821255978 + t * 1.330274429))));
        let upper = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt() * poly;
        if x >= 0.0 {
            1.0 - upper
        } else {
            upper
        }
    };
    let (mut lo, mut hi) = (-10.0f64, 10.0f64);
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        if cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// Expected distinct experts of the busiest of `ep` expert-parallel ranks for one layer:
/// each rank holds `experts / ep` experts, its count is a sum of per-expert hit
/// indicators (mean `E[distinct] / ep`, variance `Var / ep` with `Var` = sum over
/// experts of `h (1 - h)`, [`Routing::distinct_variance`]), taken as normal and
/// independent across ranks: mean + `expected_max_normal(ep)` x sd, at most the rank's
/// experts. Assumptions: experts are placed on ranks independently of their
/// popularity (so every rank has the same mean), and the indicators are independent
/// (a row's top-k are drawn without replacement, which makes them slightly negatively
/// correlated: the spread is a little overstated).
pub fn busiest_rank(routing: &Routing, m: &MoeShape, ep: u32, seq_rows: &[u64]) -> f64 {
    let epf = f64::from(ep);
    let mean = routing.expected_distinct(m.experts, m.top_k, seq_rows) / epf;
    let var = routing.distinct_variance(m.experts, m.top_k, seq_rows) / epf;
    (mean + expected_max_normal(ep) * var.max(0.0).sqrt()).min(f64::from(m.experts) / epf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> CostModel {
        CostModel {
            hardware: HardwareProfile {
                hbm_gb_s: 1000.0,
                launch_us: 2.0,
                allreduce_us: 10.0,
                tp: 2,
                ep: 2,
                compute_tflops: 100.0,
                row_us: 0.5,
                expert_us: 1.0,
                ep_busiest: false,
                allreduce_gb_s: 0.0,
            },
            target: ForwardShape {
                kernels: 100.0,
                dense_bytes: 1e6,
                moe: Some(MoeShape {
                    layers: 4,
                    experts: 16,
                    top_k: 2,
                    expert_bytes: 1e5,
                }),
                flops_per_token: 1e8,
                allreduces: 8.0,
                kv_bytes_per_token: 100.0,
                state_bytes: 1e4,
                allreduce_bytes_per_row: 0.0,
            },
            drafter: None,
            routing: Routing::UNIFORM,
        }
    }

    #[test]
    fn terms_follow_their_formulas() {
        let m = model();
        let s = StepShape {
            decode_rows: 3,
            decode_reqs: 1,
            context_tokens: 1000,
            seq_rows: vec![3],
            num_speculative: 2,
            sampling_reqs: 1,
            ..StepShape::default()
        };
        let c = m.step(&s);
        assert!((c.launch - 200.0).abs() < 1e-9);
        assert!((c.weights - 1.0).abs() < 1e-9); // 1e6 B at 1e3 B/us... = 1e6/1e6
        let d = 16.0 * (1.0 - (1.0 - 2.0 / 16.0f64).powi(3)) / 2.0;
        assert!((c.experts - 4.0 * d * (0.1 + 1.0)).abs() < 1e-9);
        assert!((c.kv - 0.1).abs() < 1e-9);
        assert!((c.state - 4.0 * 1e4 / 1e6).abs() < 1e-12);
        // 3 rows x 1 us of FLOPs, less the 1 us of dense weights, + 3 x 0.5 us.
        assert!((c.compute - (3.0 - 1.0 + 1.5)).abs() < 1e-9);
        assert!((c.allreduce - 80.0).abs() < 1e-9);
        assert_eq!(c.drafter, 0.0);
        assert_eq!(m.step(&StepShape::default()).total(), 0.0);
    }

    #[test]
    fn sequential_drafter_costs_grow_with_n() {
        let mut m = model();
        m.drafter = Some(DrafterShape {
            forward: ForwardShape {
                moe: None,
                ..m.target
            },
            sequential: true,
            overhead_us: 0.0,
        });
        let s = |n| StepShape {
            decode_rows: 1 + n,
            decode_reqs: 1,
            seq_rows: vec![1 + n],
            num_speculative: n,
            sampling_reqs: 1,
            ..StepShape::default()
        };
        let d1 = m.step(&s(1)).drafter;
        let d3 = m.step(&s(3)).drafter;
        assert!(d1 > 0.0 && d3 > d1 * 2.5, "{d1} {d3}");
        m.drafter.as_mut().unwrap().sequential = false;
        assert!(m.step(&s(3)).drafter < d3 / 2.5);
    }

    #[test]
    fn validation_names_the_field() {
        let mut m = model();
        m.hardware.hbm_gb_s = 0.0;
        assert!(m.validate().unwrap_err().to_string().contains("hbm_gb_s"));
        let mut m = model();
        m.hardware.ep = 3;
        assert!(m.validate().unwrap_err().to_string().contains("ep"));
        assert!(model().validate().is_ok());
    }

    #[test]
    fn expected_max_normal_is_monotone_and_blom_joins_the_table() {
        let v: Vec<f64> = (1..=64).map(expected_max_normal).collect();
        assert!(v.windows(2).all(|w| w[1] > w[0]), "{v:?}");
        // Blom at n = 8 against the exact 1.42360 (Blom is 1.434 there: within 0.015);
        // at n = 16 the exact value is 1.76599.
        let blom8 = inverse_normal_cdf((8.0 - 0.375) / 8.25);
        assert!((blom8 - 1.42360).abs() < 0.015, "{blom8}");
        assert!((expected_max_normal(16) - 1.76599).abs() < 0.01);
        assert!((inverse_normal_cdf(0.975) - 1.95996).abs() < 1e-4);
    }

    /// The busiest-rank estimate against a seeded Monte Carlo of uniform top-8 routing
    /// over 288 experts on 4 ranks (72 each), at batch sizes from decode to verify.
    #[test]
    fn busiest_rank_matches_monte_carlo() {
        use rand::seq::index::sample;
        use rand::SeedableRng;
        let m = MoeShape {
            layers: 1,
            experts: 288,
            top_k: 8,
            expert_bytes: 1.0,
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for rows in [1u64, 3, 8, 32, 96] {
            let trials = 4000;
            let mut sum_max = 0.0;
            for _ in 0..trials {
                let mut hit = [false; 288];
                for _ in 0..rows {
                    for e in sample(&mut rng, 288, 8).into_iter() {
                        hit[e] = true;
                    }
                }
                let per: Vec<usize> = hit
                    .chunks(72)
                    .map(|c| c.iter().filter(|&&h| h).count())
                    .collect();
                sum_max += *per.iter().max().unwrap() as f64;
            }
            let mc = sum_max / f64::from(trials);
            let seq = vec![1u64; rows as usize];
            let est = busiest_rank(&Routing::UNIFORM, &m, 4, &seq);
            let mean = Routing::UNIFORM.expected_distinct(288, 8, &seq) / 4.0;
            assert!(est > mean, "rows {rows}: {est} <= mean {mean}");
            assert!(
                (est - mc).abs() / mc < 0.06,
                "rows {rows}: estimate {est} against Monte Carlo {mc}"
            );
        }
    }

    #[test]
    fn busiest_rank_and_allreduce_bytes_take_effect() {
        let s = StepShape {
            decode_rows: 4,
            decode_reqs: 4,
            seq_rows: vec![1, 1, 1, 1],
            sampling_reqs: 4,
            ..StepShape::default()
        };
        let base = model().step(&s);
        let mut m = model();
        m.hardware.ep_busiest = true;
        let busy = m.step(&s);
        assert!(
            busy.experts > base.experts,
            "{} {}",
            busy.experts,
            base.experts
        );
        assert_eq!(busy.allreduce, base.allreduce);
        let mut m = model();
        m.hardware.allreduce_gb_s = 100.0;
        m.target.allreduce_bytes_per_row = 1e4;
        // 8 all-reduces x (10 us + 4 rows x 1e4 B x 2 (2 - 1) / 2 / 1e5 B/us) = 83.2 us.
        assert!(
            (m.step(&s).allreduce - 83.2).abs() < 1e-9,
            "{}",
            m.step(&s).allreduce
        );
        m.hardware.tp = 1;
        assert_eq!(m.step(&s).allreduce, 0.0);
    }
}
