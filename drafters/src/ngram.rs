//! The n-gram (prompt lookup) drafter, a port of vLLM 0.33.0's
//! `vllm/v1/spec_decode/ngram_proposer.py`.
//!
//! What it does: for the request's tokens (prompt + committed output), find
//! the longest suffix n-gram, `n` in `[prompt_lookup_min, prompt_lookup_max]`,
//! that also occurs earlier in the sequence, and propose the tokens that
//! followed that earlier occurrence, up to `min(num_speculative_tokens,
//! ctx.max_draft)` of them (fewer when the sequence ends first). Nothing
//! matches: an empty proposal. The drafter has no KV cache, so
//! [`Drafter::lookahead_slots`] is 0, and it gives no draft distribution
//! (`Proposal::probs == None`: the verifier treats q as one-hot, exactly like
//! vLLM's `NO_DRAFT_PROBS` path).
//!
//! vLLM details ported exactly (`_find_longest_matched_ngram_and_propose_tokens`):
//! - The search runs KMP over the reversed sequence, keeping the prefix
//!   function only for the first `max_n` positions and falling back to
//!   `lps[max_n - 1]` when a match reaches `max_n`, so a match is never longer
//!   than `max_n`.
//! - Among the earlier occurrences of the longest matched n-gram, vLLM takes the
//!   **earliest** one in the original order (the last one in reversed order:
//!   `if prev_lps >= longest_ngram: position = i`), not the most recent.
//!   Occurrences may overlap the suffix itself.
//! - The proposal is `tokens[start .. start + k]` clipped at the end of the
//!   sequence, so it may run into the suffix itself.
//! - A sequence shorter than `min_n` proposes nothing.
//!
//! Not ported: vLLM also clips `k` at `max_model_len - num_tokens` and skips
//! requests at `max_model_len`; here the caller expresses that through
//! `ctx.max_draft` (0 gives an empty proposal). vLLM's config defaults both
//! bounds to 5 when neither is given ([`Ngram::vllm_default`]).
//!
//! Invariant: a proposal is never longer than `min(num_speculative_tokens,
//! ctx.max_draft)`, and when non-empty it is exactly the run of tokens that
//! followed an earlier occurrence of a suffix n-gram of length in `[min, max]`.

use speclab_engine::{Drafter, EngineError, Proposal, ProposeCtx, Result};

/// Prompt-lookup n-gram drafter (vLLM `method = "ngram"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ngram {
    /// Shortest suffix n-gram to match (vLLM `prompt_lookup_min`), >= 1.
    pub prompt_lookup_min: usize,
    /// Longest suffix n-gram to match (vLLM `prompt_lookup_max`), >= min.
    pub prompt_lookup_max: usize,
    /// Most tokens to propose per step (vLLM `num_speculative_tokens`), >= 1.
    pub num_speculative_tokens: usize,
}

fn bad_config(reason: String) -> EngineError {
    EngineError::InvalidDrafterConfig {
        drafter: "ngram".into(),
        reason,
    }
}

impl Ngram {
    /// A validated drafter.
    pub fn new(
        prompt_lookup_min: usize,
        prompt_lookup_max: usize,
        num_speculative_tokens: usize,
    ) -> Result<Self> {
        let d = Self {
            prompt_lookup_min,
            prompt_lookup_max,
            num_speculative_tokens,
        };
        d.validate()?;
        Ok(d)
    }

    /// vLLM's defaults when neither bound is configured: min = max = 5.
    pub fn vllm_default(num_speculative_tokens: usize) -> Result<Self> {
        Self::new(5, 5, num_speculative_tokens)
    }

    /// `1 <= prompt_lookup_min <= prompt_lookup_max` and `num_speculative_tokens >= 1`.
    pub fn validate(&self) -> Result<()> {
        if self.prompt_lookup_min == 0 {
            return Err(bad_config("prompt_lookup_min must be >= 1, got 0".into()));
        }
        if self.prompt_lookup_min > self.prompt_lookup_max {
            return Err(bad_config(format!(
                "prompt_lookup_min={} must be <= prompt_lookup_max={}",
                self.prompt_lookup_min, self.prompt_lookup_max
            )));
        }
        if self.num_speculative_tokens == 0 {
            return Err(bad_config(
                "num_speculative_tokens must be >= 1, got 0".into(),
            ));
        }
        Ok(())
    }
}

/// vLLM `_find_longest_matched_ngram_and_propose_tokens`: the tokens that
/// followed the earliest earlier occurrence of the longest suffix n-gram with
/// `n` in `[min_n, max_n]`, at most `k` of them; empty when none matches.
/// Expects `1 <= min_n <= max_n` (callers validate); `k == 0` gives empty.
pub fn find_longest_matched_ngram(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> &[u32] {
    let total = tokens.len();
    if total < min_n || k == 0 || max_n == 0 {
        return &[];
    }
    // Reversed view: the suffix of `tokens` is the prefix of `rev`.
    let rev = |i: usize| tokens[total - 1 - i];
    // lps[i] = longest proper prefix of rev[..=i] that is also its suffix,
    // stored for the first max_n positions only.
    let mut lps = vec![0usize; max_n];
    let mut longest = 0usize;
    let mut position = 0usize;
    let mut prev_lps = 0usize;
    let mut i = 1usize;
    while i < total {
        if rev(prev_lps) == rev(i) {
            prev_lps += 1;
            // `>=`: a later i in reversed order is an earlier occurrence in
            // the original order; vLLM keeps the earliest.
            if prev_lps >= longest {
                longest = prev_lps;
                position = i;
            }
            if i < max_n {
                lps[i] = prev_lps;
            }
            if prev_lps == max_n {
                prev_lps = lps[max_n - 1];
            }
            i += 1;
        } else if prev_lps != 0 {
            prev_lps = lps[prev_lps - 1];
        } else {
            i += 1;
        }
    }
    if longest < min_n {
        return &[];
    }
    let start = total - 1 - position + longest;
    let k = k.min(total - start);
    &tokens[start..start + k]
}

impl Drafter for Ngram {
    fn propose(&mut self, ctx: &mut ProposeCtx<'_>) -> Result<Proposal> {
        self.validate()?;
        let k = self.num_speculative_tokens.min(ctx.max_draft);
        let draft = find_longest_matched_ngram(
            ctx.tokens,
            self.prompt_lookup_min,
            self.prompt_lookup_max,
            k,
        );
        Ok(Proposal {
            tokens: draft.to_vec(),
            probs: None,
        })
    }

    fn lookahead_slots(&self) -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn propose(d: Ngram, tokens: &[u32], max_draft: usize) -> Vec<u32> {
        let mut d = d;
        let p = d
            .propose(&mut ProposeCtx::new(0, tokens, max_draft))
            .unwrap();
        assert!(p.probs.is_none());
        p.tokens
    }

    #[test]
    fn validation() {
        assert!(Ngram::new(1, 3, 4).is_ok());
        assert!(Ngram::new(3, 3, 1).is_ok());
        assert!(Ngram::vllm_default(7).is_ok());
        for (min, max, k) in [(0, 3, 4), (4, 3, 4), (1, 3, 0)] {
            let e = Ngram::new(min, max, k).unwrap_err();
            assert!(matches!(e, EngineError::InvalidDrafterConfig { .. }), "{e}");
        }
        // A hand-built invalid drafter is refused at propose time.
        let mut d = Ngram {
            prompt_lookup_min: 0,
            prompt_lookup_max: 2,
            num_speculative_tokens: 2,
        };
        assert!(d.propose(&mut ProposeCtx::new(0, &[1, 2, 1], 2)).is_err());
        assert_eq!(Ngram::new(1, 2, 3).unwrap().lookahead_slots(), 0);
    }

    /// Cases of vLLM's own tests (tests/v1/spec_decode/test_ngram.py), then
    /// hand-derived cases from reading the numba function.
    #[test]
    fn vllm_test_cases() {
        let f = find_longest_matched_ngram;
        let none: &[u32] = &[];
        assert_eq!(f(&[1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2), none);
        let t = [1, 2, 3, 4, 1, 2, 3];
        assert_eq!(f(&t, 2, 2, 3), &[4, 1, 2]);
        assert_eq!(f(&t, 2, 2, 2), &[4, 1]);
        assert_eq!(f(&t, 1, 1, 3), &[4, 1, 2]);
        assert_eq!(f(&t, 1, 1, 2), &[4, 1]);
        let t = [1, 3, 6, 2, 3, 4, 1, 2, 3];
        assert_eq!(f(&t, 2, 2, 3), &[4, 1, 2]);
        // "Return on the first match": the unigram [3] first occurs at index 1.
        assert_eq!(f(&t, 1, 1, 2), &[6, 2]);
        assert_eq!(f(&[1, 2, 3, 4, 5], 2, 2, 2), none);
        assert_eq!(f(&[1, 2, 3, 4, 1, 2, 3], 4, 4, 2), none);
        assert_eq!(f(&[1, 2, 3, 4, 1, 2, 3], 3, 4, 2), &[4, 1]);
        // The 4-gram match wins over the 3-gram one.
        assert_eq!(f(&[2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2), &[1, 2]);
        assert_eq!(f(&[3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2), &[1, 2]);
        // Several 3-gram matches: the first (earliest) one.
        assert_eq!(
            f(
                &[1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3],
                3,
                3,
                2
            ),
            &[100, 1]
        );
    }

    #[test]
    fn hand_cases() {
        let d = |min, max, k| Ngram::new(min, max, k).unwrap();
        // [2,3] at 3 beats the earlier unigram [3] at 1: longest first.
        assert_eq!(
            propose(d(1, 2, 2), &[1, 3, 6, 2, 3, 4, 1, 2, 3], 2),
            vec![4, 1]
        );
        // Earliest occurrence: [5,6] occurs at 0 (then 7) and at 3 (then 8).
        assert_eq!(propose(d(2, 2, 1), &[5, 6, 7, 5, 6, 8, 5, 6], 1), vec![7]);
        // Capped at max_n: [1,2,3] occurs at 0 (then 9); with max 2 the
        // bigram [2,3] occurs at 1 (then 9) and 5 (then 4): earliest, 9.
        assert_eq!(
            propose(d(2, 2, 1), &[1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 1),
            vec![9]
        );
        // With max 3 the trigram at 0 wins; k runs on past the next match.
        assert_eq!(
            propose(d(2, 3, 3), &[1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 3),
            vec![9, 2, 3]
        );
        // Clipped at the end of the sequence; overlapping occurrences.
        assert_eq!(propose(d(1, 3, 5), &[7, 7, 7, 7], 5), vec![7]);
        assert_eq!(propose(d(1, 1, 5), &[4, 2, 4], 5), vec![2, 4]);
        // Shorter than min_n, empty, single token.
        assert_eq!(propose(d(3, 3, 2), &[1, 1], 2), Vec::<u32>::new());
        assert_eq!(propose(d(1, 1, 2), &[], 2), Vec::<u32>::new());
        assert_eq!(propose(d(1, 1, 2), &[3], 2), Vec::<u32>::new());
        // max_draft caps k; 0 proposes nothing; a larger max_draft does not raise k.
        assert_eq!(propose(d(3, 4, 3), &[1, 2, 3, 4, 1, 2, 3], 1), vec![4]);
        assert_eq!(
            propose(d(3, 4, 3), &[1, 2, 3, 4, 1, 2, 3], 0),
            Vec::<u32>::new()
        );
        assert_eq!(
            propose(d(3, 4, 3), &[1, 2, 3, 4, 1, 2, 3], 99),
            vec![4, 1, 2]
        );
        // max_n larger than the sequence.
        assert_eq!(propose(d(1, 50, 4), &[1, 2, 1], 4), vec![2, 1]);
    }

    /// Reference: the suffix n-gram of the largest n in [min, max] that occurs
    /// at an earlier start; among its occurrences the earliest; the k tokens after it.
    fn brute(tokens: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
        let t = tokens.len();
        for n in (min..=max.min(t.saturating_sub(1))).rev() {
            let suffix = &tokens[t - n..];
            if let Some(s) = (0..t - n).find(|&s| &tokens[s..s + n] == suffix) {
                return tokens[s + n..(s + n + k).min(t)].to_vec();
            }
        }
        Vec::new()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// A proposal is always the run of tokens that followed an earlier
        /// occurrence of a suffix n-gram with n in [min, max], and the port
        /// equals the brute-force reference (longest n, earliest occurrence).
        #[test]
        fn proposal_follows_an_earlier_occurrence(
            tokens in proptest::collection::vec(0u32..4, 0..60),
            min in 1usize..4,
            extra in 0usize..4,
            k in 1usize..6,
            max_draft in 0usize..8,
        ) {
            let max = min + extra;
            let d = Ngram::new(min, max, k).unwrap();
            let got = propose(d, &tokens, max_draft);
            let kk = k.min(max_draft);
            prop_assert!(got.len() <= kk);
            prop_assert_eq!(&got, &brute(&tokens, min, max, kk));
            if !got.is_empty() {
                let t = tokens.len();
                let follows = (min..=max.min(t - 1)).any(|n| {
                    let suffix = &tokens[t - n..];
                    (0..t - n).any(|s| {
                        &tokens[s..s + n] == suffix
                            && tokens[s + n..].starts_with(&got)
                            && (got.len() == kk || s + n + got.len() == t)
                    })
                });
                prop_assert!(follows, "proposal {:?} does not follow an earlier suffix occurrence", got);
            } else if kk > 0 {
                // Nothing proposed: no suffix n-gram with n in [min, max] recurs.
                let t = tokens.len();
                let any = (min..=max.min(t.saturating_sub(1))).any(|n| {
                    let suffix = &tokens[t - n..];
                    (0..t - n).any(|s| &tokens[s..s + n] == suffix)
                });
                prop_assert!(!any);
            }
        }
    }
}
