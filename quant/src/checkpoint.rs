//! compressed-tensors `pack-quantized` checkpoints: writer, reader, `quantization_config`,
//! and the `ignore`-list semantics.
//!
//! What: [`write_pack_quantized`] turns a checkpoint's tensors plus W4A16 weights into
//! `model.safetensors` (or shards `model-0000i-of-0000n.safetensors` +
//! `model.safetensors.index.json` when a maximum shard size is given and one file would
//! exceed it) and `config.json` with `quantization_config`; [`read_safetensors_dir`] /
//! [`read_w4a16`] read them back; [`is_quantized`] / [`IgnoreList`] decide which modules the
//! `ignore` list leaves quantized. The pieces are the engine's (`speclab_engine::model`):
//! the one safetensors writer (`checkpoint::write_tensor_files`, the `safetensors` crate's
//! serializer, [`ShardLimit::FileBytes`]), reader (`Checkpoint`), `quantization_config`
//! parser ([`QuantizationConfig`]) and ignore-list matcher ([`IgnoreList`]); this module
//! adds [`TensorData`] (an owned tensor of any dtype) and the pack-quantized checks.
//!
//! Source: `docs/model.md` §8 (tensor names, dtypes, shapes, the `quantization_config` JSON,
//! the ignore rule), checked against compressed-tensors 0.17 (`QuantizationConfig.model_dump()`
//! as `ModelCompressor.update_config` writes it; `utils/match.py`: an entry matches if it
//! equals the name, or starts with `re:` and `re.match(rest, name)` succeeds — anchored at the
//! start only). Sharding follows Hugging Face's `save_pretrained` naming and index layout
//! (`{"metadata": {"total_size": ...}, "weight_map": {...}}`, `total_size` = tensor bytes).
//!
//! Invariants:
//! - each quantized module `M` replaces `M.weight` (which must exist, 2-D, same `[N, K]`) by
//!   `M.weight_packed` int32 `[N, K/8]`, `M.weight_scale` bf16 `[N, K/128]`,
//!   `M.weight_shape` int64 `[2]`; every other tensor is copied byte for byte;
//! - a quantized module must not be matched by the `ignore` list (a loader would then expect
//!   `M.weight`), and the three names must not already exist;
//! - every file (shard, index, `config.json`) is written to a temporary sibling and renamed
//!   into place; after a successful write, stale `model*.safetensors` /
//!   `model.safetensors.index.json` files of this naming scheme that are not part of the new
//!   checkpoint are removed (a loader globbing `*.safetensors` would otherwise pick them up);
//! - with `max_shard_bytes`, every shard *file* (header included) is at most that size, or
//!   the write fails before anything is written (a single tensor too large for a shard);
//! - safetensors headers carry `{"format": "pt"}` (transformers requires it).
//! - Regexes use the `regex` crate (no look-around / back-references: such entries are errors
//!   in [`IgnoreList::new`]); Python's `$` also matches before a trailing newline, which module
//!   names never contain.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::bf16;
pub use safetensors::Dtype;
use serde_json::Value;
use speclab_engine::model::checkpoint::{
    write_json_file, write_tensor_files, Checkpoint, ShardLimit,
};
pub use speclab_engine::model::checkpoint::{INDEX_FILE, SINGLE_FILE};
use speclab_engine::model::config::read_json_config;
pub use speclab_engine::model::config::{
    IgnoreList, QuantizationConfig, COMPRESSED_TENSORS_VERSION,
};
use speclab_engine::EngineError;

use crate::error::{checked_len, QuantError, Result};
use crate::w4a16::{W4A16Tensor, GROUP_SIZE, PACK_FACTOR};

/// Model config name.
pub const CONFIG_FILE: &str = "config.json";

/// One tensor: dtype, shape, little-endian row-major bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorData {
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// `prod(shape) * dtype.size()` bytes.
    pub data: Vec<u8>,
}

fn dtype_size(dtype: Dtype) -> Result<usize> {
    let bits = dtype.bitsize();
    if !bits.is_multiple_of(8) {
        return Err(QuantError::Checkpoint(format!(
            "sub-byte dtype {dtype:?} is not supported"
        )));
    }
    Ok(bits / 8)
}

impl TensorData {
    /// Validate that `data` has `prod(shape) * size(dtype)` bytes.
    pub fn new(dtype: Dtype, shape: Vec<usize>, data: Vec<u8>) -> Result<Self> {
        let mut elems = 1usize;
        for &d in &shape {
            elems = checked_len(elems, d, "tensor shape")?;
        }
        let bytes = checked_len(elems, dtype_size(dtype)?, "tensor bytes")?;
        if data.len() != bytes {
            return Err(QuantError::Shape(format!(
                "{dtype:?} {shape:?} needs {bytes} bytes, got {}",
                data.len()
            )));
        }
        Ok(Self { dtype, shape, data })
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// An f32 tensor.
    pub fn from_f32(shape: Vec<usize>, v: &[f32]) -> Result<Self> {
        Self::new(
            Dtype::F32,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
    }

    /// A bf16 tensor.
    pub fn from_bf16(shape: Vec<usize>, v: &[bf16]) -> Result<Self> {
        Self::new(
            Dtype::BF16,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
    }

    /// An int32 tensor.
    pub fn from_i32(shape: Vec<usize>, v: &[i32]) -> Result<Self> {
        Self::new(
            Dtype::I32,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
    }

    /// An int64 tensor.
    pub fn from_i64(shape: Vec<usize>, v: &[i64]) -> Result<Self> {
        Self::new(
            Dtype::I64,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
    }

    /// Values as f32 (exact for BF16, F16 and F32; F64 is rounded).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let d = &self.data;
        Ok(match self.dtype {
            Dtype::F32 => d
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => d
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => d
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F64 => d
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("chunk of 8")) as f32)
                .collect(),
            other => {
                return Err(QuantError::Checkpoint(format!(
                    "{other:?} is not a float dtype"
                )))
            }
        })
    }

    /// Values as bf16 (BF16 only).
    pub fn to_bf16(&self) -> Result<Vec<bf16>> {
        self.expect_dtype(Dtype::BF16)?;
        Ok(self
            .data
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]))
            .collect())
    }

    /// Values as i32 (I32 only).
    pub fn to_i32(&self) -> Result<Vec<i32>> {
        self.expect_dtype(Dtype::I32)?;
        Ok(self
            .data
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Values as i64 (I64 only).
    pub fn to_i64(&self) -> Result<Vec<i64>> {
        self.expect_dtype(Dtype::I64)?;
        Ok(self
            .data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("chunk of 8")))
            .collect())
    }

    fn expect_dtype(&self, want: Dtype) -> Result<()> {
        if self.dtype != want {
            return Err(QuantError::Checkpoint(format!(
                "expected {want:?}, tensor is {:?}",
                self.dtype
            )));
        }
        Ok(())
    }
}

impl safetensors::View for &TensorData {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// True iff the Linear module `module` (tensor name without `.weight`) is matched by no
/// `ignore` entry: exact names, or `re:` + a regex matched from the start of the name
/// (Python `re.match`). Entries that do not compile match nothing here; use
/// [`IgnoreList::new`] to have them reported.
pub fn is_quantized(module: &str, ignore: &[String]) -> bool {
    ignore.iter().all(|entry| {
        IgnoreList::new(std::slice::from_ref(entry)).map_or(true, |l| l.is_quantized(module))
    })
}

/// Options of [`write_pack_quantized`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriteOptions {
    /// Maximum size of one `.safetensors` file in bytes (header included); `None`: one file.
    pub max_shard_bytes: Option<u64>,
}

/// What [`write_pack_quantized`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteReport {
    /// Safetensors file names written, in order (then the index if sharded, then `config.json`).
    pub files: Vec<String>,
    /// Sum of tensor bytes (the index's `metadata.total_size`).
    pub total_size: u64,
    /// Number of tensors written.
    pub tensors: usize,
    /// Number of modules written quantized.
    pub quantized_modules: usize,
    /// Stale checkpoint files removed from the directory.
    pub removed_stale: Vec<String>,
    /// 2-D `*.weight` tensors neither quantized nor ignored: if such a module is a Linear,
    /// a compressed-tensors loader will expect it quantized (embeddings are not Linear).
    pub unquantized_not_ignored: Vec<String>,
}

/// The output tensors: the quantized modules' three tensors each, then every other tensor;
/// and the 2-D `*.weight` tensors neither quantized nor ignored.
fn output_tensors(
    tensors: &BTreeMap<String, TensorData>,
    quantized: &BTreeMap<String, W4A16Tensor>,
    ignore: &IgnoreList,
) -> Result<(BTreeMap<String, TensorData>, Vec<String>)> {
    let mut out: BTreeMap<String, TensorData> = BTreeMap::new();
    for (m, qt) in quantized {
        if let Some(entry) = ignore.matching_entry(m) {
            return Err(QuantError::Checkpoint(format!(
                "module {m} is quantized but matched by ignore entry {entry:?}"
            )));
        }
        let wname = format!("{m}.weight");
        let orig = tensors.get(&wname).ok_or_else(|| {
            QuantError::Checkpoint(format!("quantized module {m}: no tensor {wname}"))
        })?;
        if orig.shape != qt.shape {
            return Err(QuantError::Checkpoint(format!(
                "{wname} has shape {:?}, its W4A16 tensor {:?}",
                orig.shape, qt.shape
            )));
        }
        // Re-validate (fields are public).
        let qt = W4A16Tensor::new(qt.packed.clone(), qt.scale.clone(), qt.shape)?;
        for t in qt.to_named(m) {
            let data = TensorData::new(t.dtype.to_st(), t.shape, t.data)?;
            out.insert(t.name, data);
        }
    }
    let mut unquantized_not_ignored = Vec::new();
    for (name, t) in tensors {
        if let Some(m) = name.strip_suffix(".weight") {
            if quantized.contains_key(m) {
                continue;
            }
            if t.shape.len() == 2 && ignore.is_quantized(m) {
                unquantized_not_ignored.push(name.clone());
            }
        }
        // Re-validate byte lengths (fields are public).
        let t = TensorData::new(t.dtype, t.shape.clone(), t.data.clone())?;
        if out.insert(name.clone(), t).is_some() {
            return Err(QuantError::Checkpoint(format!(
                "tensor {name} would be written twice"
            )));
        }
    }
    Ok((out, unquantized_not_ignored))
}

/// Write a pack-quantized checkpoint into `dir` (created if missing).
///
/// `tensors`: the original checkpoint (name -> tensor; bf16 / fp32 as the model has them).
/// `quantized`: module name `M` -> its W4A16 weight; `M.weight` must be in `tensors`.
/// `base_config`: the model's `config.json` object; `quantization_config` is set from `qcfg`.
pub fn write_pack_quantized(
    dir: &Path,
    tensors: &BTreeMap<String, TensorData>,
    quantized: &BTreeMap<String, W4A16Tensor>,
    base_config: &Value,
    qcfg: &QuantizationConfig,
    opts: &WriteOptions,
) -> Result<WriteReport> {
    let ignore = IgnoreList::compile(&qcfg.ignore, |_, entry, source| QuantError::Regex {
        entry: entry.to_string(),
        source,
    })?;
    let Value::Object(base) = base_config else {
        return Err(QuantError::Checkpoint(
            "base config is not a JSON object".into(),
        ));
    };
    let (out, unquantized_not_ignored) = output_tensors(tensors, quantized, &ignore)?;
    let items: Vec<(&str, &TensorData)> = out.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let limit = opts.max_shard_bytes.map(ShardLimit::FileBytes);
    let written = write_tensor_files(dir, &items, limit)?;
    let mut config: BTreeMap<String, Value> = base.clone().into_iter().collect();
    config.insert("quantization_config".into(), qcfg.to_json());
    write_json_file(&dir.join(CONFIG_FILE), &serde_json::to_value(config)?)?;
    let mut files = written.files;
    files.push(CONFIG_FILE.to_string());
    Ok(WriteReport {
        files,
        total_size: written.total_size,
        tensors: out.len(),
        quantized_modules: quantized.len(),
        removed_stale: written.removed_stale,
        unquantized_not_ignored,
    })
}

/// An engine I/O error as [`QuantError::Io`], any other as [`QuantError`]'s `From`.
fn io_or_other(e: EngineError) -> QuantError {
    match e {
        EngineError::Io { path, reason } => QuantError::Io {
            path: PathBuf::from(path),
            source: std::io::Error::other(reason),
        },
        other => other.into(),
    }
}

/// Read every tensor of a checkpoint directory: `model.safetensors.index.json` and its shards
/// when the index exists, else `model.safetensors` (the engine's [`Checkpoint`] reader).
pub fn read_safetensors_dir(dir: &Path) -> Result<BTreeMap<String, TensorData>> {
    let ck = Checkpoint::open(dir).map_err(io_or_other)?;
    let mut out = BTreeMap::new();
    for name in ck.names() {
        let v = ck.tensor_view(name)?;
        let t = TensorData::new(v.dtype(), v.shape().to_vec(), v.data().to_vec())?;
        out.insert(name.to_string(), t);
    }
    Ok(out)
}

/// Read `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<Value> {
    read_json_config(&dir.join(CONFIG_FILE), |_: &Value| Ok(())).map_err(io_or_other)
}

/// Assemble module `module`'s [`W4A16Tensor`] from `module.weight_packed` (int32 `[N, K/8]`),
/// `module.weight_scale` (bf16 `[N, K/128]`) and `module.weight_shape` (int64 `[2]`).
pub fn read_w4a16(tensors: &BTreeMap<String, TensorData>, module: &str) -> Result<W4A16Tensor> {
    let get = |suffix: &str| {
        let name = format!("{module}.{suffix}");
        tensors
            .get(&name)
            .ok_or_else(|| QuantError::Checkpoint(format!("missing tensor {name}")))
    };
    let (p, s, sh) = (
        get("weight_packed")?,
        get("weight_scale")?,
        get("weight_shape")?,
    );
    let shape = sh.to_i64()?;
    if sh.shape != [2] || shape.len() != 2 || shape.iter().any(|&d| d < 0) {
        return Err(QuantError::Checkpoint(format!(
            "{module}.weight_shape is not [N, K]: {shape:?}"
        )));
    }
    let (n, k) = (shape[0] as usize, shape[1] as usize);
    if k % GROUP_SIZE != 0 {
        return Err(QuantError::GroupMisaligned { k });
    }
    if p.shape != [n, k / PACK_FACTOR] || s.shape != [n, k / GROUP_SIZE] {
        return Err(QuantError::Checkpoint(format!(
            "{module}: weight_packed {:?} / weight_scale {:?} do not match weight_shape [{n}, {k}]",
            p.shape, s.shape
        )));
    }
    Ok(W4A16Tensor::new(p.to_i32()?, s.to_bf16()?, [n, k])?)
}
