//! Safetensors checkpoints: memory-mapped reading with typed, checked getters, and
//! speclab's one checkpoint writer ([`write_tensor_files`], also behind
//! `ModelWeights::save` and `speclab-quant`'s pack-quantized writer).
//!
//! Source: the safetensors format (8-byte little-endian header length, JSON header,
//! contiguous row-major data), read through the `safetensors` crate's header parser
//! over a `memmap2` map and written by its `serialize_to_file`; HF sharding
//! (`model.safetensors.index.json` with a `weight_map` of tensor -> shard file, shard
//! names `model-0000i-of-0000n.safetensors`); docs/model.md §7 (dtypes) and §12.
//!
//! Invariants: every error names the file and, where there is one, the tensor; a
//! truncated or corrupt file, an index naming a missing shard, a tensor listed in two
//! shards or a shard tensor the index does not list are errors, never panics. Getters
//! check dtype and shape before converting: bf16 -> f32 is exact (§1.1); int32 and
//! int64 are read little-endian. Maps are read-only; the files must not be modified
//! while a [`Checkpoint`] is alive (the usual mmap contract). Writing: every tensor's
//! byte length is checked and the shards planned ([`ShardLimit`]) before anything is
//! written; each file is written to a temporary sibling and renamed into place; safetensors
//! headers carry `{"format": "pt"}`; stale checkpoint files of the naming scheme are
//! removed after a successful write.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo, TensorView, View};

use crate::{EngineError, Result};

/// Name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of a sharded checkpoint's index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// A tensor dtype this crate reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorDtype {
    Bf16,
    F32,
    I32,
    I64,
}

impl TensorDtype {
    /// The `safetensors` dtype.
    pub fn to_st(self) -> Dtype {
        match self {
            Self::Bf16 => Dtype::BF16,
            Self::F32 => Dtype::F32,
            Self::I32 => Dtype::I32,
            Self::I64 => Dtype::I64,
        }
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::Bf16 => 2,
            Self::F32 | Self::I32 => 4,
            Self::I64 => 8,
        }
    }
}

/// Which float dtypes a getter accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatKind {
    /// bf16 (the contract) or f32 (an f32 export of the same model).
    Bf16OrF32,
    /// Only f32 (`A_log`, `dt_bias`, `e_score_correction_bias`, §1.1).
    F32Only,
}

/// One expected dimension: its size and the config expression that gives it
/// (used to name the config key when a checkpoint does not match the config).
#[derive(Debug, Clone, Copy)]
pub struct Dim {
    pub size: usize,
    /// Config key(s) behind the size, e.g. `"hidden_size"`; `""` when fixed.
    pub key: &'static str,
}

/// Shorthand for a [`Dim`].
pub const fn dim(size: usize, key: &'static str) -> Dim {
    Dim { size, key }
}

struct Shard {
    path: PathBuf,
    /// The whole file. Shape: [file bytes].
    mmap: Mmap,
    /// Offset of the data section (8 + header length).
    data_start: usize,
    meta: Metadata,
}

/// An opened checkpoint: one file or several shards.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Tensor name -> shard index.
    names: BTreeMap<String, usize>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.names.len())
            .finish()
    }
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> EngineError {
    EngineError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

fn corrupt(path: &Path, reason: impl Into<String>) -> EngineError {
    EngineError::CorruptCheckpoint {
        file: path.display().to_string(),
        reason: reason.into(),
    }
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

fn fmt_shape(s: &[usize]) -> String {
    format!("{s:?}")
}

/// A readable reason for a safetensors header error.
fn explain(e: &safetensors::SafeTensorError, file_len: usize) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall => format!("{file_len} bytes: shorter than the 8-byte header length"),
        E::InvalidHeaderLength => format!("the header length exceeds the file ({file_len} bytes)"),
        E::HeaderTooLarge => "the header length is implausibly large".into(),
        E::MetadataIncompleteBuffer => format!("the file size ({file_len} bytes) does not match the tensors the header describes (truncated?)"),
        E::InvalidHeader(_) => "the JSON header is not UTF-8".into(),
        E::InvalidHeaderDeserialization(err) => format!("the JSON header does not parse: {err}"),
        E::InvalidOffset(t) => format!("tensor `{t}` has data offsets that are not contiguous"),
        E::TensorInvalidInfo => "a tensor's byte size does not match its dtype and shape".into(),
        other => format!("{other:?}"),
    }
}

fn open_shard(path: &Path) -> Result<Shard> {
    let file = File::open(path).map_err(|e| io_err(path, e))?;
    // SAFETY: the map is read-only and private to this process; the checkpoint
    // contract (module doc) is that files are not modified while mapped.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| io_err(path, e))?;
    let (n, meta) =
        SafeTensors::read_metadata(&mmap).map_err(|e| corrupt(path, explain(&e, mmap.len())))?;
    Ok(Shard {
        path: path.to_path_buf(),
        mmap,
        data_start: 8 + n,
        meta,
    })
}

impl Checkpoint {
    /// Open `dir/model.safetensors`, or the shards of `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join(INDEX_FILE);
        if index.exists() {
            return Self::open_index(dir, &index);
        }
        let single = dir.join(SINGLE_FILE);
        if !single.exists() {
            return Err(io_err(
                dir,
                format!("no {SINGLE_FILE} or {INDEX_FILE} in this directory"),
            ));
        }
        Self::open_file(&single)
    }

    /// Open one safetensors file.
    pub fn open_file(path: &Path) -> Result<Self> {
        let shard = open_shard(path)?;
        let names = shard.meta.tensors().into_keys().map(|k| (k, 0)).collect();
        Ok(Self {
            dir: path.parent().map(Path::to_path_buf).unwrap_or_default(),
            shards: vec![shard],
            names,
        })
    }

    fn open_index(dir: &Path, index: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(index).map_err(|e| io_err(index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| corrupt(index, format!("invalid JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| corrupt(index, "no `weight_map` object"))?;
        let mut shard_of: BTreeMap<String, String> = BTreeMap::new();
        for (name, file) in map {
            let f = file.as_str().ok_or_else(|| {
                corrupt(index, format!("weight_map[{name:?}] is not a file name"))
            })?;
            if f.contains('/') || f.contains('\\') || f == ".." {
                return Err(corrupt(
                    index,
                    format!("weight_map[{name:?}] = {f:?} is not a plain file name"),
                ));
            }
            shard_of.insert(name.clone(), f.to_string());
        }
        let mut files: Vec<String> = shard_of.values().cloned().collect();
        files.sort();
        files.dedup();
        let mut shards = Vec::with_capacity(files.len());
        let mut file_idx = HashMap::new();
        for f in &files {
            let p = dir.join(f);
            if !p.exists() {
                let t = shard_of
                    .iter()
                    .find(|(_, v)| *v == f)
                    .map(|(k, _)| k.clone())
                    .unwrap_or_default();
                return Err(corrupt(
                    index,
                    format!(
                        "names shard {f:?} (e.g. for tensor `{t}`), which does not exist in {}",
                        dir.display()
                    ),
                ));
            }
            file_idx.insert(f.clone(), shards.len());
            shards.push(open_shard(&p)?);
        }
        let mut names = BTreeMap::new();
        for (name, f) in &shard_of {
            let i = file_idx[f];
            if shards[i].meta.info(name).is_none() {
                return Err(EngineError::MissingTensor {
                    file: shards[i].path.display().to_string(),
                    tensor: name.clone(),
                });
            }
            names.insert(name.clone(), i);
        }
        for s in &shards {
            for name in s.meta.tensors().keys() {
                match shard_of.get(name) {
                    None => return Err(corrupt(&s.path, format!("tensor `{name}` is not listed in {INDEX_FILE}"))),
                    Some(f) if dir.join(f) != s.path => {
                        return Err(corrupt(
                            &s.path,
                            format!("tensor `{name}` is also stored here, but {INDEX_FILE} maps it to {f:?}"),
                        ))
                    }
                    _ => {}
                }
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            shards,
            names,
        })
    }

    /// Directory of the checkpoint.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }
    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }
    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.names.len()
    }
    /// Whether the checkpoint has no tensors.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
    /// File holding a tensor (or the first shard / the directory when unknown), for errors.
    pub fn file_of(&self, name: &str) -> String {
        match self.names.get(name) {
            Some(&i) => self.shards[i].path.display().to_string(),
            None if self.shards.len() == 1 => self.shards[0].path.display().to_string(),
            None => self.dir.join(INDEX_FILE).display().to_string(),
        }
    }
    /// The shape of a tensor, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        let &i = self.names.get(name)?;
        self.shards[i].meta.info(name).map(|t| t.shape.as_slice())
    }

    /// The shard, header entry and data bytes of a tensor.
    fn locate(&self, name: &str) -> Result<(&Shard, &TensorInfo, &[u8])> {
        let &i = self
            .names
            .get(name)
            .ok_or_else(|| EngineError::MissingTensor {
                file: self.file_of(name),
                tensor: name.into(),
            })?;
        let s = &self.shards[i];
        let info = s
            .meta
            .info(name)
            .ok_or_else(|| EngineError::MissingTensor {
                file: s.path.display().to_string(),
                tensor: name.into(),
            })?;
        let (a, b) = info.data_offsets;
        let bytes = s
            .mmap
            .get(s.data_start + a..s.data_start + b)
            .ok_or_else(|| corrupt(&s.path, format!("tensor `{name}` data is out of the file")))?;
        Ok((s, info, bytes))
    }

    /// A tensor as stored, whatever its dtype and shape (a `safetensors` view of the map).
    pub fn tensor_view(&self, name: &str) -> Result<TensorView<'_>> {
        let (s, info, bytes) = self.locate(name)?;
        TensorView::new(info.dtype, info.shape.clone(), bytes).map_err(|e| {
            corrupt(
                &s.path,
                format!("tensor `{name}`: {}", explain(&e, s.mmap.len())),
            )
        })
    }

    /// Raw bytes of a tensor after checking dtype (one of `allowed`) and shape.
    fn raw(&self, name: &str, allowed: &[Dtype], dims: &[Dim]) -> Result<(Dtype, &[u8])> {
        let (s, info, bytes) = self.locate(name)?;
        let file = s.path.display().to_string();
        if !allowed.contains(&info.dtype) {
            let exp: Vec<String> = allowed.iter().map(|d| dtype_name(*d)).collect();
            return Err(EngineError::TensorDtype {
                file,
                tensor: name.into(),
                detail: format!(
                    "dtype {}, expected {}",
                    dtype_name(info.dtype),
                    exp.join(" or ")
                ),
            });
        }
        let expected: Vec<usize> = dims.iter().map(|d| d.size).collect();
        if info.shape != expected {
            // Name the config key behind the first differing dimension, if any.
            if info.shape.len() == dims.len() {
                if let Some((ax, (d, found))) = dims
                    .iter()
                    .zip(&info.shape)
                    .enumerate()
                    .find(|(_, (d, f))| d.size != **f && !d.key.is_empty())
                {
                    return Err(EngineError::ConfigMismatch {
                        key: d.key.into(),
                        tensor: name.into(),
                        reason: format!(
                            "{} = {} implies shape {}, but {file} stores {} (axis {ax} is {found})",
                            d.key,
                            d.size,
                            fmt_shape(&expected),
                            fmt_shape(&info.shape),
                        ),
                    });
                }
            }
            return Err(EngineError::TensorShape {
                file,
                tensor: name.into(),
                detail: format!(
                    "shape {}, expected {}",
                    fmt_shape(&info.shape),
                    fmt_shape(&expected)
                ),
            });
        }
        Ok((info.dtype, bytes))
    }

    /// A float tensor as f32 (bf16 upcast exactly), checking dtype and shape.
    pub fn f32(&self, name: &str, kind: FloatKind, dims: &[Dim]) -> Result<Vec<f32>> {
        let allowed: &[Dtype] = match kind {
            FloatKind::Bf16OrF32 => &[Dtype::BF16, Dtype::F32],
            FloatKind::F32Only => &[Dtype::F32],
        };
        let (dt, bytes) = self.raw(name, allowed, dims)?;
        Ok(match dt {
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                .collect(),
            _ => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        })
    }

    /// An int32 tensor, checking dtype and shape.
    pub fn i32(&self, name: &str, dims: &[Dim]) -> Result<Vec<i32>> {
        let (_, bytes) = self.raw(name, &[Dtype::I32], dims)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// An int64 tensor, checking dtype and shape.
    pub fn i64(&self, name: &str, dims: &[Dim]) -> Result<Vec<i64>> {
        let (_, bytes) = self.raw(name, &[Dtype::I64], dims)?;
        Ok(bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect())
    }

    /// A tensor's stored shape and the [`Dim`]s that accept exactly it.
    fn stored_dims(&self, name: &str) -> Result<(Vec<usize>, Vec<Dim>)> {
        let shape = self
            .shape(name)
            .ok_or_else(|| EngineError::MissingTensor {
                file: self.file_of(name),
                tensor: name.into(),
            })?
            .to_vec();
        let dims = shape.iter().map(|&s| dim(s, "")).collect();
        Ok((shape, dims))
    }

    /// A float tensor of whatever shape it has (for goldens): (values, shape).
    pub fn f32_any_shape(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let (shape, dims) = self.stored_dims(name)?;
        Ok((self.f32(name, FloatKind::Bf16OrF32, &dims)?, shape))
    }

    /// An int32 tensor of whatever shape it has: (values, shape).
    pub fn i32_any_shape(&self, name: &str) -> Result<(Vec<i32>, Vec<usize>)> {
        let (shape, dims) = self.stored_dims(name)?;
        Ok((self.i32(name, &dims)?, shape))
    }

    /// Header metadata (`__metadata__`) of the first shard.
    pub fn metadata(&self) -> Option<&HashMap<String, String>> {
        self.shards.first().and_then(|s| s.meta.metadata().as_ref())
    }
}

/// A named tensor ready to be written (little-endian bytes).
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    pub name: String,
    pub dtype: TensorDtype,
    pub shape: Vec<usize>,
    /// Shape: [prod(shape) * dtype.size()] bytes.
    pub data: Vec<u8>,
}

impl NamedTensor {
    /// f32 values stored as bf16 (round to nearest even; exact for bf16-valued weights).
    pub fn bf16(name: &str, shape: Vec<usize>, v: &[f32]) -> Self {
        let data = v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect();
        Self {
            name: name.into(),
            dtype: TensorDtype::Bf16,
            shape,
            data,
        }
    }
    /// bf16 values stored as bf16.
    pub fn from_bf16(name: &str, shape: Vec<usize>, v: &[half::bf16]) -> Self {
        Self {
            name: name.into(),
            dtype: TensorDtype::Bf16,
            shape,
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    /// f32 values stored as f32.
    pub fn f32(name: &str, shape: Vec<usize>, v: &[f32]) -> Self {
        Self {
            name: name.into(),
            dtype: TensorDtype::F32,
            shape,
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    /// int32 values.
    pub fn i32(name: &str, shape: Vec<usize>, v: &[i32]) -> Self {
        Self {
            name: name.into(),
            dtype: TensorDtype::I32,
            shape,
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    /// int64 values.
    pub fn i64(name: &str, shape: Vec<usize>, v: &[i64]) -> Self {
        Self {
            name: name.into(),
            dtype: TensorDtype::I64,
            shape,
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

impl safetensors::View for &NamedTensor {
    fn dtype(&self) -> Dtype {
        self.dtype.to_st()
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// How [`write_tensor_files`] splits a checkpoint into shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardLimit {
    /// Hugging Face `save_pretrained`'s rule on tensor data bytes: shard only when the
    /// tensors exceed the limit; tensors kept in order, a new shard when the next tensor
    /// would overflow the current one (a larger tensor gets a shard of its own).
    TensorBytes(usize),
    /// Every shard *file* (header included) at most this many bytes: tensors kept in
    /// order, each shard as long as its exact serialized size fits; one shard is written
    /// as the single file. A tensor that does not fit an empty shard is an error before
    /// anything is written.
    FileBytes(u64),
}

/// What [`write_tensor_files`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenTensors {
    /// Safetensors file names written, in order, then the index if sharded.
    pub files: Vec<String>,
    /// Sum of tensor data bytes (the index's `metadata.total_size`).
    pub total_size: u64,
    /// Stale checkpoint files (of this naming scheme, not part of the new checkpoint)
    /// removed from the directory, sorted.
    pub removed_stale: Vec<String>,
}

/// The `{"format": "pt"}` header metadata transformers requires.
fn pt_metadata() -> Option<HashMap<String, String>> {
    Some(HashMap::from([("format".to_string(), "pt".to_string())]))
}

/// Error unless a tensor's data has `prod(shape) * dtype size` bytes.
fn check_data_len(path: &Path, name: &str, t: &impl View) -> Result<()> {
    let bits = t
        .shape()
        .iter()
        .try_fold(t.dtype().bitsize(), |a, &d| a.checked_mul(d));
    if bits != Some(t.data_len() * 8) {
        return Err(corrupt(
            path,
            format!(
                "tensor `{name}`: {} bytes for shape {:?} {:?}",
                t.data_len(),
                t.shape(),
                t.dtype()
            ),
        ));
    }
    Ok(())
}

/// Write `(name, tensor)` pairs to one safetensors file with the `safetensors` crate's
/// `serialize_to_file` (a temporary sibling renamed into place; header metadata
/// `{"format": "pt"}`), after checking every tensor's byte length.
pub fn write_safetensors_views<S: AsRef<str>, V: View + Clone>(
    path: &Path,
    tensors: &[(S, V)],
) -> Result<()> {
    for (name, t) in tensors {
        check_data_len(path, name.as_ref(), t)?;
    }
    serialize_file(path, tensors)
}

/// `serialize_to_file` of checked tensors.
fn serialize_file<S: AsRef<str>, V: View + Clone>(path: &Path, tensors: &[(S, V)]) -> Result<()> {
    safetensors::serialize_to_file(
        tensors.iter().map(|(n, t)| (n.as_ref(), t.clone())),
        pt_metadata(),
        path,
    )
    .map_err(|e| io_err(path, format!("{e:?}")))
}

/// Write tensors to one safetensors file (header metadata `{"format": "pt"}`).
pub fn write_safetensors(path: &Path, tensors: &[NamedTensor]) -> Result<()> {
    write_safetensors_views(path, &named_views(tensors))
}

fn named_views(tensors: &[NamedTensor]) -> Vec<(&str, &NamedTensor)> {
    tensors.iter().map(|t| (t.name.as_str(), t)).collect()
}

/// Write `bytes` to `path` atomically (a temporary sibling, fsync, rename).
pub fn write_file_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let name = path
        .file_name()
        .map_or_else(|| "out".to_string(), |n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
    let res = (|| {
        let mut f = File::create(&tmp).map_err(|e| io_err(&tmp, e))?;
        f.write_all(bytes).map_err(|e| io_err(&tmp, e))?;
        f.sync_all().map_err(|e| io_err(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_err(path, e))
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// Write a JSON value as `config.json` / the index store it: pretty-printed, a final
/// newline, atomically.
pub fn write_json_file(path: &Path, v: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| io_err(path, e))?;
    write_file_atomic(path, (text + "\n").as_bytes())
}

/// Serialized size of one safetensors file holding `tensors` (the crate's serializer).
fn serialized_len<S: AsRef<str>, V: View + Clone>(tensors: &[(S, V)]) -> Result<u64> {
    let bytes = safetensors::serialize(
        tensors.iter().map(|(n, t)| (n.as_ref(), t.clone())),
        pt_metadata(),
    )
    .map_err(|e| EngineError::InvalidConfig {
        key: "max_shard_bytes".into(),
        reason: format!("cannot serialize a shard: {e:?}"),
    })?;
    Ok(bytes.len() as u64)
}

/// Tensor index ranges of the shards, or `None` for a single file.
fn plan_shards<S: AsRef<str>, V: View + Clone>(
    tensors: &[(S, V)],
    limit: Option<ShardLimit>,
) -> Result<Option<Vec<std::ops::Range<usize>>>> {
    match limit {
        None => Ok(None),
        Some(ShardLimit::TensorBytes(l)) => {
            let total: usize = tensors.iter().map(|(_, t)| t.data_len()).sum();
            if total <= l {
                return Ok(None);
            }
            let limit = l.max(1);
            // Shard starts: a new shard when the next tensor would overflow this one.
            let mut starts = vec![0];
            let mut size = 0;
            for (i, (_, t)) in tensors.iter().enumerate() {
                if size > 0 && size + t.data_len() > limit {
                    starts.push(i);
                    size = 0;
                }
                size += t.data_len();
            }
            let ends = starts.iter().skip(1).copied().chain([tensors.len()]);
            Ok(Some(starts.iter().zip(ends).map(|(&a, b)| a..b).collect()))
        }
        Some(ShardLimit::FileBytes(max)) => {
            let shards = plan_file_bytes(tensors, max)?;
            Ok((shards.len() > 1).then_some(shards))
        }
    }
}

/// [`ShardLimit::FileBytes`]: take tensors while their data fits; the header can only
/// make it too big, so shrink from the end until the exact serialized size fits.
fn plan_file_bytes<S: AsRef<str>, V: View + Clone>(
    tensors: &[(S, V)],
    max: u64,
) -> Result<Vec<std::ops::Range<usize>>> {
    let refuse = |reason: String| EngineError::InvalidConfig {
        key: "max_shard_bytes".into(),
        reason,
    };
    if tensors.is_empty() {
        if serialized_len(tensors)? > max {
            return Err(refuse(format!("max_shard_bytes {max} is too small")));
        }
        return Ok(std::iter::once(0..0).collect());
    }
    let mut shards = Vec::new();
    let mut start = 0;
    while start < tensors.len() {
        let mut end = start;
        let mut data = 0u64;
        while end < tensors.len() && data + tensors[end].1.data_len() as u64 <= max {
            data += tensors[end].1.data_len() as u64;
            end += 1;
        }
        loop {
            if end == start {
                let (name, t) = &tensors[start];
                return Err(refuse(format!(
                    "tensor {} ({} bytes + header) does not fit a {max}-byte shard",
                    name.as_ref(),
                    t.data_len()
                )));
            }
            if serialized_len(&tensors[start..end])? <= max {
                break;
            }
            end -= 1;
        }
        shards.push(start..end);
        start = end;
    }
    Ok(shards)
}

/// Is `name` a file of this writer's naming scheme (`model.safetensors`,
/// `model-NNNNN-of-NNNNN.safetensors`, the index)?
fn is_checkpoint_file_name(name: &str) -> bool {
    if name == SINGLE_FILE || name == INDEX_FILE {
        return true;
    }
    let Some(mid) = name
        .strip_prefix("model-")
        .and_then(|s| s.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let parts: Vec<&str> = mid.split("-of-").collect();
    parts.len() == 2
        && parts
            .iter()
            .all(|p| p.len() == 5 && p.bytes().all(|b| b.is_ascii_digit()))
}

/// Remove the checkpoint files of `dir` (this naming scheme) that are not in `keep`.
fn remove_stale(dir: &Path, keep: &[String]) -> Result<Vec<String>> {
    let mut removed = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io_err(dir, e))? {
        let entry = entry.map_err(|e| io_err(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_checkpoint_file_name(&name) && !keep.contains(&name) {
            let p = entry.path();
            std::fs::remove_file(&p).map_err(|e| io_err(&p, e))?;
            removed.push(name);
        }
    }
    removed.sort();
    Ok(removed)
}

/// The one checkpoint writer: `(name, tensor)` pairs into `dir` (created if missing) as
/// one `model.safetensors`, or, under `limit` (see [`ShardLimit`]), HF-style shards
/// `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`
/// (`metadata.total_size` = tensor data bytes, `weight_map` sorted by name). Shards are
/// planned before anything is written; each file is written atomically (the
/// `safetensors` crate's `serialize_to_file`, [`write_json_file`]); afterwards, stale
/// files of this naming scheme that are not part of the new checkpoint are removed (a
/// stale index would otherwise shadow a new single file, and a loader globbing
/// `*.safetensors` would pick up old shards).
pub fn write_tensor_files<S: AsRef<str>, V: View + Clone>(
    dir: &Path,
    tensors: &[(S, V)],
    limit: Option<ShardLimit>,
) -> Result<WrittenTensors> {
    for (name, t) in tensors {
        check_data_len(dir, name.as_ref(), t)?;
    }
    let total_size: u64 = tensors.iter().map(|(_, t)| t.data_len() as u64).sum();
    let plan = plan_shards(tensors, limit)?;
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let mut files = Vec::new();
    match plan {
        None => {
            serialize_file(&dir.join(SINGLE_FILE), tensors)?;
            files.push(SINGLE_FILE.to_string());
        }
        Some(shards) => {
            let n = shards.len();
            let mut weight_map = BTreeMap::new();
            for (i, r) in shards.into_iter().enumerate() {
                let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
                serialize_file(&dir.join(&file), &tensors[r.clone()])?;
                for (name, _) in &tensors[r] {
                    weight_map.insert(name.as_ref().to_string(), file.clone());
                }
                files.push(file);
            }
            let index = serde_json::json!({
                "metadata": { "total_size": total_size },
                "weight_map": weight_map
            });
            write_json_file(&dir.join(INDEX_FILE), &index)?;
            files.push(INDEX_FILE.to_string());
        }
    }
    let removed_stale = remove_stale(dir, &files)?;
    Ok(WrittenTensors {
        files,
        total_size,
        removed_stale,
    })
}

/// Write a checkpoint into `dir` with [`write_tensor_files`], sharded by
/// [`ShardLimit::TensorBytes`] when `max_shard_bytes` is given. Returns the written file
/// names (shards, then the index).
pub fn write_checkpoint(
    dir: &Path,
    tensors: &[NamedTensor],
    max_shard_bytes: Option<usize>,
) -> Result<Vec<String>> {
    let limit = max_shard_bytes.map(ShardLimit::TensorBytes);
    Ok(write_tensor_files(dir, &named_views(tensors), limit)?.files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("speclab-ckpt-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn tensors(sizes: &[usize]) -> Vec<NamedTensor> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| NamedTensor::f32(&format!("t{i}"), vec![n], &vec![i as f32; n]))
            .collect()
    }

    #[test]
    fn tensor_bytes_rule_and_stale_files_removed() {
        let d = tmp("stale");
        // 400 + 400 > 600: two shards (HF rule on data bytes) and the index.
        let files = write_checkpoint(&d, &tensors(&[100, 100, 50]), Some(600)).unwrap();
        assert_eq!(
            files,
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                INDEX_FILE
            ]
        );
        // One file now: the old shards and index go (the index would shadow it).
        let files = write_checkpoint(&d, &tensors(&[100]), Some(600)).unwrap();
        assert_eq!(files, [SINGLE_FILE]);
        let mut left: Vec<String> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, [SINGLE_FILE]);
        assert_eq!(Checkpoint::open(&d).unwrap().len(), 1);
        // A single tensor above the limit is still "sharded" (its own shard), as before.
        let files = write_checkpoint(&d, &tensors(&[200]), Some(600)).unwrap();
        assert_eq!(files, ["model-00001-of-00001.safetensors", INDEX_FILE]);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn file_bytes_rule_counts_the_header() {
        let d = tmp("file-bytes");
        let t = tensors(&[100, 100, 100]);
        let views = named_views(&t);
        // Two tensors' 800 data bytes fit 850, not with the header: one tensor per shard.
        let w = write_tensor_files(&d, &views, Some(ShardLimit::FileBytes(850))).unwrap();
        assert_eq!(w.files.len(), 4);
        for f in &w.files[..3] {
            assert!(std::fs::metadata(d.join(f)).unwrap().len() <= 850);
        }
        assert_eq!(w.total_size, 1200);
        let e = write_tensor_files(&tmp("too-small"), &views, Some(ShardLimit::FileBytes(100)));
        assert!(e.unwrap_err().to_string().contains("does not fit"));
        let _ = std::fs::remove_dir_all(&d);
    }
}
