//! The prefill kernels on the device (the chunked KDA of [`crate::kda_chunk`] and the
//! tiled `prefill_attention`): parity against the per-token recurrence with
//! `paged_attention` and the CPU engine, and prefill timing with them on and off (issue 11:
//! "KDA recurrence (chunked for prefill)", "paged attention for prefill"). Run by
//! `examples/gpu_check.rs`.
//!
//! Design: two `CudaBackend`s and the CPU `ModelRunner` share one `KvCacheManager` (as in
//! [`crate::check`]); one backend takes `kda_chunk_prep` / `kda_chunk_scan`
//! ([`crate::device::Gpu::kda_chunked`]) and `prefill_attention`
//! ([`crate::device::Gpu::att_tiled`]), the other the per-token `kda_recurrent` and
//! `paged_attention`. The
//! steps cover the chunked path's cases: spans of many chunks, a partial last chunk, a
//! continued prefill (start position > 0, the state and conv window read from the page), a
//! one-token span beside prefill spans, and decode steps after it (the fused decode kernel
//! reading what the chunked kernels left in the pages).
//!
//! Invariants: nothing is asserted here; every comparison is a [`CheckLine`]. The chunked
//! form sums in another order than the recurrence, so its lines are tolerances (docs/model.md
//! §1.6), not bit equality; greedy tokens must still agree.

use std::path::Path;
use std::time::Instant;

use serde::Serialize;
use speclab_engine::kv::{AllocOutcome, KvCacheManager};
use speclab_engine::model::ops::{argmax, rel_err};
use speclab_engine::model::{ForwardOptions, LogitsRows, ModelRunner, ModelWeights, SeqChunk};
use speclab_engine::ReqSlot;

use crate::backend::{CudaBackend, CudaOptions};
use crate::check::{alloc, line, CheckLine, TOLERANCE};
use crate::error::{CudaError, Result};

/// Deterministic prompt `i` of `n` tokens (ids 1..8000, as `check::timing`'s).
fn prompt(i: usize, n: usize) -> Vec<u32> {
    (0..n)
        .map(|j| ((i * 7919 + j * 104_729 + j * j * 31) % 8000) as u32 + 1)
        .collect()
}

/// An eager backend with the prefill kernels on (`chunked`) or off.
fn eager(w: &ModelWeights, kv: &KvCacheManager, chunked: bool) -> Result<CudaBackend> {
    let mut b = CudaBackend::with_options(
        w,
        kv,
        CudaOptions {
            use_graphs: false,
            ..Default::default()
        },
    )?;
    set_prefill(&mut b, chunked);
    Ok(b)
}

fn set_prefill(b: &mut CudaBackend, on: bool) {
    b.gpu.kda_chunked = on;
    b.gpu.att_tiled = on;
}

/// Worst relative logits errors of a phase: (chunked vs CPU, per-token vs CPU, chunked vs
/// per-token) and greedy rows where the chunked backend's argmax differs from the CPU's.
#[derive(Default)]
struct Worst {
    err: [f32; 3],
    miss: usize,
}

impl Worst {
    fn add(&mut self, a: &[f32], b: &[f32], c: &[f32], v: usize) {
        for (k, e) in [rel_err(a, c), rel_err(b, c), rel_err(a, b)]
            .into_iter()
            .enumerate()
        {
            self.err[k] = self.err[k].max(e);
        }
        self.miss += (0..c.len() / v)
            .filter(|&r| argmax(&a[r * v..(r + 1) * v]) != argmax(&c[r * v..(r + 1) * v]))
            .count();
    }
}

/// Parity lines of the chunked prefill on `dir` (models/tiny).
pub fn parity(dir: &Path, out: &mut Vec<CheckLine>) -> Result<()> {
    let w = ModelWeights::load(dir)?;
    let v = w.cfg.vocab_size;
    let mut kv = KvCacheManager::from_layout(&w.cfg.kv_layout(16, 3, 256)?)?;
    let mut cpu = ModelRunner::new(w.clone(), &kv)?;
    let mut a = eager(&w, &kv, true)?;
    let mut b = eager(&w, &kv, false)?;
    // Spans of 700 (22 chunks), 77 and 33 tokens: the first two prefill in two steps, the
    // third whole in the first and decoding one token in the second.
    let full = [prompt(0, 700), prompt(1, 77), prompt(2, 33)];
    let split = [400usize, 40, 33];
    let all = ForwardOptions {
        logits: LogitsRows::All,
        ..ForwardOptions::default()
    };
    let mut worst = Worst::default();
    let mut step =
        |kv: &KvCacheManager, batch: &[SeqChunk<'_>], w: &mut Worst| -> Result<Vec<u32>> {
            let c = cpu.forward_with(kv, batch, &all)?;
            let ga = a.forward(kv, batch, &all)?;
            let gb = b.forward(kv, batch, &all)?;
            w.add(&ga.logits, &gb.logits, &c.logits, v);
            // The CPU's greedy token after each chunk's last row.
            let mut off = 0;
            Ok(batch
                .iter()
                .map(|ch| {
                    off += ch.tokens.len();
                    argmax(&c.logits[(off - 1) * v..off * v]) as u32
                })
                .collect())
        };
    for (i, &n) in split.iter().enumerate() {
        whole(&mut kv, ReqSlot(i as u32), n)?;
    }
    let first: Vec<SeqChunk<'_>> = (0..3)
        .map(|i| SeqChunk {
            slot: ReqSlot(i as u32),
            tokens: &full[i][..split[i]],
            start_pos: 0,
            snapshot: false,
        })
        .collect();
    let next = step(&kv, &first, &mut worst)?;
    line(
        out,
        "prefill kernels (chunked KDA, tiled attention): greedy rows differing from CPU (first step)",
        worst.miss as f64,
        0.0,
    );
    // Second step: the rest of prompts 0 and 1 (start > 0), prompt 2 decodes its next token.
    let one = [next[2]];
    let rest: Vec<&[u32]> = vec![&full[0][split[0]..], &full[1][split[1]..], &one];
    let starts = [split[0], split[1], split[2]];
    for i in 0..3 {
        alloc(
            &mut kv,
            ReqSlot(i as u32),
            starts[i] as u64,
            rest[i].len() as u64,
        )?;
    }
    let second: Vec<SeqChunk<'_>> = (0..3)
        .map(|i| SeqChunk {
            slot: ReqSlot(i as u32),
            tokens: rest[i],
            start_pos: starts[i],
            snapshot: false,
        })
        .collect();
    let mut tok = step(&kv, &second, &mut worst)?;
    let mut pos: Vec<usize> = (0..3).map(|i| starts[i] + rest[i].len()).collect();
    // Eight decode steps from the chunked prefill's state (the fused decode kernel).
    for _ in 0..8 {
        for (i, &p) in pos.iter().enumerate() {
            alloc(&mut kv, ReqSlot(i as u32), p as u64, 1)?;
        }
        let toks: Vec<[u32; 1]> = tok.iter().map(|&t| [t]).collect();
        let batch: Vec<SeqChunk<'_>> = (0..3)
            .map(|i| SeqChunk {
                slot: ReqSlot(i as u32),
                tokens: &toks[i],
                start_pos: pos[i],
                snapshot: false,
            })
            .collect();
        tok = step(&kv, &batch, &mut worst)?;
        pos.iter_mut().for_each(|p| *p += 1);
    }
    let t = TOLERANCE as f64;
    let names = [
        "prefill kernels (chunked KDA, tiled attention) + decode logits vs CPU (worst of 10 steps)",
        "per-token KDA, paged_attention prefill + decode logits vs CPU (worst of 10 steps)",
        "prefill kernels vs per-token KDA, paged_attention logits (worst of 10 steps)",
    ];
    for (name, e) in names.iter().zip(worst.err) {
        line(out, *name, e as f64, t);
    }
    line(
        out,
        "prefill kernels (chunked KDA, tiled attention) + decode: greedy rows differing from CPU (10 steps)",
        worst.miss as f64,
        0.0,
    );
    Ok(())
}

/// One prefill shape, timed with the chunked kernels off and on.
#[derive(Debug, Clone, Serialize)]
pub struct PrefillRow {
    /// Prompts prefilled in one step.
    pub prompts: usize,
    /// Tokens of each.
    pub tokens: usize,
    /// Median ms of the whole prefill step (host-observed, logits of the last rows back),
    /// with the old kernels (`_recurrent`: per-token KDA, `paged_attention`) then the
    /// prefill kernels (`_chunked`: chunked KDA, `prefill_attention`); the record keeps
    /// the field names of its first version.
    pub ms_recurrent: f64,
    pub ms_chunked: f64,
    /// Of one step: the KDA kernels' ms (an event after every launch; about 3 us of event
    /// overhead a kernel included), per-token path then chunked.
    pub kda_ms_recurrent: f64,
    pub kda_ms_chunked: f64,
    /// Of the same steps: the attention kernels' ms (`paged_attention`, then
    /// `prefill_attention`).
    pub att_ms_recurrent: f64,
    pub att_ms_chunked: f64,
    /// Prompt tokens a second, chunked.
    pub tok_per_s_chunked: f64,
    /// The profiled chunked step's kernels by total ms (the five longest): where a
    /// prefill's time goes besides KDA.
    pub top_kernels_chunked: Vec<(String, f64)>,
}

/// Prefill timing on `dir`: for each (prompts, tokens) shape, `reps` steps a mode
/// (median; at least 1), then one profiled step a mode.
pub fn timing(dir: &Path, shapes: &[(usize, usize)], reps: usize) -> Result<Vec<PrefillRow>> {
    let reps = reps.max(1);
    let w = ModelWeights::load(dir)?;
    let mut rows = Vec::new();
    for &(p, n) in shapes {
        let blocks = (p * (n.div_ceil(16) + 2) + 8) as u32;
        let mut kv = KvCacheManager::from_layout(&w.cfg.kv_layout(16, 0, blocks)?)?;
        let mut gpu = eager(&w, &kv, false)?;
        let prompts: Vec<Vec<u32>> = (0..p).map(|i| prompt(i + 3, n)).collect();
        let mut ms = [0.0f64; 2];
        let mut kda = [0.0f64; 2];
        let mut att = [0.0f64; 2];
        let mut top = Vec::new();
        for (mode, chunked) in [false, true].into_iter().enumerate() {
            set_prefill(&mut gpu, chunked);
            let mut times = Vec::new();
            for rep in 0..reps + 2 {
                let batch = fresh(&mut kv, &mut gpu, &prompts)?;
                if rep == reps + 1 {
                    let prof = gpu.profile_step(&kv, &batch)?;
                    if chunked {
                        top = prof
                            .iter()
                            .map(|(k, _, us)| (k.clone(), us / 1e3))
                            .collect();
                        top.sort_by(|a: &(String, f64), b| b.1.total_cmp(&a.1));
                        top.truncate(5);
                    }
                    let ms = |pre: &str| -> f64 {
                        prof.iter()
                            .filter(|(k, _, _)| k.starts_with(pre))
                            .map(|(_, _, us)| us / 1e3)
                            .sum()
                    };
                    kda[mode] = ms("kda_");
                    att[mode] = ms("paged_attention") + ms("prefill_attention");
                    continue;
                }
                let t0 = Instant::now();
                gpu.forward_greedy(&kv, &batch, LogitsRows::LastPerChunk)?;
                if rep > 0 {
                    times.push(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
            times.sort_by(f64::total_cmp);
            ms[mode] = times[times.len() / 2];
        }
        rows.push(PrefillRow {
            prompts: p,
            tokens: n,
            ms_recurrent: ms[0],
            ms_chunked: ms[1],
            kda_ms_recurrent: kda[0],
            kda_ms_chunked: kda[1],
            att_ms_recurrent: att[0],
            att_ms_chunked: att[1],
            tok_per_s_chunked: (p * n) as f64 / ms[1] * 1e3,
            top_kernels_chunked: top,
        });
    }
    Ok(rows)
}

/// A whole-prompt allocation of `n` tokens for `slot`, an error unless it is granted.
fn whole(kv: &mut KvCacheManager, slot: ReqSlot, n: usize) -> Result<()> {
    match kv.allocate_whole(slot, n as u64)? {
        AllocOutcome::Allocated(_) => Ok(()),
        other => Err(CudaError::Input(format!(
            "prefill check: {n} tokens for slot {} not allocated: {other:?}",
            slot.0
        ))),
    }
}

/// Free the prompts' slots and allocate them again for a prefill from position 0.
fn fresh<'a>(
    kv: &mut KvCacheManager,
    gpu: &mut CudaBackend,
    prompts: &'a [Vec<u32>],
) -> Result<Vec<SeqChunk<'a>>> {
    for (i, p) in prompts.iter().enumerate() {
        let slot = ReqSlot(i as u32);
        kv.free(slot);
        gpu.release(slot);
        whole(kv, slot, p.len())?;
    }
    Ok(prompts
        .iter()
        .enumerate()
        .map(|(i, t)| SeqChunk {
            slot: ReqSlot(i as u32),
            tokens: t,
            start_pos: 0,
            snapshot: false,
        })
        .collect())
}
