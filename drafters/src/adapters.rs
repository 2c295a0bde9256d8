//! Drafters behind the engine's seams: the DFlash2 adapter and the drafter factory.
//!
//! [`DFlash2Drafter`] wraps [`DFlash2`] (docs/dflash2.md §7) as a [`Drafter`]: after every
//! target pass it appends the committed positions' target features (the residual stream
//! after each of `target_layer_ids`, from `ForwardOut::per_layer_hidden`, which it asks
//! for through [`Drafter::layer_hidden`]) to its sliding-window KV, then drafts one
//! block from the anchor (the token just sampled, at position `n` = positions appended)
//! and returns the block's first `min(N, max_draft)` tokens, plus q when sampling.
//! DFlash v1 is the same drafter with the grouped convolutions and the selector off
//! ([`DraftMode::V1`]). Source: vLLM's DFlash proposer (`vllm/v1/spec_decode/dflash`:
//! `num_lookahead_tokens = N + 1`, context from the target's aux hidden states of the
//! accepted tokens, one parallel block pass).
//!
//! [`DrafterSpec`] is the engine's [`DrafterFactory`]: which drafter (`none`, `ngram`,
//! `mtp`, `dflash2`, `dflash1`), `N`, the weights, and the KV group the drafter needs
//! (DFlash2's `drafter_swa`, block size and cap policy chosen here), validated against the
//! target before any run (hidden size, vocab, target layer ids, `1 <= N <= block - 1`).
//!
//! Invariants: a proposal never exceeds `min(N, ctx.max_draft)`; DFlash2's context is
//! appended in position order, and a chunk at position 0 restarts it.

use std::path::Path;

use serde::{Deserialize, Serialize};
use std::str::FromStr;

use speclab_engine::exec::DrafterFactory;
use speclab_engine::kv::{CapPolicy, GroupSpec, KvCacheManager};
use speclab_engine::model::ModelConfig;
use speclab_engine::spec::DraftProbs;
use speclab_engine::{Drafter, EngineError, LayerHidden, Proposal, ProposeCtx, ReqSlot, Result};

use crate::dflash2::{DFlash2, DFlash2Weights, DraftMode, DraftRequest};
use crate::mtp::Mtp;
use crate::ngram::Ngram;
use crate::NoDraft;

fn bad(drafter: &str, reason: String) -> EngineError {
    EngineError::InvalidDrafterConfig {
        drafter: drafter.into(),
        reason,
    }
}

/// DFlash2 (or v1) behind the [`Drafter`] trait (module doc).
#[derive(Debug)]
pub struct DFlash2Drafter {
    inner: DFlash2,
    num_speculative_tokens: usize,
    mode: DraftMode,
}

impl DFlash2Drafter {
    /// A drafter whose context K/V live in `kv`'s `drafter_swa` group; checks the weights
    /// fit `target`, `1 <= N <= block_size - 1`, and that v2 has its conv + selector tensors.
    pub fn new(
        weights: DFlash2Weights,
        target: &ModelConfig,
        kv: &KvCacheManager,
        num_speculative_tokens: usize,
        mode: DraftMode,
    ) -> Result<Self> {
        check_dflash(&weights, target, num_speculative_tokens, mode)?;
        let group = dflash_group(kv)?;
        let inner = DFlash2::new(weights, target, kv, group)?;
        Ok(Self {
            inner,
            num_speculative_tokens,
            mode,
        })
    }

    /// The wrapped drafter.
    pub fn inner(&self) -> &DFlash2 {
        &self.inner
    }
    /// The drafting mode.
    pub fn mode(&self) -> DraftMode {
        self.mode
    }
}

/// Index of the `drafter_swa` group of `kv`, or the error naming what is missing (every
/// DFlash drafter, host or device, keeps its context K/V there).
pub fn dflash_group(kv: &KvCacheManager) -> Result<usize> {
    DFlash2::find_group(kv).ok_or_else(|| EngineError::InvalidLayout {
        field: "groups".into(),
        reason: format!(
            "the KV layout has no `{}` group; the DFlash2 drafter keeps its context K/V there (DFlash2Config::kv_group)",
            crate::dflash2::KV_GROUP_NAME
        ),
    })
}

/// The checks every DFlash drafter makes of its weights: the config, its fit to `target`,
/// `1 <= N <= block_size - 1`, and v2's conv + selector tensors.
pub fn check_dflash(
    weights: &DFlash2Weights,
    target: &ModelConfig,
    n: usize,
    mode: DraftMode,
) -> Result<()> {
    weights.cfg.validate()?;
    weights.cfg.check_target(target)?;
    weights.cfg.check_num_speculative_tokens(n)?;
    if mode == DraftMode::V2 && !weights.has_v2() {
        return Err(bad(
            "dflash2",
            "this checkpoint is v1-only (no conv + candidate-selector tensors); use the dflash1 drafter".into(),
        ));
    }
    Ok(())
}

impl Drafter for DFlash2Drafter {
    fn propose(&mut self, ctx: &mut ProposeCtx<'_>) -> Result<Proposal> {
        let slot = ctx.slot;
        let t = ctx.target.as_mut().ok_or_else(|| {
            bad(
                "dflash2",
                "the DFlash2 drafter needs the target pass (ProposeCtx::target) for its features"
                    .into(),
            )
        })?;
        if !t.rows.is_empty() {
            let feats = self.inner.features(t.forward, t.rows.clone())?;
            self.inner.append_context(t.kv, slot, t.start_pos, &feats)?;
        }
        let want = self.num_speculative_tokens.min(ctx.max_draft);
        if want == 0 {
            return Ok(Proposal::default());
        }
        let n = self.inner.context_len(slot).unwrap_or(0);
        if ctx.tokens.len() != n + 1 {
            return Err(bad(
                "dflash2",
                format!(
                    "request slot {}: {n} context positions appended but the request holds {} tokens; the anchor must be the only token without a feature",
                    slot.0,
                    ctx.tokens.len()
                ),
            ));
        }
        let temperature = if ctx.sampling.is_greedy() {
            0.0
        } else {
            ctx.sampling.temperature
        };
        let req = DraftRequest {
            slot,
            anchor_token: ctx.tokens[n],
            anchor_pos: n,
            num_speculative_tokens: self.num_speculative_tokens,
            mode: self.mode,
            temperature,
            trace: false,
        };
        // `&mut &mut dyn RngCore` is itself an RngCore (forwarding): a reborrow with the
        // call's lifetime.
        let rng = ctx.rng.as_mut().map(|r| r as &mut dyn rand::RngCore);
        let head: &dyn speclab_engine::backend::SharedHead = &*t.backend;
        let d = self.inner.draft(t.kv, head, &req, rng)?;
        let mut tokens = d.tokens;
        tokens.truncate(want);
        let probs = d.q.map(|mut q| {
            q.truncate(want);
            DraftProbs::Dense(q)
        });
        Ok(Proposal { tokens, probs })
    }

    fn lookahead_slots(&self) -> usize {
        DrafterKind::Dflash2.lookahead(self.num_speculative_tokens)
    }

    fn layer_hidden(&self) -> LayerHidden {
        LayerHidden::Host
    }

    fn release(&mut self, slot: ReqSlot) {
        self.inner.release(slot);
    }
}

/// Which drafter: the one vocabulary of the CLI (`--drafter`), manifests (`drafter.kind`,
/// `real.drafters`) and records (`none`, `ngram`, `mtp`, `dflash2`, `dflash1`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum DrafterKind {
    /// No drafter (N = 0): the spec-off control.
    #[default]
    None,
    /// vLLM's n-gram prompt lookup.
    Ngram,
    /// The target's MTP layer.
    Mtp,
    /// DFlash2 (grouped conv + candidate selector).
    Dflash2,
    /// DFlash v1 (the DFlash2 checkpoint with conv and selector off).
    Dflash1,
}

impl DrafterKind {
    /// Every kind, in order.
    pub const ALL: [DrafterKind; 5] = [
        Self::None,
        Self::Ngram,
        Self::Mtp,
        Self::Dflash2,
        Self::Dflash1,
    ];
    /// The names `FromStr` accepts.
    pub const NAMES: [&'static str; 5] = ["none", "ngram", "mtp", "dflash2", "dflash1"];

    /// The name.
    pub fn name(self) -> &'static str {
        match self {
            DrafterKind::None => "none",
            DrafterKind::Ngram => "ngram",
            DrafterKind::Mtp => "mtp",
            DrafterKind::Dflash2 => "dflash2",
            DrafterKind::Dflash1 => "dflash1",
        }
    }

    /// Parse a name as written in manifests (exact spelling).
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == s)
    }

    /// DFlash (v1 or v2): needs a checkpoint directory and its own KV group.
    pub fn is_dflash(self) -> bool {
        matches!(self, Self::Dflash2 | Self::Dflash1)
    }

    /// Drafts per step with `n` speculative tokens (0 without a drafter).
    pub fn drafts_per_step(self, n: usize) -> usize {
        if self == Self::None {
            0
        } else {
            n
        }
    }

    /// vLLM's lookahead slots per step (`VllmConfig.num_lookahead_tokens`): N for MTP
    /// (EAGLE-style proposers write KV for N positions), N + 1 for DFlash (the bonus
    /// query + one per draft, `DFlash2Config::lookahead_slots`), 0 for n-gram and none
    /// (no drafter KV). The one place this rule lives.
    pub fn lookahead(self, n: usize) -> usize {
        match self {
            DrafterKind::None | DrafterKind::Ngram => 0,
            DrafterKind::Mtp => n,
            DrafterKind::Dflash2 | DrafterKind::Dflash1 => {
                crate::dflash2::DFlash2Config::lookahead_slots(n)
            }
        }
    }
}

impl FromStr for DrafterKind {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "none" => DrafterKind::None,
            "ngram" => DrafterKind::Ngram,
            "mtp" => DrafterKind::Mtp,
            "dflash2" => DrafterKind::Dflash2,
            "dflash1" | "dflash" => DrafterKind::Dflash1,
            other => {
                return Err(bad(
                    other,
                    format!(
                        "unknown drafter kind `{other}`; expected one of {}",
                        Self::NAMES.join(", ")
                    ),
                ))
            }
        })
    }
}

/// A drafter's description, validated against the target: the engine's [`DrafterFactory`].
#[derive(Debug, Clone)]
pub struct DrafterSpec {
    pub kind: DrafterKind,
    /// `N` (0 for `none`).
    pub num_speculative_tokens: usize,
    /// n-gram bounds (vLLM `prompt_lookup_min` / `prompt_lookup_max`).
    pub prompt_lookup_min: usize,
    pub prompt_lookup_max: usize,
    /// DFlash weights (dflash1 / dflash2).
    pub dflash: Option<DFlash2Weights>,
    /// Block size of DFlash's `drafter_swa` group (the card's stack: 16).
    pub dflash_block_size: u32,
    /// Cap policy of DFlash's sliding-window group.
    pub dflash_cap: CapPolicy,
}

impl DrafterSpec {
    /// No drafter.
    pub fn none() -> Self {
        Self {
            kind: DrafterKind::None,
            num_speculative_tokens: 0,
            prompt_lookup_min: 5,
            prompt_lookup_max: 5,
            dflash: None,
            dflash_block_size: 16,
            dflash_cap: CapPolicy::default(),
        }
    }

    /// n-gram with bounds `[min, max]` (vLLM's default: 5, 5).
    pub fn ngram(num_speculative_tokens: usize, min: usize, max: usize) -> Result<Self> {
        Ngram::new(min, max, num_speculative_tokens)?;
        Ok(Self {
            kind: DrafterKind::Ngram,
            num_speculative_tokens,
            prompt_lookup_min: min,
            prompt_lookup_max: max,
            ..Self::none()
        })
    }

    /// The target's MTP layer.
    pub fn mtp(target: &ModelConfig, num_speculative_tokens: usize) -> Result<Self> {
        Mtp::new(target, num_speculative_tokens)?;
        Ok(Self {
            kind: DrafterKind::Mtp,
            num_speculative_tokens,
            ..Self::none()
        })
    }

    /// DFlash (v2: `mode = V2`; v1: `V1`) with its group at `block_size` / `cap`.
    pub fn dflash(
        weights: DFlash2Weights,
        target: &ModelConfig,
        num_speculative_tokens: usize,
        mode: DraftMode,
        block_size: u32,
        cap: CapPolicy,
    ) -> Result<Self> {
        check_dflash(&weights, target, num_speculative_tokens, mode)?;
        weights.cfg.kv_group(block_size, cap)?;
        let kind = if mode == DraftMode::V2 {
            DrafterKind::Dflash2
        } else {
            DrafterKind::Dflash1
        };
        Ok(Self {
            kind,
            num_speculative_tokens,
            dflash: Some(weights),
            dflash_block_size: block_size,
            dflash_cap: cap,
            ..Self::none()
        })
    }

    /// From a kind name and (for DFlash) a checkpoint directory; n-gram uses vLLM's bounds,
    /// DFlash's group block 16 with cap `cap`. `none` ignores `num_speculative_tokens`.
    pub fn load(
        kind: &str,
        dir: Option<&Path>,
        target: &ModelConfig,
        num_speculative_tokens: usize,
        cap: CapPolicy,
    ) -> Result<Self> {
        let kind: DrafterKind = kind.parse()?;
        match kind {
            DrafterKind::None => Ok(Self::none()),
            DrafterKind::Ngram => Self::ngram(num_speculative_tokens, 5, 5),
            DrafterKind::Mtp => Self::mtp(target, num_speculative_tokens),
            DrafterKind::Dflash2 | DrafterKind::Dflash1 => {
                let dir = dir.ok_or_else(|| {
                    bad(
                        kind.name(),
                        "needs the drafter checkpoint directory (--drafter-dir)".into(),
                    )
                })?;
                let w = DFlash2Weights::load_for_target(dir, target)?;
                let mode = if kind == DrafterKind::Dflash2 {
                    DraftMode::V2
                } else {
                    DraftMode::V1
                };
                Self::dflash(w, target, num_speculative_tokens, mode, 16, cap)
            }
        }
    }

    /// vLLM's lookahead slots ([`DrafterKind::lookahead`]).
    pub fn lookahead_slots(&self) -> usize {
        self.kind.lookahead(self.num_speculative_tokens)
    }

    /// The default pool of a run when none is given (`speclab generate`, real manifest
    /// legs): every request at its full length `min(prompt + max_tokens + N + 1,
    /// max_model_len)` at once, in the target's full-attention group at `block_size`,
    /// `1 + N` KDA snapshot blocks, and a DFlash window group at this spec's
    /// `dflash_block_size` sized without a cap (+ 2), plus the null block. The DFlash
    /// term is counted for every drafter kind (an upper bound; the recorded legs were
    /// sized this way). Saturates at `u32::MAX`.
    pub fn default_num_blocks(
        &self,
        block_size: u32,
        max_model_len: u64,
        requests: &[speclab_engine::exec::EngineRequest],
    ) -> u32 {
        let n = self.num_speculative_tokens() as u64;
        let (bs, dbs) = (
            u64::from(block_size.max(1)),
            u64::from(self.dflash_block_size.max(1)),
        );
        let need = requests.iter().fold(0u64, |acc, r| {
            let len = (r.prompt.len() as u64)
                .saturating_add(r.max_tokens)
                .saturating_add(n + 1)
                .min(max_model_len);
            let per = len.div_ceil(bs) + 1 + n + len.div_ceil(dbs) + 2;
            acc.saturating_add(per)
        });
        u32::try_from(need.saturating_add(1)).unwrap_or(u32::MAX)
    }
}

impl DrafterFactory for DrafterSpec {
    fn num_speculative_tokens(&self) -> usize {
        if self.kind == DrafterKind::None {
            0
        } else {
            self.num_speculative_tokens
        }
    }

    fn kv_groups(&self) -> Result<Vec<GroupSpec>> {
        match (&self.kind, &self.dflash) {
            (DrafterKind::Dflash2 | DrafterKind::Dflash1, Some(w)) => Ok(vec![w
                .cfg
                .kv_group(self.dflash_block_size, self.dflash_cap)?]),
            (DrafterKind::Dflash2 | DrafterKind::Dflash1, None) => Err(bad(
                self.kind.name(),
                "no DFlash weights in the spec".into(),
            )),
            _ => Ok(Vec::new()),
        }
    }

    fn build(&self, target: &ModelConfig, kv: &KvCacheManager) -> Result<Box<dyn Drafter>> {
        let n = self.num_speculative_tokens;
        Ok(match self.kind {
            DrafterKind::None => Box::new(NoDraft),
            DrafterKind::Ngram => Box::new(Ngram::new(
                self.prompt_lookup_min,
                self.prompt_lookup_max,
                n,
            )?),
            DrafterKind::Mtp => Box::new(Mtp::new(target, n)?),
            DrafterKind::Dflash2 | DrafterKind::Dflash1 => {
                let w = self
                    .dflash
                    .clone()
                    .ok_or_else(|| bad(self.kind.name(), "no DFlash weights in the spec".into()))?;
                let mode = if self.kind == DrafterKind::Dflash2 {
                    DraftMode::V2
                } else {
                    DraftMode::V1
                };
                Box::new(DFlash2Drafter::new(w, target, kv, n, mode)?)
            }
        })
    }
}

#[cfg(test)]
mod pool_plan_tests {
    //! The pool planned from bytes (`speclab_engine::exec::plan_run_pool`) against what the
    //! stores really allocate, for models/tiny + models/dflash2-tiny's actual configs.
    use super::*;
    use crate::dflash2::{DFlash2, DFlash2Weights, DraftMode};
    use speclab_engine::exec::{plan_run_pool, EngineOptions};
    use speclab_engine::kv::KvCacheManager;
    use speclab_engine::model::kv_store::KvGeometry;
    use speclab_engine::model::{KvStore, ModelConfig};
    use std::path::Path;

    fn configs() -> (ModelConfig, crate::DFlash2Config) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let t = ModelConfig::from_file(&root.join("models/tiny/config.json")).unwrap();
        let d =
            crate::DFlash2Config::from_file(&root.join("models/dflash2-tiny/config.json")).unwrap();
        (t, d)
    }

    #[test]
    fn planned_pool_equals_the_stores_allocation_for_models_tiny() {
        let (tcfg, dcfg) = configs();
        let w = DFlash2Weights::random(&dcfg, 7).unwrap();
        let opts = EngineOptions::default();
        let bytes = 180_000_000u64;
        // Spec-off: the target's groups only.
        let none = DrafterSpec::none();
        let p = plan_run_pool(&tcfg, &none, &opts, bytes).unwrap();
        // full: 3 layers (2 attention + MTP) x 16 x 2 (K,V) x 2 kv heads x 64 x 4 B;
        // kda_state: 6 KDA layers x (3 x 3 x 256 + 4 x 64 x 64) x 4 B.
        let full = 3 * 16 * 2 * 2 * 64 * 4;
        let state = 6 * (3 * 3 * 256 + 4 * 64 * 64) * 4;
        assert_eq!(p.plan.groups.len(), 2);
        assert_eq!(p.plan.groups[0].bytes_per_block, full);
        assert_eq!(p.plan.groups[1].bytes_per_block, state);
        assert_eq!(p.plan.bytes_per_block, 448_512);
        assert_eq!(p.plan.num_blocks, 401);
        assert_eq!(p.drafter_store_bytes_per_block, 0);
        for cap in [CapPolicy::None, CapPolicy::WindowPlusTwo] {
            let spec = DrafterSpec::dflash(w.clone(), &tcfg, 7, DraftMode::V2, 16, cap).unwrap();
            let p = plan_run_pool(&tcfg, &spec, &opts, bytes).unwrap();
            let drafter = 3 * 16 * 2 * 2 * 64 * 4;
            assert_eq!(p.plan.groups.len(), 3);
            assert_eq!(p.plan.groups[2].bytes_per_block, drafter);
            assert_eq!(p.plan.bytes_per_block, state.max(full).max(drafter));
            assert_eq!(p.plan.num_blocks as u64, bytes / p.plan.bytes_per_block);
            // The run's manager with the planned pool, and the stores built on it.
            let mut layout = tcfg.kv_layout(16, 7, p.plan.num_blocks).unwrap();
            layout.groups.extend(spec.kv_groups().unwrap());
            let kv = KvCacheManager::new(&layout, p.plan.num_blocks).unwrap();
            let n = p.plan.num_blocks as usize;
            let host = KvStore::new(&tcfg, &kv).unwrap();
            assert_eq!(host.bytes(), n * p.target_store_bytes_per_block as usize);
            assert_eq!(
                4 * host.floats_per_block() as u64,
                p.target_store_bytes_per_block
            );
            // The CUDA engine's device pool is sized by the same geometry.
            let geo = KvGeometry::new(&tcfg, &kv).unwrap();
            assert_eq!(
                4 * geo.total_floats().unwrap() as u64,
                p.target_store_bytes()
            );
            let g = DFlash2::find_group(&kv).unwrap();
            let d = DFlash2::new(w.clone(), &tcfg, &kv, g).unwrap();
            assert_eq!(
                d.store().bytes(),
                n * p.drafter_store_bytes_per_block as usize
            );
            assert_eq!(
                (host.bytes() + d.store().bytes()) as u64,
                p.allocated_bytes()
            );
        }
    }

    #[test]
    fn a_budget_below_one_block_is_an_error() {
        let (tcfg, _) = configs();
        let e = plan_run_pool(
            &tcfg,
            &DrafterSpec::none(),
            &EngineOptions::default(),
            448_511,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("0 blocks"), "{e}");
    }
}
