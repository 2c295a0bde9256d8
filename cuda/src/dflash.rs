//! The DFlash2 drafter on the device (issue 11): its context K/V in device pages indexed
//! by the KV manager's `drafter_swa` block ids, its block forward as device kernels, the
//! target's features read where the CUDA backend left them.
//!
//! Source: docs/dflash2.md §3-§7 (the contract), `drafters/src/dflash2/forward.rs` (the
//! CPU drafter this ports, and whose pickers it reuses), `cuda/kernels/dflash.cu` (the
//! drafter's own kernels), vLLM's DFlash proposer (`v1/spec_decode/dflash`: the proposer
//! lives beside the target on the device and reads its hidden states there).
//!
//! Per step ([`CudaDFlash2::propose_batch`]): (1) one batched context append for every
//! request's committed rows: features gathered from the backend's per-layer buffer
//! (`LayerHidden::Device`: the forward never copies them to the host), `fc`, then one GEMM
//! for every layer's K/V with `hidden_norm` fused in, then `df2_ctx_write` (k_norm, RoPE,
//! the pages); (2) one batched block forward over `B * (N + 1)` rows, replayed from a CUDA
//! graph captured per `B` when the backend's graphs are on (dropped whenever a buffer it
//! points into is reallocated); (3) greedy: the
//! device's top-k candidates (and the selector's `hidden_projection`) come back, a few
//! floats a row, and the walk runs on the host with the CPU's own code
//! (`speclab_drafters::dflash2::walk_greedy`); sampling (v2): the same candidates, and the
//! CPU's sampled walk (`walk_sampled`) draws with the request's RNG, q going to the
//! verifier as sparse rows over the candidates (`DraftProbs::Sparse`: k floats a draft, not
//! a vocabulary); sampling v1 (a softmax over the whole row): the prediction rows' hidden
//! and logits come back and the CPU picker (`pick_rows`) draws.
//!
//! Invariants: the device pages are written only by appends (a draft never modifies the
//! cache, §7); every page slot was resolved on the host by `DraftGroup::locate`
//! (`crate::dflash_plan`); numerics are f32 with bf16 weights widened exactly (§1), so
//! the draft equals the CPU drafter's up to summation order (gpu_check: the same accepted
//! drafts at every step); the weights are uploaded
//! once, at the first step, on the backend's own context and stream.

use std::collections::HashMap;

use rand::RngCore;
use speclab_drafters::adapters::{check_dflash, dflash_group, DrafterKind, DrafterSpec};
use speclab_drafters::dflash2::{
    pick_rows, walk_greedy, walk_sampled, DFlash2Weights, DraftGroup, DraftMode, DraftRequest,
};
use speclab_engine::exec::DrafterFactory;
use speclab_engine::kv::{GroupSpec, KvCacheManager};
use speclab_engine::model::attention::rope_tables;
use speclab_engine::model::ModelConfig;
use speclab_engine::spec::{DraftProbs, SparseProbs};
use speclab_engine::{
    DraftReq, DraftStep, Drafter, EngineError, LayerHidden, Proposal, ProposeCtx, ReqSlot,
};

use crate::backend::CudaBackend;
use crate::buf::DevBuf;
use crate::device::Gpu;
use crate::dflash_plan::{plan_append, plan_draft, AppendPlan, AppendReq, DraftAnchor, DraftPlan};
use crate::error::{CudaError, Result};
use crate::launch::{grid_2d, Shape};
use crate::ops::{self, int, ptr, Arg, Mat};
use crate::repack::{fuse_gate_up_bf16, stack_rows};

/// One grouped conv module on the device.
struct DevConv {
    /// `kernel_projection` [2*K*G, H] bf16.
    proj: DevBuf<u16>,
    /// Shape: [2, K, H] f32.
    base: DevBuf<f32>,
}

/// One drafter layer on the device.
struct DevDraftLayer {
    /// Shape: [H] f32.
    input_norm: DevBuf<f32>,
    /// Shape: [H] f32.
    post_norm: DevBuf<f32>,
    /// `[q; k; v]` stacked: [(nh + 2 nkv) d, H] bf16.
    wqkv: DevBuf<u16>,
    /// Shape: [d] f32.
    q_norm: DevBuf<f32>,
    /// Shape: [d] f32.
    k_norm: DevBuf<f32>,
    /// [H, nh d] bf16.
    wo: DevBuf<u16>,
    /// Gate / up fused: [I, 2, H] bf16.
    w13: DevBuf<u16>,
    /// [H, I] bf16.
    wd: DevBuf<u16>,
    attn_conv: Option<DevConv>,
    mlp_conv: Option<DevConv>,
}

/// The drafter's weights, RoPE tables and context pages on the device.
struct DevDraft {
    /// [H, F] bf16.
    fc: DevBuf<u16>,
    /// Shape: [H] f32.
    hidden_norm: DevBuf<f32>,
    /// Every layer's `[k; v]` stacked (the context projections, §4): [Ld * 2 nkv d, H] bf16.
    wkv: DevBuf<u16>,
    /// Shape: [Ld, d] f32.
    k_norms: DevBuf<f32>,
    layers: Vec<DevDraftLayer>,
    /// Shape: [H] f32.
    norm: DevBuf<f32>,
    /// `candidate_selector.hidden_projection` [r, H] bf16 (v2 checkpoints).
    sel_proj: Option<DevBuf<u16>>,
    /// Shape: [max_pos, d] f32 each.
    rope_cos: DevBuf<f32>,
    rope_sin: DevBuf<f32>,
    /// Positions the RoPE tables cover.
    max_pos: usize,
    /// Per layer K then V, each [num_blocks * bs, nkv d]. Shape: [Ld * 2 * num_blocks * bs * nkv * d] f32.
    pages: DevBuf<f32>,
    /// Floats of one layer's K (= V) region: num_blocks * bs * nkv * d.
    kv_region: usize,
    bufs: Bufs,
    /// The block forward captured per batch size `B`, alone (`false`) or after the
    /// padded context append (`true`, [`run_step`]), with the kernels each holds; dropped
    /// whenever the buffers it points into are reallocated.
    graphs: HashMap<(usize, bool), (cudarc::driver::CudaGraph, u64)>,
    /// Uses of each key (a graph is captured at its `CAPTURE_AT_USE`-th).
    sightings: crate::backend::Sightings<(usize, bool)>,
    /// The target's per-layer hidden buffer (device address, layer stride) the append
    /// graphs read: when the backend reallocates it, they are dropped.
    append_src: Option<(u64, usize)>,
    /// The first capture / replay failure (the drafter then runs eagerly).
    graph_error: Option<String>,
}

/// Step buffers, grown on demand.
struct Bufs {
    /// Block rows the draft buffers hold.
    r_cap: usize,
    /// Context rows the append buffers hold.
    t_cap: usize,
    /// Shape: [r_cap, H] each.
    x: DevBuf<f32>,
    a1: DevBuf<f32>,
    a2: DevBuf<f32>,
    t: DevBuf<f32>,
    hid: DevBuf<f32>,
    /// Conv coefficients. Shape: [r_cap, 2*K*G].
    proj: DevBuf<f32>,
    /// Shape: [r_cap, (nh + 2 nkv) d].
    qkv: DevBuf<f32>,
    /// Shape: [r_cap, nh d].
    o: DevBuf<f32>,
    /// Shape: [r_cap, I].
    hm: DevBuf<f32>,
    /// Shape: [r_cap, V].
    logits: DevBuf<f32>,
    /// Candidates (ids as floats), unary scores, selector g. Shape: [r_cap, 2k + r].
    pick: DevBuf<f32>,
    /// Shape: [t_cap, F].
    feats: DevBuf<f32>,
    /// Shape: [t_cap, H].
    c: DevBuf<f32>,
    /// Shape: [t_cap, Ld * 2 nkv d].
    kvc: DevBuf<f32>,
    /// Metadata of one call. Shape: [len] i32.
    meta: DevBuf<i32>,
}

fn zeros(g: &Gpu, n: usize, what: &str) -> Result<DevBuf<f32>> {
    DevBuf::zeros(&g.stream, n.max(1), what)
}

impl Bufs {
    fn new(
        g: &Gpu,
        cfg: &speclab_drafters::DFlash2Config,
        r_cap: usize,
        t_cap: usize,
    ) -> Result<Self> {
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let d = &cfg.dflash_config;
        let kg = conv_coeffs(cfg);
        let (nh, nkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let pick = pick_stride(DraftMode::V2, d.selector_top_k.max(1), d.selector_rank);
        Ok(Self {
            r_cap,
            t_cap,
            x: zeros(g, r_cap * h, "dflash2 x")?,
            a1: zeros(g, r_cap * h, "dflash2 a1")?,
            a2: zeros(g, r_cap * h, "dflash2 a2")?,
            t: zeros(g, r_cap * h, "dflash2 t")?,
            hid: zeros(g, r_cap * h, "dflash2 hidden")?,
            proj: zeros(g, r_cap * kg, "dflash2 conv coefficients")?,
            qkv: zeros(g, r_cap * (nh + 2 * nkv) * hd, "dflash2 qkv")?,
            o: zeros(g, r_cap * nh * hd, "dflash2 attention out")?,
            hm: zeros(g, r_cap * cfg.intermediate_size, "dflash2 mlp")?,
            logits: zeros(g, r_cap * v, "dflash2 logits")?,
            pick: zeros(g, r_cap * pick, "dflash2 candidates")?,
            feats: zeros(g, t_cap * cfg.feature_dim(), "dflash2 features")?,
            c: zeros(g, t_cap * h, "dflash2 context hidden")?,
            kvc: zeros(
                g,
                t_cap * cfg.num_hidden_layers * 2 * cfg.kv_row(),
                "dflash2 context kv",
            )?,
            meta: DevBuf::zeros(&g.stream, 1024, "dflash2 metadata")?,
        })
    }
}

fn up_f32(g: &Gpu, v: &[f32], what: &str) -> Result<DevBuf<f32>> {
    DevBuf::upload(&g.stream, v, what)
}
fn up_lin(g: &Gpu, ls: &[&speclab_engine::model::Linear], what: &str) -> Result<DevBuf<u16>> {
    DevBuf::upload(&g.stream, &stack_rows(ls, 0, what)?, what)
}

fn conv(
    g: &Gpu,
    c: &Option<speclab_drafters::dflash2::weights::ConvWeights>,
    p: &str,
) -> Result<Option<DevConv>> {
    c.as_ref()
        .map(|c| {
            Ok(DevConv {
                proj: up_lin(g, &[&c.proj], &format!("{p}.kernel_projection"))?,
                base: up_f32(g, &c.base, &format!("{p}.base_kernel"))?,
            })
        })
        .transpose()
}

impl DevDraft {
    fn upload(g: &Gpu, w: &DFlash2Weights, grp: &DraftGroup) -> Result<Self> {
        let cfg = &w.cfg;
        let mut layers = Vec::with_capacity(w.layers.len());
        let mut kv_rows = Vec::new();
        let mut k_norms = Vec::new();
        for (l, lw) in w.layers.iter().enumerate() {
            let p = format!("layers.{l}");
            kv_rows.push(&lw.k);
            kv_rows.push(&lw.v);
            k_norms.extend_from_slice(&lw.k_norm);
            layers.push(DevDraftLayer {
                input_norm: up_f32(g, &lw.input_norm, &p)?,
                post_norm: up_f32(g, &lw.post_norm, &p)?,
                wqkv: up_lin(g, &[&lw.q, &lw.k, &lw.v], &format!("{p}.self_attn.qkv"))?,
                q_norm: up_f32(g, &lw.q_norm, &p)?,
                k_norm: up_f32(g, &lw.k_norm, &p)?,
                wo: up_lin(g, &[&lw.o], &format!("{p}.self_attn.o_proj"))?,
                w13: DevBuf::upload(
                    &g.stream,
                    &fuse_gate_up_bf16(&lw.mlp.gate, &lw.mlp.up, &p)?,
                    &p,
                )?,
                wd: up_lin(g, &[&lw.mlp.down], &format!("{p}.mlp.down_proj"))?,
                attn_conv: conv(g, &lw.attn_conv, &format!("{p}.attention_conv"))?,
                mlp_conv: conv(g, &lw.mlp_conv, &format!("{p}.mlp_conv"))?,
            });
        }
        // RoPE over every position a block can reach: the context plus one block.
        let max_pos = cfg.max_position_embeddings + cfg.block_size;
        let (cos, sin) = rope_tables(0, max_pos, cfg.head_dim, cfg.rope_theta);
        let kv_region = grp.num_blocks * grp.block_size * cfg.kv_row();
        let pages = DevBuf::zeros(
            &g.stream,
            (cfg.num_hidden_layers * 2 * kv_region).max(1),
            "dflash2 context pages",
        )?;
        Ok(Self {
            fc: up_lin(g, &[&w.fc], "fc")?,
            hidden_norm: up_f32(g, &w.hidden_norm, "hidden_norm")?,
            wkv: up_lin(g, &kv_rows, "context k/v")?,
            k_norms: up_f32(g, &k_norms, "k_norm")?,
            layers,
            norm: up_f32(g, &w.norm, "norm")?,
            sel_proj: w
                .selector
                .as_ref()
                .map(|s| up_lin(g, &[&s.hidden_proj], "candidate_selector.hidden_projection"))
                .transpose()?,
            rope_cos: up_f32(g, &cos, "dflash2 rope cos")?,
            rope_sin: up_f32(g, &sin, "dflash2 rope sin")?,
            max_pos,
            pages,
            kv_region,
            bufs: Bufs::new(g, cfg, 8, 8)?,
            graphs: HashMap::new(),
            sightings: Default::default(),
            append_src: None,
            graph_error: None,
        })
    }

    /// Grow the step buffers to `r` block rows and `t` context rows.
    fn ensure(
        &mut self,
        g: &Gpu,
        cfg: &speclab_drafters::DFlash2Config,
        r: usize,
        t: usize,
    ) -> Result<()> {
        if r > self.bufs.r_cap || t > self.bufs.t_cap {
            let grow = |x: usize, cap: usize| x.max(cap).next_power_of_two();
            self.bufs = Bufs::new(g, cfg, grow(r, self.bufs.r_cap), grow(t, self.bufs.t_cap))?;
            self.graphs.clear();
        }
        Ok(())
    }
}

impl DevDraft {
    /// Upload `data` as the call's metadata (reallocating drops the captured graphs).
    fn upload_meta(&mut self, g: &Gpu, data: &[i32]) -> Result<()> {
        if data.len() > self.bufs.meta.len {
            self.bufs.meta = DevBuf::zeros(
                &g.stream,
                data.len().next_power_of_two(),
                "dflash2 metadata",
            )?;
            self.graphs.clear();
        }
        self.bufs.meta.write(&g.stream, data, "dflash2 metadata")
    }
}

fn shape(x: usize, y: usize, block: u32, what: &str) -> Result<Shape> {
    grid_2d(x, y, block, what)
}

/// Keys per shared-memory tile of `df2_attention` (`Df2Tile<D>::T`).
fn att_tile(d: usize) -> usize {
    if d <= 64 {
        64
    } else {
        32
    }
}
/// Candidates per row `df2_topk` can keep (its longest register list).
pub const TOPK_MAX: usize = 16;

/// `df2_attention`: grid (R, nkv), one warp per query head of a KV group, dynamic shared
/// memory for a K and a V tile (rows padded to d + 1) and the group's queries.
fn attention_shape(r: usize, nh: usize, nkv: usize, d: usize) -> Result<Shape> {
    let gq = nh / nkv.max(1);
    let smem = 4 * (2 * att_tile(d) * (d + 1) + gq * d);
    if gq == 0 || gq > 8 || smem > 48 * 1024 || ![32, 64, 128].contains(&d) {
        return Err(CudaError::Unsupported(format!(
            "df2_attention: {gq} query heads per KV head and head_dim {d} need {smem} B of shared memory (at most 8 heads per KV head: the kernel's 256-thread launch bound; 48 KiB; head_dim 32, 64 or 128)"
        )));
    }
    let mut s = grid_2d(r, nkv, 32 * gq.max(2) as u32, "df2_attention")?;
    s.smem = smem as u32;
    Ok(s)
}

/// The CUDA DFlash2 (v2) / DFlash v1 drafter (module doc).
pub struct CudaDFlash2 {
    /// Host copy: config, the selector codebooks of the walk, the pickers.
    w: DFlash2Weights,
    mode: DraftMode,
    num_speculative_tokens: usize,
    grp: DraftGroup,
    dev: Option<DevDraft>,
    /// Per request: positions appended (`n`).
    ctx_len: HashMap<ReqSlot, usize>,
    /// v2 at T > 0: the CPU picker over the prediction rows read back (`pick_rows`, q
    /// dense) instead of the walk over the device's candidates (q sparse); the A/B
    /// reference. Off unless `SPECLAB_DF2_DEVICE_CANDS=0`.
    pub host_sampled_walk: bool,
    /// With graphs on, a step whose context append fits the block (at most B (N + 1)
    /// rows: decode steps) pads it to that and replays append + block forward as one
    /// graph ([`run_step`]); default, `SPECLAB_DF2_APPEND_GRAPH=0` launches the append
    /// eagerly before the block's graph (the A/B reference).
    pub append_in_graph: bool,
}

/// One request's candidates from the device: ids and unary scores [N, k], the selector's
/// g [N, r] (v2; empty for v1).
#[derive(Default)]
struct Cands {
    ids: Vec<u32>,
    unary: Vec<f32>,
    g: Vec<f32>,
}

impl std::fmt::Debug for CudaDFlash2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDFlash2")
            .field("mode", &self.mode)
            .field("num_speculative_tokens", &self.num_speculative_tokens)
            .field("uploaded", &self.dev.is_some())
            .finish_non_exhaustive()
    }
}

fn not_uploaded() -> CudaError {
    CudaError::Input("dflash2: the weights are not on the device yet (internal)".into())
}

fn engine(e: CudaError) -> EngineError {
    e.into()
}

impl CudaDFlash2 {
    /// The drafter over `kv` (whose layout holds the `drafter_swa` group), validated as
    /// the host drafter is. Nothing touches the device until the first step.
    pub fn new(
        w: DFlash2Weights,
        target: &ModelConfig,
        kv: &KvCacheManager,
        num_speculative_tokens: usize,
        mode: DraftMode,
    ) -> speclab_engine::Result<Self> {
        check_dflash(&w, target, num_speculative_tokens, mode)?;
        let (c, k) = (&w.cfg, w.cfg.dflash_config.selector_top_k);
        if c.vocab_size >= 1 << 24
            || c.head_dim > 128
            || c.head_dim % 2 == 1
            || k > TOPK_MAX
            || k > c.vocab_size
        {
            return Err(EngineError::Unsupported(format!(
                "the CUDA DFlash2 drafter needs vocab_size < 2^24, an even head_dim <= 128 and selector_top_k <= {TOPK_MAX} (and <= vocab_size): vocab {}, head_dim {}, top-k {k}",
                c.vocab_size, c.head_dim
            )));
        }
        attention_shape(1, c.num_attention_heads, c.num_key_value_heads, c.head_dim)?;
        let group = dflash_group(kv)?;
        let grp = DraftGroup::new(&w.cfg, target, kv, group)?;
        Ok(Self {
            w,
            mode,
            num_speculative_tokens,
            grp,
            dev: None,
            ctx_len: HashMap::new(),
            host_sampled_walk: !crate::device::env_on("SPECLAB_DF2_DEVICE_CANDS"),
            append_in_graph: crate::device::env_on("SPECLAB_DF2_APPEND_GRAPH"),
        })
    }

    /// (1), planned: the batched context append of every request's committed rows (the
    /// appended lengths advance here; the rows go to the device with the draft, or alone
    /// through [`Self::append_eager`]).
    fn plan_append_step(
        &mut self,
        kv: &KvCacheManager,
        reqs: &[AppendReq],
        t_fwd: usize,
    ) -> Result<AppendPlan> {
        let plan = plan_append(&self.w.cfg, &self.grp, kv, &self.ctx_len, reqs)?;
        if plan.rows.iter().any(|&r| r as usize >= t_fwd) {
            return Err(CudaError::Input(
                "dflash2: a committed row lies outside the forward (internal)".into(),
            ));
        }
        for &(s, n) in &plan.new_len {
            self.ctx_len.insert(s, n);
        }
        Ok(plan)
    }

    /// (1) launched on its own (eagerly).
    fn append_eager(&mut self, be: &CudaBackend, plan: &AppendPlan) -> Result<()> {
        let t = plan.rows.len();
        if t == 0 {
            return Ok(());
        }
        let dev = self.dev.as_mut().ok_or_else(not_uploaded)?;
        dev.ensure(&be.gpu, &self.w.cfg, 1, t)?;
        dev.upload_meta(&be.gpu, &append_meta(&self.w.cfg, plan))?;
        run_append(&be.gpu, be, &self.w, dev, t, 0)
    }

    /// (1) + (2) + (3) for `anchors`: the context append of `append`, then the draft
    /// tokens (N each) and, when sampling, q. With [`Self::append_in_graph`] and graphs
    /// on, an append of at most B (N + 1) rows is padded to that and runs in the block's
    /// graph; otherwise it is launched before it.
    fn draft(
        &mut self,
        be: &CudaBackend,
        kv: &KvCacheManager,
        mut append: AppendPlan,
        anchors: &[DraftAnchor],
        temperature: f32,
        rngs: &mut [Option<&mut dyn RngCore>],
    ) -> Result<Vec<Proposal>> {
        let nn = self.num_speculative_tokens;
        let r = anchors.len() * (nn + 1);
        let fused = self.append_in_graph
            && be.graphs_on()
            && append.rows.len() <= r
            && self.dev.as_ref().is_some_and(|d| d.graph_error.is_none());
        if !fused {
            self.append_eager(be, &append)?;
        }
        let dev = self.dev.as_mut().ok_or_else(not_uploaded)?;
        let plan = plan_draft(
            &self.w.cfg,
            &self.grp,
            kv,
            &self.ctx_len,
            anchors,
            nn,
            dev.max_pos,
        )?;
        if fused {
            pad_append(&mut append, r);
            dev.ensure(&be.gpu, &self.w.cfg, r, r)?;
            let mut meta = Fx::meta(&plan);
            let aoff = meta.len();
            meta.extend(append_meta(&self.w.cfg, &append));
            dev.upload_meta(&be.gpu, &meta)?;
            run_step(
                be,
                &self.w,
                dev,
                self.mode,
                &plan,
                anchors.len(),
                Some(aoff),
            )?;
        } else {
            dev.ensure(&be.gpu, &self.w.cfg, r, 1)?;
            dev.upload_meta(&be.gpu, &Fx::meta(&plan))?;
            run_step(be, &self.w, dev, self.mode, &plan, anchors.len(), None)?;
        }
        match (temperature > 0.0, self.mode) {
            (true, DraftMode::V2) if self.host_sampled_walk => {
                self.pick_sampled(be, anchors, temperature, rngs)
            }
            (true, DraftMode::V2) => self.pick_walk_sampled(be, anchors, temperature, rngs),
            (true, DraftMode::V1) => self.pick_sampled(be, anchors, temperature, rngs),
            (false, _) => self.pick_greedy(be, anchors),
        }
    }

    /// Each anchor's candidates from the device's pick buffer: ids and unary scores [N, k]
    /// and (v2) the selector's g [N, r], one read for the step.
    fn candidates(&self, be: &CudaBackend, anchors: &[DraftAnchor]) -> Result<Vec<Cands>> {
        let dev = self.dev.as_ref().ok_or_else(not_uploaded)?;
        let q = self.num_speculative_tokens + 1;
        let d = &self.w.cfg.dflash_config;
        let (k, rank) = (topk(self.mode, &self.w.cfg), d.selector_rank);
        let stride = pick_stride(self.mode, k, rank);
        let all = dev.bufs.pick.read(
            &be.gpu.stream,
            0,
            anchors.len() * q * stride,
            "dflash2 candidates",
        )?;
        let mut out = Vec::with_capacity(anchors.len());
        for b in 0..anchors.len() {
            let mut c = Cands::default();
            for j in 1..q {
                let row = &all[(b * q + j) * stride..(b * q + j + 1) * stride];
                c.ids.extend(row[..k].iter().map(|&x| x as u32));
                c.unary.extend_from_slice(&row[k..2 * k]);
                if self.mode == DraftMode::V2 {
                    c.g.extend_from_slice(&row[2 * k..2 * k + rank]);
                }
            }
            out.push(c);
        }
        Ok(out)
    }

    fn pick_greedy(&self, be: &CudaBackend, anchors: &[DraftAnchor]) -> Result<Vec<Proposal>> {
        let (k, rank) = (
            topk(self.mode, &self.w.cfg),
            self.w.cfg.dflash_config.selector_rank,
        );
        let cands = self.candidates(be, anchors)?;
        let mut out = Vec::with_capacity(anchors.len());
        for (a, c) in anchors.iter().zip(cands) {
            let tokens = match (&self.w.selector, self.mode) {
                (Some(sel), DraftMode::V2) => {
                    walk_greedy(sel, rank, a.anchor, &c.ids, &c.unary, &c.g, k)
                }
                _ => c.ids,
            };
            debug_assert_eq!(tokens.len(), self.num_speculative_tokens);
            out.push(Proposal {
                tokens,
                probs: None,
            });
        }
        Ok(out)
    }

    /// v2 at T > 0: the sampled walk over the device's candidates (`walk_sampled`, the
    /// CPU picker's draws), q as sparse rows over them. Only the candidates cross to the
    /// host, as in the greedy pick.
    fn pick_walk_sampled(
        &self,
        be: &CudaBackend,
        anchors: &[DraftAnchor],
        temperature: f32,
        rngs: &mut [Option<&mut dyn RngCore>],
    ) -> Result<Vec<Proposal>> {
        let sel = self.w.selector.as_ref().ok_or_else(|| {
            CudaError::Input("dflash2: v2 sampling needs the candidate selector (internal)".into())
        })?;
        let (k, rank) = (
            topk(self.mode, &self.w.cfg),
            self.w.cfg.dflash_config.selector_rank,
        );
        let cands = self.candidates(be, anchors)?;
        let mut out = Vec::with_capacity(anchors.len());
        for (b, (a, c)) in anchors.iter().zip(cands).enumerate() {
            let rng = request_rng(rngs, b)?;
            let (tokens, p) = walk_sampled(
                sel,
                rank,
                a.anchor,
                (&c.ids, &c.unary, &c.g),
                k,
                temperature,
                rng,
            );
            out.push(Proposal {
                tokens,
                probs: Some(DraftProbs::Sparse(SparseProbs { k, ids: c.ids, p })),
            });
        }
        Ok(out)
    }

    fn pick_sampled(
        &self,
        be: &CudaBackend,
        anchors: &[DraftAnchor],
        temperature: f32,
        rngs: &mut [Option<&mut dyn RngCore>],
    ) -> Result<Vec<Proposal>> {
        let dev = self.dev.as_ref().ok_or_else(not_uploaded)?;
        let (nn, q) = (self.num_speculative_tokens, self.num_speculative_tokens + 1);
        let (h, v) = (self.w.cfg.hidden_size, self.w.cfg.vocab_size);
        let st = &be.gpu.stream;
        let rows = anchors.len() * q;
        // One read of each buffer (row 0 of a block, the anchor, is read and skipped).
        let hid_all = dev.bufs.hid.read(st, 0, rows * h, "dflash2 hidden")?;
        let logits_all = dev.bufs.logits.read(st, 0, rows * v, "dflash2 logits")?;
        let mut out = Vec::with_capacity(anchors.len());
        for (b, a) in anchors.iter().enumerate() {
            let hid = &hid_all[(b * q + 1) * h..(b * q + q) * h];
            let rows = &logits_all[(b * q + 1) * v..(b * q + q) * v];
            let req = DraftRequest {
                slot: a.slot,
                anchor_token: a.anchor,
                anchor_pos: self.ctx_len.get(&a.slot).copied().unwrap_or(0),
                num_speculative_tokens: nn,
                mode: self.mode,
                temperature,
                trace: false,
            };
            let rng = request_rng(rngs, b)?;
            out.push(pick_rows(&self.w, hid, rows, &req, Some(rng))?);
        }
        Ok(out)
    }
}

/// Request `b`'s RNG for a sampled draft (an error when the step gave none).
fn request_rng<'a>(
    rngs: &'a mut [Option<&mut dyn RngCore>],
    b: usize,
) -> Result<&'a mut dyn RngCore> {
    match rngs.get_mut(b) {
        Some(Some(r)) => Ok(&mut **r),
        _ => Err(CudaError::Input(
            "sampling drafts (temperature > 0) needs an RNG".into(),
        )),
    }
}

/// Candidates per row the device keeps: the selector's k (v2), 1 (v1: the argmax).
fn topk(mode: DraftMode, cfg: &speclab_drafters::DFlash2Config) -> usize {
    match mode {
        DraftMode::V2 => cfg.dflash_config.selector_top_k,
        DraftMode::V1 => 1,
    }
}

/// Floats per row of a conv module's coefficients (`kernel_projection`: [2, K, G], §5.1).
fn conv_coeffs(cfg: &speclab_drafters::DFlash2Config) -> usize {
    2 * cfg.dflash_config.conv_kernel_size * cfg.conv_groups()
}

/// Floats per row of the candidates buffer: ids, unary scores, and (v2) g.
fn pick_stride(mode: DraftMode, k: usize, rank: usize) -> usize {
    match mode {
        DraftMode::V2 => 2 * k + rank,
        DraftMode::V1 => 2 * k,
    }
}

/// The append's metadata sections in the order [`run_append`] reads them: rows, positions,
/// page slots (each [T]), then the target layer slots of the features.
fn append_meta(cfg: &speclab_drafters::DFlash2Config, plan: &AppendPlan) -> Vec<i32> {
    let layers = &cfg.dflash_config.target_layer_ids;
    let mut meta = Vec::with_capacity(3 * plan.rows.len() + layers.len());
    for sec in [&plan.rows, &plan.pos, &plan.slot] {
        meta.extend_from_slice(sec);
    }
    meta.extend(layers.iter().map(|&i| i as i32 + 1));
    meta
}

/// Pad `plan` to `t` rows: row 0, position 0 and page slot -1, which `df2_ctx_write`
/// skips (the padded rows' features, fc and K/V are computed and never stored), so a
/// decode step's append has one shape per batch and can sit in the step's graph.
fn pad_append(plan: &mut AppendPlan, t: usize) {
    for v in [&mut plan.rows, &mut plan.pos] {
        v.resize(t, 0);
    }
    plan.slot.resize(t, -1);
}

/// The per-layer hidden buffer the append reads and its layer stride.
fn per_layer(be: &CudaBackend) -> Result<(&DevBuf<f32>, usize)> {
    let pl = be.per_layer.as_ref().ok_or_else(|| {
        CudaError::Input(
            "dflash2: the target forward kept no per-layer hidden states (collect_hidden)".into(),
        )
    })?;
    Ok((pl, be.ws.t_cap * be.w.cfg.hidden_size))
}

/// Context append on the device of `t` rows whose [`append_meta`] lies at `aoff` of the
/// uploaded metadata: features -> fc -> (hidden_norm fused) every layer's K/V -> k_norm +
/// RoPE + pages.
fn run_append(
    g: &Gpu,
    be: &CudaBackend,
    w: &DFlash2Weights,
    dev: &DevDraft,
    t: usize,
    aoff: usize,
) -> Result<()> {
    let cfg = &w.cfg;
    let (h, f) = (cfg.hidden_size, cfg.feature_dim());
    let nl = cfg.dflash_config.target_layer_ids.len();
    let (pl, layer_stride) = per_layer(be)?;
    let b = &dev.bufs;
    let m = &b.meta;
    let args = [
        ptr(&b.feats, 0, t * f, "features")?,
        ptr(
            pl,
            0,
            (be.w.cfg.num_hidden_layers + 1) * layer_stride,
            "per-layer hidden",
        )?,
        ops::long(layer_stride),
        ptr(m, aoff, t, "rows")?,
        ptr(m, aoff + 3 * t, nl, "layers")?,
        int(t, "T")?,
        int(nl, "m")?,
        int(be.w.cfg.hidden_size, "H")?,
    ];
    // SAFETY: out [T, m*H] and per_layer [(L+1) * t_cap * H] checked; rows < T_fwd <= t_cap
    // (checked by the caller) and layer slots <= L (DFlash2Config::check_target).
    unsafe { ops::launch(g, "df2_features", shape(t, 1, 256, "df2_features")?, &args)? };
    ops::linear(
        g,
        &ops::Linear {
            y: Mat::rows(&b.c, h),
            x: Mat::rows(&b.feats, f),
            w: &dev.fc,
            m: t,
            n: h,
            k: f,
            accumulate: false,
        },
    )?;
    let kvw = cfg.num_hidden_layers * 2 * cfg.kv_row();
    ops::linear_norm(
        g,
        &ops::Linear {
            y: Mat::rows(&b.kvc, kvw),
            x: Mat::rows(&b.c, h),
            w: &dev.wkv,
            m: t,
            n: kvw,
            k: h,
            accumulate: false,
        },
        &dev.hidden_norm,
        cfg.rms_norm_eps as f32,
    )?;
    let (ld, nkv, d) = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim);
    let args = [
        ptr(&b.kvc, 0, t * kvw, "context kv")?,
        ptr(m, aoff + t, t, "pos")?,
        ptr(m, aoff + 2 * t, t, "slot")?,
        ptr(&dev.k_norms, 0, ld * d, "k_norm")?,
        ptr(&dev.rope_cos, 0, dev.max_pos * d, "rope cos")?,
        ptr(&dev.rope_sin, 0, dev.max_pos * d, "rope sin")?,
        ptr(&dev.pages, 0, ld * 2 * dev.kv_region, "pages")?,
        ops::long(2 * dev.kv_region),
        ops::long(dev.kv_region),
        int(ld, "Ld")?,
        int(nkv, "nkv")?,
        int(d, "d")?,
        Arg::F(cfg.rms_norm_eps as f32),
        int(t, "T")?,
    ];
    // SAFETY: kv [T, Ld*2*row], pages [Ld * 2 * region] checked; pos < max_pos (positions
    // < the target's context <= max_position_embeddings), slots < num_blocks * bs
    // (DraftGroup::locate) or -1 (a padded row, skipped).
    unsafe {
        ops::launch(
            g,
            "df2_ctx_write",
            shape(t, ld, 32 * nkv as u32, "df2_ctx_write")?,
            &args,
        )
    }
}

/// The block forward of `nb` requests, after the padded context append of `B (N + 1)`
/// rows whose metadata lies at `aoff` when given: replayed from the graph captured for
/// (`nb`, append or not) when the backend's graphs are on (at the key's
/// `CAPTURE_AT_USE`-th use), else launched eagerly. A capture that fails turns the
/// drafter's graphs off (recorded in `graph_error`) and runs eagerly. Append graphs read
/// the target's per-layer hidden buffer: they are dropped when it moves.
fn run_step(
    be: &CudaBackend,
    w: &DFlash2Weights,
    dev: &mut DevDraft,
    mode: DraftMode,
    plan: &DraftPlan,
    nb: usize,
    aoff: Option<usize>,
) -> Result<()> {
    let q = plan.tokens.len() / nb.max(1);
    let fx = |dev: &DevDraft| {
        if let Some(aoff) = aoff {
            run_append(&be.gpu, be, w, dev, nb * q, aoff)?;
        }
        Fx {
            g: &be.gpu,
            be,
            w,
            dev,
            mode,
            s_max: plan.s_max,
            q,
            r: nb * q,
        }
        .kernels()
    };
    let key = (nb, aoff.is_some());
    if aoff.is_some() {
        let (pl, stride) = per_layer(be)?;
        let src = match ptr(pl, 0, pl.len, "per-layer hidden")? {
            Arg::P(a) => (a, stride),
            _ => (0, stride),
        };
        if dev.append_src != Some(src) {
            dev.graphs.retain(|k, _| !k.1);
            dev.append_src = Some(src);
        }
    }
    if !be.graphs_on()
        || dev.graph_error.is_some()
        || !(dev.graphs.contains_key(&key) || dev.sightings.capture_now(key))
    {
        return fx(dev);
    }
    if !dev.graphs.contains_key(&key) {
        match crate::backend::capture_uploaded(&be.gpu, || fx(dev)) {
            Ok(gn) => {
                dev.graphs.insert(key, gn);
            }
            Err(e) => {
                dev.graph_error = Some(e.to_string());
                return fx(dev);
            }
        }
    }
    crate::backend::launch_captured(dev.graphs.get(&key), "dflash2")
}

/// The block forward's borrowed context.
struct Fx<'a> {
    g: &'a Gpu,
    be: &'a CudaBackend,
    w: &'a DFlash2Weights,
    dev: &'a DevDraft,
    mode: DraftMode,
    /// Context slots per request in the metadata (`W - 1`).
    s_max: usize,
    /// Rows per block (N + 1).
    q: usize,
    /// Rows of the batch.
    r: usize,
}

impl Fx<'_> {
    /// The metadata of `plan` in the order the kernels read it (tokens, positions, info,
    /// context slots).
    fn meta(plan: &DraftPlan) -> Vec<i32> {
        let mut meta =
            Vec::with_capacity(2 * plan.tokens.len() + plan.info.len() + plan.ctx_slots.len());
        for sec in [&plan.tokens, &plan.pos, &plan.info, &plan.ctx_slots] {
            meta.extend_from_slice(sec);
        }
        meta
    }

    /// §5 over every request's block, then the head and the device pick inputs (the
    /// metadata already uploaded): the kernels a draft graph holds.
    fn kernels(&self) -> Result<()> {
        let cfg = &self.w.cfg;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let r = self.r;
        let b = &self.dev.bufs;
        let tokens = ptr(&b.meta, 0, r, "tokens")?;
        ops::embed(self.g, &b.x, &self.be.w.embed, tokens, r, h, v)?;
        for l in 0..cfg.num_hidden_layers {
            self.layer(l)?;
        }
        self.norm(&b.hid, &self.dev.norm)?;
        self.lin(
            Mat::rows(&b.logits, v),
            &b.hid,
            &self.be.w.lm_head,
            v,
            h,
            false,
        )?;
        let (k, rank) = (topk(self.mode, cfg), cfg.dflash_config.selector_rank);
        let stride = pick_stride(self.mode, k, rank);
        let args = [
            ptr(&b.pick, 0, r * stride, "candidates")?,
            int(stride, "stride")?,
            ptr(&b.logits, 0, r * v, "logits")?,
            int(v, "V")?,
            int(k, "k")?,
            int(r, "R")?,
        ];
        // SAFETY: out [R, stride] (2k <= stride) and logits [R, V] checked.
        unsafe { ops::launch(self.g, "df2_topk", shape(r, 1, 512, "df2_topk")?, &args)? };
        if let (DraftMode::V2, Some(sp)) = (self.mode, &self.dev.sel_proj) {
            let g_cols = Mat {
                buf: &b.pick,
                off: 2 * k,
                stride,
            };
            self.lin(g_cols, &b.hid, sp, rank, h, false)?;
        }
        Ok(())
    }

    /// `y (+)= x @ W^T` over the batch's rows; `x` holds rows of `k` floats.
    fn lin(
        &self,
        y: Mat<'_>,
        x: &DevBuf<f32>,
        w: &DevBuf<u16>,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        let x = Mat::rows(x, k);
        let (m, a) = (self.r, accumulate);
        ops::linear(
            self.g,
            &ops::Linear {
                y,
                x,
                w,
                m,
                n,
                k,
                accumulate: a,
            },
        )
    }

    /// `out = rmsnorm(x, w)` over the batch's rows.
    fn norm(&self, out: &DevBuf<f32>, w: &DevBuf<f32>) -> Result<()> {
        let cfg = &self.w.cfg;
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps as f32);
        let x = Mat::rows(&self.dev.bufs.x, h);
        ops::rmsnorm(self.g, Mat::rows(out, h), x, w, self.r, h, eps)
    }

    /// A sublayer's input: `a1 = rmsnorm(x, norm)`, then, with a conv module, its
    /// coefficients from `a1` (both sides, §5.1) and its `prepare` side into `a2`.
    fn sublayer_in(&self, norm: &DevBuf<f32>, conv: Option<&DevConv>) -> Result<&DevBuf<f32>> {
        let b = &self.dev.bufs;
        self.norm(&b.a1, norm)?;
        let Some(c) = conv else {
            return Ok(&b.a1);
        };
        let (h, kg) = (self.w.cfg.hidden_size, conv_coeffs(&self.w.cfg));
        self.lin(Mat::rows(&b.proj, kg), &b.a1, &c.proj, kg, h, false)?;
        self.conv(&b.a2, &b.a1, c, 0, false)?;
        Ok(&b.a2)
    }

    /// A sublayer's output into the residual: `x += out @ W^T`, through the conv
    /// module's `finish` side when there is one (§5).
    fn residual(
        &self,
        conv: Option<&DevConv>,
        out: &DevBuf<f32>,
        w: &DevBuf<u16>,
        k: usize,
    ) -> Result<()> {
        let b = &self.dev.bufs;
        let h = self.w.cfg.hidden_size;
        match conv {
            Some(c) => {
                self.lin(Mat::rows(&b.t, h), out, w, h, k, false)?;
                self.conv(&b.x, &b.t, c, 1, true)
            }
            None => self.lin(Mat::rows(&b.x, h), out, w, h, k, true),
        }
    }

    fn conv(
        &self,
        out: &DevBuf<f32>,
        y: &DevBuf<f32>,
        c: &DevConv,
        side: usize,
        acc: bool,
    ) -> Result<()> {
        let cfg = &self.w.cfg;
        let dc = &cfg.dflash_config;
        let (h, k, gs) = (cfg.hidden_size, dc.conv_kernel_size, dc.conv_group_size);
        let b = &self.dev.bufs;
        let args = [
            ptr(out, 0, self.r * h, "conv out")?,
            ptr(y, 0, self.r * h, "conv in")?,
            ptr(&b.proj, 0, self.r * conv_coeffs(cfg), "conv coefficients")?,
            ptr(&c.base, 0, 2 * k * h, "conv base")?,
            int(side, "side")?,
            int(k, "K")?,
            int(gs, "gs")?,
            int(h, "H")?,
            int(self.q, "Q")?,
            int(self.r, "R")?,
            Arg::I(i32::from(acc)),
        ];
        // SAFETY: out, y [R, H], proj [R, 2KG], base [2, K, H] checked; taps read rows
        // r - tau >= r - j >= the block's first row.
        unsafe {
            ops::launch(
                self.g,
                "df2_conv",
                shape(self.r, 1, 256, "df2_conv")?,
                &args,
            )
        }
    }

    /// One decoder layer in place on `x` (§5; v1 skips the convolutions).
    fn layer(&self, l: usize) -> Result<()> {
        let cfg = &self.w.cfg;
        let lw = &self.dev.layers[l];
        let b = &self.dev.bufs;
        let (h, nh, nkv, d) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let qkv_w = (nh + 2 * nkv) * d;
        let v2 = self.mode == DraftMode::V2;
        let ac = lw.attn_conv.as_ref().filter(|_| v2);
        let mc = lw.mlp_conv.as_ref().filter(|_| v2);
        let a2 = self.sublayer_in(&lw.input_norm, ac)?;
        self.lin(Mat::rows(&b.qkv, qkv_w), a2, &lw.wqkv, qkv_w, h, false)?;
        self.norm_rope(lw)?;
        self.attention(l)?;
        self.residual(ac, &b.o, &lw.wo, nh * d)?;
        let f2 = self.sublayer_in(&lw.post_norm, mc)?;
        let inter = cfg.intermediate_size;
        let x = Mat::rows(f2, h);
        let (w13, m) = (&lw.w13, self.r);
        ops::swiglu(
            self.g,
            &ops::Swiglu {
                h: &b.hm,
                x,
                w13,
                m,
                n: inter,
                k: h,
            },
        )?;
        self.residual(mc, &b.hm, &lw.wd, inter)
    }

    fn norm_rope(&self, lw: &DevDraftLayer) -> Result<()> {
        let cfg = &self.w.cfg;
        let (nh, nkv, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let qkv_w = (nh + 2 * nkv) * d;
        let b = &self.dev.bufs;
        let r = self.r;
        let args = [
            ptr(&b.qkv, 0, r * qkv_w, "qkv")?,
            int(qkv_w, "stride")?,
            ptr(&b.meta, r, r, "pos")?,
            ptr(&lw.q_norm, 0, d, "q_norm")?,
            ptr(&lw.k_norm, 0, d, "k_norm")?,
            ptr(&self.dev.rope_cos, 0, self.dev.max_pos * d, "rope cos")?,
            ptr(&self.dev.rope_sin, 0, self.dev.max_pos * d, "rope sin")?,
            int(nh, "nh")?,
            int(nkv, "nkv")?,
            int(d, "d")?,
            Arg::F(cfg.rms_norm_eps as f32),
            int(r, "R")?,
        ];
        // SAFETY: qkv [R, (nh + 2nkv) d] checked; positions < max_pos (plan_draft).
        unsafe {
            ops::launch(
                self.g,
                "df2_head_norm_rope",
                shape(r, nh + nkv, 32, "df2_head_norm_rope")?,
                &args,
            )
        }
    }

    fn attention(&self, l: usize) -> Result<()> {
        let cfg = &self.w.cfg;
        let (nh, nkv, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let qkv_w = (nh + 2 * nkv) * d;
        let b = &self.dev.bufs;
        let (r, nb) = (self.r, self.r / self.q);
        let region = self.dev.kv_region;
        let info_off = 2 * r;
        let slots_off = info_off + 3 * nb;
        let args = [
            ptr(&b.o, 0, r * nh * d, "attention out")?,
            ptr(&b.qkv, 0, r * qkv_w, "qkv")?,
            int(qkv_w, "stride")?,
            ptr(&self.dev.pages, l * 2 * region, 2 * region, "layer pages")?,
            ops::long(region),
            ptr(&b.meta, slots_off, nb * self.s_max, "context slots")?,
            int(self.s_max, "s_max")?,
            ptr(&b.meta, info_off, 3 * nb, "info")?,
            int(self.q, "Q")?,
            int(nh, "nh")?,
            int(nkv, "nkv")?,
            int(d, "d")?,
            int(cfg.sliding_window, "W")?,
            Arg::F((d as f64).powf(-0.5) as f32),
            int(r, "R")?,
        ];
        // SAFETY: o, qkv, this layer's 2 * region pages, slots [B, s_max], info [B, 3]
        // checked; every slot < num_blocks * bs (DraftGroup::locate), S <= s_max.
        unsafe {
            ops::launch(
                self.g,
                "df2_attention",
                attention_shape(r, nh, nkv, d)?,
                &args,
            )
        }
    }
}

impl Drafter for CudaDFlash2 {
    fn propose(&mut self, ctx: &mut ProposeCtx<'_>) -> speclab_engine::Result<Proposal> {
        speclab_engine::propose_one(self, ctx).unwrap_or_else(|| {
            Err(EngineError::InvalidDrafterConfig {
                drafter: "dflash2".into(),
                reason: "the DFlash2 drafter needs the target pass (ProposeCtx::target) for its features".into(),
            })
        })
    }

    fn lookahead_slots(&self) -> usize {
        DrafterKind::Dflash2.lookahead(self.num_speculative_tokens)
    }

    fn layer_hidden(&self) -> LayerHidden {
        LayerHidden::Device
    }

    fn release(&mut self, slot: ReqSlot) {
        self.ctx_len.remove(&slot);
    }

    fn propose_batch(
        &mut self,
        step: &mut DraftStep<'_>,
        reqs: &mut [DraftReq<'_>],
    ) -> speclab_engine::Result<Vec<Proposal>> {
        self.grp.check_manager(step.kv)?;
        let be = crate::seam::cuda_backend(&mut *step.backend, "the CUDA DFlash2 drafter")
            .map_err(engine)?;
        if self.dev.is_none() {
            self.dev = Some(DevDraft::upload(&be.gpu, &self.w, &self.grp).map_err(engine)?);
            // From the next forward on only the feature layers are copied (the first,
            // a prefill, kept every layer).
            let ids = &self.w.cfg.dflash_config.target_layer_ids;
            if ids.iter().all(|&i| i + 1 < 64) {
                be.keep_hidden_layers(ids.iter().fold(0u64, |m, &i| m | 1u64 << (i + 1)));
            }
        }
        let appends: Vec<AppendReq> = reqs
            .iter()
            .map(|r| AppendReq {
                slot: r.slot,
                rows: r.rows.clone(),
                start_pos: r.start_pos,
            })
            .collect();
        let append = self
            .plan_append_step(step.kv, &appends, step.forward.num_tokens)
            .map_err(engine)?;
        let temperature = if step.sampling.is_greedy() {
            0.0
        } else {
            step.sampling.temperature
        };
        let n_reqs = reqs.len();
        let mut idx = Vec::new();
        let mut anchors = Vec::new();
        let mut rngs: Vec<Option<&mut dyn RngCore>> = Vec::new();
        for (i, r) in reqs.iter_mut().enumerate() {
            let want = r.max_draft.min(self.num_speculative_tokens);
            if want == 0 {
                continue;
            }
            idx.push((i, want));
            anchors.push(DraftAnchor {
                slot: r.slot,
                anchor: r.tokens.last().copied().unwrap_or(0),
                num_tokens: r.tokens.len(),
            });
            rngs.push(r.rng.as_mut().map(|g| &mut **g as &mut dyn RngCore));
        }
        let mut out = vec![Proposal::default(); n_reqs];
        if anchors.is_empty() {
            self.append_eager(be, &append).map_err(engine)?;
            return Ok(out);
        }
        let props = self
            .draft(be, step.kv, append, &anchors, temperature, &mut rngs)
            .map_err(engine)?;
        for ((i, want), mut p) in idx.into_iter().zip(props) {
            p.tokens.truncate(want);
            if let Some(q) = p.probs.as_mut() {
                q.truncate(want);
            }
            out[i] = p;
        }
        Ok(out)
    }
}

/// A [`DrafterSpec`] whose DFlash and MTP drafters run on the CUDA device (`--device
/// cuda`: [`CudaDFlash2`], [`crate::mtp::CudaMtp`]); every other kind is the spec's own
/// drafter.
#[derive(Debug, Clone)]
pub struct CudaDrafterSpec<'a>(pub &'a DrafterSpec);

impl DrafterFactory for CudaDrafterSpec<'_> {
    fn num_speculative_tokens(&self) -> usize {
        self.0.num_speculative_tokens()
    }
    fn kv_groups(&self) -> speclab_engine::Result<Vec<GroupSpec>> {
        self.0.kv_groups()
    }
    fn build(
        &self,
        target: &ModelConfig,
        kv: &KvCacheManager,
    ) -> speclab_engine::Result<Box<dyn Drafter>> {
        let s = &self.0;
        match (s.kind, &s.dflash) {
            (DrafterKind::Dflash2 | DrafterKind::Dflash1, Some(w)) => {
                let mode = if s.kind == DrafterKind::Dflash2 {
                    DraftMode::V2
                } else {
                    DraftMode::V1
                };
                Ok(Box::new(CudaDFlash2::new(
                    w.clone(),
                    target,
                    kv,
                    s.num_speculative_tokens,
                    mode,
                )?))
            }
            (DrafterKind::Mtp, _) => Ok(Box::new(crate::mtp::CudaMtp::new(
                target,
                s.num_speculative_tokens,
            )?)),
            _ => s.build(target, kv),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use speclab_drafters::DFlash2Config;
    use speclab_engine::kv::CapPolicy;
    use speclab_engine::model::{ModelRunner, ModelWeights};

    #[test]
    fn a_padded_append_keeps_its_rows_and_skips_the_padding() {
        let cfg = DFlash2Config::preset("dflash2-micro").unwrap();
        let mut p = AppendPlan {
            rows: vec![5, 6],
            pos: vec![40, 41],
            slot: vec![100, 101],
            new_len: vec![(ReqSlot(0), 42)],
        };
        pad_append(&mut p, 5);
        assert_eq!(p.rows, [5, 6, 0, 0, 0]);
        assert_eq!(p.pos, [40, 41, 0, 0, 0]);
        assert_eq!(p.slot, [100, 101, -1, -1, -1]);
        let m = append_meta(&cfg, &p);
        let layers = cfg.dflash_config.target_layer_ids.len();
        assert_eq!(m.len(), 15 + layers);
        // rows, positions, slots, then the feature layers' per-layer slots (id + 1).
        assert_eq!(&m[10..15], &[100, 101, -1, -1, -1]);
        let ids: Vec<i32> = cfg
            .dflash_config
            .target_layer_ids
            .iter()
            .map(|&i| i as i32 + 1)
            .collect();
        assert_eq!(&m[15..], &ids[..]);
    }

    fn setup() -> (ModelWeights, DFlash2Weights, KvCacheManager) {
        let tcfg = ModelConfig::micro();
        let target = ModelWeights::random(&tcfg, 3, false).unwrap();
        let dcfg = DFlash2Config::preset("dflash2-micro").unwrap();
        let mut layout = tcfg.kv_layout(16, 7, 32).unwrap();
        layout
            .groups
            .push(dcfg.kv_group(8, CapPolicy::WindowPlusTwo).unwrap());
        let kv = KvCacheManager::new(&layout, 32).unwrap();
        (target, DFlash2Weights::random(&dcfg, 7).unwrap(), kv)
    }

    #[test]
    fn checks_like_the_host_drafter_and_refuses_a_host_backend() {
        let (target, w, kv) = setup();
        let cfg = target.cfg.clone();
        // N beyond the block, and v2 on a v1-only checkpoint, are refused at build time.
        assert!(CudaDFlash2::new(w.clone(), &cfg, &kv, 99, DraftMode::V2).is_err());
        let mut v1_only = w.clone();
        v1_only.selector = None;
        let e = CudaDFlash2::new(v1_only, &cfg, &kv, 7, DraftMode::V2).unwrap_err();
        assert!(e.to_string().contains("v1-only"), "{e}");
        let mut d = CudaDFlash2::new(w, &cfg, &kv, 7, DraftMode::V2).unwrap();
        assert_eq!(d.layer_hidden(), LayerHidden::Device);
        assert_eq!(d.lookahead_slots(), 8);
        // Beside the CPU backend it is a clear error, not a panic or a silent host run.
        let mut cpu = ModelRunner::new(target, &kv).unwrap();
        let e = crate::seam::host_propose_error(&mut d, &mut cpu, &kv);
        assert!(e.contains("CUDA target backend"), "{e}");
    }

    #[test]
    fn the_factory_puts_only_dflash_kinds_on_the_device() {
        let (target, w, kv) = setup();
        let cfg = &target.cfg;
        let spec =
            DrafterSpec::dflash(w, cfg, 7, DraftMode::V2, 8, CapPolicy::WindowPlusTwo).unwrap();
        let dev = CudaDrafterSpec(&spec);
        assert_eq!(dev.num_speculative_tokens(), 7);
        assert_eq!(dev.kv_groups().unwrap(), spec.kv_groups().unwrap());
        let d = dev.build(cfg, &kv).unwrap();
        assert_eq!(d.layer_hidden(), LayerHidden::Device);
        let mtp_spec = DrafterSpec::mtp(cfg, 2).unwrap();
        let mtp = CudaDrafterSpec(&mtp_spec);
        let m = mtp.build(cfg, &kv).unwrap();
        assert_eq!(m.layer_hidden(), LayerHidden::FinalOnDevice);
        assert_eq!(
            m.lookahead_slots(),
            mtp_spec.build(cfg, &kv).unwrap().lookahead_slots()
        );
        let ngram_spec = DrafterSpec::ngram(2, 1, 3).unwrap();
        let ngram = CudaDrafterSpec(&ngram_spec);
        assert_eq!(
            ngram.build(cfg, &kv).unwrap().layer_hidden(),
            LayerHidden::None
        );
        // The attention kernel's limits are checked up front.
        assert!(attention_shape(8, 64, 1, 64).is_err());
        assert!(attention_shape(8, 4, 2, 48).is_err());
        assert!(attention_shape(8, 4, 2, 64).is_ok());
    }
}
