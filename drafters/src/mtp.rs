//! The MTP drafter: the target's own multi-token-prediction layer (docs/model.md §6).
//!
//! Source: vLLM 0.33.0 `vllm/v1/spec_decode/eagle.py` (`EagleProposer.propose`, which
//! also drives `deepseek_mtp`) and `vllm/model_executor/models/deepseek_mtp.py`:
//! - first pass, after every target pass: the MTP layer runs over the positions the pass
//!   committed, position `t` taking the target's final (post-`model.norm`) hidden `h_t`
//!   and the token that follows it (`tokens[t + 1]`: the next prompt token, an accepted
//!   draft, or the token just sampled). This writes the MTP layer's K/V for exactly the
//!   committed positions (overwriting what earlier autoregressive steps wrote there), so
//!   the MTP cache below the last committed token always holds target-conditioned rows;
//!   rejected drafts never enter it (vLLM excludes them through `token_indices`).
//! - the last row's logits give draft 1 (argmax); step `i >= 1` runs the layer at the
//!   next position on `(MtpOut.hidden of step i-1, draft i)`: the MTP's own pre-norm
//!   hidden is fed back as the "previous hidden" (EAGLE style), giving draft `i + 1`.
//!   With several MTP layers step `i` would use layer `i % num_layers`; the twin has one
//!   (`num_nextn_predict_layers = 1`, the only value docs/model.md specifies), so every
//!   step reuses it, as vLLM does for `num_speculative_tokens > num_nextn_predict_layers`.
//! - drafts are greedy and carry no q (vLLM's proposer argmaxes; rejection sampling then
//!   uses one-hot q).
//!
//! KV: the MTP layer's K/V live in the target's `full` group (the runner's store), at the
//! request's positions; autoregressive steps write positions past the committed tokens,
//! which the scheduler's lookahead (N slots, vLLM `num_lookahead_tokens`) covers.
//!
//! Invariant: a proposal has at most `min(N, ctx.max_draft)` tokens; the drafter keeps no
//! per-request state (everything is in the KV manager's blocks), so `release` is a no-op.

use speclab_engine::model::ops::argmax;
use speclab_engine::model::{ForwardOptions, LogitsRows, ModelConfig, MtpChunk};
use speclab_engine::{Drafter, EngineError, Proposal, ProposeCtx, Result};

/// The MTP drafter (vLLM `method = "mtp"` / `deepseek_mtp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mtp {
    /// `N`: drafts per step (vLLM `num_speculative_tokens`), >= 1.
    pub num_speculative_tokens: usize,
}

fn bad(reason: String) -> EngineError {
    EngineError::InvalidDrafterConfig {
        drafter: "mtp".into(),
        reason,
    }
}

impl Mtp {
    /// An MTP drafter for `target` (which must have an MTP layer), `N >= 1`.
    pub fn new(target: &ModelConfig, num_speculative_tokens: usize) -> Result<Self> {
        if num_speculative_tokens == 0 {
            return Err(bad("num_speculative_tokens must be >= 1, got 0".into()));
        }
        if target.num_nextn_predict_layers == 0 {
            return Err(bad(
                "the target has no MTP layer (num_nextn_predict_layers = 0)".into(),
            ));
        }
        if num_speculative_tokens >= target.max_position_embeddings {
            return Err(bad(format!(
                "num_speculative_tokens = {num_speculative_tokens} is not below max_position_embeddings {}",
                target.max_position_embeddings
            )));
        }
        Ok(Self {
            num_speculative_tokens,
        })
    }
}

impl Drafter for Mtp {
    fn propose(&mut self, ctx: &mut ProposeCtx<'_>) -> Result<Proposal> {
        let slot = ctx.slot;
        let t = ctx
            .target
            .as_mut()
            .ok_or_else(|| bad("the MTP drafter needs the target pass (ProposeCtx::target); it cannot draft from tokens alone".into()))?;
        let h = t.backend.head_dims().0;
        let rows = t.rows.clone();
        let len = rows.len();
        if len == 0 {
            return Ok(Proposal::default());
        }
        let hidden = t
            .forward
            .hidden
            .get(rows.start * h..rows.end * h)
            .ok_or_else(|| {
                bad(format!(
                    "target rows {rows:?} are outside the forward's {} rows",
                    t.forward.num_tokens
                ))
            })?;
        // Position t takes the token after it: tokens[start + 1 ..= start + len].
        let next = ctx.tokens.get(t.start_pos + 1..t.start_pos + len + 1).ok_or_else(|| {
            bad(format!(
                "rows at positions {}..{} need the tokens that follow them, but the request holds {} tokens",
                t.start_pos,
                t.start_pos + len,
                ctx.tokens.len()
            ))
        })?;
        let want = self.num_speculative_tokens.min(ctx.max_draft);
        // Drafts are greedy: a device backend may answer with argmax ids only.
        let opts = ForwardOptions {
            logits: LogitsRows::LastPerChunk,
            greedy_ids: true,
            ..ForwardOptions::default()
        };
        let out = t.backend.mtp_forward(
            t.kv,
            &[MtpChunk {
                slot,
                hidden,
                next_tokens: next,
                start_pos: t.start_pos,
            }],
            &opts,
        )?;
        if want == 0 {
            return Ok(Proposal::default());
        }
        let mut d = greedy_id(&out);
        let mut tokens = Vec::with_capacity(want);
        tokens.push(d);
        let mut prev = out.hidden[(len - 1) * h..len * h].to_vec();
        // Step i runs at the position after the last committed row's.
        for pos in t.start_pos + len..t.start_pos + len + want - 1 {
            let o = t.backend.mtp_forward(
                t.kv,
                &[MtpChunk {
                    slot,
                    hidden: &prev,
                    next_tokens: &[d],
                    start_pos: pos,
                }],
                &opts,
            )?;
            d = greedy_id(&o);
            tokens.push(d);
            prev = o.hidden;
        }
        Ok(Proposal {
            tokens,
            probs: None,
        })
    }

    fn lookahead_slots(&self) -> usize {
        crate::DrafterKind::Mtp.lookahead(self.num_speculative_tokens)
    }
}

/// The draft token of an MTP output with one logits row: the backend's argmax id when
/// it gave one, else the argmax of the logits (the same first maximum).
fn greedy_id(out: &speclab_engine::model::MtpOut) -> u32 {
    match out.argmax.as_deref() {
        Some([id, ..]) => *id,
        _ => argmax(&out.logits) as u32,
    }
}
