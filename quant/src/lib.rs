//! speclab-quant: W4A16 (INT4 weights, 16-bit activations) quantization for speclab.
//!
//! What: the compressed-tensors `pack-quantized` format (symmetric INT4, group 128) of
//! speclab's routed experts ([`w4a16`]), round-to-nearest ([`rtn`]), GPTQ with
//! reconstruction-error metrics ([`gptq`]), checkpoint writing/reading with the
//! `quantization_config` ignore-list semantics ([`checkpoint`]), and the sequential
//! per-layer quantize pipeline ([`pipeline`]). What the engine also needs has its one
//! implementation in `speclab_engine::model` and is used from there: INT4 pack / unpack,
//! dequantization and RTN (`w4a16`), `QuantizationConfig` / `IgnoreList` (`config`), the
//! safetensors reader and writer (`checkpoint`).
//!
//! Source: `docs/model.md` §8 (the format contract), Frantar et al. 2022 (GPTQ),
//! compressed-tensors 0.17 (`pack_to_int32`, `QuantizationConfig`), `recipes/gptq_ref.py`
//! (the executable GPTQ reference behind `tests/fixtures/quant/gptq_golden.safetensors`).
//!
//! Invariants: one error type ([`QuantError`], engine errors convert into it); no panics on
//! user input; weights are
//! `[N, K]` row-major (`out_features`, `in_features`) with `K % 128 == 0`.

pub mod checkpoint;
pub mod error;
pub mod gptq;
mod linalg;
pub mod pipeline;
pub mod rtn;
pub mod w4a16;

pub use checkpoint::{
    is_quantized, read_config, read_safetensors_dir, read_w4a16, write_pack_quantized, Dtype,
    IgnoreList, QuantizationConfig, TensorData, WriteOptions, WriteReport,
};
pub use error::{QuantError, Result};
pub use gptq::{gptq_quantize, reconstruction_error, GptqConfig, GptqOutput, Hessian, ReconError};
pub use rtn::quantize_rtn;
pub use w4a16::{dequantize, pack_int4, scale_from_amax, unpack_int4, W4A16Tensor, GROUP_SIZE};
