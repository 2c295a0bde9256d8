//! The kernel sequence of one step (target forward or MTP), launches only.
//!
//! Source: docs/model.md §2 (embedding, pre-norm decoder layers with residual adds,
//! final norm, lm_head), §3 (attention), §4 (KDA), §5 (dense MLP, MoE + shared expert),
//! §6 (MTP: enorm / hnorm / eh_proj, one decoder layer, shared_head.norm, lm_head);
//! engine/src/model/forward.rs `decoder_layer` (the same op order: x += mixer(norm(x)),
//! x += ffn(norm(x))).
//!
//! Invariants: nothing here allocates, synchronizes or copies to the host, so the whole
//! sequence can be captured into a CUDA graph; every scalar argument is a function of
//! (T, S, the model), and everything that varies between steps of the same shape is
//! read from the metadata buffer. The residual adds are fused into the o_proj / down
//! GEMMs (`accumulate`) and the MoE combine, each a single `x + f` as on the CPU.

use speclab_engine::model::LayerKind;

use crate::backend::CudaBackend;
use crate::error::{CudaError, Result};
use crate::meta::StepMeta;
use crate::ops::{self, Arg, Mat};
use crate::weights::{DevExperts, DevFfn, DevLayer, DevMixer, DevMlp, DevMoe};

/// What to record besides the outputs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Collect {
    /// The residual stream after the embedding and each layer.
    pub hidden: bool,
    /// Each MoE layer's selected experts and weights.
    pub router: bool,
    /// With `hidden`: the per-layer slots to fill, bit `l` for slot `l` (0 = the
    /// embeddings), slots from 64 always; `0` = all (a host caller reads every layer; a
    /// device drafter names the layers it reads, `CudaBackend::keep_hidden_layers`).
    pub hidden_mask: u64,
}

/// Which step to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepKind {
    /// The target model; `argmax` adds the on-device greedy pick of each logits row.
    Target {
        last_rows: bool,
        collect: Collect,
        argmax: bool,
    },
    /// The MTP layer (its hidden rows are in `Workspace::tmp`); `argmax` as for `Target`.
    Mtp {
        last_rows: bool,
        collect: Collect,
        argmax: bool,
    },
}

/// Pointers to the metadata sections of a step.
#[derive(Clone, Copy)]
pub(crate) struct MetaArgs {
    tokens: Arg,
    pos: Arg,
    tok_seq: Arg,
    tables: Arg,
    row0: Arg,
    len: Arg,
    pos0: Arg,
    snap: Arg,
    state_tables: Arg,
    last_rows: Arg,
}

/// Where a layer's cache lives.
#[derive(Clone, Copy)]
enum Cache {
    Attn(usize),
    Kda(usize),
}

/// Per-step values every layer needs.
struct Ctx<'m> {
    m: &'m StepMeta,
    ma: MetaArgs,
    t: usize,
    collect: Collect,
    /// The longest chunk's tokens and whether any chunk takes snapshots (the prefill
    /// kernels' choice, host copies of the metadata read once a step).
    max_len: usize,
    snapshots: bool,
}

impl CudaBackend {
    fn meta_args(&self, m: &StepMeta) -> Result<MetaArgs> {
        let l = &m.layout;
        let p =
            |s: crate::meta::Section, what: &str| ops::ptr(&self.meta, m.base + s.off, s.len, what);
        Ok(MetaArgs {
            tokens: p(l.tokens, "meta tokens")?,
            pos: p(l.pos, "meta pos")?,
            tok_seq: p(l.tok_seq, "meta tok_seq")?,
            tables: p(l.block_tables, "meta block tables")?,
            row0: p(l.row0, "meta row0")?,
            len: p(l.len, "meta len")?,
            pos0: p(l.pos0, "meta pos0")?,
            snap: p(l.snap, "meta snap")?,
            state_tables: p(l.state_tables, "meta state tables")?,
            last_rows: p(l.last_rows, "meta last rows")?,
        })
    }

    /// Launch the kernels of one step (no host synchronization).
    pub(crate) fn run(&self, m: &StepMeta, kind: StepKind) -> Result<()> {
        let cfg = &self.w.cfg;
        let (h, t) = (cfg.hidden_size, m.t_total);
        let collect = match kind {
            StepKind::Target { collect, .. } | StepKind::Mtp { collect, .. } => collect,
        };
        let cx = Ctx {
            m,
            ma: self.meta_args(m)?,
            t,
            collect,
            max_len: m.max_len(),
            snapshots: m.any_snapshot(),
        };
        let g = &self.gpu;
        let ws = &self.ws;
        match kind {
            StepKind::Target {
                last_rows, argmax, ..
            } => {
                ops::embed(g, &ws.x, &self.w.embed, cx.ma.tokens, t, h, cfg.vocab_size)?;
                self.snap_hidden(&cx, 0)?;
                let (mut ai, mut ki, mut moe) = (0, 0, 0);
                for (i, layer) in self.w.layers.iter().enumerate() {
                    let cache = match cfg.layer_kind(i) {
                        LayerKind::FullAttention => {
                            ai += 1;
                            Cache::Attn(ai - 1)
                        }
                        LayerKind::Kda => {
                            ki += 1;
                            Cache::Kda(ki - 1)
                        }
                    };
                    self.layer(&cx, layer, cache, &mut moe)?;
                    self.snap_hidden(&cx, i + 1)?;
                }
                let gathered = self.final_norm(&cx, &self.w.norm, last_rows)?;
                self.head(&cx, last_rows, argmax, gathered)
            }
            StepKind::Mtp {
                last_rows, argmax, ..
            } => self.mtp(&cx, last_rows, argmax),
        }
    }

    /// Copy the residual stream into slot `l` of the per-layer buffer (collect_hidden).
    fn snap_hidden(&self, cx: &Ctx<'_>, l: usize) -> Result<()> {
        let mask = cx.collect.hidden_mask;
        let wanted = mask == 0 || l >= 64 || mask & (1u64 << l) != 0;
        match (&self.per_layer, cx.collect.hidden && wanted) {
            (Some(p), true) => {
                let h = self.w.cfg.hidden_size;
                ops::copy(&self.gpu, p, l * self.ws.t_cap * h, &self.ws.x, 0, cx.t * h)
            }
            _ => Ok(()),
        }
    }

    /// `ws.hidden` = rmsnorm(`ws.x`, `w`). When only each chunk's last row goes to the head
    /// and every chunk is one row (a decode step), the row gather is the identity: the norm
    /// also writes `ws.tmp` (`rmsnorm_dup`, unless `SPECLAB_FINAL_DUP=0`) and returns true.
    fn final_norm(
        &self,
        cx: &Ctx<'_>,
        w: &crate::buf::DevBuf<f32>,
        last_rows: bool,
    ) -> Result<bool> {
        let cfg = &self.w.cfg;
        let (h, t, eps) = (cfg.hidden_size, cx.t, cfg.rms_norm_eps as f32);
        let (g, ws) = (&self.gpu, &self.ws);
        let dup = g.final_dup && last_rows && t == cx.m.num_seqs;
        if dup {
            ops::rmsnorm_dup(g, [&ws.hidden, &ws.tmp], Mat::rows(&ws.x, h), w, t, h, eps)?;
        } else {
            ops::rmsnorm(
                g,
                Mat::rows(&ws.hidden, h),
                Mat::rows(&ws.x, h),
                w,
                t,
                h,
                eps,
            )?;
        }
        Ok(dup)
    }

    /// lm_head over every row of `ws.hidden`, or over each chunk's last row (in `ws.tmp`,
    /// gathered here unless `gathered`); then argmax.
    fn head(&self, cx: &Ctx<'_>, last_rows: bool, argmax: bool, gathered: bool) -> Result<()> {
        let (h, v) = (self.w.cfg.hidden_size, self.w.cfg.vocab_size);
        let (g, ws) = (&self.gpu, &self.ws);
        let (src, rows) = if last_rows && gathered {
            (&ws.tmp, cx.m.num_seqs)
        } else if last_rows {
            ops::gather_rows(
                g,
                &ws.tmp,
                &ws.hidden,
                cx.t,
                cx.ma.last_rows,
                cx.m.num_seqs,
                h,
            )?;
            (&ws.tmp, cx.m.num_seqs)
        } else {
            (&ws.hidden, cx.t)
        };
        ops::linear(
            g,
            &ops::Linear {
                y: Mat::rows(&ws.logits, v),
                x: Mat::rows(src, h),
                w: &self.w.lm_head,
                m: rows,
                n: v,
                k: h,
                accumulate: false,
            },
        )?;
        if argmax {
            ops::argmax(g, &ws.argmax, &ws.logits, rows, v)?;
        }
        Ok(())
    }

    /// The MTP step: x = eh_proj([enorm(embed(next)), hnorm(h)]), one decoder layer, head.
    fn mtp(&self, cx: &Ctx<'_>, last_rows: bool, argmax: bool) -> Result<()> {
        let cfg = &self.w.cfg;
        let (h, t, eps) = (cfg.hidden_size, cx.t, cfg.rms_norm_eps as f32);
        let mtp = self
            .w
            .mtp
            .as_ref()
            .ok_or_else(|| CudaError::Input("no MTP layer".into()))?;
        let (g, ws) = (&self.gpu, &self.ws);
        let cat = Mat::rows(&ws.proj, 2 * h);
        if g.fuse_mtp_in {
            ops::mtp_in_norm(
                g,
                &ops::MtpIn {
                    out: cat,
                    table: &self.w.embed,
                    tokens: cx.ma.tokens,
                    h: Mat::rows(&ws.tmp, h),
                    we: &mtp.enorm,
                    wh: &mtp.hnorm,
                    t,
                    d: h,
                    vocab: cfg.vocab_size,
                    eps,
                },
            )?;
        } else {
            ops::embed(g, &ws.a, &self.w.embed, cx.ma.tokens, t, h, cfg.vocab_size)?;
            ops::rmsnorm(g, cat, Mat::rows(&ws.a, h), &mtp.enorm, t, h, eps)?;
            ops::rmsnorm(g, cat.col(h), Mat::rows(&ws.tmp, h), &mtp.hnorm, t, h, eps)?;
        }
        ops::linear(
            g,
            &ops::Linear {
                y: Mat::rows(&ws.x, h),
                x: cat,
                w: &mtp.eh_proj,
                m: t,
                n: h,
                k: 2 * h,
                accumulate: false,
            },
        )?;
        let mut moe = 0;
        self.layer(cx, &mtp.layer, Cache::Attn(cfg.num_full_layers()), &mut moe)?;
        let gathered = self.final_norm(cx, &mtp.head_norm, last_rows)?;
        self.head(cx, last_rows, argmax, gathered)
    }

    /// One decoder layer in place on `ws.x` (docs/model.md §2 body).
    fn layer(&self, cx: &Ctx<'_>, layer: &DevLayer, cache: Cache, moe: &mut usize) -> Result<()> {
        let cfg = &self.w.cfg;
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps as f32);
        let (g, ws) = (&self.gpu, &self.ws);
        // The input norm is fused into the mixer's first projection (its only consumer).
        match (&layer.mixer, cache) {
            (DevMixer::Full(w), Cache::Attn(a)) => {
                let qkv_w = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim;
                let o_w = cfg.num_attention_heads * cfg.head_dim;
                ops::linear_norm(
                    g,
                    &ops::Linear {
                        y: Mat::rows(&ws.proj, qkv_w),
                        x: Mat::rows(&ws.x, h),
                        w: &w.wqkv,
                        m: cx.t,
                        n: qkv_w,
                        k: h,
                        accumulate: false,
                    },
                    &layer.input_norm,
                    eps,
                )?;
                let paged = ops::Paged {
                    pool: &self.pool,
                    fpb: self.geo.floats_per_block,
                    layer_off: self.geo.attn_off(a),
                    block_size: self.geo.block_size,
                    pos: cx.ma.pos,
                    tok_seq: cx.ma.tok_seq,
                    tables: cx.ma.tables,
                    max_blocks: self.dims.max_blocks,
                    row0: cx.ma.row0,
                    len: cx.ma.len,
                    num_seqs: cx.m.num_seqs,
                    max_len: cx.max_len,
                };
                let att = ops::Attention {
                    qkv: &ws.proj,
                    o: &ws.mix,
                    cos: &self.w.rope_cos,
                    sin: &self.w.rope_sin,
                    max_pos: cfg.max_position_embeddings,
                    t: cx.t,
                    nh: cfg.num_attention_heads,
                    nkv: cfg.num_key_value_heads,
                    d: cfg.head_dim,
                };
                ops::attention(g, &paged, &att)?;
                ops::linear(
                    g,
                    &ops::Linear {
                        y: Mat::rows(&ws.x, h),
                        x: Mat::rows(&ws.mix, o_w),
                        w: &w.wo,
                        m: cx.t,
                        n: h,
                        k: o_w,
                        accumulate: true,
                    },
                )?;
            }
            (DevMixer::Kda(w), Cache::Kda(l)) => self.kda_mixer(cx, w, l, &layer.input_norm)?,
            _ => {
                return Err(CudaError::Input(
                    "mixer and cache kind disagree (internal)".into(),
                ))
            }
        }
        // The post-attention norm is fused into the MoE router when it can be.
        let fused = match &layer.ffn {
            DevFfn::Moe(_) => self.router_fuses_norm(),
            DevFfn::Dense(_) => false,
        };
        if !fused {
            ops::rmsnorm(
                g,
                Mat::rows(&ws.a, h),
                Mat::rows(&ws.x, h),
                &layer.post_norm,
                cx.t,
                h,
                eps,
            )?;
        }
        match &layer.ffn {
            DevFfn::Dense(m) => self.dense_mlp(cx.t, m, &ws.x, true, false),
            DevFfn::Moe(m) => {
                self.moe(cx, m, *moe, fused.then_some(&layer.post_norm))?;
                *moe += 1;
                Ok(())
            }
        }
    }

    /// KDA mixer: stacked input GEMM, f / g low-rank GEMMs, conv, recurrence, gated norm, o_proj.
    fn kda_mixer(
        &self,
        cx: &Ctx<'_>,
        w: &crate::weights::DevKda,
        l: usize,
        input_norm: &crate::buf::DevBuf<f32>,
    ) -> Result<()> {
        let cfg = &self.w.cfg;
        let (h, t) = (cfg.hidden_size, cx.t);
        let (nl, dl) = (cfg.linear_num_heads, cfg.linear_head_dim);
        let c = nl * dl;
        let (g, ws) = (&self.gpu, &self.ws);
        let xin = Mat::rows(&ws.proj, w.in_width);
        ops::linear_norm(
            g,
            &ops::Linear {
                y: xin,
                x: Mat::rows(&ws.x, h),
                w: &w.w_in,
                m: t,
                n: w.in_width,
                k: h,
                accumulate: false,
            },
            input_norm,
            cfg.rms_norm_eps as f32,
        )?;
        let fg = Mat::rows(&ws.fg, 2 * c);
        // Decode and verify steps: the fused / pair KDA kernels do the f / g
        // up-projections themselves.
        let lowrank =
            g.fuse_kda_lowrank && ops::kda_path(g, t, cx.m.num_seqs) != ops::KdaPath::Split;
        if !lowrank {
            ops::linear_pair(
                g,
                &ops::Linear {
                    y: fg,
                    x: xin.col(3 * c),
                    w: &w.w_fb,
                    m: t,
                    n: c,
                    k: dl,
                    accumulate: false,
                },
                &ops::Linear {
                    y: fg.col(c),
                    x: xin.col(3 * c + dl),
                    w: &w.w_gb,
                    m: t,
                    n: c,
                    k: dl,
                    accumulate: false,
                },
            )?;
        }
        let pages = ops::StatePages {
            pool: &self.pool,
            fpb: self.geo.floats_per_block,
            layer_off: self.geo.state_off(l),
            conv_len: self.geo.conv_len,
            row0: cx.ma.row0,
            len: cx.ma.len,
            pos0: cx.ma.pos0,
            snap: cx.ma.snap,
            tables: cx.ma.state_tables,
            max_state: self.dims.max_state,
            num_seqs: cx.m.num_seqs,
            max_len: cx.max_len,
            snapshots: cx.snapshots,
        };
        let k = ops::Kda {
            xin: &ws.proj,
            in_width: w.in_width,
            b_col: 3 * c + 2 * dl,
            y: &ws.conv_y,
            fg: &ws.fg,
            o: &ws.mix,
            out: &ws.kda_out,
            ck: &ws.kda_chunk,
            taps: &w.taps,
            a_log: &w.a_log,
            dt_bias: &w.dt_bias,
            o_norm: &w.o_norm,
            t,
            nl,
            dl,
            kc: cfg.linear_conv_kernel_dim,
            eps: cfg.rms_norm_eps as f32,
            lowrank: lowrank.then_some((&w.w_fb, &w.w_gb, 3 * c)),
        };
        ops::kda(g, &pages, &k)?;
        ops::linear(
            g,
            &ops::Linear {
                y: Mat::rows(&ws.x, h),
                x: Mat::rows(&ws.kda_out, c),
                w: &w.wo,
                m: t,
                n: h,
                k: c,
                accumulate: true,
            },
        )
    }

    /// The MLP's first GEMM: `ws.h_dense` = SwiGLU(`ws.a` @ W13^T) of `m`.
    fn mlp_swiglu<'s>(&'s self, t: usize, m: &'s DevMlp) -> ops::Swiglu<'s> {
        ops::Swiglu {
            h: &self.ws.h_dense,
            x: Mat::rows(&self.ws.a, self.w.cfg.hidden_size),
            w13: &m.w13,
            m: t,
            n: m.inter,
            k: self.w.cfg.hidden_size,
        }
    }

    /// Dense SwiGLU of `ws.a` into `out` (`accumulate`: out += mlp, else out = mlp);
    /// `hidden_ready`: `ws.h_dense` already holds the first GEMM's output.
    fn dense_mlp(
        &self,
        t: usize,
        m: &DevMlp,
        out: &crate::buf::DevBuf<f32>,
        accumulate: bool,
        hidden_ready: bool,
    ) -> Result<()> {
        let h = self.w.cfg.hidden_size;
        let (g, ws) = (&self.gpu, &self.ws);
        if !hidden_ready {
            ops::swiglu(g, &self.mlp_swiglu(t, m))?;
        }
        ops::linear(
            g,
            &ops::Linear {
                y: Mat::rows(out, h),
                x: Mat::rows(&ws.h_dense, m.inter),
                w: &m.wd,
                m: t,
                n: h,
                k: m.inter,
                accumulate,
            },
        )
    }

    /// Whether the fused router kernel also applies the post-attention norm
    /// (`SPECLAB_ROUTER_NORM=0` turns it off: [`crate::device::Gpu::fuse_router_norm`]).
    fn router_fuses_norm(&self) -> bool {
        let cfg = &self.w.cfg;
        self.gpu.fuse_router_norm
            && cfg.n_routed_experts <= ops::ROUTER_FUSED_E_MAX
            && cfg.hidden_size <= ops::ROUTER_NORM_K_MAX
    }

    /// MoE of `ws.a` added into `ws.x`: route, experts, shared expert, combine. With
    /// `post_norm` the router kernel first writes `ws.a` = rmsnorm(`ws.x`).
    fn moe(
        &self,
        cx: &Ctx<'_>,
        m: &DevMoe,
        j: usize,
        post_norm: Option<&crate::buf::DevBuf<f32>>,
    ) -> Result<()> {
        let cfg = &self.w.cfg;
        let (h, e, k, t) = (
            cfg.hidden_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            cx.t,
        );
        let (g, ws) = (&self.gpu, &self.ws);
        let r = ops::Routing {
            ids: &ws.ids,
            wts: &ws.wts,
            sorted: &ws.sorted,
            tile_expert: &ws.tile_expert,
            t,
            k,
            e,
            max_tiles: crate::launch::moe_max_tiles(t * k, e),
        };
        let (norm, rsf) = (cfg.norm_topk_prob, cfg.routed_scaling_factor as f32);
        // INT4 experts read a split copy of the input; the fused router writes it on the way.
        let int4 = matches!(m.experts, DevExperts::Int4 { .. });
        let fused_split = int4 && e <= ops::ROUTER_FUSED_E_MAX;
        if e <= ops::ROUTER_FUSED_E_MAX {
            let rt = ops::Router {
                x: &ws.a,
                w: &m.router,
                k_dim: h,
                logits: &ws.router_logits,
                bias: &m.bias,
                xs: fused_split.then_some(&ws.xs_moe),
                norm: post_norm.map(|w| (&ws.x, w, cfg.rms_norm_eps as f32)),
                ticket: g.fuse_router_align.then_some(&ws.route_ticket),
                pre: g.router_pre,
            };
            ops::moe_route_fused(g, &r, &rt, norm, rsf)?;
        } else {
            ops::linear(
                g,
                &ops::Linear {
                    y: Mat::rows(&ws.router_logits, e),
                    x: Mat::rows(&ws.a, h),
                    w: &m.router,
                    m: t,
                    n: e,
                    k: h,
                    accumulate: false,
                },
            )?;
            ops::moe_route(g, &r, &ws.router_logits, &m.bias, norm, rsf)?;
        }
        if let (Some((ids, wts)), true) = (&self.router, cx.collect.router) {
            let off = j * ws.t_cap * k;
            ops::copy_words(g, ids, off, &ws.ids, 0, t * k)?;
            ops::copy(g, wts, off, &ws.wts, 0, t * k)?;
        }
        let w = match &m.experts {
            DevExperts::Int4 { q13, s13, qd, sd } => ops::ExpertPtrs::Int4 { q13, s13, qd, sd },
            DevExperts::Bf16 { w13, wd } => ops::ExpertPtrs::Bf16 { w13, wd },
        };
        // The shared expert's first GEMM rides on the INT4 gate/up launch (tiled GEMMs only).
        let merge = g.merges_shared(t, int4);
        let ex = ops::Experts {
            w,
            x: &ws.a,
            xs: &ws.xs_moe,
            input: if fused_split {
                // The router writes the split and the routing in the grid just before.
                ops::ExpertInput::Ready {
                    routing_settled: false,
                }
            } else {
                ops::ExpertInput::Split
            },
            h: &ws.h_moe,
            y: &ws.y_pairs,
            sync: &ws.moe_sync,
            hidden: h,
            inter: cfg.moe_intermediate_size,
            shared: merge.then(|| self.mlp_swiglu(t, &m.shared)),
        };
        ops::moe_experts(g, &r, &ex)?;
        if g.fuses_combine(t) {
            return self.shared_combine(t, &m.shared, &r, merge);
        }
        self.dense_mlp(t, &m.shared, &ws.shared_out, false, merge)?;
        ops::moe_combine(g, &r, &ws.x, &ws.y_pairs, &ws.shared_out, h)
    }

    /// The shared expert with the MoE combine fused into its down-projection:
    /// `ws.x += routed + shared(ws.a)` in two launches (swiglu, then
    /// `ops::linear_combine`), bit for bit `dense_mlp` into `ws.shared_out` + `moe_combine`;
    /// `hidden_ready`: the swiglu ran already (merged into the gate/up launch).
    fn shared_combine(
        &self,
        t: usize,
        m: &DevMlp,
        r: &ops::Routing<'_>,
        hidden_ready: bool,
    ) -> Result<()> {
        let h = self.w.cfg.hidden_size;
        let (g, ws) = (&self.gpu, &self.ws);
        if !hidden_ready {
            ops::swiglu(g, &self.mlp_swiglu(t, m))?;
        }
        let down = ops::Linear {
            y: Mat::rows(&ws.x, h),
            x: Mat::rows(&ws.h_dense, m.inter),
            w: &m.wd,
            m: t,
            n: h,
            k: m.inter,
            accumulate: false,
        };
        // Merged, the hidden came from the gate/up launch with the down-projection between.
        ops::linear_combine(g, &down, r, &ws.y_pairs, hidden_ready)
    }
}
