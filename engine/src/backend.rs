//! The model seam: [`TargetBackend`] and [`SharedHead`], what the model executor and
//! the neural drafters (MTP, DFlash2) reach the target through.
//!
//! Where the cut is, and why (DESIGN.md "The GPU engine": "the target and the neural
//! drafters reach the model through one small trait, so a drafter is written once and
//! the CPU reference stays the oracle for the CUDA backend"; vLLM v1's
//! `GPUModelRunner.execute_model` / `propose_draft_token_ids` split):
//! - one call per batch, not per layer: [`TargetBackend::forward`] runs every decoder
//!   layer of every scheduled chunk (prefill chunks, decode rows, verify rows with KDA
//!   snapshots) against the KV manager's block tables, so a device backend keeps
//!   weights, KV pages and KDA state on the device and crosses to the host once a step
//!   (the rows the step samples from, and the hidden rows a drafter asked for);
//! - the MTP layer is part of the target ([`TargetBackend::mtp_forward`]): its weights
//!   and K/V (the `full` group) live with the target's;
//! - the KDA state rollback after a verify is the backend's ([`TargetBackend::commit_state`]):
//!   the state lives in the `kda_state` group's blocks, one snapshot per speculative
//!   position, and choosing the accepted snapshot is a device-side copy;
//! - the embedding and lm_head that DFlash2 shares with the target are a separate
//!   trait ([`SharedHead`]), the only thing a drafter with its own layers needs of the
//!   target's weights.
//!
//! The CPU reference ([`crate::model::ModelRunner`] + [`crate::model::ModelWeights`])
//! implements both. Rows cross the seam as host `f32` tensors today; a device backend
//! returns the same shapes (copied out once per step).
//!
//! Invariants: a backend addresses KV memory only through block tables of the
//! [`KvCacheManager`] it was built for; errors, never panics, on bad batches.

use crate::kv::KvCacheManager;
use crate::model::{
    ForwardOptions, ForwardOut, ModelRunner, ModelWeights, MtpChunk, MtpOut, SeqChunk,
};
use crate::request::ReqSlot;
use crate::{EngineError, Result};

/// The shared embedding and lm_head of the target (DFlash2 drafts through them).
pub trait SharedHead {
    /// `(hidden_size, vocab_size)` of the embedding / lm_head.
    fn head_dims(&self) -> (usize, usize);
    /// Embedding rows of `tokens`. Shape: [T, H].
    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>>;
    /// `lm_head` over `rows` hidden rows. `hidden`: [rows, H]; returns [rows, V].
    fn lm_head(&self, hidden: &[f32], rows: usize) -> Result<Vec<f32>>;
}

/// The target model behind the seam (module doc).
pub trait TargetBackend: SharedHead {
    /// One batched target forward over `batch` (the protocol of
    /// [`ModelRunner::forward_with`]: tables allocated by the scheduler, positions
    /// `0..start_pos` computed earlier, snapshots for verify chunks).
    fn forward(
        &mut self,
        kv: &KvCacheManager,
        batch: &[SeqChunk<'_>],
        opts: &ForwardOptions,
    ) -> Result<ForwardOut>;
    /// The MTP layer over `(hidden, next token)` rows (docs/model.md §6).
    fn mtp_forward(
        &mut self,
        kv: &KvCacheManager,
        batch: &[MtpChunk<'_>],
        opts: &ForwardOptions,
    ) -> Result<MtpOut>;
    /// After a verify of `slot`: the KDA state after `accepted + 1` tokens becomes the
    /// committed one.
    fn commit_state(&mut self, kv: &KvCacheManager, slot: ReqSlot, accepted: usize) -> Result<()>;
    /// Forget a request's model state (it finished, was preempted, or starts afresh).
    fn release(&mut self, slot: ReqSlot);
    /// The backend itself, for a drafter built to run on the same device (the CUDA
    /// DFlash2 reads the target's features and shares its embedding and head there).
    /// `None` (the default): no such drafter can use this backend.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
    /// The backend's sampler on its device, when it has one: the model executor then
    /// asks the forward to keep sampled steps' logits there
    /// ([`ForwardOptions::logits_on_device`]) and verifies through it. `None` (the
    /// default, and the CPU reference): logits cross to the host and are sampled there.
    fn device_sampler(&mut self) -> Option<&mut dyn DeviceSampler> {
        None
    }
}

/// One sampling chunk of the last forward, for [`DeviceSampler::sample`].
#[derive(Debug, Clone, Copy)]
pub struct SampleReq<'a> {
    /// The chunk's first logits row, in the rows the forward's logits would hold on the
    /// host (`LogitsRows::All`: the chunk's offset; `LastPerChunk`: its index).
    pub row: usize,
    /// Drafts verified against rows `row .. row + k`; row `row + k` gives the bonus.
    /// Shape: [k].
    pub drafts: &'a [u32],
    /// The drafter's q (k rows, dense or sparse), or `None` for one-hot q.
    pub q: Option<&'a crate::spec::DraftProbs>,
    /// The uniforms the request's RNG would give next, in order (at least
    /// [`crate::spec::max_uniforms`]`(k)`). Shape: [>= k + 1].
    pub uniforms: &'a [f64],
}

/// Rejection sampling ([`crate::spec::verify_with_uniforms`]'s contract) of the last
/// forward's logits where they are, without copying them to the host.
pub trait DeviceSampler {
    /// Verify every chunk of `reqs` against the last forward's logits (kept by
    /// [`ForwardOptions::logits_on_device`]) under sampling `params`: for each, what
    /// `verify_with_uniforms` gives on those logits (tokens and uniforms consumed), or
    /// its error.
    fn sample(
        &mut self,
        params: &crate::spec::SamplingParams,
        reqs: &[SampleReq<'_>],
    ) -> Result<Vec<crate::spec::UniformVerdict>>;
}

impl SharedHead for ModelWeights {
    fn head_dims(&self) -> (usize, usize) {
        (self.cfg.hidden_size, self.cfg.vocab_size)
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let (h, v) = self.head_dims();
        if self.embed.len() != v * h {
            return Err(EngineError::ModelInput(format!(
                "embed_tokens holds {} values, expected [{v}, {h}]",
                self.embed.len()
            )));
        }
        let mut x = Vec::with_capacity(tokens.len() * h);
        for &t in tokens {
            let t = t as usize;
            if t >= v {
                return Err(EngineError::ModelInput(format!(
                    "token id {t} is not below vocab_size {v}"
                )));
            }
            x.extend_from_slice(&self.embed[t * h..(t + 1) * h]);
        }
        Ok(x)
    }

    fn lm_head(&self, hidden: &[f32], rows: usize) -> Result<Vec<f32>> {
        self.lm_head.forward(hidden, rows)
    }
}

impl SharedHead for ModelRunner {
    fn head_dims(&self) -> (usize, usize) {
        self.weights().head_dims()
    }
    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.weights().embed(tokens)
    }
    fn lm_head(&self, hidden: &[f32], rows: usize) -> Result<Vec<f32>> {
        SharedHead::lm_head(self.weights(), hidden, rows)
    }
}

impl TargetBackend for ModelRunner {
    fn forward(
        &mut self,
        kv: &KvCacheManager,
        batch: &[SeqChunk<'_>],
        opts: &ForwardOptions,
    ) -> Result<ForwardOut> {
        self.forward_with(kv, batch, opts)
    }
    fn mtp_forward(
        &mut self,
        kv: &KvCacheManager,
        batch: &[MtpChunk<'_>],
        opts: &ForwardOptions,
    ) -> Result<MtpOut> {
        ModelRunner::mtp_forward(self, kv, batch, opts)
    }
    fn commit_state(&mut self, kv: &KvCacheManager, slot: ReqSlot, accepted: usize) -> Result<()> {
        ModelRunner::commit_state(self, kv, slot, accepted)
    }
    fn release(&mut self, slot: ReqSlot) {
        ModelRunner::release(self, slot)
    }
}

/// Builds the run's target backend over its KV manager (the CPU reference by default;
/// a device backend sizes its KV pages from the same manager).
pub trait BackendFactory {
    /// A backend for `weights` whose KV memory matches `kv`'s pool and groups.
    fn build(&self, weights: &ModelWeights, kv: &KvCacheManager) -> Result<Box<dyn TargetBackend>>;
}

/// The CPU reference backend ([`ModelRunner`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl BackendFactory for CpuBackend {
    fn build(&self, weights: &ModelWeights, kv: &KvCacheManager) -> Result<Box<dyn TargetBackend>> {
        Ok(Box::new(ModelRunner::new(weights.clone(), kv)?))
    }
}
