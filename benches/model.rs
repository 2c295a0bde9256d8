//! CPU model benchmarks (criterion; `cargo bench --bench model`).
//!
//! The `tiny` preset (docs/model.md §10: hidden 256, 8 layers = 6 KDA + 2 full
//! attention, 16 routed experts top-2 + 1 shared, vocab 8,200, + MTP) with seeded
//! `ModelWeights::random` weights, W4A16 routed experts (`quantize_experts = true`) vs the
//! same weights dequantized to f32 (`ModelWeights::dequantized`), side by side in each
//! group so the ratio comes from one run:
//!
//! - `model_tiny_prefill_128`: one 128-token prompt (a fresh sequence each iteration:
//!   `start_pos = 0` resets the KDA state, K/V is overwritten), logits of the last
//!   token only (`LogitsRows::LastPerChunk`, as a serving prefill). Throughput in tokens.
//! - `model_tiny_decode`: one single-sequence decode step at context 128 (the prompt is
//!   prefilled once outside the clock; each iteration decodes one token at position 128,
//!   overwriting that position's K/V). Throughput in tokens.
//!
//! KV goes through a real `KvCacheManager` (`cfg.kv_layout(16, 0, 64)`) allocated with
//! `allocate_slots`, exactly as in the parity tests. Single-threaded GEMM.
//! Invariant: the weights and prompt are identical on every run (fixed seeds).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use speclab_engine::kv::KvCacheManager;
use speclab_engine::model::{
    ForwardOptions, LogitsRows, ModelConfig, ModelRunner, ModelWeights, SeqChunk,
};
use speclab_engine::ReqSlot;

const PROMPT: usize = 128;
const SEED: u64 = 0x5eed;

/// A runner with one request allocated for `PROMPT + 1` tokens.
fn setup(w: ModelWeights) -> (KvCacheManager, ModelRunner, Vec<u32>) {
    let cfg = w.cfg.clone();
    let layout = cfg.kv_layout(16, 0, 64).expect("layout");
    let mut kv = KvCacheManager::new(&layout, 64).expect("kv");
    let n = (PROMPT + 1) as u64;
    kv.allocate_whole(ReqSlot(0), n).expect("allocate");
    let runner = ModelRunner::new(w, &kv).expect("runner");
    let prompt: Vec<u32> = (0..PROMPT as u64)
        .map(|i| ((i * 2_654_435_761) % 8192) as u32)
        .collect();
    (kv, runner, prompt)
}

fn bench_model(c: &mut Criterion) {
    let cfg = ModelConfig::tiny();
    let w4 = ModelWeights::random(&cfg, SEED, true).expect("random weights");
    let f32w = w4.dequantized();
    let bytes = |w: &ModelWeights| w.tensors().len(); // touch export once (sanity)
    let expert_bytes = |w: &ModelWeights| -> usize {
        w.layers
            .iter()
            .filter_map(|l| match &l.ffn {
                speclab_engine::model::weights::Ffn::Moe(m) => Some(
                    m.experts
                        .iter()
                        .map(|e| {
                            e.gate.weight_bytes() + e.up.weight_bytes() + e.down.weight_bytes()
                        })
                        .sum::<usize>(),
                ),
                _ => None,
            })
            .sum()
    };
    eprintln!(
        "tiny: {} parameters; routed-expert weights in memory: W4A16 {:.2} MiB, f32 {:.2} MiB ({} / {} exported tensors)",
        cfg.num_parameters(),
        expert_bytes(&w4) as f64 / (1 << 20) as f64,
        expert_bytes(&f32w) as f64 / (1 << 20) as f64,
        bytes(&w4),
        bytes(&f32w)
    );
    let mut paths = [("w4a16", setup(w4)), ("f32_dequantized", setup(f32w))];

    let prefill = ForwardOptions {
        logits: LogitsRows::LastPerChunk,
        ..Default::default()
    };
    let mut g = c.benchmark_group("model_tiny_prefill_128");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    g.throughput(Throughput::Elements(PROMPT as u64));
    for (name, (kv, runner, prompt)) in paths.iter_mut() {
        g.bench_function(BenchmarkId::from_parameter(*name), |b| {
            b.iter(|| {
                let out = runner
                    .forward_with(
                        kv,
                        &[SeqChunk {
                            slot: ReqSlot(0),
                            tokens: prompt,
                            start_pos: 0,
                            snapshot: false,
                        }],
                        &prefill,
                    )
                    .expect("prefill");
                black_box(out.logits[0])
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("model_tiny_decode");
    g.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Elements(1));
    for (name, (kv, runner, prompt)) in paths.iter_mut() {
        runner
            .forward_with(
                kv,
                &[SeqChunk {
                    slot: ReqSlot(0),
                    tokens: prompt,
                    start_pos: 0,
                    snapshot: false,
                }],
                &prefill,
            )
            .expect("prefill");
        let tok = [prompt[PROMPT - 1]];
        g.bench_function(BenchmarkId::from_parameter(*name), |b| {
            b.iter(|| {
                let out = runner
                    .forward(
                        kv,
                        &[SeqChunk {
                            slot: ReqSlot(0),
                            tokens: &tok,
                            start_pos: PROMPT,
                            snapshot: false,
                        }],
                    )
                    .expect("decode");
                black_box(out.logits[0])
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_model);
criterion_main!(benches);
