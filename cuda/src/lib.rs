//! speclab-cuda: the target model of docs/model.md on an NVIDIA GPU, through cudarc + NVRTC.
//!
//! Design: shared/DESIGN.md "The GPU engine" and issue 11. Kernels are `.cu` sources
//! under `cuda/kernels/`, compiled at run time by NVRTC ([`kernels`]) and cached on
//! disk; cudarc is loaded dynamically, so this crate builds and its host tests run on a
//! machine with no CUDA at all. [`backend::CudaBackend`] implements the backend seam of
//! the CPU `ModelRunner` (forward / mtp_forward / commit_state / release) over the same
//! `KvCacheManager` block ids, with device pages laid out exactly as
//! `engine/src/model/kv_store.rs` lays out host pages.
//!
//! Modules: [`error`] (the one error type), [`kernels`] (sources, NVRTC, cache),
//! [`device`] (probing for a driver / device without panicking), [`repack`] (the INT4
//! layout of routed experts, pure host code), [`launch`] (launch shapes and workspace
//! sizes, pure), [`meta`] (per-step metadata built on the host), [`weights`] (upload),
//! [`ops`] (one launch wrapper per kernel), [`buf`] (device buffers, checked pointers),
//! [`kvpool`] (the device KV pool geometry), [`workspace`] (step buffers), [`step`]
//! (the kernel sequence of a step), [`backend`] (the public backend), [`check`] (the
//! device check: parity against the CPU engine and decode timing), [`seam`] (the
//! engine's `TargetBackend` / `SharedHead` / `BackendFactory` for the CUDA backend),
//! [`moebench`] (issue 12: one GLM-5.3-Flash MoE layer timed and checked on the device),
//! [`dflash`] / [`dflash_plan`] (the DFlash2 drafter on the device, beside the target),
//! [`gemm_check`] (the register-tiled bf16 GEMMs against the per-column ones, and the
//! router with the fused norm against `rmsnorm` + router, bit for bit), [`sample`] (the
//! device sampler: rejection sampling where the logits are), [`w4trace`] (block traces of
//! the INT4 expert kernels, `W4_TRACE=1`).
//!
//! Invariants: numerics follow docs/model.md §1 (f32 compute; bf16 weights widened
//! exactly; INT4 dequantized to exact f32 products); every launch's bounds are checked
//! on the host before the `unsafe` launch; inside a step the host only uploads the
//! step's metadata, launches, and copies the outputs out once at the end.

pub mod backend;
pub mod buf;
pub mod check;
pub mod device;
pub mod dflash;
pub mod dflash_plan;
pub mod error;
pub mod gemm_check;
pub mod kda_chunk;
pub mod kernels;
pub mod kvpool;
pub mod launch;
pub mod meta;
pub mod moebench;
pub mod mtp;
pub mod mtp_graph;
pub mod ops;
pub mod prefill;
pub mod repack;
pub mod sample;
pub mod seam;
pub mod step;
pub mod w4trace;
pub mod weights;
pub mod workspace;

pub use backend::{CudaBackend, CudaOptions};
pub use dflash::{CudaDFlash2, CudaDrafterSpec};
pub use error::{CudaError, Result};
pub use seam::CudaFactory;
