//! speclab-drafters: drafters around the target model, behind the engine's
//! [`speclab_engine::Drafter`] trait.
//!
//! Today: [`NoDraft`] (the spec-off control) and [`Ngram`] (vLLM's prompt
//! lookup, `ngram`), and [`DFlash2`] (docs/dflash2.md; v1 and v2 modes; driven with
//! target features rather than through the `Drafter` trait). MTP arrives with the engine issue.
//! Invariant: a drafter never proposes more than `ctx.max_draft` tokens.

pub mod dflash2;
pub mod ngram;

pub use dflash2::{DFlash2, DFlash2Config, DFlash2Weights, Draft, DraftMode, DraftRequest};
pub use ngram::Ngram;

use speclab_engine::{Drafter, Proposal, ProposeCtx, Result};

/// The no-drafter case: proposes nothing, reserves no lookahead.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoDraft;

impl Drafter for NoDraft {
    fn propose(&mut self, _ctx: &ProposeCtx<'_>) -> Result<Proposal> {
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
        let p = d.propose(&ProposeCtx { request: 0, tokens: &[1, 2, 3], max_draft: 4 }).unwrap();
        assert!(p.tokens.is_empty());
        assert_eq!(d.lookahead_slots(), 0);
    }
}
