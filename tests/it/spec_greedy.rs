//! Greedy speculative decoding equals plain argmax decoding, token for token.
//!
//! A toy deterministic target (logits are a hash of the last two tokens,
//! quantized so ties are frequent and the lowest-index tie-break matters)
//! decodes greedily; the spec loop drafts with the n-gram drafter, an oracle
//! that knows the greedy continuation (exercising the bonus path), or random
//! tokens, verifies with `verify_greedy` / `VerifyCtx` under greedy params,
//! and must emit exactly the same sequence. Acceptance is recorded with vLLM's
//! metric definitions through `Verified::observe`.

use proptest::prelude::*;
use speclab_drafters::Ngram;
use speclab_engine::sim::SpecMetrics;
use speclab_engine::spec::{seeded_rng, verify_greedy, DraftProbs, SamplingParams, VerifyCtx};
use speclab_engine::{Drafter, Proposal, ProposeCtx};

const V: usize = 12;

/// Toy target: logits from a hash of the last two tokens, values in {0..3}
/// (many ties), so the greedy sequence soon cycles and n-grams recur.
fn logits(ctx: &[u32], salt: u64) -> Vec<f32> {
    let a = ctx.last().copied().unwrap_or(0) as u64;
    let b = ctx.len().checked_sub(2).map_or(0, |i| ctx[i]) as u64;
    (0..V as u64)
        .map(|t| {
            let mut h = salt ^ (a << 32) ^ (b << 16) ^ t;
            h = h.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            h ^= h >> 29;
            h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            h ^= h >> 32;
            (h % 4) as f32
        })
        .collect()
}

fn argmax(l: &[f32]) -> u32 {
    // Lowest index on ties, written independently of the engine's argmax.
    let m = l.iter().copied().fold(f32::MIN, f32::max);
    l.iter().position(|&x| x == m).unwrap() as u32
}

fn greedy_reference(prompt: &[u32], n: usize, salt: u64) -> Vec<u32> {
    let mut t = prompt.to_vec();
    for _ in 0..n {
        let next = argmax(&logits(&t, salt));
        t.push(next);
    }
    t[prompt.len()..].to_vec()
}

/// The verify pass over `ctx ++ draft`: rows for the k + 1 positions.
fn verify_logits(ctx: &[u32], draft: &[u32], salt: u64) -> Vec<f32> {
    let mut t = ctx.to_vec();
    let mut out = logits(&t, salt);
    for &d in draft {
        t.push(d);
        out.extend(logits(&t, salt));
    }
    out
}

/// Drafters for the loop.
enum TestDrafter {
    Ngram(Ngram),
    /// Proposes the true greedy continuation, with every `corrupt_every`-th
    /// draft token replaced (0 = never).
    Oracle {
        reference: Vec<u32>,
        prompt_len: usize,
        k: usize,
        corrupt_every: usize,
    },
    /// Random tokens from a proptest-chosen stream.
    Random {
        stream: Vec<u32>,
        at: usize,
        k: usize,
    },
}

impl Drafter for TestDrafter {
    fn propose(&mut self, ctx: &mut ProposeCtx<'_>) -> speclab_engine::Result<Proposal> {
        match self {
            TestDrafter::Ngram(d) => d.propose(ctx),
            TestDrafter::Oracle {
                reference,
                prompt_len,
                k,
                corrupt_every,
            } => {
                let done = ctx.tokens.len() - *prompt_len;
                let n = (*k).min(ctx.max_draft);
                let mut tokens: Vec<u32> = reference.iter().skip(done).take(n).copied().collect();
                for (i, t) in tokens.iter_mut().enumerate() {
                    if *corrupt_every > 0 && (done + i) % *corrupt_every == *corrupt_every - 1 {
                        *t = (*t + 1) % V as u32;
                    }
                }
                // Draft probs are ignored under greedy params.
                let probs = Some(DraftProbs::Dense(vec![
                    vec![1.0 / V as f32; V];
                    tokens.len()
                ]));
                Ok(Proposal { tokens, probs })
            }
            TestDrafter::Random { stream, at, k } => {
                let n = (*k).min(ctx.max_draft);
                let tokens = (0..n)
                    .map(|i| stream[(*at + i) % stream.len()] % V as u32)
                    .collect();
                *at += n;
                Ok(Proposal {
                    tokens,
                    probs: None,
                })
            }
        }
    }
    fn lookahead_slots(&self) -> usize {
        0
    }
}

/// Greedy spec decoding of `n` tokens; alternates the two greedy entry points.
fn spec_decode(
    prompt: &[u32],
    n: usize,
    salt: u64,
    drafter: &mut dyn Drafter,
    k: usize,
    metrics: &mut SpecMetrics,
) -> Vec<u32> {
    let mut rng = seeded_rng(0);
    let mut t = prompt.to_vec();
    let mut via_ctx = false;
    while t.len() - prompt.len() < n {
        let remaining = n - (t.len() - prompt.len());
        // Like vLLM's max_model_len clip: never draft past the budget.
        let max_draft = k.min(remaining - 1);
        let p = drafter
            .propose(&mut ProposeCtx::new(1, &t, max_draft))
            .unwrap();
        assert!(p.tokens.len() <= max_draft);
        let l = verify_logits(&t, &p.tokens, salt);
        let v = if !via_ctx {
            verify_greedy(&l, V, &p.tokens).unwrap()
        } else {
            VerifyCtx::new(SamplingParams::GREEDY, &mut rng)
                .verify(&l, V, &p)
                .unwrap()
        };
        assert_eq!(v.tokens.len(), v.accepted + 1);
        assert_eq!(&v.tokens[..v.accepted], &p.tokens[..v.accepted]);
        v.observe(metrics);
        t.extend(&v.tokens);
        via_ctx = !via_ctx;
    }
    assert_eq!(
        t.len() - prompt.len(),
        n,
        "the loop never overshoots the budget"
    );
    t[prompt.len()..].to_vec()
}

#[test]
fn ngram_spec_decoding_equals_argmax_decoding() {
    let prompt = [3, 1, 4, 1, 5, 9, 2, 6];
    for salt in 0..20u64 {
        let want = greedy_reference(&prompt, 200, salt);
        let mut m = SpecMetrics::default();
        let mut d = TestDrafter::Ngram(Ngram::new(1, 3, 4).unwrap());
        let got = spec_decode(&prompt, 200, salt, &mut d, 4, &mut m);
        assert_eq!(got, want, "salt {salt}");
        // The toy target cycles, so the n-gram drafter must get tokens accepted.
        assert!(
            m.num_accepted_tokens > 0 && m.mean_acceptance_length() > 1.5,
            "salt {salt}: {m:?}"
        );
        assert!(m.num_accepted_tokens <= m.num_draft_tokens);
    }
}

#[test]
fn oracle_drafts_are_all_accepted_and_corruptions_corrected() {
    let prompt = [7, 7, 2];
    let want = greedy_reference(&prompt, 120, 42);
    // Perfect oracle: every draft accepted, tau = 1 + k on full steps.
    let mut m = SpecMetrics::default();
    let mut d = TestDrafter::Oracle {
        reference: want.clone(),
        prompt_len: prompt.len(),
        k: 5,
        corrupt_every: 0,
    };
    assert_eq!(spec_decode(&prompt, 120, 42, &mut d, 5, &mut m), want);
    assert_eq!(m.num_accepted_tokens, m.num_draft_tokens);
    assert_eq!(m.num_drafts, 20); // 120 tokens in steps of 5 drafts + 1 bonus
    assert_eq!(m.mean_acceptance_length(), 6.0);
    assert_eq!(m.per_position_rates(), vec![1.0; 5]);
    // Every 4th draft token corrupted: rejected there, corrected to the argmax.
    let mut m = SpecMetrics::default();
    let mut d = TestDrafter::Oracle {
        reference: want.clone(),
        prompt_len: prompt.len(),
        k: 5,
        corrupt_every: 4,
    };
    assert_eq!(spec_decode(&prompt, 120, 42, &mut d, 5, &mut m), want);
    assert!(m.num_accepted_tokens < m.num_draft_tokens);
    assert!((m.mean_acceptance_length() - 4.0).abs() < 1e-9, "{m:?}"); // 3 accepted + correction per step
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the drafter proposes, greedy verification reproduces argmax decoding.
    #[test]
    fn any_drafts_give_argmax_decoding(
        prompt in proptest::collection::vec(0u32..V as u32, 1..12),
        salt in any::<u64>(),
        k in 1usize..7,
        stream in proptest::collection::vec(0u32..V as u32, 1..40),
        use_ngram in any::<bool>(),
    ) {
        let n = 60;
        let want = greedy_reference(&prompt, n, salt);
        let mut m = SpecMetrics::default();
        let mut d = if use_ngram {
            TestDrafter::Ngram(Ngram::new(1, 2, k).unwrap())
        } else {
            TestDrafter::Random { stream, at: 0, k }
        };
        let got = spec_decode(&prompt, n, salt, &mut d, k, &mut m);
        prop_assert_eq!(got, want);
    }
}
