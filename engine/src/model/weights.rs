//! The model's weights: tensor inventory, loading from a checkpoint, export, random init.
//!
//! Source: docs/model.md §7 (tensor names, shapes, dtypes), §8 (W4A16 modules:
//! `weight_packed` int32 `[N, K/8]`, `weight_scale` bf16 `[N, K/128]`, `weight_shape`
//! int64 `[2]`, chosen by the `quantization_config` ignore list), §10 (seeded init
//! scales); reference `recipes/model.py` (`tensor_specs`, `init_weights`,
//! `quantize_checkpoint`, `Model.__init__`).
//!
//! Invariants after [`ModelWeights::load`]: every tensor of [`tensor_specs`] was found
//! with its dtype and shape (a mismatch names the config key behind the dimension);
//! a Linear is W4A16 iff the checkpoint stores its `weight_packed`, and that agrees with
//! the `quantization_config` targets/ignore list in both directions (a module that
//! should be quantized but is not, or a packed tensor where none is expected, is an
//! error naming it); the checkpoint holds no tensor the model does not use (so e.g. more
//! experts than `n_routed_experts` is an error naming the key). Weights are f32 holding
//! bf16 values exactly (§1.1); nothing is rounded again.

use std::collections::BTreeSet;
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::checkpoint::{
    dim, write_checkpoint, write_file_atomic, Checkpoint, Dim, FloatKind, NamedTensor, TensorDtype,
};
use super::config::{IgnoreList, LayerKind, ModelConfig, GROUP_SIZE};
use super::linear::Linear;
use super::w4a16::{quantize_rtn, W4A16Tensor};
use crate::{EngineError, Result};

/// One tensor of the bf16 checkpoint (`recipes/model.py::tensor_specs`).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    /// F32 for `A_log`, `dt_bias`, `e_score_correction_bias`; Bf16 otherwise.
    pub dtype: TensorDtype,
}

/// Every tensor of the bf16 checkpoint, in `tensor_specs` order (§7).
pub fn tensor_specs(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let (nh, nkv, d) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let (nl, dl, kc) = (
        cfg.linear_num_heads,
        cfg.linear_head_dim,
        cfg.linear_conv_kernel_dim,
    );
    let c = nl * dl;
    let (e, im, i_) = (
        cfg.n_routed_experts,
        cfg.moe_intermediate_size,
        cfg.intermediate_size,
    );
    let is = im * cfg.n_shared_experts;
    let mut out = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, dtype: TensorDtype| {
        out.push(TensorSpec { name, shape, dtype })
    };
    let bf = TensorDtype::Bf16;
    let f32_ = TensorDtype::F32;
    add("model.embed_tokens.weight".into(), vec![v, h], bf);
    let n_total = cfg.num_hidden_layers + cfg.num_nextn_predict_layers;
    for i in 0..n_total {
        let p = format!("model.layers.{i}");
        let is_mtp = i == cfg.num_hidden_layers;
        if is_mtp {
            add(format!("{p}.enorm.weight"), vec![h], bf);
            add(format!("{p}.hnorm.weight"), vec![h], bf);
            add(format!("{p}.eh_proj.weight"), vec![h, 2 * h], bf);
        }
        add(format!("{p}.input_layernorm.weight"), vec![h], bf);
        if cfg.layer_kind(i) == LayerKind::FullAttention {
            add(format!("{p}.self_attn.q_proj.weight"), vec![nh * d, h], bf);
            add(format!("{p}.self_attn.k_proj.weight"), vec![nkv * d, h], bf);
            add(format!("{p}.self_attn.v_proj.weight"), vec![nkv * d, h], bf);
            add(format!("{p}.self_attn.o_proj.weight"), vec![h, nh * d], bf);
        } else {
            let a = format!("{p}.linear_attn");
            add(format!("{a}.q_proj.weight"), vec![c, h], bf);
            add(format!("{a}.k_proj.weight"), vec![c, h], bf);
            add(format!("{a}.v_proj.weight"), vec![c, h], bf);
            add(format!("{a}.q_conv1d.weight"), vec![c, 1, kc], bf);
            add(format!("{a}.k_conv1d.weight"), vec![c, 1, kc], bf);
            add(format!("{a}.v_conv1d.weight"), vec![c, 1, kc], bf);
            add(format!("{a}.f_a_proj.weight"), vec![dl, h], bf);
            add(format!("{a}.f_b_proj.weight"), vec![c, dl], bf);
            add(format!("{a}.b_proj.weight"), vec![nl, h], bf);
            add(format!("{a}.A_log"), vec![nl], f32_);
            add(format!("{a}.dt_bias"), vec![c], f32_);
            add(format!("{a}.g_a_proj.weight"), vec![dl, h], bf);
            add(format!("{a}.g_b_proj.weight"), vec![c, dl], bf);
            add(format!("{a}.o_norm.weight"), vec![dl], bf);
            add(format!("{a}.o_proj.weight"), vec![h, c], bf);
        }
        add(format!("{p}.post_attention_layernorm.weight"), vec![h], bf);
        let m = format!("{p}.mlp");
        if !cfg.is_moe_layer(i) {
            add(format!("{m}.gate_proj.weight"), vec![i_, h], bf);
            add(format!("{m}.up_proj.weight"), vec![i_, h], bf);
            add(format!("{m}.down_proj.weight"), vec![h, i_], bf);
        } else {
            add(format!("{m}.gate.weight"), vec![e, h], bf);
            add(format!("{m}.gate.e_score_correction_bias"), vec![e], f32_);
            for j in 0..e {
                add(format!("{m}.experts.{j}.gate_proj.weight"), vec![im, h], bf);
                add(format!("{m}.experts.{j}.up_proj.weight"), vec![im, h], bf);
                add(format!("{m}.experts.{j}.down_proj.weight"), vec![h, im], bf);
            }
            add(
                format!("{m}.shared_experts.gate_proj.weight"),
                vec![is, h],
                bf,
            );
            add(
                format!("{m}.shared_experts.up_proj.weight"),
                vec![is, h],
                bf,
            );
            add(
                format!("{m}.shared_experts.down_proj.weight"),
                vec![h, is],
                bf,
            );
        }
        if is_mtp {
            add(format!("{p}.shared_head.norm.weight"), vec![h], bf);
        }
    }
    add("model.norm.weight".into(), vec![h], bf);
    add("lm_head.weight".into(), vec![v, h], bf);
    out
}

/// Names of every Linear module (2-D `.weight`, embeddings excluded), as compressed-tensors sees them.
pub fn linear_module_names(cfg: &ModelConfig) -> Vec<String> {
    tensor_specs(cfg)
        .into_iter()
        .filter(|s| {
            s.shape.len() == 2
                && s.name.ends_with(".weight")
                && s.name != "model.embed_tokens.weight"
        })
        .map(|s| s.name[..s.name.len() - ".weight".len()].to_string())
        .collect()
}

/// Modules `quantization_config` quantizes: targets `Linear`, minus the ignore list.
pub fn quantized_module_names(cfg: &ModelConfig) -> Result<Vec<String>> {
    let Some(q) = &cfg.quantization_config else {
        return Ok(Vec::new());
    };
    let ig: IgnoreList = q.ignore_matcher()?;
    Ok(linear_module_names(cfg)
        .into_iter()
        .filter(|m| !ig.matches(m))
        .collect())
}

/// SwiGLU FFN (dense MLP, routed expert or shared expert), §5.
#[derive(Debug, Clone, PartialEq)]
pub struct Mlp {
    /// [I, H]
    pub gate: Linear,
    /// [I, H]
    pub up: Linear,
    /// [H, I]
    pub down: Linear,
}

/// MoE FFN (§5).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeWeights {
    /// Router `[E, H]` (dense f32).
    pub router: Linear,
    /// `e_score_correction_bias`, fp32. Shape: [E].
    pub bias: Vec<f32>,
    /// Routed experts. Shape: [E].
    pub experts: Vec<Mlp>,
    /// The shared expert (intermediate `Im * n_shared_experts`).
    pub shared: Mlp,
}

/// Full attention projections (§3).
#[derive(Debug, Clone, PartialEq)]
pub struct AttnWeights {
    /// [nh*d, H]
    pub q: Linear,
    /// [nkv*d, H]
    pub k: Linear,
    /// [nkv*d, H]
    pub v: Linear,
    /// [H, nh*d]
    pub o: Linear,
}

/// KDA weights (§4).
#[derive(Debug, Clone, PartialEq)]
pub struct KdaWeights {
    /// [C, H]
    pub q: Linear,
    /// [C, H]
    pub k: Linear,
    /// [C, H]
    pub v: Linear,
    /// Depthwise conv taps of q, k, v (the `[C, 1, kc]` tensors). Shape: [3][C, kc].
    pub conv: [Vec<f32>; 3],
    /// [dl, H]
    pub f_a: Linear,
    /// [C, dl]
    pub f_b: Linear,
    /// [nl, H]
    pub b: Linear,
    /// fp32. Shape: [nl].
    pub a_log: Vec<f32>,
    /// fp32. Shape: [C].
    pub dt_bias: Vec<f32>,
    /// [dl, H]
    pub g_a: Linear,
    /// [C, dl]
    pub g_b: Linear,
    /// Shape: [dl] (shared by heads).
    pub o_norm: Vec<f32>,
    /// [H, C]
    pub o: Linear,
}

/// Token mixer of a layer.
#[allow(clippy::large_enum_variant)] // one per layer; boxing buys nothing
#[derive(Debug, Clone, PartialEq)]
pub enum Mixer {
    Full(AttnWeights),
    Kda(KdaWeights),
}

/// FFN of a layer.
#[derive(Debug, Clone, PartialEq)]
pub enum Ffn {
    Dense(Mlp),
    Moe(MoeWeights),
}

/// One decoder layer (§2 body).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerWeights {
    /// Shape: [H].
    pub input_norm: Vec<f32>,
    pub mixer: Mixer,
    /// Shape: [H].
    pub post_norm: Vec<f32>,
    pub ffn: Ffn,
}

/// The MTP layer (§6).
#[derive(Debug, Clone, PartialEq)]
pub struct MtpWeights {
    /// Shape: [H].
    pub enorm: Vec<f32>,
    /// Shape: [H].
    pub hnorm: Vec<f32>,
    /// [H, 2H] (embedding half first).
    pub eh_proj: Linear,
    /// Full attention + MoE.
    pub layer: LayerWeights,
    /// `shared_head.norm`. Shape: [H].
    pub head_norm: Vec<f32>,
}

/// All weights of the model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelWeights {
    pub cfg: ModelConfig,
    /// Shape: [V, H].
    pub embed: Vec<f32>,
    /// Shape: [L].
    pub layers: Vec<LayerWeights>,
    pub mtp: Option<MtpWeights>,
    /// `model.norm`. Shape: [H].
    pub norm: Vec<f32>,
    /// [V, H]
    pub lm_head: Linear,
}

/// Source of tensors for [`build`]: a checkpoint or a generator.
trait TensorSource {
    /// A float tensor of the given shape.
    fn float(&mut self, name: &str, dims: &[Dim], kind: FloatKind) -> Result<Vec<f32>>;
    /// A Linear module (`name` without `.weight`) of `[n, k]`.
    fn linear(&mut self, module: &str, n: Dim, k: Dim) -> Result<Linear>;
}

/// Reads from a [`Checkpoint`], tracking which tensors were used.
struct CkptSource<'a> {
    ck: &'a Checkpoint,
    used: BTreeSet<String>,
    /// Modules `quantization_config` says are quantized (None: no quantization_config).
    expect_quant: Option<BTreeSet<String>>,
}

impl TensorSource for CkptSource<'_> {
    fn float(&mut self, name: &str, dims: &[Dim], kind: FloatKind) -> Result<Vec<f32>> {
        let v = self.ck.f32(name, kind, dims)?;
        self.used.insert(name.to_string());
        Ok(v)
    }
    fn linear(&mut self, module: &str, n: Dim, k: Dim) -> Result<Linear> {
        let packed_name = format!("{module}.weight_packed");
        let has_packed = self.ck.contains(&packed_name);
        let expected = self.expect_quant.as_ref().map(|s| s.contains(module));
        match (has_packed, expected) {
            (true, None) => {
                return Err(EngineError::Quantization {
                    module: module.into(),
                    reason: format!(
                        "{} stores `{packed_name}` but config.json has no quantization_config",
                        self.ck.file_of(&packed_name)
                    ),
                })
            }
            (true, Some(false)) => {
                return Err(EngineError::Quantization {
                    module: module.into(),
                    reason: format!(
                        "unexpected packed tensor `{packed_name}` in {}: quantization_config's ignore list excludes this module",
                        self.ck.file_of(&packed_name)
                    ),
                })
            }
            (false, Some(true)) => {
                return Err(EngineError::Quantization {
                    module: module.into(),
                    reason: format!(
                        "quantization_config quantizes this module but {} has no `{packed_name}`{}",
                        self.ck.file_of(&packed_name),
                        if self.ck.contains(&format!("{module}.weight")) {
                            " (it stores a dense `.weight` instead)"
                        } else {
                            ""
                        }
                    ),
                })
            }
            _ => {}
        }
        if !has_packed {
            let w = self.float(&format!("{module}.weight"), &[n, k], FloatKind::Bf16OrF32)?;
            return Linear::dense(n.size, k.size, w);
        }
        let qerr = |reason: String| EngineError::Quantization {
            module: module.into(),
            reason,
        };
        if !k.size.is_multiple_of(GROUP_SIZE) {
            return Err(qerr(format!(
                "in_features {} ({}) is not a multiple of the group size {GROUP_SIZE}",
                k.size, k.key
            )));
        }
        let shape_name = format!("{module}.weight_shape");
        let shape = self.ck.i64(&shape_name, &[dim(2, "")])?;
        if shape != [n.size as i64, k.size as i64] {
            return Err(EngineError::ConfigMismatch {
                key: format!("{} / {}", n.key, k.key),
                tensor: shape_name,
                reason: format!(
                    "the config implies [{}, {}], the checkpoint's weight_shape is {shape:?}",
                    n.size, k.size
                ),
            });
        }
        let packed = self.ck.i32(&packed_name, &[n, dim(k.size / 8, k.key)])?;
        let scale_name = format!("{module}.weight_scale");
        let scale = self.ck.f32(
            &scale_name,
            FloatKind::Bf16OrF32,
            &[n, dim(k.size / GROUP_SIZE, k.key)],
        )?;
        for extra in ["weight", "weight_zero_point", "weight_g_idx"] {
            let nm = format!("{module}.{extra}");
            if self.ck.contains(&nm) {
                return Err(qerr(format!(
                    "{} stores `{nm}` next to weight_packed (dense duplicate, asymmetric zero point or activation order: not supported)",
                    self.ck.file_of(&nm)
                )));
            }
        }
        for n_ in [&packed_name, &shape_name, &scale_name] {
            self.used.insert(n_.clone());
        }
        Linear::w4a16(
            n.size,
            k.size,
            packed.into_iter().map(|w| w as u32).collect(),
            scale,
        )
    }
}

/// Builds every module from a [`TensorSource`] in `tensor_specs` order.
fn build(cfg: &ModelConfig, src: &mut dyn TensorSource) -> Result<ModelWeights> {
    let h = dim(cfg.hidden_size, "hidden_size");
    let v = dim(cfg.vocab_size, "vocab_size");
    let bf = FloatKind::Bf16OrF32;
    let embed = src.float("model.embed_tokens.weight", &[v, h], bf)?;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for i in 0..cfg.num_hidden_layers {
        layers.push(build_layer(cfg, src, i)?);
    }
    let mtp = match cfg.mtp_layer_index() {
        Some(n) => {
            let p = format!("model.layers.{n}");
            let enorm = src.float(&format!("{p}.enorm.weight"), &[h], bf)?;
            let hnorm = src.float(&format!("{p}.hnorm.weight"), &[h], bf)?;
            let eh_proj = src.linear(
                &format!("{p}.eh_proj"),
                h,
                dim(2 * cfg.hidden_size, "hidden_size"),
            )?;
            let layer = build_layer(cfg, src, n)?;
            let head_norm = src.float(&format!("{p}.shared_head.norm.weight"), &[h], bf)?;
            Some(MtpWeights {
                enorm,
                hnorm,
                eh_proj,
                layer,
                head_norm,
            })
        }
        None => None,
    };
    let norm = src.float("model.norm.weight", &[h], bf)?;
    let lm_head = src.linear("lm_head", v, h)?;
    Ok(ModelWeights {
        cfg: cfg.clone(),
        embed,
        layers,
        mtp,
        norm,
        lm_head,
    })
}

fn build_mlp(src: &mut dyn TensorSource, m: &str, inter: Dim, h: Dim) -> Result<Mlp> {
    Ok(Mlp {
        gate: src.linear(&format!("{m}.gate_proj"), inter, h)?,
        up: src.linear(&format!("{m}.up_proj"), inter, h)?,
        down: src.linear(&format!("{m}.down_proj"), h, inter)?,
    })
}

fn build_layer(cfg: &ModelConfig, src: &mut dyn TensorSource, i: usize) -> Result<LayerWeights> {
    let p = format!("model.layers.{i}");
    let bf = FloatKind::Bf16OrF32;
    let h = dim(cfg.hidden_size, "hidden_size");
    let input_norm = src.float(&format!("{p}.input_layernorm.weight"), &[h], bf)?;
    let mixer = if cfg.layer_kind(i) == LayerKind::FullAttention {
        let q = dim(
            cfg.num_attention_heads * cfg.head_dim,
            "num_attention_heads * head_dim",
        );
        let kv = dim(
            cfg.num_key_value_heads * cfg.head_dim,
            "num_key_value_heads * head_dim",
        );
        let a = format!("{p}.self_attn");
        Mixer::Full(AttnWeights {
            q: src.linear(&format!("{a}.q_proj"), q, h)?,
            k: src.linear(&format!("{a}.k_proj"), kv, h)?,
            v: src.linear(&format!("{a}.v_proj"), kv, h)?,
            o: src.linear(&format!("{a}.o_proj"), h, q)?,
        })
    } else {
        let c = dim(cfg.kda_channels(), "linear_num_heads * linear_head_dim");
        let dl = dim(cfg.linear_head_dim, "linear_head_dim");
        let nl = dim(cfg.linear_num_heads, "linear_num_heads");
        let kc = dim(cfg.linear_conv_kernel_dim, "linear_conv_kernel_dim");
        let a = format!("{p}.linear_attn");
        let conv = |src: &mut dyn TensorSource, w: &str| {
            src.float(&format!("{a}.{w}_conv1d.weight"), &[c, dim(1, ""), kc], bf)
        };
        Mixer::Kda(KdaWeights {
            q: src.linear(&format!("{a}.q_proj"), c, h)?,
            k: src.linear(&format!("{a}.k_proj"), c, h)?,
            v: src.linear(&format!("{a}.v_proj"), c, h)?,
            conv: [conv(src, "q")?, conv(src, "k")?, conv(src, "v")?],
            f_a: src.linear(&format!("{a}.f_a_proj"), dl, h)?,
            f_b: src.linear(&format!("{a}.f_b_proj"), c, dl)?,
            b: src.linear(&format!("{a}.b_proj"), nl, h)?,
            a_log: src.float(&format!("{a}.A_log"), &[nl], FloatKind::F32Only)?,
            dt_bias: src.float(&format!("{a}.dt_bias"), &[c], FloatKind::F32Only)?,
            g_a: src.linear(&format!("{a}.g_a_proj"), dl, h)?,
            g_b: src.linear(&format!("{a}.g_b_proj"), c, dl)?,
            o_norm: src.float(&format!("{a}.o_norm.weight"), &[dl], bf)?,
            o: src.linear(&format!("{a}.o_proj"), h, c)?,
        })
    };
    let post_norm = src.float(&format!("{p}.post_attention_layernorm.weight"), &[h], bf)?;
    let m = format!("{p}.mlp");
    let ffn = if !cfg.is_moe_layer(i) {
        Ffn::Dense(build_mlp(
            src,
            &m,
            dim(cfg.intermediate_size, "intermediate_size"),
            h,
        )?)
    } else {
        let e = dim(cfg.n_routed_experts, "n_routed_experts");
        let im = dim(cfg.moe_intermediate_size, "moe_intermediate_size");
        let is = dim(
            cfg.moe_intermediate_size * cfg.n_shared_experts,
            "moe_intermediate_size * n_shared_experts",
        );
        let router = src.linear(&format!("{m}.gate"), e, h)?;
        let bias = src.float(
            &format!("{m}.gate.e_score_correction_bias"),
            &[e],
            FloatKind::F32Only,
        )?;
        let mut experts = Vec::with_capacity(cfg.n_routed_experts);
        for j in 0..cfg.n_routed_experts {
            experts.push(build_mlp(src, &format!("{m}.experts.{j}"), im, h)?);
        }
        let shared = build_mlp(src, &format!("{m}.shared_experts"), is, h)?;
        Ffn::Moe(MoeWeights {
            router,
            bias,
            experts,
            shared,
        })
    };
    Ok(LayerWeights {
        input_norm,
        mixer,
        post_norm,
        ffn,
    })
}

/// Checks done before reading any tensor, so that a config describing another model
/// fails with the config key rather than a generic missing tensor.
fn precheck(cfg: &ModelConfig, ck: &Checkpoint) -> Result<()> {
    let (max_layer, max_expert) = highest_indices(ck);
    let n_total = cfg.num_hidden_layers + cfg.num_nextn_predict_layers;
    if let Some(m) = max_layer {
        if m + 1 > n_total {
            let t = ck
                .names()
                .find(|n| n.starts_with(&format!("model.layers.{m}.")))
                .unwrap_or_default()
                .to_string();
            return Err(EngineError::ConfigMismatch {
                key: "num_hidden_layers".into(),
                tensor: t,
                reason: format!(
                    "num_hidden_layers = {} + num_nextn_predict_layers = {} gives layers 0..{}, but the checkpoint has layer {m}",
                    cfg.num_hidden_layers,
                    cfg.num_nextn_predict_layers,
                    n_total - 1
                ),
            });
        }
    }
    if let Some((j, t)) = max_expert {
        if j >= cfg.n_routed_experts {
            return Err(EngineError::ConfigMismatch {
                key: "n_routed_experts".into(),
                tensor: t,
                reason: format!(
                    "n_routed_experts = {} but the checkpoint stores expert {j}",
                    cfg.n_routed_experts
                ),
            });
        }
    }
    for i in 0..n_total {
        precheck_layer(cfg, ck, i)?;
    }
    Ok(())
}

/// The highest `model.layers.{i}` index and the highest routed expert index (with a
/// tensor that has it) the checkpoint stores.
fn highest_indices(ck: &Checkpoint) -> (Option<usize>, Option<(usize, String)>) {
    // Layers present: max index of `model.layers.{i}.`
    let mut max_layer: Option<usize> = None;
    let mut max_expert: Option<(usize, String)> = None;
    for name in ck.names() {
        if let Some(rest) = name.strip_prefix("model.layers.") {
            if let Some(i) = rest.split('.').next().and_then(|s| s.parse::<usize>().ok()) {
                max_layer = Some(max_layer.map_or(i, |m| m.max(i)));
            }
            if let Some(pos) = rest.find(".mlp.experts.") {
                let tail = &rest[pos + ".mlp.experts.".len()..];
                if let Some(j) = tail.split('.').next().and_then(|s| s.parse::<usize>().ok()) {
                    if max_expert.as_ref().is_none_or(|(m, _)| j > *m) {
                        max_expert = Some((j, name.to_string()));
                    }
                }
            }
        }
    }
    (max_layer, max_expert)
}

/// Layer `i`'s mixer and FFN kind against the config (`layer_types`, `first_k_dense_replace`).
fn precheck_layer(cfg: &ModelConfig, ck: &Checkpoint, i: usize) -> Result<()> {
    let file = |n: &str| ck.file_of(n);
    let p = format!("model.layers.{i}");
    let full = ck.contains(&format!("{p}.self_attn.q_proj.weight"));
    let kda = ck.contains(&format!("{p}.linear_attn.q_proj.weight"));
    let want_full = cfg.layer_kind(i) == LayerKind::FullAttention;
    let key = if i < cfg.num_hidden_layers {
        format!("layer_types[{i}]")
    } else {
        "num_nextn_predict_layers".into()
    };
    if want_full && kda && !full {
        return Err(EngineError::ConfigMismatch {
            key,
            tensor: format!("{p}.linear_attn.q_proj.weight"),
            reason: format!(
                "layer {i} is full_attention in the config but {} stores a linear_attn (KDA) layer",
                file(&format!("{p}.linear_attn.q_proj.weight"))
            ),
        });
    }
    if !want_full && full && !kda {
        return Err(EngineError::ConfigMismatch {
            key,
            tensor: format!("{p}.self_attn.q_proj.weight"),
            reason: format!(
                "layer {i} is linear_attention in the config but {} stores a self_attn layer",
                file(&format!("{p}.self_attn.q_proj.weight"))
            ),
        });
    }
    let router = format!("{p}.mlp.gate.weight");
    if cfg.is_moe_layer(i) != ck.contains(&router)
        && (ck.contains(&format!("{p}.mlp.gate_proj.weight")) || ck.contains(&router))
    {
        return Err(EngineError::ConfigMismatch {
            key: "first_k_dense_replace".into(),
            tensor: if ck.contains(&router) {
                router
            } else {
                format!("{p}.mlp.gate_proj.weight")
            },
            reason: format!(
                "first_k_dense_replace = {} makes layer {i} {}, but the checkpoint stores {}",
                cfg.first_k_dense_replace,
                if cfg.is_moe_layer(i) { "MoE" } else { "dense" },
                if cfg.is_moe_layer(i) {
                    "a dense MLP"
                } else {
                    "an MoE router"
                }
            ),
        });
    }
    Ok(())
}

impl ModelWeights {
    /// Load `dir/config.json` and the checkpoint in `dir` (single file or sharded).
    pub fn load(dir: &Path) -> Result<Self> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let ck = Checkpoint::open(dir)?;
        Self::from_checkpoint(&cfg, &ck)
    }

    /// Build from an opened checkpoint and a validated config.
    pub fn from_checkpoint(cfg: &ModelConfig, ck: &Checkpoint) -> Result<Self> {
        cfg.validate()?;
        precheck(cfg, ck)?;
        let expect_quant = match &cfg.quantization_config {
            Some(_) => Some(quantized_module_names(cfg)?.into_iter().collect()),
            None => None,
        };
        let mut src = CkptSource {
            ck,
            used: BTreeSet::new(),
            expect_quant,
        };
        let w = build(cfg, &mut src)?;
        if let Some(extra) = ck.names().find(|n| !src.used.contains(*n)) {
            return Err(EngineError::ConfigMismatch {
                key: "<model structure>".into(),
                tensor: extra.to_string(),
                reason: format!(
                    "{} stores a tensor this config does not use",
                    ck.file_of(extra)
                ),
            });
        }
        Ok(w)
    }

    /// Seeded random weights with `recipes/model.py::init_weights`' scales (not its
    /// stream: ChaCha8 + Box-Muller): Linear `N(0, 1/in)`, embed `N(0, 1)`, lm_head
    /// `N(0, 9/H)`, norms `1 + 0.1 N(0, 1)`, conv `N(0, 0.25)`, `A_log = log U(1, 16)`,
    /// `dt_bias` = inverse softplus of `logU(1e-3, 1e-1)`, router bias `0.1 N(0, 1)`;
    /// bf16-rounded except the fp32 tensors. With `quantize_experts`, the modules the
    /// W4A16 `quantization_config` selects (routed experts) are RTN-quantized (§8) and
    /// the config gets that `quantization_config`.
    pub fn random(cfg: &ModelConfig, seed: u64, quantize_experts: bool) -> Result<Self> {
        let cfg = if quantize_experts {
            cfg.clone().with_quantization()
        } else {
            ModelConfig {
                quantization_config: None,
                ..cfg.clone()
            }
        };
        cfg.validate()?;
        let quant: BTreeSet<String> = quantized_module_names(&cfg)?.into_iter().collect();
        let mut src = RandomSource {
            rng: ChaCha8Rng::seed_from_u64(seed),
            spare: None,
            h: cfg.hidden_size,
            quant,
        };
        build(&cfg, &mut src)
    }

    /// Every tensor as the checkpoint stores it (§7/§8), in `tensor_specs` order with
    /// W4A16 modules as `weight_packed` / `weight_scale` / `weight_shape`. bf16 tensors
    /// are rounded to bf16 (exact for weights that were loaded from bf16 or made by
    /// [`ModelWeights::random`]).
    pub fn tensors(&self) -> Vec<NamedTensor> {
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        let mut out = Vec::new();
        out.push(NamedTensor::bf16(
            "model.embed_tokens.weight",
            vec![cfg.vocab_size, h],
            &self.embed,
        ));
        for (i, l) in self.layers.iter().enumerate() {
            export_layer(&mut out, cfg, i, l, None);
        }
        if let Some(m) = &self.mtp {
            export_layer(&mut out, cfg, cfg.num_hidden_layers, &m.layer, Some(m));
        }
        out.push(NamedTensor::bf16("model.norm.weight", vec![h], &self.norm));
        export_linear(&mut out, "lm_head", &self.lm_head);
        out
    }

    /// Write `dir/config.json` (sorted keys) and `dir/model.safetensors`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.save_sharded(dir, None).map(|_| ())
    }

    /// Write `dir/config.json` and the tensors, sharded above `max_shard_bytes` (see
    /// [`write_checkpoint`]: HF's rule on tensor bytes, atomic files, stale checkpoint
    /// files removed); returns the tensor file names.
    pub fn save_sharded(&self, dir: &Path, max_shard_bytes: Option<usize>) -> Result<Vec<String>> {
        std::fs::create_dir_all(dir).map_err(|e| EngineError::Io {
            path: dir.display().to_string(),
            reason: e.to_string(),
        })?;
        let text = self.cfg.to_json_string()? + "\n";
        write_file_atomic(&dir.join("config.json"), text.as_bytes())?;
        write_checkpoint(dir, &self.tensors(), max_shard_bytes)
    }

    /// A copy whose W4A16 layers are dense f32 (the dequantized side of the benchmarks).
    pub fn dequantized(&self) -> Self {
        let mut w = self.clone();
        let dq = |l: &mut Linear| {
            if l.is_quantized() {
                *l = l.dequantized();
            }
        };
        let fix_layer = |l: &mut LayerWeights| {
            if let Ffn::Moe(m) = &mut l.ffn {
                for e in &mut m.experts {
                    dq(&mut e.gate);
                    dq(&mut e.up);
                    dq(&mut e.down);
                }
            }
        };
        for l in &mut w.layers {
            fix_layer(l);
        }
        if let Some(m) = &mut w.mtp {
            fix_layer(&mut m.layer);
        }
        w
    }

    /// Number of W4A16 Linear modules.
    pub fn num_quantized(&self) -> usize {
        self.tensors()
            .iter()
            .filter(|t| t.name.ends_with(".weight_packed"))
            .count()
    }
}

fn export_linear(out: &mut Vec<NamedTensor>, module: &str, l: &Linear) {
    match l {
        Linear::Dense {
            out_features,
            in_features,
            w,
        } => out.push(NamedTensor::bf16(
            &format!("{module}.weight"),
            vec![*out_features, *in_features],
            w,
        )),
        Linear::W4A16 { .. } => {
            if let Some(t) = W4A16Tensor::from_linear(l) {
                out.extend(t.to_named(module));
            }
        }
    }
}

fn export_mlp(out: &mut Vec<NamedTensor>, pre: &str, x: &Mlp) {
    export_linear(out, &format!("{pre}.gate_proj"), &x.gate);
    export_linear(out, &format!("{pre}.up_proj"), &x.up);
    export_linear(out, &format!("{pre}.down_proj"), &x.down);
}

/// A KDA mixer's tensors under `{p}.linear_attn`.
fn export_kda(out: &mut Vec<NamedTensor>, cfg: &ModelConfig, p: &str, k: &KdaWeights) {
    let a = format!("{p}.linear_attn");
    let c = cfg.kda_channels();
    let kc = cfg.linear_conv_kernel_dim;
    for (n, x) in [("q_proj", &k.q), ("k_proj", &k.k), ("v_proj", &k.v)] {
        export_linear(out, &format!("{a}.{n}"), x);
    }
    for (n, x) in ["q", "k", "v"].iter().zip(&k.conv) {
        out.push(NamedTensor::bf16(
            &format!("{a}.{n}_conv1d.weight"),
            vec![c, 1, kc],
            x,
        ));
    }
    export_linear(out, &format!("{a}.f_a_proj"), &k.f_a);
    export_linear(out, &format!("{a}.f_b_proj"), &k.f_b);
    export_linear(out, &format!("{a}.b_proj"), &k.b);
    out.push(NamedTensor::f32(
        &format!("{a}.A_log"),
        vec![cfg.linear_num_heads],
        &k.a_log,
    ));
    out.push(NamedTensor::f32(
        &format!("{a}.dt_bias"),
        vec![c],
        &k.dt_bias,
    ));
    export_linear(out, &format!("{a}.g_a_proj"), &k.g_a);
    export_linear(out, &format!("{a}.g_b_proj"), &k.g_b);
    out.push(NamedTensor::bf16(
        &format!("{a}.o_norm.weight"),
        vec![cfg.linear_head_dim],
        &k.o_norm,
    ));
    export_linear(out, &format!("{a}.o_proj"), &k.o);
}

fn export_layer(
    out: &mut Vec<NamedTensor>,
    cfg: &ModelConfig,
    i: usize,
    l: &LayerWeights,
    mtp: Option<&MtpWeights>,
) {
    let h = cfg.hidden_size;
    let p = format!("model.layers.{i}");
    if let Some(m) = mtp {
        out.push(NamedTensor::bf16(
            &format!("{p}.enorm.weight"),
            vec![h],
            &m.enorm,
        ));
        out.push(NamedTensor::bf16(
            &format!("{p}.hnorm.weight"),
            vec![h],
            &m.hnorm,
        ));
        export_linear(out, &format!("{p}.eh_proj"), &m.eh_proj);
    }
    out.push(NamedTensor::bf16(
        &format!("{p}.input_layernorm.weight"),
        vec![h],
        &l.input_norm,
    ));
    match &l.mixer {
        Mixer::Full(a) => {
            for (n, x) in [
                ("q_proj", &a.q),
                ("k_proj", &a.k),
                ("v_proj", &a.v),
                ("o_proj", &a.o),
            ] {
                export_linear(out, &format!("{p}.self_attn.{n}"), x);
            }
        }
        Mixer::Kda(k) => export_kda(out, cfg, &p, k),
    }
    out.push(NamedTensor::bf16(
        &format!("{p}.post_attention_layernorm.weight"),
        vec![h],
        &l.post_norm,
    ));
    let m = format!("{p}.mlp");
    match &l.ffn {
        Ffn::Dense(x) => export_mlp(out, &m, x),
        Ffn::Moe(x) => {
            export_linear(out, &format!("{m}.gate"), &x.router);
            out.push(NamedTensor::f32(
                &format!("{m}.gate.e_score_correction_bias"),
                vec![x.bias.len()],
                &x.bias,
            ));
            for (j, e) in x.experts.iter().enumerate() {
                export_mlp(out, &format!("{m}.experts.{j}"), e);
            }
            export_mlp(out, &format!("{m}.shared_experts"), &x.shared);
        }
    }
    if let Some(mt) = mtp {
        out.push(NamedTensor::bf16(
            &format!("{p}.shared_head.norm.weight"),
            vec![h],
            &mt.head_norm,
        ));
    }
}

/// Seeded generator behind [`ModelWeights::random`].
struct RandomSource {
    rng: ChaCha8Rng,
    /// Second Box-Muller output, not yet used.
    spare: Option<f64>,
    h: usize,
    quant: BTreeSet<String>,
}

impl RandomSource {
    fn normal(&mut self) -> f64 {
        // Box-Muller on two 32-bit uniforms from one 64-bit draw; both outputs are used.
        if let Some(z) = self.spare.take() {
            return z;
        }
        let x: u64 = self.rng.random();
        let u1 = ((x >> 32) as f64 + 0.5) / 4_294_967_296.0; // (0, 1)
        let u2 = (x & 0xffff_ffff) as f64 / 4_294_967_296.0; // [0, 1)
        let r = (-2.0 * u1.ln()).sqrt();
        let a = std::f64::consts::TAU * u2;
        self.spare = Some(r * a.sin());
        r * a.cos()
    }
    fn bf16(x: f64) -> f32 {
        half::bf16::from_f64(x).to_f32()
    }
}

impl TensorSource for RandomSource {
    fn float(&mut self, name: &str, dims: &[Dim], kind: FloatKind) -> Result<Vec<f32>> {
        let n: usize = dims.iter().map(|d| d.size).product();
        let leaf = name.rsplit('.').next().unwrap_or("");
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let x = match leaf {
                "A_log" => self.rng.random_range(1.0f64..16.0).ln(),
                "dt_bias" => {
                    let dt = (self.rng.random_range((1e-3f64).ln()..(1e-1f64).ln())).exp();
                    dt + (-(-dt).exp_m1()).ln()
                }
                "e_score_correction_bias" => 0.1 * self.normal(),
                _ if name.ends_with("norm.weight") => 1.0 + 0.1 * self.normal(),
                _ if name == "model.embed_tokens.weight" => self.normal(),
                _ if name.ends_with("conv1d.weight") => 0.5 * self.normal(),
                // N(0, 9/H): logit std ~3, so greedy margins are not tiny.
                _ if name == "lm_head.weight" => 3.0 * self.normal() / (self.h as f64).sqrt(),
                _ => self.normal() / (dims.last().map_or(1, |d| d.size) as f64).sqrt(),
            };
            v.push(if kind == FloatKind::F32Only {
                x as f32
            } else {
                Self::bf16(x)
            });
        }
        Ok(v)
    }
    fn linear(&mut self, module: &str, n: Dim, k: Dim) -> Result<Linear> {
        let name = format!("{module}.weight");
        let w = self.float(&name, &[n, k], FloatKind::Bf16OrF32)?;
        if self.quant.contains(module) {
            return quantize_rtn(&w, n.size, k.size)?.to_linear();
        }
        Linear::dense(n.size, k.size, w)
    }
}
