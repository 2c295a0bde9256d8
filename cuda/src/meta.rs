//! Per-step metadata: everything a step's kernels read that changes from step to step,
//! built on the host, validated, and uploaded in ONE copy into one i32 device buffer.
//!
//! Source: vLLM v1's persistent input buffers (`gpu_model_runner.py`: input ids,
//! positions, block tables and slot mappings copied into fixed buffers before a CUDA
//! graph replays); the validation rules of `engine/src/model/forward.rs::plan` (empty
//! chunk, slot twice, token id >= vocab, uncommitted snapshot, table too short or
//! holding the null block).
//!
//! Layout ([`MetaLayout`], offsets in i32 elements, each section contiguous):
//! `tokens [T]` (u32 bits), `pos [T]`, `tok_seq [T]` (chunk of each token),
//! `block_tables [S, max_blocks]` (the `full` group; unused entries 0), `row0 [S]`,
//! `len [S]`, `pos0 [S]`, `snap [S]`, `state_tables [S, max_state]` (the `kda_state`
//! group), `last_rows [S]` (row of each chunk's last token). `max_blocks` and
//! `max_state` are fixed per backend (from `max_position_embeddings` and
//! `1 + num_speculative_tokens`), so a batch of the same (T, S) has the same layout and
//! the same device addresses: what CUDA-graph replay requires.
//!
//! Invariants: after [`build`] succeeds, every block id a kernel can read for a token
//! (its `full` blocks for positions `0 ..= pos`, its state blocks `0 .. (snapshot ? len :
//! 1)`) is a real block (`!= NULL_BLOCK`, `< num_blocks`); every token id is `< vocab`.

use speclab_engine::kv::{BlockId, KvCacheManager, NULL_BLOCK};
use speclab_engine::ReqSlot;

use crate::error::{CudaError, Result};

/// One contiguous section of the metadata buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Section {
    pub off: usize,
    pub len: usize,
}

impl Section {
    /// The element range.
    pub fn range(self) -> std::ops::Range<usize> {
        self.off..self.off + self.len
    }
}

/// Offsets of every section for `t` tokens in `s` chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MetaLayout {
    pub tokens: Section,
    pub pos: Section,
    pub tok_seq: Section,
    pub block_tables: Section,
    pub row0: Section,
    pub len: Section,
    pub pos0: Section,
    pub snap: Section,
    pub state_tables: Section,
    pub last_rows: Section,
    /// i32 elements in all.
    pub total: usize,
}

impl MetaLayout {
    /// The layout of `t` tokens in `s` chunks.
    pub fn new(t: usize, s: usize, max_blocks: usize, max_state: usize) -> Self {
        let mut off = 0;
        let mut sec = |len: usize| {
            let x = Section { off, len };
            off += len;
            x
        };
        let tokens = sec(t);
        let pos = sec(t);
        let tok_seq = sec(t);
        let block_tables = sec(s * max_blocks);
        let row0 = sec(s);
        let len = sec(s);
        let pos0 = sec(s);
        let snap = sec(s);
        let state_tables = sec(s * max_state);
        let last_rows = sec(s);
        Self {
            tokens,
            pos,
            tok_seq,
            block_tables,
            row0,
            len,
            pos0,
            snap,
            state_tables,
            last_rows,
            total: off,
        }
    }
}

/// The fixed dimensions the metadata is built against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaDims {
    pub vocab: usize,
    /// Tokens per block of the `full` group (0 when the model has none).
    pub block_size: usize,
    /// Width of a block-table row: ceil(max_position_embeddings / block_size).
    pub max_blocks: usize,
    /// Width of a state-table row: 1 + num_speculative_tokens.
    pub max_state: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Positions the device RoPE tables cover (max_position_embeddings).
    pub max_pos: usize,
    /// Index of the `full` group in the manager.
    pub full_group: Option<usize>,
    /// Index of the `kda_state` group.
    pub state_group: Option<usize>,
}

/// One chunk of a step (a target `SeqChunk`, or an MTP chunk with `snapshot = false`).
#[derive(Debug, Clone, Copy)]
pub struct ChunkIn<'a> {
    pub slot: ReqSlot,
    /// Shape: [T_chunk].
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub snapshot: bool,
}

/// A built step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMeta {
    pub layout: MetaLayout,
    /// Shape: [layout.total].
    pub data: Vec<i32>,
    /// Where `data` starts in the backend's metadata buffer (0 for a step uploaded on
    /// its own; the MTP chain uploads every pass at once, `crate::mtp_graph`): the
    /// device offset of a section is `base + off`.
    pub base: usize,
    /// Tokens in the step.
    pub t_total: usize,
    /// Chunks in the step.
    pub num_seqs: usize,
}

impl StepMeta {
    /// The longest chunk's tokens.
    pub fn max_len(&self) -> usize {
        let l = self.layout.len;
        self.data[l.off..l.off + self.num_seqs]
            .iter()
            .map(|&n| n.max(0) as usize)
            .max()
            .unwrap_or(0)
    }

    /// Whether any chunk takes per-token state snapshots (a verify chunk).
    pub fn any_snapshot(&self) -> bool {
        let l = self.layout.snap;
        self.data[l.off..l.off + self.num_seqs]
            .iter()
            .any(|&s| s != 0)
    }
}

fn input(msg: String) -> CudaError {
    CudaError::Input(msg)
}

fn to_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| input(format!("{what} = {v} exceeds i32")))
}

/// "request slot N" in error text, formatted only when an error is built.
#[derive(Clone, Copy)]
struct Who(u32);

impl std::fmt::Display for Who {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "request slot {}", self.0)
    }
}

/// Copy `need` real blocks of `table` into `row` (the rest of `row` stays 0).
fn fill_table(
    row: &mut [i32],
    table: &[BlockId],
    need: usize,
    d: &MetaDims,
    who: &dyn Fn() -> String,
) -> Result<()> {
    if need > row.len() {
        return Err(input(format!(
            "{}: needs {need} blocks, the table row holds {}",
            who(),
            row.len()
        )));
    }
    if table.len() < need {
        return Err(input(format!(
            "{}: table has {} blocks, needs {need}; allocate with KvCacheManager::allocate_slots first",
            who(),
            table.len()
        )));
    }
    let n = table.len().min(row.len());
    for (i, dst) in row.iter_mut().enumerate().take(n) {
        let b = table[i];
        if i < need && (b == NULL_BLOCK || b as usize >= d.num_blocks) {
            return Err(input(format!(
                "{}: table holds block {b}, the null block or outside the pool",
                who()
            )));
        }
        *dst = b as i32;
    }
    Ok(())
}

/// Validate a step and build its metadata. `pending(slot)` says whether the slot's last
/// chunk was a snapshot verify not yet committed.
pub fn build(
    d: &MetaDims,
    kv: &KvCacheManager,
    chunks: &[ChunkIn<'_>],
    pending: &dyn Fn(ReqSlot) -> bool,
) -> Result<StepMeta> {
    if chunks.is_empty() {
        return Err(input("empty batch".into()));
    }
    let t_total: usize = chunks.iter().map(|c| c.tokens.len()).sum();
    let s = chunks.len();
    let layout = MetaLayout::new(t_total, s, d.max_blocks, d.max_state);
    let mut data = vec![0i32; layout.total];
    let mut slots: Vec<u32> = chunks.iter().map(|c| c.slot.0).collect();
    slots.sort_unstable();
    if let Some(w) = slots.windows(2).find(|w| w[0] == w[1]) {
        return Err(input(format!(
            "request slot {} appears twice in one batch",
            w[0]
        )));
    }
    let mut row = 0usize;
    for (ci, ch) in chunks.iter().enumerate() {
        // Error text is built only on an error (this runs for every request every step).
        let who = Who(ch.slot.0);
        let n = ch.tokens.len();
        if n == 0 {
            return Err(input(format!("{who}: empty chunk")));
        }
        if let Some(&bad) = ch.tokens.iter().find(|&&t| t as usize >= d.vocab) {
            return Err(input(format!(
                "{who}: token id {bad} is not below vocab_size {}",
                d.vocab
            )));
        }
        if ch.start_pos > 0 && pending(ch.slot) {
            return Err(input(format!(
                "{who}: the last chunk was a speculative verify with snapshot; call commit_state before the next chunk"
            )));
        }
        let end = ch.start_pos + n;
        if end > d.max_pos {
            return Err(input(format!(
                "{who}: positions up to {end} exceed max_position_embeddings {} (the device RoPE tables)",
                d.max_pos
            )));
        }
        if let Some(g) = d.full_group {
            let need = end.div_ceil(d.block_size);
            let r = &mut data[layout.block_tables.off + ci * d.max_blocks..][..d.max_blocks];
            fill_table(r, kv.table(g, ch.slot), need, d, &|| {
                format!("{who}, group `full`, positions 0..{end}")
            })?;
        }
        if let Some(g) = d.state_group {
            let need = if ch.snapshot { n } else { 1 };
            let r = &mut data[layout.state_tables.off + ci * d.max_state..][..d.max_state];
            fill_table(r, kv.table(g, ch.slot), need, d, &|| {
                format!(
                    "{who}, group `kda_state`, chunk of {n} (snapshot {})",
                    ch.snapshot
                )
            })?;
        }
        for (j, &tok) in ch.tokens.iter().enumerate() {
            data[layout.tokens.off + row + j] = tok as i32;
            data[layout.pos.off + row + j] = to_i32(ch.start_pos + j, "position")?;
            data[layout.tok_seq.off + row + j] = ci as i32;
        }
        data[layout.row0.off + ci] = to_i32(row, "row")?;
        data[layout.len.off + ci] = to_i32(n, "chunk length")?;
        data[layout.pos0.off + ci] = to_i32(ch.start_pos, "start position")?;
        data[layout.snap.off + ci] = i32::from(ch.snapshot);
        data[layout.last_rows.off + ci] = to_i32(row + n - 1, "row")?;
        row += n;
    }
    Ok(StepMeta {
        layout,
        data,
        base: 0,
        t_total,
        num_seqs: s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use speclab_engine::model::ModelConfig;

    fn setup(spec: u32) -> (KvCacheManager, MetaDims) {
        let cfg = ModelConfig::micro();
        let kv = KvCacheManager::from_layout(&cfg.kv_layout(16, spec, 64).unwrap()).unwrap();
        let d = MetaDims {
            vocab: cfg.vocab_size,
            block_size: 16,
            max_blocks: cfg.max_position_embeddings.div_ceil(16),
            max_state: 1 + spec as usize,
            num_blocks: 64,
            max_pos: cfg.max_position_embeddings,
            full_group: Some(0),
            state_group: Some(1),
        };
        (kv, d)
    }

    #[test]
    fn layout_sections_tile_the_buffer() {
        let l = MetaLayout::new(7, 3, 16, 4);
        let secs = [
            l.tokens,
            l.pos,
            l.tok_seq,
            l.block_tables,
            l.row0,
            l.len,
            l.pos0,
            l.snap,
            l.state_tables,
            l.last_rows,
        ];
        let mut off = 0;
        for s in secs {
            assert_eq!(s.off, off);
            off += s.len;
        }
        assert_eq!(off, l.total);
        assert_eq!(l.total, 3 * 7 + 3 * 16 + 4 * 3 + 3 * 4 + 3);
        // Same (T, S) -> same layout (graph replay needs fixed addresses).
        assert_eq!(l, MetaLayout::new(7, 3, 16, 4));
    }

    #[test]
    fn build_fills_and_validates() {
        let (mut kv, d) = setup(3);
        kv.allocate_whole(ReqSlot(0), 20).unwrap();
        kv.allocate_whole(ReqSlot(1), 4).unwrap();
        let a = [1u32, 2, 3, 4, 5];
        let b = [7u32, 8, 9, 10];
        let none = |_: ReqSlot| false;
        let chunks = [
            ChunkIn {
                slot: ReqSlot(0),
                tokens: &a,
                start_pos: 15,
                snapshot: false,
            },
            ChunkIn {
                slot: ReqSlot(1),
                tokens: &b,
                start_pos: 0,
                snapshot: false,
            },
        ];
        let m = build(&d, &kv, &chunks, &none).unwrap();
        let l = m.layout;
        assert_eq!(m.t_total, 9);
        assert_eq!(&m.data[l.pos.range()], &[15, 16, 17, 18, 19, 0, 1, 2, 3]);
        assert_eq!(&m.data[l.tok_seq.range()], &[0, 0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(&m.data[l.row0.range()], &[0, 5]);
        assert_eq!(&m.data[l.last_rows.range()], &[4, 8]);
        let t0 = kv.table(0, ReqSlot(0));
        assert_eq!(m.data[l.block_tables.off], t0[0] as i32);
        assert_eq!(m.data[l.block_tables.off + 1], t0[1] as i32);
        assert_eq!(m.data[l.block_tables.off + 2], 0);
        // Errors: token id, duplicate slot, uncovered positions, pending snapshot, snapshot too long.
        let bad = [600u32];
        assert!(build(
            &d,
            &kv,
            &[ChunkIn {
                slot: ReqSlot(1),
                tokens: &bad,
                start_pos: 0,
                snapshot: false
            }],
            &none
        )
        .is_err());
        assert!(build(&d, &kv, &[chunks[1], chunks[1]], &none).is_err());
        let far = ChunkIn {
            slot: ReqSlot(1),
            tokens: &b,
            start_pos: 30,
            snapshot: false,
        };
        assert!(build(&d, &kv, &[far], &none).is_err());
        let yes = |_: ReqSlot| true;
        assert!(build(&d, &kv, &[chunks[0]], &yes).is_err());
        let snap = ChunkIn {
            slot: ReqSlot(0),
            tokens: &a,
            start_pos: 15,
            snapshot: true,
        };
        assert!(
            build(&d, &kv, &[snap], &none).is_err(),
            "5 > 1 + 3 state blocks"
        );
        assert!(build(&d, &kv, &[], &none).is_err());
    }
}
