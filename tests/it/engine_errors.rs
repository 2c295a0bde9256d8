//! Bad input to the real engine gives clear errors, never panics.
//!
//! Unknown drafter kind; drafter weights that do not match the target (hidden size, vocab,
//! target layer ids out of range; a v1-only checkpoint asked for v2); N = 0 or above the
//! drafter's block; MTP on a target without an MTP layer; prompts longer than
//! max_model_len, empty, with out-of-vocab ids, max_tokens 0; temperature > 0 in the
//! lossless check; a pool too small to ever admit a request (a wedge report, and an error
//! from the lossless check); a drafter that proposes more than allowed; the same through
//! the `speclab generate` / `verify-lossless` CLI (exit code 2 and a message on stderr).

use std::process::Command;

use crate::engine_support::*;
use speclab_drafters::{DFlash2Config, DFlash2Weights, DraftMode, DrafterKind, DrafterSpec};
use speclab_engine::exec::{
    generate, verify_lossless, DrafterFactory, EngineOptions, EngineRequest,
};
use speclab_engine::kv::{CapPolicy, GroupSpec, KvCacheManager};
use speclab_engine::model::{ModelConfig, ModelWeights};
use speclab_engine::spec::SamplingParams;
use speclab_engine::{Drafter, EngineError, Proposal, ProposeCtx};

fn err_text<T: std::fmt::Debug>(r: Result<T, EngineError>) -> String {
    r.expect_err("expected an error").to_string()
}

#[test]
fn drafter_configuration_errors() {
    let cfg = ModelConfig::micro();
    // Unknown kind.
    let e = err_text("eagle9".parse::<DrafterKind>());
    assert!(
        e.contains("unknown drafter kind `eagle9`")
            && e.contains("none, ngram, mtp, dflash2, dflash1"),
        "{e}"
    );
    // N = 0.
    assert!(err_text(DrafterSpec::ngram(0, 1, 3)).contains("num_speculative_tokens must be >= 1"));
    assert!(err_text(DrafterSpec::mtp(&cfg, 0)).contains("num_speculative_tokens must be >= 1"));
    let w = micro_dflash(1);
    let e = err_text(DrafterSpec::dflash(
        w.clone(),
        &cfg,
        0,
        DraftMode::V2,
        8,
        CapPolicy::None,
    ));
    assert!(
        e.contains("num_speculative_tokens = 0 is out of range"),
        "{e}"
    );
    // N above the drafter's block (micro block 8: N <= 7).
    let e = err_text(DrafterSpec::dflash(
        w.clone(),
        &cfg,
        8,
        DraftMode::V1,
        8,
        CapPolicy::None,
    ));
    assert!(
        e.contains("num_speculative_tokens = 8 is out of range: it must be in 1..=7"),
        "{e}"
    );
    assert!(DrafterSpec::dflash(w.clone(), &cfg, 7, DraftMode::V1, 8, CapPolicy::None).is_ok());
    // MTP on a target without an MTP layer.
    let mut no_mtp = cfg.clone();
    no_mtp.num_nextn_predict_layers = 0;
    assert!(err_text(DrafterSpec::mtp(&no_mtp, 2)).contains("no MTP layer"));
    // Weights for another target: hidden size (the tiny drafter), vocab, layer ids.
    let tiny = DFlash2Weights::random(&DFlash2Config::preset("dflash2-tiny").unwrap(), 1).unwrap();
    let e = err_text(DrafterSpec::dflash(
        tiny,
        &cfg,
        3,
        DraftMode::V2,
        8,
        CapPolicy::None,
    ));
    assert!(
        e.contains("hidden_size") && e.contains("differs from the target"),
        "{e}"
    );
    let mut c = DFlash2Config::preset("dflash2-micro").unwrap();
    c.vocab_size = 1024;
    let e = err_text(DrafterSpec::dflash(
        DFlash2Weights::random(&c, 1).unwrap(),
        &cfg,
        3,
        DraftMode::V2,
        8,
        CapPolicy::None,
    ));
    assert!(e.contains("vocab_size") && e.contains("1024"), "{e}");
    let mut c = DFlash2Config::preset("dflash2-micro").unwrap();
    c.dflash_config.target_layer_ids = vec![0, 7];
    c.num_target_layers = 8;
    let e = err_text(
        DFlash2Weights::random(&c, 1)
            .and_then(|w| DrafterSpec::dflash(w, &cfg, 3, DraftMode::V2, 8, CapPolicy::None)),
    );
    assert!(
        e.contains("target_layer_ids") && e.contains("out of range"),
        "{e}"
    );
    // A v1-only checkpoint cannot draft in v2 mode.
    let e = err_text(DrafterSpec::dflash(
        w.v1_only(),
        &cfg,
        3,
        DraftMode::V2,
        8,
        CapPolicy::None,
    ));
    assert!(e.contains("v1-only"), "{e}");
    assert!(DrafterSpec::dflash(w.v1_only(), &cfg, 3, DraftMode::V1, 8, CapPolicy::None).is_ok());
    // DFlash from a kind name without a directory; from a directory of another target.
    let e = err_text(DrafterSpec::load("dflash2", None, &cfg, 3, CapPolicy::None));
    assert!(e.contains("--drafter-dir"), "{e}");
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dflash2");
    assert!(DrafterSpec::load("dflash2", Some(&fixture), &cfg, 3, CapPolicy::None).is_ok());
    let e = err_text(DrafterSpec::load(
        "dflash2",
        Some(&fixture),
        &ModelConfig::tiny(),
        3,
        CapPolicy::None,
    ));
    assert!(e.contains("hidden_size"), "{e}");
}

#[test]
fn request_and_run_errors() {
    let target = micro_target(2);
    let mml = target.cfg.max_position_embeddings;
    let opts = EngineOptions::default();
    let mtp = DrafterSpec::mtp(&target.cfg, 2).unwrap();
    let go = |reqs: Vec<EngineRequest>, opts: &EngineOptions| {
        let mut f = fcfs(64, 4);
        generate(&target, &mtp, &reqs, opts, &mut f)
    };
    let req = |prompt: Vec<u32>, max_tokens| {
        vec![EngineRequest {
            id: 0,
            prompt,
            max_tokens,
        }]
    };
    let e = err_text(go(req(vec![1; mml], 4), &opts));
    assert!(
        e.contains("prompt of 256 tokens does not fit max_model_len 256"),
        "{e}"
    );
    let capped = EngineOptions {
        max_model_len: Some(32),
        ..opts
    };
    let e = err_text(go(req(vec![1; 40], 4), &capped));
    assert!(
        e.contains("prompt of 40 tokens does not fit max_model_len 32"),
        "{e}"
    );
    let e = err_text(go(
        req(vec![1; 4], 4),
        &EngineOptions {
            max_model_len: Some(10_000),
            ..opts
        },
    ));
    assert!(
        e.contains("max_model_len") && e.contains("max_position_embeddings"),
        "{e}"
    );
    assert!(err_text(go(req(vec![], 4), &opts)).contains("empty prompt"));
    assert!(err_text(go(req(vec![1, 2], 0), &opts)).contains("max_tokens must be >= 1"));
    let e = err_text(go(req(vec![1, 600], 4), &opts));
    assert!(
        e.contains("token id 600 is not below vocab_size 512"),
        "{e}"
    );
    let e = err_text(go(
        vec![
            EngineRequest {
                id: 3,
                prompt: vec![1],
                max_tokens: 1,
            },
            EngineRequest {
                id: 3,
                prompt: vec![2],
                max_tokens: 1,
            },
        ],
        &opts,
    ));
    assert!(e.contains("request 3 already exists"), "{e}");
    let e = err_text(go(
        req(vec![1, 2], 2),
        &EngineOptions {
            sampling: SamplingParams::random(7.0),
            ..opts
        },
    ));
    assert!(e.contains("temperature"), "{e}");
    // Generation up to max_model_len stops there.
    let run = go(
        req(vec![3; 30], 100),
        &EngineOptions {
            max_model_len: Some(40),
            ignore_eos: true,
            ..opts
        },
    )
    .unwrap();
    assert_eq!(run.requests[0].output.len(), 10);
    assert_eq!(
        run.requests[0].finish,
        Some(speclab_engine::exec::FinishReason::MaxModelLen)
    );
    assert_allocator_clean(&run, "max_model_len");
    // A pool that can never admit the request: a wedge report, not a hang or a panic.
    let tiny_pool = EngineOptions {
        num_blocks: 4,
        ..opts
    };
    let run = go(req(vec![5; 100], 4), &tiny_pool).unwrap();
    let w = run.wedged.as_deref().expect("wedged");
    assert!(w.contains("usable blocks"), "{w}");
    assert!(!run.complete());
    // The lossless check refuses sampling and incomplete runs.
    let mut f = fcfs(64, 4);
    let e = err_text(verify_lossless(
        &target,
        &mtp,
        &req(vec![1, 2], 2),
        &EngineOptions {
            sampling: SamplingParams::random(0.5),
            ..opts
        },
        &mut f,
    ));
    assert!(e.contains("lossless only in distribution"), "{e}");
    let e = err_text(verify_lossless(
        &target,
        &mtp,
        &req(vec![5; 100], 4),
        &tiny_pool,
        &mut f,
    ));
    assert!(
        e.contains("did not finish every request") && e.contains("usable blocks"),
        "{e}"
    );
}

/// A drafter that ignores `max_draft`.
struct Greedy;
impl Drafter for Greedy {
    fn propose(&mut self, ctx: &mut ProposeCtx<'_>) -> speclab_engine::Result<Proposal> {
        Ok(Proposal {
            tokens: vec![1; ctx.max_draft + 2],
            probs: None,
        })
    }
    fn lookahead_slots(&self) -> usize {
        0
    }
}
struct GreedyFactory;
impl DrafterFactory for GreedyFactory {
    fn num_speculative_tokens(&self) -> usize {
        2
    }
    fn kv_groups(&self) -> speclab_engine::Result<Vec<GroupSpec>> {
        Ok(vec![])
    }
    fn build(
        &self,
        _t: &ModelConfig,
        _kv: &KvCacheManager,
    ) -> speclab_engine::Result<Box<dyn Drafter>> {
        Ok(Box::new(Greedy))
    }
}

#[test]
fn a_drafter_that_overdrafts_is_an_error() {
    let target: ModelWeights = micro_target(2);
    let mut f = fcfs(64, 4);
    let e = err_text(generate(
        &target,
        &GreedyFactory,
        &[EngineRequest {
            id: 0,
            prompt: vec![1, 2, 3],
            max_tokens: 5,
        }],
        &EngineOptions::default(),
        &mut f,
    ));
    assert!(e.contains("proposed 4 drafts, at most 2 allowed"), "{e}");
}

fn speclab(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_speclab"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn cli_generate_and_verify_lossless() {
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/model");
    let dflash = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/dflash2");
    let (code, _, err) = speclab(&[
        "generate",
        "--model",
        model,
        "--drafter",
        "eagle9",
        "--num-spec",
        "2",
        "--prompt-ids",
        "1,2",
    ]);
    assert_eq!(code, 2);
    assert!(
        err.contains("unknown drafter kind `eagle9`") && !err.contains("panicked"),
        "{err}"
    );
    let (code, _, err) = speclab(&[
        "generate",
        "--model",
        model,
        "--drafter",
        "mtp",
        "--prompt-ids",
        "1,2",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("--num-spec"), "{err}");
    let (code, _, err) = speclab(&[
        "generate",
        "--model",
        model,
        "--drafter",
        "mtp",
        "--num-spec",
        "0",
        "--prompt-ids",
        "1,2",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("num_speculative_tokens must be >= 1"), "{err}");
    let (code, _, err) = speclab(&[
        "generate",
        "--model",
        model,
        "--drafter",
        "dflash2",
        "--drafter-dir",
        dflash,
        "--num-spec",
        "9",
        "--prompt-ids",
        "1,2",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("out of range"), "{err}");
    let (code, _, err) = speclab(&["generate", "--model", model, "--prompt", "hello"]);
    assert_eq!(code, 2);
    assert!(err.contains("tokenizer.json"), "{err}");
    let long: String = (0..300)
        .map(|i| (i % 400).to_string())
        .collect::<Vec<_>>()
        .join(",");
    let (code, _, err) = speclab(&["generate", "--model", model, "--prompt-ids", &long]);
    assert_eq!(code, 2);
    assert!(err.contains("does not fit max_model_len 256"), "{err}");
    // A working run, JSON.
    let (code, out, err) = speclab(&[
        "generate",
        "--model",
        model,
        "--drafter",
        "dflash2",
        "--drafter-dir",
        dflash,
        "--drafter-block-size",
        "8",
        "--num-spec",
        "3",
        "--prompt-ids",
        "5,6,7,8",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 6);
    assert_eq!(
        v["run"]["spec"]["num_draft_tokens"].as_u64().unwrap() % 3,
        0
    );
    // verify-lossless: JSON, exit 0 when lossless.
    let (code, out, err) = speclab(&[
        "verify-lossless",
        "--model",
        model,
        "--drafter",
        "mtp",
        "--num-spec",
        "3",
        "--random-prompts",
        "2:12",
        "--max-tokens",
        "8",
        "--max-num-batched-tokens",
        "8",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["lossless"], true);
    assert_eq!(v["num_tokens_compared"].as_u64().unwrap(), 16);
}
