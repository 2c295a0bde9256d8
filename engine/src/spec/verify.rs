//! Lossless verification of a drafter's proposal against one target verify pass.
//!
//! What it does: the target scored `k + 1` positions (the last committed token
//! followed by the `k` drafts), giving logits `[k + 1][V]` flattened row-major.
//! Verification walks the drafts and emits `accepted + 1` tokens: the accepted
//! drafts, then either the correction token at the first rejected position or
//! the bonus token at position `k` when every draft was accepted.
//!
//! - Greedy ([`verify_greedy`], or [`VerifyCtx::verify`] with greedy params):
//!   accept while `draft[i] == argmax(target[i])` (ties -> lowest index); the
//!   emitted token at the stopping position is `argmax(target[j])`. The output
//!   equals plain argmax decoding exactly. No randomness is consumed.
//! - Sampling (temperature > 0, optional top-k / top-p): speculative sampling
//!   (Leviathan et al. 2023, Chen et al. 2023). `p = target_probs(target[i])`,
//!   `q` = the drafter's row `Proposal::probs[i]`, or the one-hot of the draft
//!   token when the drafter gives none (n-gram). Accept `x = draft[i]` when
//!   `q(x) > 0` and `u < p(x) / q(x)` for a fresh uniform `u`; at the first
//!   rejection emit a sample of `norm(max(0, p - q))` (falling back to `p` if
//!   that has no mass); if all are accepted emit a sample of `p` at row `k`.
//!   The emitted sequence is distributed exactly as sampling the target alone.
//!
//! Where it comes from: vLLM 0.33.0 `vllm/v1/sample/rejection_sampler.py`
//! (`rejection_greedy_sample_kernel`, `rejection_random_sample_kernel`,
//! `sample_recovered_tokens_kernel`). Ported: greedy compares against the
//! argmax and emits it; a zero draft probability rejects ("avoid NaNs"); with
//! no draft probs the recovered distribution is `p` with the draft token
//! masked out (= `max(0, p - onehot)`); the target distribution for accept,
//! recovery and bonus is the processed one (temperature, top-k, top-p);
//! uniforms are f64. Deviations: vLLM accepts on `p/q >= u`; here `u < p/q`,
//! so a token with `p(x) = 0` is never accepted (they differ only when `u`
//! hits `p/q` exactly, probability ~2^-53). When `max(0, p - q)` has no mass
//! vLLM's argmax over zeros returns token 0; here it falls back to sampling
//! `p` (the case only arises when `p == q` up to rounding, where rejection has
//! probability ~0 anyway). vLLM samples the bonus token outside the
//! rejection sampler, with the same processed logits; here it is sampled
//! inline from row `k`.
//!
//! RNG use (reproducibility): one uniform per examined draft position in
//! order, then one uniform for the emitted correction/bonus token. The RNG is
//! borrowed through [`VerifyCtx`]; there is no global state.
//!
//! Invariants: `tokens.len() == accepted + 1`, `accepted <= num_draft`,
//! `tokens[..accepted] == draft[..accepted]`, every emitted id is `< V`, and
//! invalid inputs (shape or vocabulary mismatches, draft ids `>= V`, NaN or
//! +inf logits, negative or non-finite q) are errors, never panics.

use rand::RngCore;

use crate::sim::SpecMetrics;
use crate::traits::Proposal;
use crate::{EngineError, Result};

use super::probs::check_draft_probs;
use super::sampling::{
    argmax, check_logits, sample_index_with, target_probs, uniform, SamplingParams,
};

/// What one verification emitted.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Verified {
    /// Draft tokens that were verified (`k`).
    pub num_draft: usize,
    /// Accepted draft tokens (the bonus/correction token is not counted).
    pub accepted: usize,
    /// Emitted tokens: `draft[..accepted]`, then the correction or bonus token.
    /// Shape `[accepted + 1]`.
    pub tokens: Vec<u32>,
}

impl Verified {
    /// Rejected drafts (vLLM rolls `num_computed_tokens` back by this many).
    pub fn rejected(&self) -> usize {
        self.num_draft.saturating_sub(self.accepted)
    }

    /// Record this verification in vLLM's spec-decode counters
    /// (`SpecDecodingStats.observe_draft`); like vLLM's scheduler, a step
    /// without drafts is not recorded.
    pub fn observe(&self, metrics: &mut SpecMetrics) {
        if self.num_draft > 0 {
            metrics.observe_draft(self.num_draft as u64, self.accepted as u64);
        }
    }
}

/// The borrowed context of sampling verification: the target's sampling
/// parameters and the caller's seeded RNG.
pub struct VerifyCtx<'a> {
    pub params: SamplingParams,
    pub rng: &'a mut dyn RngCore,
}

impl std::fmt::Debug for VerifyCtx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerifyCtx")
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

fn bad(reason: String) -> EngineError {
    EngineError::InvalidVerifyInput { reason }
}

/// Shape checks shared by both paths: `target_logits.len() == (k + 1) * vocab`,
/// draft ids `< vocab`, every logits row acceptable.
fn check_shapes(target_logits: &[f32], vocab: usize, draft: &[u32]) -> Result<()> {
    if vocab == 0 {
        return Err(bad("vocab size is 0".into()));
    }
    let rows = draft.len() + 1;
    if target_logits.len() != rows * vocab {
        return Err(bad(format!(
            "target logits hold {} values; {} drafts need {} rows of vocab {} = {}",
            target_logits.len(),
            draft.len(),
            rows,
            vocab,
            rows * vocab
        )));
    }
    if let Some((i, &t)) = draft.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(bad(format!(
            "draft token {i} is {t}, outside vocab {vocab}"
        )));
    }
    for (r, row) in target_logits.chunks_exact(vocab).enumerate() {
        check_logits(row).map_err(|e| bad(format!("target row {r}: {e}")))?;
    }
    Ok(())
}

/// Greedy verification. `target_logits`: Shape `[k + 1][vocab]` row-major,
/// `draft`: Shape `[k]`. Consumes no randomness.
pub fn verify_greedy(target_logits: &[f32], vocab: usize, draft: &[u32]) -> Result<Verified> {
    check_shapes(target_logits, vocab, draft)?;
    greedy(target_logits, vocab, draft)
}

fn greedy(target_logits: &[f32], vocab: usize, draft: &[u32]) -> Result<Verified> {
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    for (i, (row, &x)) in target_logits.chunks_exact(vocab).zip(draft).enumerate() {
        let t = argmax(row)? as u32;
        tokens.push(t);
        if t != x {
            return Ok(Verified {
                num_draft: draft.len(),
                accepted: i,
                tokens,
            });
        }
    }
    let bonus = argmax(&target_logits[draft.len() * vocab..])? as u32;
    tokens.push(bonus);
    Ok(Verified {
        num_draft: draft.len(),
        accepted: draft.len(),
        tokens,
    })
}

/// Greedy verification from the target's argmax ids (a device backend computes them
/// and keeps the logits on the device): the same result as [`verify_greedy`] on the
/// logits the ids came from. `target_ids`: Shape `[k + 1]`, `draft`: Shape `[k]`. The
/// finiteness check of the logits path is the backend's (its argmax kernel).
pub fn verify_greedy_ids(target_ids: &[u32], draft: &[u32]) -> Result<Verified> {
    if target_ids.len() != draft.len() + 1 {
        return Err(bad(format!(
            "{} target argmax ids for {} draft tokens (expected {})",
            target_ids.len(),
            draft.len(),
            draft.len() + 1
        )));
    }
    let accepted = target_ids
        .iter()
        .zip(draft)
        .take_while(|(t, d)| t == d)
        .count();
    Ok(Verified {
        num_draft: draft.len(),
        accepted,
        tokens: target_ids[..=accepted].to_vec(),
    })
}

impl<'a> VerifyCtx<'a> {
    /// A context over the caller's RNG.
    pub fn new(params: SamplingParams, rng: &'a mut dyn RngCore) -> Self {
        Self { params, rng }
    }

    /// Verify `proposal` against the target logits of one verify pass.
    /// `target_logits`: Shape `[k + 1][vocab]` row-major, `k = proposal.tokens.len()`;
    /// `proposal.probs`, when given: Shape `[k][vocab]`. Greedy params take the
    /// greedy path (draft probs ignored, no randomness consumed).
    pub fn verify(
        &mut self,
        target_logits: &[f32],
        vocab: usize,
        proposal: &Proposal,
    ) -> Result<Verified> {
        check_inputs(&self.params, target_logits, vocab, proposal)?;
        if self.params.is_greedy() {
            return greedy(target_logits, vocab, &proposal.tokens);
        }
        let rng = &mut *self.rng;
        rejection_sample(target_logits, vocab, proposal, &self.params, &mut || {
            uniform(rng)
        })
    }
}

/// Every check [`VerifyCtx::verify`] makes before it draws: params, shapes, logits rows,
/// q's shape and entries.
fn check_inputs(
    params: &SamplingParams,
    target_logits: &[f32],
    vocab: usize,
    proposal: &Proposal,
) -> Result<()> {
    params.validate()?;
    let draft = &proposal.tokens;
    check_shapes(target_logits, vocab, draft)?;
    match &proposal.probs {
        Some(q) => check_draft_probs(q, draft.len(), vocab),
        None => Ok(()),
    }
}

/// The sampling path of [`VerifyCtx::verify`] (shapes already checked, params not
/// greedy) with every uniform taken from `draw`, in the order documented in the module
/// header.
fn rejection_sample(
    target_logits: &[f32],
    vocab: usize,
    proposal: &Proposal,
    params: &SamplingParams,
    draw: &mut dyn FnMut() -> f64,
) -> Result<Verified> {
    let draft = &proposal.tokens;
    let rows: Vec<&[f32]> = target_logits.chunks_exact(vocab).collect();
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    for (i, &x) in draft.iter().enumerate() {
        let p = target_probs(rows[i], params)?;
        let xi = x as usize;
        let q = proposal.probs.as_ref();
        let q_x = q.map_or(1.0, |q| f64::from(q.at(i, xi)));
        let u = draw();
        if q_x > 0.0 && u < p[xi] / q_x {
            tokens.push(x);
            continue;
        }
        // Rejected: sample the residual norm(max(0, p - q)).
        let residual: Vec<f64> = match q {
            Some(q) => q.residual(i, &p),
            None => p
                .iter()
                .enumerate()
                .map(|(j, &pj)| if j == xi { 0.0 } else { pj })
                .collect(),
        };
        let t = match sample_index_with(&residual, draw) {
            Some(t) => t,
            None => sample_index_with(&p, draw)
                .ok_or_else(|| bad(format!("target row {i} has no probability mass")))?,
        };
        tokens.push(t as u32);
        return Ok(Verified {
            num_draft: draft.len(),
            accepted: i,
            tokens,
        });
    }
    let p = target_probs(rows[draft.len()], params)?;
    let bonus = sample_index_with(&p, draw).ok_or_else(|| {
        bad(format!(
            "target row {} has no probability mass",
            draft.len()
        ))
    })?;
    tokens.push(bonus as u32);
    Ok(Verified {
        num_draft: draft.len(),
        accepted: draft.len(),
        tokens,
    })
}

/// Most uniforms one sampling verification of `num_draft` drafts draws: one accept test
/// per examined draft, then one draw for the correction or bonus token (the fallback to
/// `p` draws only when the residual had no mass, so no path draws more than `k + 1`).
pub fn max_uniforms(num_draft: usize) -> usize {
    num_draft + 1
}

/// What [`verify_with_uniforms`] returns: the verification and how many of the given
/// uniforms it consumed (the caller advances its RNG by exactly that many draws).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UniformVerdict {
    pub verified: Verified,
    pub consumed: usize,
}

/// [`VerifyCtx::verify`] for sampling params with the uniforms drawn ahead: `uniforms`
/// (at least [`max_uniforms`] of the drafts) are the draws the RNG would have given, in
/// order. With `uniforms` drawn from a clone of the RNG and the RNG then advanced by
/// `consumed` draws, tokens and RNG state equal `VerifyCtx::verify`'s. This is the
/// reference of the device sampler (cuda/kernels/sample.cu), which takes the same
/// uniforms. Greedy params are refused (they draw nothing: use [`verify_greedy`]).
pub fn verify_with_uniforms(
    target_logits: &[f32],
    vocab: usize,
    proposal: &Proposal,
    params: &SamplingParams,
    uniforms: &[f64],
) -> Result<UniformVerdict> {
    if params.is_greedy() {
        return Err(bad(
            "verify_with_uniforms needs sampling params (temperature > 0)".into(),
        ));
    }
    let need = max_uniforms(proposal.tokens.len());
    if uniforms.len() < need {
        return Err(bad(format!(
            "{} uniforms for {} drafts (need {need})",
            uniforms.len(),
            proposal.tokens.len()
        )));
    }
    check_inputs(params, target_logits, vocab, proposal)?;
    let mut used = 0usize;
    let verified = rejection_sample(target_logits, vocab, proposal, params, &mut || {
        let u = uniforms[used.min(uniforms.len() - 1)];
        used += 1;
        u
    })?;
    Ok(UniformVerdict {
        verified,
        consumed: used,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{seeded_rng, DraftProbs, SparseProbs};

    fn rows(r: &[&[f32]]) -> Vec<f32> {
        r.concat()
    }

    #[test]
    fn greedy_hand_cases() {
        // V = 4. argmax rows: 2, 1 (tie 1/3 -> 1), 0.
        let l = rows(&[
            &[0.0, 1.0, 5.0, 2.0],
            &[0.0, 3.0, 1.0, 3.0],
            &[9.0, 1.0, 1.0, 1.0],
        ]);
        let v = verify_greedy(&l, 4, &[2, 1]).unwrap();
        assert_eq!(
            v,
            Verified {
                num_draft: 2,
                accepted: 2,
                tokens: vec![2, 1, 0]
            }
        );
        let v = verify_greedy(&l, 4, &[2, 3]).unwrap();
        assert_eq!(
            v,
            Verified {
                num_draft: 2,
                accepted: 1,
                tokens: vec![2, 1]
            }
        );
        let v = verify_greedy(&l, 4, &[0, 1]).unwrap();
        assert_eq!(
            v,
            Verified {
                num_draft: 2,
                accepted: 0,
                tokens: vec![2]
            }
        );
        assert_eq!(v.rejected(), 2);
        // No drafts: one row, the bonus only.
        let v = verify_greedy(&[0.0, 1.0, 0.5], 3, &[]).unwrap();
        assert_eq!(
            v,
            Verified {
                num_draft: 0,
                accepted: 0,
                tokens: vec![1]
            }
        );
    }

    #[test]
    fn bad_inputs_are_errors() {
        let l = rows(&[&[0.0, 1.0, 5.0], &[0.0, 3.0, 1.0]]);
        let is_bad = |r: Result<Verified>| matches!(r, Err(EngineError::InvalidVerifyInput { .. }));
        assert!(is_bad(verify_greedy(&l, 3, &[])));
        assert!(is_bad(verify_greedy(&l, 3, &[1, 2])));
        assert!(is_bad(verify_greedy(&l, 2, &[1])));
        assert!(is_bad(verify_greedy(&l, 0, &[1])));
        assert!(is_bad(verify_greedy(&l, 3, &[3])));
        assert!(is_bad(verify_greedy(&[0.0, f32::NAN, 0.0, 1.0], 2, &[0])));
        let mut rng = seeded_rng(1);
        let mut ctx = VerifyCtx::new(SamplingParams::random(1.0), &mut rng);
        let mk = |probs| Proposal {
            tokens: vec![1],
            probs,
        };
        assert!(is_bad(ctx.verify(
            &l,
            3,
            &mk(Some(DraftProbs::Dense(vec![vec![0.5, 0.5]])))
        )));
        assert!(is_bad(ctx.verify(
            &l,
            3,
            &mk(Some(DraftProbs::Dense(vec![
                vec![0.5, 0.5, 0.0],
                vec![1.0, 0.0, 0.0]
            ])))
        )));
        assert!(is_bad(ctx.verify(
            &l,
            3,
            &mk(Some(DraftProbs::Dense(vec![vec![0.5, 0.6, -0.1]])))
        )));
        assert!(is_bad(ctx.verify(
            &l,
            3,
            &mk(Some(DraftProbs::Dense(vec![vec![0.5, f32::NAN, 0.0]])))
        )));
        assert!(ctx
            .verify(
                &l,
                3,
                &mk(Some(DraftProbs::Dense(vec![vec![0.5, 0.5, 0.0]])))
            )
            .is_ok());
        let mut ctx = VerifyCtx::new(SamplingParams::random(3.0), &mut rng);
        assert!(matches!(
            ctx.verify(&l, 3, &mk(None)),
            Err(EngineError::InvalidSamplingParams { .. })
        ));
    }

    #[test]
    fn sampling_edge_cases() {
        let mut rng = seeded_rng(7);
        let params = SamplingParams::random(1.0);
        // q(x) = 0: always rejected; the residual max(0, p - q) excludes x = 1.
        let l = rows(&[&[0.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
        let prop = Proposal {
            tokens: vec![1],
            probs: Some(DraftProbs::Dense(vec![vec![0.5, 0.0, 0.5]])),
        };
        for _ in 0..200 {
            let v = VerifyCtx::new(params, &mut rng)
                .verify(&l, 3, &prop)
                .unwrap();
            assert_eq!(v.accepted, 0);
            assert_eq!(v.tokens.len(), 1);
            assert_eq!(v.tokens[0], 1, "residual (0, 1/3, 0) can only give token 1");
        }
        // Rejected with an empty residual (a degenerate, unnormalized q
        // dominating p): fall back to sampling p, never the masked token 1.
        let l0 = rows(&[&[0.0, f32::NEG_INFINITY, 0.0], &[0.0, 0.0, 0.0]]);
        let prop = Proposal {
            tokens: vec![1],
            probs: Some(DraftProbs::Dense(vec![vec![1.0, 0.0, 1.0]])),
        };
        let mut seen = [0u32; 3];
        for _ in 0..200 {
            let v = VerifyCtx::new(params, &mut rng)
                .verify(&l0, 3, &prop)
                .unwrap();
            assert_eq!(v.accepted, 0);
            seen[v.tokens[0] as usize] += 1;
        }
        assert!(seen[0] > 0 && seen[1] == 0 && seen[2] > 0, "{seen:?}");
        // Top-k 1 makes the target greedy-like: a draft off the argmax is
        // always rejected and corrected to the argmax, with no drafts probs.
        let l = rows(&[&[0.0, 2.0, 1.0], &[3.0, 0.0, 0.0]]);
        let p1 = SamplingParams {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
        };
        for _ in 0..50 {
            let v = VerifyCtx::new(p1, &mut rng)
                .verify(
                    &l,
                    3,
                    &Proposal {
                        tokens: vec![2],
                        probs: None,
                    },
                )
                .unwrap();
            assert_eq!(v.tokens, vec![1]);
            let v = VerifyCtx::new(p1, &mut rng)
                .verify(
                    &l,
                    3,
                    &Proposal {
                        tokens: vec![1],
                        probs: None,
                    },
                )
                .unwrap();
            assert_eq!(v.tokens, vec![1, 0]);
        }
        // Greedy params ignore draft probs and consume no randomness.
        let mut a = seeded_rng(3);
        let mut b = seeded_rng(3);
        let prop = Proposal {
            tokens: vec![1],
            probs: Some(DraftProbs::Dense(vec![vec![0.0, 1.0, 0.0]])),
        };
        let v = VerifyCtx::new(SamplingParams::GREEDY, &mut a)
            .verify(&l, 3, &prop)
            .unwrap();
        assert_eq!(v.tokens, vec![1, 0]);
        assert_eq!(a.next_u64(), b.next_u64());
    }

    #[test]
    fn seeded_and_observed() {
        let l = rows(&[
            &[0.1, 0.7, 0.2, 0.0],
            &[0.3, 0.3, 0.3, 0.1],
            &[1.0, 0.0, 0.0, 0.5],
        ]);
        let prop = Proposal {
            tokens: vec![1, 2],
            probs: None,
        };
        let run = |seed| {
            let mut rng = seeded_rng(seed);
            let mut ctx = VerifyCtx::new(SamplingParams::random(0.8), &mut rng);
            (0..100)
                .map(|_| ctx.verify(&l, 4, &prop).unwrap())
                .collect::<Vec<_>>()
        };
        let a = run(11);
        assert_eq!(a, run(11));
        let mut m = SpecMetrics::default();
        for v in &a {
            assert_eq!(v.tokens.len(), v.accepted + 1);
            assert_eq!(&v.tokens[..v.accepted], &prop.tokens[..v.accepted]);
            v.observe(&mut m);
        }
        assert_eq!(m.num_drafts, 100);
        assert_eq!(m.num_draft_tokens, 200);
        assert_eq!(
            m.num_accepted_tokens,
            a.iter().map(|v| v.accepted as u64).sum::<u64>()
        );
        // A step without drafts is not recorded.
        Verified {
            num_draft: 0,
            accepted: 0,
            tokens: vec![3],
        }
        .observe(&mut m);
        assert_eq!(m.num_drafts, 100);
    }
    #[test]
    fn greedy_ids_equal_greedy_logits() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let vocab = 5;
        for _ in 0..500 {
            let k = rng.random_range(0..5usize);
            let logits: Vec<f32> = (0..(k + 1) * vocab)
                .map(|_| rng.random_range(0..4) as f32)
                .collect();
            let ids: Vec<u32> = logits
                .chunks_exact(vocab)
                .map(|r| crate::spec::sampling::argmax(r).unwrap() as u32)
                .collect();
            // Drafts that often agree with the target, so every accepted length occurs.
            let draft: Vec<u32> = ids[..k]
                .iter()
                .map(|&t| if rng.random_bool(0.7) { t } else { (t + 1) % 5 })
                .collect();
            let a = verify_greedy(&logits, vocab, &draft).unwrap();
            let b = verify_greedy_ids(&ids, &draft).unwrap();
            assert_eq!(
                (a.accepted, a.tokens, a.num_draft),
                (b.accepted, b.tokens, b.num_draft)
            );
        }
        assert!(verify_greedy_ids(&[1, 2], &[1, 2]).is_err());
    }

    /// The device sampler's contract: uniforms drawn ahead from a clone of the RNG, then
    /// the RNG advanced by `consumed` draws, give `VerifyCtx::verify`'s tokens and leave
    /// the RNG where it would be, over random logits (with -inf entries and ties), drafts
    /// that often agree, q given or one-hot, and every sampling-param kind.
    #[test]
    fn uniforms_drawn_ahead_reproduce_the_rng_path() {
        use rand::{Rng, RngCore, SeedableRng};
        let mut gen = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let params = [
            SamplingParams::random(1.0),
            SamplingParams::random(0.3),
            SamplingParams {
                temperature: 0.8,
                top_k: 3,
                top_p: 1.0,
            },
            SamplingParams {
                temperature: 1.2,
                top_k: 0,
                top_p: 0.6,
            },
            SamplingParams {
                temperature: 0.7,
                top_k: 4,
                top_p: 0.9,
            },
        ];
        let vocab = 7;
        let mut consumed_seen = std::collections::BTreeSet::new();
        for case in 0..3000 {
            let p = params[case % params.len()];
            let k = gen.random_range(0..6usize);
            let logits: Vec<f32> = (0..(k + 1) * vocab)
                .map(|_| match gen.random_range(0..11) {
                    0 => f32::NEG_INFINITY,
                    10 => 0.0,
                    n => (n % 4) as f32 * 0.7,
                })
                .collect();
            let draft: Vec<u32> = (0..k).map(|_| gen.random_range(0..vocab as u32)).collect();
            let probs = gen.random_bool(0.5).then(|| {
                (0..k)
                    .map(|_| {
                        let mut r: Vec<f32> =
                            (0..vocab).map(|_| gen.random_range(0.0..1.0)).collect();
                        let s: f32 = r.iter().sum();
                        r.iter_mut().for_each(|x| *x /= s);
                        r
                    })
                    .collect::<Vec<_>>()
            });
            let prop = Proposal {
                tokens: draft,
                probs: probs.map(DraftProbs::Dense),
            };
            let mut rng = crate::spec::seeded_rng(case as u64);
            let mut ahead = rng.clone();
            let us: Vec<f64> = (0..max_uniforms(k)).map(|_| uniform(&mut ahead)).collect();
            let want = VerifyCtx::new(p, &mut rng).verify(&logits, vocab, &prop);
            let got = verify_with_uniforms(&logits, vocab, &prop, &p, &us);
            match (want, got) {
                (Ok(w), Ok(g)) => {
                    assert_eq!(w, g.verified, "case {case}");
                    assert!(g.consumed <= us.len());
                    consumed_seen.insert(g.consumed);
                    let mut replay = crate::spec::seeded_rng(case as u64);
                    for _ in 0..g.consumed {
                        uniform(&mut replay);
                    }
                    assert_eq!(
                        replay.next_u64(),
                        rng.next_u64(),
                        "case {case}: RNG position"
                    );
                }
                (Err(w), Err(g)) => assert_eq!(w.to_string(), g.to_string()),
                (w, g) => panic!("case {case}: {w:?} against {g:?}"),
            }
        }
        // Every draft count's paths occur: 1 (no drafts) up to k + 1 draws.
        assert!(
            consumed_seen.contains(&1) && consumed_seen.contains(&6),
            "{consumed_seen:?}"
        );
        // Too few uniforms, or greedy params, are refused.
        let prop = Proposal {
            tokens: vec![1],
            probs: None,
        };
        let l = vec![0.0f32; 2 * vocab];
        assert!(
            verify_with_uniforms(&l, vocab, &prop, &SamplingParams::random(1.0), &[0.5]).is_err()
        );
        assert!(
            verify_with_uniforms(&l, vocab, &prop, &SamplingParams::GREEDY, &[0.5, 0.5]).is_err()
        );
    }

    /// A sparse q (a candidate set's probabilities, every other token 0) verifies exactly
    /// as its dense rows: same tokens and the same RNG position, for random drafts inside
    /// and outside the candidate sets, with and without top-k / top-p.
    #[test]
    fn sparse_q_verifies_as_its_dense_rows() {
        use rand::seq::SliceRandom;
        use rand::{Rng, SeedableRng};
        let mut gen = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let vocab = 9;
        let mut outside = 0;
        for case in 0..2000u64 {
            let p = if case % 2 == 0 {
                SamplingParams::random(0.9)
            } else {
                SamplingParams {
                    temperature: 1.1,
                    top_k: 5,
                    top_p: 0.8,
                }
            };
            let (k, kq) = (gen.random_range(1..5usize), gen.random_range(1..5usize));
            let logits: Vec<f32> = (0..(k + 1) * vocab)
                .map(|_| gen.random_range(-2.0..2.0))
                .collect();
            let mut ids = Vec::new();
            let mut ps = Vec::new();
            let mut draft = Vec::new();
            for _ in 0..k {
                let mut row: Vec<u32> = (0..vocab as u32).collect();
                row.shuffle(&mut gen);
                row.truncate(kq);
                let w: Vec<f32> = (0..kq).map(|_| gen.random_range(0.0..1.0)).collect();
                let sum: f32 = w.iter().sum();
                ps.extend(w.iter().map(|x| x / sum));
                let x = if gen.random_bool(0.8) {
                    row[0]
                } else {
                    gen.random_range(0..vocab as u32)
                };
                outside += usize::from(!row.contains(&x));
                draft.push(x);
                ids.extend(row);
            }
            let sparse = DraftProbs::Sparse(SparseProbs { k: kq, ids, p: ps });
            let dense = DraftProbs::Dense(sparse.to_dense(vocab));
            let run = |q: DraftProbs| {
                let prop = Proposal {
                    tokens: draft.clone(),
                    probs: Some(q),
                };
                let mut rng = seeded_rng(case);
                let v = VerifyCtx::new(p, &mut rng)
                    .verify(&logits, vocab, &prop)
                    .unwrap();
                (v, rng.next_u64())
            };
            assert_eq!(run(sparse), run(dense), "case {case}");
        }
        assert!(outside > 100, "drafts outside the candidate set: {outside}");
    }
}
