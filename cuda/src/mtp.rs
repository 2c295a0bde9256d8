//! The MTP drafter chained on the device (issue 11): [`CudaMtp`], and the backend's
//! [`CudaBackend::mtp_chain`] that runs all N passes of a step with one host read.
//!
//! Source: `drafters/src/mtp.rs` (the host drafter: the protocol, the positions and the
//! hidden each pass takes, from vLLM 0.33.0 `v1/spec_decode/eagle.py`, whose proposer
//! keeps the hidden states and draft ids on the device between its passes); the CUDA
//! backend's MTP step (`crate::step`, `StepKind::Mtp`, replayed from a CUDA graph per
//! shape).
//!
//! Per step: (1) the target forward's final hidden rows (`Workspace::hidden`, kept there
//! because this drafter says `LayerHidden::FinalOnDevice`) are gathered into the MTP
//! input on the device; (2) pass 1 over every request's committed rows; (3) before each
//! further pass one `mtp_feed` kernel keeps the last pass's drafts, writes them into the
//! next pass's step metadata as its input tokens and gathers each chunk's last pre-norm
//! hidden row; (4) one read of every pass's drafts at the end. The host plans every pass
//! before the first runs (`CudaBackend::plan_chain`): by default the whole chain is one
//! upload and one CUDA graph (`crate::mtp_graph`), with `SPECLAB_MTP_CHAIN_GRAPH=0` each
//! pass's metadata is uploaded before it and each pass is a graph. Nothing waits between
//! passes (the host drafter reads the drafts and the hidden back after every pass, and
//! uploads the hidden again).
//!
//! The first pass is padded by default (vLLM's padded drafter batch): each request's
//! chunk keeps the rejected rows of its verify, so the pass has c x (N + 1) rows whatever
//! was accepted and one CUDA graph serves every step; the draft and the next pass read
//! the last committed row (`CudaBackend::first_pass` says why the padded rows' K/V is
//! harmless).
//!
//! Invariants: unpadded, every pass sees exactly the rows, positions, tokens and hidden
//! values of the host drafter's pass on the same backend, so the drafts are the same bit
//! for bit (gpu_check compares them step by step); padded, the committed rows are the
//! same computations except the MoE kernels' K split, which follows the number of rows
//! in the batch (summation order only). The chain reads only the hidden of the backend's
//! last target forward ([`CudaBackend::mtp_chain`] refuses otherwise).

use std::ops::Range;

use speclab_drafters::adapters::DrafterKind;
use speclab_engine::kv::KvCacheManager;
use speclab_engine::model::ModelConfig;
use speclab_engine::{
    DraftReq, DraftStep, Drafter, EngineError, LayerHidden, Proposal, ProposeCtx, ReqSlot,
};

use crate::backend::{CudaBackend, GRAPH_MAX_CHUNK};
use crate::buf::DevBuf;
use crate::error::{CudaError, Result};
use crate::meta::{self, ChunkIn, MetaDims, StepMeta};
use crate::mtp_graph::{ChainMode, ChainPlan, Feed, LaterPass, ONE_GRAPH_MAX_SEQS};

/// One request of a chained MTP step.
#[derive(Debug, Clone)]
pub struct ChainReq<'a> {
    pub slot: ReqSlot,
    /// The token after each committed row (`tokens[t + 1]`). Shape: [T_chunk].
    pub next_tokens: &'a [u32],
    /// The committed rows in the backend's last target forward (their final hidden).
    pub rows: Range<usize>,
    /// Position of the first committed row.
    pub start_pos: usize,
    /// Drafts wanted (0: only the MTP layer's K/V of the committed rows is written).
    pub want: usize,
}

/// Device buffers of the chain. Shapes: `idx` [cap] i32 (gather rows, then feed rows and
/// sources), `keep` [cap] u32 (pass p's drafts at `p * S_1`).
pub(crate) struct ChainBufs {
    pub(crate) idx: DevBuf<i32>,
    pub(crate) keep: DevBuf<u32>,
}

/// A chunk of one pass: the request it drafts for and its last row in that pass.
#[derive(Clone, Copy)]
struct PassChunk {
    req: usize,
    last_row: usize,
}

/// A chunk of the first pass: its request, input tokens (the committed rows' next
/// tokens, then fillers for the padded rows) and the forward rows it reads.
struct FirstChunk {
    req: usize,
    /// Shape: [T_chunk].
    tokens: Vec<u32>,
    src: Range<usize>,
}

/// The placeholder input token of passes 2.. (overwritten on the device by `mtp_feed`).
const PLACEHOLDER: [u32; 1] = [0];

fn i32s(v: impl Iterator<Item = usize>) -> Result<Vec<i32>> {
    v.map(|x| i32::try_from(x).map_err(|_| CudaError::Input(format!("row {x} exceeds i32"))))
        .collect()
}

impl CudaBackend {
    /// Grow the chain buffers to hold `idx` and `keep` elements (dropping the captured
    /// chains, whose feeds hold the old buffers' addresses).
    fn chain_bufs(&mut self, idx: usize, keep: usize) -> Result<()> {
        let st = self.gpu.stream.clone();
        let small = match &self.chain {
            Some(c) => c.idx.len < idx || c.keep.len < keep,
            None => true,
        };
        if small {
            let (i0, k0) = self
                .chain
                .as_ref()
                .map_or((0, 0), |c| (c.idx.len, c.keep.len));
            self.chain = Some(ChainBufs {
                idx: DevBuf::zeros(&st, idx.max(i0).max(64), "MTP chain rows")?,
                keep: DevBuf::zeros(&st, keep.max(k0).max(64), "MTP chain drafts")?,
            });
            // A captured chain's feeds write the old drafts buffer: drop them.
            self.chain_graphs.clear();
        }
        Ok(())
    }

    /// Build a pass's metadata (at base 0; not uploaded), refusing a pass that would move
    /// the workspace (the chain's inputs live there; a pass never outgrows the forward).
    fn chain_meta(
        &self,
        kv: &KvCacheManager,
        chunks: &[ChunkIn<'_>],
        last_rows: Option<&[usize]>,
    ) -> Result<StepMeta> {
        let dims = MetaDims {
            state_group: None,
            ..self.dims
        };
        let mut m = meta::build(&dims, kv, chunks, &|_| false)?;
        if let Some(lasts) = last_rows {
            let sec = m.layout.last_rows;
            for (dst, &r) in m.data[sec.range()].iter_mut().zip(lasts) {
                *dst = i32::try_from(r)
                    .map_err(|_| CudaError::Input(format!("row {r} exceeds i32")))?;
            }
        }
        if m.t_total > self.ws.t_cap || m.num_seqs > self.ws.s_cap {
            return Err(CudaError::Input(format!(
                "mtp_chain: a pass of {} rows in {} chunks outgrows the workspace ({} / {}) of the forward it drafts from (internal)",
                m.t_total, m.num_seqs, self.ws.t_cap, self.ws.s_cap
            )));
        }
        Ok(m)
    }

    /// The first pass's chunks: every request with committed rows, padded (`pad`) to its
    /// chunk of the last target forward when that was a decode / verify chunk (vLLM's
    /// padded drafter batch, `eagle.py` `prepare_inputs_padded`: the rejected rows stay in
    /// the batch so its shape, and its CUDA graph, does not depend on the acceptance).
    /// A padded row writes the MTP layer's K/V at a position past the committed ones,
    /// which a later pass or step rewrites before any row reads it (a row at position p
    /// reads positions <= p, and the first pass of the step that commits p writes it);
    /// its token is a filler and its draft is never used.
    fn first_pass(
        &self,
        reqs: &[ChainReq<'_>],
        valid: usize,
        pad: bool,
    ) -> Result<Vec<FirstChunk>> {
        let mut first = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            if r.rows.is_empty() {
                continue;
            }
            if r.rows.len() != r.next_tokens.len() || r.rows.end > valid {
                return Err(CudaError::Input(format!(
                    "mtp_chain: request slot {}: rows {:?} with {} next tokens; the last forward left {valid} hidden rows on the device",
                    r.slot.0,
                    r.rows,
                    r.next_tokens.len()
                )));
            }
            let chunk = self
                .last_chunks
                .iter()
                .find(|&&(slot, start, _)| slot == r.slot && start == r.start_pos)
                .map_or(r.rows.len(), |&(_, _, len)| len);
            let len = if pad && chunk <= GRAPH_MAX_CHUNK && r.rows.start + chunk <= valid {
                chunk.max(r.rows.len())
            } else {
                r.rows.len()
            };
            let mut tokens = r.next_tokens.to_vec();
            let filler = tokens.last().copied().unwrap_or(0);
            tokens.resize(len, filler);
            first.push(FirstChunk {
                req: i,
                tokens,
                src: r.rows.start..r.rows.start + len,
            });
        }
        Ok(first)
    }

    /// Every MTP pass of a step on the device (module doc): returns each request's
    /// drafts (`want` of them; none for a request without committed rows). Reads the
    /// final hidden of the backend's last target forward, which no MTP pass may have
    /// overwritten since.
    pub fn mtp_chain(
        &mut self,
        kv: &KvCacheManager,
        reqs: &[ChainReq<'_>],
        pad: bool,
        mode: ChainMode,
    ) -> Result<Vec<Vec<u32>>> {
        self.check_manager(kv)?;
        if self.w.mtp.is_none() {
            return Err(CudaError::Input(
                "mtp_chain: the model has no MTP layer".into(),
            ));
        }
        let valid = self.final_hidden_rows.take().unwrap_or(0);
        let first = self.first_pass(reqs, valid, pad)?;
        let mut out = vec![Vec::new(); reqs.len()];
        if first.is_empty() {
            self.final_hidden_rows = Some(valid).filter(|&v| v > 0);
            return Ok(out);
        }
        let t: usize = first.iter().map(|f| f.tokens.len()).sum();
        let s1 = first.len();
        let passes = reqs.iter().map(|r| r.want).max().unwrap_or(0).max(1);
        self.chain_bufs(t.max(2 * s1), passes * s1)?;
        let graphable = first.iter().all(|f| f.tokens.len() <= GRAPH_MAX_CHUNK);
        // Past ONE_GRAPH_MAX_SEQS chunks building every pass's metadata before the first
        // costs more than the graph saves (runs/newold-f8f40b3/): a graph a pass there.
        let mode = match mode {
            ChainMode::OneGraph if s1 > ONE_GRAPH_MAX_SEQS => ChainMode::PerPass,
            m => m,
        };
        let plan = self.plan_chain(kv, reqs, &first, valid, mode == ChainMode::OneGraph)?;
        self.run_chain(kv, &plan, graphable)?;
        // One read of every pass's drafts.
        let c = self.chain_ref()?;
        let keep = c
            .keep
            .read(&self.gpu.stream, 0, plan.order.len() * s1, "MTP drafts")?;
        for (q, reqs_q) in plan.order.iter().enumerate() {
            for (j, &i) in reqs_q.iter().enumerate() {
                if out[i].len() < reqs[i].want {
                    out[i].push(keep[q * s1 + j]);
                }
            }
        }
        Ok(out)
    }

    /// Every pass of the chain on the host (module doc): (1) the first pass over each
    /// request's rows, the draft of a chunk from its last committed row; (2) passes 2..
    /// over the chunks whose request wants another draft, one row each, fed on the device.
    /// With `all` every pass's metadata is built now (one upload); without, only the
    /// first's (the others are built as the chain runs, while the device runs the pass
    /// before).
    fn plan_chain(
        &self,
        kv: &KvCacheManager,
        reqs: &[ChainReq<'_>],
        first: &[FirstChunk],
        valid: usize,
        all: bool,
    ) -> Result<ChainPlan> {
        let s1 = first.len();
        let chunks: Vec<ChunkIn<'_>> = first
            .iter()
            .map(|f| ChunkIn {
                slot: reqs[f.req].slot,
                tokens: &f.tokens,
                start_pos: reqs[f.req].start_pos,
                snapshot: false,
            })
            .collect();
        let mut pass = Vec::with_capacity(s1);
        let mut row0 = 0usize;
        for f in first {
            pass.push(PassChunk {
                req: f.req,
                last_row: row0 + reqs[f.req].rows.len() - 1,
            });
            row0 += f.tokens.len();
        }
        let lasts: Vec<usize> = pass.iter().map(|c| c.last_row).collect();
        let mut metas = vec![self.chain_meta(kv, &chunks, Some(&lasts))?];
        let mut feeds = Vec::new();
        let mut later = Vec::new();
        let mut order = vec![pass.iter().map(|c| c.req).collect::<Vec<_>>()];
        let mut t_prev = row0;
        loop {
            let p = order.len();
            let mut chunk_of = vec![usize::MAX; reqs.len()];
            for (j, c) in pass.iter().enumerate() {
                chunk_of[c.req] = j;
            }
            let next: Vec<PassChunk> = pass
                .iter()
                .copied()
                .filter(|c| reqs[c.req].want > p)
                .collect();
            let idx = i32s(
                next.iter()
                    .map(|c| c.last_row)
                    .chain(next.iter().map(|c| chunk_of[c.req])),
            )?;
            feeds.push(Feed {
                keep_at: (p - 1) * s1,
                s_prev: pass.len(),
                t_prev,
                n: next.len(),
                idx,
                idx_off: 0,
            });
            if next.is_empty() {
                break;
            }
            let spec: LaterPass = next
                .iter()
                .map(|c| {
                    let r = &reqs[c.req];
                    (r.slot, r.start_pos + r.rows.len() + p - 1)
                })
                .collect();
            if all {
                metas.push(self.later_meta(kv, &spec)?);
            }
            later.push(spec);
            t_prev = next.len();
            order.push(next.iter().map(|c| c.req).collect());
            pass = next
                .iter()
                .enumerate()
                .map(|(j, c)| PassChunk {
                    req: c.req,
                    last_row: j,
                })
                .collect();
        }
        let gather = i32s(first.iter().flat_map(|f| f.src.clone()))?;
        ChainPlan::lay_out(metas, later, gather, feeds, valid, order, all)
    }

    /// The metadata of a later pass: its chunks one placeholder token each (`mtp_feed`
    /// writes the drafts in on the device).
    pub(crate) fn later_meta(&self, kv: &KvCacheManager, spec: &LaterPass) -> Result<StepMeta> {
        let chunks: Vec<ChunkIn<'_>> = spec
            .iter()
            .map(|&(slot, start_pos)| ChunkIn {
                slot,
                tokens: &PLACEHOLDER,
                start_pos,
                snapshot: false,
            })
            .collect();
        self.chain_meta(kv, &chunks, None)
    }

    pub(crate) fn chain_ref(&self) -> Result<&ChainBufs> {
        self.chain
            .as_ref()
            .ok_or_else(|| CudaError::Input("MTP chain buffers missing (internal)".into()))
    }

    pub(crate) fn chain_write_idx(&mut self, v: &[i32]) -> Result<()> {
        let st = self.gpu.stream.clone();
        match self.chain.as_mut() {
            Some(c) => c.idx.write(&st, v, "MTP chain rows"),
            None => Err(CudaError::Input(
                "MTP chain buffers missing (internal)".into(),
            )),
        }
    }
}

/// The MTP drafter with its passes chained on the device (module doc); the host
/// drafter's contract (`speclab_drafters::Mtp`), beside the CUDA target backend only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaMtp {
    /// `N`: drafts per step (vLLM `num_speculative_tokens`), >= 1.
    pub num_speculative_tokens: usize,
    /// Pad the first pass to the verify chunks ([`CudaBackend::mtp_chain`]); default on,
    /// off with `SPECLAB_MTP_PAD=0` ([`pad_wanted`]).
    pub pad_first_pass: bool,
    /// The whole chain as one upload and one CUDA graph ([`ChainMode::OneGraph`]);
    /// default on, off with `SPECLAB_MTP_CHAIN_GRAPH=0` (a graph a pass, the A/B
    /// reference).
    pub one_graph: bool,
}

/// Whether the chain's first pass is padded: yes unless `env` (`SPECLAB_MTP_PAD`) says
/// `0` / `off` / `false` (an A/B of the padding in one device call).
pub fn pad_wanted(env: Option<&str>) -> bool {
    crate::device::switch_on(env)
}

impl CudaMtp {
    /// Validated as the host drafter is (an MTP layer, 1 <= N < max positions).
    pub fn new(
        target: &ModelConfig,
        num_speculative_tokens: usize,
    ) -> speclab_engine::Result<Self> {
        speclab_drafters::Mtp::new(target, num_speculative_tokens)?;
        Ok(Self {
            num_speculative_tokens,
            pad_first_pass: pad_wanted(std::env::var("SPECLAB_MTP_PAD").ok().as_deref()),
            one_graph: crate::device::env_on("SPECLAB_MTP_CHAIN_GRAPH"),
        })
    }
}

/// The chain request of a drafter request: its committed rows and the tokens after them.
fn chain_req<'a>(r: &'a DraftReq<'_>, n: usize) -> speclab_engine::Result<ChainReq<'a>> {
    let len = r.rows.len();
    let next = r
        .tokens
        .get(r.start_pos + 1..r.start_pos + len + 1)
        .ok_or_else(|| EngineError::InvalidDrafterConfig {
            drafter: "mtp".into(),
            reason: format!(
                "rows at positions {}..{} need the tokens that follow them, but the request holds {} tokens",
                r.start_pos,
                r.start_pos + len,
                r.tokens.len()
            ),
        })?;
    Ok(ChainReq {
        slot: r.slot,
        next_tokens: if len == 0 { &[] } else { next },
        rows: r.rows.clone(),
        start_pos: r.start_pos,
        want: if len == 0 { 0 } else { n.min(r.max_draft) },
    })
}

impl Drafter for CudaMtp {
    fn propose(&mut self, ctx: &mut ProposeCtx<'_>) -> speclab_engine::Result<Proposal> {
        speclab_engine::propose_one(self, ctx).unwrap_or_else(|| {
            Err(EngineError::InvalidDrafterConfig {
                drafter: "mtp".into(),
                reason: "the MTP drafter needs the target pass (ProposeCtx::target)".into(),
            })
        })
    }

    fn lookahead_slots(&self) -> usize {
        DrafterKind::Mtp.lookahead(self.num_speculative_tokens)
    }

    fn layer_hidden(&self) -> LayerHidden {
        LayerHidden::FinalOnDevice
    }

    fn propose_batch(
        &mut self,
        step: &mut DraftStep<'_>,
        reqs: &mut [DraftReq<'_>],
    ) -> speclab_engine::Result<Vec<Proposal>> {
        let be = crate::seam::cuda_backend(&mut *step.backend, "the CUDA MTP drafter")?;
        let chain = reqs
            .iter()
            .map(|r| chain_req(r, self.num_speculative_tokens))
            .collect::<speclab_engine::Result<Vec<_>>>()?;
        let mode = if self.one_graph {
            ChainMode::OneGraph
        } else {
            ChainMode::PerPass
        };
        let drafts = be.mtp_chain(step.kv, &chain, self.pad_first_pass, mode)?;
        Ok(drafts
            .into_iter()
            .map(|tokens| Proposal {
                tokens,
                probs: None,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use speclab_engine::model::{ModelRunner, ModelWeights};

    #[test]
    fn validates_like_the_host_drafter_and_refuses_a_host_backend() {
        let cfg = ModelConfig::micro();
        assert!(CudaMtp::new(&cfg, 0).is_err());
        let mut d = CudaMtp::new(&cfg, 3).unwrap();
        assert_eq!(d.layer_hidden(), LayerHidden::FinalOnDevice);
        assert_eq!(
            d.lookahead_slots(),
            speclab_drafters::Mtp::new(&cfg, 3)
                .unwrap()
                .lookahead_slots()
        );
        let kv = KvCacheManager::new(&cfg.kv_layout(16, 3, 32).unwrap(), 32).unwrap();
        let mut cpu = ModelRunner::new(ModelWeights::random(&cfg, 1, true).unwrap(), &kv).unwrap();
        let e = crate::seam::host_propose_error(&mut d, &mut cpu, &kv);
        assert!(e.contains("CUDA target backend"), "{e}");
    }

    #[test]
    fn padding_is_on_unless_switched_off() {
        assert!(pad_wanted(None));
        assert!(pad_wanted(Some("1")));
        assert!(!pad_wanted(Some("0")));
        assert!(!pad_wanted(Some(" off")));
    }

    #[test]
    fn chain_requests_take_the_tokens_after_the_committed_rows() {
        let tokens = [5u32, 6, 7, 8];
        let mk = |rows: Range<usize>, start_pos, max_draft| DraftReq {
            request: 0,
            slot: ReqSlot(1),
            tokens: &tokens,
            max_draft,
            rng: None,
            rows,
            start_pos,
        };
        let r = mk(4..6, 1, 2);
        let c = chain_req(&r, 3).unwrap();
        assert_eq!(c.next_tokens, &[7, 8]);
        assert_eq!((c.rows.clone(), c.start_pos, c.want), (4..6, 1, 2));
        // No committed rows (a partial prefill): nothing to run, nothing wanted.
        let r = mk(0..0, 3, 2);
        assert_eq!(chain_req(&r, 3).unwrap().want, 0);
        // Rows past the request's tokens are a clear error, not a panic.
        let r = mk(0..4, 1, 2);
        let e = chain_req(&r, 3).unwrap_err().to_string();
        assert!(e.contains("need the tokens that follow them"), "{e}");
    }
}
