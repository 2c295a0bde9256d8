//! Spec-decode counters with vLLM's definitions ([`SpecMetrics`]).
//!
//! Source: vLLM 0.33.0 `vllm/v1/spec_decode/metrics.py` (`SpecDecodingStats`:
//! `observe_draft`, per-position counts unconditional) and DESIGN.md "Measuring":
//! draft acceptance rate = accepted / drafted tokens, mean acceptance length
//! tau = 1 + accepted / drafts (includes the bonus token).
//!
//! Invariant: counted once per verified step, in the run loop ([`crate::run::run`]),
//! for the simulator and the real engine alike.

use serde::{Deserialize, Serialize};

/// Spec-decode counters, vLLM `SpecDecodingStats` definitions.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SpecMetrics {
    /// Decode steps that verified at least one draft token.
    pub num_drafts: u64,
    /// Draft tokens verified.
    pub num_draft_tokens: u64,
    /// Draft tokens accepted (the bonus token is not counted).
    pub num_accepted_tokens: u64,
    /// `accepted_per_position[i]`: drafts whose position i was accepted. Shape: [max drafts seen].
    pub accepted_per_position: Vec<u64>,
}

impl SpecMetrics {
    /// vLLM `SpecDecodingStats.observe_draft`.
    pub fn observe_draft(&mut self, num_draft_tokens: u64, num_accepted_tokens: u64) {
        self.num_drafts += 1;
        self.num_draft_tokens += num_draft_tokens;
        self.num_accepted_tokens += num_accepted_tokens;
        let n = usize::try_from(num_draft_tokens.max(num_accepted_tokens)).unwrap_or(usize::MAX);
        if self.accepted_per_position.len() < n {
            self.accepted_per_position.resize(n, 0);
        }
        for c in self
            .accepted_per_position
            .iter_mut()
            .take(usize::try_from(num_accepted_tokens).unwrap_or(usize::MAX))
        {
            *c += 1;
        }
    }

    /// Draft acceptance rate = accepted / drafted tokens (0 when nothing was drafted).
    pub fn draft_acceptance_rate(&self) -> f64 {
        if self.num_draft_tokens == 0 {
            0.0
        } else {
            self.num_accepted_tokens as f64 / self.num_draft_tokens as f64
        }
    }

    /// Mean acceptance length tau = 1 + accepted / drafts (includes the bonus
    /// token; 1 when nothing was drafted).
    pub fn mean_acceptance_length(&self) -> f64 {
        if self.num_drafts == 0 {
            1.0
        } else {
            1.0 + self.num_accepted_tokens as f64 / self.num_drafts as f64
        }
    }

    /// Unconditional per-position acceptance rates: `accepted_per_position[i] / num_drafts`.
    pub fn per_position_rates(&self) -> Vec<f64> {
        if self.num_drafts == 0 {
            return vec![0.0; self.accepted_per_position.len()];
        }
        self.accepted_per_position
            .iter()
            .map(|&c| c as f64 / self.num_drafts as f64)
            .collect()
    }
}
