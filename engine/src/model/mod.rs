//! The target model in real mode: speclab's twin of `Glm5NextForConditionalGeneration`.
//!
//! Contract: docs/model.md (every formula, tensor name, shape, dtype and numerics rule);
//! reference `recipes/model.py`; fixtures `tests/fixtures/model/` (`recipes/make_fixture.py`).
//! CPU, f32 compute exactly per §1: bf16 weights upcast exactly, hidden states and
//! caches never rounded, W4A16 routed experts dequantized to exact f32 products.
//!
//! Modules: [`config`] (config.json, presets, KV layout), [`checkpoint`] (safetensors
//! via mmap, sharding, typed checked getters, writing), [`weights`] (tensor inventory,
//! loading with quantization cross-checks, export, seeded random init), [`linear`]
//! (dense f32 GEMM and the W4A16 kernel), [`w4a16`] (the INT4 pack-quantized format:
//! pack / unpack, dequantization, RTN, the checkpoint form of a quantized weight), [`attention`] / [`kda`] / [`moe`] / [`mtp`]
//! (the blocks), [`kv_store`] (host KV memory addressed by the KV manager's block ids),
//! [`forward`] ([`ModelRunner`]: forward, snapshot / commit of KDA state), [`tokenizer`].
//!
//! Invariants: one error type ([`crate::EngineError`]); no panics on user input (files,
//! configs, token ids, batches); KV memory is only ever addressed through block tables
//! of a [`crate::kv::KvCacheManager`].

pub mod attention;
pub mod checkpoint;
pub mod config;
pub mod forward;
pub mod kda;
pub mod kv_store;
pub mod linear;
pub mod moe;
pub mod mtp;
pub mod ops;
pub mod tokenizer;
pub mod w4a16;
pub mod weights;

pub use checkpoint::{Checkpoint, NamedTensor, TensorDtype};
pub use config::{LayerKind, ModelConfig, QuantizationConfig};
pub use forward::{ForwardOptions, ForwardOut, LogitsRows, ModelRunner, SeqChunk};
pub use kv_store::KvStore;
pub use linear::Linear;
pub use moe::{ExpertInput, ExpertObserver, RouterTrace};
pub use mtp::{MtpChunk, MtpOut};
pub use tokenizer::Tokenizer;
pub use weights::ModelWeights;
