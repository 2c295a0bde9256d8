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
use speclab_engine::model::{ForwardOptions, ForwardOut, LogitsRows, ModelConfig, MtpChunk};
use speclab_engine::{DraftReq, DraftStep, Drafter, EngineError, Proposal, ProposeCtx, Result};

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
        speclab_engine::propose_one(self, ctx).unwrap_or_else(|| {
            Err(bad("the MTP drafter needs the target pass (ProposeCtx::target); it cannot draft from tokens alone".into()))
        })
    }

    /// One MTP pass over every request's committed rows (draft 1 of each), then one
    /// pass per further draft position over the requests still drafting: N MTP calls a
    /// step whatever the batch size. Each request's rows and positions are exactly
    /// those of a per-request pass (the layer's attention is per sequence).
    fn propose_batch(
        &mut self,
        step: &mut DraftStep<'_>,
        reqs: &mut [DraftReq<'_>],
    ) -> Result<Vec<Proposal>> {
        let mut out = vec![Proposal::default(); reqs.len()];
        let mut live = self.first_pass(step, reqs, &mut out)?;
        let (h, v) = step.backend.head_dims();
        while !live.is_empty() {
            // The last pass's hidden rows feed nothing: a device backend keeps them.
            let last = live.iter().all(|l| out[l.req].tokens.len() + 1 >= l.want);
            let opts = draft_opts(last);
            let o = {
                let chunks: Vec<MtpChunk<'_>> = live
                    .iter()
                    .map(|l| MtpChunk {
                        slot: reqs[l.req].slot,
                        hidden: &l.prev,
                        next_tokens: std::slice::from_ref(&l.draft),
                        start_pos: l.pos,
                    })
                    .collect();
                step.backend.mtp_forward(step.kv, &chunks, &opts)?
            };
            for (c, l) in live.iter_mut().enumerate() {
                l.draft = greedy_row(&o, c, v)?;
                out[l.req].tokens.push(l.draft);
                if !last {
                    l.prev = hidden_row(&o, c, h)?.to_vec();
                }
                l.pos += 1;
            }
            live.retain(|l| out[l.req].tokens.len() < l.want);
        }
        Ok(out)
    }

    fn lookahead_slots(&self) -> usize {
        crate::DrafterKind::Mtp.lookahead(self.num_speculative_tokens)
    }
}

/// A request still drafting after the first pass.
struct Live {
    req: usize,
    want: usize,
    /// The last draft (the next pass's input token).
    draft: u32,
    /// The MTP layer's pre-norm hidden of the last pass. Shape: [H].
    prev: Vec<f32>,
    /// Position of the next pass's row.
    pos: usize,
}

/// Options of an MTP pass: drafts are greedy (a device backend may answer with argmax
/// ids only); `last`: no later pass reads this one's hidden rows.
fn draft_opts(last: bool) -> ForwardOptions {
    ForwardOptions {
        logits: LogitsRows::LastPerChunk,
        greedy_ids: true,
        skip_hidden: last,
        ..ForwardOptions::default()
    }
}

impl Mtp {
    /// The pass over every request's committed rows: writes the MTP layer's K/V there
    /// and gives draft 1; returns the requests that want more drafts.
    fn first_pass(
        &self,
        step: &mut DraftStep<'_>,
        reqs: &[DraftReq<'_>],
        out: &mut [Proposal],
    ) -> Result<Vec<Live>> {
        let (h, v) = step.backend.head_dims();
        let forward = step.forward;
        let mut chunks = Vec::with_capacity(reqs.len());
        let mut which = Vec::with_capacity(reqs.len());
        for (i, r) in reqs.iter().enumerate() {
            if r.rows.is_empty() {
                continue;
            }
            chunks.push(committed_chunk(forward, r, h)?);
            which.push(i);
        }
        if chunks.is_empty() {
            return Ok(Vec::new());
        }
        let more = reqs
            .iter()
            .any(|r| !r.rows.is_empty() && self.num_speculative_tokens.min(r.max_draft) > 1);
        let o = step
            .backend
            .mtp_forward(step.kv, &chunks, &draft_opts(!more))?;
        let mut live = Vec::new();
        let mut end = 0usize;
        for (c, &i) in which.iter().enumerate() {
            let r = &reqs[i];
            end += r.rows.len();
            let want = self.num_speculative_tokens.min(r.max_draft);
            if want == 0 {
                continue;
            }
            let draft = greedy_row(&o, c, v)?;
            out[i].tokens.push(draft);
            if want > 1 {
                live.push(Live {
                    req: i,
                    want,
                    draft,
                    prev: hidden_row(&o, end - 1, h)?.to_vec(),
                    pos: r.start_pos + r.rows.len(),
                });
            }
        }
        Ok(live)
    }
}

/// The MTP chunk of a request's committed rows: position `t` takes the target's hidden
/// `h_t` and the token that follows it (`tokens[t + 1]`).
fn committed_chunk<'f>(
    forward: &'f ForwardOut,
    r: &'f DraftReq<'_>,
    h: usize,
) -> Result<MtpChunk<'f>> {
    let (rows, len) = (r.rows.clone(), r.rows.len());
    let hidden = forward
        .hidden
        .get(rows.start * h..rows.end * h)
        .ok_or_else(|| {
            bad(format!(
                "target rows {rows:?} are outside the forward's {} rows",
                forward.num_tokens
            ))
        })?;
    let next = r.tokens.get(r.start_pos + 1..r.start_pos + len + 1).ok_or_else(|| {
        bad(format!(
            "rows at positions {}..{} need the tokens that follow them, but the request holds {} tokens",
            r.start_pos,
            r.start_pos + len,
            r.tokens.len()
        ))
    })?;
    Ok(MtpChunk {
        slot: r.slot,
        hidden,
        next_tokens: next,
        start_pos: r.start_pos,
    })
}

/// The greedy token of logits row `row` of an MTP output: the backend's argmax id when
/// it gave them, else the argmax of that row's logits (the same first maximum); an error
/// when the backend returned neither for that row.
fn greedy_row(out: &speclab_engine::model::MtpOut, row: usize, vocab: usize) -> Result<u32> {
    if let Some(&id) = out.argmax.as_deref().and_then(|ids| ids.get(row)) {
        return Ok(id);
    }
    out.logits
        .get(row * vocab..(row + 1) * vocab)
        .map(|l| argmax(l) as u32)
        .ok_or_else(|| {
            bad(format!(
                "the MTP pass returned no logits or argmax for row {row}"
            ))
        })
}

/// Row `row` of an MTP output's hidden states. Shape: [H].
fn hidden_row(out: &speclab_engine::model::MtpOut, row: usize, h: usize) -> Result<&[f32]> {
    out.hidden
        .get(row * h..(row + 1) * h)
        .ok_or_else(|| bad(format!("the MTP pass returned no hidden row {row}")))
}
