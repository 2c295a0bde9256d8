//! `config.json` of the target model (`speclab_glm5_next_tiny`) and its presets.
//!
//! Source: docs/model.md §9 (keys, HF spelling: DeepSeek-V3 / GLM MoE names,
//! Qwen3-Next-style flat linear-attention names), §8 (`quantization_config`, the
//! compressed-tensors 0.17 shape) and §10 (presets); the reference is
//! `recipes/model.py` (`make_config`, `validate_config`, `quantization_config`).
//!
//! Invariants: a [`ModelConfig`] that passed [`ModelConfig::validate`] describes a
//! model the engine implements exactly: every unsupported value (scoring function,
//! routing method, grouped routing, activation, more than one MTP layer, layer types,
//! head counts, quantization scheme) is refused with an error that names the key and
//! the allowed values. [`QuantizationConfig`] (parse, validate, write) and [`IgnoreList`]
//! (compressed-tensors `ignore` matching) are speclab's only ones (`speclab-quant` uses
//! them too). Unknown extra keys (e.g. `transformers_version`) are kept in
//! [`ModelConfig::extra`] and ignored. The presets equal `make_config(preset)`
//! key for key (tested against `tests/fixtures/model/config.json`).
//!
//! KV layout ([`ModelConfig::kv_layout`]): one `full` group holds the K/V of every
//! full-attention decoder layer **and** of the MTP layer (they share block tables:
//! the MTP layer attends over the same positions as the target); one `state` group
//! holds the KDA layers' recurrent state in vLLM's Mamba "none" mode (1 + N blocks a
//! request for N speculative tokens, see `model/kv_store.rs`).

use std::collections::BTreeMap;
use std::path::Path;

use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::kv::layout::GroupMemory;
use crate::kv::{GroupSpec, KvLayout};
use crate::{EngineError, Result};

/// The model type this engine implements.
pub const MODEL_TYPE: &str = "speclab_glm5_next_tiny";
/// The architecture name written by `recipes/model.py`.
pub const ARCHITECTURE: &str = "SpeclabGlm5NextForCausalLM";
/// INT4 group size (docs/model.md §8).
pub const GROUP_SIZE: usize = 128;
/// compressed-tensors version whose `quantization_config` shape is written (§8).
pub const COMPRESSED_TENSORS_VERSION: &str = "0.17.0";
/// Special ids at the end of the vocab: bos, eos, pad, mask, 4 reserved (§10).
pub const NUM_SPECIAL: usize = 8;
/// `layer_types` entry of a KDA layer.
pub const LINEAR_ATTENTION: &str = "linear_attention";
/// `layer_types` entry of a full-attention layer.
pub const FULL_ATTENTION: &str = "full_attention";
/// Name of the full-attention KV cache group in [`ModelConfig::kv_layout`].
pub const FULL_GROUP: &str = "full";
/// Name of the KDA state group in [`ModelConfig::kv_layout`].
pub const STATE_GROUP: &str = "kda_state";

/// Kind of a decoder layer's token mixer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// GQA + RoPE full attention (§3).
    FullAttention,
    /// Kimi Delta Attention (§4).
    Kda,
}

/// `config.json` (§9). Field names are the HF keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub model_type: String,
    pub architectures: Vec<String>,
    /// Informational preset name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    /// `num_hidden_layers` entries, `"linear_attention"` or `"full_attention"`.
    pub layer_types: Vec<String>,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub linear_num_heads: usize,
    pub linear_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    pub intermediate_size: usize,
    pub first_k_dense_replace: usize,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_shared_experts: usize,
    pub moe_intermediate_size: usize,
    pub routed_scaling_factor: f64,
    pub norm_topk_prob: bool,
    pub scoring_func: String,
    pub topk_method: String,
    pub n_group: usize,
    pub topk_group: usize,
    pub num_nextn_predict_layers: usize,
    pub rms_norm_eps: f64,
    pub hidden_act: String,
    pub attention_bias: bool,
    pub tie_word_embeddings: bool,
    pub torch_dtype: String,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub pad_token_id: u32,
    pub mask_token_id: u32,
    /// Present in W4A16 checkpoints only (§8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization_config: Option<QuantizationConfig>,
    /// Keys this engine does not read (kept for round trips, ignored).
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// compressed-tensors 0.17 `QuantizationConfig` as llm-compressor writes it (§8).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantizationConfig {
    pub config_groups: BTreeMap<String, QuantGroup>,
    pub format: String,
    #[serde(default)]
    pub global_compression_ratio: Option<Value>,
    #[serde(default)]
    pub ignore: Vec<String>,
    #[serde(default)]
    pub kv_cache_scheme: Option<Value>,
    pub quant_method: String,
    #[serde(default = "default_status")]
    pub quantization_status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sparsity_config: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform_config: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

fn default_status() -> String {
    "compressed".into()
}

/// One `config_groups` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantGroup {
    #[serde(default)]
    pub format: Option<String>,
    #[serde(default)]
    pub input_activations: Option<Value>,
    #[serde(default)]
    pub output_activations: Option<Value>,
    pub targets: Vec<String>,
    #[serde(default)]
    pub weights: Option<QuantArgs>,
}

/// compressed-tensors `QuantizationArgs` of the weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantArgs {
    #[serde(default)]
    pub actorder: Option<Value>,
    #[serde(default)]
    pub block_structure: Option<Value>,
    #[serde(default)]
    pub dynamic: Value,
    #[serde(default)]
    pub group_size: Option<i64>,
    pub num_bits: u32,
    #[serde(default)]
    pub observer: Option<String>,
    #[serde(default)]
    pub observer_kwargs: Option<Value>,
    #[serde(default)]
    pub scale_dtype: Option<Value>,
    #[serde(default)]
    pub strategy: Option<String>,
    pub symmetric: bool,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub zp_dtype: Option<Value>,
}

/// Parse an HF-style JSON config and validate it (shared by the target's and the
/// drafters' configs): errors name the file (`file:line:col` for syntax and type
/// errors, `(in file)` after a refused key). A UTF-8 byte-order mark is accepted.
pub fn parse_json_config<T: serde::de::DeserializeOwned>(
    text: &str,
    file: &str,
    validate: impl Fn(&T) -> Result<()>,
) -> Result<T> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let cfg: T = serde_json::from_str(text).map_err(|e| {
        let msg = e.to_string();
        let msg = match msg.rfind(" at line ") {
            Some(k) if e.line() != 0 => msg[..k].to_string(),
            _ => msg,
        };
        EngineError::ConfigParse {
            file: format!("{file}:{}:{}", e.line(), e.column()),
            reason: msg,
        }
    })?;
    validate(&cfg).map_err(|e| match e {
        EngineError::InvalidConfig { key, reason } => EngineError::InvalidConfig {
            key,
            reason: format!("{reason} (in {file})"),
        },
        other => other,
    })?;
    Ok(cfg)
}

/// Read, parse and validate a JSON config file.
pub fn read_json_config<T: serde::de::DeserializeOwned>(
    path: &Path,
    validate: impl Fn(&T) -> Result<()>,
) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| EngineError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    parse_json_config(&text, &path.display().to_string(), validate)
}

/// Pretty JSON with sorted keys (serde_json's map is ordered).
pub fn json_config_string<T: Serialize>(cfg: &T) -> Result<String> {
    let v = serde_json::to_value(cfg).map_err(|e| invalid("<serialize>", e.to_string()))?;
    serde_json::to_string_pretty(&v).map_err(|e| invalid("<serialize>", e.to_string()))
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> EngineError {
    EngineError::InvalidConfig {
        key: key.into(),
        reason: reason.into(),
    }
}

fn must_equal<T: PartialEq + std::fmt::Debug>(key: &str, got: &T, allowed: &T) -> Result<()> {
    if got != allowed {
        return Err(invalid(key, format!("got {got:?}, allowed: {allowed:?}")));
    }
    Ok(())
}

fn positive(key: &str, v: usize) -> Result<()> {
    if v == 0 {
        return Err(invalid(key, "must be > 0"));
    }
    Ok(())
}

impl QuantizationConfig {
    /// The `quantization_config` `recipes/model.py::quantization_config` writes for `cfg`:
    /// every Linear is a target; ignored: lm_head, attention, KDA, router, shared experts,
    /// the dense-FFN prefix and the MTP layer (so exactly the routed experts of layers
    /// `first_k_dense_replace .. L-1` are quantized).
    pub fn for_model(cfg: &ModelConfig) -> Self {
        let l = cfg.num_hidden_layers;
        let k = cfg.first_k_dense_replace;
        let mut ignore: Vec<String> = [
            "lm_head",
            "re:.*self_attn.*",
            "re:.*linear_attn.*",
            r"re:.*mlp\.gate$",
            "re:.*shared_experts.*",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if k > 0 {
            let dense = if k == 1 {
                "0".to_string()
            } else {
                format!(
                    "({})",
                    (0..k).map(|i| i.to_string()).collect::<Vec<_>>().join("|")
                )
            };
            ignore.push(format!(r"re:model\.layers\.{dense}\.mlp\..*"));
        }
        if cfg.num_nextn_predict_layers > 0 {
            ignore.push(format!(r"re:model\.layers\.{l}\..*"));
        }
        Self::new(ignore)
    }

    /// The W4A16 scheme (symmetric INT4, group 128, static, weights only, one group
    /// targeting `Linear`, `pack-quantized`, compressed-tensors 0.17) with `ignore`: the
    /// only part that varies between checkpoints.
    pub fn new(ignore: Vec<String>) -> Self {
        let weights = QuantArgs {
            actorder: None,
            block_structure: None,
            dynamic: Value::Bool(false),
            group_size: Some(GROUP_SIZE as i64),
            num_bits: 4,
            observer: Some("memoryless_minmax".into()),
            observer_kwargs: Some(Value::Object(Default::default())),
            scale_dtype: None,
            strategy: Some("group".into()),
            symmetric: true,
            kind: "int".into(),
            zp_dtype: None,
        };
        let group = QuantGroup {
            format: None,
            input_activations: None,
            output_activations: None,
            targets: vec!["Linear".into()],
            weights: Some(weights),
        };
        Self {
            config_groups: [("group_0".to_string(), group)].into_iter().collect(),
            format: "pack-quantized".into(),
            global_compression_ratio: None,
            ignore,
            kv_cache_scheme: None,
            quant_method: "compressed-tensors".into(),
            quantization_status: "compressed".into(),
            sparsity_config: Some(Value::Object(Default::default())),
            transform_config: Some(Value::Object(Default::default())),
            version: Some(COMPRESSED_TENSORS_VERSION.into()),
        }
    }

    /// The JSON value as `config.json` stores it (keys sorted, docs/model.md §8).
    pub fn to_json(&self) -> Value {
        // Serializing these field types (strings, numbers, maps with string keys) cannot fail.
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// Parse a `quantization_config` JSON value and [`validate`](Self::validate) it.
    pub fn from_json(v: &Value) -> Result<Self> {
        let q: Self = serde_json::from_value(v.clone())
            .map_err(|e| invalid("quantization_config", e.to_string()))?;
        q.validate()?;
        Ok(q)
    }

    /// Refuse anything but symmetric INT4 group-128 `pack-quantized` weights-only
    /// quantization of Linear layers (W4A16 as compressed-tensors writes it).
    pub fn validate(&self) -> Result<()> {
        let k = |s: &str| format!("quantization_config.{s}");
        must_equal(
            &k("quant_method"),
            &self.quant_method.as_str(),
            &"compressed-tensors",
        )?;
        must_equal(&k("format"), &self.format.as_str(), &"pack-quantized")?;
        must_equal(
            &k("quantization_status"),
            &self.quantization_status.as_str(),
            &"compressed",
        )?;
        if self.kv_cache_scheme.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(invalid(
                k("kv_cache_scheme"),
                "KV cache quantization is not supported; allowed: null",
            ));
        }
        for (name, v) in [
            ("sparsity_config", &self.sparsity_config),
            ("transform_config", &self.transform_config),
        ] {
            let empty = match v {
                None | Some(Value::Null) => true,
                Some(Value::Object(m)) => m.is_empty(),
                _ => false,
            };
            if !empty {
                return Err(invalid(k(name), "not supported; allowed: {} or null"));
            }
        }
        if self.config_groups.is_empty() {
            return Err(invalid(k("config_groups"), "must have at least one group"));
        }
        for (gname, g) in &self.config_groups {
            check_group(gname, g)?;
        }
        self.ignore_matcher()?;
        Ok(())
    }

    /// The ignore list as a matcher (exact names and anchored-at-start `re:` regexes).
    pub fn ignore_matcher(&self) -> Result<IgnoreList> {
        IgnoreList::new(&self.ignore)
    }
}

/// One `config_groups` entry: Linear targets, weights-only symmetric INT4 group 128.
fn check_group(gname: &str, g: &QuantGroup) -> Result<()> {
    let gk = |s: &str| format!("quantization_config.config_groups.{gname}.{s}");
    if g.targets != ["Linear"] {
        return Err(invalid(
            gk("targets"),
            format!("got {:?}, allowed: [\"Linear\"]", g.targets),
        ));
    }
    if let Some(f) = &g.format {
        must_equal(&gk("format"), &f.as_str(), &"pack-quantized")?;
    }
    for (name, v) in [
        ("input_activations", &g.input_activations),
        ("output_activations", &g.output_activations),
    ] {
        if v.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(invalid(
                gk(name),
                "activation quantization is not supported (W4A16); allowed: null",
            ));
        }
    }
    let w = g
        .weights
        .as_ref()
        .ok_or_else(|| invalid(gk("weights"), "required (W4A16 quantizes weights)"))?;
    must_equal(&gk("weights.num_bits"), &w.num_bits, &4)?;
    must_equal(&gk("weights.type"), &w.kind.as_str(), &"int")?;
    if !w.symmetric {
        return Err(invalid(
            gk("weights.symmetric"),
            "asymmetric quantization (zero points) is not supported; allowed: true",
        ));
    }
    must_equal(
        &gk("weights.strategy"),
        &w.strategy.as_deref().unwrap_or("null"),
        &"group",
    )?;
    must_equal(
        &gk("weights.group_size"),
        &w.group_size
            .map_or("null".to_string(), |g| g.to_string())
            .as_str(),
        &"128",
    )?;
    // "weight" / "static" only change GPTQ's calibration order (groups stay
    // contiguous, nothing extra is stored); "group" / "dynamic" / true need g_idx.
    let no_g_idx = match &w.actorder {
        None | Some(Value::Null) | Some(Value::Bool(false)) => true,
        Some(Value::String(a)) => a == "weight" || a == "static",
        _ => false,
    };
    if !no_g_idx {
        return Err(invalid(
                gk("weights.actorder"),
                format!(
                    "got {}; activation ordering with g_idx is not supported; allowed: null, false, \"weight\", \"static\"",
                    w.actorder.as_ref().map_or("null".to_string(), |v| v.to_string())
                ),
            ));
    }
    if !matches!(w.dynamic, Value::Null | Value::Bool(false)) {
        return Err(invalid(
            gk("weights.dynamic"),
            format!("got {}, allowed: false", w.dynamic),
        ));
    }
    if w.block_structure.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(invalid(
            gk("weights.block_structure"),
            "not supported; allowed: null",
        ));
    }
    Ok(())
}

/// compressed-tensors `ignore` semantics: an entry matches a module name if it equals
/// it, or starts with `re:` and the rest matches at the start of the name (Python
/// `re.match`: anchored at the start only). Regexes use the `regex` crate (no
/// look-around / back-references: such entries do not compile); Python's `$` also
/// matches before a trailing newline, which module names never contain.
#[derive(Debug, Clone)]
pub struct IgnoreList {
    exact: Vec<String>,
    /// Shape: [regex entries]; (the entry, the rest compiled as `^(?:rest)`).
    regexes: Vec<(String, Regex)>,
}

impl IgnoreList {
    /// Compile the entries; an invalid regex is an error naming it
    /// (`quantization_config.ignore[i]`).
    pub fn new(entries: &[String]) -> Result<Self> {
        Self::compile(entries, |i, entry, err| {
            let rest = entry.strip_prefix("re:").unwrap_or(entry);
            invalid(
                format!("quantization_config.ignore[{i}]"),
                format!("invalid regex {rest:?}: {err}"),
            )
        })
    }

    /// Compile the entries, building the error of the first `re:` entry that does not
    /// compile with `on_err(index, entry, regex error)`.
    pub fn compile<E>(
        entries: &[String],
        on_err: impl Fn(usize, &str, regex::Error) -> E,
    ) -> std::result::Result<Self, E> {
        let mut exact = Vec::new();
        let mut regexes = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            if let Some(rest) = e.strip_prefix("re:") {
                let r = Regex::new(&format!("^(?:{rest})")).map_err(|err| on_err(i, e, err))?;
                regexes.push((e.clone(), r));
            } else {
                exact.push(e.clone());
            }
        }
        Ok(Self { exact, regexes })
    }

    /// The first entry that matches `module` (exact names first, then the regexes in order).
    pub fn matching_entry(&self, module: &str) -> Option<&str> {
        if let Some(e) = self.exact.iter().find(|e| e.as_str() == module) {
            return Some(e);
        }
        self.regexes
            .iter()
            .find(|(_, re)| re.is_match(module))
            .map(|(e, _)| e.as_str())
    }

    /// Whether a module (tensor name without `.weight`) is ignored.
    pub fn matches(&self, module: &str) -> bool {
        self.matching_entry(module).is_some()
    }

    /// True iff no entry matches `module` (the caller knows `module` is a Linear target).
    pub fn is_quantized(&self, module: &str) -> bool {
        !self.matches(module)
    }
}

struct PresetDims {
    vocab: usize,
    hidden: usize,
    layers: usize,
    period: usize,
    nh: usize,
    nkv: usize,
    d: usize,
    nl: usize,
    dl: usize,
    inter: usize,
    dense: usize,
    experts: usize,
    topk: usize,
    moe_inter: usize,
    theta: f64,
    max_pos: usize,
}

/// `recipes/model.py::default_layer_types`: `period - 1` KDA layers then one full.
pub fn default_layer_types(n_layers: usize, period: usize) -> Vec<String> {
    (0..n_layers)
        .map(|i| {
            if (i + 1) % period == 0 {
                FULL_ATTENTION
            } else {
                LINEAR_ATTENTION
            }
            .to_string()
        })
        .collect()
}

impl ModelConfig {
    fn from_dims(name: &str, p: PresetDims) -> Self {
        let v = p.vocab as u32;
        let s = NUM_SPECIAL as u32;
        Self {
            model_type: MODEL_TYPE.into(),
            architectures: vec![ARCHITECTURE.into()],
            preset: Some(name.into()),
            vocab_size: p.vocab,
            hidden_size: p.hidden,
            num_hidden_layers: p.layers,
            layer_types: default_layer_types(p.layers, p.period),
            num_attention_heads: p.nh,
            num_key_value_heads: p.nkv,
            head_dim: p.d,
            rope_theta: p.theta,
            max_position_embeddings: p.max_pos,
            linear_num_heads: p.nl,
            linear_head_dim: p.dl,
            linear_conv_kernel_dim: 4,
            intermediate_size: p.inter,
            first_k_dense_replace: p.dense,
            n_routed_experts: p.experts,
            num_experts_per_tok: p.topk,
            n_shared_experts: 1,
            moe_intermediate_size: p.moe_inter,
            routed_scaling_factor: 2.5,
            norm_topk_prob: true,
            scoring_func: "sigmoid".into(),
            topk_method: "noaux_tc".into(),
            n_group: 1,
            topk_group: 1,
            num_nextn_predict_layers: 1,
            rms_norm_eps: 1e-5,
            hidden_act: "silu".into(),
            attention_bias: false,
            tie_word_embeddings: false,
            torch_dtype: "bfloat16".into(),
            bos_token_id: v - s,
            eos_token_id: v - s + 1,
            pad_token_id: v - s + 2,
            mask_token_id: v - s + 3,
            quantization_config: None,
            extra: BTreeMap::new(),
        }
    }

    /// `make_config("micro")`: the committed test fixture (1.44 M parameters).
    pub fn micro() -> Self {
        Self::from_dims(
            "micro",
            PresetDims {
                vocab: 512,
                hidden: 128,
                layers: 4,
                period: 4,
                nh: 4,
                nkv: 2,
                d: 32,
                nl: 2,
                dl: 32,
                inter: 128,
                dense: 1,
                experts: 4,
                topk: 2,
                moe_inter: 128,
                theta: 10000.0,
                max_pos: 256,
            },
        )
    }

    /// `make_config("tiny")`: the CPU-test / benchmark target (20.9 M parameters).
    pub fn tiny() -> Self {
        Self::from_dims(
            "tiny",
            PresetDims {
                vocab: 8192 + NUM_SPECIAL,
                hidden: 256,
                layers: 8,
                period: 4,
                nh: 4,
                nkv: 2,
                d: 64,
                nl: 4,
                dl: 64,
                inter: 768,
                dense: 1,
                experts: 16,
                topk: 2,
                moe_inter: 128,
                theta: 10000.0,
                max_pos: 4096,
            },
        )
    }

    /// `make_config("glm53-flash")`: the card's shapes (config only: memory planning).
    pub fn glm53_flash() -> Self {
        Self::from_dims(
            "glm53-flash",
            PresetDims {
                vocab: 154_880,
                hidden: 4096,
                layers: 45,
                period: 5,
                nh: 32,
                nkv: 8,
                d: 128,
                nl: 32,
                dl: 128,
                inter: 12288,
                dense: 3,
                experts: 288,
                topk: 8,
                moe_inter: 2048,
                theta: 1_000_000.0,
                max_pos: 262_144,
            },
        )
    }

    /// A preset by name (`micro`, `tiny`, `glm53-flash`).
    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "micro" => Ok(Self::micro()),
            "tiny" => Ok(Self::tiny()),
            "glm53-flash" => Ok(Self::glm53_flash()),
            other => Err(invalid(
                "preset",
                format!("unknown preset {other:?}; allowed: \"micro\", \"tiny\", \"glm53-flash\""),
            )),
        }
    }

    /// This config plus the W4A16 `quantization_config` of [`QuantizationConfig::for_model`].
    pub fn with_quantization(mut self) -> Self {
        self.quantization_config = Some(QuantizationConfig::for_model(&self));
        self
    }

    /// Parse and validate a `config.json` text (`file` names it in errors).
    pub fn from_json_str(text: &str, file: &str) -> Result<Self> {
        parse_json_config(text, file, Self::validate)
    }

    /// Read and validate `config.json` from a file.
    pub fn from_file(path: &Path) -> Result<Self> {
        read_json_config(path, Self::validate)
    }

    /// Pretty JSON with sorted keys (the layout `save_checkpoint` writes).
    pub fn to_json_string(&self) -> Result<String> {
        json_config_string(self)
    }

    /// Refuse unknown or unsupported values, naming the key and the allowed values.
    pub fn validate(&self) -> Result<()> {
        must_equal("model_type", &self.model_type.as_str(), &MODEL_TYPE)?;
        if !self.architectures.iter().any(|a| a == ARCHITECTURE) {
            return Err(invalid(
                "architectures",
                format!("got {:?}, allowed: [{ARCHITECTURE:?}]", self.architectures),
            ));
        }
        self.check_sizes()?;
        self.check_fixed()?;
        if let Some(q) = &self.quantization_config {
            q.validate()?;
            // Every quantized Linear must have in_features % 128 == 0: gate/up of routed
            // experts take hidden_size, down takes moe_intermediate_size.
            for (k, v) in [
                ("hidden_size", self.hidden_size),
                ("moe_intermediate_size", self.moe_intermediate_size),
            ] {
                if !v.is_multiple_of(GROUP_SIZE) {
                    return Err(invalid(
                        k,
                        format!("must be a multiple of {GROUP_SIZE} for INT4 group-{GROUP_SIZE} routed experts, got {v}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Sizes, the layer mix, GQA, RoPE and MoE shape rules.
    fn check_sizes(&self) -> Result<()> {
        for (k, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("linear_num_heads", self.linear_num_heads),
            ("linear_head_dim", self.linear_head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("intermediate_size", self.intermediate_size),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("n_shared_experts", self.n_shared_experts),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            positive(k, v)?;
        }
        if self.layer_types.len() != self.num_hidden_layers {
            return Err(invalid(
                "layer_types",
                format!(
                    "has {} entries, must have num_hidden_layers = {}",
                    self.layer_types.len(),
                    self.num_hidden_layers
                ),
            ));
        }
        for (i, t) in self.layer_types.iter().enumerate() {
            if t != LINEAR_ATTENTION && t != FULL_ATTENTION {
                return Err(invalid(
                    format!("layer_types[{i}]"),
                    format!("got {t:?}, allowed: {LINEAR_ATTENTION:?}, {FULL_ATTENTION:?}"),
                ));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(invalid(
                "num_key_value_heads",
                format!(
                    "must divide num_attention_heads = {} (GQA), got {}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "head_dim",
                format!("must be even (rotate-half RoPE), got {}", self.head_dim),
            ));
        }
        if self.first_k_dense_replace > self.num_hidden_layers {
            return Err(invalid(
                "first_k_dense_replace",
                format!("must be <= num_hidden_layers = {}", self.num_hidden_layers),
            ));
        }
        if self.num_experts_per_tok > self.n_routed_experts {
            return Err(invalid(
                "num_experts_per_tok",
                format!("must be <= n_routed_experts = {}", self.n_routed_experts),
            ));
        }
        Ok(())
    }

    /// Values the format fixes (router, activation, biases, dtype, MTP layers), norm and RoPE
    /// constants, special token ids.
    fn check_fixed(&self) -> Result<()> {
        must_equal("scoring_func", &self.scoring_func.as_str(), &"sigmoid")?;
        must_equal("topk_method", &self.topk_method.as_str(), &"noaux_tc")?;
        must_equal("n_group", &self.n_group, &1)?;
        must_equal("topk_group", &self.topk_group, &1)?;
        must_equal("hidden_act", &self.hidden_act.as_str(), &"silu")?;
        must_equal("attention_bias", &self.attention_bias, &false)?;
        must_equal("tie_word_embeddings", &self.tie_word_embeddings, &false)?;
        if self.torch_dtype != "bfloat16" && self.torch_dtype != "float32" {
            return Err(invalid(
                "torch_dtype",
                format!(
                    "got {:?}, allowed: \"bfloat16\", \"float32\"",
                    self.torch_dtype
                ),
            ));
        }
        if self.num_nextn_predict_layers > 1 {
            return Err(invalid(
                "num_nextn_predict_layers",
                format!(
                    "got {}, allowed: 0, 1 (more MTP layers are not specified, docs/model.md §6)",
                    self.num_nextn_predict_layers
                ),
            ));
        }
        for (k, v) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(k, format!("must be finite and > 0, got {v}")));
            }
        }
        if !self.routed_scaling_factor.is_finite() {
            return Err(invalid(
                "routed_scaling_factor",
                format!("must be finite, got {}", self.routed_scaling_factor),
            ));
        }
        for (k, v) in [
            ("bos_token_id", self.bos_token_id),
            ("eos_token_id", self.eos_token_id),
            ("pad_token_id", self.pad_token_id),
            ("mask_token_id", self.mask_token_id),
        ] {
            if v as usize >= self.vocab_size {
                return Err(invalid(
                    k,
                    format!("{v} is not below vocab_size = {}", self.vocab_size),
                ));
            }
        }
        Ok(())
    }

    /// Token mixer of decoder layer `i` (`i == num_hidden_layers` is the MTP layer: full attention).
    pub fn layer_kind(&self, i: usize) -> LayerKind {
        match self.layer_types.get(i).map(String::as_str) {
            Some(LINEAR_ATTENTION) => LayerKind::Kda,
            _ => LayerKind::FullAttention,
        }
    }
    /// Whether layer `i` (MTP layer included) has an MoE FFN.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        i >= self.first_k_dense_replace
    }
    /// Index of the MTP layer's tensors (`model.layers.{N}`), if any.
    pub fn mtp_layer_index(&self) -> Option<usize> {
        (self.num_nextn_predict_layers > 0).then_some(self.num_hidden_layers)
    }
    /// Full-attention decoder layers (MTP excluded).
    pub fn num_full_layers(&self) -> usize {
        (0..self.num_hidden_layers)
            .filter(|&i| self.layer_kind(i) == LayerKind::FullAttention)
            .count()
    }
    /// KDA decoder layers.
    pub fn num_kda_layers(&self) -> usize {
        self.num_hidden_layers - self.num_full_layers()
    }
    /// Layers with attention K/V in the `full` group: full decoder layers + the MTP layer.
    pub fn num_attention_kv_layers(&self) -> usize {
        self.num_full_layers() + self.num_nextn_predict_layers
    }
    /// `C = linear_num_heads * linear_head_dim`.
    pub fn kda_channels(&self) -> usize {
        self.linear_num_heads * self.linear_head_dim
    }
    /// f32 values of one full-attention layer's page: K and V of `block_size` tokens.
    pub fn full_page_floats(&self, block_size: usize) -> usize {
        2 * block_size * self.num_key_value_heads * self.head_dim
    }
    /// f32 values of one KDA layer's state: conv q,k,v `[3, kc-1, C]` + S `[nl, dl, dl]`.
    pub fn state_page_floats(&self) -> usize {
        3 * (self.linear_conv_kernel_dim - 1) * self.kda_channels()
            + self.linear_num_heads * self.linear_head_dim * self.linear_head_dim
    }
    /// Parameters of the bf16 checkpoint (`recipes/model.py::count_params`).
    pub fn num_parameters(&self) -> u64 {
        crate::model::weights::tensor_specs(self)
            .iter()
            .map(|s| s.shape.iter().product::<usize>() as u64)
            .sum()
    }

    /// The KV layout of this model: a `full` group (block `block_size`; the K/V of every
    /// full-attention layer and of the MTP layer, which share block tables) and a
    /// `kda_state` group (vLLM Mamba "none" mode: `num_speculative_blocks =
    /// num_speculative_tokens`, so a request holds 1 + N state blocks: block 0 the
    /// committed state, blocks 1..N the states after each draft position). Each group's
    /// `memory` is `layers x page bytes` (full: `block_size x nkv x d x 2 x 4`; state:
    /// `(3 (kc-1) C + nl dl dl) x 4`, f32) so the pool can be sized from bytes.
    /// `max_model_len` = `max_position_embeddings`; groups with no layers are omitted.
    pub fn kv_layout(
        &self,
        block_size: u32,
        num_speculative_tokens: u32,
        num_blocks: u32,
    ) -> Result<KvLayout> {
        self.validate()?;
        let mut groups = Vec::new();
        let n_attn = self.num_attention_kv_layers();
        if n_attn > 0 {
            let mut g = GroupSpec::full(FULL_GROUP, block_size);
            g.memory = Some(GroupMemory {
                num_layers: n_attn as u32,
                page_size_bytes: 4 * self.full_page_floats(block_size as usize) as u64,
            });
            groups.push(g);
        }
        let n_kda = self.num_kda_layers();
        if n_kda > 0 {
            let mut g = GroupSpec::state(STATE_GROUP, num_speculative_tokens);
            g.memory = Some(GroupMemory {
                num_layers: n_kda as u32,
                page_size_bytes: 4 * self.state_page_floats() as u64,
            });
            groups.push(g);
        }
        let layout = KvLayout {
            num_blocks: Some(num_blocks),
            kv_cache_memory_bytes: None,
            max_model_len: u32::try_from(self.max_position_embeddings)
                .map_err(|_| invalid("max_position_embeddings", "exceeds u32"))?,
            max_in_flight_tokens: None,
            watermark: 0.0,
            groups,
        };
        layout.resolve_groups()?;
        Ok(layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_count() {
        for c in [
            ModelConfig::micro(),
            ModelConfig::tiny(),
            ModelConfig::glm53_flash(),
        ] {
            c.validate().unwrap();
            c.clone().with_quantization().validate().unwrap();
        }
        assert_eq!(ModelConfig::micro().num_parameters(), 1_436_726);
        assert_eq!(ModelConfig::tiny().num_parameters(), 20_909_592);
        assert_eq!(ModelConfig::glm53_flash().num_hidden_layers, 45);
        assert_eq!(ModelConfig::glm53_flash().num_full_layers(), 9);
    }

    #[test]
    fn actorder_without_g_idx_is_accepted() {
        for (v, ok) in [
            ("static", true),
            ("weight", true),
            ("group", false),
            ("dynamic", false),
        ] {
            let mut c = ModelConfig::micro().with_quantization();
            if let Some(w) = c
                .quantization_config
                .as_mut()
                .and_then(|q| q.config_groups.get_mut("group_0"))
                .and_then(|g| g.weights.as_mut())
            {
                w.actorder = Some(Value::String(v.into()));
            }
            assert_eq!(c.validate().is_ok(), ok, "actorder {v}");
        }
    }

    #[test]
    fn ignore_list_is_anchored_at_start() {
        let q = QuantizationConfig::for_model(&ModelConfig::micro());
        let m = q.ignore_matcher().unwrap();
        assert!(m.matches("lm_head"));
        assert!(m.matches("model.layers.3.self_attn.q_proj"));
        assert!(m.matches("model.layers.1.mlp.gate"));
        assert!(!m.matches("model.layers.1.mlp.gate_proj"));
        assert!(m.matches("model.layers.0.mlp.gate_proj"));
        assert!(m.matches("model.layers.4.mlp.experts.0.up_proj"));
        assert!(!m.matches("model.layers.1.mlp.experts.0.up_proj"));
        assert!(!m.matches("xlm_head"));
    }

    #[test]
    fn kv_layout_groups_and_memory() {
        let c = ModelConfig::micro();
        let l = c.kv_layout(16, 3, 64).unwrap();
        assert_eq!(l.groups.len(), 2);
        assert_eq!(l.groups[0].memory.unwrap().num_layers, 2); // layer 3 + MTP
        assert_eq!(
            l.groups[0].memory.unwrap().page_size_bytes,
            16 * 2 * 32 * 2 * 4
        );
        assert_eq!(l.groups[1].num_speculative_blocks, 3);
        assert_eq!(
            l.groups[1].memory.unwrap().page_size_bytes,
            (3 * 3 * 64 + 2 * 32 * 32) * 4
        );
    }
}
