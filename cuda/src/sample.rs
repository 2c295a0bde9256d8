//! The device sampler: rejection sampling of a step's verify chunks where the target's
//! logits are (kernel `sample_verify`, cuda/kernels/sample.cu), behind the engine's
//! [`DeviceSampler`] seam.
//!
//! Design (issue 11, "lm_head with argmax and sampling on the device"; vLLM v1 samples in
//! the model runner, on the GPU, `vllm/v1/sample/rejection_sampler.py`): the model
//! executor draws each request's uniforms ahead from a clone of its RNG
//! (`speclab_engine::spec::max_uniforms`), this module uploads them with the drafts and q
//! rows, one block a chunk verifies against the logits the forward left in the workspace
//! (`ForwardOptions::logits_on_device`), and only `(status, accepted, token, consumed)` a
//! chunk comes back. With sampling the forward's logits never cross to the host, and a
//! sampled step can be replayed from a CUDA graph like a greedy one.
//!
//! Invariants: the verdict of every chunk is `verify_with_uniforms` on the device's logits
//! (the host reference; `crate::check` compares them). Anything the kernel does not
//! decide (a row the host would refuse, no probability mass, draft ids or q rows the host
//! refuses, a vocabulary beyond the device sort for top-k / top-p) is decided by the host
//! reference on that chunk's logits rows, read back: the same result or the same error.

use speclab_engine::backend::{DeviceSampler, SampleReq};
use speclab_engine::spec::{
    check_draft_probs, max_uniforms, verify_with_uniforms, DraftProbs, SamplingParams,
    UniformVerdict, Verified,
};
use speclab_engine::Proposal;

use crate::backend::CudaBackend;
use crate::buf::DevBuf;
use crate::error::{CudaError, Result};
use crate::ops;

/// Threads of a `sample_verify` block (sample.cu `SAMPLE_THREADS`).
pub const SAMPLE_THREADS: u32 = 1024;
/// Largest vocabulary the kernel sorts for top-k / top-p (sample.cu `SORT_CAP`): its keys
/// fill `SORT_CAP * 8` bytes of shared memory.
pub const SORT_CAP: usize = 16384;
/// Dynamic shared memory `sample_verify` is allowed (`device::Gpu::new` opts in).
pub const SAMPLE_SMEM: u32 = (SORT_CAP * 8) as u32;

/// Keys the kernel sorts for `params` over `vocab` entries: `Some(0)` when neither top-k
/// nor top-p is on (no sort), `Some(n)` (a power of two >= vocab and >= the block's
/// [`SAMPLE_THREADS`]) when one is, `None`
/// when the vocabulary is beyond [`SORT_CAP`] (the host samples those steps).
pub fn sort_keys(params: &SamplingParams, vocab: usize) -> Option<usize> {
    let sorts = (params.top_k > 0 && params.top_k < vocab) || params.top_p < 1.0;
    match (sorts, vocab.next_power_of_two()) {
        (false, _) => Some(0),
        // At least one key a thread: the top-p walk splits the keys between the threads.
        (true, n) if n <= SORT_CAP => Some(n.max(SAMPLE_THREADS as usize)),
        _ => None,
    }
}

/// The sampler's device buffers, grown as steps need (kept by the backend).
pub(crate) struct SampleBufs {
    /// Per chunk [`META`] ints (row, k, draft offset, q offset or -1, uniform offset, kq,
    /// q id offset), then the drafts. Shape: [META C + drafts].
    meta: DevBuf<i32>,
    /// Shape: [total uniforms] f64.
    uniforms: DevBuf<f64>,
    /// The q rows of every chunk that has them: V floats a dense row, kq a sparse one.
    /// Shape: [packed q].
    q: DevBuf<f32>,
    /// The token ids of the sparse q rows. Shape: [packed ids].
    qid: DevBuf<i32>,
    /// One f64 distribution a chunk (scratch). Shape: [C, V].
    probs: DevBuf<f64>,
    /// Per chunk (status, accepted, token, consumed). Shape: [4 C].
    out: DevBuf<i32>,
}

fn grown<T>(
    b: DevBuf<T>,
    st: &std::sync::Arc<cudarc::driver::CudaStream>,
    n: usize,
    what: &str,
) -> Result<DevBuf<T>>
where
    T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits,
{
    if b.len >= n.max(1) {
        Ok(b)
    } else {
        DevBuf::zeros(st, n.next_power_of_two(), what)
    }
}

/// Ints a chunk's row of the kernel's metadata (sample.cu `sample_verify`).
pub const META: usize = 7;

/// Whether the kernel can take chunk `r` (else the host reference decides it).
fn device_ok(r: &SampleReq<'_>, vocab: usize, rows: usize) -> bool {
    let k = r.drafts.len();
    let rows_ok = r.row + k < rows;
    let drafts_ok = r.drafts.iter().all(|&t| (t as usize) < vocab);
    let sparse_ok = |q: &DraftProbs| match q {
        DraftProbs::Sparse(s) => s.k <= SAMPLE_THREADS as usize,
        DraftProbs::Dense(_) => true,
    };
    let q_ok =
        r.q.is_none_or(|q| sparse_ok(q) && check_draft_probs(q, k, vocab).is_ok());
    rows_ok && drafts_ok && q_ok && r.uniforms.len() >= max_uniforms(k)
}

/// The host arrays of one launch: meta + drafts, uniforms, q rows and sparse q ids.
#[derive(Default)]
struct Packed {
    meta: Vec<i32>,
    drafts: Vec<i32>,
    uniforms: Vec<f64>,
    q: Vec<f32>,
    qid: Vec<i32>,
}

fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| CudaError::Unsupported(format!("{what} = {v} exceeds a kernel int")))
}

fn pack(reqs: &[&SampleReq<'_>]) -> Result<Packed> {
    let mut p = Packed::default();
    for r in reqs {
        let k = r.drafts.len();
        let (q_off, id_off) = (
            int(p.q.len(), "q offset")?,
            int(p.qid.len(), "q id offset")?,
        );
        let (q_off, kq) = match r.q {
            Some(DraftProbs::Dense(rows)) => {
                rows.iter().for_each(|row| p.q.extend_from_slice(row));
                (q_off, 0)
            }
            Some(DraftProbs::Sparse(s)) => {
                p.q.extend_from_slice(&s.p);
                for &id in &s.ids {
                    p.qid.push(int(id as usize, "q id")?);
                }
                (q_off, int(s.k, "q pairs a row")?)
            }
            None => (-1, 0),
        };
        p.meta.extend([
            int(r.row, "logits row")?,
            int(k, "drafts")?,
            int(p.drafts.len(), "draft offset")?,
            q_off,
            int(p.uniforms.len(), "uniform offset")?,
            kq,
            id_off,
        ]);
        p.drafts.extend(r.drafts.iter().map(|&t| t as i32));
        p.uniforms.extend_from_slice(&r.uniforms[..max_uniforms(k)]);
    }
    Ok(p)
}

impl CudaBackend {
    /// The host reference on chunk `r`'s logits rows, read back (module doc).
    fn sample_on_host(&self, params: &SamplingParams, r: &SampleReq<'_>) -> Result<UniformVerdict> {
        let v = self.w.cfg.vocab_size;
        let rows = r.drafts.len() + 1;
        let have = self.logit_rows.unwrap_or(0);
        if r.row + rows > have {
            return Err(CudaError::Input(format!(
                "device sampler: chunk rows {}..{} past the {have} logits rows of the last forward",
                r.row,
                r.row + rows
            )));
        }
        let logits = self
            .ws
            .logits
            .read(&self.gpu.stream, r.row * v, rows * v, "logits")?;
        let prop = Proposal {
            tokens: r.drafts.to_vec(),
            probs: r.q.cloned(),
        };
        Ok(verify_with_uniforms(&logits, v, &prop, params, r.uniforms)?)
    }

    /// Every chunk the kernel can take in one launch; their raw 4-int verdicts.
    fn sample_launch(
        &mut self,
        params: &SamplingParams,
        reqs: &[&SampleReq<'_>],
        sort_n: usize,
    ) -> Result<Vec<i32>> {
        let v = self.w.cfg.vocab_size;
        let st = self.gpu.stream.clone();
        let c = reqs.len();
        let p = pack(reqs)?;
        let b = match self.sample_bufs.take() {
            Some(b) => b,
            None => SampleBufs {
                meta: DevBuf::zeros(&st, 1, "sampler metadata")?,
                uniforms: DevBuf::zeros(&st, 1, "sampler uniforms")?,
                q: DevBuf::zeros(&st, 1, "sampler q")?,
                qid: DevBuf::zeros(&st, 1, "sampler q ids")?,
                probs: DevBuf::zeros(&st, 1, "sampler probabilities")?,
                out: DevBuf::zeros(&st, 1, "sampler verdicts")?,
            },
        };
        let n_meta = p.meta.len() + p.drafts.len();
        let mut b = SampleBufs {
            meta: grown(b.meta, &st, n_meta, "sampler metadata")?,
            uniforms: grown(b.uniforms, &st, p.uniforms.len(), "sampler uniforms")?,
            q: grown(b.q, &st, p.q.len(), "sampler q")?,
            qid: grown(b.qid, &st, p.qid.len(), "sampler q ids")?,
            probs: grown(b.probs, &st, c * v, "sampler probabilities")?,
            out: grown(b.out, &st, 4 * c, "sampler verdicts")?,
        };
        let mut md = p.meta;
        md.extend_from_slice(&p.drafts);
        b.meta.write(&st, &md, "sampler metadata")?;
        b.uniforms.write(&st, &p.uniforms, "sampler uniforms")?;
        if !p.q.is_empty() {
            b.q.write(&st, &p.q, "sampler q")?;
        }
        if !p.qid.is_empty() {
            b.qid.write(&st, &p.qid, "sampler q ids")?;
        }
        let launch = ops::SampleVerify {
            out: &b.out,
            probs: &b.probs,
            logits: &self.ws.logits,
            logit_rows: self.logit_rows.unwrap_or(0),
            meta: &b.meta,
            chunks: c,
            drafts: p.drafts.len(),
            uniforms: &b.uniforms,
            q: &b.q,
            qid: &b.qid,
            vocab: v,
            params: *params,
            sort_n,
        };
        let ran = ops::sample_verify(&self.gpu, &launch)
            .and_then(|_| b.out.read(&st, 0, 4 * c, "sampler verdicts"));
        self.sample_bufs = Some(b);
        ran
    }

    /// [`DeviceSampler::sample`] with the crate's error.
    pub fn sample_chunks(
        &mut self,
        params: &SamplingParams,
        reqs: &[SampleReq<'_>],
    ) -> Result<Vec<UniformVerdict>> {
        params.validate().map_err(CudaError::Engine)?;
        if params.is_greedy() {
            return Err(CudaError::Input(
                "the device sampler needs sampling params (temperature > 0)".into(),
            ));
        }
        let v = self.w.cfg.vocab_size;
        let rows = self.logit_rows.unwrap_or(0);
        let sort = sort_keys(params, v);
        let on_device: Vec<usize> = (0..reqs.len())
            .filter(|&i| sort.is_some() && device_ok(&reqs[i], v, rows))
            .collect();
        let mut out: Vec<Option<UniformVerdict>> = vec![None; reqs.len()];
        if let (Some(sort_n), false) = (sort, on_device.is_empty()) {
            let picked: Vec<&SampleReq<'_>> = on_device.iter().map(|&i| &reqs[i]).collect();
            let raw = self.sample_launch(params, &picked, sort_n)?;
            for (&i, w) in on_device.iter().zip(raw.chunks_exact(4)) {
                if w[0] == 0 {
                    out[i] = Some(verdict(&reqs[i], w));
                }
            }
        }
        reqs.iter()
            .zip(out)
            .map(|(r, o)| match o {
                Some(v) => Ok(v),
                None => self.sample_on_host(params, r),
            })
            .collect()
    }
}

/// A kernel verdict `(0, accepted, token, consumed)` as the host reference states it.
fn verdict(r: &SampleReq<'_>, w: &[i32]) -> UniformVerdict {
    let accepted = (w[1].max(0) as usize).min(r.drafts.len());
    let mut tokens = r.drafts[..accepted].to_vec();
    tokens.push(w[2].max(0) as u32);
    UniformVerdict {
        verified: Verified {
            num_draft: r.drafts.len(),
            accepted,
            tokens,
        },
        consumed: w[3].max(0) as usize,
    }
}

impl DeviceSampler for CudaBackend {
    fn sample(
        &mut self,
        params: &SamplingParams,
        reqs: &[SampleReq<'_>],
    ) -> speclab_engine::Result<Vec<UniformVerdict>> {
        Ok(self.sample_chunks(params, reqs)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use speclab_engine::spec::SparseProbs;

    #[test]
    fn sort_only_for_top_k_or_top_p_and_within_the_cap() {
        let t = SamplingParams::random(1.0);
        assert_eq!(sort_keys(&t, 8200), Some(0));
        let k = SamplingParams { top_k: 50, ..t };
        assert_eq!(sort_keys(&k, 8200), Some(16384));
        // top_k >= V is off, as target_probs has it.
        assert_eq!(
            sort_keys(&SamplingParams { top_k: 8200, ..t }, 8200),
            Some(0)
        );
        let p = SamplingParams { top_p: 0.9, ..t };
        assert_eq!(sort_keys(&p, 5), Some(1024));
        assert_eq!(sort_keys(&p, SORT_CAP), Some(SORT_CAP));
        assert_eq!(sort_keys(&p, SORT_CAP + 1), None);
        assert_eq!(SAMPLE_SMEM as usize, SORT_CAP * 8);
    }

    #[test]
    fn chunks_the_kernel_cannot_take_go_to_the_host() {
        let us = [0.5; 3];
        let q_row = vec![0.25f32; 4];
        let q = DraftProbs::Dense(vec![q_row.clone(), q_row]);
        let ok = SampleReq {
            row: 1,
            drafts: &[1, 2],
            q: Some(&q),
            uniforms: &us,
        };
        assert!(device_ok(&ok, 4, 4));
        // Rows past the forward's logits, a draft outside the vocabulary, a q row of the
        // wrong width or with a negative entry, too few uniforms.
        assert!(!device_ok(&SampleReq { row: 2, ..ok }, 4, 4));
        assert!(!device_ok(
            &SampleReq {
                drafts: &[1, 4],
                ..ok
            },
            4,
            4
        ));
        let bad = DraftProbs::Dense(vec![vec![0.25f32; 3], vec![0.25f32; 4]]);
        assert!(!device_ok(
            &SampleReq {
                q: Some(&bad),
                ..ok
            },
            4,
            4
        ));
        let neg = DraftProbs::Dense(vec![vec![-0.1f32; 4], vec![0.25f32; 4]]);
        assert!(!device_ok(
            &SampleReq {
                q: Some(&neg),
                ..ok
            },
            4,
            4
        ));
        assert!(!device_ok(
            &SampleReq {
                uniforms: &us[..2],
                ..ok
            },
            4,
            4
        ));
        // Sparse rows: taken when they pass the host's checks and fit a block.
        let sparse = |k: usize, ids: Vec<u32>| {
            let p = vec![1.0 / k as f32; ids.len()];
            DraftProbs::Sparse(SparseProbs { k, ids, p })
        };
        let good = sparse(2, vec![1, 3, 2, 0]);
        assert!(device_ok(
            &SampleReq {
                q: Some(&good),
                ..ok
            },
            4,
            4
        ));
        let dup = sparse(2, vec![1, 1, 2, 0]);
        assert!(!device_ok(
            &SampleReq {
                q: Some(&dup),
                ..ok
            },
            4,
            4
        ));
        let wide = SAMPLE_THREADS as usize + 1;
        let big = sparse(
            wide,
            (0..2 * wide as u32).map(|i| i % wide as u32).collect(),
        );
        assert!(!device_ok(
            &SampleReq {
                q: Some(&big),
                ..ok
            },
            2 * wide,
            4
        ));
    }

    #[test]
    fn packing_offsets_index_each_chunks_inputs() {
        let us = [0.1, 0.2, 0.3, 0.4];
        let q = DraftProbs::Dense(vec![vec![1.0f32, 0.0]]);
        let a = SampleReq {
            row: 0,
            drafts: &[1],
            q: Some(&q),
            uniforms: &us,
        };
        let b = SampleReq {
            row: 3,
            drafts: &[],
            q: None,
            uniforms: &us,
        };
        let sq = DraftProbs::Sparse(SparseProbs {
            k: 2,
            ids: vec![5, 1, 0, 2],
            p: vec![0.5, 0.5, 0.25, 0.75],
        });
        let c = SampleReq {
            row: 5,
            drafts: &[5, 2],
            q: Some(&sq),
            uniforms: &us,
        };
        let p = pack(&[&a, &b, &c]).unwrap();
        assert_eq!(
            p.meta,
            vec![0, 1, 0, 0, 0, 0, 0, 3, 0, 1, -1, 2, 0, 0, 5, 2, 1, 2, 3, 2, 0]
        );
        assert_eq!(p.meta.len(), 3 * META);
        assert_eq!(p.drafts, vec![1, 5, 2]);
        // k + 1 uniforms a chunk, no more.
        assert_eq!(p.uniforms, vec![0.1, 0.2, 0.1, 0.1, 0.2, 0.3]);
        // The dense row's V floats, then the sparse rows' pairs (ids beside them).
        assert_eq!(p.q, vec![1.0, 0.0, 0.5, 0.5, 0.25, 0.75]);
        assert_eq!(p.qid, vec![5, 1, 0, 2]);
        let w = [0, 0, 7, 2];
        let v = verdict(&a, &w);
        assert_eq!(
            (v.verified.accepted, v.verified.tokens, v.consumed),
            (0, vec![7], 2)
        );
    }
}
