//! Speculative decoding: lossless verification and acceptance bookkeeping.
//!
//! What it holds: [`sampling`] (the target's sampling parameters, logits ->
//! distribution, seeded draws), [`probs`] (a drafter's q, dense or sparse) and
//! [`verify`] (greedy and rejection-sampling verification of a drafter's
//! [`Proposal`](crate::Proposal) against one target verify pass, vLLM 0.33.0
//! `rejection_sampler.py` semantics). The
//! acceptance counters are [`SpecMetrics`] from [`crate::sim`] with vLLM's
//! definitions; [`Verified::observe`] feeds them and
//! [`fitted_acceptance_model`] turns measured counters into the
//! [`AcceptanceModel`] the simulated executor replays.
//!
//! Typical step (one request):
//! ```
//! use speclab_engine::spec::{seeded_rng, SamplingParams, VerifyCtx};
//! use speclab_engine::{sim::SpecMetrics, Proposal};
//! let mut rng = seeded_rng(0);
//! let mut metrics = SpecMetrics::default();
//! let proposal = Proposal { tokens: vec![2], probs: None }; // from a Drafter
//! let logits = vec![0.0f32, 1.0, 5.0, /* row 1: */ 3.0, 0.0, 0.0]; // [k + 1][V = 3]
//! let mut ctx = VerifyCtx::new(SamplingParams::GREEDY, &mut rng);
//! let v = ctx.verify(&logits, 3, &proposal).unwrap();
//! assert_eq!(v.tokens, vec![2, 0]); // draft accepted + bonus
//! v.observe(&mut metrics);
//! assert_eq!(metrics.mean_acceptance_length(), 2.0);
//! ```
//!
//! Where it comes from: DESIGN.md "Core seams" (`Proposal` carries q for
//! lossless rejection sampling) and "Measuring" (metric definitions).
//!
//! Invariant: randomness only comes from the caller's RNG ([`SpecRng`] by
//! convention, the same ChaCha8 generator the simulator uses), so a seed
//! reproduces a run.

pub mod probs;
pub mod sampling;
pub mod verify;

pub use probs::{check_draft_probs, DraftProbs, SparseProbs};
pub use sampling::{SamplingParams, SAMPLING_EPS};
pub use verify::{
    max_uniforms, verify_greedy, verify_greedy_ids, verify_with_uniforms, UniformVerdict, Verified,
    VerifyCtx,
};

use rand::SeedableRng;

use crate::sim::{AcceptanceModel, SpecMetrics};
use crate::Result;

/// The RNG speclab seeds spec-decode sampling with (as [`crate::sim`] does).
pub type SpecRng = rand_chacha::ChaCha8Rng;

/// A [`SpecRng`] from a seed.
pub fn seeded_rng(seed: u64) -> SpecRng {
    SpecRng::seed_from_u64(seed)
}

/// The simulator's acceptance model measured from real verifications: vLLM's
/// unconditional per-position rates `accepted_per_position[i] / num_drafts`.
pub fn fitted_acceptance_model(metrics: &SpecMetrics) -> Result<AcceptanceModel> {
    AcceptanceModel::new(metrics.per_position_rates())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fitted_model_round_trips_rates() {
        let mut m = SpecMetrics::default();
        for (k, a) in [(3, 3), (3, 1), (3, 0), (2, 2)] {
            Verified {
                num_draft: k,
                accepted: a,
                tokens: vec![0; a + 1],
            }
            .observe(&mut m);
        }
        let model = fitted_acceptance_model(&m).unwrap();
        assert_eq!(model.per_position, vec![0.75, 0.5, 0.25]);
        // tau = 1 + accepted / drafts = 1 + 6 / 4.
        assert!((m.mean_acceptance_length() - 2.5).abs() < 1e-12);
        assert!((m.draft_acceptance_rate() - 6.0 / 11.0).abs() < 1e-12);
        assert!((model.expected_tau(3) - m.mean_acceptance_length()).abs() < 1e-12);
    }
}
