//! One launch wrapper per kernel: shape checks, bounds of every pointer, the launch.
//!
//! Source: the signature and `Shapes:` / `Launch:` comments of each kernel in
//! `cuda/kernels/*.cu`; launch shapes from [`crate::launch`].
//!
//! Invariants: a wrapper computes, for every pointer argument, the exact element region
//! the kernel may touch from the dimensions it passes, and obtains the pointer through
//! [`DevBuf::span`] (which fails if the region leaves the allocation); only then does
//! it call [`launch`]. Scalar arguments are passed with the C type of the kernel
//! parameter (`int` -> i32, `long long` -> i64, `float` -> f32, pointers -> u64).
//! Index data read *from device memory* (token ids, positions, block ids, expert ids,
//! sorted pair ids) was validated on the host when it was built (`crate::meta`) or is
//! produced by an earlier kernel with stated bounds (`moe_topk` ids < E, `moe_align`
//! pair ids < P).

use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::PushKernelArg;

use crate::buf::DevBuf;
use crate::device::Gpu;
use crate::error::{CudaError, Result};
use crate::launch::{self, Shape};

/// A kernel argument.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    /// A device pointer.
    P(u64),
    /// `int`.
    I(i32),
    /// `long long`.
    L(i64),
    /// `float`.
    F(f32),
}

/// `usize` -> `int` argument.
pub fn int(v: usize, what: &str) -> Result<Arg> {
    i32::try_from(v)
        .map(Arg::I)
        .map_err(|_| CudaError::Unsupported(format!("{what} = {v} exceeds a kernel int")))
}

/// `usize` -> `long long` argument.
pub fn long(v: usize) -> Arg {
    Arg::L(v as i64)
}

/// Kernels executed by this process: eager launches, plus each replayed graph's kernels
/// (a capture's launches are taken back: captured kernels run only when replayed).
pub static KERNELS: AtomicU64 = AtomicU64::new(0);

/// [`KERNELS`] now.
pub fn kernels_executed() -> u64 {
    KERNELS.load(Ordering::Relaxed)
}

/// CUDA graphs captured by this process, and the host nanoseconds their capture,
/// instantiation and upload took (`crate::backend`, the DFlash drafter's block graphs).
pub static GRAPH_CAPTURES: AtomicU64 = AtomicU64::new(0);
pub static GRAPH_CAPTURE_NS: AtomicU64 = AtomicU64::new(0);

/// ([`GRAPH_CAPTURES`], [`GRAPH_CAPTURE_NS`]) now.
pub fn graph_captures() -> (u64, u64) {
    (
        GRAPH_CAPTURES.load(Ordering::Relaxed),
        GRAPH_CAPTURE_NS.load(Ordering::Relaxed),
    )
}

/// Count one capture that took `since.elapsed()`.
pub fn note_capture(since: std::time::Instant) {
    GRAPH_CAPTURES.fetch_add(1, Ordering::Relaxed);
    let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
    GRAPH_CAPTURE_NS.fetch_add(ns, Ordering::Relaxed);
}

/// Launch kernel `name` with `args` on the GPU's stream.
///
/// # Safety
/// Every `Arg::P` must point into a live device allocation covering every element the
/// kernel reads or writes for these scalar arguments, and the argument list must match
/// the kernel's parameter list in count and C types.
pub unsafe fn launch(g: &Gpu, name: &str, shape: Shape, args: &[Arg]) -> Result<()> {
    let f = g.func(name)?;
    g.launches.set(g.launches.get() + 1);
    KERNELS.fetch_add(1, Ordering::Relaxed);
    if g.pdl.get() {
        // SAFETY: forwarded from this function's contract.
        unsafe { launch_pdl(g, f, shape, args) }
            .map_err(|e| CudaError::driver(format!("launch {name} (programmatic)"), e))?;
    } else {
        let mut b = g.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::P(v) => b.arg(v),
                Arg::I(v) => b.arg(v),
                Arg::L(v) => b.arg(v),
                Arg::F(v) => b.arg(v),
            };
        }
        // SAFETY: forwarded from this function's contract (pointer regions checked by the
        // calling wrapper, argument list matching the kernel signature).
        unsafe { b.launch(shape.cfg()) }
            .map(|_| ())
            .map_err(|e| CudaError::driver(format!("launch {name}"), e))?;
    }
    if let Some(p) = g.profile.borrow_mut().as_mut() {
        let key = g.func_name(name);
        p.push((key, g.timing_event()?));
    }
    Ok(())
}

/// `cuLaunchKernelEx` with `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` (CUDA
/// driver API; captured into graphs as a programmatic edge): the kernel may launch before
/// the previous one in the stream completes; its `pdl_enter` waits for it.
///
/// # Safety
/// As [`launch`]; `f` must begin with `pdl_enter` (every engine entry point does).
unsafe fn launch_pdl(
    g: &Gpu,
    f: &cudarc::driver::CudaFunction,
    shape: Shape,
    args: &[Arg],
) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    g.ctx.bind_to_thread()?;
    // The values, then pointers to them (kernelParams holds one pointer per argument).
    let mut vals: Vec<[u8; 8]> = args
        .iter()
        .map(|a| {
            let mut b = [0u8; 8];
            match a {
                Arg::P(v) => b.copy_from_slice(&v.to_ne_bytes()),
                Arg::L(v) => b.copy_from_slice(&v.to_ne_bytes()),
                Arg::I(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                Arg::F(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
            }
            b
        })
        .collect();
    let mut ptrs: Vec<*mut std::ffi::c_void> = vals
        .iter_mut()
        .map(|v| v.as_mut_ptr().cast::<std::ffi::c_void>())
        .collect();
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value: sys::CUlaunchAttributeValue {
            programmaticStreamSerializationAllowed: 1,
        },
    };
    let cfg = sys::CUlaunchConfig {
        gridDimX: shape.grid.0,
        gridDimY: shape.grid.1,
        gridDimZ: shape.grid.2,
        blockDimX: shape.block.0,
        blockDimY: shape.block.1,
        blockDimZ: shape.block.2,
        sharedMemBytes: shape.smem,
        hStream: g.stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: cfg, attr, ptrs and vals outlive the call (the driver copies the argument
    // values at launch); the argument list matches the kernel (this function's contract).
    unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            ptrs.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
    }
}

/// A pointer argument after checking `[off, off + n)` lies in `b`.
pub fn ptr<T: cudarc::driver::DeviceRepr>(
    b: &DevBuf<T>,
    off: usize,
    n: usize,
    what: &str,
) -> Result<Arg> {
    b.span(off, n, what).map(Arg::P)
}

/// Elements a row-strided matrix of `rows` rows, `cols` used columns spans.
pub fn strided(rows: usize, stride: usize, cols: usize) -> usize {
    if rows == 0 {
        0
    } else {
        (rows - 1) * stride + cols
    }
}

/// A row-strided f32 operand: buffer, first element, row stride.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub buf: &'a DevBuf<f32>,
    pub off: usize,
    pub stride: usize,
}

impl<'a> Mat<'a> {
    /// Rows of `stride` floats starting at row 0 of `buf`.
    pub fn rows(buf: &'a DevBuf<f32>, stride: usize) -> Self {
        Self {
            buf,
            off: 0,
            stride,
        }
    }
    /// The same rows starting at column `col`.
    pub fn col(self, col: usize) -> Self {
        Self {
            off: self.off + col,
            ..self
        }
    }
    fn arg(&self, rows: usize, cols: usize, what: &str) -> Result<Arg> {
        ptr(self.buf, self.off, strided(rows, self.stride, cols), what)
    }
}

/// `y (+)= x @ W^T` with bf16 `W [n, k]` (kernel `linear_bf16`).
pub struct Linear<'a> {
    pub y: Mat<'a>,
    pub x: Mat<'a>,
    pub w: &'a DevBuf<u16>,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub accumulate: bool,
}

/// The arguments `linear_bf16` and `linear_norm_bf16` share (the GEMM's operands).
fn linear_args(a: &Linear<'_>, what: &str) -> Result<Vec<Arg>> {
    launch::check_gemm_operands(a.k, a.x.stride, a.x.off % a.x.stride.max(1), what)?;
    Ok(vec![
        a.y.arg(a.m, a.n, "linear y")?,
        int(a.y.stride, "y stride")?,
        a.x.arg(a.m, a.k, "linear x")?,
        int(a.x.stride, "x stride")?,
        ptr(a.w, 0, a.n * a.k, "linear W")?,
        int(a.m, "M")?,
        int(a.n, "N")?,
        int(a.k, "K")?,
        Arg::I(i32::from(a.accumulate)),
    ])
}

/// The kernel and launch shape of a bf16 GEMM over `[m rows, n output columns, r weight
/// rows]`: up to [`Gpu::skinny_max_rows`] rows the skinny kernel `kin[1]`, else from
/// [`Gpu::tiled_min_rows`] rows the register-tiled `kin[0]`, else the warp-per-column
/// kernel `base` (all three bit-identical, linear.cu).
fn gemm_pick(
    g: &Gpu,
    [m, n, r]: [usize; 3],
    base: &'static str,
    kin: [&'static str; 2],
) -> Result<(&'static str, Shape)> {
    if m <= g.skinny_max_rows || m >= g.tiled_min_rows {
        skinny_or_tiled(g, m, r, kin)
    } else {
        Ok((base, launch::gemm(m, n, base)?))
    }
}

/// Of a bf16 GEMM family's register-tiled and skinny kernels `[tiled, skinny]`, the one
/// `m` rows take (skinny up to [`Gpu::skinny_max_rows`]) and its launch shape over `r`
/// weight rows.
fn skinny_or_tiled(
    g: &Gpu,
    m: usize,
    r: usize,
    [tiled, skinny]: [&'static str; 2],
) -> Result<(&'static str, Shape)> {
    if m <= g.skinny_max_rows {
        Ok((skinny, launch::gemm_skinny(m, r, skinny)?))
    } else {
        Ok((tiled, launch::gemm_tiled(m, r, tiled)?))
    }
}

/// Kernel `linear_bf16` (or `linear_tiled_bf16` / `linear_skinny_bf16`, [`gemm_pick`]).
pub fn linear(g: &Gpu, a: &Linear<'_>) -> Result<()> {
    let args = linear_args(a, "linear_bf16")?;
    let (name, shape) = gemm_pick(
        g,
        [a.m, a.n, a.n],
        "linear_bf16",
        ["linear_tiled_bf16", "linear_skinny_bf16"],
    )?;
    // SAFETY: y spans (M-1)*y_stride + N, x spans (M-1)*x_stride + K, W spans N*K
    // elements, all checked by `ptr`; both kernels touch y[m*ys + n], x[m*xs + k],
    // W[n*K + k] for m < M, n < N, k < K only (K % 8 == 0 and 16-byte alignment checked).
    unsafe { launch(g, name, shape, &args) }
}

/// `y (+)= rmsnorm(x, norm, eps) @ W^T` in one kernel (`linear_norm_bf16`): the input
/// norm fused into the projection that is its only consumer. `norm`: Shape [k] f32.
pub fn linear_norm(g: &Gpu, a: &Linear<'_>, norm: &DevBuf<f32>, eps: f32) -> Result<()> {
    let mut args = linear_args(a, "linear_norm_bf16")?;
    args.push(ptr(norm, 0, a.k, "linear norm weight")?);
    args.push(Arg::F(eps));
    let (name, shape) = gemm_pick(
        g,
        [a.m, a.n, a.n],
        "linear_norm_bf16",
        ["linear_norm_tiled_bf16", "linear_norm_skinny_bf16"],
    )?;
    // SAFETY: as `linear`, plus g [K] checked; the kernels read g[k] for k < K.
    unsafe { launch(g, name, shape, &args) }
}

/// Two `linear`s of one shape (same m, n, k and strides, no accumulate) in one launch
/// (kernel `linear_pair_bf16`).
pub fn linear_pair(g: &Gpu, a: &Linear<'_>, b: &Linear<'_>) -> Result<()> {
    let same = (a.m, a.n, a.k, a.y.stride, a.x.stride) == (b.m, b.n, b.k, b.y.stride, b.x.stride);
    if !same || a.accumulate || b.accumulate {
        return Err(CudaError::Input(
            "linear_pair: the two GEMMs differ in shape or accumulate (internal)".into(),
        ));
    }
    for l in [a, b] {
        launch::check_gemm_operands(l.k, l.x.stride, l.x.off % l.x.stride.max(1), "linear_pair")?;
    }
    let args = [
        a.y.arg(a.m, a.n, "pair y0")?,
        b.y.arg(b.m, b.n, "pair y1")?,
        int(a.y.stride, "y stride")?,
        a.x.arg(a.m, a.k, "pair x0")?,
        b.x.arg(b.m, b.k, "pair x1")?,
        int(a.x.stride, "x stride")?,
        ptr(a.w, 0, a.n * a.k, "pair W0")?,
        ptr(b.w, 0, b.n * b.k, "pair W1")?,
        int(a.m, "M")?,
        int(a.n, "N")?,
        int(a.k, "K")?,
    ];
    let (name, mut shape) = gemm_pick(
        g,
        [a.m, a.n, a.n],
        "linear_pair_bf16",
        ["linear_pair_tiled_bf16", "linear_pair_skinny_bf16"],
    )?;
    shape.grid.2 = 2;
    // SAFETY: each (y_z, x_z, W_z) checked as in `linear`; block z touches only its own.
    unsafe { launch(g, name, shape, &args) }
}

/// `h = silu(x Wg^T) * (x Wu^T)` with fused bf16 `W13 [n, 2, k]` (kernel `swiglu_dense_bf16`).
pub struct Swiglu<'a> {
    pub h: &'a DevBuf<f32>,
    pub x: Mat<'a>,
    pub w13: &'a DevBuf<u16>,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// The checked arguments of the swiglu kernels (h, x, x stride, W13, M, N, K).
fn swiglu_args(a: &Swiglu<'_>) -> Result<Vec<Arg>> {
    launch::check_gemm_operands(a.k, a.x.stride, a.x.off % a.x.stride.max(1), "swiglu")?;
    Ok(vec![
        ptr(a.h, 0, a.m * a.n, "swiglu h")?,
        a.x.arg(a.m, a.k, "swiglu x")?,
        int(a.x.stride, "x stride")?,
        ptr(a.w13, 0, 2 * a.n * a.k, "swiglu W13")?,
        int(a.m, "M")?,
        int(a.n, "N")?,
        int(a.k, "K")?,
    ])
}

/// Kernel `swiglu_dense_bf16`.
pub fn swiglu(g: &Gpu, a: &Swiglu<'_>) -> Result<()> {
    let args = swiglu_args(a)?;
    let (name, shape) = gemm_pick(
        g,
        [a.m, a.n, 2 * a.n],
        "swiglu_dense_bf16",
        ["swiglu_tiled_bf16", "swiglu_skinny_bf16"],
    )?;
    // SAFETY: h [M, N], x (M-1)*stride + K, W13 [N, 2, K], checked by `ptr`; both kernels
    // touch exactly those for m < M, n < N.
    unsafe { launch(g, name, shape, &args) }
}

/// Kernel `embed_gather`: `out [t, h]` rows of the bf16 table by token id.
pub fn embed(
    g: &Gpu,
    out: &DevBuf<f32>,
    table: &DevBuf<u16>,
    tokens: Arg,
    t: usize,
    h: usize,
    vocab: usize,
) -> Result<()> {
    let args = [
        ptr(out, 0, t * h, "embed out")?,
        ptr(table, 0, vocab * h, "embed table")?,
        tokens,
        int(t, "T")?,
        int(h, "H")?,
    ];
    // SAFETY: out [T, H] and table [V, H] checked; `tokens` is the meta section of T ids,
    // each < V (checked by meta::build).
    unsafe { launch(g, "embed_gather", launch::per_row(t, 128, "embed")?, &args) }
}

/// The arguments the rmsnorm kernels share after their outputs: x, its stride, w, R, D, eps.
fn norm_tail(x: Mat<'_>, w: &DevBuf<f32>, rows: usize, d: usize, eps: f32) -> Result<[Arg; 6]> {
    Ok([
        x.arg(rows, d, "rmsnorm x")?,
        int(x.stride, "x stride")?,
        ptr(w, 0, d, "rmsnorm w")?,
        int(rows, "R")?,
        int(d, "D")?,
        Arg::F(eps),
    ])
}

/// Kernel `rmsnorm` over `rows` rows of `d`.
pub fn rmsnorm(
    g: &Gpu,
    out: Mat<'_>,
    x: Mat<'_>,
    w: &DevBuf<f32>,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    let mut args = vec![
        out.arg(rows, d, "rmsnorm out")?,
        int(out.stride, "out stride")?,
    ];
    args.extend(norm_tail(x, w, rows, d, eps)?);
    // SAFETY: out and x span (R-1)*stride + D, w spans D, all checked.
    unsafe { launch(g, "rmsnorm", launch::per_row(rows, 128, "rmsnorm")?, &args) }
}

/// Kernel `mtp_in_norm`: `out[:, ..d] = rmsnorm(embed(tokens), we)` and `out[:, d..2d] =
/// rmsnorm(h, wh)` over `t` rows in one launch (`embed` + two `rmsnorm`s bit for bit).
/// `out`: [t, stride >= 2d]; `h`: [t, stride >= d]; `table` [vocab, d] bf16; `tokens` the
/// meta section of `t` ids (< vocab).
pub struct MtpIn<'a> {
    pub out: Mat<'a>,
    pub table: &'a DevBuf<u16>,
    pub tokens: Arg,
    pub h: Mat<'a>,
    pub we: &'a DevBuf<f32>,
    pub wh: &'a DevBuf<f32>,
    pub t: usize,
    pub d: usize,
    pub vocab: usize,
    pub eps: f32,
}

/// Kernel `mtp_in_norm` ([`MtpIn`]).
pub fn mtp_in_norm(g: &Gpu, a: &MtpIn<'_>) -> Result<()> {
    if a.out.stride < 2 * a.d {
        return Err(CudaError::Input(
            "mtp_in_norm: out rows narrower than 2 d (internal)".into(),
        ));
    }
    let args = [
        a.out.arg(a.t, 2 * a.d, "mtp in out")?,
        int(a.out.stride, "out stride")?,
        ptr(a.table, 0, a.vocab * a.d, "embed table")?,
        a.tokens,
        a.h.arg(a.t, a.d, "mtp in h")?,
        int(a.h.stride, "h stride")?,
        ptr(a.we, 0, a.d, "enorm")?,
        ptr(a.wh, 0, a.d, "hnorm")?,
        int(a.t, "T")?,
        int(a.d, "D")?,
        Arg::F(a.eps),
    ];
    let mut shape = launch::per_row(a.t, 128, "mtp_in_norm")?;
    shape.grid.1 = 2;
    // SAFETY: out spans (T-1)*stride + 2D, h (T-1)*stride + D, table [V, D], we / wh [D],
    // all checked; `tokens` is the meta section of T ids, each < V (meta::build).
    unsafe { launch(g, "mtp_in_norm", shape, &args) }
}

/// Kernel `rmsnorm_dup`: [`rmsnorm`] of `rows` rows written to both `out` and `out2`
/// (contiguous rows of `d`).
pub fn rmsnorm_dup(
    g: &Gpu,
    [out, out2]: [&DevBuf<f32>; 2],
    x: Mat<'_>,
    w: &DevBuf<f32>,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    let mut args = vec![
        ptr(out, 0, rows * d, "rmsnorm out")?,
        ptr(out2, 0, rows * d, "rmsnorm out2")?,
        int(d, "out stride")?,
    ];
    args.extend(norm_tail(x, w, rows, d, eps)?);
    // SAFETY: out and out2 [R, D] (stride D), x spans (R-1)*stride + D, w [D], all checked.
    unsafe {
        launch(
            g,
            "rmsnorm_dup",
            launch::per_row(rows, 128, "rmsnorm_dup")?,
            &args,
        )
    }
}

/// Kernel `gather_rows`: `out [r, d] = x[rows[i]]`; `rows` (meta) indexes `< x_rows`.
pub fn gather_rows(
    g: &Gpu,
    out: &DevBuf<f32>,
    x: &DevBuf<f32>,
    x_rows: usize,
    rows: Arg,
    r: usize,
    d: usize,
) -> Result<()> {
    let args = [
        ptr(out, 0, r * d, "gather out")?,
        ptr(x, 0, x_rows * d, "gather x")?,
        rows,
        int(r, "R")?,
        int(d, "D")?,
    ];
    // SAFETY: out [R, D], x [x_rows, D] checked; `rows` holds meta last_rows, each < T =
    // x_rows (built by meta::build).
    unsafe {
        launch(
            g,
            "gather_rows",
            launch::per_row(r, 128, "gather_rows")?,
            &args,
        )
    }
}

/// Kernel `argmax_rows`.
pub fn argmax(g: &Gpu, out: &DevBuf<u32>, logits: &DevBuf<f32>, r: usize, v: usize) -> Result<()> {
    let args = [
        ptr(out, 0, r, "argmax out")?,
        ptr(logits, 0, r * v, "argmax logits")?,
        int(r, "R")?,
        int(v, "V")?,
    ];
    // SAFETY: out [R], logits [R, V] checked.
    unsafe { launch(g, "argmax_rows", launch::per_row(r, 1024, "argmax")?, &args) }
}

/// Kernel `copy_f32`: `n` floats from `src[s_off..]` to `dst[d_off..]`.
pub fn copy(
    g: &Gpu,
    dst: &DevBuf<f32>,
    d_off: usize,
    src: &DevBuf<f32>,
    s_off: usize,
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    // Device allocations are 256-byte aligned, so offsets in whole float4s keep the
    // 16-byte alignment copy_f32x4 needs.
    let vec4 = n.is_multiple_of(4) && d_off.is_multiple_of(4) && s_off.is_multiple_of(4);
    let args = [
        ptr(dst, d_off, n, "copy dst")?,
        ptr(src, s_off, n, "copy src")?,
        long(if vec4 { n / 4 } else { n }),
    ];
    let (name, shape) = if vec4 {
        let blocks = (n / 4).div_ceil(256).min(132 * 8);
        ("copy_f32x4", launch::grid_2d(blocks, 1, 256, "copy")?)
    } else {
        (
            "copy_f32",
            launch::grid_2d(n.div_ceil(256), 1, 256, "copy")?,
        )
    };
    // SAFETY: both regions of n floats checked; copy_f32x4 touches the same n floats as
    // n / 4 aligned float4s.
    unsafe { launch(g, name, shape, &args) }
}

/// The MoE routing buffers of one step (`T` tokens, top-`k` of `E`).
pub struct Routing<'a> {
    /// Shape: [T * k] i32 expert ids.
    pub ids: &'a DevBuf<i32>,
    /// Shape: [T * k] f32 router weights.
    pub wts: &'a DevBuf<f32>,
    /// Shape: [8 * max_tiles] i32 pair ids by expert, -1 padding.
    pub sorted: &'a DevBuf<i32>,
    /// Shape: [max_tiles + 1] i32: each tile's expert, then the count of tiles used.
    pub tile_expert: &'a DevBuf<i32>,
    pub t: usize,
    pub k: usize,
    pub e: usize,
    pub max_tiles: usize,
}

impl Routing<'_> {
    fn check(&self) -> Result<()> {
        if self.k == 0
            || self.k > launch::TOPK_MAX
            || self.k > self.e
            || self.e > launch::EXPERTS_MAX
        {
            return Err(CudaError::Unsupported(format!(
                "MoE with top-{} of {} experts (kernels: k <= {}, E <= {})",
                self.k,
                self.e,
                launch::TOPK_MAX,
                launch::EXPERTS_MAX
            )));
        }
        if self.max_tiles < launch::moe_max_tiles(self.t * self.k, self.e) {
            return Err(CudaError::Input(
                "MoE tile buffer below the bound (internal)".into(),
            ));
        }
        Ok(())
    }
}

/// Kernels `moe_topk` then `moe_align`: routing from router logits `[T, E]`.
pub fn moe_route(
    g: &Gpu,
    r: &Routing<'_>,
    logits: &DevBuf<f32>,
    bias: &DevBuf<f32>,
    norm_topk: bool,
    rsf: f32,
) -> Result<()> {
    moe_topk(g, r, logits, bias, norm_topk, rsf)?;
    moe_align(g, r)
}

/// Kernel `moe_topk`: `r.ids` / `r.wts` from router logits `[T, E]` and the bias `[E]`.
pub fn moe_topk(
    g: &Gpu,
    r: &Routing<'_>,
    logits: &DevBuf<f32>,
    bias: &DevBuf<f32>,
    norm_topk: bool,
    rsf: f32,
) -> Result<()> {
    r.check()?;
    let p = r.t * r.k;
    let args = [
        ptr(r.ids, 0, p, "topk ids")?,
        ptr(r.wts, 0, p, "topk wts")?,
        ptr(logits, 0, r.t * r.e, "router logits")?,
        ptr(bias, 0, r.e, "router bias")?,
        int(r.t, "T")?,
        int(r.e, "E")?,
        int(r.k, "k")?,
        Arg::I(i32::from(norm_topk)),
        Arg::F(rsf),
    ];
    // SAFETY: ids, wts [T*k], logits [T, E], bias [E] checked; k <= 8, E <= 1024 checked
    // (the kernel's shared arrays).
    unsafe { launch(g, "moe_topk", launch::per_warp(r.t, "moe_topk")?, &args) }
}

/// The router GEMM's operands for [`moe_route_fused`].
pub struct Router<'a> {
    /// Shape: [T, K] post-norm input.
    pub x: &'a DevBuf<f32>,
    /// Shape: [E, K] bf16.
    pub w: &'a DevBuf<u16>,
    pub k_dim: usize,
    /// Shape: [T, E] router logits (written).
    pub logits: &'a DevBuf<f32>,
    /// Shape: [E].
    pub bias: &'a DevBuf<f32>,
    /// Shape: [T, K W4_XS_MAX / 2]: the INT4 experts' split input, written on the way
    /// (then [`ExpertInput::Ready`]); `None` writes nothing.
    pub xs: Option<&'a DevBuf<f32>>,
    /// The post-attention rmsnorm fused in: (raw residual [T, K], norm weight [K], eps).
    /// The kernel writes rmsnorm(residual) into `x` (bit for bit kernel `rmsnorm`) and
    /// routes that; `None`: `x` is the normalized input already.
    pub norm: Option<(&'a DevBuf<f32>, &'a DevBuf<f32>, f32)>,
    /// Shape: [1] i32, zero between launches. `Some`: the router's last block also sorts
    /// the pairs (moe_align's work, no `moe_align` launch); `None`: `moe_align` follows.
    pub ticket: Option<&'a DevBuf<i32>>,
    /// The kernel's latency cuts (`pre`: router-weight prologue before the
    /// grid-dependency wait, no ticket in a one-block grid; [`Gpu::router_pre`]).
    pub pre: bool,
}

/// Largest hidden size whose norm the fused router takes (`ROUTER_NORM_K_MAX`).
pub const ROUTER_NORM_K_MAX: usize = 4096;

/// Largest router the fused kernel takes (its shared arrays).
pub const ROUTER_FUSED_E_MAX: usize = 256;

/// Kernels `moe_router_topk` (router GEMM + top-k, logits bit-identical to `linear` +
/// `moe_topk`) then `moe_align`, or with [`Router::ticket`] the align done by the router's
/// last block (one launch); routers with E <= [`ROUTER_FUSED_E_MAX`].
pub fn moe_route_fused(
    g: &Gpu,
    r: &Routing<'_>,
    rt: &Router<'_>,
    norm_topk: bool,
    rsf: f32,
) -> Result<()> {
    r.check()?;
    if r.e > ROUTER_FUSED_E_MAX {
        return Err(CudaError::Unsupported(format!(
            "fused router with {} experts (at most {ROUTER_FUSED_E_MAX})",
            r.e
        )));
    }
    launch::check_gemm_operands(rt.k_dim, rt.k_dim, 0, "moe_router_topk")?;
    let p = r.t * r.k;
    let xs = match rt.xs {
        Some(b) if rt.k_dim.is_multiple_of(16) => {
            ptr(b, 0, r.t * rt.k_dim * launch::W4_XS_MAX / 2, "router xs")?
        }
        Some(_) => {
            return Err(CudaError::Unsupported(format!(
                "fused router split with K = {} (needs K % 16 == 0)",
                rt.k_dim
            )))
        }
        None => Arg::P(0),
    };
    let (src, norm) = match rt.norm {
        Some(_) if rt.k_dim > ROUTER_NORM_K_MAX => {
            return Err(CudaError::Unsupported(format!(
                "fused router norm with K = {} (at most {ROUTER_NORM_K_MAX})",
                rt.k_dim
            )))
        }
        Some((raw, w, eps)) => (
            ptr(raw, 0, r.t * rt.k_dim, "router residual")?,
            [
                ptr(w, 0, rt.k_dim, "router norm weight")?,
                Arg::F(eps),
                ptr(rt.x, 0, r.t * rt.k_dim, "router normed input")?,
            ],
        ),
        None => (
            ptr(rt.x, 0, r.t * rt.k_dim, "router input")?,
            [Arg::P(0), Arg::F(0.0), Arg::P(0)],
        ),
    };
    let [sorted, tiles] = tile_args(r)?;
    let args = [
        ptr(r.ids, 0, p, "topk ids")?,
        ptr(r.wts, 0, p, "topk wts")?,
        ptr(rt.logits, 0, r.t * r.e, "router logits")?,
        xs,
        src,
        int(rt.k_dim, "x stride")?,
        ptr(rt.w, 0, r.e * rt.k_dim, "router weight")?,
        ptr(rt.bias, 0, r.e, "router bias")?,
        int(r.t, "T")?,
        int(r.e, "E")?,
        int(rt.k_dim, "K")?,
        int(r.k, "k")?,
        Arg::I(i32::from(norm_topk)),
        Arg::F(rsf),
        norm[0],
        norm[1],
        norm[2],
        match rt.ticket {
            Some(b) => ptr(b, 0, 1, "router ticket")?,
            None => Arg::P(0),
        },
        sorted,
        tiles,
        int(r.max_tiles, "max_tiles")?,
        Arg::I(i32::from(rt.pre)),
    ];
    // SAFETY: ids, wts [T*k], logits [T, E], x [T, K], W [E, K], bias [E], xs (null or
    // [T, K W4_XS_MAX / 2] words, K % 16 == 0) checked; k <= 8 and E <= 256 checked (the
    // kernel's shared arrays), K % 8 == 0 checked; x stride = K; with the norm, the
    // residual [T, K], weight [K] and output [T, K] checked and K <= ROUTER_NORM_K_MAX;
    // with the ticket ([1], zero between launches) the last block writes sorted / tiles
    // as `moe_align` does (bounds as there: `r.check`).
    unsafe {
        launch(
            g,
            "moe_router_topk",
            launch::per_row(r.t, 512, "moe_router_topk")?,
            &args,
        )?
    };
    match rt.ticket {
        Some(_) => Ok(()),
        None => moe_align(g, r),
    }
}

/// The `sorted` [8 * max_tiles] and `tile_expert` [max_tiles + 1] pointers that
/// `moe_align`, and the router's aligning last block, write.
fn tile_args(r: &Routing<'_>) -> Result<[Arg; 2]> {
    Ok([
        ptr(
            r.sorted,
            0,
            launch::ROWS_PER_TILE as usize * r.max_tiles,
            "sorted",
        )?,
        ptr(r.tile_expert, 0, r.max_tiles + 1, "tile_expert")?,
    ])
}

/// Kernel `moe_align`: the pairs of `r.ids` (each `< E`) sorted per expert into tiles.
pub fn moe_align(g: &Gpu, r: &Routing<'_>) -> Result<()> {
    r.check()?;
    let p = r.t * r.k;
    let [sorted, tiles] = tile_args(r)?;
    let args = [
        sorted,
        tiles,
        ptr(r.ids, 0, p, "ids")?,
        int(p, "P")?,
        int(r.e, "E")?,
        int(r.max_tiles, "max_tiles")?,
    ];
    // SAFETY: sorted [8 * max_tiles], tile_expert [max_tiles + 1], ids [P] checked; the
    // kernel writes at most moe_max_tiles(P, E) <= max_tiles tiles (checked by
    // `r.check`; the bound is tested in launch.rs); ids < E (moe_topk's output, or
    // host-built ids checked by their builder, crate::moebench).
    unsafe {
        launch(
            g,
            "moe_align",
            launch::grid_2d(1, 1, 1024, "moe_align")?,
            &args,
        )
    }
}

/// Routed expert weights of one layer, as kernel pointers.
pub enum ExpertPtrs<'a> {
    Int4 {
        q13: &'a DevBuf<u32>,
        s13: &'a DevBuf<u16>,
        qd: &'a DevBuf<u32>,
        sd: &'a DevBuf<u16>,
    },
    Bf16 {
        w13: &'a DevBuf<u16>,
        wd: &'a DevBuf<u16>,
    },
}

/// The routed experts of one MoE layer: `x [T, H] -> y [P, H]` (router-weighted).
pub struct Experts<'a> {
    pub w: ExpertPtrs<'a>,
    /// Shape: [T, H] post-norm input.
    pub x: &'a DevBuf<f32>,
    /// Shape: [T, H W4_XS_MAX / 2] scratch: the split input of the INT4 kernels.
    pub xs: &'a DevBuf<f32>,
    /// Where the INT4 gate/up launch takes its activations from.
    pub input: ExpertInput,
    /// Shape: [P, Im] scratch.
    pub h: &'a DevBuf<f32>,
    /// Shape: [P, H] output.
    pub y: &'a DevBuf<f32>,
    /// Shape: [MOE_SYNC_FIXED + max_tiles] the fused INT4 kernel's counters, zero between
    /// launches.
    pub sync: &'a DevBuf<i32>,
    pub hidden: usize,
    pub inter: usize,
    /// The shared expert's SwiGLU hidden, computed by extra blocks of the INT4 gate/up
    /// launch (`moe_gate_up_shared_w4`, its tiled `swiglu` bit for bit); `None`: the
    /// caller launches it. Only with INT4 experts, not the fused launch.
    pub shared: Option<Swiglu<'a>>,
}

/// Where the INT4 gate/up launch of [`moe_experts`] takes its activations from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertInput {
    /// `moe_split_x` splits `x` into `xs` first (so the routing is two grids back).
    Split,
    /// `xs` already holds the split of `x`: the fused router wrote it (the grid before), or
    /// bench moe did at set-up. `routing_settled`: the routing was written before the grid
    /// before gate/up (bench moe's injected routing, not the engine's router), so gate/up's
    /// weight prologue may read it before the grid-dependency wait.
    Ready { routing_settled: bool },
}

/// The weight-prologue flags (`pre`) of the INT4 gate/up and down launches: the routing
/// must be at least two grids back (linear.cu `w4_mma`). Down always has gate/up between;
/// gate/up when `moe_split_x` runs after the routing, or the routing is settled.
fn w4_pre(g: &Gpu, input: ExpertInput) -> [bool; 2] {
    let gate_up = match input {
        ExpertInput::Split => true,
        ExpertInput::Ready { routing_settled } => routing_settled,
    };
    [g.w4_pre && gate_up, g.w4_pre]
}

/// What the INT4 expert GEMMs of `t` tokens routed top-`k` over a grid of `max_tiles`
/// know about their tiles, under this device's K-split rule (forced, wave or reaching).
pub fn w4_tiles(g: &Gpu, max_tiles: usize, t: usize, k: usize) -> Result<launch::W4Tiles> {
    Ok(launch::W4Tiles {
        max: max_tiles,
        min: launch::moe_min_tiles(t, k),
        target: launch::w4_target_blocks()?,
        forced: launch::w4_ks_forced()?,
        waves: g.w4_waves.then_some((g.w4_slots, g.w4_band)),
    })
}

/// Kernel `moe_split_x`: `xs` [T, H W4_XS_MAX / 2] words = the split of `x` [T, H] the
/// INT4 gate/up reads (H % 128 == 0).
pub fn moe_split_x(g: &Gpu, xs: &DevBuf<f32>, x: &DevBuf<f32>, t: usize, hd: usize) -> Result<()> {
    if !hd.is_multiple_of(128) {
        return Err(CudaError::Unsupported(format!(
            "moe_split_x needs H % 128 == 0 (H {hd})"
        )));
    }
    let args = [
        ptr(xs, 0, t * hd * launch::W4_XS_MAX / 2, "moe xs")?,
        ptr(x, 0, t * hd, "moe x")?,
        int(t, "T")?,
        int(hd, "K")?,
    ];
    // SAFETY: xs [T, H W4_XS_MAX / 2] words, x [T, H] checked; H % 128 == 0 (above).
    unsafe {
        launch(
            g,
            "moe_split_x",
            launch::moe_split(t, hd, "moe_split_x")?,
            &args,
        )
    }
}

/// Kernels `moe_gate_up_*` then `moe_down_*`.
pub fn moe_experts(g: &Gpu, r: &Routing<'_>, a: &Experts<'_>) -> Result<()> {
    r.check()?;
    let (e, hd, im, p) = (r.e, a.hidden, a.inter, r.t * r.k);
    launch::check_gemm_operands(hd, hd, 0, "moe gate/up")?;
    launch::check_gemm_operands(im, im, 0, "moe down")?;
    let sorted = ptr(
        r.sorted,
        0,
        launch::ROWS_PER_TILE as usize * r.max_tiles,
        "sorted",
    )?;
    let tiles = ptr(r.tile_expert, 0, r.max_tiles + 1, "tile_expert")?;
    // INT4: h holds gate/up's split output, W4_XS <= W4_XS_MAX bf16 terms an element.
    let int4 = matches!(a.w, ExpertPtrs::Int4 { .. });
    let h_len = if int4 {
        p * im * launch::W4_XS_MAX / 2
    } else {
        p * im
    };
    let h = ptr(a.h, 0, h_len, "moe h")?;
    let x = ptr(a.x, 0, r.t * hd, "moe x")?;
    let y = ptr(a.y, 0, p * hd, "moe y")?;
    let wts = ptr(r.wts, 0, p, "moe wts")?;
    let (gu_name, gu_w, dn_name, dn_w): (&str, Vec<Arg>, &str, Vec<Arg>) = match &a.w {
        ExpertPtrs::Int4 { q13, s13, qd, sd } => {
            if hd % 128 != 0 || im % 128 != 0 {
                return Err(CudaError::Unsupported(format!(
                    "INT4 experts need H and Im % 128 == 0 (H {hd}, Im {im})"
                )));
            }
            (
                "moe_gate_up_w4",
                vec![
                    ptr(q13, 0, e * im * 2 * hd / 8, "q13")?,
                    ptr(s13, 0, e * im * 2 * hd / 128, "s13")?,
                ],
                "moe_down_w4",
                vec![
                    ptr(qd, 0, e * hd * im / 8, "qd")?,
                    ptr(sd, 0, e * hd * im / 128, "sd")?,
                ],
            )
        }
        ExpertPtrs::Bf16 { w13, wd } => (
            "moe_gate_up_bf16",
            vec![ptr(w13, 0, e * im * 2 * hd, "w13")?],
            "moe_down_bf16",
            vec![ptr(wd, 0, e * hd * im, "wd")?],
        ),
    };
    // Shapes first (every check before any launch). INT4: the kernels pick the warps
    // splitting K from the real tile count, up to the host's bound `ks_hi` (launch.rs).
    let w4t = w4_tiles(g, r.max_tiles, r.t, r.k)?;
    let none = launch::W4Split {
        ks_hi: 0,
        seg: [0; launch::W4_SEGS],
    };
    let (gu_shape, gu_ks) = if int4 {
        launch::moe_w4(im, hd, 2, &w4t, gu_name)?
    } else {
        (launch::moe_gemm(im, r.max_tiles, gu_name)?, none)
    };
    let (dn_shape, dn_ks) = if int4 {
        launch::moe_w4(hd, im, 1, &w4t, dn_name)?
    } else {
        (launch::moe_gemm(hd, r.max_tiles, dn_name)?, none)
    };
    // The INT4 kernels' last arguments: the grid's tiles, the K-split bound and
    // segments, the weight prologue.
    let w4_tail = |ks: launch::W4Split, pre: bool| -> Result<Vec<Arg>> {
        Ok(if int4 {
            let mut v = vec![int(r.max_tiles, "max_tiles")?, int(ks.ks_hi, "ks_hi")?];
            for s in ks.seg {
                v.push(int(s, "K-split segment")?);
            }
            v.push(Arg::I(i32::from(pre)));
            v
        } else {
            Vec::new()
        })
    };
    if a.shared.is_some() && (!int4 || launch::moe_fused()) {
        return Err(CudaError::Input(
            "moe_experts: the shared expert rides only on the separate INT4 gate/up launch (internal)".into(),
        ));
    }
    if a.shared.is_some() && !launch::w4_blocks_carry_shared() {
        return Err(CudaError::Input(format!(
            "moe_experts: the shared expert merges only into blocks of {} warps, not {} (internal)",
            launch::W4_WARPS,
            launch::w4_warps()
        )));
    }
    if int4 && launch::moe_fused() {
        let fused = Fused {
            gu_w,
            dn_w,
            grid: gu_shape.grid.0 as usize + dn_shape.grid.0 as usize,
            ks: [gu_ks.ks_hi, dn_ks.ks_hi],
            target: w4t.target,
        };
        return moe_experts_fused(g, r, a, fused, [sorted, tiles, h, x, y, wts]);
    }
    let mut args = if int4 {
        let xs = ptr(a.xs, 0, r.t * hd * launch::W4_XS_MAX / 2, "moe xs")?;
        if a.input == ExpertInput::Split {
            moe_split_x(g, a.xs, a.x, r.t, hd)?;
        }
        vec![h, xs]
    } else {
        vec![h, x]
    };
    args.extend(gu_w);
    args.extend([
        sorted,
        tiles,
        int(r.k, "topk")?,
        int(im, "N")?,
        int(hd, "K")?,
    ]);
    let pre = w4_pre(g, a.input);
    args.extend(w4_tail(gu_ks, pre[0])?);
    match &a.shared {
        // SAFETY: h [P, Im] (INT4: P Im W4_XS_MAX / 2 words), x [T, H], the expert weights
        // [E, Im, 2, H] (as words / scales), sorted [8 max_tiles], tile_expert
        // [max_tiles + 1] checked; pair ids in `sorted` are < P and tile experts < E
        // (moe_align's output over ids < E). The INT4 kernels touch whole row blocks of 64
        // rows only (2 Im, H % 64 == 0, checked by moe_w4; launch.rs tests the row-block cover).
        None => unsafe { launch(g, gu_name, gu_shape, &args)? },
        Some(sw) => gate_up_shared(g, sw, gu_shape, args)?,
    }
    let mut args = vec![y, h];
    args.extend(dn_w);
    args.extend([wts, sorted, tiles, int(hd, "N")?, int(im, "K")?]);
    args.extend(w4_tail(dn_ks, pre[1])?);
    // SAFETY: y [P, H], h as above, weights [E, H, Im], wts [P] checked; indices as above.
    unsafe { launch(g, dn_name, dn_shape, &args) }
}

/// Kernel `moe_gate_up_shared_w4`: the INT4 gate/up launch `gu` (its checked `args`)
/// with the tiled (or, up to [`Gpu::skinny_max_rows`] rows, skinny) `swiglu` of `sw` as
/// extra leading blocks.
fn gate_up_shared(g: &Gpu, sw: &Swiglu<'_>, gu: launch::Shape, mut args: Vec<Arg>) -> Result<()> {
    let name = "moe_gate_up_shared_w4";
    let mut sh_args = swiglu_args(sw)?;
    let kin = ["swiglu_tiled_bf16", "swiglu_skinny_bf16"];
    let (block, sh) = skinny_or_tiled(g, sw.m, 2 * sw.n, kin)?;
    let skinny = block == kin[1];
    let (gx, blocks) = (sh.grid.0 as usize, sh.grid.0 as usize * sh.grid.1 as usize);
    sh_args.extend([
        int(gx, "shared grid x")?,
        int(blocks, "shared blocks")?,
        Arg::I(i32::from(skinny)),
    ]);
    args.extend(sh_args);
    let mut shape = gu;
    shape.grid.0 = u32::try_from(gu.grid.0 as usize + blocks).map_err(|_| {
        CudaError::Unsupported(format!("{name}: grid of {} + {blocks} blocks", gu.grid.0))
    })?;
    // SAFETY: the gate/up arguments as checked by `moe_experts`; the shared expert's as
    // `swiglu` checks them (h [M, N], x (M-1)*stride + K, W13 [N, 2, K]); blocks below
    // `blocks` run swiglu_tiled_bf16's (skinny: swiglu_skinny_bf16's) block (x, y) = (b %
    // gx, b / gx) of the grid `gemm_tiled` (`gemm_skinny`) gives, the rest moe_gate_up_w4's
    // blocks in order (all 256 threads).
    unsafe { launch(g, name, shape, &args) }
}

/// What `moe_experts` hands the fused INT4 kernel: the two weight-pointer pairs, the
/// separate kernels' grids (summed), their K-split bounds and target.
struct Fused {
    gu_w: Vec<Arg>,
    dn_w: Vec<Arg>,
    grid: usize,
    ks: [usize; 2],
    target: usize,
}

/// Kernel `moe_experts_w4`: split (unless `xs` is ready), gate/up and down in one launch.
/// `p` = the checked pointers sorted, tile_expert, h, x, y, wts of `moe_experts`.
fn moe_experts_fused(
    g: &Gpu,
    r: &Routing<'_>,
    a: &Experts<'_>,
    f: Fused,
    p: [Arg; 6],
) -> Result<()> {
    let [sorted, tiles, h, x, y, wts] = p;
    let (hd, im) = (a.hidden, a.inter);
    let ready = matches!(a.input, ExpertInput::Ready { .. });
    let split_chunks = if ready {
        0
    } else {
        (r.t * hd / 4).div_ceil(32 * launch::w4_warps() as usize)
    };
    let grid = f.grid + split_chunks;
    let mut shape = launch::grid_2d(grid, 1, 32 * launch::w4_warps(), "moe_experts_w4")?;
    shape.smem = launch::w4_smem();
    let mut args = vec![
        y,
        h,
        ptr(a.xs, 0, r.t * hd * launch::W4_XS_MAX / 2, "moe xs")?,
        if ready { Arg::P(0) } else { x },
        int(r.t, "T")?,
    ];
    args.extend(f.gu_w);
    args.extend(f.dn_w);
    args.extend([
        wts,
        sorted,
        tiles,
        ptr(a.sync, 0, launch::MOE_SYNC_FIXED + r.max_tiles, "moe sync")?,
        int(r.k, "topk")?,
        int(hd, "H")?,
        int(im, "Im")?,
        int(r.max_tiles, "max_tiles")?,
        int(f.ks[0], "ks_hi_gu")?,
        int(f.ks[1], "ks_hi_dn")?,
        int(f.target, "target")?,
    ]);
    // SAFETY: as the three separate launches of `moe_experts` (the same pointers and
    // bounds, checked there; the grid is their grids' sum, so it covers every item), plus
    // sync [MOE_SYNC_FIXED + max_tiles] i32 checked here, zero between launches (allocated
    // zeroed, reset by the last block). Blocks take items in ticket order, so a block only
    // waits on items already taken by running blocks: no deadlock whatever the residency.
    unsafe { launch(g, "moe_experts_w4", shape, &args) }
}

/// Kernel `linear_tiled_combine_bf16`: the shared expert's down-projection `s = h @ Wd^T`
/// with `moe_combine` as its epilogue, `x += routed (ascending expert) + s`, bit for bit
/// the unfused `linear` + `moe_combine`. `a.y` is the residual `x` [T, H] (stride H),
/// `a.x` the shared expert's hidden rows, `a.w` its down weight [H, inter]; `a.accumulate`
/// must be false (the epilogue always adds). Register-tiled, or up to
/// [`Gpu::skinny_max_rows`] rows skinny (`linear_skinny_combine_bf16`, the same bits):
/// callers use it when [`Gpu::tiled_min_rows`] picks the tiled GEMMs.
///
/// `settled`: `a.x` (the shared hidden) was written at least two grids back (the shared
/// SwiGLU merged into the routed gate/up launch, the routed down-projection between), so
/// the kernels run the dot before their grid-dependency wait; false: after it.
pub fn linear_combine(
    g: &Gpu,
    a: &Linear<'_>,
    r: &Routing<'_>,
    y: &DevBuf<f32>,
    settled: bool,
) -> Result<()> {
    r.check()?;
    if a.accumulate || a.y.stride != a.n || a.m != r.t {
        return Err(CudaError::Input(
            "linear_combine: y must be the [T, H] residual, rows = routed tokens, no accumulate (internal)".into(),
        ));
    }
    launch::check_gemm_operands(
        a.k,
        a.x.stride,
        a.x.off % a.x.stride.max(1),
        "linear_combine",
    )?;
    let args = [
        a.y.arg(a.m, a.n, "combine x")?,
        ptr(y, 0, r.t * r.k * a.n, "combine y")?,
        ptr(r.ids, 0, r.t * r.k, "combine ids")?,
        int(r.k, "k")?,
        a.x.arg(a.m, a.k, "combine h")?,
        int(a.x.stride, "h stride")?,
        ptr(a.w, 0, a.n * a.k, "combine Wd")?,
        int(a.m, "M")?,
        int(a.n, "N")?,
        int(a.k, "K")?,
        Arg::I(i32::from(settled && g.combine_pre)),
    ];
    let (name, shape) = skinny_or_tiled(
        g,
        a.m,
        a.n,
        ["linear_tiled_combine_bf16", "linear_skinny_combine_bf16"],
    )?;
    // SAFETY: x [T, H] (stride H), y [T*k, H], ids [T*k], h spans (T-1)*stride + K, Wd
    // [H, K], all checked; k <= 8 (`r.check`: the kernels' slot arrays); both kernels read
    // and write only those (K % 8 == 0 and 16-byte alignment checked).
    unsafe { launch(g, name, shape, &args) }
}

/// Kernel `moe_combine`: `x += routed (ascending expert) + shared`.
pub fn moe_combine(
    g: &Gpu,
    r: &Routing<'_>,
    x: &DevBuf<f32>,
    y: &DevBuf<f32>,
    shared: &DevBuf<f32>,
    hd: usize,
) -> Result<()> {
    r.check()?;
    let args = [
        ptr(x, 0, r.t * hd, "combine x")?,
        ptr(y, 0, r.t * r.k * hd, "combine y")?,
        ptr(shared, 0, r.t * hd, "combine shared")?,
        ptr(r.ids, 0, r.t * r.k, "combine ids")?,
        int(r.t, "T")?,
        int(hd, "H")?,
        int(r.k, "k")?,
    ];
    // SAFETY: x, shared [T, H], y [T*k, H], ids [T*k] checked; k <= 8 (shared order array).
    unsafe {
        launch(
            g,
            "moe_combine",
            launch::per_row(r.t, 128, "moe_combine")?,
            &args,
        )
    }
}

/// The paged KV pool and the step's attention metadata.
pub struct Paged<'a> {
    /// Shape: [num_blocks * fpb] f32.
    pub pool: &'a DevBuf<f32>,
    pub fpb: usize,
    /// Float offset of this layer's page inside a block.
    pub layer_off: usize,
    pub block_size: usize,
    /// Meta sections: pos [T], tok_seq [T], block_tables [S, max_blocks].
    pub pos: Arg,
    pub tok_seq: Arg,
    pub tables: Arg,
    pub max_blocks: usize,
    /// Meta sections row0, len [S] (the prefill kernel's tiles).
    pub row0: Arg,
    pub len: Arg,
    pub num_seqs: usize,
    /// The longest chunk's tokens (host copy).
    pub max_len: usize,
}

/// Longest chunk of a step whose attention runs `paged_attention` (a row a block); a step
/// with a longer chunk (prefill) runs `prefill_attention` (16 rows a block, each K/V
/// position loaded once a tile) unless `SPECLAB_ATT_TILED=0` ([`Gpu::att_tiled`]).
pub const ATT_TILED_MIN_LEN: usize = crate::backend::GRAPH_MAX_CHUNK + 1;

/// Full attention of one layer on `qkv [T, (nh + 2 nkv) d]` into `o [T, nh d]`.
pub struct Attention<'a> {
    pub qkv: &'a DevBuf<f32>,
    pub o: &'a DevBuf<f32>,
    pub cos: &'a DevBuf<f32>,
    pub sin: &'a DevBuf<f32>,
    /// Rows of the RoPE tables (max_position_embeddings).
    pub max_pos: usize,
    pub t: usize,
    pub nh: usize,
    pub nkv: usize,
    pub d: usize,
}

/// Kernels `rope_kv_write` then `paged_attention`, or `prefill_attention` for a step with
/// a chunk of at least [`ATT_TILED_MIN_LEN`] tokens.
pub fn attention(g: &Gpu, kv: &Paged<'_>, a: &Attention<'_>) -> Result<()> {
    let (nh, nkv, d) = (a.nh, a.nkv, a.d);
    if d % 32 != 0 || d > launch::HEAD_DIM_MAX || nkv == 0 || nh % nkv != 0 {
        return Err(CudaError::Unsupported(format!(
            "attention nh {nh}, nkv {nkv}, d {d} (needs d % 32 == 0, d <= 128, nkv | nh)"
        )));
    }
    let w = (nh + 2 * nkv) * d;
    let qkv = ptr(a.qkv, 0, a.t * w, "qkv")?;
    let pool = ptr(kv.pool, 0, kv.pool.len, "kv pool")?;
    if kv.layer_off + 2 * kv.block_size * nkv * d > kv.fpb {
        return Err(CudaError::Input(
            "attention page outside the block (internal)".into(),
        ));
    }
    let args = [
        qkv,
        int(w, "qkv stride")?,
        ptr(a.cos, 0, a.max_pos * d, "rope cos")?,
        ptr(a.sin, 0, a.max_pos * d, "rope sin")?,
        kv.pos,
        kv.tok_seq,
        kv.tables,
        int(kv.max_blocks, "max_blocks")?,
        pool,
        long(kv.layer_off),
        long(kv.fpb),
        int(kv.block_size, "block size")?,
        int(nh, "nh")?,
        int(nkv, "nkv")?,
        int(d, "d")?,
        int(a.t, "T")?,
    ];
    // SAFETY: qkv [T, W], rope tables [max_pos, d], the whole pool checked; positions
    // < max_position_embeddings and every block of positions 0..=pos real and < num_blocks
    // (meta::build), so each K/V write lands in block b's page of this layer, which lies
    // inside the block (layer_off + page <= fpb checked above).
    unsafe {
        launch(
            g,
            "rope_kv_write",
            launch::per_row(a.t, 128, "rope")?,
            &args,
        )?
    };
    let mut args = att_args(kv, a, [qkv, pool], w)?;
    if g.att_tiled && kv.max_len >= ATT_TILED_MIN_LEN {
        return prefill_attention(g, kv, a, args);
    }
    args.extend([
        kv.tok_seq,
        int(nh, "nh")?,
        int(nkv, "nkv")?,
        int(d, "d")?,
        Arg::F((d as f64).powf(-0.5) as f32),
        int(a.t, "T")?,
    ]);
    // SAFETY: o [T, nh d], qkv, pool checked as above; reads positions 0..=pos of the
    // token's own table (meta-validated); d <= 128 (shared accumulators).
    let shape = launch::Shape {
        grid: (int_u32(a.t)?, int_u32(nh)?, 1),
        // 32 * ATT_WARPS (attention.cu).
        block: (512, 1, 1),
        smem: 0,
    };
    unsafe { launch(g, "paged_attention", shape, &args) }
}

/// The leading arguments `paged_attention` and `prefill_attention` share: o, qkv and its
/// stride, the pool, the layer's page offset, floats a block, block size, the block tables
/// and their width, positions.
fn att_args(
    kv: &Paged<'_>,
    a: &Attention<'_>,
    [qkv, pool]: [Arg; 2],
    w: usize,
) -> Result<Vec<Arg>> {
    Ok(vec![
        ptr(a.o, 0, a.t * a.nh * a.d, "attn o")?,
        qkv,
        int(w, "qkv stride")?,
        pool,
        long(kv.layer_off),
        long(kv.fpb),
        int(kv.block_size, "block size")?,
        kv.tables,
        int(kv.max_blocks, "max_blocks")?,
        kv.pos,
    ])
}

/// Kernel `prefill_attention` for [`attention`] (its checks done, `rope_kv_write` launched,
/// `args` from [`att_args`]): tiles of 16 query rows of a chunk per block.
fn prefill_attention(g: &Gpu, kv: &Paged<'_>, a: &Attention<'_>, mut args: Vec<Arg>) -> Result<()> {
    let (nh, d) = (a.nh, a.d);
    if kv.max_len > a.t {
        return Err(CudaError::Input(format!(
            "prefill attention: a chunk of {} tokens in a step of {} (internal)",
            kv.max_len, a.t
        )));
    }
    args.extend([
        kv.row0,
        kv.len,
        int(nh, "nh")?,
        int(a.nkv, "nkv")?,
        int(d, "d")?,
        Arg::F((d as f64).powf(-0.5) as f32),
    ]);
    // 32 * ATT_QB threads (attention.cu).
    let shape = grid3([kv.max_len.div_ceil(16), kv.num_seqs, nh], 512)?;
    // SAFETY: as paged_attention's (o [T, nh d], qkv [T, W], the pool checked; positions
    // 0..=pos of chunk s read through its own table row s, meta-validated; d <= 128 for the
    // shared tiles); chunk rows row0 + len <= T from meta::build.
    unsafe { launch(g, "prefill_attention", shape, &args) }
}

/// A launch of grid `[x, y, z]` with `block` threads and no dynamic shared memory.
fn grid3([x, y, z]: [usize; 3], block: u32) -> Result<launch::Shape> {
    Ok(launch::Shape {
        grid: (int_u32(x)?, int_u32(y)?, int_u32(z)?),
        block: (block, 1, 1),
        smem: 0,
    })
}

fn int_u32(v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| CudaError::Unsupported(format!("grid dimension {v}")))
}

/// The KDA state pool and the step's chunk metadata.
pub struct StatePages<'a> {
    pub pool: &'a DevBuf<f32>,
    pub fpb: usize,
    /// Float offset of this KDA layer's page inside a block.
    pub layer_off: usize,
    /// Floats of the conv part of a page: 3 (kc - 1) C.
    pub conv_len: usize,
    /// Meta sections: row0, len, pos0, snap [S], state_tables [S, max_state].
    pub row0: Arg,
    pub len: Arg,
    pub pos0: Arg,
    pub snap: Arg,
    pub tables: Arg,
    pub max_state: usize,
    pub num_seqs: usize,
    /// The longest chunk's tokens (host copy of the metadata).
    pub max_len: usize,
    /// Whether any chunk takes state snapshots (host copy).
    pub snapshots: bool,
}

/// The buffers of one KDA layer's core (after the input projections).
pub struct Kda<'a> {
    /// Shape: [T, in_width] stacked projections (pre-conv q|k|v at 0, b at `b_col`).
    pub xin: &'a DevBuf<f32>,
    pub in_width: usize,
    pub b_col: usize,
    /// Shape: [T, 3C] post-conv.
    pub y: &'a DevBuf<f32>,
    /// Shape: [T, 2C]: f then g.
    pub fg: &'a DevBuf<f32>,
    /// Shape: [T, C] recurrence output.
    pub o: &'a DevBuf<f32>,
    /// Shape: [T, C] gated-norm output.
    pub out: &'a DevBuf<f32>,
    /// The chunked prefill's workspace (`Workspace::kda_chunk`).
    pub ck: &'a DevBuf<f32>,
    pub taps: &'a DevBuf<f32>,
    pub a_log: &'a DevBuf<f32>,
    pub dt_bias: &'a DevBuf<f32>,
    pub o_norm: &'a DevBuf<f32>,
    pub t: usize,
    pub nl: usize,
    pub dl: usize,
    pub kc: usize,
    pub eps: f32,
    /// The f / g up-projections done by the fused or pair kernels (`Wf`, `Wg` [C, dl] bf16
    /// and the xin column of f's low-rank input, g's following it): only where
    /// [`kda_path`] is not `Split`; `None`: `fg` holds them already (`linear_pair`).
    pub lowrank: Option<(&'a DevBuf<u16>, &'a DevBuf<u16>, usize)>,
}

/// Whether [`kda`] takes the one fused kernel for `t` rows in `num_seqs` chunks.
pub fn kda_fuses(g: &Gpu, t: usize, num_seqs: usize) -> bool {
    g.fuse_kda && t <= g.kda_fused_rows * num_seqs
}

/// Mean rows a chunk up to which [`kda`] runs a multi-row chunk in two launches (the verify
/// pair, `kda_conv_lowrank_{dl}` + `kda_recurrent_norm_{dl}`): verify steps of up to 15
/// drafts; prefill keeps the separate kernels, whose gated norm runs over all tokens at once.
pub const KDA_PAIR_MEAN_ROWS: usize = 16;

/// How [`kda`] runs a step's KDA layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KdaPath {
    /// One kernel (`kda_fused_{dl}`, decode).
    Fused,
    /// Two kernels (verify; [`Gpu::kda_pair`]).
    Pair,
    /// `kda_conv`, `kda_recurrent_{dl}`, `kda_gate_norm` (after `linear_pair`).
    Split,
}

/// The [`KdaPath`] of `t` rows in `num_seqs` chunks.
pub fn kda_path(g: &Gpu, t: usize, num_seqs: usize) -> KdaPath {
    if kda_fuses(g, t, num_seqs) {
        KdaPath::Fused
    } else if g.kda_pair && t <= KDA_PAIR_MEAN_ROWS * num_seqs {
        KdaPath::Pair
    } else {
        KdaPath::Split
    }
}

/// Mean rows a chunk up to which [`kda`] takes the fused kernel: one, decode steps only.
/// In multi-row verify chunks it is slower: the conv, the f / g up-projections and the
/// gated norm run inside its sequential token loop, where the separate kernels spread them
/// over the GPU. DFlash2 N = 7 verify at c1 took 406.3 us a step fused against 353.6 us
/// with this bound (runs/ab-3f7d51f/, `SPECLAB_KDA_FUSED_ROWS=16` against 1); with the
/// gated norm after the loop it was slower too (runs/ab-59303f3/). `SPECLAB_KDA_FUSED_ROWS=n`
/// sets another bound ([`Gpu::kda_fused_rows`]).
pub const KDA_FUSED_MEAN_ROWS: usize = 1;

/// Kernels `kda_conv`, `kda_recurrent_{dl}`, `kda_gate_norm`, or with
/// [`Gpu::fuse_kda`] and chunks of at most [`KDA_FUSED_MEAN_ROWS`] row on average the one
/// kernel `kda_fused_{dl}` doing all three (`a.y` unused).
pub fn kda(g: &Gpu, s: &StatePages<'_>, a: &Kda<'_>) -> Result<()> {
    let (c, dl, nl, t) = (a.nl * a.dl, a.dl, a.nl, a.t);
    if !(2..=launch::KC_MAX).contains(&a.kc) || ![32, 64, 128].contains(&dl) {
        return Err(CudaError::Unsupported(format!(
            "KDA with kc {} and head dim {dl} (kernels: 2 <= kc <= 8, dl in 32/64/128)",
            a.kc
        )));
    }
    if s.layer_off + s.conv_len + nl * dl * dl > s.fpb
        || a.b_col + nl > a.in_width
        || a.in_width < 3 * c
    {
        return Err(CudaError::Input(
            "KDA page or projection layout out of range (internal)".into(),
        ));
    }
    let pool = ptr(s.pool, 0, s.pool.len, "state pool")?;
    let xin = ptr(a.xin, 0, t * a.in_width, "kda xin")?;
    let y = ptr(a.y, 0, t * 3 * c, "kda y")?;
    let fg = ptr(a.fg, 0, t * 2 * c, "kda fg")?;
    let meta = [
        s.row0,
        s.len,
        s.pos0,
        s.snap,
        s.tables,
        int(s.max_state, "max_state")?,
    ];
    // Fused for one-row (decode) chunks only (KDA_FUSED_MEAN_ROWS); verify chunks in two
    // launches (KDA_PAIR_MEAN_ROWS); prefill in the separate kernels.
    match kda_path(g, t, s.num_seqs) {
        KdaPath::Fused => return kda_fused(g, s, a, [pool, xin, fg], meta),
        KdaPath::Pair => return kda_pair(g, s, a, [pool, xin, y, fg], meta),
        KdaPath::Split => {}
    }
    if a.lowrank.is_some() {
        return Err(CudaError::Input(
            "kda: the f / g up-projections ride only on the fused and pair kernels (internal)"
                .into(),
        ));
    }
    if g.kda_chunked && !s.snapshots {
        kda_chunked(g, s, a, [pool, xin, fg], meta)?;
        return kda_gate_norm(g, a);
    }
    let args = conv_args(s, a, [y, xin, pool], meta)?;
    // SAFETY: y [T, 3C], xin [T, in_width >= 3C], taps [3C, kc], the pool checked; chunk
    // rows row0 + len <= T and state blocks real and < num_blocks (meta::build); conv
    // elements lie in the first conv_len floats of this layer's page (inside the block).
    unsafe {
        launch(
            g,
            "kda_conv",
            launch::grid_2d((3 * c).div_ceil(128), s.num_seqs, 128, "kda_conv")?,
            &args,
        )?
    };
    let name = format!("kda_recurrent_{dl}");
    let o = ptr(a.o, 0, t * c, "kda o")?;
    let (mut args, shape) = recurrent_args(s, a, vec![o, y], [fg, xin, pool], meta)?;
    args.push(Arg::I(i32::from(g.kda_pre)));
    // SAFETY: o [T, C], y, fg [T, 2C], xin (b at b_col + nl <= in_width), A_log [nl],
    // dt_bias [C], pool checked; S elements of head h lie at conv_len + h dl^2 + i dl + j
    // < conv_len + nl dl^2 (inside the page, checked above); block = dl threads.
    unsafe { launch(g, &name, shape, &args)? };
    kda_gate_norm(g, a)
}

/// Kernel `kda_gate_norm` over `a.o` (the recurrence's output) into `a.out`.
fn kda_gate_norm(g: &Gpu, a: &Kda<'_>) -> Result<()> {
    let (c, dl, nl, t) = (a.nl * a.dl, a.dl, a.nl, a.t);
    let args = [
        ptr(a.out, 0, t * c, "kda out")?,
        ptr(a.o, 0, t * c, "kda o")?,
        ptr(a.fg, 0, t * 2 * c, "kda fg")?,
        ptr(a.o_norm, 0, dl, "o_norm")?,
        int(t, "T")?,
        int(nl, "nl")?,
        int(dl, "dl")?,
        Arg::F(a.eps),
    ];
    // SAFETY: out, o [T, C], fg [T, 2C], o_norm [dl] checked.
    unsafe {
        launch(
            g,
            "kda_gate_norm",
            launch::per_warp(t * nl, "kda_gate_norm")?,
            &args,
        )
    }
}

/// The chunked prefill for [`kda`] (its checks done; no chunk takes snapshots):
/// `kda_chunk_prep_{dl}` (the conv, norms, gates and each chunk's solve, every chunk at
/// once) then `kda_chunk_scan_{dl}` (each span's chunks in order) into `a.o`
/// ([`crate::kda_chunk`]).
fn kda_chunked(
    g: &Gpu,
    s: &StatePages<'_>,
    a: &Kda<'_>,
    [pool, xin, fg]: [Arg; 3],
    meta: [Arg; 6],
) -> Result<()> {
    use crate::kda_chunk::{chunk_floats, chunk_len, slot_count};
    let (c, dl, nl, t) = (a.nl * a.dl, a.dl, a.nl, a.t);
    let ck_len = slot_count(t, s.num_seqs, dl) * nl * chunk_floats(dl);
    if s.max_len == 0 || s.max_len > t || ck_len > a.ck.len {
        return Err(CudaError::Input(format!(
            "kda chunked: {} tokens, longest chunk {}, {ck_len} workspace floats of {} (internal)",
            t, s.max_len, a.ck.len
        )));
    }
    let ck = ptr(a.ck, 0, ck_len, "kda chunk workspace")?;
    let [row0, len, pos0, _snap, tables, max_state] = meta;
    let args = [
        ck,
        xin,
        int(a.in_width, "xin stride")?,
        int(a.b_col, "b col")?,
        fg,
        ptr(a.taps, 0, 3 * c * a.kc, "taps")?,
        int(a.kc, "kc")?,
        ptr(a.a_log, 0, nl, "A_log")?,
        ptr(a.dt_bias, 0, c, "dt_bias")?,
        pool,
        long(s.layer_off),
        long(s.fpb),
        int(nl, "nl")?,
        Arg::F((dl as f64).powf(-0.5) as f32),
        row0,
        len,
        pos0,
        tables,
        max_state,
    ];
    let shape = grid3([s.max_len.div_ceil(chunk_len(dl)), s.num_seqs, nl], 256)?;
    // SAFETY: ck holds slot_count(T, S) slots of nl * chunk_floats(dl) (checked above;
    // kda_chunk's slot invariant keeps every chunk's slot below it); xin [T, in_width >=
    // 3C] with b at b_col + nl <= in_width, fg [T, 2C], taps [3C, kc] (2 <= kc <= 8),
    // A_log [nl], dt_bias [C] and the pool checked in `kda`; chunk rows row0 + len <= T
    // and state blocks from meta::build; conv elements inside the page's first conv_len
    // floats.
    unsafe { launch(g, &format!("kda_chunk_prep_{dl}"), shape, &args)? };
    let args = [
        ptr(a.o, 0, t * c, "kda o")?,
        ck,
        pool,
        long(s.layer_off),
        long(s.fpb),
        int(s.conv_len, "conv_len")?,
        int(nl, "nl")?,
        row0,
        len,
        pos0,
        tables,
        max_state,
    ];
    let shape = grid3([nl, s.num_seqs, dl / crate::kda_chunk::SCAN_COLUMNS], 256)?;
    // SAFETY: o [T, C] checked, ck as above (written by the prep launch before it); S
    // elements of head h at conv_len + h dl^2 + i dl + j < conv_len + nl dl^2 (inside the
    // page, checked in `kda`); dl in 32 / 64 / 128 so dl / SCAN_COLUMNS column groups of
    // SCAN_COLUMNS (kda.cu KDA_SCAN_JB).
    unsafe { launch(g, &format!("kda_chunk_scan_{dl}"), shape, &args) }
}

/// The arguments `kda_recurrent_{dl}`, `kda_fused_{dl}` and `kda_recurrent_norm_{dl}`
/// share, from their leading pointers (`o, y` / `out` / `out, y`) to the chunk
/// metadata, and their launch shape: grid (nl, S), block dl.
fn recurrent_args(
    s: &StatePages<'_>,
    a: &Kda<'_>,
    lead: Vec<Arg>,
    [fg, xin, pool]: [Arg; 3],
    meta: [Arg; 6],
) -> Result<(Vec<Arg>, launch::Shape)> {
    let (c, dl, nl) = (a.nl * a.dl, a.dl, a.nl);
    let mut args = lead;
    args.extend([
        fg,
        xin,
        int(a.in_width, "xin stride")?,
        int(a.b_col, "b col")?,
        ptr(a.a_log, 0, nl, "A_log")?,
        ptr(a.dt_bias, 0, c, "dt_bias")?,
        pool,
        long(s.layer_off),
        long(s.fpb),
        int(s.conv_len, "conv_len")?,
        int(nl, "nl")?,
        Arg::F((dl as f64).powf(-0.5) as f32),
    ]);
    args.extend(meta);
    let shape = launch::Shape {
        grid: (int_u32(nl)?, int_u32(s.num_seqs)?, 1),
        block: (int_u32(dl)?, 1, 1),
        smem: 0,
    };
    Ok((args, shape))
}

/// Kernel `kda_fused_{dl}` for [`kda`] (its checks done): `[pool, xin, fg]` and the
/// chunk metadata as `kda` built them.
fn kda_fused(
    g: &Gpu,
    s: &StatePages<'_>,
    a: &Kda<'_>,
    [pool, xin, fg]: [Arg; 3],
    meta: [Arg; 6],
) -> Result<()> {
    let (c, dl, t) = (a.nl * a.dl, a.dl, a.t);
    let out = ptr(a.out, 0, t * c, "kda out")?;
    let (mut args, shape) = recurrent_args(s, a, vec![out], [fg, xin, pool], meta)?;
    args.extend([
        ptr(a.taps, 0, 3 * c * a.kc, "taps")?,
        int(a.kc, "kc")?,
        ptr(a.o_norm, 0, dl, "o_norm")?,
        Arg::F(a.eps),
    ]);
    args.extend(lowrank_args(a)?.unwrap_or([Arg::P(0), Arg::P(0), Arg::I(0)]));
    args.push(Arg::I(i32::from(g.kda_pre)));
    let name = format!("kda_fused_{dl}");
    // SAFETY: the union of the three kernels' operands but o (not used), each checked as
    // in `kda`: out [T, C], fg [T, 2C], xin [T, in_width >= 3C] (b at b_col + nl <= in_width), A_log
    // [nl], dt_bias [C], taps [3C, kc] (2 <= kc <= 8), o_norm [dl], the pool, with the
    // low-rank GEMMs Wf / Wg [C, dl] and xin columns fcol .. fcol + 2 dl (checked above:
    // thread j of head h reads row h dl + j, 16-byte aligned as dl % 32 == 0); chunk rows
    // and state blocks from meta::build; conv elements inside the first conv_len floats of
    // the layer's page and S elements below conv_len + nl dl^2 (checked in `kda`).
    unsafe { launch(g, &name, shape, &args) }
}

/// The checked `Wf`, `Wg`, f column arguments of [`Kda::lowrank`], or `None` without it.
fn lowrank_args(a: &Kda<'_>) -> Result<Option<[Arg; 3]>> {
    let (c, dl) = (a.nl * a.dl, a.dl);
    match a.lowrank {
        Some((wf, wg, fcol)) if fcol + 2 * dl <= a.in_width => Ok(Some([
            ptr(wf, 0, c * dl, "kda Wf")?,
            ptr(wg, 0, c * dl, "kda Wg")?,
            int(fcol, "f col")?,
        ])),
        Some(_) => Err(CudaError::Input(
            "kda: low-rank inputs past the projection width (internal)".into(),
        )),
        None => Ok(None),
    }
}

/// `kda_conv`'s arguments (which `kda_conv_lowrank_{dl}` begins with): y, xin, its stride,
/// taps, the pool, the layer's page offset, floats a block, C, kc, the chunk metadata.
fn conv_args(
    s: &StatePages<'_>,
    a: &Kda<'_>,
    [y, xin, pool]: [Arg; 3],
    meta: [Arg; 6],
) -> Result<Vec<Arg>> {
    let c = a.nl * a.dl;
    let mut args = vec![
        y,
        xin,
        int(a.in_width, "xin stride")?,
        ptr(a.taps, 0, 3 * c * a.kc, "taps")?,
        pool,
        long(s.layer_off),
        long(s.fpb),
        int(c, "C")?,
        int(a.kc, "kc")?,
    ];
    args.extend(meta);
    Ok(args)
}

/// The verify pair for [`kda`] (its checks done): `kda_conv_lowrank_{dl}` (the conv, and the
/// f / g up-projections when `a.lowrank`; else `kda_conv` after the caller's `linear_pair`),
/// then `kda_recurrent_norm_{dl}` (the recurrence with the gated norm in its token loop).
fn kda_pair(
    g: &Gpu,
    s: &StatePages<'_>,
    a: &Kda<'_>,
    [pool, xin, y, fg]: [Arg; 4],
    meta: [Arg; 6],
) -> Result<()> {
    let (c, dl, t) = (a.nl * a.dl, a.dl, a.t);
    let conv_gx = (3 * c).div_ceil(256);
    let conv_blocks = conv_gx * s.num_seqs;
    let mut args = conv_args(s, a, [y, xin, pool], meta)?;
    let (name, shape) = match lowrank_args(a)? {
        Some(lr) => {
            args.extend([
                int(conv_gx, "conv grid x")?,
                int(conv_blocks, "conv blocks")?,
                fg,
            ]);
            args.extend(lr);
            let shape = launch::grid_2d(conv_blocks + 2 * t, 1, 256, "kda_conv_lowrank")?;
            (format!("kda_conv_lowrank_{dl}"), shape)
        }
        None => (
            "kda_conv".to_string(),
            launch::grid_2d(conv_gx, s.num_seqs, 256, "kda_conv")?,
        ),
    };
    // SAFETY: as kda_conv in `kda` (y [T, 3C], xin, taps, the pool, chunk metadata; blocks
    // cover the 3C channels of every chunk at 256 threads); with the low-rank GEMMs, blocks
    // past the conv's write row it / 2's f or g half of fg [T, 2C] from xin columns
    // fcol .. fcol + 2 dl <= in_width and Wf / Wg [C, dl] (checked above).
    unsafe { launch(g, &name, shape, &args)? };
    let (mut args, shape) = recurrent_args(
        s,
        a,
        vec![ptr(a.out, 0, t * c, "kda out")?, y],
        [fg, xin, pool],
        meta,
    )?;
    args.extend([
        ptr(a.o_norm, 0, dl, "o_norm")?,
        Arg::F(a.eps),
        Arg::I(i32::from(g.kda_pre)),
    ]);
    let name = format!("kda_recurrent_norm_{dl}");
    // SAFETY: as kda_recurrent_{dl} in `kda`, with out [T, C] and o_norm [dl] in place of
    // o (the gated norm written per token, kda_gate_norm's operands).
    unsafe { launch(g, &name, shape, &args) }
}

/// Kernel `copy_f32` on 4-byte words of any type (e.g. i32 expert ids): `n` words.
pub fn copy_words<A: cudarc::driver::DeviceRepr, B: cudarc::driver::DeviceRepr>(
    g: &Gpu,
    dst: &DevBuf<A>,
    d_off: usize,
    src: &DevBuf<B>,
    s_off: usize,
    n: usize,
) -> Result<()> {
    if std::mem::size_of::<A>() != 4 || std::mem::size_of::<B>() != 4 {
        return Err(CudaError::Input(
            "copy_words on non-4-byte elements (internal)".into(),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let args = [
        ptr(dst, d_off, n, "copy dst")?,
        ptr(src, s_off, n, "copy src")?,
        long(n),
    ];
    // SAFETY: both regions of n 4-byte words checked; the kernel moves bits only.
    unsafe {
        launch(
            g,
            "copy_f32",
            launch::grid_2d(n.div_ceil(256), 1, 256, "copy")?,
            &args,
        )
    }
}

/// Kernel `sample_verify`'s operands (cuda/kernels/sample.cu, [`crate::sample`]).
pub struct SampleVerify<'a> {
    /// Shape: [4 chunks] i32.
    pub out: &'a DevBuf<i32>,
    /// Scratch. Shape: [chunks, V] f64.
    pub probs: &'a DevBuf<f64>,
    /// The last target step's logits. Shape: [logit_rows, V].
    pub logits: &'a DevBuf<f32>,
    pub logit_rows: usize,
    /// `sample::META` ints a chunk, then the drafts. Shape: [META chunks + drafts] i32.
    pub meta: &'a DevBuf<i32>,
    pub chunks: usize,
    pub drafts: usize,
    /// Shape: [>= the packed uniforms] f64.
    pub uniforms: &'a DevBuf<f64>,
    /// Packed q rows (dense V a row, sparse kq a row; at least 1 element).
    pub q: &'a DevBuf<f32>,
    /// Sparse q rows' token ids (at least 1 element).
    pub qid: &'a DevBuf<i32>,
    pub vocab: usize,
    pub params: speclab_engine::spec::SamplingParams,
    /// Keys sorted for top-k / top-p (0: none; else a power of two <= `sample::SORT_CAP`).
    pub sort_n: usize,
}

/// Kernel `sample_verify`: one block a chunk.
pub fn sample_verify(g: &Gpu, s: &SampleVerify<'_>) -> Result<()> {
    let c = s.chunks;
    let bad_sort = s.sort_n > 0
        && (s.sort_n < s.vocab
            || s.sort_n < crate::sample::SAMPLE_THREADS as usize
            || !s.sort_n.is_power_of_two());
    if s.sort_n > crate::sample::SORT_CAP || bad_sort {
        return Err(CudaError::Input(format!(
            "sample_verify: {} sort keys for vocab {} (internal)",
            s.sort_n, s.vocab
        )));
    }
    let args = [
        ptr(s.out, 0, 4 * c, "sampler out")?,
        ptr(s.probs, 0, c * s.vocab, "sampler probs")?,
        ptr(s.logits, 0, s.logit_rows * s.vocab, "sampler logits")?,
        ptr(s.meta, 0, crate::sample::META * c, "sampler meta")?,
        ptr(s.meta, crate::sample::META * c, s.drafts, "sampler drafts")?,
        ptr(s.q, 0, s.q.len, "sampler q")?,
        ptr(s.qid, 0, s.qid.len, "sampler q ids")?,
        ptr(s.uniforms, 0, s.uniforms.len, "sampler uniforms")?,
        int(s.vocab, "V")?,
        Arg::F(s.params.temperature),
        int(s.params.top_k, "top_k")?,
        Arg::F(s.params.top_p),
        int(s.sort_n, "sort keys")?,
    ];
    let mut shape = launch::grid_2d(c, 1, crate::sample::SAMPLE_THREADS, "sample_verify")?;
    shape.smem = (s.sort_n * 8) as u32;
    // SAFETY: out [4 C], probs [C, V], logits [logit_rows, V] checked; the meta rows were
    // built by sample::pack from chunks sample::device_ok accepted (row + k < logit_rows,
    // drafts < V, q rows of V entries or kq <= SAMPLE_THREADS (id, p) pairs with ids < V at
    // their offsets, k + 1 uniforms at theirs), and
    // the shared keys fit the kernel's opt-in (sort_n <= SORT_CAP).
    unsafe { launch(g, "sample_verify", shape, &args) }
}
