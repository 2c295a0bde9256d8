//! The device check: parity of the CUDA engine against the CPU engine (and the PyTorch
//! goldens) on models/tiny, then decode-step timing. Run by `examples/gpu_check.rs`
//! (one device call: `recipes/gpu_check.sh`) and, for parity, by `tests/gpu_parity.rs`.
//!
//! Source: tests/it/model_tiny_parity.rs (the golden comparisons, mirrored), docs/model.md
//! §1.6 (tolerance: `max|a-b| / max|b| < 1e-2`, greedy tokens identical).
//!
//! Invariants: the CPU `ModelRunner` and every `CudaBackend` of a check share ONE
//! `KvCacheManager`, so both engines address their own memory with the same block ids;
//! every comparison is recorded as a [`CheckLine`] (value, bound, pass), nothing is
//! asserted here, so one device call reports every failure at once.

use std::path::Path;
use std::time::Instant;

use serde::Serialize;
use speclab_engine::kv::manager::AllocArgs;
use speclab_engine::kv::{AllocOutcome, KvCacheManager};
use speclab_engine::model::ops::{argmax, rel_err};
use speclab_engine::model::{
    Checkpoint, ForwardOptions, LogitsRows, ModelRunner, ModelWeights, MtpChunk, SeqChunk,
};
use speclab_engine::{ReqSlot, RequestStatus, RequestView};

use crate::backend::{CudaBackend, CudaOptions};
use crate::error::{CudaError, Result};

/// The docs/model.md §1.6 bound on `max|a-b| / max|b|`.
pub const TOLERANCE: f32 = 1e-2;

/// One comparison.
#[derive(Debug, Clone, Serialize)]
pub struct CheckLine {
    pub name: String,
    /// The measured value (relative error, or mismatch count).
    pub value: f64,
    /// The bound it must stay at or below (strictly below for errors).
    pub bound: f64,
    pub pass: bool,
}

/// Push a comparison: passes when `value` is 0 for a bound of 0 (a count), else `value < bound`.
pub fn line(out: &mut Vec<CheckLine>, name: impl Into<String>, value: f64, bound: f64) {
    let pass = if bound == 0.0 {
        value == 0.0
    } else {
        value < bound
    };
    out.push(CheckLine {
        name: name.into(),
        value,
        bound,
        pass,
    });
}

/// Allocate `n` new tokens for `slot` with `computed` already computed (lookahead 0).
pub fn alloc(kv: &mut KvCacheManager, slot: ReqSlot, computed: u64, n: u64) -> Result<()> {
    let view = RequestView {
        slot,
        num_computed_tokens: computed,
        num_tokens: computed + n,
        num_prompt_tokens: computed.max(1),
        status: if computed == 0 {
            RequestStatus::Waiting
        } else {
            RequestStatus::Running
        },
        num_in_flight_tokens: 0,
    };
    let args = AllocArgs {
        num_new_tokens: n,
        num_lookahead_tokens: 0,
        full_sequence_must_fit: computed == 0,
        has_scheduled_reqs: false,
    };
    match kv.allocate_slots(&view, args)? {
        AllocOutcome::Allocated(_) => Ok(()),
        other => Err(CudaError::Input(format!(
            "KV allocation for slot {} failed: {other:?}",
            slot.0
        ))),
    }
}

fn golden_i32(g: &Checkpoint, key: &str) -> Result<Vec<u32>> {
    Ok(g.i32_any_shape(key)?.0.iter().map(|&t| t as u32).collect())
}

/// The three golden prompts of models/tiny and their goldens.
struct Golden {
    prompts: Vec<Vec<u32>>,
    logits_tail: Vec<Vec<f32>>,
    mtp_tail: Vec<Vec<f32>>,
    greedy: Vec<Vec<u32>>,
}

fn load_golden(dir: &Path) -> Result<Golden> {
    let g = Checkpoint::open_file(&dir.join("golden.safetensors"))?;
    let mut out = Golden {
        prompts: vec![],
        logits_tail: vec![],
        mtp_tail: vec![],
        greedy: vec![],
    };
    for p in 0..3 {
        out.prompts.push(golden_i32(&g, &format!("p{p}.prompt"))?);
        out.greedy.push(golden_i32(&g, &format!("p{p}.greedy"))?);
        out.logits_tail
            .push(g.f32_any_shape(&format!("p{p}.logits_tail"))?.0);
        out.mtp_tail
            .push(g.f32_any_shape(&format!("p{p}.mtp_logits_tail"))?.0);
    }
    Ok(out)
}

fn chunks<'a>(toks: &'a [Vec<u32>], pos: &[usize], snapshot: bool) -> Vec<SeqChunk<'a>> {
    toks.iter()
        .enumerate()
        .map(|(i, t)| SeqChunk {
            slot: ReqSlot(i as u32),
            tokens: t,
            start_pos: pos[i],
            snapshot,
        })
        .collect()
}

/// The engines of one parity check, sharing one KV manager.
struct Rig {
    kv: KvCacheManager,
    cpu: ModelRunner,
    /// Eager forward (graphs off).
    gpu: CudaBackend,
    /// On-device greedy with graphs on.
    greedy: CudaBackend,
    gold: Golden,
    v: usize,
    h: usize,
}

fn tol(out: &mut Vec<CheckLine>, name: impl Into<String>, e: f32) {
    line(out, name, e as f64, TOLERANCE as f64);
}

/// Two lines: the GPU logits against the CPU's (`names[0]`, docs/model.md tolerance) and
/// the on-device greedy ids against the CPU logits' argmax (`names[1]`, must be 0).
fn against_cpu(
    out: &mut Vec<CheckLine>,
    names: [&str; 2],
    gpu: &[f32],
    cpu: &[f32],
    greedy: &[u32],
    v: usize,
) {
    tol(out, names[0], rel_err(gpu, cpu));
    let miss = (0..greedy.len())
        .filter(|&r| cpu.get(r * v..(r + 1) * v).map(|row| argmax(row) as u32) != Some(greedy[r]))
        .count();
    line(out, names[1], miss as f64, 0.0);
}

/// Parity of the CUDA engine on `dir` (models/tiny): prefill (logits, hidden, per-layer
/// hidden, router), the goldens, MTP, 16 greedy decode steps (eager forward and the
/// on-device greedy with graphs), and a snapshot verify + commit_state rollback.
pub fn parity(dir: &Path) -> Result<Vec<CheckLine>> {
    let w = ModelWeights::load(dir)?;
    let gold = load_golden(dir)?;
    let (v, h) = (w.cfg.vocab_size, w.cfg.hidden_size);
    let kv = KvCacheManager::from_layout(&w.cfg.kv_layout(16, 3, 128)?)?;
    let cpu = ModelRunner::new(w.clone(), &kv)?;
    let gpu = CudaBackend::with_options(
        &w,
        &kv,
        CudaOptions {
            use_graphs: false,
            ..Default::default()
        },
    )?;
    let greedy = CudaBackend::with_options(
        &w,
        &kv,
        CudaOptions {
            use_graphs: true,
            ..Default::default()
        },
    )?;
    let mut rig = Rig {
        kv,
        cpu,
        gpu,
        greedy,
        gold,
        v,
        h,
    };
    let mut out = Vec::new();
    let (hidden, last) = rig.prefill(&mut out)?;
    rig.mtp(&mut out, &hidden)?;
    let (next, pos) = rig.decode(&mut out, last)?;
    rig.verify(&mut out, next, pos)?;
    rig.shared_head(&mut out, &w, &hidden)?;
    let mut g = crate::device::Gpu::new(0)?;
    crate::gemm_check::tiled_parity(&mut g, &mut out)?;
    crate::gemm_check::router_norm_parity(&g, &mut out)?;
    crate::gemm_check::combine_parity(&g, &mut out)?;
    crate::gemm_check::align_parity(&g, &mut out)?;
    crate::moebench::shared_merge_parity(&g, &mut out)?;
    Ok(out)
}

impl Rig {
    /// The seam's SharedHead (what DFlash2 drafts through): embedding rows and lm_head.
    fn shared_head(
        &self,
        out: &mut Vec<CheckLine>,
        w: &ModelWeights,
        hidden: &[f32],
    ) -> Result<()> {
        use speclab_engine::backend::SharedHead;
        let toks = &self.gold.prompts[0];
        let e_gpu = SharedHead::embed(&self.gpu, toks)?;
        let e_cpu = SharedHead::embed(w, toks)?;
        tol(out, "SharedHead embed vs CPU", rel_err(&e_gpu, &e_cpu));
        let rows = 4;
        let l_gpu = SharedHead::lm_head(&self.gpu, &hidden[..rows * self.h], rows)?;
        let l_cpu = SharedHead::lm_head(w, &hidden[..rows * self.h], rows)?;
        tol(out, "SharedHead lm_head vs CPU", rel_err(&l_gpu, &l_cpu));
        Ok(())
    }

    fn prompts(&self) -> &[Vec<u32>] {
        &self.gold.prompts
    }

    /// Batched prefill of the three prompts; returns the CPU hidden and each prompt's
    /// greedy first token.
    fn prefill(&mut self, out: &mut Vec<CheckLine>) -> Result<(Vec<f32>, Vec<u32>)> {
        let n = self.prompts().len();
        for i in 0..n {
            self.kv
                .allocate_whole(ReqSlot(i as u32), self.gold.prompts[i].len() as u64)?;
        }
        let all = ForwardOptions {
            logits: LogitsRows::All,
            collect_hidden: true,
            hidden_on_device: false,
            collect_router: true,
            greedy_ids: false,
            skip_hidden: false,
            logits_on_device: false,
        };
        let zeros = vec![0usize; n];
        let batch = chunks(&self.gold.prompts, &zeros, false);
        let c = self.cpu.forward_with(&self.kv, &batch, &all)?;
        let g = self.gpu.forward(&self.kv, &batch, &all)?;
        let _ = self
            .greedy
            .forward(&self.kv, &batch, &ForwardOptions::default())?;
        tol(out, "prefill logits vs CPU", rel_err(&g.logits, &c.logits));
        tol(out, "prefill hidden vs CPU", rel_err(&g.hidden, &c.hidden));
        if let (Some(a), Some(b)) = (&g.per_layer_hidden, &c.per_layer_hidden) {
            tol(out, "prefill per-layer hidden vs CPU", rel_err(a, b));
        }
        if let (Some(a), Some(b)) = (&g.router, &c.router) {
            let miss: usize = a
                .iter()
                .zip(b)
                .map(|(x, y)| x.ids.iter().zip(&y.ids).filter(|(p, q)| p != q).count())
                .sum();
            line(
                out,
                "prefill router choices differing from CPU",
                miss as f64,
                0.0,
            );
            let ew = a
                .iter()
                .zip(b)
                .map(|(x, y)| rel_err(&x.weights, &y.weights))
                .fold(0f32, f32::max);
            tol(out, "prefill router weights vs CPU", ew);
        }
        let (v, mut off, mut last) = (self.v, 0, Vec::new());
        for (i, p) in self.gold.prompts.iter().enumerate() {
            let t = p.len();
            let tail = self.gold.logits_tail[i].len() / v;
            tol(
                out,
                format!("p{i} prefill logits tail vs PyTorch golden"),
                rel_err(
                    &g.logits[(off + t - tail) * v..(off + t) * v],
                    &self.gold.logits_tail[i],
                ),
            );
            last.push(argmax(&c.logits[(off + t - 1) * v..(off + t) * v]) as u32);
            off += t;
        }
        Ok((c.hidden, last))
    }

    /// MTP over each prompt's positions 0..T-1 (next tokens prompt[1..]).
    fn mtp(&mut self, out: &mut Vec<CheckLine>, hidden: &[f32]) -> Result<()> {
        let (v, h) = (self.v, self.h);
        let mut rows = Vec::new();
        let mut off = 0;
        for (i, p) in self.gold.prompts.iter().enumerate() {
            let t = p.len();
            rows.push(MtpChunk {
                slot: ReqSlot(i as u32),
                hidden: &hidden[off * h..(off + t - 1) * h],
                next_tokens: &p[1..],
                start_pos: 0,
            });
            off += t;
        }
        let opts = ForwardOptions::default();
        let c = self.cpu.mtp_forward(&self.kv, &rows, &opts)?;
        let g = self.gpu.mtp_forward(&self.kv, &rows, &opts)?;
        tol(out, "MTP logits vs CPU", rel_err(&g.logits, &c.logits));
        tol(out, "MTP hidden vs CPU", rel_err(&g.hidden, &c.hidden));
        let mut end = 0;
        for (i, p) in self.gold.prompts.iter().enumerate() {
            end += p.len() - 1;
            let tail = self.gold.mtp_tail[i].len() / v;
            tol(
                out,
                format!("p{i} MTP logits tail vs PyTorch golden"),
                rel_err(&g.logits[(end - tail) * v..end * v], &self.gold.mtp_tail[i]),
            );
        }
        Ok(())
    }

    /// 15 greedy decode steps of the three prompts as one batch, on every engine.
    fn decode(
        &mut self,
        out: &mut Vec<CheckLine>,
        first: Vec<u32>,
    ) -> Result<(Vec<u32>, Vec<usize>)> {
        let v = self.v;
        let mut pos: Vec<usize> = self.prompts().iter().map(|p| p.len()).collect();
        let mut next = first;
        let mut seqs: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
        let (mut worst, mut miss_eager, mut miss_graph) = (0f32, 0usize, 0usize);
        for _ in 1..self.gold.greedy[0].len() {
            for (i, &p) in pos.iter().enumerate() {
                alloc(&mut self.kv, ReqSlot(i as u32), p as u64, 1)?;
            }
            let toks: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
            let batch = chunks(&toks, &pos, false);
            let c = self.cpu.forward(&self.kv, &batch)?;
            let g = self
                .gpu
                .forward(&self.kv, &batch, &ForwardOptions::default())?;
            let gg = self
                .greedy
                .forward_greedy(&self.kv, &batch, LogitsRows::LastPerChunk)?;
            worst = worst.max(rel_err(&g.logits, &c.logits));
            for i in 0..next.len() {
                let want = argmax(&c.logits[i * v..(i + 1) * v]) as u32;
                miss_eager += usize::from(argmax(&g.logits[i * v..(i + 1) * v]) as u32 != want);
                miss_graph += usize::from(gg[i] != want);
                next[i] = want;
                seqs[i].push(want);
                pos[i] += 1;
            }
        }
        tol(out, "decode logits vs CPU (worst of 15 steps)", worst);
        line(
            out,
            "decode greedy tokens differing from CPU (eager)",
            miss_eager as f64,
            0.0,
        );
        line(
            out,
            "decode greedy tokens differing from CPU (on-device argmax, CUDA graphs)",
            miss_graph as f64,
            0.0,
        );
        if let Some(e) = self.greedy.graph_error() {
            eprintln!("CUDA graph capture failed (greedy ran eagerly): {e}");
        }
        let failed = f64::from(u8::from(self.greedy.graph_error().is_some()));
        line(out, "CUDA graph capture/replay failures", failed, 0.0);
        let gold_miss: usize = seqs
            .iter()
            .zip(&self.gold.greedy)
            .map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x != y).count())
            .sum();
        line(
            out,
            "greedy continuation tokens differing from the PyTorch golden",
            gold_miss as f64,
            0.0,
        );
        Ok((next, pos))
    }

    /// A snapshot verify of [next, 3 drafts] per slot, commits of 1 / 0 / 3 accepted,
    /// then one decode step from the rolled-back state.
    fn verify(
        &mut self,
        out: &mut Vec<CheckLine>,
        next: Vec<u32>,
        mut pos: Vec<usize>,
    ) -> Result<()> {
        let v = self.v;
        let toks: Vec<Vec<u32>> = next
            .iter()
            .map(|&t| vec![t, (t + 1) % 8000, (t + 7) % 8000, (t + 13) % 8000])
            .collect();
        for (i, &p) in pos.iter().enumerate() {
            alloc(&mut self.kv, ReqSlot(i as u32), p as u64, 4)?;
        }
        let batch = chunks(&toks, &pos, true);
        let c = self.cpu.forward(&self.kv, &batch)?;
        let g = self
            .gpu
            .forward(&self.kv, &batch, &ForwardOptions::default())?;
        let gg = self
            .greedy
            .forward_greedy(&self.kv, &batch, LogitsRows::All)?;
        let names = [
            "verify (snapshot) logits vs CPU",
            "verify greedy rows differing from CPU (graphs)",
        ];
        against_cpu(out, names, &g.logits, &c.logits, &gg, v);
        sampler_parity(&mut self.gpu, out, &g.logits, v)?;
        let accepted = [1usize, 0, 3];
        let mut after = Vec::new();
        for i in 0..toks.len() {
            let (slot, a) = (ReqSlot(i as u32), accepted[i % 3]);
            self.cpu.commit_state(&self.kv, slot, a)?;
            self.gpu.commit_state(&self.kv, slot, a)?;
            self.greedy.commit_state(&self.kv, slot, a)?;
            pos[i] += a + 1;
            after.push(vec![
                argmax(&c.logits[(4 * i + a) * v..(4 * i + a + 1) * v]) as u32,
            ]);
            alloc(&mut self.kv, slot, pos[i] as u64, 1)?;
        }
        let batch = chunks(&after, &pos, false);
        let c = self.cpu.forward(&self.kv, &batch)?;
        let g = self
            .gpu
            .forward(&self.kv, &batch, &ForwardOptions::default())?;
        let gg = self
            .greedy
            .forward_greedy(&self.kv, &batch, LogitsRows::LastPerChunk)?;
        let names = [
            "decode after commit_state rollback: logits vs CPU",
            "decode after rollback: greedy differing from CPU (graphs)",
        ];
        against_cpu(out, names, &g.logits, &c.logits, &gg, v);
        Ok(())
    }
}

/// A sparse q for `drafts` (a selector's candidate sets): 1..=16 distinct ids a row over
/// `v` tokens, the row's draft among them most of the time, normalized random weights.
fn sparse_q(
    gen: &mut rand_chacha::ChaCha8Rng,
    drafts: &[u32],
    v: usize,
) -> speclab_engine::spec::DraftProbs {
    use rand::Rng;
    let kq = gen.random_range(1..=16usize.min(v));
    let (mut ids, mut p) = (Vec::new(), Vec::new());
    for &x in drafts {
        let mut row: Vec<u32> = if gen.random_bool(0.7) {
            vec![x]
        } else {
            Vec::new()
        };
        while row.len() < kq {
            let id = gen.random_range(0..v as u32);
            if !row.contains(&id) {
                row.push(id);
            }
        }
        let w: Vec<f32> = (0..kq)
            .map(|_| gen.random::<f32>().powi(2) + 1e-3)
            .collect();
        let s: f32 = w.iter().sum();
        p.extend(w.iter().map(|x| x / s));
        ids.extend(row);
    }
    speclab_engine::spec::DraftProbs::Sparse(speclab_engine::spec::SparseProbs { k: kq, ids, p })
}

/// The device sampler (`crate::sample`) against its host reference
/// (`verify_with_uniforms`) on the logits the last forward left on the device (`logits`
/// is their host copy): 400 chunks of 0..=3 drafts anywhere in those rows, drafts the
/// greedy tokens or not, q one-hot, a dense random distribution or sparse rows
/// ([`sparse_q`]), under temperature alone, top-k, top-p and both. Every verdict (tokens
/// and uniforms consumed) must be equal.
fn sampler_parity(
    gpu: &mut CudaBackend,
    out: &mut Vec<CheckLine>,
    logits: &[f32],
    v: usize,
) -> Result<()> {
    use rand::{Rng, SeedableRng};
    use speclab_engine::backend::SampleReq;
    use speclab_engine::spec::{max_uniforms, verify_with_uniforms, DraftProbs, SamplingParams};
    let rows = logits.len() / v;
    let mut gen = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let params = [
        SamplingParams::random(1.0),
        SamplingParams::random(0.6),
        SamplingParams {
            temperature: 0.8,
            top_k: 20,
            top_p: 1.0,
        },
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
        },
        SamplingParams {
            temperature: 0.7,
            top_k: 50,
            top_p: 0.8,
        },
    ];
    let (mut differ, mut total, mut accepted) = (0usize, 0usize, 0usize);
    for (pi, p) in params.iter().enumerate() {
        let mut cases = Vec::new();
        for _ in 0..80 {
            let k = gen.random_range(0..=3usize.min(rows - 1));
            let row = gen.random_range(0..rows - k);
            let greedy = gen.random_bool(0.6);
            let drafts: Vec<u32> = (0..k)
                .map(|i| {
                    let r = &logits[(row + i) * v..(row + i + 1) * v];
                    if greedy {
                        argmax(r) as u32
                    } else {
                        gen.random_range(0..v as u32)
                    }
                })
                .collect();
            let q = match gen.random_range(0..3) {
                0 => None,
                1 => Some(DraftProbs::Dense(
                    (0..k)
                        .map(|_| {
                            let mut q: Vec<f32> =
                                (0..v).map(|_| gen.random::<f32>().powi(8)).collect();
                            let s: f32 = q.iter().sum();
                            q.iter_mut().for_each(|x| *x /= s);
                            q
                        })
                        .collect(),
                )),
                _ => Some(sparse_q(&mut gen, &drafts, v)),
            };
            let us: Vec<f64> = (0..max_uniforms(k)).map(|_| gen.random::<f64>()).collect();
            cases.push((row, drafts, q, us));
        }
        let reqs: Vec<SampleReq<'_>> = cases
            .iter()
            .map(|(row, d, q, us)| SampleReq {
                row: *row,
                drafts: d,
                q: q.as_ref(),
                uniforms: us,
            })
            .collect();
        let dev = gpu.sample_chunks(p, &reqs)?;
        for (r, d) in reqs.iter().zip(&dev) {
            let k = r.drafts.len();
            let prop = speclab_engine::Proposal {
                tokens: r.drafts.to_vec(),
                probs: r.q.cloned(),
            };
            let host = verify_with_uniforms(
                &logits[r.row * v..(r.row + k + 1) * v],
                v,
                &prop,
                p,
                r.uniforms,
            )?;
            total += 1;
            accepted += d.verified.accepted;
            if host != *d {
                differ += 1;
                eprintln!("sampler params #{pi}: device {d:?} host {host:?}");
            }
        }
    }
    line(
        out,
        format!("device sampler verdicts differing from the host reference ({total} chunks, {accepted} drafts accepted)"),
        differ as f64,
        0.0,
    );
    Ok(())
}

/// One timing row.
#[derive(Debug, Clone, Serialize)]
pub struct TimingRow {
    pub batch: usize,
    pub graphs: bool,
    pub steps: usize,
    /// Median microseconds per decode step (host-observed, incl. the copy-out).
    pub us_per_step: f64,
    pub tok_per_s: f64,
    pub kernels_per_step: f64,
    /// Graphs-on rows: GPU µs per replay of the step's graph (events, no host work).
    pub gpu_us_per_step: Option<f64>,
    /// Host µs per step by phase (`CudaBackend::host_times`): metadata build, upload,
    /// launch, and the read-back (which waits for the GPU).
    pub host_us: [f64; 4],
}

/// GPU time of one kernel name over one eager decode step (events between launches).
#[derive(Debug, Clone, Serialize)]
pub struct ProfileRow {
    pub batch: usize,
    pub kernel: String,
    pub launches: usize,
    pub us: f64,
}

/// Timing rows, copy bandwidth (GB/s), weight bytes, and the per-kernel profile.
pub type Timing = (Vec<TimingRow>, f64, usize, Vec<ProfileRow>);

/// Decode-step timing at each batch size, graphs off then on: `steps` timed greedy
/// steps after 3 warm-up steps (the first of which captures the graph), from 32-token
/// prompts.
pub fn timing(dir: &Path, batches: &[usize], steps: usize) -> Result<Timing> {
    let w = ModelWeights::load(dir)?;
    let mut rows = Vec::new();
    let mut prof = Vec::new();
    let (mut bw, mut wbytes) = (0.0, 0);
    for &b in batches {
        let per_seq = (32 + 2 * (steps + 3)).div_ceil(16) + 1;
        let mut kv = KvCacheManager::from_layout(&w.cfg.kv_layout(
            16,
            0,
            (b * (per_seq + 1) + 8) as u32,
        )?)?;
        let mut gpu = CudaBackend::with_options(
            &w,
            &kv,
            CudaOptions {
                use_graphs: false,
                ..Default::default()
            },
        )?;
        if bw == 0.0 {
            bw = gpu.copy_bandwidth_gbs(1 << 28)?;
            wbytes = gpu.weight_bytes();
        }
        let prompts: Vec<Vec<u32>> = (0..b)
            .map(|i| {
                (0..32)
                    .map(|j| ((i * 131 + j * 17) % 8000) as u32 + 1)
                    .collect()
            })
            .collect();
        for i in 0..b {
            kv.allocate_whole(ReqSlot(i as u32), 32)?;
        }
        let mut next = gpu.forward_greedy(
            &kv,
            &chunks(&prompts, &vec![0; b], false),
            LogitsRows::LastPerChunk,
        )?;
        let mut pos = vec![32usize; b];
        let mut eager_kernels = 0.0;
        for graphs in [false, true] {
            gpu.set_graphs(graphs);
            let mut times = Vec::new();
            let mut kernels = 0u64;
            for s in 0..steps + 3 {
                if s == 3 {
                    gpu.host_times = Default::default();
                }
                for (i, &p) in pos.iter().enumerate() {
                    alloc(&mut kv, ReqSlot(i as u32), p as u64, 1)?;
                }
                let toks: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
                let (k0, t0) = (gpu.launches(), Instant::now());
                next =
                    gpu.forward_greedy(&kv, &chunks(&toks, &pos, false), LogitsRows::LastPerChunk)?;
                let dt = t0.elapsed().as_secs_f64() * 1e6;
                if s >= 3 {
                    times.push(dt);
                    kernels += gpu.launches() - k0;
                }
                pos.iter_mut().for_each(|p| *p += 1);
            }
            times.sort_by(f64::total_cmp);
            let med = times[times.len() / 2];
            // With graphs the launches are recorded once at capture: report the eager count.
            if !graphs {
                eager_kernels = kernels as f64 / steps as f64;
            }
            if let Some(e) = gpu.graph_error() {
                eprintln!("batch {b}: CUDA graphs failed, the graphs-on row ran eagerly: {e}");
            }
            rows.push(TimingRow {
                batch: b,
                graphs: graphs && gpu.graph_error().is_none(),
                steps,
                us_per_step: med,
                tok_per_s: b as f64 / med * 1e6,
                kernels_per_step: eager_kernels,
                gpu_us_per_step: None,
                host_us: {
                    let h = gpu.host_times;
                    let per = |x: f64| x * 1e6 / h.calls.max(1) as f64;
                    [
                        per(h.meta_s),
                        per(h.upload_s),
                        per(h.launch_s),
                        per(h.read_s),
                    ]
                },
            });
        }
        // One eager step with an event after every launch, then the graph replayed alone.
        for (i, &p) in pos.iter().enumerate() {
            alloc(&mut kv, ReqSlot(i as u32), p as u64, 1)?;
        }
        let toks: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
        for (kernel, launches, us) in gpu.profile_step(&kv, &chunks(&toks, &pos, false))? {
            prof.push(ProfileRow {
                batch: b,
                kernel,
                launches,
                us,
            });
        }
        let us = gpu.replay_us(&kv, &chunks(&toks, &pos, false), 100)?;
        if let Some(r) = rows.last_mut() {
            r.gpu_us_per_step = Some(us);
        }
    }
    Ok((rows, bw, wbytes, prof))
}
