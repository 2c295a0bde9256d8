//! The drafter's weights: loading from its own checkpoint directory, export, random init.
//!
//! Source: docs/dflash2.md §9 (tensor names, shapes; all bf16, no `embed_tokens` /
//! `lm_head`: those are the target's), §1.1 (bf16 upcast to f32 exactly), §11.2 (the
//! "fixture" init scales, reproduced here with ChaCha8 + Box-Muller, not numpy's stream).
//! Reading goes through `speclab_engine::model::checkpoint` (mmap'd safetensors, typed and
//! shape-checked getters whose errors name the file and tensor).
//!
//! Invariants after [`DFlash2Weights::load`] / [`DFlash2Weights::from_checkpoint`]: every
//! v1 tensor of [`DFlash2Config::tensor_specs`] was found with its shape (a mismatch names
//! the config key behind the dimension); the conv + selector tensors are all present or
//! all absent (a v1-only checkpoint, which refuses v2 drafting); the checkpoint holds no
//! tensor the drafter does not use.

use std::collections::BTreeSet;
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use speclab_engine::model::checkpoint::{
    dim, write_safetensors, Checkpoint, Dim, FloatKind, NamedTensor,
};
use speclab_engine::model::weights::Mlp;
use speclab_engine::model::{Linear, ModelConfig};
use speclab_engine::{EngineError, Result};

use super::config::DFlash2Config;

/// One grouped dynamic depthwise convolution module (§5.1).
#[derive(Debug, Clone, PartialEq)]
pub struct ConvWeights {
    /// Static taps of both sides. Shape: [2, K, H].
    pub base: Vec<f32>,
    /// `kernel_projection`: [2*K*G, H].
    pub proj: Linear,
}

/// One drafter decoder layer (§5).
#[derive(Debug, Clone, PartialEq)]
pub struct DraftLayer {
    /// Shape: [H].
    pub input_norm: Vec<f32>,
    /// [nh*d, H]
    pub q: Linear,
    /// [nkv*d, H]
    pub k: Linear,
    /// [nkv*d, H]
    pub v: Linear,
    /// [H, nh*d]
    pub o: Linear,
    /// Shape: [d].
    pub q_norm: Vec<f32>,
    /// Shape: [d].
    pub k_norm: Vec<f32>,
    /// Shape: [H].
    pub post_norm: Vec<f32>,
    pub mlp: Mlp,
    /// `attention_conv` (v2 checkpoints).
    pub attn_conv: Option<ConvWeights>,
    /// `mlp_conv` (v2 checkpoints).
    pub mlp_conv: Option<ConvWeights>,
}

/// The candidate selector (§6.2).
#[derive(Debug, Clone, PartialEq)]
pub struct SelectorWeights {
    /// `A`. Shape: [V, r].
    pub predecessor: Vec<f32>,
    /// `Bc`. Shape: [V, r].
    pub successor: Vec<f32>,
    /// `W_h`: [r, H].
    pub hidden_proj: Linear,
}

/// All drafter weights (f32 holding bf16 values exactly).
#[derive(Debug, Clone, PartialEq)]
pub struct DFlash2Weights {
    pub cfg: DFlash2Config,
    /// [H, F]
    pub fc: Linear,
    /// Shape: [H].
    pub hidden_norm: Vec<f32>,
    /// Shape: [Ld].
    pub layers: Vec<DraftLayer>,
    /// Shape: [H].
    pub norm: Vec<f32>,
    /// Present iff the checkpoint has the v2 tensors.
    pub selector: Option<SelectorWeights>,
}

/// Where tensors come from: a checkpoint or a generator.
trait Source {
    fn float(&mut self, name: &str, dims: &[Dim]) -> Result<Vec<f32>>;
    fn linear(&mut self, name: &str, n: Dim, k: Dim) -> Result<Linear> {
        let w = self.float(name, &[n, k])?;
        Linear::dense(n.size, k.size, w)
    }
}

struct CkptSource<'a> {
    ck: &'a Checkpoint,
    used: BTreeSet<String>,
}

impl Source for CkptSource<'_> {
    fn float(&mut self, name: &str, dims: &[Dim]) -> Result<Vec<f32>> {
        let v = self.ck.f32(name, FloatKind::Bf16OrF32, dims)?;
        self.used.insert(name.to_string());
        Ok(v)
    }
}

/// Seeded generator with §11.2's "fixture" scales, bf16-rounded.
struct RandomSource {
    rng: ChaCha8Rng,
    h: usize,
    rank: usize,
}

impl RandomSource {
    fn normal(&mut self) -> f32 {
        // Box-Muller; u1 in (0, 1].
        let u1: f64 = 1.0 - self.rng.random::<f64>();
        let u2: f64 = self.rng.random::<f64>();
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
}

fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

impl Source for RandomSource {
    fn float(&mut self, name: &str, dims: &[Dim]) -> Result<Vec<f32>> {
        let n: usize = dims.iter().map(|d| d.size).product();
        let mut out = Vec::with_capacity(n);
        if name.ends_with("norm.weight") {
            for _ in 0..n {
                let z = self.normal();
                out.push(1.0 + 0.1 * z);
            }
        } else if name.ends_with("base_kernel") {
            let (k, h) = (dims[1].size, dims[2].size);
            for i in 0..n {
                let tau = (i / h) % k;
                let z = self.normal();
                out.push(if tau == 0 { 1.0 + 0.1 * z } else { 0.3 * z });
            }
        } else if name.ends_with("kernel_projection.weight") {
            let s = 0.3 / (self.h as f32).sqrt();
            for _ in 0..n {
                out.push(self.normal() * s);
            }
        } else if name.ends_with("codebook") {
            let s = (self.rank as f32).powf(-0.25);
            for _ in 0..n {
                out.push(self.normal() * s);
            }
        } else {
            let s = 1.0 / (dims[dims.len() - 1].size as f32).sqrt();
            for _ in 0..n {
                out.push(self.normal() * s);
            }
        }
        Ok(out.into_iter().map(bf16_round).collect())
    }
}

/// Dimensions of the checkpoint tensors, with the config keys behind them.
struct Dims {
    h: Dim,
    f: Dim,
    q: Dim,
    kv: Dim,
    d: Dim,
    i: Dim,
    two: Dim,
    k: Dim,
    proj: Dim,
    v: Dim,
    r: Dim,
}

fn dims(cfg: &DFlash2Config) -> Dims {
    let k = cfg.dflash_config.conv_kernel_size;
    Dims {
        h: dim(cfg.hidden_size, "hidden_size"),
        f: dim(cfg.feature_dim(), "dflash_config.target_layer_ids (x target_hidden_size)"),
        q: dim(cfg.num_attention_heads * cfg.head_dim, "num_attention_heads * head_dim"),
        kv: dim(cfg.num_key_value_heads * cfg.head_dim, "num_key_value_heads * head_dim"),
        d: dim(cfg.head_dim, "head_dim"),
        i: dim(cfg.intermediate_size, "intermediate_size"),
        two: dim(2, ""),
        k: dim(k, "dflash_config.conv_kernel_size"),
        proj: dim(
            2 * k * cfg.conv_groups(),
            "dflash_config.conv_kernel_size / dflash_config.conv_group_size (2 * K * hidden_size / conv_group_size)",
        ),
        v: dim(cfg.vocab_size, "vocab_size"),
        r: dim(cfg.dflash_config.selector_rank, "dflash_config.selector_rank"),
    }
}

fn build(cfg: &DFlash2Config, src: &mut dyn Source, v2: bool) -> Result<DFlash2Weights> {
    let d = dims(cfg);
    let fc = src.linear("fc.weight", d.h, d.f)?;
    let hidden_norm = src.float("hidden_norm.weight", &[d.h])?;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for li in 0..cfg.num_hidden_layers {
        let p = format!("layers.{li}");
        let input_norm = src.float(&format!("{p}.input_layernorm.weight"), &[d.h])?;
        let q = src.linear(&format!("{p}.self_attn.q_proj.weight"), d.q, d.h)?;
        let k = src.linear(&format!("{p}.self_attn.k_proj.weight"), d.kv, d.h)?;
        let v = src.linear(&format!("{p}.self_attn.v_proj.weight"), d.kv, d.h)?;
        let o = src.linear(&format!("{p}.self_attn.o_proj.weight"), d.h, d.q)?;
        let q_norm = src.float(&format!("{p}.self_attn.q_norm.weight"), &[d.d])?;
        let k_norm = src.float(&format!("{p}.self_attn.k_norm.weight"), &[d.d])?;
        let post_norm = src.float(&format!("{p}.post_attention_layernorm.weight"), &[d.h])?;
        let gate = src.linear(&format!("{p}.mlp.gate_proj.weight"), d.i, d.h)?;
        let up = src.linear(&format!("{p}.mlp.up_proj.weight"), d.i, d.h)?;
        let down = src.linear(&format!("{p}.mlp.down_proj.weight"), d.h, d.i)?;
        let mut convs = [None, None];
        if v2 {
            for (slot, conv) in convs.iter_mut().zip(["attention_conv", "mlp_conv"]) {
                let base = src.float(&format!("{p}.{conv}.base_kernel"), &[d.two, d.k, d.h])?;
                let proj =
                    src.linear(&format!("{p}.{conv}.kernel_projection.weight"), d.proj, d.h)?;
                *slot = Some(ConvWeights { base, proj });
            }
        }
        let [attn_conv, mlp_conv] = convs;
        layers.push(DraftLayer {
            input_norm,
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
            post_norm,
            mlp: Mlp { gate, up, down },
            attn_conv,
            mlp_conv,
        });
    }
    let norm = src.float("norm.weight", &[d.h])?;
    let selector = if v2 {
        Some(SelectorWeights {
            predecessor: src.float("candidate_selector.predecessor_codebook", &[d.v, d.r])?,
            successor: src.float("candidate_selector.successor_codebook", &[d.v, d.r])?,
            hidden_proj: src.linear("candidate_selector.hidden_projection.weight", d.r, d.h)?,
        })
    } else {
        None
    };
    Ok(DFlash2Weights {
        cfg: cfg.clone(),
        fc,
        hidden_norm,
        layers,
        norm,
        selector,
    })
}

impl DFlash2Weights {
    /// Load `dir/config.json` and `dir/model.safetensors` (or a sharded checkpoint).
    pub fn load(dir: &Path) -> Result<Self> {
        let cfg = DFlash2Config::from_file(&dir.join("config.json"))?;
        let ck = Checkpoint::open(dir)?;
        Self::from_checkpoint(&cfg, &ck)
    }

    /// [`DFlash2Weights::load`], then check the drafter fits `target` (hidden size, vocab,
    /// target layer ids in range).
    pub fn load_for_target(dir: &Path, target: &ModelConfig) -> Result<Self> {
        let w = Self::load(dir)?;
        w.cfg.check_target(target)?;
        Ok(w)
    }

    /// Build from an opened checkpoint and a config (validated here).
    pub fn from_checkpoint(cfg: &DFlash2Config, ck: &Checkpoint) -> Result<Self> {
        cfg.validate()?;
        let specs = cfg.tensor_specs(true);
        let v2_names: Vec<&str> = specs
            .iter()
            .filter(|s| s.v2)
            .map(|s| s.name.as_str())
            .collect();
        let present = v2_names.iter().filter(|n| ck.contains(n)).count();
        if present > 0 && present < v2_names.len() {
            let missing = v2_names
                .iter()
                .find(|n| !ck.contains(n))
                .copied()
                .unwrap_or_default();
            return Err(EngineError::ConfigMismatch {
                key: "<drafter structure>".into(),
                tensor: missing.to_string(),
                reason: format!(
                    "{} is missing this tensor but has {present} of the {} conv + selector tensors: they must be all present (v2) or all absent (v1-only checkpoint)",
                    ck.file_of(missing),
                    v2_names.len()
                ),
            });
        }
        let mut src = CkptSource {
            ck,
            used: BTreeSet::new(),
        };
        let w = build(cfg, &mut src, present > 0)?;
        if let Some(extra) = ck.names().find(|n| !src.used.contains(*n)) {
            return Err(EngineError::ConfigMismatch {
                key: "<drafter structure>".into(),
                tensor: extra.to_string(),
                reason: format!(
                    "{} stores a tensor this DFlash2 config does not use (docs/dflash2.md §9; the drafter holds no embed_tokens / lm_head)",
                    ck.file_of(extra)
                ),
            });
        }
        Ok(w)
    }

    /// Seeded random weights (v1 + v2) with docs/dflash2.md §11.2's "fixture" scales
    /// (Linear `N(0, 1/in)`, norms `1 + 0.1 N`, base taps `1 + 0.1 N` / `0.3 N`,
    /// `kernel_projection` `N(0, 0.3^2/H)`, codebooks `N(0, r^-1/2)`), bf16-rounded;
    /// ChaCha8 + Box-Muller, so not the reference's bytes. For tests and benchmarks.
    pub fn random(cfg: &DFlash2Config, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let mut src = RandomSource {
            rng: ChaCha8Rng::seed_from_u64(seed),
            h: cfg.hidden_size,
            rank: cfg.dflash_config.selector_rank,
        };
        build(cfg, &mut src, true)
    }

    /// Whether the conv + selector tensors are present (v2 drafting possible).
    pub fn has_v2(&self) -> bool {
        self.selector.is_some()
    }

    /// The same drafter without conv + selector (a v1-only checkpoint).
    pub fn v1_only(&self) -> Self {
        let mut w = self.clone();
        for l in &mut w.layers {
            l.attn_conv = None;
            l.mlp_conv = None;
        }
        w.selector = None;
        w
    }

    /// Every tensor as the checkpoint stores it (bf16), in `tensor_specs` order.
    pub fn tensors(&self) -> Vec<NamedTensor> {
        let c = &self.cfg;
        let h = c.hidden_size;
        let lin = |name: &str, l: &Linear| {
            NamedTensor::bf16(
                name,
                vec![l.out_features(), l.in_features()],
                &l.weight_f32(),
            )
        };
        let mut out = vec![
            lin("fc.weight", &self.fc),
            NamedTensor::bf16("hidden_norm.weight", vec![h], &self.hidden_norm),
        ];
        for (li, l) in self.layers.iter().enumerate() {
            let p = format!("layers.{li}");
            out.push(NamedTensor::bf16(
                &format!("{p}.input_layernorm.weight"),
                vec![h],
                &l.input_norm,
            ));
            out.push(lin(&format!("{p}.self_attn.q_proj.weight"), &l.q));
            out.push(lin(&format!("{p}.self_attn.k_proj.weight"), &l.k));
            out.push(lin(&format!("{p}.self_attn.v_proj.weight"), &l.v));
            out.push(lin(&format!("{p}.self_attn.o_proj.weight"), &l.o));
            out.push(NamedTensor::bf16(
                &format!("{p}.self_attn.q_norm.weight"),
                vec![c.head_dim],
                &l.q_norm,
            ));
            out.push(NamedTensor::bf16(
                &format!("{p}.self_attn.k_norm.weight"),
                vec![c.head_dim],
                &l.k_norm,
            ));
            out.push(NamedTensor::bf16(
                &format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                &l.post_norm,
            ));
            out.push(lin(&format!("{p}.mlp.gate_proj.weight"), &l.mlp.gate));
            out.push(lin(&format!("{p}.mlp.up_proj.weight"), &l.mlp.up));
            out.push(lin(&format!("{p}.mlp.down_proj.weight"), &l.mlp.down));
            for (conv, w) in [("attention_conv", &l.attn_conv), ("mlp_conv", &l.mlp_conv)] {
                if let Some(w) = w {
                    let k = c.dflash_config.conv_kernel_size;
                    out.push(NamedTensor::bf16(
                        &format!("{p}.{conv}.base_kernel"),
                        vec![2, k, h],
                        &w.base,
                    ));
                    out.push(lin(
                        &format!("{p}.{conv}.kernel_projection.weight"),
                        &w.proj,
                    ));
                }
            }
        }
        out.push(NamedTensor::bf16("norm.weight", vec![h], &self.norm));
        if let Some(s) = &self.selector {
            let (v, r) = (c.vocab_size, c.dflash_config.selector_rank);
            out.push(NamedTensor::bf16(
                "candidate_selector.predecessor_codebook",
                vec![v, r],
                &s.predecessor,
            ));
            out.push(NamedTensor::bf16(
                "candidate_selector.successor_codebook",
                vec![v, r],
                &s.successor,
            ));
            out.push(lin(
                "candidate_selector.hidden_projection.weight",
                &s.hidden_proj,
            ));
        }
        out
    }

    /// Write `dir/config.json` (sorted keys) and `dir/model.safetensors`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let io = |p: &Path, e: std::io::Error| EngineError::Io {
            path: p.display().to_string(),
            reason: e.to_string(),
        };
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let cfg_path = dir.join("config.json");
        std::fs::write(&cfg_path, self.cfg.to_json_string()? + "\n")
            .map_err(|e| io(&cfg_path, e))?;
        write_safetensors(&dir.join("model.safetensors"), &self.tensors())
    }
}
