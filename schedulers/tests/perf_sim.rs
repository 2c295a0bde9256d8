//! Simulation speed checks (`cargo test --release -p speclab-schedulers --test perf_sim -- --nocapture`).
//!
//! A 256K-token prompt with 8,192-token chunks and thousands of decode steps
//! must simulate in milliseconds in release builds; the debug-build test
//! below keeps a smaller version in the normal suite.

use std::time::Instant;

use speclab_engine::kv::presets::glm53_dflash2;
use speclab_engine::kv::{CapPolicy, KvCacheManager};
use speclab_engine::sim::{run_sim, AcceptanceModel, SimExecutor, SimLimits, SimRun};
use speclab_schedulers::{AdmissionPolicy, FcfsScheduler, RequestSpec, SchedulerConfig};

fn run(cap: CapPolicy, num_blocks: u32, reqs: &[(u64, u64)]) -> (SimRun, std::time::Duration) {
    let mut kv =
        KvCacheManager::from_layout(&glm53_dflash2(2304, cap, num_blocks, 262_144, 8192)).unwrap();
    let mut s = FcfsScheduler::new(SchedulerConfig {
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        num_speculative_tokens: 7,
        lookahead: 8,
        policy: AdmissionPolicy::Fcfs,
        max_steps_without_progress: 50,
    });
    for (i, &(p, m)) in reqs.iter().enumerate() {
        s.add_request(
            &kv,
            RequestSpec {
                id: i as u64,
                prompt_len: p,
                max_tokens: m,
            },
        )
        .unwrap();
    }
    let mut e = SimExecutor::new(
        5,
        AcceptanceModel::new(vec![0.7, 0.5, 0.35, 0.25, 0.15, 0.1, 0.05]).unwrap(),
    );
    let t = Instant::now();
    let r = run_sim(
        &mut kv,
        &mut s,
        &mut e,
        SimLimits {
            max_steps: 1_000_000,
        },
        &mut |_| {},
    )
    .unwrap();
    let dt = t.elapsed();
    assert_eq!(kv.num_free_blocks(), kv.usable_blocks());
    (r, dt)
}

#[test]
fn long_prompt_thousands_of_decode_steps() {
    // 256,388 tokens (the card's largest fixed case) + 5,000 outputs at tau ~3.
    let (r, dt) = run(CapPolicy::WindowPlusTwo, 1012, &[(256_388, 5_000)]);
    eprintln!(
        "window+2, 256K prompt: {} steps in {dt:?}, tau {:.2}",
        r.steps,
        r.spec.mean_acceptance_length()
    );
    assert!(r.steps > 1_000 && r.wedged.is_none() && r.finished.len() == 1);
}

#[test]
#[ignore = "timing report; run with --release"]
fn timing_report() {
    let (r, dt) = run(CapPolicy::None, 20_000, &[(256_388, 5_000)]);
    eprintln!(
        "no cap, big pool, 256K prompt: {} steps in {dt:?}, peak {:?}",
        r.steps, r.peak_held_per_group
    );
    let many: Vec<(u64, u64)> = (0..512).map(|i| (1_000 + 37 * i, 300 + i % 200)).collect();
    let (r, dt) = run(CapPolicy::WindowPlusTwo, 1012, &many);
    eprintln!(
        "512 requests: {} steps in {dt:?}, {} preemptions",
        r.steps, r.preemptions
    );
}
