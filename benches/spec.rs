//! CPU decode throughput per drafter at N = 1..7, side by side (criterion;
//! `cargo bench --bench spec`).
//!
//! The trained reference target `models/tiny` (W4A16) with each drafter:
//! none, n-gram, MTP (N = 1..7) and DFlash2 / DFlash v1 mode (N = 7, the
//! drafter's block, `models/dflash2-tiny`), greedy, one request of a held-out
//! prompt (first 128 tokens of `prompt_tokens[0]`) generating 64 tokens with
//! `ignore_eos`, through the real scheduler + model executor. Criterion's
//! throughput is output tokens per second; tau of each configuration is printed
//! once so speed and acceptance can be read together. If `models/tiny` is
//! missing the benchmark says so and measures nothing.

use std::hint::black_box;
use std::path::Path;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use speclab_drafters::DrafterSpec;
use speclab_engine::exec::{generate, EngineOptions, EngineRequest, SchedulerFactory};
use speclab_engine::kv::CapPolicy;
use speclab_engine::model::{Checkpoint, ModelWeights};

const OUT_TOKENS: u64 = 64;

fn fcfs() -> Box<SchedulerFactory<'static>> {
    Box::new(speclab_schedulers::fcfs_factory(4, 2048))
}

fn bench_spec(c: &mut Criterion) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny");
    let Ok(target) = ModelWeights::load(&dir) else {
        eprintln!("benches/spec: models/tiny not loadable; nothing measured");
        return;
    };
    let data = Checkpoint::open_file(&dir.join("data.safetensors")).expect("data.safetensors");
    let (prompts, shape) = data.i32_any_shape("prompt_tokens").expect("prompt_tokens");
    let prompt: Vec<u32> = prompts[..shape[1].min(128)]
        .iter()
        .map(|&t| t as u32)
        .collect();
    let req = vec![EngineRequest {
        id: 0,
        prompt,
        max_tokens: OUT_TOKENS,
    }];
    let opts = EngineOptions {
        max_model_len: Some(1024),
        num_blocks: 256,
        ignore_eos: true,
        ..EngineOptions::default()
    };
    let cfg = &target.cfg;
    let dflash_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/dflash2-tiny");
    let mut specs: Vec<(String, DrafterSpec)> = vec![("none".into(), DrafterSpec::none())];
    for n in 1..=7 {
        specs.push((
            format!("ngram/n={n}"),
            DrafterSpec::ngram(n, 3, 5).expect("ngram"),
        ));
        specs.push((format!("mtp/n={n}"), DrafterSpec::mtp(cfg, n).expect("mtp")));
    }
    for kind in ["dflash2", "dflash1"] {
        if let Ok(s) = DrafterSpec::load(kind, Some(&dflash_dir), cfg, 7, CapPolicy::Upstream) {
            specs.push((format!("{kind}/n=7"), s));
        }
    }
    let mut g = c.benchmark_group("spec_decode_tiny_64_tokens");
    g.sample_size(10);
    g.throughput(Throughput::Elements(OUT_TOKENS));
    for (name, spec) in &specs {
        let run = generate(&target, spec, &req, &opts, &mut *fcfs()).expect("run");
        eprintln!(
            "{name}: tau {:.3}, acceptance {:.3}",
            run.tau, run.acceptance_rate
        );
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| black_box(generate(&target, spec, &req, &opts, &mut *fcfs()).expect("run")))
        });
    }
    g.finish();
}

criterion_group!(benches, bench_spec);
criterion_main!(benches);
