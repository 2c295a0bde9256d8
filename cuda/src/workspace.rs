//! Activation buffers of a step, sized once for a token / chunk capacity.
//!
//! Design: every intermediate of the forward pass has a fixed device buffer sized for
//! `t_cap` tokens and `s_cap` chunks ([`Sizes`], pure and tested), so a step allocates
//! nothing and its kernels see the same addresses every time: the precondition of CUDA
//! graph capture and replay. A larger batch grows the workspace (powers of two) between
//! steps, which invalidates captured graphs (the backend drops them).
//!
//! Invariants: each buffer holds at least the elements its comment states for `t_cap`
//! tokens (`p = t_cap * k` routed pairs); kernels are launched only with `T <= t_cap`,
//! `S <= s_cap`.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use speclab_engine::model::ModelConfig;

use crate::buf::DevBuf;
use crate::error::Result;
use crate::launch::moe_max_tiles;
use crate::weights::kda_in_width;

/// Row widths of the workspace buffers for a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    pub hidden: usize,
    pub vocab: usize,
    /// Widest stacked input projection: max((nh + 2 nkv) d, KDA in_width, 2H).
    pub proj: usize,
    /// Widest mixer output: max(nh d, C).
    pub mix: usize,
    /// KDA channels C.
    pub c: usize,
    /// Widest dense intermediate: max(intermediate_size, shared expert's).
    pub dense_inter: usize,
    pub moe_inter: usize,
    pub experts: usize,
    pub topk: usize,
    /// KDA heads and head dim (0, 0 without KDA layers).
    pub kda_heads: usize,
    pub kda_dl: usize,
}

impl Sizes {
    /// The widths of `cfg`.
    pub fn new(cfg: &ModelConfig) -> Self {
        let att = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim;
        let c = cfg.kda_channels();
        Self {
            hidden: cfg.hidden_size,
            vocab: cfg.vocab_size,
            proj: att.max(kda_in_width(cfg)).max(2 * cfg.hidden_size),
            mix: (cfg.num_attention_heads * cfg.head_dim).max(c),
            c,
            dense_inter: cfg
                .intermediate_size
                .max(cfg.moe_intermediate_size * cfg.n_shared_experts),
            moe_inter: cfg.moe_intermediate_size,
            experts: cfg.n_routed_experts.max(1),
            topk: cfg.num_experts_per_tok.max(1),
            kda_heads: if c > 0 { cfg.linear_num_heads } else { 0 },
            kda_dl: if c > 0 { cfg.linear_head_dim } else { 0 },
        }
    }

    /// Floats of the chunked-KDA workspace for `t` tokens in `s` spans
    /// ([`crate::kda_chunk`]: one slot a chunk, heads x `chunk_floats` a slot; at least 1).
    pub fn kda_chunk_floats(&self, t: usize, s: usize) -> usize {
        if self.kda_heads == 0 {
            return 1;
        }
        let dl = self.kda_dl;
        crate::kda_chunk::slot_count(t, s, dl) * self.kda_heads * crate::kda_chunk::chunk_floats(dl)
    }
}

/// The step buffers.
pub struct Workspace {
    pub t_cap: usize,
    pub s_cap: usize,
    /// MoE tiles for t_cap * k pairs.
    pub max_tiles: usize,
    /// Residual stream. Shape: [t_cap, H].
    pub x: DevBuf<f32>,
    /// Normed input of a block. Shape: [t_cap, H].
    pub a: DevBuf<f32>,
    /// Stacked projections. Shape: [t_cap, proj].
    pub proj: DevBuf<f32>,
    /// Mixer output before o_proj. Shape: [t_cap, mix].
    pub mix: DevBuf<f32>,
    /// KDA post-conv q|k|v. Shape: [t_cap, 3C].
    pub conv_y: DevBuf<f32>,
    /// KDA f then g. Shape: [t_cap, 2C].
    pub fg: DevBuf<f32>,
    /// KDA gated-norm output. Shape: [t_cap, C].
    pub kda_out: DevBuf<f32>,
    /// Dense / shared SwiGLU intermediate. Shape: [t_cap, dense_inter].
    pub h_dense: DevBuf<f32>,
    /// Routed SwiGLU intermediate. Shape: [t_cap * k, moe_inter * W4_XS_MAX / 2] (f32 for bf16 experts; INT4: split bf16 words, linear.cu `w4_h_word`).
    pub h_moe: DevBuf<f32>,
    /// The routed experts' split input (INT4, `moe_split_x`). Shape: [t_cap, H * W4_XS_MAX / 2].
    pub xs_moe: DevBuf<f32>,
    /// Router-weighted expert outputs. Shape: [t_cap * k, H].
    pub y_pairs: DevBuf<f32>,
    /// Shared expert output. Shape: [t_cap, H].
    pub shared_out: DevBuf<f32>,
    /// Router logits. Shape: [t_cap, E].
    pub router_logits: DevBuf<f32>,
    /// Selected experts. Shape: [t_cap * k].
    pub ids: DevBuf<i32>,
    /// Router weights. Shape: [t_cap * k].
    pub wts: DevBuf<f32>,
    /// Pairs sorted by expert. Shape: [8 * max_tiles].
    pub sorted: DevBuf<i32>,
    /// Expert of each tile, then the count of tiles used. Shape: [max_tiles + 1].
    pub tile_expert: DevBuf<i32>,
    /// Counters of the fused INT4 experts kernel, zero between launches (allocated zeroed;
    /// the kernel's last block resets them). Shape: [MOE_SYNC_FIXED + max_tiles].
    pub moe_sync: DevBuf<i32>,
    /// The fused router's ticket (ops::Router::ticket): zero between launches (allocated
    /// zeroed; the router's last block resets it). Shape: [1].
    pub route_ticket: DevBuf<i32>,
    /// Final hidden (post-norm, or the MTP head-norm output). Shape: [t_cap, H].
    pub hidden: DevBuf<f32>,
    /// Scratch rows (embeddings, last rows, MTP hidden input). Shape: [t_cap, H].
    pub tmp: DevBuf<f32>,
    /// Logits. Shape: [t_cap, V].
    pub logits: DevBuf<f32>,
    /// Greedy tokens. Shape: [t_cap].
    pub argmax: DevBuf<u32>,
    /// Chunked KDA prefill (kda.cu `kda_chunk_prep`): per chunk slot and head, `W`, `U~`,
    /// `Q~`, `K-` [BT, dl], `B` [BT, BT], `gamma` [dl]. Shape:
    /// [kda_chunk::slot_count(t_cap, s_cap), nl, kda_chunk::chunk_floats(dl)].
    pub kda_chunk: DevBuf<f32>,
}

impl Workspace {
    /// Buffers for `t_cap` tokens and `s_cap` chunks.
    pub fn new(stream: &Arc<CudaStream>, z: &Sizes, t_cap: usize, s_cap: usize) -> Result<Self> {
        let p = t_cap * z.topk;
        let max_tiles = moe_max_tiles(p, z.experts);
        let f = |n: usize, what: &str| DevBuf::<f32>::zeros(stream, n, what);
        let i = |n: usize, what: &str| DevBuf::<i32>::zeros(stream, n, what);
        Ok(Self {
            t_cap,
            s_cap,
            max_tiles,
            x: f(t_cap * z.hidden, "x")?,
            a: f(t_cap * z.hidden, "a")?,
            proj: f(t_cap * z.proj, "proj")?,
            mix: f(t_cap * z.mix, "mix")?,
            conv_y: f(t_cap * 3 * z.c, "conv_y")?,
            fg: f(t_cap * 2 * z.c, "fg")?,
            kda_out: f(t_cap * z.c, "kda_out")?,
            h_dense: f(t_cap * z.dense_inter, "h_dense")?,
            h_moe: f(p * z.moe_inter * crate::launch::W4_XS_MAX / 2, "h_moe")?,
            xs_moe: f(t_cap * z.hidden * crate::launch::W4_XS_MAX / 2, "xs_moe")?,
            y_pairs: f(p * z.hidden, "y_pairs")?,
            shared_out: f(t_cap * z.hidden, "shared_out")?,
            router_logits: f(t_cap * z.experts, "router_logits")?,
            ids: i(p, "ids")?,
            wts: f(p, "wts")?,
            sorted: i(8 * max_tiles, "sorted")?,
            tile_expert: i(max_tiles + 1, "tile_expert")?,
            moe_sync: i(crate::launch::MOE_SYNC_FIXED + max_tiles, "moe_sync")?,
            route_ticket: i(1, "route_ticket")?,
            hidden: f(t_cap * z.hidden, "hidden")?,
            tmp: f(t_cap * z.hidden, "tmp")?,
            logits: f(t_cap * z.vocab, "logits")?,
            argmax: DevBuf::<u32>::zeros(stream, t_cap, "argmax")?,
            kda_chunk: f(z.kda_chunk_floats(t_cap, s_cap), "kda_chunk")?,
        })
    }
}

/// Capacity for a batch of `t` tokens: the next power of two, at least 16.
pub fn grow_to(t: usize) -> usize {
    t.max(16).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sizes_of_tiny() {
        let z = Sizes::new(&ModelConfig::tiny());
        assert_eq!(z.hidden, 256);
        // KDA in: 3 * 256 + 2 * 64 + 4 = 900 -> 904; attention (4 + 4) * 64 = 512; 2H = 512.
        assert_eq!(z.proj, 904);
        assert_eq!(z.mix, 256);
        assert_eq!(z.dense_inter, 768);
        assert_eq!((z.experts, z.topk, z.moe_inter), (16, 2, 128));
        assert_eq!(grow_to(1), 16);
        assert_eq!(grow_to(33), 64);
        // 4 heads of 64: chunks of 32, 4 * 32 * 64 + 32 * 32 + 64 floats a head; 16 tokens
        // in 2 spans use at most 2 + 1 slots.
        assert_eq!((z.kda_heads, z.kda_dl), (4, 64));
        assert_eq!(z.kda_chunk_floats(16, 2), 3 * 4 * 9280);
    }
}
