//! Host cost of the step loop alone: the real scheduler, KV manager and model executor
//! around a target that computes nothing (criterion; `cargo bench --bench step_loop`).
//!
//! Why: on the H200 a c = 128 decode step of models/tiny spends about 500 us on the GPU
//! and, in `runs/bench-e2e-h200.json`, another 100-300 us on the host (the record's
//! `host_us_per_step` and the drafter part of a no-drafter step). This bench isolates
//! that host part so it can be profiled and compared side by side on a CPU
//! (`perf record` on the bench binary with `--profile-time`).
//!
//! The null backend answers every forward with token 7 as the greedy id of each row
//! (so nothing stops early: `ignore_eos`), no logits, no hidden; `models/tiny`'s config
//! gives the KV layout. Throughput is decode steps per second of a whole run (c
//! requests, 256-token prompts, 128 new tokens; the prefill steps are included, a
//! small share). If `models/tiny` is missing the benchmark says so and measures nothing.

use std::hint::black_box;
use std::path::Path;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use speclab_drafters::DrafterSpec;
use speclab_engine::backend::{BackendFactory, SharedHead, TargetBackend};
use speclab_engine::exec::{generate_on, EngineOptions, EngineRequest};
use speclab_engine::kv::KvCacheManager;
use speclab_engine::model::{
    ForwardOptions, ForwardOut, LogitsRows, ModelWeights, MtpChunk, MtpOut, SeqChunk,
};
use speclab_engine::{EngineError, ReqSlot};

const NEW_TOKENS: u64 = 128;
const PROMPT_LEN: usize = 256;

/// A target that computes nothing: greedy id 7 for every logits row.
struct NullBackend {
    hidden: usize,
    vocab: usize,
}

impl SharedHead for NullBackend {
    fn head_dims(&self) -> (usize, usize) {
        (self.hidden, self.vocab)
    }
    fn embed(&self, tokens: &[u32]) -> speclab_engine::Result<Vec<f32>> {
        Ok(vec![0.0; tokens.len() * self.hidden])
    }
    fn lm_head(&self, _hidden: &[f32], rows: usize) -> speclab_engine::Result<Vec<f32>> {
        Ok(vec![0.0; rows * self.vocab])
    }
}

impl TargetBackend for NullBackend {
    fn forward(
        &mut self,
        _kv: &KvCacheManager,
        batch: &[SeqChunk<'_>],
        opts: &ForwardOptions,
    ) -> speclab_engine::Result<ForwardOut> {
        let t: usize = batch.iter().map(|c| c.tokens.len()).sum();
        let rows = match opts.logits {
            LogitsRows::LastPerChunk => batch.len(),
            _ => t,
        };
        Ok(ForwardOut {
            num_tokens: t,
            argmax: Some(vec![7; rows]),
            ..ForwardOut::default()
        })
    }
    fn mtp_forward(
        &mut self,
        _kv: &KvCacheManager,
        _batch: &[MtpChunk<'_>],
        _opts: &ForwardOptions,
    ) -> speclab_engine::Result<MtpOut> {
        Err(EngineError::Unsupported(
            "the null backend has no MTP layer".into(),
        ))
    }
    fn commit_state(
        &mut self,
        _kv: &KvCacheManager,
        _slot: ReqSlot,
        _accepted: usize,
    ) -> speclab_engine::Result<()> {
        Ok(())
    }
    fn release(&mut self, _slot: ReqSlot) {}
}

struct NullFactory;

impl BackendFactory for NullFactory {
    fn build(
        &self,
        w: &ModelWeights,
        _kv: &KvCacheManager,
    ) -> speclab_engine::Result<Box<dyn TargetBackend>> {
        Ok(Box::new(NullBackend {
            hidden: w.cfg.hidden_size,
            vocab: w.cfg.vocab_size,
        }))
    }
}

/// `conc` requests of 256-token prompts (ids 1..8000, no repeats within a prompt's
/// n-gram window) and options sized for them.
fn workload(conc: usize) -> (Vec<EngineRequest>, EngineOptions) {
    let reqs: Vec<EngineRequest> = (0..conc)
        .map(|i| EngineRequest {
            id: i as u64,
            prompt: (0..PROMPT_LEN)
                .map(|j| ((i * 131 + j * 17) % 8000) as u32 + 1)
                .collect(),
            max_tokens: NEW_TOKENS,
        })
        .collect();
    let per_seq = (PROMPT_LEN as u32 + NEW_TOKENS as u32).div_ceil(16) + 1;
    let opts = EngineOptions {
        num_blocks: conc as u32 * per_seq + 16,
        max_model_len: Some(1024),
        ignore_eos: true,
        check_allocator: false,
        ..EngineOptions::default()
    };
    (reqs, opts)
}

/// One group: whole runs of `spec` at c = 1, 32, 128, throughput in decode steps.
fn bench_group(c: &mut Criterion, target: &ModelWeights, name: &str, spec: &DrafterSpec) {
    let mut g = c.benchmark_group(name);
    g.sample_size(10);
    for conc in [1usize, 32, 128] {
        let (reqs, opts) = workload(conc);
        let sched = || Box::new(speclab_schedulers::fcfs_factory(conc, 8192));
        let run =
            generate_on(&NullFactory, target, spec, &reqs, &opts, &mut *sched()).expect("run");
        let steps = run.steps.len() as u64;
        g.throughput(Throughput::Elements(steps));
        g.bench_function(BenchmarkId::from_parameter(format!("c{conc}")), |b| {
            b.iter(|| {
                black_box(
                    generate_on(&NullFactory, target, spec, &reqs, &opts, &mut *sched())
                        .expect("run"),
                )
            })
        });
    }
    g.finish();
}

fn bench_step_loop(c: &mut Criterion) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny");
    let Ok(target) = ModelWeights::load(&dir) else {
        eprintln!("benches/step_loop: models/tiny not loadable; nothing measured");
        return;
    };
    bench_group(c, &target, "step_loop_host_none", &DrafterSpec::none());
    // Verify steps: the null target's greedy id is always 7, so once 7s follow a 7 the
    // n-gram drafter proposes 3 of them and all are accepted (4 rows a chunk), the host
    // bookkeeping of a drafter step without a drafter model.
    let ngram = DrafterSpec::ngram(3, 1, 3).expect("n-gram spec");
    bench_group(c, &target, "step_loop_host_ngram3", &ngram);
}

criterion_group!(benches, bench_step_loop);
criterion_main!(benches);
