//! DFlash2: the block-diffusion drafter (DFlash v1 = the same drafter with the grouped
//! convolutions and the candidate selector off).
//!
//! Contract: docs/dflash2.md (formulas, tensors, inference procedure); reference
//! `recipes/dflash2.py`; fixture + goldens `tests/fixtures/dflash2/`
//! (`recipes/make_dflash2_fixture.py`, over the micro target of `tests/fixtures/model/`).
//!
//! Modules: [`config`] (config.json, presets, validation, the drafter's sliding-window KV
//! group), [`weights`] (checkpoint loading via the engine's mmap'd safetensors reader,
//! export, seeded random init), [`forward`] ([`DFlash2`]: context append, draft step, v1
//! and v2), [`conv`] (grouped dynamic depthwise conv), [`selector`] (top-k candidates,
//! pair scores, sampling helpers), [`kv`] (host K/V pages indexed by the KV manager's
//! block ids).
//!
//! Usage (one request; `kv` built from the target's `ModelConfig::kv_layout` plus
//! `DFlash2Config::kv_group`, every allocation with lookahead `N + 1`):
//! 1. target prefill with `ForwardOptions { collect_hidden: true }`;
//!    `append_context(kv, slot, 0, &features)` (§3, §4);
//! 2. `draft(kv, target, &DraftRequest { anchor_pos: n, .. }, rng)` -> `N` tokens (+ `q`);
//! 3. target verify, accept `A`; `append_context(kv, slot, n, features of rows 0..=A)`.
//!
//! Invariant: every tensor of the drafter's context lives in the blocks the KV manager
//! gave the drafter group; an evicted (null) block is never read.

pub mod config;
pub mod conv;
pub mod forward;
pub mod kv;
pub mod selector;
pub mod weights;

pub use config::{DFlash2Config, KV_GROUP_NAME};
pub use forward::{
    pick_rows, target_features, DFlash2, Draft, DraftMode, DraftRequest, SelectorTrace,
};
pub use kv::{DraftGroup, DraftKvStore};
pub use selector::{walk_greedy, walk_sampled};
pub use weights::DFlash2Weights;
