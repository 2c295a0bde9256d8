//! The MTP chain of a step as one plan (issue 11, "one graph per MTP chain"): every
//! pass's metadata, the first pass's source rows and each feed's index words are built
//! on the host before any pass runs, uploaded in ONE copy, and the gather, the passes and
//! the feeds are replayed as ONE CUDA graph per chain shape.
//!
//! Source: vLLM 0.33.0 `v1/spec_decode/eagle.py` (the proposer's persistent input
//! buffers and its `cudagraph` dispatch of the drafter's forward) and this crate's
//! per-step graphs (`crate::backend`); the chain itself is `crate::mtp`'s.
//!
//! Why it is possible: a pass's metadata depends only on the requests (their slots,
//! committed rows and positions, all known on the host when the chain starts), never on
//! the drafts, which `mtp_feed` writes into the next pass's token section on the device.
//! Before this, each pass's metadata and index words were two more copies in the stream
//! between passes and each pass a graph of its own (still the path with
//! `SPECLAB_MTP_CHAIN_GRAPH=0`, [`ChainMode::PerPass`]).
//!
//! Invariants: the upload is `[pass 0 | pass 1 | ... | gather rows | feed 0 idx | ...]`;
//! pass q's `StepMeta::base` is where its data sits; every offset is a function of the
//! passes' (tokens, chunks) alone ([`ChainKey`]), so two chains of one key have the same
//! device addresses and launch shapes: what replaying a captured graph requires. The
//! kernels, their order and their inputs are those of the per-pass path, so the drafts
//! are the same bit for bit (gpu_check compares the two).

use speclab_engine::kv::KvCacheManager;
use speclab_engine::ReqSlot;

use crate::backend::{capture_uploaded, launch_captured, CudaBackend};
use crate::error::{CudaError, Result};
use crate::meta::StepMeta;
use crate::ops::{self, int, ptr, Arg};
use crate::step::{Collect, StepKind};

/// A chain's shape: each pass's (tokens, chunks).
pub type ChainKey = Vec<(usize, usize)>;

/// A later pass (2..): each chunk's (slot, start position), one placeholder token each.
pub type LaterPass = Vec<(ReqSlot, usize)>;

/// Most chunks (requests) a chain runs as one graph; more, a graph a pass
/// ([`ChainMode::PerPass`]). Building every pass's metadata before the first pass runs
/// takes the host time the per-pass chain spends while the device runs the pass before:
/// on an H100 (`runs/newold-f8f40b3/`, against the per-pass chain of 0ef7aa5) one graph
/// saved 10 us of draft a step at c = 1, 3 at c = 8, none at c = 32 and cost 9-25 at
/// c = 128. 64 lies between the last two, not measured itself.
pub const ONE_GRAPH_MAX_SEQS: usize = 64;

/// The step kind of every pass: greedy ids of each chunk's last row.
pub(crate) const PASS: StepKind = StepKind::Mtp {
    last_rows: true,
    collect: Collect {
        hidden: false,
        router: false,
        hidden_mask: 0,
    },
    argmax: true,
};

/// After pass q: keep its drafts at `keep_at`, then feed the next pass (`n` chunks;
/// none after the last pass).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Feed {
    pub keep_at: usize,
    /// Chunks and rows of pass q.
    pub s_prev: usize,
    pub t_prev: usize,
    /// Chunks of pass q + 1 (0 after the last pass).
    pub n: usize,
    /// The next pass's rows to gather (last rows of pass q), then each one's draft source
    /// (its chunk in pass q). Shape: [2 n].
    pub idx: Vec<i32>,
    /// Where `idx` sits in the upload.
    pub idx_off: usize,
}

/// Every pass of a chain, laid out for one upload.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ChainPlan {
    /// Pass q's metadata with `base` at its place in `data`: every pass, or only the first
    /// (a per-pass chain builds the others as it runs, from `later`).
    pub passes: Vec<StepMeta>,
    /// Passes 2.. as chunks.
    pub later: Vec<LaterPass>,
    /// One after each pass.
    pub feeds: Vec<Feed>,
    /// The first pass's source rows in the forward's final hidden. Shape: [T_1].
    pub gather: Vec<i32>,
    pub gather_off: usize,
    /// Rows of final hidden the forward left on the device (the gather's source).
    pub valid: usize,
    /// Requests each pass drafts for, in chunk order.
    pub order: Vec<Vec<usize>>,
    /// The chain runs as one upload and one graph (every pass built, in `data`); else a
    /// graph a pass, the later passes built as it runs.
    pub one_graph: bool,
    /// The whole upload.
    pub data: Vec<i32>,
}

/// How the chain runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainMode {
    /// One upload, then one graph (or, before its capture, the same launches eagerly).
    OneGraph,
    /// Each pass's metadata uploaded before it, a graph a pass (the A/B reference).
    PerPass,
}

impl ChainPlan {
    /// Lay out `passes` (each built at base 0), the gather rows and the feeds' index
    /// words into one upload, setting every base and offset; the passes go into it only
    /// with `upload` (a one-graph chain; a per-pass chain uploads each pass's own data).
    pub fn lay_out(
        mut passes: Vec<StepMeta>,
        later: Vec<LaterPass>,
        gather: Vec<i32>,
        mut feeds: Vec<Feed>,
        valid: usize,
        order: Vec<Vec<usize>>,
        upload: bool,
    ) -> Result<Self> {
        let n = later.len() + 1;
        if feeds.len() != n || (passes.len() != n && passes.len() != 1) {
            return Err(CudaError::Input(format!(
                "MTP chain plan: {} feeds and {} built passes for {n} passes (internal)",
                feeds.len(),
                passes.len()
            )));
        }
        if upload && passes.len() != n {
            return Err(CudaError::Input(format!(
                "MTP chain plan: one upload of {} built passes for {n} (internal)",
                passes.len()
            )));
        }
        // No copy of the passes for a per-pass chain; its first pass stays at base 0.
        let mut data = Vec::new();
        if upload {
            for m in &mut passes {
                m.base = data.len();
                data.extend_from_slice(&m.data);
            }
        }
        let gather_off = data.len();
        data.extend_from_slice(&gather);
        for f in &mut feeds {
            f.idx_off = data.len();
            data.extend_from_slice(&f.idx);
        }
        Ok(Self {
            passes,
            later,
            feeds,
            gather,
            gather_off,
            valid,
            order,
            one_graph: upload,
            data,
        })
    }

    /// The shape every offset follows from (of a plan with every pass built).
    pub fn key(&self) -> ChainKey {
        self.passes
            .iter()
            .map(|m| (m.t_total, m.num_seqs))
            .collect()
    }
}

impl CudaBackend {
    /// Run `plan` as it was built (`ChainPlan::one_graph`; `graphable`: every chunk is
    /// graph-sized).
    pub(crate) fn run_chain(
        &mut self,
        kv: &KvCacheManager,
        plan: &ChainPlan,
        graphable: bool,
    ) -> Result<()> {
        let ran = if plan.one_graph {
            self.chain_one_graph(plan, graphable)
        } else {
            self.chain_per_pass(kv, plan, graphable)
        };
        // What an MTP pass leaves: no target hidden rows or logits to read.
        self.final_hidden_rows = None;
        self.logit_rows = None;
        ran
    }

    /// One upload, then the chain's graph (captured at its shape's
    /// [`crate::backend::CAPTURE_AT_USE`]-th use; eager launches before that, or when
    /// graphs are off or a chunk is too long for one).
    fn chain_one_graph(&mut self, plan: &ChainPlan, graphable: bool) -> Result<()> {
        self.grow_meta(plan.data.len())?;
        let st = self.gpu.stream.clone();
        self.meta.write(&st, &plan.data, "MTP chain metadata")?;
        let key = plan.key();
        let replay = graphable
            && self.graphs_on()
            && (self.chain_graphs.contains_key(&key)
                || self.chain_sightings.capture_now(key.clone()));
        if !replay {
            return self.chain_launch(plan);
        }
        match self.chain_replay(plan, key) {
            Ok(()) => Ok(()),
            Err(e) => {
                // Nothing ran during a failed capture.
                self.graph_failed(&e);
                self.chain_launch(plan)
            }
        }
    }

    fn chain_replay(&mut self, plan: &ChainPlan, key: ChainKey) -> Result<()> {
        if !self.chain_graphs.contains_key(&key) {
            let captured = capture_uploaded(&self.gpu, || self.chain_launch(plan))?;
            self.chain_graphs.insert(key.clone(), captured);
        }
        launch_captured(self.chain_graphs.get(&key), "MTP chain")
    }

    /// The chain's launches, every input already in the metadata buffer.
    fn chain_launch(&self, plan: &ChainPlan) -> Result<()> {
        let t1 = plan.gather.len();
        let gather = ptr(&self.meta, plan.gather_off, t1, "MTP chain rows")?;
        self.chain_gather(plan.valid, gather, t1)?;
        for (q, (m, f)) in plan.passes.iter().zip(&plan.feeds).enumerate() {
            self.run(m, PASS)?;
            let idx = ptr(&self.meta, f.idx_off, f.idx.len().max(1), "feed rows")?;
            self.chain_feed(f, plan.passes.get(q + 1), idx)?;
        }
        Ok(())
    }

    /// Each later pass's metadata built and uploaded with its index words just before it,
    /// while the device runs the pass before (the chain before one upload: two copies a
    /// pass in the stream, a graph a pass).
    fn chain_per_pass(
        &mut self,
        kv: &KvCacheManager,
        plan: &ChainPlan,
        graphable: bool,
    ) -> Result<()> {
        let t1 = plan.gather.len();
        self.chain_write_idx(&plan.gather)?;
        let first = &plan.passes[0];
        self.ensure(first, Collect::default())?;
        let gather = ptr(&self.chain_ref()?.idx, 0, t1, "MTP chain rows")?;
        self.chain_gather(plan.valid, gather, t1)?;
        self.launch_step(first, PASS, graphable)?;
        for (q, f) in plan.feeds.iter().enumerate() {
            let next = match plan.later.get(q) {
                Some(spec) => Some(self.later_meta(kv, spec)?),
                None => None,
            };
            if let Some(m) = &next {
                self.chain_write_idx(&f.idx)?;
                self.ensure(m, Collect::default())?;
            }
            let idx = ptr(&self.chain_ref()?.idx, 0, f.idx.len().max(1), "feed rows")?;
            self.chain_feed(f, next.as_ref(), idx)?;
            if let Some(m) = &next {
                self.launch_step(m, PASS, true)?;
            }
        }
        Ok(())
    }

    /// The first pass's input rows: `ws.tmp` = the forward's final hidden rows `rows`.
    fn chain_gather(&self, valid: usize, rows: Arg, t1: usize) -> Result<()> {
        ops::gather_rows(
            &self.gpu,
            &self.ws.tmp,
            &self.ws.hidden,
            valid,
            rows,
            t1,
            self.w.cfg.hidden_size,
        )
    }

    /// Kernel `mtp_feed`: keep pass q's drafts at `f.keep_at`; with `next` (the next
    /// pass's metadata, its chunks' rows and sources in `idx`), feed it.
    pub(crate) fn chain_feed(&self, f: &Feed, next: Option<&StepMeta>, idx: Arg) -> Result<()> {
        let c = self.chain_ref()?;
        let h = self.w.cfg.hidden_size;
        let n = f.n;
        let tokens = match next {
            Some(m) => ptr(
                &self.meta,
                m.base + m.layout.tokens.off,
                n,
                "next pass tokens",
            )?,
            None => ptr(&self.meta, 0, 1, "unused tokens")?,
        };
        let args = [
            ptr(&c.keep, f.keep_at, f.s_prev, "kept drafts")?,
            ptr(&self.ws.argmax, 0, f.s_prev, "pass drafts")?,
            int(f.s_prev, "S")?,
            tokens,
            ptr(&self.ws.tmp, 0, n.max(1) * h, "next pass hidden")?,
            ptr(&self.ws.x, 0, f.t_prev * h, "pass hidden")?,
            idx,
            int(n, "n")?,
            int(h, "D")?,
        ];
        // SAFETY: keep [keep_at + S], argmax [S], tokens [n] (the next pass's metadata
        // section), tmp [n, H], x [t_prev, H] checked; idx spans [2n] words (checked by
        // the caller's ptr); every row in idx is a last row of the last pass (< t_prev)
        // and every source < S (host-built, `CudaBackend::plan_chain`).
        unsafe {
            ops::launch(
                &self.gpu,
                "mtp_feed",
                crate::launch::per_row(n.max(1), 128, "mtp_feed")?,
                &args,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::MetaLayout;

    fn pass(t: usize, s: usize, fill: i32) -> StepMeta {
        let layout = MetaLayout::new(t, s, 4, 2);
        StepMeta {
            layout,
            data: vec![fill; layout.total],
            base: 0,
            t_total: t,
            num_seqs: s,
        }
    }

    fn feed(n: usize, v: i32) -> Feed {
        Feed {
            keep_at: 0,
            s_prev: 1,
            t_prev: 1,
            n,
            idx: vec![v; 2 * n],
            idx_off: 0,
        }
    }

    #[test]
    fn one_upload_holds_every_section_where_the_plan_says() {
        let (a, b) = (pass(3, 1, 7), pass(1, 1, 8));
        let (ta, tb) = (a.layout.total, b.layout.total);
        let plan = ChainPlan::lay_out(
            vec![a, b],
            vec![vec![(ReqSlot(0), 3)]],
            vec![5, 6, 7],
            vec![feed(1, 9), feed(0, 0)],
            3,
            vec![vec![0], vec![0]],
            true,
        )
        .unwrap();
        assert!(plan.one_graph);
        assert_eq!(plan.passes[0].base, 0);
        assert_eq!(plan.passes[1].base, ta);
        assert_eq!(plan.gather_off, ta + tb);
        assert_eq!(plan.feeds[0].idx_off, ta + tb + 3);
        assert_eq!(plan.feeds[1].idx_off, ta + tb + 3 + 2);
        assert_eq!(plan.data.len(), ta + tb + 3 + 2);
        // Each pass's words at its base, the gather rows and the feed words after them.
        let p1 = &plan.passes[1];
        assert!(plan.data[p1.base..p1.base + tb].iter().all(|&v| v == 8));
        assert_eq!(&plan.data[plan.gather_off..plan.gather_off + 3], &[5, 6, 7]);
        assert_eq!(&plan.data[plan.feeds[0].idx_off..][..2], &[9, 9]);
        assert_eq!(plan.key(), vec![(3, 1), (1, 1)]);
    }

    #[test]
    fn offsets_follow_the_key_alone() {
        // Two chains of one shape with other contents: the same offsets (a graph captured
        // for one replays the other).
        let mk = |v: i32| {
            ChainPlan::lay_out(
                vec![pass(6, 2, v), pass(2, 2, v)],
                vec![vec![(ReqSlot(0), 6), (ReqSlot(1), 6)]],
                vec![v; 6],
                vec![feed(2, v), feed(0, v)],
                6,
                vec![vec![0, 1], vec![0, 1]],
                true,
            )
            .unwrap()
        };
        let (x, y) = (mk(1), mk(2));
        assert_eq!(x.key(), y.key());
        let offs = |p: &ChainPlan| {
            (
                p.passes.iter().map(|m| m.base).collect::<Vec<_>>(),
                p.gather_off,
                p.feeds.iter().map(|f| f.idx_off).collect::<Vec<_>>(),
                p.data.len(),
            )
        };
        assert_eq!(offs(&x), offs(&y));
        assert_ne!(x.data, y.data);
    }

    #[test]
    fn a_plan_needs_a_feed_per_pass_and_the_first_or_every_pass_built() {
        let later = || vec![vec![(ReqSlot(0), 1)]];
        let e = ChainPlan::lay_out(
            vec![pass(1, 1, 0)],
            later(),
            vec![0],
            vec![],
            1,
            vec![],
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("0 feeds and 1 built passes for 2 passes"), "{e}");
        assert!(ChainPlan::lay_out(vec![], vec![], vec![], vec![], 0, vec![], false).is_err());
        // A per-pass plan: only the first pass built, the later one as chunks.
        let p = ChainPlan::lay_out(
            vec![pass(1, 1, 0)],
            later(),
            vec![0],
            vec![feed(1, 0), feed(0, 0)],
            1,
            vec![vec![0], vec![0]],
            false,
        )
        .unwrap();
        assert!(!p.one_graph);
        // Its first pass stays at base 0 and is not copied into the upload.
        assert_eq!(
            (p.passes[0].base, p.gather_off, p.data.len()),
            (0, 0, 1 + 2)
        );
        // Two of three passes built is neither.
        let e = ChainPlan::lay_out(
            vec![pass(1, 1, 0), pass(1, 1, 0)],
            vec![vec![(ReqSlot(0), 1)], vec![(ReqSlot(0), 2)]],
            vec![0],
            vec![feed(1, 0), feed(1, 0), feed(0, 0)],
            1,
            vec![],
            false,
        );
        assert!(e.is_err());
        // One upload needs every pass built.
        let e = ChainPlan::lay_out(
            vec![pass(1, 1, 0)],
            later(),
            vec![0],
            vec![feed(1, 0), feed(0, 0)],
            1,
            vec![],
            true,
        );
        assert!(e.is_err());
    }
}
