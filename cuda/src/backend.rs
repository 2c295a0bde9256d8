//! [`CudaBackend`]: the target model's forward pass on the GPU, behind the backend seam.
//!
//! Source: engine/src/model/forward.rs and mtp.rs (the CPU `ModelRunner`: the same
//! protocol of `forward` / `mtp_forward` / `commit_state` / `release`, the same
//! `SeqChunk`, `ForwardOptions`, `ForwardOut`, `MtpChunk`, `MtpOut`), docs/model.md §2
//! and §6 (the op order). The kernel sequence of a step is in `crate::step`.
//!
//! Protocol (identical to the CPU runner, so the CPU stays the oracle): KV and KDA state
//! live in the device pool addressed by the manager's block ids; a snapshot verify
//! writes per-position KDA snapshots to state blocks 1..T-1 and must be followed by
//! [`CudaBackend::commit_state`] before the slot's next chunk.
//!
//! Invariants: one stream; inside a step the host uploads the step's metadata (one
//! copy; plus the MTP hidden rows), launches kernels, and copies outputs out once at
//! the end; no allocation unless the batch outgrows the workspace. With graphs on,
//! [`CudaBackend::forward_greedy`] captures the kernel sequence per (tokens, chunks,
//! logits rows) on first use and replays it afterwards (metadata is uploaded before
//! the replay; every other kernel argument is fixed per key).

use std::collections::HashMap;

use cudarc::driver::sys::{CUgraphInstantiate_flags_enum, CUstreamCaptureMode_enum};
use cudarc::driver::CudaGraph;
use speclab_engine::kv::KvCacheManager;
use speclab_engine::model::{
    ForwardOptions, ForwardOut, LogitsRows, ModelConfig, ModelWeights, MtpChunk, MtpOut,
    RouterTrace, SeqChunk,
};
use speclab_engine::ReqSlot;

use crate::buf::DevBuf;
use crate::device::Gpu;
use crate::error::{CudaError, Result};
use crate::kvpool::KvGeometry;
use crate::meta::{self, ChunkIn, MetaDims, StepMeta};
use crate::ops;
use crate::step::{Collect, StepKind};
use crate::weights::DeviceWeights;
use crate::workspace::{grow_to, Sizes, Workspace};

/// Options of a [`CudaBackend`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// Capture / replay `forward_greedy` steps as CUDA graphs.
    pub use_graphs: bool,
    /// Offer the device sampler (`crate::sample`) to the step loop: sampled steps keep
    /// their logits on the device. Off: they cross to the host and are sampled there.
    pub device_sampling: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            device: 0,
            use_graphs: true,
            // `SPECLAB_DEVICE_SAMPLE=0` samples on the host (the A/B reference).
            device_sampling: crate::device::env_on("SPECLAB_DEVICE_SAMPLE"),
        }
    }
}

/// Key of a captured step graph: (tokens, chunks, the step's kind). Everything else a
/// step reads (token ids, positions, block tables, hidden rows) is in device buffers
/// written before the replay, at addresses fixed until the workspace grows (which
/// drops every graph).
pub type GraphKey = (usize, usize, StepKind);

/// Host seconds of `forward_greedy` by phase, summed over calls (the device check's
/// breakdown of where a step's time goes besides the GPU).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostTimes {
    /// Building the step metadata from the KV manager's tables.
    pub meta_s: f64,
    /// Uploading the metadata (and growing buffers).
    pub upload_s: f64,
    /// Launching the step (graph launch, or every kernel eagerly).
    pub launch_s: f64,
    /// Reading the greedy ids back: the wait for the GPU plus the copy.
    pub read_s: f64,
    pub calls: u64,
}

/// Capture the launches `body` issues on the GPU's stream as a CUDA graph; returns it and
/// the kernels it holds. Captured launches do not execute, so they are taken back from
/// [`ops::KERNELS`] (a replay adds them again).
pub(crate) fn capture(gpu: &Gpu, body: impl FnOnce() -> Result<()>) -> Result<(CudaGraph, u64)> {
    let k0 = ops::kernels_executed();
    gpu.stream
        .begin_capture(CUstreamCaptureMode_enum::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| CudaError::driver("begin_capture", e))?;
    let ran = body();
    let ended = gpu.stream.end_capture(CUgraphInstantiate_flags_enum(0));
    let captured = ops::kernels_executed() - k0;
    ops::KERNELS.fetch_sub(captured, std::sync::atomic::Ordering::Relaxed);
    ran?;
    let graph = ended
        .map_err(|e| CudaError::driver("end_capture", e))?
        .ok_or_else(|| CudaError::driver("end_capture", "no graph was captured"))?;
    Ok((graph, captured))
}

/// [`capture`], then the graph uploaded and the capture's host time counted
/// ([`ops::note_capture`]): every captured graph of the engine (steps, MTP chains, the
/// DFlash drafter's block) goes through here.
pub(crate) fn capture_uploaded(
    gpu: &Gpu,
    body: impl FnOnce() -> Result<()>,
) -> Result<(CudaGraph, u64)> {
    let t0 = std::time::Instant::now();
    let (graph, n) = capture(gpu, body)?;
    graph
        .upload()
        .map_err(|e| CudaError::driver("graph upload", e))?;
    ops::note_capture(t0);
    Ok((graph, n))
}

/// Replay a captured graph (`what` names it in errors), its kernels counted as executed.
pub(crate) fn launch_captured(g: Option<&(CudaGraph, u64)>, what: &str) -> Result<()> {
    let (g, n) = g.ok_or_else(|| CudaError::Input(format!("{what} graph vanished (internal)")))?;
    ops::KERNELS.fetch_add(*n, std::sync::atomic::Ordering::Relaxed);
    g.launch()
        .map_err(|e| CudaError::driver(format!("{what} graph launch"), e))
}

/// The use of a step shape at which its CUDA graph is captured (earlier uses run
/// eagerly). vLLM captures a fixed list of batch sizes at start-up and pads every batch
/// to one of them (`compilation_config.cudagraph_capture_sizes`); this engine captures
/// lazily, inside the step that first needs a shape, and some shapes occur only once or
/// twice (an MTP first pass of a new total of accepted rows, the last steps of a run as
/// requests finish). A capture costs about as much host time as two eager launches of
/// the step save over replays (runs/ab-28d863c/bench-e2e-pdl.json: 0.2-0.9 ms a capture
/// at c = 8..128, `capture_us_per_step`), so a shape is captured at its third use
/// (`SPECLAB_CAPTURE_AT=n` sets another, for an A/B in one device call; 1 = at once).
pub const CAPTURE_AT_USE: u32 = 3;

/// [`CAPTURE_AT_USE`], or the use `env` (`SPECLAB_CAPTURE_AT`) names (at least 1).
pub fn capture_at_use(env: Option<&str>) -> u32 {
    env.and_then(|v| v.trim().parse::<u32>().ok())
        .map_or(CAPTURE_AT_USE, |n| n.max(1))
}

/// Uses of each graph key so far ([`CAPTURE_AT_USE`]).
#[derive(Debug)]
pub(crate) struct Sightings<K: std::hash::Hash + Eq> {
    seen: HashMap<K, u32>,
    at: u32,
}

impl<K: std::hash::Hash + Eq> Default for Sightings<K> {
    fn default() -> Self {
        Self::at(capture_at_use(
            std::env::var("SPECLAB_CAPTURE_AT").ok().as_deref(),
        ))
    }
}

impl<K: std::hash::Hash + Eq> Sightings<K> {
    /// Capture at use `at` (>= 1).
    pub(crate) fn at(at: u32) -> Self {
        Self {
            seen: HashMap::new(),
            at: at.max(1),
        }
    }

    /// Count a use of `key`; true once it has been used `at` times.
    #[must_use]
    pub(crate) fn capture_now(&mut self, key: K) -> bool {
        let n = self.seen.entry(key).or_insert(0);
        *n = n.saturating_add(1);
        *n >= self.at
    }
}

/// Longest chunk of a step that is captured as a graph: decode and verify chunks
/// (1 + N tokens) are; a prefill chunk's shape rarely repeats, so it runs eagerly.
pub const GRAPH_MAX_CHUNK: usize = 16;

/// Whether a step of chunks of these lengths is replayed from a graph.
fn graph_sized(mut lens: impl Iterator<Item = usize>) -> bool {
    lens.all(|n| n <= GRAPH_MAX_CHUNK)
}

/// The CUDA target backend.
pub struct CudaBackend {
    pub(crate) gpu: Gpu,
    pub(crate) w: DeviceWeights,
    pub(crate) geo: KvGeometry,
    /// The KV / state pool. Shape: [num_blocks * floats_per_block] f32.
    pub(crate) pool: DevBuf<f32>,
    pub(crate) sizes: Sizes,
    pub(crate) ws: Workspace,
    /// The step metadata (crate::meta layout). Shape: [capacity] i32.
    pub(crate) meta: DevBuf<i32>,
    pub(crate) dims: MetaDims,
    /// Slots whose last chunk was a snapshot verify: slot -> chunk length.
    pending: HashMap<ReqSlot, usize>,
    /// Captured steps and the kernels each holds.
    graphs: HashMap<GraphKey, (CudaGraph, u64)>,
    /// Uses of each step shape (a graph is captured at its [`CAPTURE_AT_USE`]-th).
    sightings: Sightings<GraphKey>,
    /// Captured MTP chains (every pass of a step in one graph, `crate::mtp_graph`) and
    /// the kernels each holds, by the passes' (tokens, chunks).
    pub(crate) chain_graphs: HashMap<crate::mtp_graph::ChainKey, (CudaGraph, u64)>,
    /// Uses of each chain shape.
    pub(crate) chain_sightings: Sightings<crate::mtp_graph::ChainKey>,
    opts: CudaOptions,
    /// Per-layer hidden states (collect_hidden). Shape: [(L + 1) * t_cap * H].
    pub(crate) per_layer: Option<DevBuf<f32>>,
    /// Router ids / weights per MoE layer (collect_router). Shape: [n_moe * t_cap * k].
    pub(crate) router: Option<(DevBuf<i32>, DevBuf<f32>)>,
    /// The first graph capture / replay failure (graphs are off after it).
    graph_error: Option<String>,
    /// Per-layer slots a device drafter reads (`Collect::hidden_mask`; 0 = all).
    device_hidden_mask: u64,
    /// Host copy of the bf16 embedding for `SharedHead::embed`. Shape: [V, H] bf16 bits.
    pub(crate) embed_host: Vec<u16>,
    /// Rows of `Workspace::hidden` holding the last target forward's final hidden (the
    /// on-device MTP chain's input); `None` once an MTP pass or a new workspace
    /// overwrote them.
    pub(crate) final_hidden_rows: Option<usize>,
    /// Buffers of the on-device MTP chain (`crate::mtp`), made at its first step.
    pub(crate) chain: Option<crate::mtp::ChainBufs>,
    /// The chunks of the last target forward: (slot, start position, tokens), in row
    /// order (the MTP chain pads its first pass to them).
    pub(crate) last_chunks: Vec<(ReqSlot, usize, usize)>,
    /// Phase times of `forward_greedy` calls (reset by the caller).
    pub host_times: HostTimes,
    /// Logits rows `Workspace::logits` holds from the last target step (`None` after an
    /// MTP step or a new workspace): what the device sampler may read.
    pub(crate) logit_rows: Option<usize>,
    /// The device sampler's buffers, made at its first call.
    pub(crate) sample_bufs: Option<crate::sample::SampleBufs>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("gpu", &self.gpu)
            .field("weight_bytes", &self.w.bytes)
            .field("kv", &self.geo)
            .field("graphs", &self.graphs.len())
            .finish()
    }
}

impl CudaBackend {
    /// Upload `weights` to device 0 and allocate the KV pool for `kv`'s pool and groups.
    pub fn new(weights: &ModelWeights, kv: &KvCacheManager) -> Result<Self> {
        Self::with_options(weights, kv, CudaOptions::default())
    }

    /// [`Self::new`] with options.
    pub fn with_options(
        weights: &ModelWeights,
        kv: &KvCacheManager,
        opts: CudaOptions,
    ) -> Result<Self> {
        let cfg = &weights.cfg;
        cfg.validate()?;
        let geo = KvGeometry::new(cfg, kv)?;
        let gpu = Gpu::new(opts.device)?;
        let w = DeviceWeights::upload(weights, &gpu.stream)?;
        let pool = DevBuf::<f32>::zeros(&gpu.stream, geo.total_floats()?, "KV pool")?;
        let sizes = Sizes::new(cfg);
        let ws = Workspace::new(&gpu.stream, &sizes, 16, 16)?;
        let dims = MetaDims {
            vocab: cfg.vocab_size,
            block_size: geo.block_size,
            max_blocks: if geo.block_size == 0 {
                0
            } else {
                cfg.max_position_embeddings.div_ceil(geo.block_size)
            },
            max_state: geo.state_blocks,
            num_blocks: geo.num_blocks,
            max_pos: cfg.max_position_embeddings,
            full_group: geo.full_group,
            state_group: geo.state_group,
        };
        let meta = DevBuf::<i32>::zeros(&gpu.stream, 4096, "step metadata")?;
        gpu.sync()?;
        Ok(Self {
            gpu,
            w,
            geo,
            pool,
            sizes,
            ws,
            meta,
            dims,
            pending: HashMap::new(),
            graphs: HashMap::new(),
            sightings: Sightings::default(),
            chain_graphs: HashMap::new(),
            chain_sightings: Sightings::default(),
            opts,
            per_layer: None,
            router: None,
            graph_error: None,
            device_hidden_mask: 0,
            host_times: HostTimes::default(),
            logit_rows: None,
            sample_bufs: None,
            final_hidden_rows: None,
            chain: None,
            last_chunks: Vec::new(),
            embed_host: crate::repack::to_bf16(&weights.embed, "model.embed_tokens")?,
        })
    }

    /// The model config.
    pub fn config(&self) -> &ModelConfig {
        &self.w.cfg
    }
    /// Device name and NVRTC architecture.
    pub fn device(&self) -> (&str, &str) {
        (&self.gpu.name, &self.gpu.arch)
    }
    /// Weight bytes on the device.
    pub fn weight_bytes(&self) -> usize {
        self.w.bytes
    }
    /// Turn graph capture / replay on or off (off drops captured graphs).
    /// A drafter on this device reads only these per-layer slots (bit `l` = slot `l`,
    /// 0 = the embeddings) of forwards with `ForwardOptions::hidden_on_device`; the other
    /// slots are not copied. `0` = all.
    pub fn keep_hidden_layers(&mut self, mask: u64) {
        self.device_hidden_mask = mask;
    }

    /// Whether kernels launch with programmatic dependent launch (`Gpu::pdl`).
    pub fn programmatic_launch(&self) -> bool {
        self.gpu.pdl.get()
    }

    /// Whether steps are replayed from CUDA graphs (the device drafter follows it).
    pub fn graphs_on(&self) -> bool {
        self.opts.use_graphs
    }

    pub fn set_graphs(&mut self, on: bool) {
        self.opts.use_graphs = on;
        if !on {
            self.drop_graphs();
        }
    }
    /// Kernel launches issued so far (captured launches count once, at capture).
    pub fn launches(&self) -> u64 {
        self.gpu.launches.get()
    }

    /// Device copy bandwidth in GB/s (bytes read + written) of `bytes`-byte copies with
    /// the engine's own copy kernel: 2 warm-up copies, then 10 timed, host-timed.
    pub fn copy_bandwidth_gbs(&self, bytes: usize) -> Result<f64> {
        let n = bytes / 4;
        let a = DevBuf::<f32>::zeros(&self.gpu.stream, n, "bandwidth src")?;
        let b = DevBuf::<f32>::zeros(&self.gpu.stream, n, "bandwidth dst")?;
        for _ in 0..2 {
            ops::copy(&self.gpu, &b, 0, &a, 0, n)?;
        }
        self.gpu.sync()?;
        let t0 = std::time::Instant::now();
        for _ in 0..10 {
            ops::copy(&self.gpu, &b, 0, &a, 0, n)?;
        }
        self.gpu.sync()?;
        Ok((2 * 10 * 4 * n) as f64 / t0.elapsed().as_secs_f64() / 1e9)
    }

    /// Graphs captured so far.
    pub fn num_graphs(&self) -> usize {
        self.graphs.len()
    }

    /// Forget a request's pending snapshot (call when the request is freed or preempted).
    pub fn release(&mut self, slot: ReqSlot) {
        self.pending.remove(&slot);
    }

    /// Check that `kv` is the manager this backend was built for (same pool and groups).
    pub(crate) fn check_manager(&self, kv: &KvCacheManager) -> Result<()> {
        let g = KvGeometry::new(&self.w.cfg, kv)?;
        if g != self.geo {
            return Err(CudaError::Input(format!(
                "this KvCacheManager ({} blocks) is not the one the CudaBackend was built for ({} blocks)",
                g.num_blocks, self.geo.num_blocks
            )));
        }
        Ok(())
    }

    /// Drop every captured step and chain (their addresses moved).
    pub(crate) fn drop_graphs(&mut self) {
        self.graphs.clear();
        self.chain_graphs.clear();
    }

    /// Grow the metadata buffer to hold `n` elements (drops the graphs when it moves).
    pub(crate) fn grow_meta(&mut self, n: usize) -> Result<()> {
        if n > self.meta.len {
            self.meta = DevBuf::zeros(&self.gpu.stream, grow_to(n), "step metadata")?;
            self.drop_graphs();
        }
        Ok(())
    }

    /// Grow the workspace / metadata buffer for a step (drops graphs when anything moved)
    /// and upload its metadata at offset 0 (`m.base` must be 0).
    pub(crate) fn ensure(&mut self, m: &StepMeta, collect: Collect) -> Result<()> {
        if m.base != 0 {
            return Err(CudaError::Input(format!(
                "step metadata at base {} uploaded on its own (internal)",
                m.base
            )));
        }
        let stream = self.gpu.stream.clone();
        if m.t_total > self.ws.t_cap || m.num_seqs > self.ws.s_cap {
            let t = grow_to(m.t_total);
            self.ws = Workspace::new(&stream, &self.sizes, t, grow_to(m.num_seqs).min(t))?;
            self.final_hidden_rows = None;
            self.per_layer = None;
            self.router = None;
            self.drop_graphs();
        }
        self.grow_meta(m.layout.total)?;
        let cfg = &self.w.cfg;
        if collect.hidden && self.per_layer.is_none() {
            let n = (cfg.num_hidden_layers + 1) * self.ws.t_cap * cfg.hidden_size;
            self.per_layer = Some(DevBuf::zeros(&stream, n, "per-layer hidden")?);
        }
        if collect.router && self.router.is_none() {
            let n = (cfg.num_hidden_layers + 1) * self.ws.t_cap * cfg.num_experts_per_tok.max(1);
            self.router = Some((
                DevBuf::zeros(&stream, n, "router ids")?,
                DevBuf::zeros(&stream, n, "router weights")?,
            ));
        }
        self.meta.write(&stream, &m.data, "step metadata")
    }

    fn target_meta(&self, kv: &KvCacheManager, batch: &[SeqChunk<'_>]) -> Result<StepMeta> {
        self.check_manager(kv)?;
        let chunks: Vec<ChunkIn<'_>> = batch
            .iter()
            .map(|c| ChunkIn {
                slot: c.slot,
                tokens: c.tokens,
                start_pos: c.start_pos,
                snapshot: c.snapshot,
            })
            .collect();
        meta::build(&self.dims, kv, &chunks, &|s| self.pending.contains_key(&s))
    }

    /// After a target forward: the slots whose verify awaits `commit_state`, and the
    /// forward's chunk layout (`last_chunks`).
    fn note_pending(&mut self, batch: &[SeqChunk<'_>]) {
        self.last_chunks = batch
            .iter()
            .map(|c| (c.slot, c.start_pos, c.tokens.len()))
            .collect();
        for ch in batch {
            if ch.snapshot {
                self.pending.insert(ch.slot, ch.tokens.len());
            } else {
                self.pending.remove(&ch.slot);
            }
        }
    }

    /// Forward a batch (the CPU `ModelRunner::forward_with` contract): logits rows,
    /// final hidden of every token, optional per-layer hidden and router traces.
    pub fn forward(
        &mut self,
        kv: &KvCacheManager,
        batch: &[SeqChunk<'_>],
        opts: &ForwardOptions,
    ) -> Result<ForwardOut> {
        let m = self.target_meta(kv, batch)?;
        let collect = Collect {
            hidden: opts.collect_hidden,
            router: opts.collect_router,
            hidden_mask: if opts.hidden_on_device {
                self.device_hidden_mask
            } else {
                0
            },
        };
        self.ensure(&m, collect)?;
        let last = opts.logits == LogitsRows::LastPerChunk;
        let kind = StepKind::Target {
            last_rows: last,
            collect,
            argmax: opts.greedy_ids,
        };
        // Graphs for greedy decode / verify steps (their outputs are the argmax ids and the
        // hidden rows); steps that return logits, and prefill chunks, run eagerly.
        // With the device sampler the logits stay on the device too, so such steps are
        // graphed like greedy ones.
        let on_device = opts.greedy_ids || opts.logits_on_device;
        let graphable = on_device && graph_sized(batch.iter().map(|c| c.tokens.len()));
        self.launch_step(&m, kind, graphable)?;
        self.note_pending(batch);
        self.read_target(&m, last, collect, opts)
    }

    /// Forward a batch and return the greedy token of each logits row, computed on the
    /// device (logits and hidden stay there). Uses CUDA graphs when enabled.
    pub fn forward_greedy(
        &mut self,
        kv: &KvCacheManager,
        batch: &[SeqChunk<'_>],
        rows: LogitsRows,
    ) -> Result<Vec<u32>> {
        let t0 = std::time::Instant::now();
        let m = self.target_meta(kv, batch)?;
        let t1 = std::time::Instant::now();
        self.ensure(&m, Collect::default())?;
        let t2 = std::time::Instant::now();
        let last = rows == LogitsRows::LastPerChunk;
        let kind = StepKind::Target {
            last_rows: last,
            collect: Collect::default(),
            argmax: true,
        };
        self.launch_step(&m, kind, true)?;
        let t3 = std::time::Instant::now();
        self.note_pending(batch);
        let r = if last { m.num_seqs } else { m.t_total };
        let ids = self
            .ws
            .argmax
            .read(&self.gpu.stream, 0, r, "greedy tokens")?;
        let h = &mut self.host_times;
        h.meta_s += (t1 - t0).as_secs_f64();
        h.upload_s += (t2 - t1).as_secs_f64();
        h.launch_s += (t3 - t2).as_secs_f64();
        h.read_s += t3.elapsed().as_secs_f64();
        h.calls += 1;
        Ok(ids)
    }

    /// GPU µs per replay of this greedy decode step's graph (captured first if needed),
    /// timed with events over `n` back-to-back replays of the same inputs. The replays
    /// advance the KDA state and rewrite the same KV rows: only for the end of a
    /// measurement.
    pub fn replay_us(
        &mut self,
        kv: &KvCacheManager,
        batch: &[SeqChunk<'_>],
        n: usize,
    ) -> Result<f64> {
        let m = self.target_meta(kv, batch)?;
        self.ensure(&m, Collect::default())?;
        let kind = StepKind::Target {
            last_rows: true,
            collect: Collect::default(),
            argmax: true,
        };
        let key = (m.t_total, m.num_seqs, kind);
        self.replay(key, &m, kind)?;
        self.gpu.sync()?;
        let e0 = self.gpu.timing_event()?;
        for _ in 0..n.max(1) {
            self.replay(key, &m, kind)?;
        }
        let e1 = self.gpu.timing_event()?;
        let ms = e0
            .elapsed_ms(&e1)
            .map_err(|e| CudaError::driver("event elapsed", e))?;
        Ok(f64::from(ms) * 1e3 / n.max(1) as f64)
    }

    /// One eager greedy step with an event after every kernel, the step's metadata
    /// uploaded before the profiler's spin kernel (a pageable upload would wait for it):
    /// GPU µs per kernel name, launches per name (module `device`, `profile_stop`).
    pub fn profile_step(
        &mut self,
        kv: &KvCacheManager,
        batch: &[SeqChunk<'_>],
    ) -> Result<Vec<(String, usize, f64)>> {
        let m = self.target_meta(kv, batch)?;
        self.ensure(&m, Collect::default())?;
        let kind = StepKind::Target {
            last_rows: true,
            collect: Collect::default(),
            argmax: true,
        };
        self.gpu.sync()?;
        self.gpu.profile_start()?;
        let ran = self.run(&m, kind);
        self.note_ran(&m, kind);
        let prof = self.gpu.profile_stop();
        ran?;
        self.note_pending(batch);
        prof
    }

    /// Run one step: replayed as a CUDA graph when graphs are on, the step is
    /// `graphable` and its shape has been used [`CAPTURE_AT_USE`] times, else eagerly.
    pub(crate) fn launch_step(
        &mut self,
        m: &StepMeta,
        kind: StepKind,
        graphable: bool,
    ) -> Result<()> {
        let key = (m.t_total, m.num_seqs, kind);
        let replayed = graphable
            && self.opts.use_graphs
            && (self.graphs.contains_key(&key) || self.sightings.capture_now(key));
        let ran = if replayed {
            self.run_graph(key, m, kind)
        } else {
            self.run(m, kind)
        };
        self.note_ran(m, kind);
        ran
    }

    /// What `Workspace::hidden` holds after a step: a target step's final hidden rows;
    /// an MTP step overwrites them.
    fn note_ran(&mut self, m: &StepMeta, kind: StepKind) {
        self.final_hidden_rows = match kind {
            StepKind::Target { .. } => Some(m.t_total),
            StepKind::Mtp { .. } => None,
        };
        self.logit_rows = match kind {
            StepKind::Target {
                last_rows: true, ..
            } => Some(m.num_seqs),
            StepKind::Target { .. } => Some(m.t_total),
            StepKind::Mtp { .. } => None,
        };
    }

    /// Replay the graph of `key`, capturing it first if needed. A capture that fails
    /// turns graphs off for this backend (recorded in [`Self::graph_error`]) and runs the
    /// step eagerly: nothing ran during the failed capture.
    fn run_graph(&mut self, key: GraphKey, m: &StepMeta, kind: StepKind) -> Result<()> {
        match self.replay(key, m, kind) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.graph_failed(&e);
                self.run(m, kind)
            }
        }
    }

    /// A capture or replay failed: record why and turn graphs off for this backend.
    pub(crate) fn graph_failed(&mut self, e: &CudaError) {
        self.graph_error = Some(e.to_string());
        self.set_graphs(false);
    }

    /// The options it was built with (graphs as last set).
    pub fn options(&self) -> CudaOptions {
        self.opts
    }

    /// Why graph capture / replay failed, if it did (graphs are then off).
    pub fn graph_error(&self) -> Option<&str> {
        self.graph_error.as_deref()
    }

    fn replay(&mut self, key: GraphKey, m: &StepMeta, kind: StepKind) -> Result<()> {
        if !self.graphs.contains_key(&key) {
            let captured = capture_uploaded(&self.gpu, || self.run(m, kind))?;
            self.graphs.insert(key, captured);
        }
        launch_captured(self.graphs.get(&key), "step")
    }

    /// Launch cost in µs per kernel of the engine's smallest kernel (a 4-float copy):
    /// (issued eagerly back to back, replayed from one CUDA graph of 200). Host-timed
    /// over 2,000 launches after a warm-up.
    pub fn launch_cost_us(&self) -> Result<(f64, f64)> {
        let st = self.gpu.stream.clone();
        let a = DevBuf::<f32>::zeros(&st, 4, "launch-cost src")?;
        let b = DevBuf::<f32>::zeros(&st, 4, "launch-cost dst")?;
        let burst = |n: usize| -> Result<()> {
            for _ in 0..n {
                ops::copy(&self.gpu, &b, 0, &a, 0, 4)?;
            }
            Ok(())
        };
        burst(100)?;
        self.gpu.sync()?;
        let t0 = std::time::Instant::now();
        burst(2000)?;
        self.gpu.sync()?;
        let eager = t0.elapsed().as_secs_f64() * 1e6 / 2000.0;
        let (g, _) = capture(&self.gpu, || burst(200))?;
        g.launch()
            .map_err(|e| CudaError::driver("graph launch", e))?;
        self.gpu.sync()?;
        let t0 = std::time::Instant::now();
        for _ in 0..10 {
            g.launch()
                .map_err(|e| CudaError::driver("graph launch", e))?;
        }
        self.gpu.sync()?;
        let graph = t0.elapsed().as_secs_f64() * 1e6 / 2000.0;
        Ok((eager, graph))
    }

    fn read_target(
        &self,
        m: &StepMeta,
        last: bool,
        collect: Collect,
        opts: &ForwardOptions,
    ) -> Result<ForwardOut> {
        let greedy = opts.greedy_ids;
        let cfg = &self.w.cfg;
        let (h, v, t) = (cfg.hidden_size, cfg.vocab_size, m.t_total);
        let st = &self.gpu.stream;
        let r = if last { m.num_seqs } else { t };
        let (logits, argmax) = if greedy {
            (
                Vec::new(),
                Some(self.ws.argmax.read(st, 0, r, "greedy tokens")?),
            )
        } else if opts.logits_on_device {
            (Vec::new(), None)
        } else {
            (self.ws.logits.read(st, 0, r * v, "logits")?, None)
        };
        let hidden = if opts.skip_hidden {
            Vec::new()
        } else {
            self.ws.hidden.read(st, 0, t * h, "hidden")?
        };
        let per_layer_hidden = match (&self.per_layer, collect.hidden) {
            // A drafter on this device reads them from `per_layer` (LayerHidden::Device).
            (Some(_), true) if opts.hidden_on_device => None,
            (Some(p), true) => {
                let cap = self.ws.t_cap * h;
                let mut out = Vec::with_capacity((cfg.num_hidden_layers + 1) * t * h);
                for l in 0..=cfg.num_hidden_layers {
                    out.extend(p.read(st, l * cap, t * h, "per-layer hidden")?);
                }
                Some(out)
            }
            _ => None,
        };
        let router = match (&self.router, collect.router) {
            (Some(buf), true) => Some(
                self.read_router(
                    buf,
                    t,
                    (0..cfg.num_hidden_layers)
                        .filter(|&i| cfg.is_moe_layer(i))
                        .collect(),
                )?,
            ),
            _ => None,
        };
        Ok(ForwardOut {
            logits,
            hidden,
            per_layer_hidden,
            router,
            num_tokens: t,
            argmax,
        })
    }

    /// Router traces of the MoE layers `layers` (in order) from the collect buffers.
    fn read_router(
        &self,
        buf: &(DevBuf<i32>, DevBuf<f32>),
        t: usize,
        layers: Vec<usize>,
    ) -> Result<Vec<RouterTrace>> {
        let k = self.w.cfg.num_experts_per_tok;
        let cap = self.ws.t_cap * k;
        let st = &self.gpu.stream;
        layers
            .into_iter()
            .enumerate()
            .map(|(j, layer)| {
                let ids = buf.0.read(st, j * cap, t * k, "router ids")?;
                let weights = buf.1.read(st, j * cap, t * k, "router weights")?;
                Ok(RouterTrace {
                    layer,
                    ids: ids.into_iter().map(|x| x as u32).collect(),
                    weights,
                })
            })
            .collect()
    }

    /// After a snapshot verify of `T` tokens, keep the first `accepted + 1`: the KDA state
    /// after token `accepted` becomes the committed one (state block 0), one device copy.
    pub fn commit_state(
        &mut self,
        kv: &KvCacheManager,
        slot: ReqSlot,
        accepted: usize,
    ) -> Result<()> {
        self.check_manager(kv)?;
        let len = *self.pending.get(&slot).ok_or_else(|| {
            CudaError::Input(format!(
                "request slot {}: commit_state without a pending snapshot verify",
                slot.0
            ))
        })?;
        if accepted + 1 > len {
            return Err(CudaError::Input(format!(
                "request slot {}: accepted = {accepted} but the verified chunk had {len} tokens (at most {} drafts)",
                slot.0,
                len - 1
            )));
        }
        if accepted + 1 < len {
            if let Some(g) = self.geo.state_group {
                let table = kv.table(g, slot);
                let ok = |b: u32| {
                    b != speclab_engine::kv::NULL_BLOCK && (b as usize) < self.geo.num_blocks
                };
                if table.len() < len || !ok(table[0]) || !ok(table[accepted + 1]) {
                    return Err(CudaError::Input(format!(
                        "request slot {}: state table too short or invalid for commit_state",
                        slot.0
                    )));
                }
                let (src, dst) = (table[accepted + 1] as usize, table[0] as usize);
                let fpb = self.geo.floats_per_block;
                let n = self.geo.n_kda * self.geo.state_page;
                ops::copy(&self.gpu, &self.pool, dst * fpb, &self.pool, src * fpb, n)?;
            }
        }
        self.pending.remove(&slot);
        Ok(())
    }

    /// The MTP layer over (hidden, next token) rows (docs/model.md §6; the CPU
    /// `ModelRunner::mtp_forward` contract).
    pub fn mtp_forward(
        &mut self,
        kv: &KvCacheManager,
        batch: &[MtpChunk<'_>],
        opts: &ForwardOptions,
    ) -> Result<MtpOut> {
        self.check_manager(kv)?;
        let cfg = self.w.cfg.clone();
        if self.w.mtp.is_none() {
            return Err(CudaError::Input(
                "mtp_forward: the model has no MTP layer".into(),
            ));
        }
        let h = cfg.hidden_size;
        for ch in batch {
            if ch.hidden.len() != ch.next_tokens.len() * h {
                return Err(CudaError::Input(format!(
                    "request slot {}: MTP chunk with {} next tokens and {} hidden values (needs [T, {h}])",
                    ch.slot.0,
                    ch.next_tokens.len(),
                    ch.hidden.len()
                )));
            }
        }
        let chunks: Vec<ChunkIn<'_>> = batch
            .iter()
            .map(|c| ChunkIn {
                slot: c.slot,
                tokens: c.next_tokens,
                start_pos: c.start_pos,
                snapshot: false,
            })
            .collect();
        let dims = MetaDims {
            state_group: None,
            ..self.dims
        };
        let m = meta::build(&dims, kv, &chunks, &|_| false)?;
        let collect = Collect {
            hidden: false,
            router: opts.collect_router,
            hidden_mask: 0,
        };
        self.ensure(&m, collect)?;
        let rows: Vec<f32> = batch
            .iter()
            .flat_map(|c| c.hidden.iter().copied())
            .collect();
        let stream = self.gpu.stream.clone();
        self.ws.tmp.write(&stream, &rows, "MTP hidden rows")?;
        let last = opts.logits == LogitsRows::LastPerChunk;
        let kind = StepKind::Mtp {
            last_rows: last,
            collect,
            argmax: opts.greedy_ids,
        };
        let graphable = opts.greedy_ids && graph_sized(batch.iter().map(|c| c.next_tokens.len()));
        self.launch_step(&m, kind, graphable)?;
        let t = m.t_total;
        let r = if last { m.num_seqs } else { t };
        let (logits, argmax) = if opts.greedy_ids {
            let ids = self.ws.argmax.read(&stream, 0, r, "MTP greedy tokens")?;
            (Vec::new(), Some(ids))
        } else {
            let l = self
                .ws
                .logits
                .read(&stream, 0, r * cfg.vocab_size, "MTP logits")?;
            (l, None)
        };
        let hidden = if opts.skip_hidden {
            Vec::new()
        } else {
            self.ws.x.read(&stream, 0, t * h, "MTP hidden")?
        };
        let router = match (&self.router, collect.router) {
            (Some(buf), true) => Some(self.read_router(buf, t, vec![cfg.num_hidden_layers])?),
            _ => None,
        };
        Ok(MtpOut {
            logits,
            hidden,
            router,
            argmax,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_is_captured_at_its_nth_use() {
        let mut s = Sightings::at(3);
        assert!(!s.capture_now(1u32));
        assert!(!s.capture_now(2));
        assert!(!s.capture_now(1));
        assert!(s.capture_now(1), "third use of 1");
        assert!(!s.capture_now(2), "second use of 2");
        let mut once = Sightings::at(0);
        assert!(once.capture_now('a'), "at least 1: at once");
        assert_eq!(capture_at_use(None), CAPTURE_AT_USE);
        assert_eq!(capture_at_use(Some(" 1 ")), 1);
        assert_eq!(capture_at_use(Some("0")), 1);
        assert_eq!(capture_at_use(Some("x")), CAPTURE_AT_USE);
    }

    #[test]
    fn graph_sized_chunks_are_decode_and_verify_chunks() {
        assert!(graph_sized([1usize, 8, GRAPH_MAX_CHUNK].into_iter()));
        assert!(!graph_sized([1usize, GRAPH_MAX_CHUNK + 1].into_iter()));
    }
}
