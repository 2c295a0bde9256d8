//! The model's weights on the device, uploaded once (they never leave the device).
//!
//! Source: engine/src/model/weights.rs (the host `ModelWeights`, tensor by tensor), the
//! device layouts of `crate::repack` (bf16 bit patterns; INT4 routed experts repacked),
//! docs/model.md §3-§6 for which projections run on the same input and are therefore
//! stacked into one GEMM: full attention `[q; k; v]`, KDA `[q; k; v; f_a; g_a; b; 0-pad]`
//! (the padding makes the row width a multiple of 8 so the column offsets of `f_a`,
//! `g_a` stay 16-byte aligned).
//!
//! Invariants: every dense weight is bf16-exact (else an error naming it); small vectors
//! (norm weights, conv taps, `A_log`, `dt_bias`, router bias) are f32; RoPE tables cover
//! positions `0 .. max_position_embeddings` and are computed by the CPU engine's own
//! `rope_tables` (f64, rounded to f32), so both engines use identical tables.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use speclab_engine::model::attention::rope_tables;
use speclab_engine::model::weights::{
    AttnWeights, Ffn, KdaWeights, LayerWeights, Mixer, Mlp, MoeWeights,
};
use speclab_engine::model::{Linear, ModelConfig, ModelWeights};

use crate::buf::DevBuf;
use crate::error::Result;
use crate::launch::round_up;
use crate::repack::{fuse_gate_up_bf16, repack_experts, stack_rows, to_bf16, Int4Experts};

/// Full attention projections.
pub struct DevAttn {
    /// Shape: [(nh + 2 nkv) d, H] bf16 (q rows, then k, then v).
    pub wqkv: DevBuf<u16>,
    /// Shape: [H, nh d] bf16.
    pub wo: DevBuf<u16>,
}

/// KDA weights.
pub struct DevKda {
    /// Shape: [in_width, H] bf16: q [C], k [C], v [C], f_a [dl], g_a [dl], b [nl], zero pad.
    pub w_in: DevBuf<u16>,
    /// Rows of `w_in` (3C + 2 dl + nl rounded up to 8).
    pub in_width: usize,
    /// Shape: [C, dl] bf16.
    pub w_fb: DevBuf<u16>,
    /// Shape: [C, dl] bf16.
    pub w_gb: DevBuf<u16>,
    /// Conv taps of q, k, v. Shape: [3C, kc] f32.
    pub taps: DevBuf<f32>,
    /// Shape: [nl] f32.
    pub a_log: DevBuf<f32>,
    /// Shape: [C] f32.
    pub dt_bias: DevBuf<f32>,
    /// Shape: [dl] f32.
    pub o_norm: DevBuf<f32>,
    /// Shape: [H, C] bf16.
    pub wo: DevBuf<u16>,
}

/// A token mixer.
pub enum DevMixer {
    Full(DevAttn),
    Kda(Box<DevKda>),
}

/// A dense SwiGLU (dense-prefix MLP or shared expert).
pub struct DevMlp {
    /// Shape: [I, 2, H] bf16 (gate row, up row per output column).
    pub w13: DevBuf<u16>,
    /// Shape: [H, I] bf16.
    pub wd: DevBuf<u16>,
    /// Intermediate size I.
    pub inter: usize,
}

/// Routed experts.
pub enum DevExperts {
    /// W4A16, repacked (crate::repack docs).
    Int4 {
        /// Shape: [E, Im, 2, H/8] u32.
        q13: DevBuf<u32>,
        /// Shape: [E, Im, 2, H/128] bf16.
        s13: DevBuf<u16>,
        /// Shape: [E, H, Im/8] u32.
        qd: DevBuf<u32>,
        /// Shape: [E, H, Im/128] bf16.
        sd: DevBuf<u16>,
    },
    /// bf16 (the MTP layer's MoE, bf16 checkpoints).
    Bf16 {
        /// Shape: [E, Im, 2, H] bf16.
        w13: DevBuf<u16>,
        /// Shape: [E, H, Im] bf16.
        wd: DevBuf<u16>,
    },
}

/// An MoE FFN.
pub struct DevMoe {
    /// Shape: [E, H] bf16.
    pub router: DevBuf<u16>,
    /// e_score_correction_bias. Shape: [E] f32.
    pub bias: DevBuf<f32>,
    pub experts: DevExperts,
    pub shared: DevMlp,
}

/// An FFN.
pub enum DevFfn {
    Dense(DevMlp),
    Moe(Box<DevMoe>),
}

/// One decoder layer.
pub struct DevLayer {
    /// Shape: [H] f32.
    pub input_norm: DevBuf<f32>,
    pub mixer: DevMixer,
    /// Shape: [H] f32.
    pub post_norm: DevBuf<f32>,
    pub ffn: DevFfn,
}

/// The MTP layer.
pub struct DevMtp {
    /// Shape: [H] f32.
    pub enorm: DevBuf<f32>,
    /// Shape: [H] f32.
    pub hnorm: DevBuf<f32>,
    /// Shape: [H, 2H] bf16.
    pub eh_proj: DevBuf<u16>,
    pub layer: DevLayer,
    /// Shape: [H] f32.
    pub head_norm: DevBuf<f32>,
}

/// Every weight of the model on the device.
pub struct DeviceWeights {
    pub cfg: ModelConfig,
    /// Shape: [V, H] bf16.
    pub embed: DevBuf<u16>,
    pub layers: Vec<DevLayer>,
    pub mtp: Option<DevMtp>,
    /// Shape: [H] f32.
    pub norm: DevBuf<f32>,
    /// Shape: [V, H] bf16.
    pub lm_head: DevBuf<u16>,
    /// RoPE cos. Shape: [max_position_embeddings, head_dim] f32.
    pub rope_cos: DevBuf<f32>,
    /// RoPE sin. Shape: [max_position_embeddings, head_dim] f32.
    pub rope_sin: DevBuf<f32>,
    /// Bytes uploaded.
    pub bytes: usize,
}

/// Upload helper that counts bytes.
struct Up<'a> {
    stream: &'a Arc<CudaStream>,
    bytes: usize,
}

impl Up<'_> {
    fn f32(&mut self, v: &[f32], what: &str) -> Result<DevBuf<f32>> {
        self.bytes += 4 * v.len();
        DevBuf::upload(self.stream, v, what)
    }
    fn u16(&mut self, v: &[u16], what: &str) -> Result<DevBuf<u16>> {
        self.bytes += 2 * v.len();
        DevBuf::upload(self.stream, v, what)
    }
    fn u32(&mut self, v: &[u32], what: &str) -> Result<DevBuf<u32>> {
        self.bytes += 4 * v.len();
        DevBuf::upload(self.stream, v, what)
    }
    fn linear(&mut self, l: &Linear, what: &str) -> Result<DevBuf<u16>> {
        let v = stack_rows(&[l], 0, what)?;
        self.u16(&v, what)
    }
}

fn attn(up: &mut Up<'_>, w: &AttnWeights, p: &str) -> Result<DevAttn> {
    let qkv = stack_rows(&[&w.q, &w.k, &w.v], 0, &format!("{p}.self_attn.qkv"))?;
    Ok(DevAttn {
        wqkv: up.u16(&qkv, p)?,
        wo: up.linear(&w.o, &format!("{p}.self_attn.o_proj"))?,
    })
}

/// Rows of the stacked KDA input projection: 3C + 2 dl + nl, rounded up to 8.
pub fn kda_in_width(cfg: &ModelConfig) -> usize {
    round_up(
        3 * cfg.kda_channels() + 2 * cfg.linear_head_dim + cfg.linear_num_heads,
        8,
    )
}

fn kda(up: &mut Up<'_>, w: &KdaWeights, cfg: &ModelConfig, p: &str) -> Result<DevKda> {
    let raw = 3 * cfg.kda_channels() + 2 * cfg.linear_head_dim + cfg.linear_num_heads;
    let width = kda_in_width(cfg);
    let w_in = stack_rows(
        &[&w.q, &w.k, &w.v, &w.f_a, &w.g_a, &w.b],
        width - raw,
        &format!("{p}.linear_attn.in"),
    )?;
    let mut taps = Vec::with_capacity(3 * cfg.kda_channels() * cfg.linear_conv_kernel_dim);
    for t in &w.conv {
        taps.extend_from_slice(t);
    }
    Ok(DevKda {
        w_in: up.u16(&w_in, p)?,
        in_width: width,
        w_fb: up.linear(&w.f_b, &format!("{p}.linear_attn.f_b_proj"))?,
        w_gb: up.linear(&w.g_b, &format!("{p}.linear_attn.g_b_proj"))?,
        taps: up.f32(&taps, p)?,
        a_log: up.f32(&w.a_log, p)?,
        dt_bias: up.f32(&w.dt_bias, p)?,
        o_norm: up.f32(&w.o_norm, p)?,
        wo: up.linear(&w.o, &format!("{p}.linear_attn.o_proj"))?,
    })
}

fn mlp(up: &mut Up<'_>, m: &Mlp, p: &str) -> Result<DevMlp> {
    Ok(DevMlp {
        w13: up.u16(&fuse_gate_up_bf16(&m.gate, &m.up, p)?, p)?,
        wd: up.linear(&m.down, &format!("{p}.down_proj"))?,
        inter: m.gate.out_features(),
    })
}

fn experts(up: &mut Up<'_>, m: &MoeWeights, p: &str) -> Result<DevExperts> {
    let quant = m
        .experts
        .iter()
        .map(|e| e.gate.is_quantized())
        .collect::<Vec<_>>();
    if quant.iter().all(|&q| q)
        && m.experts
            .iter()
            .all(|e| e.up.is_quantized() && e.down.is_quantized())
    {
        let gu: Vec<Vec<&Linear>> = m.experts.iter().map(|e| vec![&e.gate, &e.up]).collect();
        let dn: Vec<Vec<&Linear>> = m.experts.iter().map(|e| vec![&e.down]).collect();
        let a: Int4Experts = repack_experts(&gu, &format!("{p}.experts gate/up"))?;
        let b: Int4Experts = repack_experts(&dn, &format!("{p}.experts down"))?;
        return Ok(DevExperts::Int4 {
            q13: up.u32(&a.q, p)?,
            s13: up.u16(&a.s, p)?,
            qd: up.u32(&b.q, p)?,
            sd: up.u16(&b.s, p)?,
        });
    }
    let mut w13 = Vec::new();
    let mut wd = Vec::new();
    for (j, e) in m.experts.iter().enumerate() {
        let q = format!("{p}.experts.{j}");
        w13.extend(fuse_gate_up_bf16(&e.gate, &e.up, &q)?);
        wd.extend(stack_rows(&[&e.down], 0, &q)?);
    }
    Ok(DevExperts::Bf16 {
        w13: up.u16(&w13, p)?,
        wd: up.u16(&wd, p)?,
    })
}

fn layer(up: &mut Up<'_>, lw: &LayerWeights, cfg: &ModelConfig, i: usize) -> Result<DevLayer> {
    let p = format!("model.layers.{i}");
    let mixer = match &lw.mixer {
        Mixer::Full(a) => DevMixer::Full(attn(up, a, &p)?),
        Mixer::Kda(k) => DevMixer::Kda(Box::new(kda(up, k, cfg, &p)?)),
    };
    let ffn = match &lw.ffn {
        Ffn::Dense(m) => DevFfn::Dense(mlp(up, m, &format!("{p}.mlp"))?),
        Ffn::Moe(m) => DevFfn::Moe(Box::new(DevMoe {
            router: up.u16(
                &to_bf16(repack_dense(&m.router, &p)?, &format!("{p}.mlp.gate"))?,
                &p,
            )?,
            bias: up.f32(&m.bias, &p)?,
            experts: experts(up, m, &format!("{p}.mlp"))?,
            shared: mlp(up, &m.shared, &format!("{p}.mlp.shared_experts"))?,
        })),
    };
    Ok(DevLayer {
        input_norm: up.f32(&lw.input_norm, &p)?,
        mixer,
        post_norm: up.f32(&lw.post_norm, &p)?,
        ffn,
    })
}

fn repack_dense<'a>(l: &'a Linear, p: &str) -> Result<&'a [f32]> {
    crate::repack::dense_weight(l, &format!("{p}.mlp.gate"))
}

impl DeviceWeights {
    /// Upload every weight of `w` (one pass; routed experts repacked on the way).
    pub fn upload(w: &ModelWeights, stream: &Arc<CudaStream>) -> Result<Self> {
        let cfg = &w.cfg;
        let mut up = Up { stream, bytes: 0 };
        let embed = up.u16(&to_bf16(&w.embed, "model.embed_tokens")?, "embed")?;
        let layers = w
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| layer(&mut up, l, cfg, i))
            .collect::<Result<Vec<_>>>()?;
        let mtp = match (&w.mtp, cfg.mtp_layer_index()) {
            (Some(m), Some(n)) => Some(DevMtp {
                enorm: up.f32(&m.enorm, "mtp enorm")?,
                hnorm: up.f32(&m.hnorm, "mtp hnorm")?,
                eh_proj: up.linear(&m.eh_proj, &format!("model.layers.{n}.eh_proj"))?,
                layer: layer(&mut up, &m.layer, cfg, n)?,
                head_norm: up.f32(&m.head_norm, "mtp head norm")?,
            }),
            _ => None,
        };
        let norm = up.f32(&w.norm, "model.norm")?;
        let lm_head = up.linear(&w.lm_head, "lm_head")?;
        let (cos, sin) = if cfg.num_full_layers() > 0 || mtp.is_some() {
            rope_tables(0, cfg.max_position_embeddings, cfg.head_dim, cfg.rope_theta)
        } else {
            (vec![0.0; 1], vec![0.0; 1])
        };
        let rope_cos = up.f32(&cos, "rope cos")?;
        let rope_sin = up.f32(&sin, "rope sin")?;
        Ok(Self {
            cfg: cfg.clone(),
            embed,
            layers,
            mtp,
            norm,
            lm_head,
            rope_cos,
            rope_sin,
            bytes: up.bytes,
        })
    }
}
