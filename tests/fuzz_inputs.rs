//! Bounded fuzzing of every user-facing input format (issue 9, proof).
//!
//! Inputs: RON manifests (random text and mutations of a valid manifest), kv layouts
//! (RON/JSON text and structured layouts with extreme numbers), operation traces (random
//! lines and structured ops with extreme counts, replayed), safetensors headers (random
//! and mutated files) and config.json (random and mutated). Property, for every case: no
//! panic, each case finishes within [`CASE_TIME`], and the memory the case allocates on
//! its thread stays below [`ALLOC_BOUND`] (measured by a counting global allocator). CI
//! runs a fixed number of cases per format ([`CASES`], deterministic seed).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use speclab_engine::kv::{CapPolicy, GroupSpec, KvLayout};
use speclab_engine::model::ModelConfig;
use speclab_experiments::manifest::{parse_ron, Manifest};
use speclab_experiments::replay::{self, Op, Replayer};

/// Cases per format.
const CASES: u32 = 256;
/// The most one case may allocate (live bytes at peak, on its thread).
const ALLOC_BOUND: isize = 256 << 20;
/// The longest one case may take.
const CASE_TIME: Duration = Duration::from_secs(5);

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

/// Counts live bytes per thread (frees on another thread are counted there).
struct Counting;

// SAFETY: delegates to `System`; the counters are plain thread-local cells.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = LIVE.try_with(|c| {
            let v = c.get() + l.size() as isize;
            c.set(v);
            let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
        });
        // SAFETY: same layout contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        let _ = LIVE.try_with(|c| c.set(c.get() - l.size() as isize));
        // SAFETY: `p` came from `System.alloc` with this layout.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Run one case; check time and allocation bounds (a panic fails the property).
fn bounded<F: FnOnce()>(label: &str, f: F) -> Result<(), TestCaseError> {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let t0 = Instant::now();
    f();
    let peak = PEAK.with(Cell::get) - base;
    prop_assert!(t0.elapsed() < CASE_TIME, "{label}: took {:?}", t0.elapsed());
    prop_assert!(peak < ALLOC_BOUND, "{label}: allocated {peak} bytes");
    Ok(())
}

fn runner() -> TestRunner {
    TestRunner::new_with_rng(
        Config {
            cases: CASES,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    )
}

/// Text: random printable soup, or a valid document with a span replaced by junk.
fn mutated(valid: &'static str) -> impl Strategy<Value = String> {
    let junk = prop_oneof![
        Just("".to_string()),
        Just("4294967295".to_string()),
        Just("18446744073709551615".to_string()),
        Just("-1".to_string()),
        Just("1e309".to_string()),
        Just("\u{feff}".to_string()),
        Just("Some(".to_string()),
        Just("[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[".to_string()),
        "[ -~]{0,12}",
    ];
    prop_oneof![
        "[ -~\\n]{0,200}",
        (0..valid.len(), 0usize..24, junk).prop_map(move |(at, len, j)| {
            let mut s = valid.to_string();
            let a = (0..=at).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
            let b = (a + len).min(s.len());
            let b = (b..=s.len())
                .find(|&i| s.is_char_boundary(i))
                .unwrap_or(s.len());
            s.replace_range(a..b, &j);
            s
        }),
    ]
}

const MANIFEST: &str = include_str!("fixtures/manifests/small.ron");
const REAL_MANIFEST: &str = include_str!("fixtures/manifests/real_micro.ron");
const LAYOUT_JSON: &str = r#"{"num_blocks": 64, "max_model_len": 256, "max_in_flight_tokens": 64, "watermark": 0.01, "groups": [{"name": "f", "kind": "full", "block_size": 4}, {"name": "w", "kind": "sliding_window", "block_size": 4, "sliding_window": 16, "cap": "window_plus_two"}, {"name": "s", "kind": "state", "num_speculative_blocks": 2}]}"#;
const CONFIG: &str = include_str!("fixtures/model/config.json");

#[test]
fn manifests_never_panic() {
    let mut r = runner();
    let s = prop_oneof![mutated(MANIFEST), mutated(REAL_MANIFEST)];
    r.run(&s, |text| {
        bounded("manifest", || {
            let p = Path::new("fuzz.ron");
            if let Ok(m) = parse_ron::<Manifest>(p, &text) {
                if m.validate(p).is_ok() && !m.is_real() {
                    let _ = m.legs();
                }
            }
        })
    })
    .unwrap();
}

#[test]
fn layout_texts_never_panic() {
    let mut r = runner();
    r.run(&mutated(LAYOUT_JSON), |text| {
        bounded("layout", || {
            let p = Path::new("fuzz.json");
            if let Ok(l) = replay::parse_layout_json(&text, p) {
                if replay::validate_layout(&l, p).is_ok() {
                    let _ = Replayer::new(&l);
                }
            }
            let _ = replay::parse_layout_ron(&text, Path::new("fuzz.ron"));
        })
    })
    .unwrap();
}

fn extreme_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..300,
        Just(u64::MAX),
        Just(u64::MAX - 1),
        Just(1 << 32),
        any::<u64>()
    ]
}

fn extreme_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        0u32..64,
        Just(u32::MAX),
        Just(1 << 24),
        Just((1 << 24) + 1),
        any::<u32>()
    ]
}

fn group() -> impl Strategy<Value = GroupSpec> {
    (0..4u8, extreme_u32(), extreme_u32(), 0u32..8, 0..3u8).prop_map(|(k, bs, w, spec, cap)| {
        let cap = [
            CapPolicy::None,
            CapPolicy::Upstream,
            CapPolicy::WindowPlusTwo,
        ][cap as usize];
        match k {
            0 => GroupSpec::full("f", bs),
            1 => GroupSpec::sliding_window("w", bs, w, cap),
            2 => GroupSpec::state("s", spec),
            _ => GroupSpec::ring_buffer("r", bs),
        }
    })
}

fn layout() -> impl Strategy<Value = KvLayout> {
    (
        prop_oneof![Just(None), extreme_u32().prop_map(Some)],
        extreme_u32(),
        prop::collection::vec(group(), 0..4),
    )
        .prop_map(|(num_blocks, mml, mut groups)| {
            for (i, g) in groups.iter_mut().enumerate() {
                g.name = format!("{}{i}", g.name);
            }
            KvLayout {
                num_blocks,
                kv_cache_memory_bytes: None,
                max_model_len: mml,
                max_in_flight_tokens: None,
                watermark: 0.0,
                groups,
            }
        })
}

fn op() -> impl Strategy<Value = Op> {
    let req = prop_oneof![Just("a".to_string()), Just("b".to_string())];
    prop_oneof![
        (req.clone(), extreme_u64()).prop_map(|(req, prompt_len)| Op::Add { req, prompt_len }),
        (
            req.clone(),
            extreme_u64(),
            extreme_u64(),
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(
                |(req, num_new_tokens, lookahead, must_fit, has_scheduled_reqs)| Op::Allocate {
                    req,
                    num_new_tokens,
                    lookahead,
                    must_fit,
                    has_scheduled_reqs
                }
            ),
        (
            req.clone(),
            prop_oneof![-8i64..64, Just(i64::MAX), Just(i64::MIN)]
        )
            .prop_map(|(req, n)| Op::Computed { req, n }),
        (req.clone(), extreme_u64()).prop_map(|(req, n)| Op::Append { req, n }),
        req.clone().prop_map(|req| Op::Preempt { req }),
        req.prop_map(|req| Op::Free { req }),
    ]
}

#[test]
fn structured_layouts_and_traces_never_panic() {
    let mut r = runner();
    let s = (layout(), prop::collection::vec(op(), 0..40));
    r.run(&s, |(l, ops)| {
        bounded("replay", || {
            if let Ok(mut rp) = Replayer::new(&l) {
                for o in &ops {
                    let _ = rp.apply(o);
                }
            }
        })
    })
    .unwrap();
}

#[test]
fn op_lines_never_panic() {
    let line = prop_oneof![
        "[ -~]{0,80}",
        mutated(r#"{"op":"allocate","req":"a","num_new_tokens":8,"lookahead":3,"must_fit":true}"#),
        mutated(r#"{"op":"computed","req":"a","n":-2}"#),
    ];
    let mut r = runner();
    r.run(&prop::collection::vec(line, 0..8), |lines| {
        bounded("ops", || {
            let text = lines.join("\n");
            let _ = replay::parse_ops_reader(text.as_bytes(), Path::new("fuzz.jsonl"));
        })
    })
    .unwrap();
}

/// A valid safetensors file with one small tensor.
fn safetensors_bytes() -> Vec<u8> {
    let header = br#"{"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header);
    b.extend_from_slice(&[0u8; 8]);
    b
}

#[test]
fn safetensors_headers_never_panic() {
    let dir = std::env::temp_dir().join(format!("speclab-fuzz-st-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("f.safetensors");
    let valid = safetensors_bytes();
    let s = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        (
            0..valid.len(),
            any::<u8>(),
            prop::collection::vec(any::<u8>(), 0..8)
        )
            .prop_map(move |(at, b, extra)| {
                let mut v = valid.clone();
                v[at] = b;
                v.extend(extra);
                v
            }),
        any::<u64>().prop_map(|n| n.to_le_bytes().to_vec()),
    ];
    let mut r = runner();
    r.run(&s, |bytes| {
        std::fs::write(&path, &bytes).unwrap();
        bounded("safetensors", || {
            if let Ok(ck) = speclab_engine::model::Checkpoint::open_file(&path) {
                let names: Vec<String> = ck.names().map(str::to_string).collect();
                for n in names {
                    let _ = ck.shape(&n);
                }
            }
        })
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn config_json_never_panics() {
    let mut r = runner();
    r.run(&mutated(CONFIG), |text| {
        bounded("config", || {
            let _ = ModelConfig::from_json_str(&text, "fuzz/config.json");
            let _ = speclab_drafters::DFlash2Config::from_json_str(&text, "fuzz/config.json");
        })
    })
    .unwrap();
}

#[test]
fn the_allocation_bound_is_measured() {
    // The harness itself must see a large allocation, or the bound above checks nothing.
    let mut r = TestRunner::new(Config {
        cases: 1,
        failure_persistence: None,
        ..Config::default()
    });
    let res = r.run(&Just(()), |()| {
        bounded("big", || {
            let v = vec![1u8; (ALLOC_BOUND as usize) + 1];
            std::hint::black_box(&v);
        })
    });
    assert!(
        res.is_err(),
        "a {ALLOC_BOUND}-byte allocation went unnoticed"
    );
}
