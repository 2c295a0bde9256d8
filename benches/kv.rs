//! KV cache manager benchmarks (criterion; `cargo bench --bench kv`).
//!
//! `kv_replay_100k/generated`: 100,000 ops replayed through
//! `speclab_experiments::replay::Replayer` on the GLM-5.3-Flash + DFlash2
//! layout (`presets::glm53_dflash2(2304, Upstream, 1012, 262144, 8192)`). The
//! trace is generated here, deterministically (SplitMix64, fixed seed), by a
//! small chunked-prefill + speculative-decode scheduler: up to 40 live
//! requests, an 8,192-token step budget, prefill chunks, decode steps of
//! 1 + 7 tokens with 7 lookahead slots, rejected drafts rolled back, vLLM-style
//! preemption of the last running request on a failed allocation, must-fit
//! admission of waiting/preempted requests, aborts and frees. It is written to
//! `target/kv-bench/{layout.json,ops.jsonl,results.jsonl}` so that
//! `recipes/kv_replay_bench.py --layout .. --ops ..` can time vLLM on the same
//! trace (and `results.jsonl`, speclab's records, can be diffed against vLLM's).
//!
//! `kv_replay_100k/recipe_trace`: only when `recipes/kv_replay_bench.py --gen`
//! has written `tests/golden/kv/bench/*.layout.json` + `*_100k.ops.jsonl`
//! (git-ignored), the same measurement on that trace.
//!
//! Timing covers `Replayer::apply` for every op (output records included);
//! parsing, generation and building the replayer are outside the clock.
//! Invariant: the generated trace is identical on every run and machine.

use std::hint::black_box;
use std::io::Write;
use std::path::{Path, PathBuf};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use speclab_engine::kv::presets::glm53_dflash2;
use speclab_engine::kv::{AllocOutcome, CapPolicy, KvLayout};
use speclab_experiments::replay::{self, Op, OpResult, Replayer};

const N_OPS: usize = 100_000;
const SEED: u64 = 0x5eed_c0de_0000_0001;
/// max_num_batched_tokens: the per-step token budget (= max_in_flight_tokens).
const BUDGET: u64 = 8192;
/// DFlash2 draft tokens per decode step.
const K: u64 = 7;
const MAX_LIVE: usize = 40;
const MAX_RUNNING: usize = 32;

/// SplitMix64: tiny, dependency-free, identical everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in lo..=hi.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 > 1.0 - p
    }
}

#[derive(Debug, Clone)]
struct SimReq {
    id: String,
    num_tokens: u64,
    computed: u64,
    outputs: u64,
    max_outputs: u64,
}

/// A scheduler that emits only ops vLLM accepts, executing each as it goes.
struct Sim {
    rng: Rng,
    r: Replayer,
    mml: u64,
    ops: Vec<Op>,
    results: Vec<OpResult>,
    waiting: std::collections::VecDeque<SimReq>,
    running: Vec<SimReq>,
    next_id: u64,
}

impl Sim {
    fn new(layout: &KvLayout) -> Self {
        Self {
            rng: Rng(SEED),
            r: Replayer::new(layout).expect("bench layout"),
            mml: u64::from(layout.max_model_len),
            ops: Vec::with_capacity(N_OPS + 1024),
            results: Vec::with_capacity(N_OPS + 1024),
            waiting: Default::default(),
            running: Vec::new(),
            next_id: 0,
        }
    }

    fn emit(&mut self, op: Op) -> OpResult {
        let res = self
            .r
            .apply(&op)
            .unwrap_or_else(|e| panic!("generator emitted an invalid op: {e}"));
        self.ops.push(op);
        self.results.push(res.clone());
        res
    }

    fn allocated(res: &OpResult) -> bool {
        matches!(res.blocks, Some(AllocOutcome::Allocated(_)))
    }

    fn arrive(&mut self) {
        let prompt = if self.rng.chance(0.01) {
            self.rng.range(8_000, 16_000)
        } else {
            self.rng.range(32, 2000)
        };
        let req = SimReq {
            id: format!("r{}", self.next_id),
            num_tokens: prompt,
            computed: 0,
            outputs: 0,
            max_outputs: self.rng.range(1, 64),
        };
        self.next_id += 1;
        self.emit(Op::Add {
            req: req.id.clone(),
            prompt_len: prompt,
        });
        self.waiting.push_back(req);
    }

    /// Tokens to schedule for a request this step (prefill chunk or decode), and lookahead.
    fn plan(&mut self, q: &SimReq, budget: u64) -> Option<(u64, u64)> {
        let remaining = q.num_tokens - q.computed;
        if remaining > 1 {
            let chunk = if self.rng.chance(0.05) {
                remaining.min(budget).min(self.rng.range(1, 512))
            } else {
                remaining.min(budget)
            };
            (chunk > 0).then_some((chunk, 0))
        } else {
            let n = (1 + K).min(budget);
            (n > 0).then_some((n, K))
        }
    }

    fn step(&mut self) {
        let mut budget = BUDGET;
        // (request id, scheduled tokens, was a decode step)
        let mut scheduled: Vec<(String, u64, bool)> = Vec::new();
        self.step_running(&mut budget, &mut scheduled);
        self.step_waiting(&mut budget, &mut scheduled);
        // Model step done: settle computed / outputs, finish requests.
        for (id, n, decode) in scheduled {
            self.settle(id, n, decode);
        }
        self.arrivals();
    }

    /// Running requests first, preempting from the back until each fits.
    fn step_running(&mut self, budget: &mut u64, scheduled: &mut Vec<(String, u64, bool)>) {
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let q = self.running[i].clone();
            let Some((n, la)) = self.plan(&q, *budget) else {
                break;
            };
            loop {
                let res = self.emit(Op::Allocate {
                    req: q.id.clone(),
                    num_new_tokens: n,
                    lookahead: la,
                    must_fit: false,
                    has_scheduled_reqs: true,
                });
                if Self::allocated(&res) {
                    scheduled.push((q.id.clone(), n, la > 0));
                    *budget -= n;
                    i += 1;
                    break;
                }
                // vLLM: preempt the lowest-priority (last) running request, maybe itself.
                let victim = self.running.pop().expect("running is not empty");
                self.emit(Op::Preempt {
                    req: victim.id.clone(),
                });
                scheduled.retain(|s| s.0 != victim.id);
                let mut v = victim;
                v.computed = 0;
                let itself = v.id == q.id;
                self.waiting.push_front(v);
                if itself {
                    break;
                }
            }
        }
    }

    /// Admit waiting / preempted requests (must-fit admission gate).
    fn step_waiting(&mut self, budget: &mut u64, scheduled: &mut Vec<(String, u64, bool)>) {
        while *budget > 0 && self.running.len() < MAX_RUNNING {
            let Some(q) = self.waiting.front().cloned() else {
                break;
            };
            let Some((n, la)) = self.plan(&q, *budget) else {
                break;
            };
            let must_fit = !self.rng.chance(0.1);
            let has_sched = !scheduled.is_empty();
            let res = self.emit(Op::Allocate {
                req: q.id.clone(),
                num_new_tokens: n,
                lookahead: la,
                must_fit,
                has_scheduled_reqs: has_sched,
            });
            if !Self::allocated(&res) {
                break;
            }
            self.waiting.pop_front();
            self.running.push(q.clone());
            scheduled.push((q.id, n, la > 0));
            *budget -= n;
        }
    }

    /// Settle one scheduled request after the model step (computed, outputs, finish).
    fn settle(&mut self, id: String, n: u64, decode: bool) {
        let Some(pos) = self.running.iter().position(|q| q.id == id) else {
            return;
        };
        self.emit(Op::Computed {
            req: id.clone(),
            n: n as i64,
        });
        let mut q = self.running[pos].clone();
        q.computed += n;
        let new_tokens = if decode {
            let accepted = self.rng.range(0, K);
            let rejected = K - accepted;
            if rejected > 0 {
                self.emit(Op::Computed {
                    req: id.clone(),
                    n: -(rejected as i64),
                });
                q.computed -= rejected;
            }
            accepted + 1
        } else if q.computed >= q.num_tokens {
            1
        } else {
            0
        };
        let new_tokens = new_tokens.min(self.mml.saturating_sub(q.num_tokens));
        if new_tokens > 0 {
            self.emit(Op::Append {
                req: id.clone(),
                n: new_tokens,
            });
            q.num_tokens += new_tokens;
            q.outputs += new_tokens;
        }
        if q.outputs >= q.max_outputs || q.num_tokens >= self.mml {
            self.emit(Op::Free { req: id });
            self.running.remove(pos);
        } else {
            self.running[pos] = q;
        }
    }

    /// Arrivals and the odd abort of a waiting request.
    fn arrivals(&mut self) {
        let live = self.running.len() + self.waiting.len();
        if live < MAX_LIVE && (live < 24 || self.rng.chance(0.95)) {
            self.arrive();
        }
        if self.rng.chance(0.005) && !self.waiting.is_empty() {
            let k = self.rng.range(0, self.waiting.len() as u64 - 1) as usize;
            if let Some(q) = self.waiting.remove(k) {
                self.emit(Op::Free { req: q.id });
            }
        }
    }
}

fn bench_layout() -> KvLayout {
    glm53_dflash2(2304, CapPolicy::Upstream, 1012, 262_144, 8192)
}

/// The deterministic 100K-op trace and the records speclab gives for it.
fn generate(layout: &KvLayout) -> (Vec<Op>, Vec<OpResult>, replay::ReplaySummary) {
    let mut sim = Sim::new(layout);
    for _ in 0..24 {
        sim.arrive();
    }
    while sim.ops.len() < N_OPS {
        sim.step();
    }
    let summary = sim.r.summary();
    sim.ops.truncate(N_OPS); // every prefix of a valid trace is valid
    sim.results.truncate(N_OPS);
    (sim.ops, sim.results, summary)
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"))
}

fn write_trace(layout: &KvLayout, ops: &[Op], results: &[OpResult]) -> std::io::Result<PathBuf> {
    let dir = target_dir().join("kv-bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("layout.json"),
        serde_json::to_string_pretty(layout).map_err(std::io::Error::from)? + "\n",
    )?;
    let mut f = std::io::BufWriter::new(std::fs::File::create(dir.join("ops.jsonl"))?);
    for op in ops {
        serde_json::to_writer(&mut f, op).map_err(std::io::Error::from)?;
        f.write_all(b"\n")?;
    }
    f.flush()?;
    let mut f = std::io::BufWriter::new(std::fs::File::create(dir.join("results.jsonl"))?);
    for r in results {
        serde_json::to_writer(&mut f, r).map_err(std::io::Error::from)?;
        f.write_all(b"\n")?;
    }
    f.flush()?;
    Ok(dir)
}

/// The recipe's trace, if `recipes/kv_replay_bench.py --gen` has written one.
fn recipe_trace() -> Option<(KvLayout, Vec<Op>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/kv/bench");
    let mut ops_files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.to_string_lossy().ends_with(".ops.jsonl")
                || p.file_name().is_some_and(|n| n == "ops.jsonl")
        })
        .collect();
    ops_files.sort();
    let ops_path = ops_files.into_iter().next()?;
    let name = ops_path.file_name()?.to_string_lossy().into_owned();
    // `<stem>_100k.ops.jsonl` pairs with `<stem>.layout.json`; `ops.jsonl` with `layout.json`.
    let layout_path = if name == "ops.jsonl" {
        dir.join("layout.json")
    } else {
        let stem = name.trim_end_matches(".ops.jsonl");
        let stem = stem.rsplit_once('_').map_or(stem, |(a, _)| a);
        dir.join(format!("{stem}.layout.json"))
    };
    let layout = replay::load_layout(&layout_path)
        .map_err(|e| eprintln!("kv bench: skipping recipe trace: {e}"))
        .ok()?;
    let trace = replay::parse_ops(&ops_path)
        .map_err(|e| eprintln!("kv bench: skipping recipe trace: {e}"))
        .ok()?;
    Some((layout, trace.ops))
}

fn replay_all(layout: &KvLayout, ops: &[Op]) -> u64 {
    let mut r = Replayer::new(layout).expect("layout");
    let mut acc = 0u64;
    for op in ops {
        let res = r.apply(op).expect("valid trace");
        acc = acc.wrapping_add(res.free);
        black_box(&res);
    }
    acc
}

fn kv_replay_100k(c: &mut Criterion) {
    let layout = bench_layout();
    let (ops, results, s) = generate(&layout);
    match write_trace(&layout, &ops, &results) {
        Ok(dir) => eprintln!(
            "kv_replay_100k: trace written to {} ({} ops: {} allocations, {} NoFit, {} blocks handed out)",
            dir.display(),
            ops.len(),
            s.allocations,
            s.failures,
            s.blocks_allocated
        ),
        Err(e) => eprintln!("kv_replay_100k: could not write the trace: {e}"),
    }
    let mut g = c.benchmark_group("kv_replay_100k");
    g.throughput(Throughput::Elements(ops.len() as u64));
    g.sample_size(20);
    g.bench_function("generated", |b| {
        b.iter_batched(
            || Replayer::new(&layout).expect("layout"),
            |mut r| {
                for op in &ops {
                    black_box(r.apply(op).expect("valid trace"));
                }
                r
            },
            BatchSize::LargeInput,
        )
    });
    if let Some((l2, ops2)) = recipe_trace() {
        // Sanity: the recipe trace must replay without error before we time it.
        black_box(replay_all(&l2, &ops2));
        g.throughput(Throughput::Elements(ops2.len() as u64));
        g.bench_function("recipe_trace", |b| {
            b.iter_batched(
                || Replayer::new(&l2).expect("layout"),
                |mut r| {
                    for op in &ops2 {
                        black_box(r.apply(op).expect("valid trace"));
                    }
                    r
                },
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

// `bounds_1m`: exact bisection of the largest admissible prompt on a 1M-context layout.
// ---------------------------------------------------------------------------
/// `bounds_1m/<cap>`: `speclab bounds` on GLM-5.3-Flash + DFlash2 at
/// max_model_len 1,048,576 (the card's 2x DGX Spark serve) with a pool of
/// 40,000 blocks: ~20 admission probes, each building a fresh manager.
fn bounds_1m(c: &mut Criterion) {
    use speclab_experiments::bounds::{find_bound, ProbeCtx};
    let mut g = c.benchmark_group("bounds_1m");
    for cap in [CapPolicy::None, CapPolicy::Upstream] {
        let layout = glm53_dflash2(2304, cap, 40_000, 1_048_576, 8192);
        let ctx = ProbeCtx {
            layout: &layout,
            num_blocks: 40_000,
            max_num_batched_tokens: 8192,
            lookahead: 8,
        };
        let b = find_bound(&ctx).expect("bound");
        eprintln!(
            "bounds_1m/{cap:?}: largest admissible {:?} ({} probes)",
            b.largest_admissible, b.probes
        );
        g.bench_function(format!("{cap:?}").to_lowercase(), |bch| {
            bch.iter(|| black_box(find_bound(black_box(&ctx)).expect("bound")))
        });
    }
    g.finish();
}

criterion_group!(benches, kv_replay_100k, bounds_1m);
criterion_main!(benches);
