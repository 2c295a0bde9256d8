//! Pool planning for GLM-5.3-Flash (+ DFlash2) the way vLLM 0.33.0 plans it.
//!
//! From the architecture and a stated assumption set (tensor parallel size, KV dtype,
//! the requested `--block-size`, N speculative tokens, in-flight tokens, KV memory) this
//! derives what vLLM would log and allocate: the attention block size it actually uses,
//! the KV cache groups, the bytes of one pool block, `num_blocks`, "GPU KV cache size: N
//! tokens" and "Maximum concurrency", and whether the startup check passes. The rules,
//! each ported from vLLM 0.33.0 (tested against vLLM's own functions called on the CPU
//! by `recipes/kv_planning_golden.py`, goldens in `tests/golden/kv_plan/`):
//!
//! 1. Layer mix (transformers `Glm5NextTextConfig.__post_init__`): layer `i` is DSA/MLA
//!    (`indexed_attention`) when `i % 4 == 3`, else KDA: 11 + 34 of 45 layers.
//! 2. Per DSA layer three caches (`vllm/models/glm5next/common/attention.py`): the MLA
//!    latent row (`MLAAttention.get_kv_cache_spec`: one head of `kv_lora_rank +
//!    qk_rope_head_dim` = 512; quantized dtypes become `fp8_ds_mla`, 656 bytes a token,
//!    `mla_attention._canonicalize_sparse_mla_kv_cache_dtype`), the kpool indexer keys
//!    (`Glm5NextIndexerCache`: 132 bytes per state of `index_kpool` = 16 tokens), and
//!    the kpool tail ring (`Glm5NextTailCache`: a `CircularBufferSpec` of
//!    `16 * next_power_of_2(cdiv(16 + N, 16))` slots x 2 x 128 bf16).
//! 3. Per KDA layer a `MambaSpec` (`mamba_utils.MambaStateShapeCalculator.kda_state_shape`
//!    / `kda_state_dtype`): conv state `(3 * 64 * 128 / TP) x (3 + N)` bf16 plus recurrent
//!    state `(64 / TP) x 128 x 128` fp32; `1 + N` blocks a request ("none" cache mode).
//! 4. The drafter's layers, from the same pool (vLLM's `gpu_model_runner` allocates every
//!    attention layer of the static forward context, the drafter's too). An MTP head
//!    ([`PlanDrafter::Mtp`]) adds its decoder layers to the DSA buckets of rule 2 (an
//!    assumption: GLM-5.3-Flash's MTP layer is taken to be a DSA layer like DeepSeek-V3.2's
//!    `DeepSeekMTP`, whose layer is a target decoder layer); a leg without speculation
//!    (N = 0) loads no drafter and plans the target alone. The DFlash2 drafter's
//!    sliding-window layers: block size by
//!    `Attention.get_kv_cache_spec` / `_largest_kernel_block_within` (FlashAttention's
//!    `MultipleOf(16)`: the attention block rounded down to 16), or a stated override
//!    (the model card's research overlay has a block-16 drafter SlidingWindowManager).
//! 5. Block-size alignment for models with recurrent state
//!    (`vllm/platforms/interface.py` `Platform._align_hybrid_block_size`): the block is
//!    raised to `align * cdiv(mamba_page, align * attn_page_1_token)` with `align =
//!    max(min kernel block, --block-size, 128 for MLA)`, then to a multiple of every
//!    backend's smallest kernel block (the kpool indexer's 16 x 32 = 512 on SM90,
//!    `Glm5NextIndexerBackend.get_supported_kernel_block_sizes`); the Mamba page is
//!    padded to `block * attn_page_1_token`.
//! 6. Grouping for the block-outermost `BLHNC` layout this model resolves
//!    (`KpoolTailBackend` only supports it): `kv_cache_planning._get_packed_kv_cache_groups`
//!    (repeat count by `_approximate_gcd`, state buckets split to fit the anchor block).
//! 7. Bytes per block = the largest group's bytes (`_get_kv_cache_bytes_per_block`);
//!    `num_blocks = memory // bytes_per_block` (`get_kv_cache_configs`).
//! 8. Per-request blocks (`*Spec.max_memory_usage_bytes` / page): full `cdiv(L, bs)`,
//!    ring 1, state `1 + N`, sliding window `cdiv(min(window - 1 + in_flight, L), bs) + 1`
//!    (`SlidingWindowSpec.max_admission_blocks_per_request`); concurrency = num_blocks /
//!    their sum, tokens = `int(concurrency * L)` (`kv_cache_utils.get_kv_cache_capacity`);
//!    the startup check needs that sum <= num_blocks - 1 (null block reserved,
//!    `get_kv_cache_configs`).
//!
//! Invariants: a returned plan has a non-zero block size, at least one group of every
//! kind, and `bytes_per_block` equal to its largest group's bytes.

use serde::{Deserialize, Serialize};

use super::layout::{CapPolicy, GroupKind, GroupMemory, GroupSpec, KvLayout};
use crate::util::cdiv;
use crate::{EngineError, Result};

/// KV cache dtype (vLLM `--kv-cache-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum KvDtype {
    /// The model dtype, bf16.
    #[default]
    Auto,
    /// fp8 (served as `fp8_ds_mla` by FLASHMLA_SPARSE: 656 bytes a token).
    Fp8,
}

impl KvDtype {
    fn bytes(self) -> u64 {
        match self {
            KvDtype::Auto => 2,
            KvDtype::Fp8 => 1,
        }
    }
    /// Name as vLLM's flag spells it.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Auto => "auto",
            KvDtype::Fp8 => "fp8",
        }
    }
}

/// GLM-5.3-Flash's shapes (transformers `Glm5NextTextConfig` defaults, the card's Details).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Glm53Arch {
    pub num_layers: u32,
    pub kv_lora_rank: u64,
    pub qk_rope_head_dim: u64,
    pub index_head_dim: u64,
    pub index_kpool: u64,
    pub linear_num_heads: u64,
    pub linear_head_dim: u64,
    pub linear_conv_kernel_dim: u64,
}

impl Default for Glm53Arch {
    fn default() -> Self {
        Self {
            num_layers: 45,
            kv_lora_rank: 512,
            qk_rope_head_dim: 0,
            index_head_dim: 128,
            index_kpool: 16,
            linear_num_heads: 64,
            linear_head_dim: 128,
            linear_conv_kernel_dim: 4,
        }
    }
}

impl Glm53Arch {
    /// Layer `i` is DSA/MLA attention (else KDA), as `layer_types` defaults.
    pub fn is_attention(&self, i: u32) -> bool {
        i % 4 == 3
    }
    fn attention_layers(&self) -> u32 {
        (0..self.num_layers)
            .filter(|&i| self.is_attention(i))
            .count() as u32
    }
}

/// The stated assumptions a plan depends on (manifest `kv.plan`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanAssumptions {
    /// Tensor parallel size (KDA heads and drafter KV heads are split over it).
    pub tp: u32,
    #[serde(default)]
    pub kv_dtype: KvDtype,
    /// Drafter sliding-window block size; None = vLLM 0.33.0's rule (the attention block).
    #[serde(default)]
    pub drafter_block_size: Option<u32>,
    /// Whether the kpool indexer's 512-token kernel page constrains the block size
    /// (stock vLLM 0.33.0 on SM90: true).
    #[serde(default = "yes")]
    pub indexer_block_alignment: bool,
    /// Drafter KV heads (before TP), head dim and layers (the DFlash2 config is not public).
    #[serde(default = "default_drafter_kv_heads")]
    pub drafter_kv_heads: u32,
    #[serde(default = "default_drafter_head_dim")]
    pub drafter_head_dim: u32,
    #[serde(default = "default_drafter_layers")]
    pub drafter_layers: u32,
    /// Bytes of the drafter's weights on one rank. vLLM measures the KV memory after
    /// loading every model (`gpu_worker.determine_available_memory` profiles with the
    /// drafter loaded), so a leg without speculation (N = 0, no drafter loaded) has this
    /// much more KV memory than the stated or calibrated one. Default 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub drafter_weight_bytes: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn yes() -> bool {
    true
}
fn default_drafter_kv_heads() -> u32 {
    8
}
fn default_drafter_head_dim() -> u32 {
    128
}
fn default_drafter_layers() -> u32 {
    5
}

/// The drafter whose KV layers the plan includes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanDrafter {
    /// GLM-5.3-Flash-DFlash2: `drafter_layers` sliding-window layers (rule 4).
    #[default]
    Dflash2,
    /// An MTP head of `layers` DSA decoder layers, loaded only when N > 0.
    Mtp { layers: u32 },
}

/// Everything else a plan needs (from the serving config).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanInput {
    pub assumptions: PlanAssumptions,
    /// `--block-size` as the user asked.
    pub block_size: u32,
    pub num_speculative_tokens: u32,
    pub max_model_len: u32,
    /// vLLM `max_in_flight_tokens` (max_concurrent_batches x max_num_batched_tokens).
    pub max_in_flight_tokens: u32,
    pub drafter_window: u32,
    /// Available KV memory per rank in bytes.
    pub kv_cache_memory_bytes: u64,
    pub drafter: PlanDrafter,
}

/// One planned KV cache group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedGroup {
    pub kind: GroupKind,
    pub block_size: u64,
    pub num_layers: u32,
    /// Bytes of one block of this group (sum of its layers' pages).
    pub bytes: u64,
    /// Blocks one max_model_len request needs (`max_memory_usage_bytes / page`).
    pub blocks_per_request: u64,
}

/// What vLLM 0.33.0 plans for one assumption set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolPlan {
    pub requested_block_size: u64,
    pub effective_block_size: u64,
    pub mamba_page_size_padded: Option<u64>,
    pub groups: Vec<PlannedGroup>,
    pub bytes_per_block: u64,
    pub num_blocks: u64,
    pub blocks_per_request: u64,
    pub max_concurrency: f64,
    pub kv_cache_tokens: u64,
    pub starts: bool,
}

fn bad(field: &str, reason: String) -> EngineError {
    EngineError::InvalidLayout {
        field: field.into(),
        reason,
    }
}

/// vLLM `divide`: exact division or an error naming the field.
fn divide(n: u64, tp: u64, what: &str) -> Result<u64> {
    if tp == 0 || !n.is_multiple_of(tp) {
        return Err(bad(
            "plan.tp",
            format!("{what} ({n}) is not divisible by tensor parallel size {tp}"),
        ));
    }
    Ok(n / tp)
}

/// Bytes of one KDA layer's state on one rank (conv + recurrent).
pub fn kda_state_page(arch: &Glm53Arch, tp: u32, num_spec: u32) -> Result<u64> {
    let tp = u64::from(tp);
    let proj = arch.linear_num_heads * arch.linear_head_dim;
    let conv_dim = divide(3 * proj, tp, "KDA conv dim")?;
    let conv = conv_dim * (arch.linear_conv_kernel_dim - 1 + u64::from(num_spec)) * 2;
    let heads = divide(arch.linear_num_heads, tp, "KDA heads")?;
    let recurrent = heads * arch.linear_head_dim * arch.linear_head_dim * 4;
    Ok(conv + recurrent)
}

/// MLA bytes per token per layer as allocated (`fp8_ds_mla` is 656 bytes).
pub fn mla_bytes_per_token(arch: &Glm53Arch, dtype: KvDtype) -> u64 {
    match dtype {
        KvDtype::Auto => (arch.kv_lora_rank + arch.qk_rope_head_dim) * 2,
        KvDtype::Fp8 => 656,
    }
}

/// `Platform._align_hybrid_block_size`: (effective block size, padded Mamba page).
pub fn align_block_size(
    arch: &Glm53Arch,
    a: &PlanAssumptions,
    block_size: u64,
    mamba_page: u64,
) -> (u64, Option<u64>) {
    // The alignment sizes the attention page from head_size x dtype (no ds_mla packing).
    let attn_1tok = (arch.kv_lora_rank + arch.qk_rope_head_dim) * a.kv_dtype.bytes();
    // FLASHMLA_SPARSE MultipleOf(64); MLA raises the alignment to 128.
    let align = 64u64.max(block_size).max(128);
    let mut bs = align * cdiv(mamba_page, align * attn_1tok);
    // lcm of every backend's smallest kernel block: 64 (MLA), 512 (indexer), 1 (tail).
    let backend_align = if a.indexer_block_alignment {
        arch.index_kpool * 32
    } else {
        64
    };
    bs = backend_align * cdiv(bs, backend_align);
    let bs = bs.max(block_size);
    let page = bs * attn_1tok;
    let padded = (page != mamba_page).then_some(page);
    (bs, padded)
}

/// A bucket of uniform-type layers before packing: pages as (bytes, layer count).
#[derive(Debug, Clone)]
struct Bucket {
    kind: GroupKind,
    block_size: u64,
    pages: Vec<(u64, u32)>,
}

impl Bucket {
    fn layers(&self) -> u32 {
        self.pages.iter().map(|p| p.1).sum()
    }
    fn max_layers_per_page(&self) -> u32 {
        self.pages.iter().map(|p| p.1).max().unwrap_or(0)
    }
    fn balanced(&self) -> bool {
        self.pages.windows(2).all(|w| w[0].1 == w[1].1)
    }
    /// Mamba and circular-buffer buckets (sliding window too when nothing repeats).
    fn is_state(&self, repeats: Option<u32>) -> bool {
        matches!(self.kind, GroupKind::State | GroupKind::RingBuffer)
            || (repeats.is_none() && self.kind == GroupKind::SlidingWindow)
    }
    /// Bytes of the largest of `n` groups this bucket splits into.
    fn widest(&self, n: u32) -> u64 {
        let n = u64::from(n.max(1));
        self.pages
            .iter()
            .map(|&(p, c)| cdiv(u64::from(c), n) * p)
            .sum()
    }
}

/// `_approximate_gcd`: the chunk size in [lower, max] minimising upward padding (ties: larger).
fn approximate_gcd(values: &[u32], lower: u32) -> u32 {
    let min_d = lower.max(1);
    let max_d = values.iter().copied().max().unwrap_or(min_d);
    if min_d > max_d {
        return min_d;
    }
    let mut best = (min_d, u64::MAX);
    for d in min_d..=max_d {
        let pad: u64 = values.iter().map(|&x| u64::from((d - x % d) % d)).sum();
        if pad <= best.1 {
            best = (d, pad);
        }
    }
    best.0
}

/// `_get_packed_kv_cache_groups` on the buckets: (kind, block size, layers, bytes).
fn pack(buckets: &[Bucket]) -> Vec<(GroupKind, u64, u32, u64)> {
    let mixed_floor = buckets
        .iter()
        .filter(|b| b.balanced() && b.pages.len() > 1)
        .map(|b| b.max_layers_per_page())
        .max()
        .unwrap_or(0);
    let repeats = (mixed_floor > 0).then(|| {
        let v: Vec<u32> = buckets
            .iter()
            .filter(|b| b.balanced())
            .map(|b| b.max_layers_per_page())
            .collect();
        approximate_gcd(&v, mixed_floor)
    });
    let groups_for = |b: &Bucket| match repeats {
        Some(r) if b.balanced() => b.max_layers_per_page().div_ceil(r),
        _ => 1,
    };
    let anchor = buckets
        .iter()
        .map(|b| {
            b.widest(if b.is_state(repeats) {
                b.layers()
            } else {
                groups_for(b)
            })
        })
        .max()
        .unwrap_or(0);
    let mut out = Vec::new();
    for b in buckets {
        let mut n = groups_for(b);
        if anchor > 0 && b.is_state(repeats) {
            let per_block = (anchor / b.pages[0].0).max(1);
            n = n.max(cdiv(u64::from(b.layers()), per_block) as u32);
        }
        // Group i takes repeats i, i + n, ...: one layer of every page size per repeat.
        let reps = b.pages.iter().map(|p| p.1).min().unwrap_or(0);
        for i in 0..n {
            let count = if n == 1 {
                None
            } else {
                Some((i..reps).step_by(n as usize).count() as u32)
            };
            let (layers, bytes) = match count {
                None => (
                    b.layers(),
                    b.pages.iter().map(|&(p, c)| p * u64::from(c)).sum(),
                ),
                Some(k) => (
                    k * b.pages.len() as u32,
                    b.pages.iter().map(|&(p, _)| p * u64::from(k)).sum(),
                ),
            };
            out.push((b.kind, b.block_size, layers, bytes));
        }
    }
    out
}

/// The buckets of GLM-5.3-Flash + DFlash2, in vLLM's order of first appearance.
fn buckets(arch: &Glm53Arch, inp: &PlanInput, bs: u64, state_page: u64) -> Vec<Bucket> {
    let a = &inp.assumptions;
    let n = u64::from(inp.num_speculative_tokens);
    let kda = arch.num_layers - arch.attention_layers();
    let mtp = match inp.drafter {
        PlanDrafter::Mtp { layers } if n > 0 => layers,
        _ => 0,
    };
    let attn = arch.attention_layers() + mtp;
    let kpool = arch.index_kpool;
    let ring = kpool * cdiv(kpool + n, kpool).next_power_of_two();
    let mla_page = bs * mla_bytes_per_token(arch, a.kv_dtype);
    let idx_page = bs / kpool * (arch.index_head_dim + arch.index_head_dim / 128 * 4);
    let tail_page = 2 * ring * arch.index_head_dim * 2;
    let sw_bs = a.drafter_block_size.map(u64::from).unwrap_or(bs / 16 * 16);
    let heads = (u64::from(a.drafter_kv_heads) / u64::from(a.tp)).max(1);
    let sw_page = sw_bs * heads * u64::from(a.drafter_head_dim) * 2 * a.kv_dtype.bytes();
    let mut pages_full = vec![(mla_page, attn)];
    if idx_page != mla_page {
        pages_full.push((idx_page, attn));
    } else {
        pages_full[0].1 += attn;
    }
    let mut out = vec![
        Bucket {
            kind: GroupKind::State,
            block_size: u64::from(inp.max_model_len),
            pages: vec![(state_page, kda)],
        },
        Bucket {
            kind: GroupKind::Full,
            block_size: bs,
            pages: pages_full,
        },
        Bucket {
            kind: GroupKind::RingBuffer,
            block_size: ring,
            pages: vec![(tail_page, attn)],
        },
    ];
    if inp.drafter == PlanDrafter::Dflash2 {
        out.push(Bucket {
            kind: GroupKind::SlidingWindow,
            block_size: sw_bs,
            pages: vec![(sw_page, a.drafter_layers)],
        });
    }
    out
}

fn blocks_per_request(inp: &PlanInput, kind: GroupKind, block_size: u64) -> u64 {
    let mml = u64::from(inp.max_model_len);
    match kind {
        GroupKind::Full => cdiv(mml, block_size),
        GroupKind::RingBuffer => 1,
        GroupKind::State => 1 + u64::from(inp.num_speculative_tokens),
        GroupKind::SlidingWindow => {
            let t =
                (u64::from(inp.drafter_window) - 1 + u64::from(inp.max_in_flight_tokens)).min(mml);
            cdiv(t, block_size) + 1
        }
    }
}

fn check_input(inp: &PlanInput) -> Result<()> {
    let a = &inp.assumptions;
    let dflash = inp.drafter == PlanDrafter::Dflash2;
    let checks = [
        ("plan.tp", a.tp == 0, "must be > 0"),
        ("block_size", inp.block_size == 0, "must be > 0"),
        (
            "plan.drafter_layers",
            dflash && a.drafter_layers == 0,
            "must be > 0",
        ),
        (
            "plan.drafter_kv_heads",
            a.drafter_kv_heads == 0,
            "must be > 0",
        ),
        (
            "plan.drafter_block_size",
            a.drafter_block_size == Some(0),
            "must be > 0 when given",
        ),
        (
            "max_in_flight_tokens",
            inp.max_in_flight_tokens == 0,
            "must be > 0",
        ),
        (
            "drafter.sliding_window",
            dflash && inp.drafter_window == 0,
            "must be > 0",
        ),
        (
            "kv.preset",
            inp.drafter == PlanDrafter::Mtp { layers: 0 },
            "an MTP drafter needs at least one layer",
        ),
    ];
    match checks.iter().find(|c| c.1) {
        Some((f, _, why)) => Err(bad(f, (*why).into())),
        None => Ok(()),
    }
}

/// Plan the pool of GLM-5.3-Flash + its drafter (DFlash2 or MTP) as vLLM 0.33.0 would.
pub fn plan(inp: &PlanInput) -> Result<PoolPlan> {
    check_input(inp)?;
    let arch = Glm53Arch::default();
    let a = &inp.assumptions;
    let state = kda_state_page(&arch, a.tp, inp.num_speculative_tokens)?;
    let requested = u64::from(inp.block_size);
    let (bs, padded) = align_block_size(&arch, a, requested, state);
    let groups: Vec<PlannedGroup> = pack(&buckets(&arch, inp, bs, padded.unwrap_or(state)))
        .into_iter()
        .map(|(kind, block_size, num_layers, bytes)| PlannedGroup {
            kind,
            block_size,
            num_layers,
            bytes,
            blocks_per_request: blocks_per_request(inp, kind, block_size),
        })
        .collect();
    let bytes_per_block = groups.iter().map(|g| g.bytes).max().unwrap_or(0);
    if bytes_per_block == 0 {
        return Err(bad("plan", "no KV cache groups".into()));
    }
    let num_blocks = inp.kv_cache_memory_bytes / bytes_per_block;
    let per_req: u64 = groups.iter().map(|g| g.blocks_per_request).sum();
    let max_concurrency = num_blocks as f64 / per_req as f64;
    Ok(PoolPlan {
        requested_block_size: requested,
        effective_block_size: bs,
        mamba_page_size_padded: padded,
        kv_cache_tokens: (max_concurrency * f64::from(inp.max_model_len)) as u64,
        starts: per_req < num_blocks,
        groups,
        bytes_per_block,
        num_blocks,
        blocks_per_request: per_req,
        max_concurrency,
    })
}

impl PoolPlan {
    /// The speclab layout of this plan, groups in the `glm53_dflash2` preset's order
    /// (full, ring, state..., drafter); the order does not change any block count.
    pub fn layout(&self, inp: &PlanInput, cap: CapPolicy) -> Result<KvLayout> {
        let mut order: Vec<&PlannedGroup> = Vec::new();
        for kind in [
            GroupKind::Full,
            GroupKind::RingBuffer,
            GroupKind::State,
            GroupKind::SlidingWindow,
        ] {
            order.extend(self.groups.iter().filter(|g| g.kind == kind));
        }
        let mut kda = 0;
        let mut groups = Vec::new();
        for g in order {
            let bs = u32::try_from(g.block_size)
                .map_err(|_| bad("block_size", format!("{} exceeds u32", g.block_size)))?;
            let mut spec = match g.kind {
                GroupKind::Full => GroupSpec::full("target_full", bs),
                GroupKind::RingBuffer => GroupSpec::ring_buffer("indexer_ring", bs),
                GroupKind::State => {
                    kda += 1;
                    GroupSpec::state(&format!("kda{}", kda - 1), inp.num_speculative_tokens)
                }
                GroupKind::SlidingWindow => {
                    GroupSpec::sliding_window("drafter_swa", bs, inp.drafter_window, cap)
                }
            };
            spec.memory = Some(GroupMemory {
                num_layers: 1,
                page_size_bytes: g.bytes,
            });
            groups.push(spec);
        }
        let num_blocks = u32::try_from(self.num_blocks)
            .map_err(|_| bad("num_blocks", format!("{} exceeds u32", self.num_blocks)))?;
        Ok(KvLayout {
            num_blocks: Some(num_blocks),
            kv_cache_memory_bytes: None,
            max_model_len: inp.max_model_len,
            max_in_flight_tokens: Some(inp.max_in_flight_tokens),
            watermark: 0.0,
            groups,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(tp: u32, bs: u32, kv: KvDtype, align: bool) -> PlanInput {
        PlanInput {
            assumptions: PlanAssumptions {
                tp,
                kv_dtype: kv,
                drafter_block_size: Some(16),
                indexer_block_alignment: align,
                drafter_kv_heads: 8,
                drafter_head_dim: 128,
                drafter_layers: 5,
                drafter_weight_bytes: 0,
            },
            block_size: bs,
            num_speculative_tokens: 7,
            max_model_len: 262_144,
            max_in_flight_tokens: 16_384,
            drafter_window: 2048,
            kv_cache_memory_bytes: 24_174_526_464,
            drafter: PlanDrafter::Dflash2,
        }
    }

    #[test]
    fn kda_state_per_rank() {
        let a = Glm53Arch::default();
        // conv 24,576 x 10 bf16 + recurrent 64 x 128 x 128 fp32 at TP 1.
        assert_eq!(kda_state_page(&a, 1, 7).unwrap(), 491_520 + 4_194_304);
        assert_eq!(kda_state_page(&a, 4, 7).unwrap(), (491_520 + 4_194_304) / 4);
        assert!(kda_state_page(&a, 3, 7).is_err());
    }

    #[test]
    fn tp4_block_1024_becomes_2048() {
        // The KDA page at TP 4 (1,171,456 B) exceeds a 1024-token MLA page (1,048,576 B).
        let p = plan(&input(4, 1024, KvDtype::Auto, true)).unwrap();
        assert_eq!(p.effective_block_size, 2048);
        assert_eq!(p.mamba_page_size_padded, Some(2048 * 1024));
        let kinds: Vec<GroupKind> = p.groups.iter().map(|g| g.kind).collect();
        assert_eq!(kinds.iter().filter(|k| **k == GroupKind::State).count(), 4);
    }

    #[test]
    fn indexer_alignment_moves_2304_to_2560() {
        assert_eq!(
            plan(&input(4, 2304, KvDtype::Auto, true))
                .unwrap()
                .effective_block_size,
            2560
        );
        assert_eq!(
            plan(&input(4, 2304, KvDtype::Auto, false))
                .unwrap()
                .effective_block_size,
            2304
        );
    }

    #[test]
    fn mtp_head_joins_the_dsa_buckets_and_only_when_loaded() {
        let mtp = |n: u32| {
            let mut i = input(4, 64, KvDtype::Auto, true);
            i.num_speculative_tokens = n;
            i.drafter = PlanDrafter::Mtp { layers: 1 };
            plan(&i).unwrap()
        };
        let full_layers = |p: &PoolPlan, k: GroupKind| -> u32 {
            p.groups
                .iter()
                .filter(|g| g.kind == k)
                .map(|g| g.num_layers)
                .sum()
        };
        let (on, off) = (mtp(2), mtp(0));
        // 11 DSA layers + the head: an MLA and an indexer page each; no sliding window.
        assert_eq!(full_layers(&on, GroupKind::Full), 24);
        assert_eq!(full_layers(&on, GroupKind::RingBuffer), 12);
        assert_eq!(full_layers(&off, GroupKind::Full), 22);
        assert_eq!(full_layers(&off, GroupKind::RingBuffer), 11);
        for p in [&on, &off] {
            assert!(p.groups.iter().all(|g| g.kind != GroupKind::SlidingWindow));
            assert_eq!(full_layers(p, GroupKind::State), 34);
        }
        let state_blocks = |p: &PoolPlan| {
            p.groups
                .iter()
                .find(|g| g.kind == GroupKind::State)
                .unwrap()
                .blocks_per_request
        };
        assert_eq!((state_blocks(&on), state_blocks(&off)), (3, 1));
        // DFlash2's plan keeps its sliding-window group at the same input.
        let mut d = input(4, 64, KvDtype::Auto, true);
        d.num_speculative_tokens = 2;
        assert!(plan(&d)
            .unwrap()
            .groups
            .iter()
            .any(|g| g.kind == GroupKind::SlidingWindow));
        let mut zero = d;
        zero.drafter = PlanDrafter::Mtp { layers: 0 };
        assert!(plan(&zero).is_err());
    }

    #[test]
    fn approximate_gcd_prefers_least_padding() {
        assert_eq!(approximate_gcd(&[11, 11, 34, 5], 11), 12);
        assert_eq!(approximate_gcd(&[4, 8], 4), 4);
        assert_eq!(approximate_gcd(&[6, 9], 3), 3);
    }
}
