//! Block traces of the INT4 expert kernels (issue 12 diagnostics): where a MoE layer's
//! time goes at small M, block by block.
//!
//! Design: with `SPECLAB_KERNEL_DEFINES=W4_TRACE=1` (linear.cu "Block trace"), thread 0 of
//! every working block of `moe_split_x`, `moe_gate_up_w4` and `moe_down_w4` appends a
//! record to the module global `w4_trace`: the kernel, the SM, the block and four
//! `%globaltimer` marks (entry; the grid-dependency wait returned; the block's weight walk
//! done; the epilogue done). [`reset`] zeroes the record count before a traced call,
//! [`read`] copies the records back, and [`summarize`] turns one call's records into per
//! kernel times relative to the call's first release (pure host code, tested here).
//! The idea of stamping blocks with the global timer is the one of NVIDIA's
//! `cuda-samples` clock examples and of Nsight's "GPU trace"; nothing of theirs is used.
//!
//! Invariants: [`TRACE_CAP`] and [`TRACE_F`] mirror linear.cu's `W4_TRACE_CAP` and
//! `W4_TRACE_F`; the kernels are compiled without the define by default, and then the
//! global does not exist ([`Gpu::w4_trace`] is `None`) and nothing here runs.

use serde::Serialize;

use crate::device::Gpu;
use crate::error::{CudaError, Result};

/// Records the device buffer holds (linear.cu `W4_TRACE_CAP`).
pub const TRACE_CAP: usize = 16384;
/// Words a record (linear.cu `W4_TRACE_F`).
pub const TRACE_F: usize = 5;
/// Kernel ids of the records, 1-based (linear.cu `W4Clock::put`).
pub const KERNELS: [&str; 3] = ["moe_split_x", "moe_gate_up_w4", "moe_down_w4"];

/// One block's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRec {
    /// 1 split, 2 gate/up, 3 down ([`KERNELS`]).
    pub kernel: u8,
    pub sm: u32,
    pub block: u32,
    /// `%globaltimer` ns: entry, released (grid-dependency wait returned), walked, done.
    pub t: [u64; 4],
}

impl BlockRec {
    /// Decode record words (`[kernel << 48 | sm << 32 | block, t0, t1, t2, t3]`).
    pub fn from_words(w: &[u64]) -> Option<Self> {
        let &[meta, t0, t1, t2, t3] = w else {
            return None;
        };
        Some(Self {
            kernel: (meta >> 48) as u8,
            sm: ((meta >> 32) & 0xffff) as u32,
            block: meta as u32,
            t: [t0, t1, t2, t3],
        })
    }
}

/// Min / median / max of a set of µs values.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    pub min: f64,
    pub med: f64,
    pub max: f64,
}

impl Spread {
    fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return Self {
                min: 0.0,
                med: 0.0,
                max: 0.0,
            };
        }
        v.sort_by(f64::total_cmp);
        Self {
            min: v[0],
            med: v[v.len() / 2],
            max: v[v.len() - 1],
        }
    }
}

/// One kernel of a traced call; times in µs from the call's origin, the first release (the
/// first block whose grid-dependency wait returned: the call's first kernel may enter
/// earlier, while the grid before it runs, and then has negative entry times).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KernelTrace {
    pub kernel: &'static str,
    pub blocks: usize,
    /// SMs that ran at least one block, and the most blocks one SM ran.
    pub sms: usize,
    pub max_blocks_per_sm: usize,
    /// Block entry times.
    pub entry: Spread,
    /// When the grid-dependency wait returned.
    pub released: Spread,
    /// Walk durations (released to walked).
    pub walk: Spread,
    /// Epilogue durations (walked to done).
    pub epilogue: Spread,
    /// Block end times.
    pub done: Spread,
    /// Mean walk duration of the blocks each SM ran, by SM id (0 for SMs that ran none):
    /// whether the slow walks sit on the same SMs call after call (a per-SM bandwidth
    /// share) or move (contention).
    pub sm_walk_us: Vec<f32>,
}

/// One traced call.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CallTrace {
    /// The origin (first release) to the last block end, µs.
    pub span_us: f64,
    /// Records the kernels counted past [`TRACE_CAP`] (lost).
    pub dropped: usize,
    pub kernels: Vec<KernelTrace>,
}

/// Summarize one call's records (any order). Kernels without records are left out.
pub fn summarize(recs: &[BlockRec], dropped: usize) -> CallTrace {
    let origin = recs.iter().map(|r| r.t[1]).min().unwrap_or(0);
    let end = recs.iter().map(|r| r.t[3]).max().unwrap_or(origin);
    let us = |t: u64| (t as i128 - origin as i128) as f64 * 1e-3;
    let dur = |a: u64, b: u64| b.saturating_sub(a) as f64 * 1e-3;
    let kernels = (1..=KERNELS.len() as u8)
        .filter_map(|k| {
            let rs: Vec<&BlockRec> = recs.iter().filter(|r| r.kernel == k).collect();
            if rs.is_empty() {
                return None;
            }
            let mut per_sm = std::collections::BTreeMap::<u32, usize>::new();
            for r in &rs {
                *per_sm.entry(r.sm).or_default() += 1;
            }
            let col = |f: &dyn Fn(&BlockRec) -> f64| Spread::of(rs.iter().map(|r| f(r)).collect());
            let sms = per_sm.keys().next_back().map_or(0, |&s| s as usize + 1);
            let mut sm_walk = vec![0.0f32; sms];
            for r in &rs {
                sm_walk[r.sm as usize] += dur(r.t[1], r.t[2]) as f32 / per_sm[&r.sm] as f32;
            }
            Some(KernelTrace {
                kernel: KERNELS[k as usize - 1],
                blocks: rs.len(),
                sms: per_sm.len(),
                max_blocks_per_sm: per_sm.values().copied().max().unwrap_or(0),
                entry: col(&|r| us(r.t[0])),
                released: col(&|r| us(r.t[1])),
                walk: col(&|r| dur(r.t[1], r.t[2])),
                epilogue: col(&|r| dur(r.t[2], r.t[3])),
                done: col(&|r| us(r.t[3])),
                sm_walk_us: sm_walk,
            })
        })
        .collect();
    CallTrace {
        span_us: dur(origin, end),
        dropped,
        kernels,
    }
}

/// Zero the device's record count (before a traced call).
pub fn reset(g: &Gpu) -> Result<()> {
    let m = module(g)?;
    let mut n = m
        .get_global("w4_trace_n", &g.stream)
        .map_err(|e| CudaError::driver("get_global w4_trace_n", e))?;
    g.stream
        .memcpy_htod(&[0u8; 4], &mut n)
        .map_err(|e| CudaError::driver("zero w4_trace_n", e))
}

/// The records of the calls since [`reset`] (synchronizes), and how many were dropped.
pub fn read(g: &Gpu) -> Result<(Vec<BlockRec>, usize)> {
    let m = module(g)?;
    let n_view = m
        .get_global("w4_trace_n", &g.stream)
        .map_err(|e| CudaError::driver("get_global w4_trace_n", e))?;
    let n = g
        .stream
        .clone_dtoh(&n_view)
        .map_err(|e| CudaError::driver("read w4_trace_n", e))?;
    let count = u32::from_le_bytes([n[0], n[1], n[2], n[3]]) as usize;
    let kept = count.min(TRACE_CAP);
    let buf = m
        .get_global("w4_trace", &g.stream)
        .map_err(|e| CudaError::driver("get_global w4_trace", e))?;
    let bytes = g
        .stream
        .clone_dtoh(&buf.slice(..kept * TRACE_F * 8))
        .map_err(|e| CudaError::driver("read w4_trace", e))?;
    let words: Vec<u64> = bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
        .collect();
    let recs = words
        .chunks_exact(TRACE_F)
        .filter_map(BlockRec::from_words)
        .collect();
    Ok((recs, count - kept))
}

fn module(g: &Gpu) -> Result<&std::sync::Arc<cudarc::driver::CudaModule>> {
    g.w4_trace.as_ref().ok_or_else(|| {
        CudaError::Input("the kernels were compiled without W4_TRACE=1 (internal)".into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(kernel: u8, sm: u32, block: u32, t: [u64; 4]) -> BlockRec {
        BlockRec {
            kernel,
            sm,
            block,
            t,
        }
    }

    #[test]
    fn records_decode_from_the_kernels_words() {
        let meta = 2u64 << 48 | 131u64 << 32 | 4097;
        let r = BlockRec::from_words(&[meta, 10, 20, 30, 40]).unwrap();
        assert_eq!(r, rec(2, 131, 4097, [10, 20, 30, 40]));
        assert!(BlockRec::from_words(&[meta, 1, 2, 3]).is_none());
    }

    #[test]
    fn summary_times_are_relative_to_the_first_release() {
        let recs = [
            rec(2, 0, 0, [1_000, 2_000, 12_000, 13_000]),
            rec(2, 0, 1, [1_500, 2_000, 14_000, 14_500]),
            rec(2, 5, 2, [3_000, 3_000, 9_000, 9_500]),
            rec(3, 5, 0, [9_000, 14_500, 20_000, 21_000]),
        ];
        let c = summarize(&recs, 7);
        assert_eq!(c.dropped, 7);
        assert!((c.span_us - 19.0).abs() < 1e-9);
        assert_eq!(c.kernels.len(), 2);
        let gu = &c.kernels[0];
        assert_eq!(
            (gu.kernel, gu.blocks, gu.sms, gu.max_blocks_per_sm),
            ("moe_gate_up_w4", 3, 2, 2)
        );
        assert_eq!(
            gu.entry,
            Spread {
                min: -1.0,
                med: -0.5,
                max: 1.0
            }
        );
        assert_eq!(
            gu.walk,
            Spread {
                min: 6.0,
                med: 10.0,
                max: 12.0
            }
        );
        assert_eq!(gu.done.max, 12.5);
        // SM 0 ran walks of 10 and 12 us, SM 5 one of 6; SMs 1-4 none.
        assert_eq!(gu.sm_walk_us, vec![11.0, 0.0, 0.0, 0.0, 0.0, 6.0]);
        let dn = &c.kernels[1];
        assert_eq!(dn.kernel, "moe_down_w4");
        assert_eq!(dn.released.min, 12.5);
        assert_eq!(dn.epilogue.med, 1.0);
    }

    #[test]
    fn an_empty_trace_has_no_kernels() {
        let c = summarize(&[], 0);
        assert!(c.kernels.is_empty());
        assert_eq!(c.span_us, 0.0);
    }
}
