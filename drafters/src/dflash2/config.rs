//! The DFlash2 drafter's `config.json`, its presets, validation and KV group.
//!
//! Source: docs/dflash2.md §2 (notation), §10 (the HF / vLLM `DFlash2DraftModel` config
//! layout: DFlash keys inside `dflash_config`), §11 (presets, equal to
//! `recipes/dflash2.py::make_config`), §7 ("Mapping onto the allocator": the drafter's
//! own sliding-window KV cache group).
//!
//! Invariants after [`DFlash2Config::validate`]: the fixed keys hold their only supported
//! value (`architectures`, `model_type`, `layer_types`, `is_causal = false`, `hidden_act`,
//! ...); `2 <= block_size <= sliding_window`; `conv_group_size` divides `hidden_size`;
//! `hidden_size == target_hidden_size`; `target_layer_ids` is non-empty and below
//! `num_target_layers`; `mask_token_id < vocab_size`; `1 <= selector_top_k <= vocab_size`;
//! vLLM's optional DFlash2 knobs this contract does not implement are absent or neutral.
//! Every refusal is an [`EngineError::InvalidConfig`] naming the key. Checks against an
//! actual target ([`DFlash2Config::check_target`]) are separate: a config can be valid
//! and still belong to another target.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use speclab_engine::kv::layout::GroupMemory;
use speclab_engine::kv::{CapPolicy, GroupSpec};
use speclab_engine::model::ModelConfig;
use speclab_engine::{EngineError, Result};

/// `architectures[0]` (vLLM's registry name).
pub const ARCHITECTURE: &str = "DFlash2DraftModel";
/// `model_type` (the draft layers are Qwen3 layers).
pub const MODEL_TYPE: &str = "qwen3";
/// The only supported `layer_types` entry.
pub const SLIDING_ATTENTION: &str = "sliding_attention";
/// Name of the drafter's KV cache group (as `engine/src/kv/presets.rs` names it).
pub const KV_GROUP_NAME: &str = "drafter_swa";
/// Preset names (docs/dflash2.md §11).
pub const PRESETS: [&str; 3] = ["dflash2-micro", "dflash2-tiny", "dflash2-glm53-flash"];

/// `dflash_config` (§10).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DFlashSection {
    /// `MASK`: the target's reserved mask token.
    pub mask_token_id: u32,
    /// Target layers whose outputs feed the drafter (§3), in concatenation order.
    pub target_layer_ids: Vec<usize>,
    /// `K`: conv taps.
    pub conv_kernel_size: usize,
    /// `gs`: channels per conv group.
    pub conv_group_size: usize,
    /// `r`: selector codebook rank.
    pub selector_rank: usize,
    /// `k`: selector candidates per position.
    pub selector_top_k: usize,
    /// Other keys (kept for round trips; vLLM's unsupported knobs are refused by `validate`).
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// `training` (§8; ignored at inference).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingSection {
    #[serde(default = "default_gamma")]
    pub loss_decay_gamma: f64,
    #[serde(default = "default_sel_weight")]
    pub selector_loss_weight: f64,
    #[serde(default = "default_anchors")]
    pub num_anchors: usize,
}

fn default_gamma() -> f64 {
    4.0
}
fn default_sel_weight() -> f64 {
    1.0
}
fn default_anchors() -> usize {
    512
}

impl Default for TrainingSection {
    fn default() -> Self {
        Self {
            loss_decay_gamma: default_gamma(),
            selector_loss_weight: default_sel_weight(),
            num_anchors: default_anchors(),
        }
    }
}

/// The drafter's `config.json` (§10). Field names are the HF keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DFlash2Config {
    pub architectures: Vec<String>,
    pub model_type: String,
    /// Informational (`"dflash2-micro"` etc.).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speclab_preset: Option<String>,
    /// Informational (`"micro"` etc.).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_preset: Option<String>,
    /// `H`; must equal the target's (shared embedding and head).
    pub hidden_size: usize,
    /// `V`; the target's.
    pub vocab_size: usize,
    /// `Ld`.
    pub num_hidden_layers: usize,
    /// `nh`.
    pub num_attention_heads: usize,
    /// `nkv`.
    pub num_key_value_heads: usize,
    /// `d`.
    pub head_dim: usize,
    /// `I`.
    pub intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Informational.
    pub max_position_embeddings: usize,
    /// `Ld` x `"sliding_attention"`.
    pub layer_types: Vec<String>,
    /// `W`.
    pub sliding_window: usize,
    pub use_sliding_window: bool,
    pub is_causal: bool,
    /// `B`: anchor + `B - 1` masks.
    pub block_size: usize,
    /// The target's `num_hidden_layers` (range of `target_layer_ids`).
    pub num_target_layers: usize,
    /// The target's `hidden_size` (`F = m * target_hidden_size`).
    pub target_hidden_size: usize,
    pub dflash_config: DFlashSection,
    #[serde(default)]
    pub training: TrainingSection,
    pub hidden_act: String,
    pub attention_bias: bool,
    pub tie_word_embeddings: bool,
    pub torch_dtype: String,
    /// Keys this engine does not read (kept for round trips, ignored unless refused).
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

fn invalid(key: &str, reason: impl Into<String>) -> EngineError {
    EngineError::InvalidConfig {
        key: key.into(),
        reason: reason.into(),
    }
}

/// vLLM DFlash2 knobs this contract does not implement (§10), with the neutral value
/// that is accepted (`None`: only `null` is accepted).
const UNSUPPORTED_KNOBS: [(&str, Option<f64>); 6] = [
    ("input_embedding_scale", Some(1.0)),
    ("output_multiplier", Some(1.0)),
    ("final_logit_softcapping", None),
    ("attention_sink_bias", None),
    ("attention_value_scale", None),
    ("mask_embedding", None),
];

fn check_knobs(extra: &BTreeMap<String, Value>, prefix: &str, vocab: usize) -> Result<()> {
    for (name, neutral) in UNSUPPORTED_KNOBS {
        let Some(v) = extra.get(name) else { continue };
        let ok = v.is_null()
            || matches!((neutral, v.as_f64()), (Some(n), Some(x)) if x == n)
            || v == &Value::Bool(false);
        if !ok {
            return Err(invalid(
                &format!("{prefix}{name}"),
                format!(
                    "{v} is not supported: docs/dflash2.md §10 implements none of vLLM's optional DFlash2 knobs (accepted: {})",
                    neutral.map_or("null / false".to_string(), |n| format!("{n} or null"))
                ),
            ));
        }
    }
    if let Some(v) = extra.get("draft_vocab_size") {
        if v.as_u64() != Some(vocab as u64) && !v.is_null() {
            return Err(invalid(
                &format!("{prefix}draft_vocab_size"),
                format!("{v}: a reduced draft vocabulary (d2t remapping) is not supported; it must equal vocab_size {vocab}"),
            ));
        }
    }
    Ok(())
}

/// Sizes of a preset (`recipes/dflash2.py::_PRESETS`).
struct PresetDims {
    target: &'static str,
    ids: &'static [usize],
    layers: usize,
    nh: usize,
    nkv: usize,
    d: usize,
    inter: usize,
    block: usize,
    window: usize,
    taps: usize,
    gs: usize,
    rank: usize,
    topk: usize,
    theta: f64,
    max_pos: usize,
}

fn preset_dims(name: &str) -> Option<PresetDims> {
    Some(match name {
        "dflash2-micro" => PresetDims {
            target: "micro",
            ids: &[0, 2],
            layers: 2,
            nh: 4,
            nkv: 2,
            d: 32,
            inter: 256,
            block: 8,
            window: 16,
            taps: 2,
            gs: 16,
            rank: 16,
            topk: 8,
            theta: 10000.0,
            max_pos: 256,
        },
        "dflash2-tiny" => PresetDims {
            target: "tiny",
            ids: &[1, 3, 5],
            layers: 3,
            nh: 4,
            nkv: 2,
            d: 64,
            inter: 512,
            block: 8,
            window: 256,
            taps: 2,
            gs: 16,
            rank: 32,
            topk: 8,
            theta: 10000.0,
            max_pos: 4096,
        },
        "dflash2-glm53-flash" => PresetDims {
            target: "glm53-flash",
            ids: &[5, 14, 24, 33, 42],
            layers: 5,
            nh: 32,
            nkv: 8,
            d: 128,
            inter: 12288,
            block: 8,
            window: 2048,
            taps: 2,
            gs: 16,
            rank: 256,
            topk: 16,
            theta: 1_000_000.0,
            max_pos: 262_144,
        },
        _ => return None,
    })
}

/// One tensor of the drafter checkpoint (§9): name and shape (all bf16).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftTensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    /// Part of the conv / selector set (absent in a v1-only checkpoint).
    pub v2: bool,
}

impl DFlash2Config {
    /// A preset (`dflash2-micro`, `dflash2-tiny`, `dflash2-glm53-flash`) over its target
    /// preset, equal to `recipes/dflash2.py::make_config(name)`.
    pub fn preset(name: &str) -> Result<Self> {
        let p = preset_dims(name).ok_or_else(|| {
            invalid(
                "speclab_preset",
                format!(
                    "unknown DFlash2 preset {name:?}; allowed: {}",
                    PRESETS.map(|p| format!("{p:?}")).join(", ")
                ),
            )
        })?;
        let t = ModelConfig::preset(p.target)?;
        let cfg = Self {
            architectures: vec![ARCHITECTURE.into()],
            model_type: MODEL_TYPE.into(),
            speclab_preset: Some(name.into()),
            target_preset: Some(t.preset.clone().unwrap_or_else(|| p.target.into())),
            hidden_size: t.hidden_size,
            vocab_size: t.vocab_size,
            num_hidden_layers: p.layers,
            num_attention_heads: p.nh,
            num_key_value_heads: p.nkv,
            head_dim: p.d,
            intermediate_size: p.inter,
            rms_norm_eps: t.rms_norm_eps,
            rope_theta: p.theta,
            max_position_embeddings: p.max_pos,
            layer_types: vec![SLIDING_ATTENTION.into(); p.layers],
            sliding_window: p.window,
            use_sliding_window: true,
            is_causal: false,
            block_size: p.block,
            num_target_layers: t.num_hidden_layers,
            target_hidden_size: t.hidden_size,
            dflash_config: DFlashSection {
                mask_token_id: t.mask_token_id,
                target_layer_ids: p.ids.to_vec(),
                conv_kernel_size: p.taps,
                conv_group_size: p.gs,
                selector_rank: p.rank,
                selector_top_k: p.topk,
                extra: BTreeMap::new(),
            },
            training: TrainingSection::default(),
            hidden_act: "silu".into(),
            attention_bias: false,
            tie_word_embeddings: false,
            torch_dtype: "bfloat16".into(),
            extra: BTreeMap::new(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parse and validate a `config.json` text (`file` names it in errors).
    pub fn from_json_str(text: &str, file: &str) -> Result<Self> {
        speclab_engine::model::config::parse_json_config(text, file, Self::validate)
    }

    /// Read and validate `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        speclab_engine::model::config::read_json_config(path, Self::validate)
    }

    /// Pretty JSON with sorted keys (the layout `recipes/dflash2.py::save_checkpoint` writes).
    pub fn to_json_string(&self) -> Result<String> {
        speclab_engine::model::config::json_config_string(self)
    }

    /// Refuse invalid or unsupported values, naming the key (module doc).
    pub fn validate(&self) -> Result<()> {
        self.check_identity()?;
        self.check_dims()?;
        self.check_layers()?;
        self.check_dflash_config()?;
        self.check_fixed()?;
        check_knobs(&self.extra, "", self.vocab_size)?;
        check_knobs(&self.dflash_config.extra, "dflash_config.", self.vocab_size)?;
        Ok(())
    }

    /// `architectures` and `model_type`.
    fn check_identity(&self) -> Result<()> {
        if self.architectures != [ARCHITECTURE] {
            return Err(invalid(
                "architectures",
                format!("{:?}: must be [{ARCHITECTURE:?}]", self.architectures),
            ));
        }
        if self.model_type != MODEL_TYPE {
            return Err(invalid(
                "model_type",
                format!("{:?}: must be {MODEL_TYPE:?}", self.model_type),
            ));
        }
        Ok(())
    }

    /// Sizes, heads, RoPE and norm constants.
    fn check_dims(&self) -> Result<()> {
        let pos = |key: &str, v: usize| {
            if v == 0 {
                Err(invalid(key, "must be > 0"))
            } else {
                Ok(())
            }
        };
        pos("hidden_size", self.hidden_size)?;
        pos("vocab_size", self.vocab_size)?;
        pos("num_hidden_layers", self.num_hidden_layers)?;
        pos("num_attention_heads", self.num_attention_heads)?;
        pos("num_key_value_heads", self.num_key_value_heads)?;
        pos("head_dim", self.head_dim)?;
        pos("intermediate_size", self.intermediate_size)?;
        pos("sliding_window", self.sliding_window)?;
        pos("num_target_layers", self.num_target_layers)?;
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(invalid(
                "num_attention_heads",
                format!(
                    "{} is not a multiple of num_key_value_heads {}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "head_dim",
                format!("{} must be even (rotate-half RoPE)", self.head_dim),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(invalid(
                "rms_norm_eps",
                format!("{} must be finite and > 0", self.rms_norm_eps),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(invalid(
                "rope_theta",
                format!("{} must be finite and > 0", self.rope_theta),
            ));
        }
        Ok(())
    }

    /// Every layer sliding-window, non-causal, the block inside the window, the shared
    /// hidden size.
    fn check_layers(&self) -> Result<()> {
        if self.layer_types.len() != self.num_hidden_layers
            || self.layer_types.iter().any(|t| t != SLIDING_ATTENTION)
        {
            return Err(invalid(
                "layer_types",
                format!(
                    "{:?}: must be num_hidden_layers = {} x {SLIDING_ATTENTION:?} (every DFlash2 layer is sliding-window)",
                    self.layer_types, self.num_hidden_layers
                ),
            ));
        }
        if !self.use_sliding_window {
            return Err(invalid("use_sliding_window", "must be true"));
        }
        if self.is_causal {
            return Err(invalid(
                "is_causal",
                "must be false: DFlash2 attention is non-causal within the block (docs/dflash2.md §5.2)",
            ));
        }
        if self.block_size < 2 {
            return Err(invalid(
                "block_size",
                format!(
                    "{} must be >= 2 (an anchor plus at least one mask)",
                    self.block_size
                ),
            ));
        }
        if self.block_size > self.sliding_window {
            return Err(invalid(
                "block_size",
                format!(
                    "{} must be <= sliding_window {}",
                    self.block_size, self.sliding_window
                ),
            ));
        }
        if self.hidden_size != self.target_hidden_size {
            return Err(invalid(
                "hidden_size",
                format!(
                    "{} must equal target_hidden_size {} (the drafter shares the target's embedding and lm_head)",
                    self.hidden_size, self.target_hidden_size
                ),
            ));
        }
        Ok(())
    }

    /// `dflash_config`: target layers, mask token, conv and selector knobs.
    fn check_dflash_config(&self) -> Result<()> {
        let dc = &self.dflash_config;
        if dc.target_layer_ids.is_empty() {
            return Err(invalid(
                "dflash_config.target_layer_ids",
                "must name at least one target layer",
            ));
        }
        if let Some(&bad) = dc
            .target_layer_ids
            .iter()
            .find(|&&i| i >= self.num_target_layers)
        {
            return Err(invalid(
                "dflash_config.target_layer_ids",
                format!(
                    "layer {bad} in {:?} is out of range: num_target_layers = {}",
                    dc.target_layer_ids, self.num_target_layers
                ),
            ));
        }
        if dc.mask_token_id as usize >= self.vocab_size {
            return Err(invalid(
                "dflash_config.mask_token_id",
                format!(
                    "{} is not below vocab_size {}",
                    dc.mask_token_id, self.vocab_size
                ),
            ));
        }
        if dc.conv_kernel_size == 0 {
            return Err(invalid("dflash_config.conv_kernel_size", "must be >= 1"));
        }
        if dc.conv_group_size == 0 || !self.hidden_size.is_multiple_of(dc.conv_group_size) {
            return Err(invalid(
                "dflash_config.conv_group_size",
                format!(
                    "{} must be > 0 and divide hidden_size {}",
                    dc.conv_group_size, self.hidden_size
                ),
            ));
        }
        if dc.selector_rank == 0 {
            return Err(invalid("dflash_config.selector_rank", "must be >= 1"));
        }
        if dc.selector_top_k == 0 || dc.selector_top_k > self.vocab_size {
            return Err(invalid(
                "dflash_config.selector_top_k",
                format!(
                    "{} must be in 1..={} (vocab_size)",
                    dc.selector_top_k, self.vocab_size
                ),
            ));
        }
        Ok(())
    }

    /// Values the format fixes: activation, no biases, untied embeddings, bf16.
    fn check_fixed(&self) -> Result<()> {
        if self.hidden_act != "silu" {
            return Err(invalid(
                "hidden_act",
                format!("{:?}: only \"silu\" is supported", self.hidden_act),
            ));
        }
        if self.attention_bias {
            return Err(invalid(
                "attention_bias",
                "must be false (no biases anywhere, docs/dflash2.md §1.4)",
            ));
        }
        if self.tie_word_embeddings {
            return Err(invalid(
                "tie_word_embeddings",
                "must be false (the drafter uses the target's untied embed_tokens and lm_head)",
            ));
        }
        if self.torch_dtype != "bfloat16" {
            return Err(invalid(
                "torch_dtype",
                format!("{:?}: must be \"bfloat16\" (§1.1)", self.torch_dtype),
            ));
        }
        Ok(())
    }

    /// Check that this drafter fits `target`: equal `hidden_size` and `vocab_size` (shared
    /// embedding and head), `target_hidden_size` equal to the target's, every
    /// `target_layer_ids` entry a decoder layer of the target.
    pub fn check_target(&self, target: &ModelConfig) -> Result<()> {
        if self.hidden_size != target.hidden_size {
            return Err(invalid(
                "hidden_size",
                format!(
                    "the drafter's hidden_size {} differs from the target's {} (the drafter shares the target's embed_tokens and lm_head)",
                    self.hidden_size, target.hidden_size
                ),
            ));
        }
        if self.target_hidden_size != target.hidden_size {
            return Err(invalid(
                "target_hidden_size",
                format!(
                    "{} differs from the target's hidden_size {}",
                    self.target_hidden_size, target.hidden_size
                ),
            ));
        }
        if self.vocab_size != target.vocab_size {
            return Err(invalid(
                "vocab_size",
                format!(
                    "the drafter's vocab_size {} differs from the target's {} (shared embed_tokens / lm_head)",
                    self.vocab_size, target.vocab_size
                ),
            ));
        }
        let ids = &self.dflash_config.target_layer_ids;
        if let Some(&bad) = ids.iter().find(|&&i| i >= target.num_hidden_layers) {
            return Err(invalid(
                "dflash_config.target_layer_ids",
                format!(
                    "layer {bad} in {ids:?} is out of range for the target, which has {} decoder layers (0..{})",
                    target.num_hidden_layers, target.num_hidden_layers
                ),
            ));
        }
        Ok(())
    }

    /// Check a runtime `num_speculative_tokens` (`1 <= N <= block_size - 1`, §2).
    pub fn check_num_speculative_tokens(&self, n: usize) -> Result<()> {
        if n == 0 || n > self.block_size - 1 {
            return Err(EngineError::InvalidDrafterConfig {
                drafter: "dflash2".into(),
                reason: format!(
                    "num_speculative_tokens = {n} is out of range: it must be in 1..={} (block_size {} - 1)",
                    self.block_size - 1,
                    self.block_size
                ),
            });
        }
        Ok(())
    }

    /// `m`: target layers feeding the drafter.
    pub fn num_feature_layers(&self) -> usize {
        self.dflash_config.target_layer_ids.len()
    }
    /// `F = m * target_hidden_size`: width of one feature row.
    pub fn feature_dim(&self) -> usize {
        self.num_feature_layers() * self.target_hidden_size
    }
    /// `G = H / gs`: conv groups.
    pub fn conv_groups(&self) -> usize {
        self.hidden_size / self.dflash_config.conv_group_size
    }
    /// `nkv * d`: values of one token's K (or V) in one layer.
    pub fn kv_row(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
    /// f32 values of one layer's page of a KV block of `block_size` tokens (K and V).
    pub fn kv_page_floats(&self, block_size: usize) -> usize {
        2 * block_size * self.kv_row()
    }
    /// Bytes of K + V per token over all drafter layers at `dtype_bytes` per value
    /// (4 for this engine's f32 cache; 2 for vLLM's bf16: 5 x 4,096 B for `glm53-flash`).
    pub fn kv_bytes_per_token(&self, dtype_bytes: usize) -> u64 {
        (self.num_hidden_layers * 2 * self.kv_row() * dtype_bytes) as u64
    }
    /// Token slots `allocate_slots` must reserve beyond the scheduled tokens for a draft
    /// of `num_speculative_tokens` (vLLM DFlash's `num_lookahead_tokens = N + 1`, §7).
    pub fn lookahead_slots(num_speculative_tokens: usize) -> usize {
        num_speculative_tokens + 1
    }
    /// Most blocks of the drafter group live for one request during a step (§7:
    /// `cdiv(W + N, bs) + 1`; 130 for `glm53-flash`, bs 16, N = 7).
    pub fn max_live_blocks(&self, block_size: usize, num_speculative_tokens: usize) -> usize {
        (self.sliding_window + num_speculative_tokens).div_ceil(block_size) + 1
    }

    /// The drafter's sliding-window KV cache group `drafter_swa` (§7): block size
    /// `block_size` (the engine layout's choice; 16 in the card's stack), window
    /// `sliding_window`, cap policy `cap`, and `memory` = `num_hidden_layers` layers x
    /// `2 * block_size * nkv * d * 4` bytes (this engine's f32 cache) for pool sizing.
    pub fn kv_group(&self, block_size: u32, cap: CapPolicy) -> Result<GroupSpec> {
        if block_size == 0 {
            return Err(invalid("<kv group>.block_size", "must be > 0"));
        }
        let window = u32::try_from(self.sliding_window)
            .map_err(|_| invalid("sliding_window", "exceeds u32"))?;
        let mut g = GroupSpec::sliding_window(KV_GROUP_NAME, block_size, window, cap);
        g.memory = Some(GroupMemory {
            num_layers: self.num_hidden_layers as u32,
            page_size_bytes: 4 * self.kv_page_floats(block_size as usize) as u64,
        });
        Ok(g)
    }

    /// Every tensor of the checkpoint in `recipes/dflash2.py::tensor_specs` order (§9).
    pub fn tensor_specs(&self, include_v2: bool) -> Vec<DraftTensorSpec> {
        let (h, v, l) = (self.hidden_size, self.vocab_size, self.num_hidden_layers);
        let (nh, nkv, d, i) = (
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.intermediate_size,
        );
        let (k, g, r) = (
            self.dflash_config.conv_kernel_size,
            self.conv_groups(),
            self.dflash_config.selector_rank,
        );
        let mut out = Vec::new();
        let mut push = |name: String, shape: Vec<usize>, v2: bool| {
            if include_v2 || !v2 {
                out.push(DraftTensorSpec { name, shape, v2 });
            }
        };
        push("fc.weight".into(), vec![h, self.feature_dim()], false);
        push("hidden_norm.weight".into(), vec![h], false);
        for li in 0..l {
            let p = format!("layers.{li}");
            push(format!("{p}.input_layernorm.weight"), vec![h], false);
            push(
                format!("{p}.self_attn.q_proj.weight"),
                vec![nh * d, h],
                false,
            );
            push(
                format!("{p}.self_attn.k_proj.weight"),
                vec![nkv * d, h],
                false,
            );
            push(
                format!("{p}.self_attn.v_proj.weight"),
                vec![nkv * d, h],
                false,
            );
            push(
                format!("{p}.self_attn.o_proj.weight"),
                vec![h, nh * d],
                false,
            );
            push(format!("{p}.self_attn.q_norm.weight"), vec![d], false);
            push(format!("{p}.self_attn.k_norm.weight"), vec![d], false);
            push(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                false,
            );
            push(format!("{p}.mlp.gate_proj.weight"), vec![i, h], false);
            push(format!("{p}.mlp.up_proj.weight"), vec![i, h], false);
            push(format!("{p}.mlp.down_proj.weight"), vec![h, i], false);
            for conv in ["attention_conv", "mlp_conv"] {
                push(format!("{p}.{conv}.base_kernel"), vec![2, k, h], true);
                push(
                    format!("{p}.{conv}.kernel_projection.weight"),
                    vec![2 * k * g, h],
                    true,
                );
            }
        }
        push("norm.weight".into(), vec![h], false);
        push(
            "candidate_selector.predecessor_codebook".into(),
            vec![v, r],
            true,
        );
        push(
            "candidate_selector.successor_codebook".into(),
            vec![v, r],
            true,
        );
        push(
            "candidate_selector.hidden_projection.weight".into(),
            vec![r, h],
            true,
        );
        out
    }

    /// Parameters of the checkpoint (`recipes/dflash2.py::count_params`; excludes the shared
    /// embedding and head).
    pub fn num_parameters(&self, include_v2: bool) -> u64 {
        self.tensor_specs(include_v2)
            .iter()
            .map(|s| s.shape.iter().product::<usize>() as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_count() {
        let m = DFlash2Config::preset("dflash2-micro").unwrap();
        assert_eq!(m.num_parameters(true), 365_440);
        assert_eq!(m.num_parameters(false), 328_576);
        let t = DFlash2Config::preset("dflash2-tiny").unwrap();
        assert_eq!(t.num_parameters(true), 2_605_952);
        assert_eq!(t.num_parameters(false), 1_968_512);
        let g = DFlash2Config::preset("dflash2-glm53-flash").unwrap();
        assert_eq!(g.num_parameters(true), 1_171_080_448);
        assert_eq!(g.num_parameters(false), 1_048_626_432);
        assert_eq!(g.kv_bytes_per_token(2), 5 * 4096);
        assert_eq!(g.max_live_blocks(16, 7), 130);
        assert!(DFlash2Config::preset("nope").is_err());
    }
}
