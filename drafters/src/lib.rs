//! speclab-drafters: drafters around the target model, behind the engine's
//! [`speclab_engine::Drafter`] trait.
//!
//! Today: [`NoDraft`] (the spec-off control), [`Ngram`] (vLLM's prompt lookup,
//! `ngram`), [`Mtp`] (the target's MTP layer, `mtp.rs`), and [`DFlash2`] (docs/dflash2.md;
//! v1 and v2 modes), which [`DFlash2Drafter`] (`adapters.rs`) puts behind the `Drafter`
//! trait. [`DrafterSpec`] names and validates a drafter against a target and is the
//! engine's `DrafterFactory` (`speclab_engine::exec::generate`).
//! Invariant: a drafter never proposes more than `ctx.max_draft` tokens.

pub mod adapters;
pub mod dflash2;
pub mod mtp;
pub mod ngram;

pub use adapters::{DFlash2Drafter, DrafterKind, DrafterSpec};
pub use dflash2::{DFlash2, DFlash2Config, DFlash2Weights, Draft, DraftMode, DraftRequest};
pub use mtp::Mtp;
pub use ngram::Ngram;

use speclab_engine::{Drafter, Proposal, ProposeCtx, Result};

/// The no-drafter case: proposes nothing, reserves no lookahead.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoDraft;

impl Drafter for NoDraft {
    fn propose(&mut self, _ctx: &mut ProposeCtx<'_>) -> Result<Proposal> {
        Ok(Proposal::default())
    }
    fn lookahead_slots(&self) -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn nodraft_proposes_nothing() {
        let mut d = NoDraft;
        let p = d.propose(&mut ProposeCtx::new(0, &[1, 2, 3], 4)).unwrap();
        assert!(p.tokens.is_empty());
        assert_eq!(d.lookahead_slots(), 0);
    }
}
