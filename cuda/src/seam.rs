//! [`CudaBackend`] behind the engine's backend seam (`engine/src/backend.rs`):
//! `TargetBackend`, `SharedHead`, and a `BackendFactory` ([`CudaFactory`]).
//!
//! Design: the trait methods delegate to the inherent methods of the same names (which
//! return the crate's [`CudaError`]) and map errors into `EngineError` (`Engine` passes
//! through, bad input -> `ModelInput`, unsupported -> `Unsupported`, device / driver /
//! NVRTC failures -> `Io` on the "cuda device" path). `SharedHead::embed` reads a host
//! copy of the bf16 embedding (exact, as the device's); `SharedHead::lm_head` runs the
//! device GEMM on temporary buffers (a drafter call, not part of a captured step).
//!
//! Invariants: the seam adds no behaviour: a `Box<dyn TargetBackend>` of a CudaBackend
//! answers exactly as the inherent API does.

use speclab_engine::backend::{BackendFactory, DeviceSampler, SharedHead, TargetBackend};
use speclab_engine::kv::KvCacheManager;
use speclab_engine::model::{ForwardOptions, ForwardOut, ModelWeights, MtpChunk, MtpOut, SeqChunk};
use speclab_engine::{EngineError, ReqSlot};

use crate::backend::{CudaBackend, CudaOptions};
use crate::buf::DevBuf;
use crate::error::CudaError;
use crate::ops::{self, Mat};

impl From<CudaError> for EngineError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Engine(e) => e,
            CudaError::Input(m) => EngineError::ModelInput(m),
            CudaError::Unsupported(m) => EngineError::Unsupported(m),
            other => EngineError::Io {
                path: "cuda device".into(),
                reason: other.to_string(),
            },
        }
    }
}

type EResult<T> = speclab_engine::Result<T>;

impl SharedHead for CudaBackend {
    fn head_dims(&self) -> (usize, usize) {
        (self.w.cfg.hidden_size, self.w.cfg.vocab_size)
    }

    fn embed(&self, tokens: &[u32]) -> EResult<Vec<f32>> {
        let (h, v) = self.head_dims();
        let mut x = Vec::with_capacity(tokens.len() * h);
        for &t in tokens {
            let t = t as usize;
            if t >= v {
                return Err(EngineError::ModelInput(format!(
                    "token id {t} is not below vocab_size {v}"
                )));
            }
            x.extend(
                self.embed_host[t * h..(t + 1) * h]
                    .iter()
                    .map(|&b| f32::from_bits(u32::from(b) << 16)),
            );
        }
        Ok(x)
    }

    fn lm_head(&self, hidden: &[f32], rows: usize) -> EResult<Vec<f32>> {
        let (h, v) = self.head_dims();
        if hidden.len() != rows * h || rows == 0 {
            return Err(EngineError::ModelInput(format!(
                "lm_head: {} hidden values for {rows} rows of {h}",
                hidden.len()
            )));
        }
        let st = &self.gpu.stream;
        let x = DevBuf::upload(st, hidden, "lm_head input")?;
        let y = DevBuf::<f32>::zeros(st, rows * v, "lm_head output")?;
        let lin = ops::Linear {
            y: Mat::rows(&y, v),
            x: Mat::rows(&x, h),
            w: &self.w.lm_head,
            m: rows,
            n: v,
            k: h,
            accumulate: false,
        };
        ops::linear(&self.gpu, &lin)?;
        Ok(y.read(st, 0, rows * v, "lm_head output")?)
    }
}

impl TargetBackend for CudaBackend {
    fn forward(
        &mut self,
        kv: &KvCacheManager,
        batch: &[SeqChunk<'_>],
        opts: &ForwardOptions,
    ) -> EResult<ForwardOut> {
        Ok(CudaBackend::forward(self, kv, batch, opts)?)
    }
    fn mtp_forward(
        &mut self,
        kv: &KvCacheManager,
        batch: &[MtpChunk<'_>],
        opts: &ForwardOptions,
    ) -> EResult<MtpOut> {
        Ok(CudaBackend::mtp_forward(self, kv, batch, opts)?)
    }
    fn commit_state(&mut self, kv: &KvCacheManager, slot: ReqSlot, accepted: usize) -> EResult<()> {
        Ok(CudaBackend::commit_state(self, kv, slot, accepted)?)
    }
    fn release(&mut self, slot: ReqSlot) {
        CudaBackend::release(self, slot)
    }
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
    fn device_sampler(&mut self) -> Option<&mut dyn DeviceSampler> {
        if self.options().device_sampling {
            Some(self)
        } else {
            None
        }
    }
}

/// The CUDA backend behind `b`, for a drafter (`who`) that runs beside it on the device.
pub(crate) fn cuda_backend<'a>(
    b: &'a mut dyn TargetBackend,
    who: &str,
) -> std::result::Result<&'a mut CudaBackend, CudaError> {
    b.as_any_mut()
        .and_then(|a| a.downcast_mut::<CudaBackend>())
        .ok_or_else(|| {
            CudaError::Unsupported(format!(
                "{who} runs only beside the CUDA target backend (--device cuda)"
            ))
        })
}

/// Builds [`CudaBackend`]s for the step loop (`--device cuda`).
#[derive(Debug, Clone, Copy, Default)]
pub struct CudaFactory {
    pub opts: CudaOptions,
}

impl BackendFactory for CudaFactory {
    fn build(
        &self,
        weights: &ModelWeights,
        kv: &KvCacheManager,
    ) -> EResult<Box<dyn TargetBackend>> {
        Ok(Box::new(CudaBackend::with_options(weights, kv, self.opts)?))
    }
}

/// A drafter built for the CUDA backend, proposing beside the CPU runner: the error it
/// must give (tests of `CudaDFlash2` and `CudaMtp`).
#[cfg(test)]
pub(crate) fn host_propose_error(
    d: &mut dyn speclab_engine::Drafter,
    cpu: &mut speclab_engine::model::ModelRunner,
    kv: &KvCacheManager,
) -> String {
    let fwd = ForwardOut::default();
    let mut step = speclab_engine::DraftStep {
        backend: cpu,
        kv,
        forward: &fwd,
        sampling: speclab_engine::spec::SamplingParams::GREEDY,
    };
    let tokens = [1u32, 2, 3];
    let mut reqs = [speclab_engine::DraftReq {
        request: 0,
        slot: ReqSlot(0),
        tokens: &tokens,
        max_draft: 3,
        rng: None,
        rows: 0..2,
        start_pos: 0,
    }];
    match d.propose_batch(&mut step, &mut reqs) {
        Ok(_) => String::from("(no error)"),
        Err(e) => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn errors_map_into_engine_errors() {
        assert!(matches!(
            EngineError::from(CudaError::Input("x".into())),
            EngineError::ModelInput(_)
        ));
        assert!(matches!(
            EngineError::from(CudaError::Unsupported("x".into())),
            EngineError::Unsupported(_)
        ));
        assert!(matches!(
            EngineError::from(CudaError::NoDriver),
            EngineError::Io { .. }
        ));
        let e = EngineError::ModelInput("inner".into());
        assert!(
            matches!(EngineError::from(CudaError::Engine(e)), EngineError::ModelInput(m) if m == "inner")
        );
    }
}
