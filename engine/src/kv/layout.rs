//! KV cache layouts: the groups of a model's KV cache and the pool they share.
//!
//! Mirrors vLLM's `KVCacheConfig` / `KVCacheGroupSpec` / `*Spec` classes in
//! `vllm/v1/kv_cache_interface.py` (0.33.0), reduced to what block accounting
//! needs. The serialized form is documented in `docs/kv-replay-format.md` and
//! is shared by RON manifests and the JSON goldens written from vLLM.
//!
//! Invariants after [`KvLayout::validate`]: at least one group, every block
//! size > 0, sliding-window groups have a window > 0, state groups have a
//! block size (defaulted to max_model_len, as vLLM sets `mamba_block_size` when
//! prefix caching is off), and the pool has at least the null block.

use serde::{Deserialize, Serialize};

use crate::util::cdiv;
use crate::{EngineError, Result};

/// The kind of a KV cache group (vLLM spec class).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// `FullAttentionSpec`: one block per `block_size` tokens, held until free.
    Full,
    /// `SlidingWindowSpec`: blocks outside the window are replaced by the null block.
    SlidingWindow,
    /// `MambaSpec` with `mamba_cache_mode="none"`: 1 + num_speculative_blocks a request.
    State,
    /// `CircularBufferSpec`: exactly one block per request.
    RingBuffer,
}

/// Sliding-window admission/execution cap policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum CapPolicy {
    /// No cap: admission reserves the full sequence (vLLM issue #55800, the card's build).
    None,
    /// vLLM 0.33.0 (PR #40946): admission capped at
    /// `cdiv(min(window - 1 + extra + max_in_flight_tokens, max_model_len), bs) + 1`.
    #[default]
    Upstream,
    /// The model card's fix: `min(cdiv(tokens, bs), cdiv(window, bs) + 2)` blocks on
    /// admission and execution (the group keeps a per-request ring of that many blocks).
    /// The CLI's older spelling `window-plus-two` is accepted as an alias.
    #[serde(alias = "window-plus-two")]
    WindowPlusTwo,
}

/// Memory of one group, for pool sizing from bytes (vLLM `page_size_bytes` x layers).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GroupMemory {
    /// Layers in the group.
    pub num_layers: u32,
    /// Bytes of one layer's page (one block of `block_size` tokens, or one state).
    pub page_size_bytes: u64,
}

/// One KV cache group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupSpec {
    /// Name used in reports (e.g. `drafter_swa`).
    pub name: String,
    /// Spec kind.
    pub kind: GroupKind,
    /// Tokens per block. For `state`, defaults to max_model_len.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Window in tokens (sliding_window only).
    #[serde(default)]
    pub sliding_window: Option<u32>,
    /// Extra trailing tokens retained below the window (vLLM `extra_retained_tokens`).
    #[serde(default)]
    pub extra_retained_tokens: u32,
    /// Extra state blocks for speculative decoding (state only).
    #[serde(default)]
    pub num_speculative_blocks: u32,
    /// Cap policy (sliding_window only).
    #[serde(default)]
    pub cap: CapPolicy,
    /// Optional memory model for pool sizing.
    #[serde(default)]
    pub memory: Option<GroupMemory>,
}

impl GroupSpec {
    /// A full-attention group.
    pub fn full(name: &str, block_size: u32) -> Self {
        Self::base(name, GroupKind::Full, Some(block_size))
    }
    /// A sliding-window group.
    pub fn sliding_window(name: &str, block_size: u32, window: u32, cap: CapPolicy) -> Self {
        Self {
            sliding_window: Some(window),
            cap,
            ..Self::base(name, GroupKind::SlidingWindow, Some(block_size))
        }
    }
    /// A recurrent-state group (block size defaults to max_model_len).
    pub fn state(name: &str, num_speculative_blocks: u32) -> Self {
        Self {
            num_speculative_blocks,
            ..Self::base(name, GroupKind::State, None)
        }
    }
    /// A one-block ring buffer group.
    pub fn ring_buffer(name: &str, block_size: u32) -> Self {
        Self::base(name, GroupKind::RingBuffer, Some(block_size))
    }
    fn base(name: &str, kind: GroupKind, block_size: Option<u32>) -> Self {
        Self {
            name: name.to_string(),
            kind,
            block_size,
            sliding_window: None,
            extra_retained_tokens: 0,
            num_speculative_blocks: 0,
            cap: CapPolicy::default(),
            memory: None,
        }
    }
}

/// A whole KV layout: groups plus the pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvLayout {
    /// Total blocks including the null block (vLLM `num_blocks`, or the
    /// `num_gpu_blocks_override`). When absent, sized from `kv_cache_memory_bytes`.
    #[serde(default)]
    pub num_blocks: Option<u32>,
    /// KV cache memory in bytes (vLLM's available KV memory) for pool sizing.
    #[serde(default)]
    pub kv_cache_memory_bytes: Option<u64>,
    /// Longest sequence the model serves.
    pub max_model_len: u32,
    /// vLLM `max_in_flight_tokens` (max_concurrent_batches x max_num_batched_tokens);
    /// `None` = max_model_len, as `KVCacheManager` defaults.
    #[serde(default)]
    pub max_in_flight_tokens: Option<u32>,
    /// Watermark fraction of `num_blocks` (vLLM `watermark`).
    #[serde(default)]
    pub watermark: f64,
    /// The groups, in vLLM's group order.
    pub groups: Vec<GroupSpec>,
}

/// A group after validation, with every default resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedGroup {
    pub name: String,
    pub kind: GroupKind,
    pub block_size: u64,
    pub sliding_window: u64,
    pub extra_retained_tokens: u64,
    pub num_speculative_blocks: u64,
    pub cap: CapPolicy,
    /// Admission cap in blocks, if any (vLLM `max_admission_blocks_per_request`).
    pub admission_cap_blocks: Option<u64>,
    pub memory: Option<GroupMemory>,
}

fn bad(field: String, reason: impl Into<String>) -> EngineError {
    EngineError::InvalidLayout {
        field,
        reason: reason.into(),
    }
}

impl KvLayout {
    /// Validate and resolve defaults of every group.
    pub fn resolve_groups(&self) -> Result<Vec<ResolvedGroup>> {
        if self.max_model_len == 0 {
            return Err(bad("max_model_len".into(), "must be > 0"));
        }
        if self.groups.is_empty() {
            return Err(bad(
                "groups".into(),
                "at least one KV cache group is required",
            ));
        }
        if !(self.watermark.is_finite() && (0.0..1.0).contains(&self.watermark)) {
            return Err(bad(
                "watermark".into(),
                format!("must be in [0, 1), got {}", self.watermark),
            ));
        }
        if let Some(n) = self.num_blocks {
            if n > super::pool::MAX_NUM_BLOCKS {
                return Err(super::pool::too_many_blocks(u64::from(n)));
            }
        }
        if self.max_in_flight_tokens == Some(0) {
            return Err(bad("max_in_flight_tokens".into(), "must be > 0 when given"));
        }
        let mml = u64::from(self.max_model_len);
        let in_flight = u64::from(self.max_in_flight_tokens.unwrap_or(self.max_model_len));
        let mut names = std::collections::HashSet::new();
        let mut out = Vec::with_capacity(self.groups.len());
        for (i, g) in self.groups.iter().enumerate() {
            let f = |k: &str| format!("groups[{i}] ({}).{k}", g.name);
            if !names.insert(g.name.as_str()) {
                return Err(bad(f("name"), "duplicate group name"));
            }
            let bs = match (g.kind, g.block_size) {
                (GroupKind::State, None) => mml,
                (_, None) => return Err(bad(f("block_size"), "required")),
                (_, Some(0)) => return Err(bad(f("block_size"), "must be > 0")),
                (_, Some(b)) => u64::from(b),
            };
            let window = match (g.kind, g.sliding_window) {
                (GroupKind::SlidingWindow, Some(0)) => {
                    return Err(bad(f("sliding_window"), "must be > 0"))
                }
                (GroupKind::SlidingWindow, Some(w)) => u64::from(w),
                (GroupKind::SlidingWindow, None) => {
                    return Err(bad(
                        f("sliding_window"),
                        "required for a sliding_window group",
                    ))
                }
                (_, Some(_)) => {
                    return Err(bad(
                        f("sliding_window"),
                        "only valid for a sliding_window group",
                    ))
                }
                (_, None) => 0,
            };
            if g.kind != GroupKind::State && g.num_speculative_blocks != 0 {
                return Err(bad(
                    f("num_speculative_blocks"),
                    "only valid for a state group",
                ));
            }
            if g.kind != GroupKind::SlidingWindow && g.extra_retained_tokens != 0 {
                return Err(bad(
                    f("extra_retained_tokens"),
                    "only valid for a sliding_window group",
                ));
            }
            if let Some(m) = g.memory {
                if m.num_layers == 0 || m.page_size_bytes == 0 {
                    return Err(bad(
                        f("memory"),
                        "num_layers and page_size_bytes must be > 0",
                    ));
                }
            }
            let extra = u64::from(g.extra_retained_tokens);
            let admission_cap_blocks = match (g.kind, g.cap) {
                (GroupKind::SlidingWindow, CapPolicy::Upstream) => {
                    Some(cdiv((window - 1 + extra + in_flight).min(mml), bs) + 1)
                }
                (GroupKind::SlidingWindow, CapPolicy::WindowPlusTwo) => Some(cdiv(window, bs) + 2),
                _ => None,
            };
            out.push(ResolvedGroup {
                name: g.name.clone(),
                kind: g.kind,
                block_size: bs,
                sliding_window: window,
                extra_retained_tokens: extra,
                num_speculative_blocks: u64::from(g.num_speculative_blocks),
                cap: g.cap,
                admission_cap_blocks,
                memory: g.memory,
            });
        }
        Ok(out)
    }
}
