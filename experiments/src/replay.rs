//! `kv replay`: drive the KV cache manager from a layout file and a trace of
//! JSON-lines operations, one output record per operation.
//!
//! The contract is `docs/kv-replay-format.md`; the semantics are those of vLLM
//! 0.33.0 `KVCacheManager` (`vllm/v1/core/kv_cache_manager.py`) driven the way
//! `recipes/kv_golden.py` drives it, so that the records equal the goldens under
//! `tests/golden/kv/`. Used by the CLI (`speclab kv replay`), the golden and
//! property tests, and the `kv` bench.
//!
//! Flow: [`load_layout`] (RON or JSON by extension; parse errors carry
//! `path:line:col` and the field path) -> [`parse_ops`] (all ops parsed up
//! front, so that timing a replay excludes parsing; errors carry
//! `path:line N`) -> [`Replayer::apply`] per op -> [`OpResult`] (serializes to
//! `{"i","op","blocks"?,"free"}`).
//!
//! Invariants: an op that returns an error leaves the replayer's request state
//! and the pool unchanged (everything is checked before the manager is
//! called), and does not advance the op index; no user input reaches a panic.
//! Request slots of freed requests are reused (they are dense indices into the
//! manager's tables).

use std::collections::HashMap;
use std::fmt;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize};
use speclab_engine::kv::manager::AllocArgs;
use speclab_engine::kv::{planning, AllocOutcome, KvCacheManager, KvLayout};
use speclab_engine::{EngineError, ReqSlot, RequestStatus, RequestView};

use crate::{ExperimentError, Result};

// ---------------------------------------------------------------------------
// Layout files
// ---------------------------------------------------------------------------

/// Read a layout file: `.ron` (RON, `Some(..)` optional with implicit-some) or
/// `.json`, chosen by extension; then validate it (groups, pool size).
///
/// Errors: `path:line:col: field `groups[1].kind`: <serde message>` for
/// syntax and type errors; `path: <field>: <reason>` for values the engine
/// refuses (zero block size, missing window, no pool size, ...).
pub fn load_layout(path: impl AsRef<Path>) -> Result<KvLayout> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|e| ExperimentError::io(path, e))?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let layout = match ext.as_deref() {
        Some("ron") => parse_layout_ron(&text, path)?,
        Some("json") => parse_layout_json(&text, path)?,
        _ => {
            return Err(ExperimentError::Invalid {
                path: path.to_path_buf(),
                field: "file extension".into(),
                msg: "a layout file must end in .ron or .json".into(),
            })
        }
    };
    validate_layout(&layout, path)?;
    Ok(layout)
}

/// Parse a RON layout from text; `path` is only used in error messages.
/// A UTF-8 byte-order mark at the start is accepted (skipped).
pub fn parse_layout_ron(text: &str, path: &Path) -> Result<KvLayout> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let opts =
        ron::Options::default().with_default_extension(ron::extensions::Extensions::IMPLICIT_SOME);
    let ron_err = |e: ron::error::SpannedError, field: Option<String>| ExperimentError::Parse {
        path: path.to_path_buf(),
        at: format!("{}:{}", e.position.line, e.position.col),
        msg: with_field(field, &e.code.to_string()),
    };
    let mut de =
        ron::Deserializer::from_str_with_options(text, &opts).map_err(|e| ron_err(e, None))?;
    let layout: KvLayout = match serde_path_to_error::deserialize(&mut de) {
        Ok(l) => l,
        Err(e) => {
            let field = field_path(e.path());
            let spanned = de.span_error(e.into_inner());
            return Err(ron_err(spanned, field));
        }
    };
    de.end()
        .map_err(|code| ron_err(de.span_error(code), None))?;
    Ok(layout)
}

/// Parse a JSON layout from text; `path` is only used in error messages.
/// A UTF-8 byte-order mark at the start is accepted (skipped).
pub fn parse_layout_json(text: &str, path: &Path) -> Result<KvLayout> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut de = serde_json::Deserializer::from_str(text);
    let layout: KvLayout = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let field = field_path(e.path());
        json_err(path, e.inner(), field)
    })?;
    de.end().map_err(|e| json_err(path, &e, None))?;
    Ok(layout)
}

/// Check a parsed layout the way the manager will (groups, then pool size),
/// naming the file.
pub fn validate_layout(layout: &KvLayout, path: &Path) -> Result<()> {
    let err = |e: EngineError| match e {
        EngineError::InvalidLayout { field, reason } => ExperimentError::Invalid {
            path: path.to_path_buf(),
            field,
            msg: reason,
        },
        other => ExperimentError::engine(path.display().to_string(), other),
    };
    layout.resolve_groups().map_err(err)?;
    planning::resolve_num_blocks(layout).map_err(err)?;
    Ok(())
}

/// The field path of a deserialization error (`groups[1].kind`), without the
/// trailing unknown segments (`?`) serde_path_to_error adds between fields.
fn field_path(p: &serde_path_to_error::Path) -> Option<String> {
    let mut s = p.to_string();
    while let Some(t) = s.strip_suffix('?') {
        s = t.strip_suffix('.').unwrap_or(t).to_string();
    }
    (!s.is_empty() && s != ".").then_some(s)
}

fn with_field(field: Option<String>, msg: &str) -> String {
    match field {
        Some(f) => format!("field `{f}`: {msg}"),
        None => msg.to_string(),
    }
}

/// serde_json's message without its " at line L column C" suffix.
fn json_msg(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(k) if e.line() != 0 => s[..k].to_string(),
        _ => s,
    }
}

fn json_err(path: &Path, e: &serde_json::Error, field: Option<String>) -> ExperimentError {
    ExperimentError::Parse {
        path: path.to_path_buf(),
        at: format!("{}:{}", e.line(), e.column()),
        msg: with_field(field, &json_msg(e)),
    }
}

// ---------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------

fn yes() -> bool {
    true
}
fn is_zero(x: &u64) -> bool {
    *x == 0
}
fn is_false(b: &bool) -> bool {
    !*b
}
fn is_true(b: &bool) -> bool {
    *b
}

/// One operation of a trace (one JSON line), as in `docs/kv-replay-format.md`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Op {
    /// New request: prompt = num_tokens = `prompt_len`, nothing computed, WAITING.
    Add { req: String, prompt_len: u64 },
    /// `allocate_slots(request, num_new_tokens, num_lookahead_tokens, full_sequence_must_fit, has_scheduled_reqs)`.
    Allocate {
        req: String,
        num_new_tokens: u64,
        #[serde(default, skip_serializing_if = "is_zero")]
        lookahead: u64,
        #[serde(default, skip_serializing_if = "is_false")]
        must_fit: bool,
        #[serde(default = "yes", skip_serializing_if = "is_true")]
        has_scheduled_reqs: bool,
    },
    /// num_computed_tokens += n (n < 0: rejected draft tokens).
    Computed { req: String, n: i64 },
    /// n output tokens appended: num_tokens += n.
    Append { req: String, n: u64 },
    /// `free(request)`, num_computed_tokens = 0, status PREEMPTED.
    Preempt { req: String },
    /// `free(request)`; the request is forgotten.
    Free { req: String },
}

/// The name of an operation (the `op` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpName {
    Add,
    Allocate,
    Computed,
    Append,
    Preempt,
    Free,
}

impl OpName {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            OpName::Add => "add",
            OpName::Allocate => "allocate",
            OpName::Computed => "computed",
            OpName::Append => "append",
            OpName::Preempt => "preempt",
            OpName::Free => "free",
        }
    }
}

impl fmt::Display for OpName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Op {
    /// The op's name.
    pub fn name(&self) -> OpName {
        match self {
            Op::Add { .. } => OpName::Add,
            Op::Allocate { .. } => OpName::Allocate,
            Op::Computed { .. } => OpName::Computed,
            Op::Append { .. } => OpName::Append,
            Op::Preempt { .. } => OpName::Preempt,
            Op::Free { .. } => OpName::Free,
        }
    }
    /// The request the op names.
    pub fn req(&self) -> &str {
        match self {
            Op::Add { req, .. }
            | Op::Allocate { req, .. }
            | Op::Computed { req, .. }
            | Op::Append { req, .. }
            | Op::Preempt { req }
            | Op::Free { req } => req,
        }
    }
}

impl fmt::Display for Op {
    /// The op as its JSON line (falls back to name + request).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match serde_json::to_string(self) {
            Ok(s) => f.write_str(&s),
            Err(_) => write!(f, "{} {:?}", self.name(), self.req()),
        }
    }
}

/// A parsed trace: the ops, in order, and the 1-based line each came from.
#[derive(Debug, Clone, Default)]
pub struct OpTrace {
    /// File (or label) the ops were read from; used in error messages.
    pub source: PathBuf,
    /// The operations. Shape: [num_ops].
    pub ops: Vec<Op>,
    /// Source line of each op (1-based). Shape: [num_ops].
    pub lines: Vec<usize>,
}

impl OpTrace {
    /// A trace built in memory (line i+1 for op i).
    pub fn from_ops(source: impl Into<PathBuf>, ops: Vec<Op>) -> Self {
        let lines = (1..=ops.len()).collect();
        Self {
            source: source.into(),
            ops,
            lines,
        }
    }
    /// `path:line N` of op `i`.
    pub fn place(&self, i: usize) -> String {
        match self.lines.get(i) {
            Some(l) => format!("{}:line {l}", self.source.display()),
            None => format!("{}:op {i}", self.source.display()),
        }
    }
}

/// Read a JSON-lines trace (blank lines are skipped).
pub fn parse_ops(path: impl AsRef<Path>) -> Result<OpTrace> {
    let path = path.as_ref();
    let f = std::fs::File::open(path).map_err(|e| ExperimentError::io(path, e))?;
    parse_ops_reader(std::io::BufReader::new(f), path)
}

/// Read a JSON-lines trace from a reader; `source` names it in errors.
///
/// Errors: `source:line N: expected one JSON object per line: <msg> (column C)`
/// for malformed JSON, `source:line N: invalid operation: <msg>` for a
/// well-formed object that is not an op (unknown `op`, missing or unknown field,
/// wrong type).
pub fn parse_ops_reader<R: BufRead>(reader: R, source: &Path) -> Result<OpTrace> {
    let mut trace = OpTrace {
        source: source.to_path_buf(),
        ..OpTrace::default()
    };
    for (k, line) in reader.lines().enumerate() {
        let n = k + 1;
        let line = line.map_err(|e| ExperimentError::io(source, e))?;
        let line = match (k, line.strip_prefix('\u{feff}')) {
            (0, Some(rest)) => rest.to_string(),
            _ => line,
        };
        if line.trim().is_empty() {
            continue;
        }
        let op: Op = serde_json::from_str(&line).map_err(|e| {
            let msg = if e.is_data() {
                format!("invalid operation: {} (expected {})", json_msg(&e), OP_HELP)
            } else {
                format!(
                    "expected one JSON object per line: {} (column {})",
                    json_msg(&e),
                    e.column()
                )
            };
            ExperimentError::Parse {
                path: source.to_path_buf(),
                at: format!("line {n}"),
                msg,
            }
        })?;
        trace.ops.push(op);
        trace.lines.push(n);
    }
    Ok(trace)
}

const OP_HELP: &str = "{\"op\": \"add\"|\"allocate\"|\"computed\"|\"append\"|\"preempt\"|\"free\", \"req\": <string>, ...} as in docs/kv-replay-format.md";

// ---------------------------------------------------------------------------
// Output records
// ---------------------------------------------------------------------------

/// The output record of one op: `{"i": .., "op": .., "blocks"?: .., "free": ..}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpResult {
    /// Index of the op in the trace.
    pub i: usize,
    /// The op's name.
    pub op: OpName,
    /// For `allocate` only: the outcome (`NoFit` serializes as `null`).
    pub blocks: Option<AllocOutcome>,
    /// Free blocks after the op (excludes the null block).
    pub free: u64,
}

impl Serialize for OpResult {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(if self.blocks.is_some() { 4 } else { 3 }))?;
        m.serialize_entry("i", &self.i)?;
        m.serialize_entry("op", &self.op)?;
        match &self.blocks {
            None => {}
            Some(AllocOutcome::NoFit) => m.serialize_entry("blocks", &())?,
            Some(AllocOutcome::Allocated(b)) => m.serialize_entry("blocks", b)?,
        }
        m.serialize_entry("free", &self.free)?;
        m.end()
    }
}

impl OpResult {
    /// The record as one JSON line (no trailing newline).
    pub fn to_json(&self) -> String {
        // A map of integers, strings and integer lists cannot fail to serialize.
        serde_json::to_string(self).unwrap_or_default()
    }
}

// ---------------------------------------------------------------------------
// The replayer
// ---------------------------------------------------------------------------

/// A request as the replayer tracks it (the fields of vLLM's `Request` that
/// `allocate_slots` reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReqState {
    /// Slot in the manager's tables.
    pub slot: ReqSlot,
    /// vLLM `num_computed_tokens`.
    pub num_computed_tokens: u64,
    /// vLLM `num_tokens` (prompt + appended outputs).
    pub num_tokens: u64,
    /// vLLM `num_prompt_tokens`.
    pub num_prompt_tokens: u64,
    /// WAITING until a successful allocate, PREEMPTED after preempt.
    pub status: RequestStatus,
    /// Token slots of the last successful allocate (`computed + num_new_tokens +
    /// lookahead`); 0 before any and after preempt. `computed` may not go beyond it.
    pub allocated_slots: u64,
}

impl ReqState {
    /// The view `allocate_slots` takes (synchronous: nothing in flight).
    pub fn view(&self) -> RequestView {
        RequestView {
            slot: self.slot,
            num_computed_tokens: self.num_computed_tokens,
            num_tokens: self.num_tokens,
            num_prompt_tokens: self.num_prompt_tokens,
            status: self.status,
            num_in_flight_tokens: 0,
        }
    }
}

/// Options of a replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Run vLLM's startup check (`planning::check_startup`): refuse a pool that
    /// cannot hold one max_model_len request. Off by default: goldens use tiny pools.
    pub check_startup: bool,
}

/// Counters over a replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReplaySummary {
    /// Ops applied.
    pub ops: u64,
    /// `allocate` ops applied.
    pub allocations: u64,
    /// `allocate` ops that returned `null` (NoFit).
    pub failures: u64,
    /// Blocks handed out by successful allocations.
    pub blocks_allocated: u64,
    /// Requests still known at the end.
    pub live_requests: u64,
    /// Free blocks at the end.
    pub final_free: u64,
    /// Usable blocks of the pool (num_blocks - 1).
    pub usable_blocks: u64,
}

/// Request ids are short local strings: SipHash's DoS resistance buys nothing here
/// and cost a third of replay time, so the table uses rustc's FxHash (`rustc-hash`).
type FxBuild = rustc_hash::FxBuildHasher;

/// Streaming replayer: owns a [`KvCacheManager`] and the request table.
#[derive(Debug)]
pub struct Replayer {
    kv: KvCacheManager,
    reqs: HashMap<String, ReqState, FxBuild>,
    free_slots: Vec<ReqSlot>,
    next_slot: u32,
    next_i: usize,
    summary: ReplaySummary,
}

impl Replayer {
    /// A replayer over a fresh manager for `layout` (pool from `num_blocks` or bytes).
    pub fn new(layout: &KvLayout) -> Result<Self> {
        Self::with_options(layout, ReplayOptions::default())
    }

    /// Like [`Replayer::new`], optionally running vLLM's startup check.
    pub fn with_options(layout: &KvLayout, opts: ReplayOptions) -> Result<Self> {
        let kv = KvCacheManager::from_layout(layout)
            .map_err(|e| ExperimentError::engine("layout", e))?;
        if opts.check_startup {
            planning::check_startup(layout, kv.pool().num_blocks())
                .map_err(|e| ExperimentError::engine("startup check", e))?;
        }
        Ok(Self {
            kv,
            reqs: HashMap::default(),
            free_slots: Vec::new(),
            next_slot: 0,
            next_i: 0,
            summary: ReplaySummary::default(),
        })
    }

    /// The manager (read-only), for invariant checks.
    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    /// A known request's state.
    pub fn request(&self, id: &str) -> Option<&ReqState> {
        self.reqs.get(id)
    }

    /// Every known request (arbitrary order).
    pub fn requests(&self) -> impl Iterator<Item = (&str, &ReqState)> {
        self.reqs.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Index the next op will get.
    pub fn next_index(&self) -> usize {
        self.next_i
    }

    /// Counters so far.
    pub fn summary(&self) -> ReplaySummary {
        ReplaySummary {
            live_requests: self.reqs.len() as u64,
            final_free: self.kv.num_free_blocks(),
            usable_blocks: self.kv.usable_blocks(),
            ..self.summary
        }
    }

    /// Apply one op. Errors name the op (`op i (<json>)`) and leave all state unchanged.
    pub fn apply(&mut self, op: &Op) -> Result<OpResult> {
        let i = self.next_i;
        let blocks = self
            .step(op)
            .map_err(|source| ExperimentError::engine(format!("op {i} {op}"), source))?;
        self.next_i += 1;
        self.summary.ops += 1;
        if let Some(b) = &blocks {
            self.summary.allocations += 1;
            match b {
                AllocOutcome::NoFit => self.summary.failures += 1,
                AllocOutcome::Allocated(v) => {
                    self.summary.blocks_allocated += v.iter().map(|g| g.len() as u64).sum::<u64>()
                }
            }
        }
        Ok(OpResult {
            i,
            op: op.name(),
            blocks,
            free: self.kv.num_free_blocks(),
        })
    }

    /// Apply every op of a trace in order, handing each record to `sink`.
    /// Errors are prefixed with the op's `path:line N`.
    pub fn run<F>(&mut self, trace: &OpTrace, mut sink: F) -> Result<()>
    where
        F: FnMut(&OpResult) -> Result<()>,
    {
        for (k, op) in trace.ops.iter().enumerate() {
            let r = self.apply(op).map_err(|e| locate(e, &trace.place(k)))?;
            sink(&r)?;
        }
        Ok(())
    }

    fn get_mut(&mut self, id: &str) -> std::result::Result<&mut ReqState, EngineError> {
        self.reqs.get_mut(id).ok_or_else(|| unknown(id))
    }

    fn step(&mut self, op: &Op) -> std::result::Result<Option<AllocOutcome>, EngineError> {
        match op {
            Op::Add { req, prompt_len } => self.op_add(req, *prompt_len),
            Op::Allocate { req, .. } => self.op_allocate(req, op),
            Op::Computed { req, n } => self.op_computed(req, *n),
            Op::Append { req, n } => {
                let s = self.get_mut(req)?;
                s.num_tokens =
                    s.num_tokens
                        .checked_add(*n)
                        .ok_or_else(|| EngineError::BadTokenCount {
                            req: format!("{req:?}"),
                            reason: format!("num_tokens {} + {n} overflows", s.num_tokens),
                        })?;
                Ok(None)
            }
            Op::Preempt { req } => {
                let st = self
                    .reqs
                    .get_mut(req.as_str())
                    .ok_or_else(|| unknown(req))?;
                self.kv.free(st.slot);
                st.num_computed_tokens = 0;
                st.allocated_slots = 0;
                st.status = RequestStatus::Preempted;
                Ok(None)
            }
            Op::Free { req } => {
                let st = self.reqs.remove(req.as_str()).ok_or_else(|| unknown(req))?;
                self.kv.free(st.slot);
                self.free_slots.push(st.slot);
                Ok(None)
            }
        }
    }

    /// `add`: a new waiting request.
    fn op_add(
        &mut self,
        req: &str,
        prompt_len: u64,
    ) -> std::result::Result<Option<AllocOutcome>, EngineError> {
        let prompt_len = &prompt_len;
        if self.reqs.contains_key(req) {
            return Err(EngineError::DuplicateRequest {
                req: format!("{req:?}"),
            });
        }
        let mml = self.kv.max_model_len();
        if *prompt_len > mml {
            return Err(EngineError::PromptTooLong {
                req: format!("{req:?}"),
                prompt_len: *prompt_len,
                max_model_len: mml,
            });
        }
        if *prompt_len == 0 {
            return Err(EngineError::BadTokenCount {
                req: format!("{req:?}"),
                reason: "prompt_len must be > 0".into(),
            });
        }
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                let s = ReqSlot(self.next_slot);
                self.next_slot = self.next_slot.checked_add(1).ok_or_else(|| {
                    EngineError::Unsupported("more than 2^32 live requests".into())
                })?;
                s
            }
        };
        let st = ReqState {
            slot,
            num_computed_tokens: 0,
            num_tokens: *prompt_len,
            num_prompt_tokens: *prompt_len,
            status: RequestStatus::Waiting,
            allocated_slots: 0,
        };
        self.reqs.insert(req.to_string(), st);
        Ok(None)
    }

    /// `allocate`: one `allocate_slots` call.
    fn op_allocate(
        &mut self,
        req: &str,
        op: &Op,
    ) -> std::result::Result<Option<AllocOutcome>, EngineError> {
        let Op::Allocate {
            num_new_tokens,
            lookahead,
            must_fit,
            has_scheduled_reqs,
            ..
        } = op
        else {
            return Ok(None);
        };
        // One lookup: `reqs` and `kv` are disjoint fields.
        let st = self
            .reqs
            .get_mut(req)
            .ok_or_else(|| unknown(req))?;
        if *num_new_tokens == 0 {
            return Err(EngineError::ZeroTokenAllocation {
                req: format!("{req:?}"),
            });
        }
        let args = AllocArgs {
            num_new_tokens: *num_new_tokens,
            num_lookahead_tokens: *lookahead,
            full_sequence_must_fit: *must_fit,
            has_scheduled_reqs: *has_scheduled_reqs,
        };
        let out = self.kv.allocate_slots(&st.view(), args)?;
        if matches!(out, AllocOutcome::Allocated(_)) {
            // allocate_slots refused any overflow of this sum above.
            st.allocated_slots = st
                .num_computed_tokens
                .saturating_add(*num_new_tokens)
                .saturating_add(*lookahead);
            if matches!(st.status, RequestStatus::Waiting | RequestStatus::Preempted) {
                st.status = RequestStatus::Running;
            }
        }
        Ok(Some(out))
    }

    /// `computed`: advance (or roll back) the computed tokens within the allocated slots.
    fn op_computed(
        &mut self,
        req: &str,
        n: i64,
    ) -> std::result::Result<Option<AllocOutcome>, EngineError> {
        let n = &n;
        let s = self.get_mut(req)?;
        let new = i128::from(s.num_computed_tokens) + i128::from(*n);
        let new = u64::try_from(new).map_err(|_| EngineError::BadTokenCount {
            req: format!("{req:?}"),
            reason: format!(
                "num_computed_tokens {} + {n} is out of range (would go below 0)",
                s.num_computed_tokens
            ),
        })?;
        if new > s.allocated_slots {
            return Err(EngineError::BadTokenCount {
                req: format!("{req:?}"),
                reason: format!(
                    "num_computed_tokens {} + {n} = {new} is beyond the {} token slots the last allocate gave the request (num_tokens {}): computed tokens need KV slots, allocate them first",
                    s.num_computed_tokens, s.allocated_slots, s.num_tokens
                ),
            });
        }
        s.num_computed_tokens = new;
        Ok(None)
    }
}

fn unknown(id: &str) -> EngineError {
    EngineError::UnknownRequest {
        req: format!("{id:?}"),
    }
}

/// Prefix an error from [`Replayer::apply`] with where the op came from.
pub fn locate(e: ExperimentError, place: &str) -> ExperimentError {
    match e {
        ExperimentError::Engine { context, error } => ExperimentError::Engine {
            context: format!("{place}: {context}"),
            error,
        },
        other => other,
    }
}

/// Load a layout and a trace and replay it, collecting every record.
pub fn replay_files(
    layout: &Path,
    ops: &Path,
    opts: ReplayOptions,
) -> Result<(Vec<OpResult>, ReplaySummary)> {
    let layout_v = load_layout(layout)?;
    let trace = parse_ops(ops)?;
    let mut r = Replayer::with_options(&layout_v, opts)
        .map_err(|e| locate(e, &layout.display().to_string()))?;
    let mut out = Vec::with_capacity(trace.ops.len());
    r.run(&trace, |res| {
        out.push(res.clone());
        Ok(())
    })?;
    Ok((out, r.summary()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use speclab_engine::kv::GroupSpec;

    fn layout(num_blocks: u32) -> KvLayout {
        KvLayout {
            num_blocks: Some(num_blocks),
            kv_cache_memory_bytes: None,
            max_model_len: 64,
            max_in_flight_tokens: None,
            watermark: 0.0,
            groups: vec![GroupSpec::full("full", 4)],
        }
    }

    fn ops(lines: &str) -> Vec<Op> {
        parse_ops_reader(lines.as_bytes(), Path::new("t.jsonl"))
            .unwrap()
            .ops
    }

    #[test]
    fn records_have_the_documented_shape() {
        let mut r = Replayer::new(&layout(4)).unwrap();
        let mut out = vec![];
        for op in ops(r#"{"op":"add","req":"a","prompt_len":6}
               {"op":"allocate","req":"a","num_new_tokens":6}
               {"op":"add","req":"b","prompt_len":8}
               {"op":"allocate","req":"b","num_new_tokens":8,"must_fit":true}
               {"op":"free","req":"a"}"#)
        {
            out.push(r.apply(&op).unwrap().to_json());
        }
        assert_eq!(
            out,
            [
                r#"{"i":0,"op":"add","free":3}"#,
                r#"{"i":1,"op":"allocate","blocks":[[1,2]],"free":1}"#,
                r#"{"i":2,"op":"add","free":1}"#,
                r#"{"i":3,"op":"allocate","blocks":null,"free":1}"#,
                r#"{"i":4,"op":"free","free":3}"#,
            ]
        );
        assert_eq!(r.summary().failures, 1);
        assert_eq!(r.summary().blocks_allocated, 2);
    }

    #[test]
    fn errors_leave_state_unchanged_and_name_the_request() {
        let mut r = Replayer::new(&layout(4)).unwrap();
        r.apply(&Op::Add {
            req: "a".into(),
            prompt_len: 4,
        })
        .unwrap();
        let e = r
            .apply(&Op::Computed {
                req: "a".into(),
                n: -1,
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("op 1") && e.contains("below 0"), "{e}");
        let e = r
            .apply(&Op::Free { req: "zz".into() })
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown request \"zz\""), "{e}");
        let e = r
            .apply(&Op::Allocate {
                req: "a".into(),
                num_new_tokens: 0,
                lookahead: 0,
                must_fit: false,
                has_scheduled_reqs: true,
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_new_tokens = 0"), "{e}");
        assert!(r
            .apply(&Op::Add {
                req: "a".into(),
                prompt_len: 4
            })
            .is_err());
        assert!(r
            .apply(&Op::Add {
                req: "b".into(),
                prompt_len: 65
            })
            .is_err());
        assert!(r
            .apply(&Op::Add {
                req: "b".into(),
                prompt_len: 0
            })
            .is_err());
        assert_eq!(r.next_index(), 1);
        assert_eq!(r.request("a").unwrap().num_computed_tokens, 0);
    }

    #[test]
    fn preempt_and_free_reuse_slots() {
        let mut r = Replayer::new(&layout(8)).unwrap();
        for op in ops(r#"{"op":"add","req":"a","prompt_len":6}
               {"op":"allocate","req":"a","num_new_tokens":6}
               {"op":"computed","req":"a","n":6}
               {"op":"preempt","req":"a"}
               {"op":"free","req":"a"}
               {"op":"add","req":"b","prompt_len":6}"#)
        {
            r.apply(&op).unwrap();
        }
        assert_eq!(r.request("b").unwrap().slot, ReqSlot(0));
        assert!(r.request("a").is_none());
    }

    #[test]
    fn op_lines_round_trip_with_defaults() {
        let o = ops(r#"{"op":"allocate","req":"x","num_new_tokens":3}"#);
        assert_eq!(
            o[0],
            Op::Allocate {
                req: "x".into(),
                num_new_tokens: 3,
                lookahead: 0,
                must_fit: false,
                has_scheduled_reqs: true
            }
        );
        let back: Op = serde_json::from_str(&o[0].to_string()).unwrap();
        assert_eq!(back, o[0]);
    }

    #[test]
    fn bad_op_lines_name_the_line() {
        let e = parse_ops_reader(
            "\n{\"op\":\"add\",\"req\":\"a\",\"prompt_len\":1}\n{\"op\":\"add\"".as_bytes(),
            Path::new("t.jsonl"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("t.jsonl:line 3: expected one JSON object"),
            "{e}"
        );
        let e = parse_ops_reader(
            "{\"op\":\"grow\",\"req\":\"a\"}".as_bytes(),
            Path::new("t.jsonl"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("t.jsonl:line 1: invalid operation: unknown variant `grow`"),
            "{e}"
        );
        let e = parse_ops_reader(
            "{\"op\":\"free\",\"req\":\"a\",\"x\":1}".as_bytes(),
            Path::new("t.jsonl"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("unknown field `x`"), "{e}");
    }

    #[test]
    fn a_utf8_bom_is_accepted_in_layouts_and_traces() {
        let ron = "\u{feff}(num_blocks: 9, max_model_len: 64, groups: [(name: \"f\", kind: full, block_size: 4)])";
        assert!(parse_layout_ron(ron, Path::new("l.ron")).is_ok());
        let json = "\u{feff}{\"num_blocks\": 9, \"max_model_len\": 64, \"groups\": [{\"name\": \"f\", \"kind\": \"full\", \"block_size\": 4}]}";
        assert!(parse_layout_json(json, Path::new("l.json")).is_ok());
        let ops = "\u{feff}{\"op\":\"add\",\"req\":\"a\",\"prompt_len\":1}\n";
        assert_eq!(
            parse_ops_reader(ops.as_bytes(), Path::new("t.jsonl"))
                .unwrap()
                .ops
                .len(),
            1
        );
    }

    #[test]
    fn layout_errors_name_place_and_field() {
        let p = Path::new("l.ron");
        let e = parse_layout_ron(
            "(max_model_len: 64,\n groups: [(name: \"f\", kind: fulll, block_size: 4)])",
            p,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("l.ron:2:") && e.contains("groups[0].kind"),
            "{e}"
        );
        let e = parse_layout_json("{\"max_model_len\": 64,\n \"groups\": [{\"name\": \"f\", \"kind\": \"full\", \"block_size\": \"4\"}]}", Path::new("l.json"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("l.json:2:") && e.contains("groups[0].block_size"),
            "{e}"
        );
        let l = parse_layout_ron("(num_blocks: 9, max_model_len: 64, groups: [(name: \"f\", kind: full, block_size: 0)])", p).unwrap();
        let e = validate_layout(&l, p).unwrap_err().to_string();
        assert!(
            e.contains("l.ron") && e.contains("block_size") && e.contains("> 0"),
            "{e}"
        );
    }
}
