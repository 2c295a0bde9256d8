//! compressed-tensors `pack-quantized` checkpoints: writer, reader, `quantization_config`,
//! and the `ignore`-list semantics.
//!
//! What: [`write_pack_quantized`] writes `model.safetensors` (or shards
//! `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` when a maximum shard
//! size is given and one file would exceed it) and `config.json` with `quantization_config`;
//! [`read_safetensors_dir`] / [`read_w4a16`] read them back; [`is_quantized`] / [`IgnoreList`]
//! decide which modules the `ignore` list leaves quantized.
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

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::Path;

use half::bf16;
use regex::Regex;
use safetensors::tensor::{SafeTensors, TensorView};
pub use safetensors::Dtype;
use serde_json::{json, Map, Value};

use crate::error::{checked_len, QuantError, Result};
use crate::w4a16::{W4A16Tensor, GROUP_SIZE, PACK_FACTOR};

/// Single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Shard index name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Model config name.
pub const CONFIG_FILE: &str = "config.json";
/// compressed-tensors version the `quantization_config` shape is taken from.
pub const COMPRESSED_TENSORS_VERSION: &str = "0.17.0";

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

/// The `ignore` list, compiled: exact names and `re:` regexes anchored at the start.
#[derive(Debug, Clone)]
pub struct IgnoreList {
    exact: Vec<String>,
    regexes: Vec<(String, Regex)>,
}

impl IgnoreList {
    /// Compile; an uncompilable `re:` entry is an error.
    pub fn new(ignore: &[String]) -> Result<Self> {
        let mut exact = Vec::new();
        let mut regexes = Vec::new();
        for entry in ignore {
            match entry.strip_prefix("re:") {
                Some(pat) => {
                    let re =
                        Regex::new(&format!("^(?:{pat})")).map_err(|source| QuantError::Regex {
                            entry: entry.clone(),
                            source,
                        })?;
                    regexes.push((entry.clone(), re));
                }
                None => exact.push(entry.clone()),
            }
        }
        Ok(Self { exact, regexes })
    }

    /// The first entry that matches `module`, if any.
    pub fn matching_entry(&self, module: &str) -> Option<&str> {
        if let Some(e) = self.exact.iter().find(|e| e.as_str() == module) {
            return Some(e);
        }
        self.regexes
            .iter()
            .find(|(_, re)| re.is_match(module))
            .map(|(e, _)| e.as_str())
    }

    /// True iff no entry matches `module` (the caller knows `module` is a Linear target).
    pub fn is_quantized(&self, module: &str) -> bool {
        self.matching_entry(module).is_none()
    }
}

/// True iff the Linear module `module` (tensor name without `.weight`) is matched by no
/// `ignore` entry: exact names, or `re:` + a regex matched from the start of the name
/// (Python `re.match`). Entries that do not compile match nothing here; use
/// [`IgnoreList::new`] to have them reported.
pub fn is_quantized(module: &str, ignore: &[String]) -> bool {
    ignore.iter().all(|entry| match entry.strip_prefix("re:") {
        Some(pat) => Regex::new(&format!("^(?:{pat})"))
            .map(|re| !re.is_match(module))
            .unwrap_or(true),
        None => entry != module,
    })
}

/// `quantization_config` of a W4A16 (INT4, symmetric, group 128) pack-quantized checkpoint.
/// Only the `ignore` list varies; everything else is fixed by the format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantizationConfig {
    /// Modules left unquantized (exact names or `re:` regexes).
    pub ignore: Vec<String>,
}

impl QuantizationConfig {
    /// With the given ignore list.
    pub fn new(ignore: Vec<String>) -> Self {
        Self { ignore }
    }

    /// The JSON exactly as `docs/model.md` §8 / compressed-tensors 0.17 write it (keys sorted).
    pub fn to_json(&self) -> Value {
        // Keys inserted in sorted order, so the output is sorted with or without
        // serde_json's `preserve_order`.
        let weights = json!({
            "actorder": null,
            "block_structure": null,
            "dynamic": false,
            "group_size": GROUP_SIZE,
            "num_bits": 4,
            "observer": "memoryless_minmax",
            "observer_kwargs": {},
            "scale_dtype": null,
            "strategy": "group",
            "symmetric": true,
            "type": "int",
            "zp_dtype": null
        });
        json!({
            "config_groups": {
                "group_0": {
                    "format": null,
                    "input_activations": null,
                    "output_activations": null,
                    "targets": ["Linear"],
                    "weights": weights
                }
            },
            "format": "pack-quantized",
            "global_compression_ratio": null,
            "ignore": self.ignore,
            "kv_cache_scheme": null,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
            "sparsity_config": {},
            "transform_config": {},
            "version": COMPRESSED_TENSORS_VERSION
        })
    }

    /// Parse a `quantization_config` value, checking that it describes this format
    /// (pack-quantized compressed-tensors, one group targeting `Linear` with INT4 symmetric
    /// group-128 static weights, no activation quantization); returns its ignore list.
    pub fn from_json(v: &Value) -> Result<Self> {
        let bad = |what: &str| QuantError::Checkpoint(format!("quantization_config: {what}"));
        let get = |v: &Value, key: &str| v.get(key).cloned().unwrap_or(Value::Null);
        if get(v, "quant_method") != json!("compressed-tensors") {
            return Err(bad("quant_method is not \"compressed-tensors\""));
        }
        if get(v, "format") != json!("pack-quantized") {
            return Err(bad("format is not \"pack-quantized\""));
        }
        let groups = v
            .get("config_groups")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("config_groups missing"))?;
        if groups.len() != 1 {
            return Err(bad("expected exactly one config group"));
        }
        let g = groups
            .values()
            .next()
            .ok_or_else(|| bad("empty config_groups"))?;
        if get(g, "targets") != json!(["Linear"]) {
            return Err(bad("targets is not [\"Linear\"]"));
        }
        if !get(g, "input_activations").is_null() || !get(g, "output_activations").is_null() {
            return Err(bad("activation quantization is not W4A16"));
        }
        if let Some(fmt) = g.get("format").filter(|f| !f.is_null()) {
            if fmt != &json!("pack-quantized") {
                return Err(bad("group format is not pack-quantized"));
            }
        }
        let w = g.get("weights").ok_or_else(|| bad("weights missing"))?;
        let checks = [
            ("num_bits", json!(4)),
            ("type", json!("int")),
            ("symmetric", json!(true)),
            ("strategy", json!("group")),
            ("group_size", json!(GROUP_SIZE)),
        ];
        for (key, want) in checks {
            if get(w, key) != want {
                return Err(bad(&format!(
                    "weights.{key} is {}, expected {want}",
                    get(w, key)
                )));
            }
        }
        if get(w, "dynamic") == json!(true) {
            return Err(bad("weights.dynamic is true"));
        }
        // "weight" / its alias "static" only change calibration; "group" / "dynamic" (or
        // `true`) need a g_idx tensor, which this format does not store.
        match w.get("actorder") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(Value::String(a)) if a == "weight" || a == "static" => {}
            Some(a) => {
                return Err(bad(&format!(
                    "weights.actorder {a} needs g_idx, unsupported"
                )))
            }
        }
        let ignore = match v.get("ignore") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|e| {
                    e.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| bad("ignore entry is not a string"))
                })
                .collect::<Result<Vec<_>>>()?,
            Some(_) => return Err(bad("ignore is not a list")),
        };
        Ok(Self { ignore })
    }
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

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> QuantError + '_ {
    move |source| QuantError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Write `bytes` to `dir/name` atomically (temporary sibling, fsync, rename).
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let dst = dir.join(name);
    let res = (|| {
        let mut f = fs::File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(bytes).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
        fs::rename(&tmp, &dst).map_err(io_err(&dst))
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

fn json_bytes(v: &Value) -> Result<Vec<u8>> {
    let mut s = serde_json::to_string_pretty(v)?;
    s.push('\n');
    Ok(s.into_bytes())
}

fn serialize_tensors(items: &[(String, &TensorData)]) -> Result<Vec<u8>> {
    let views = items
        .iter()
        .map(|(name, t)| {
            Ok((
                name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.data)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    Ok(safetensors::serialize(views, Some(meta))?)
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
    let ignore = IgnoreList::new(&qcfg.ignore)?;
    let Value::Object(base) = base_config else {
        return Err(QuantError::Checkpoint(
            "base config is not a JSON object".into(),
        ));
    };

    // Output tensors.
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
        let [n, k] = qt.shape;
        if orig.shape != [n, k] {
            return Err(QuantError::Checkpoint(format!(
                "{wname} has shape {:?}, its W4A16 tensor {:?}",
                orig.shape, qt.shape
            )));
        }
        // Re-validate (fields are public).
        let qt = W4A16Tensor::new(qt.packed.clone(), qt.scale.clone(), qt.shape)?;
        let to_i64 = |x: usize| {
            i64::try_from(x)
                .map_err(|_| QuantError::Shape(format!("dimension {x} does not fit int64")))
        };
        out.insert(
            format!("{m}.weight_packed"),
            TensorData::from_i32(vec![n, k / PACK_FACTOR], &qt.packed)?,
        );
        out.insert(
            format!("{m}.weight_scale"),
            TensorData::from_bf16(vec![n, k / GROUP_SIZE], &qt.scale)?,
        );
        out.insert(
            format!("{m}.weight_shape"),
            TensorData::from_i64(vec![2], &[to_i64(n)?, to_i64(k)?])?,
        );
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
    let total_size: u64 = out.values().map(|t| t.data.len() as u64).sum();

    // Plan files: serialize greedily, exact sizes.
    let items: Vec<(String, &TensorData)> = out.iter().map(|(n, t)| (n.clone(), t)).collect();
    let mut shards: Vec<Vec<u8>> = Vec::new();
    let mut shard_names: Vec<Vec<String>> = Vec::new();
    match opts.max_shard_bytes {
        None => {
            shards.push(serialize_tensors(&items)?);
            shard_names.push(items.iter().map(|(n, _)| n.clone()).collect());
        }
        Some(max) => {
            let too_small =
                || QuantError::Checkpoint(format!("max_shard_bytes {max} is too small"));
            if items.is_empty() {
                let bytes = serialize_tensors(&[])?;
                if bytes.len() as u64 > max {
                    return Err(too_small());
                }
                shards.push(bytes);
                shard_names.push(Vec::new());
            }
            let mut start = 0;
            while start < items.len() {
                // Take tensors while their data fits; the header can only make it too big,
                // so shrink from the end until the exact serialized size fits.
                let mut end = start;
                let mut data = 0u64;
                while end < items.len() && data + items[end].1.data.len() as u64 <= max {
                    data += items[end].1.data.len() as u64;
                    end += 1;
                }
                loop {
                    if end == start {
                        let (name, t) = &items[start];
                        return Err(QuantError::Checkpoint(format!(
                            "tensor {name} ({} bytes + header) does not fit a {max}-byte shard",
                            t.data.len()
                        )));
                    }
                    let bytes = serialize_tensors(&items[start..end])?;
                    if bytes.len() as u64 <= max {
                        shards.push(bytes);
                        shard_names
                            .push(items[start..end].iter().map(|(n, _)| n.clone()).collect());
                        break;
                    }
                    end -= 1;
                }
                start = end;
            }
        }
    }

    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let count = shards.len();
    let file_names: Vec<String> = if count == 1 {
        vec![SINGLE_FILE.to_string()]
    } else {
        (1..=count)
            .map(|i| format!("model-{i:05}-of-{count:05}.safetensors"))
            .collect()
    };
    let mut files = Vec::new();
    for (name, bytes) in file_names.iter().zip(&shards) {
        write_atomic(dir, name, bytes)?;
        files.push(name.clone());
    }
    if count > 1 {
        let mut weight_map = Map::new();
        for (file, names) in file_names.iter().zip(&shard_names) {
            for n in names {
                weight_map.insert(n.clone(), Value::String(file.clone()));
            }
        }
        // Re-sort (weight_map inserted per file; with preserve_order keep names sorted).
        let sorted: BTreeMap<String, Value> = weight_map.into_iter().collect();
        let index = json!({
            "metadata": { "total_size": total_size },
            "weight_map": sorted
        });
        write_atomic(dir, INDEX_FILE, &json_bytes(&index)?)?;
        files.push(INDEX_FILE.to_string());
    }
    let mut config: BTreeMap<String, Value> = base.clone().into_iter().collect();
    config.insert("quantization_config".into(), qcfg.to_json());
    write_atomic(
        dir,
        CONFIG_FILE,
        &json_bytes(&serde_json::to_value(config)?)?,
    )?;
    files.push(CONFIG_FILE.to_string());

    // Remove stale files of the same naming scheme.
    let mut removed_stale = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_checkpoint_file_name(&name) && !files.contains(&name) {
            let p = entry.path();
            fs::remove_file(&p).map_err(io_err(&p))?;
            removed_stale.push(name);
        }
    }
    removed_stale.sort();

    Ok(WriteReport {
        files,
        total_size,
        tensors: out.len(),
        quantized_modules: quantized.len(),
        removed_stale,
        unquantized_not_ignored,
    })
}

fn read_one_file(
    path: &Path,
    out: &mut BTreeMap<String, TensorData>,
    only: Option<&[&str]>,
) -> Result<()> {
    let bytes = fs::read(path).map_err(io_err(path))?;
    let st = SafeTensors::deserialize(&bytes)?;
    for (name, view) in st.iter() {
        if let Some(only) = only {
            if !only.contains(&name) {
                return Err(QuantError::Checkpoint(format!(
                    "{} holds {name}, which the index maps elsewhere",
                    path.display()
                )));
            }
        }
        let t = TensorData::new(view.dtype(), view.shape().to_vec(), view.data().to_vec())?;
        if out.insert(name.to_string(), t).is_some() {
            return Err(QuantError::Checkpoint(format!(
                "tensor {name} appears twice"
            )));
        }
    }
    Ok(())
}

/// Read every tensor of a checkpoint directory: `model.safetensors.index.json` and its shards
/// when the index exists, else `model.safetensors`.
pub fn read_safetensors_dir(dir: &Path) -> Result<BTreeMap<String, TensorData>> {
    let mut out = BTreeMap::new();
    let index_path = dir.join(INDEX_FILE);
    if index_path.exists() {
        let text = fs::read_to_string(&index_path).map_err(io_err(&index_path))?;
        let index: Value = serde_json::from_str(&text)?;
        let map = index
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| QuantError::Checkpoint("index has no weight_map".into()))?;
        let mut by_file: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| {
                QuantError::Checkpoint(format!("weight_map[{name}] is not a string"))
            })?;
            if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                return Err(QuantError::Checkpoint(format!(
                    "weight_map names an unsafe path {file:?}"
                )));
            }
            by_file.entry(file).or_default().push(name);
        }
        for (file, names) in &by_file {
            read_one_file(&dir.join(file), &mut out, Some(names))?;
        }
        for name in map.keys() {
            if !out.contains_key(name) {
                return Err(QuantError::Checkpoint(format!(
                    "index lists {name}, not found in its shard"
                )));
            }
        }
    } else {
        read_one_file(&dir.join(SINGLE_FILE), &mut out, None)?;
    }
    Ok(out)
}

/// Read `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<Value> {
    let p = dir.join(CONFIG_FILE);
    let text = fs::read_to_string(&p).map_err(io_err(&p))?;
    Ok(serde_json::from_str(&text)?)
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
    W4A16Tensor::new(p.to_i32()?, s.to_bf16()?, [n, k])
}
