//! The host side of the CUDA DFlash2 drafter: which rows a context append writes and
//! where, and the metadata of one batched draft step. Pure host code, tested without a
//! device.
//!
//! Source: docs/dflash2.md §7 (the per-request protocol: append the committed rows in
//! order, `start_pos <= n`; rows at positions `<= end - W` are never visible again and
//! are not written; the anchor sits at position `n`), §5.2 (query row `j` sees context
//! positions `P_j - W + 1 .. P_0 - 1`); `drafters/src/dflash2/forward.rs`
//! (`append_context`, `draft`), whose checks and messages these follow.
//!
//! Invariants: every page slot in a plan comes from [`DraftGroup::locate`] (never a null,
//! missing or out-of-pool block) and fits an `int`; a draft's context list holds
//! positions `ctx_start .. n` in order, at most `W - 1` of them; every token id is below
//! the vocabulary and every position below the RoPE table's length.

use std::collections::HashMap;
use std::ops::Range;

use speclab_drafters::dflash2::{DFlash2Config, DraftGroup};
use speclab_engine::kv::KvCacheManager;
use speclab_engine::ReqSlot;

use crate::error::{CudaError, Result};

/// One request's committed rows of a target forward.
#[derive(Debug, Clone)]
pub struct AppendReq {
    pub slot: ReqSlot,
    /// Rows of the forward (its token order).
    pub rows: Range<usize>,
    /// Absolute position of `rows.start`.
    pub start_pos: usize,
}

/// The rows a batched context append computes: forward row, position and page slot of
/// each, and each request's new context length.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AppendPlan {
    /// Shape: [T].
    pub rows: Vec<i32>,
    /// Shape: [T].
    pub pos: Vec<i32>,
    /// Page slot (`block * bs + offset`). Shape: [T].
    pub slot: Vec<i32>,
    /// `(slot, n)` after the append, in request order.
    pub new_len: Vec<(ReqSlot, usize)>,
}

fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::Unsupported(format!("{what} = {v} exceeds an int")))
}

/// Append the page slots of positions `pos` of request `slot` to `out`: one
/// [`DraftGroup::locate`] per block (its checks included), the block's consecutive slots
/// after it (at c = 128 a draft step lists about 32k context slots).
fn page_slots(
    grp: &DraftGroup,
    kv: &KvCacheManager,
    slot: ReqSlot,
    pos: Range<usize>,
    out: &mut Vec<i32>,
) -> Result<()> {
    let table = kv.table(grp.index, slot);
    let bs = grp.block_size;
    let mut p = pos.start;
    while p < pos.end {
        let (b, off) = grp.locate(table, slot, p)?;
        let run = (bs - off).min(pos.end - p);
        let first = int(b as usize * bs + off, "DFlash2 page slot")?;
        int(b as usize * bs + off + run - 1, "DFlash2 page slot")?;
        out.extend((0..run as i32).map(|i| first + i));
        p += run;
    }
    Ok(())
}

/// Plan the append of `reqs` (their rows of one forward) given the context lengths
/// `ctx_len` so far.
pub fn plan_append(
    cfg: &DFlash2Config,
    grp: &DraftGroup,
    kv: &KvCacheManager,
    ctx_len: &HashMap<ReqSlot, usize>,
    reqs: &[AppendReq],
) -> Result<AppendPlan> {
    let mut p = AppendPlan::default();
    for r in reqs.iter().filter(|r| !r.rows.is_empty()) {
        let n = ctx_len.get(&r.slot).copied().unwrap_or(0);
        if r.start_pos > n {
            return Err(CudaError::Input(format!(
                "request slot {}: append_context at position {}, but only positions 0..{n} have features: context must be appended in order (start_pos <= {n}; 0 restarts)",
                r.slot.0, r.start_pos
            )));
        }
        let end = r.start_pos + r.rows.len();
        let keep_from = r
            .start_pos
            .max((end + 1).saturating_sub(cfg.sliding_window));
        for pos in keep_from..end {
            p.rows
                .push(int(r.rows.start + pos - r.start_pos, "forward row")?);
            p.pos.push(int(pos, "position")?);
        }
        page_slots(grp, kv, r.slot, keep_from..end, &mut p.slot)?;
        p.new_len.push((r.slot, end));
    }
    Ok(p)
}

/// One request of a draft step: its slot and its anchor (the last committed token).
#[derive(Debug, Clone, Copy)]
pub struct DraftAnchor {
    pub slot: ReqSlot,
    pub anchor: u32,
    /// Tokens the request holds (the anchor is the last): must be `n + 1`.
    pub num_tokens: usize,
}

/// The metadata of one batched draft step over `B` requests of `Q = N + 1` rows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraftPlan {
    /// `[anchor, MASK x N]` per request (u32 ids as i32 bits). Shape: [B * Q].
    pub tokens: Vec<i32>,
    /// `n .. n + N` per request. Shape: [B * Q].
    pub pos: Vec<i32>,
    /// `(p0 = n, ctx_start, S)` per request. Shape: [B * 3].
    pub info: Vec<i32>,
    /// Page slots of positions `ctx_start .. n`, padded to `s_max`. Shape: [B * s_max].
    pub ctx_slots: Vec<i32>,
    /// `W - 1`: the most context rows a block sees.
    pub s_max: usize,
}

/// Plan a draft step: the checks of the host drafter's `draft` (context appended, the
/// anchor at position `n`), positions within `max_pos` (the RoPE table's length).
pub fn plan_draft(
    cfg: &DFlash2Config,
    grp: &DraftGroup,
    kv: &KvCacheManager,
    ctx_len: &HashMap<ReqSlot, usize>,
    reqs: &[DraftAnchor],
    num_speculative_tokens: usize,
    max_pos: usize,
) -> Result<DraftPlan> {
    let w = cfg.sliding_window;
    let nn = num_speculative_tokens;
    let s_max = w.saturating_sub(1).max(1);
    let mut p = DraftPlan {
        s_max,
        ..DraftPlan::default()
    };
    let mask = cfg.dflash_config.mask_token_id;
    for r in reqs {
        let n = ctx_len.get(&r.slot).copied().ok_or_else(|| {
            CudaError::Input(format!(
                "request slot {}: no DFlash2 context; append the prompt's target features before drafting",
                r.slot.0
            ))
        })?;
        if r.num_tokens != n + 1 {
            return Err(CudaError::Input(format!(
                "request slot {}: {n} context positions appended but the request holds {} tokens; the anchor must be the only token without a feature",
                r.slot.0, r.num_tokens
            )));
        }
        if r.anchor as usize >= cfg.vocab_size {
            return Err(CudaError::Input(format!(
                "request slot {}: anchor token id {} is not below vocab_size {}",
                r.slot.0, r.anchor, cfg.vocab_size
            )));
        }
        if n + nn >= max_pos {
            return Err(CudaError::Input(format!(
                "request slot {}: the draft block reaches position {}, beyond the drafter's RoPE table ({max_pos} positions)",
                r.slot.0,
                n + nn
            )));
        }
        p.tokens.push(r.anchor as i32);
        p.tokens.extend(std::iter::repeat_n(mask as i32, nn));
        for j in 0..=nn {
            p.pos.push(int(n + j, "position")?);
        }
        let ctx_start = (n + 1).saturating_sub(w);
        p.info.extend([
            int(n, "position")?,
            int(ctx_start, "position")?,
            int(n - ctx_start, "S")?,
        ]);
        let base = p.ctx_slots.len();
        page_slots(grp, kv, r.slot, ctx_start..n, &mut p.ctx_slots)?;
        p.ctx_slots.resize(base + s_max, 0);
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use speclab_engine::kv::CapPolicy;
    use speclab_engine::model::ModelConfig;

    /// The context rows (indices into a request's `ctx_slots`) that block row `j` sees, as
    /// `df2_attention` computes them: `lo .. S` with `lo = max(p0 + j + 1 - W, ctx_start) -
    /// ctx_start`. The host model of the kernel's window, tested against docs/dflash2.md §5.2.
    fn visible_context(info: [i32; 3], j: usize, w: usize) -> Range<usize> {
        let [p0, cs, s] = info.map(|x| x.max(0) as usize);
        let lo = (p0 + j + 1).saturating_sub(w).max(cs) - cs;
        lo.min(s)..s
    }

    fn setup(cap: CapPolicy, tokens: u64) -> (DFlash2Config, DraftGroup, KvCacheManager) {
        let tcfg = ModelConfig::micro();
        let dcfg = DFlash2Config::preset("dflash2-micro").unwrap();
        let mut layout = tcfg.kv_layout(16, 7, 64).unwrap();
        layout.groups.push(dcfg.kv_group(8, cap).unwrap());
        let mut kv = KvCacheManager::new(&layout, 64).unwrap();
        crate::check::alloc(&mut kv, ReqSlot(0), 0, tokens).unwrap();
        let g = speclab_drafters::dflash2::DFlash2::find_group(&kv).unwrap();
        let grp = DraftGroup::new(&dcfg, &tcfg, &kv, g).unwrap();
        (dcfg, grp, kv)
    }

    #[test]
    fn append_keeps_only_rows_a_future_query_can_see() {
        let (cfg, grp, kv) = setup(CapPolicy::None, 40);
        let w = cfg.sliding_window;
        let t = 40usize;
        let req = AppendReq {
            slot: ReqSlot(0),
            rows: 3..3 + t,
            start_pos: 0,
        };
        let p = plan_append(&cfg, &grp, &kv, &HashMap::new(), std::slice::from_ref(&req)).unwrap();
        let keep_from = (t + 1).saturating_sub(w);
        assert_eq!(p.rows.len(), t - keep_from);
        assert_eq!(p.pos.first().copied(), Some(keep_from as i32));
        assert_eq!(p.rows.first().copied(), Some(3 + keep_from as i32));
        assert_eq!(p.new_len, vec![(ReqSlot(0), t)]);
        let table = kv.table(grp.index, ReqSlot(0));
        for (&pos, &s) in p.pos.iter().zip(&p.slot) {
            let (b, off) = grp.locate(table, ReqSlot(0), pos as usize).unwrap();
            assert_eq!(s as usize, b as usize * grp.block_size + off);
        }
        // Out of order is an error, as on the host.
        let mut len = HashMap::new();
        len.insert(ReqSlot(0), 2);
        let late = AppendReq {
            start_pos: 3,
            ..req
        };
        let e = plan_append(&cfg, &grp, &kv, &len, &[late])
            .unwrap_err()
            .to_string();
        assert!(e.contains("in order"), "{e}");
    }

    #[test]
    fn draft_plan_lists_the_window_and_checks_the_anchor() {
        let (cfg, grp, kv) = setup(CapPolicy::WindowPlusTwo, 40);
        let w = cfg.sliding_window;
        let n = 40usize;
        let mut len = HashMap::new();
        len.insert(ReqSlot(0), n);
        let a = DraftAnchor {
            slot: ReqSlot(0),
            anchor: 5,
            num_tokens: n + 1,
        };
        let p = plan_draft(&cfg, &grp, &kv, &len, &[a], 7, 4096).unwrap();
        let cs = (n + 1).saturating_sub(w);
        assert_eq!(p.info, vec![n as i32, cs as i32, (n - cs) as i32]);
        assert_eq!(p.tokens.len(), 8);
        assert_eq!(p.tokens[0], 5);
        assert!(p.tokens[1..]
            .iter()
            .all(|&t| t == cfg.dflash_config.mask_token_id as i32));
        assert_eq!(p.pos, (n..n + 8).map(|x| x as i32).collect::<Vec<_>>());
        assert_eq!(p.ctx_slots.len(), p.s_max);
        let table = kv.table(grp.index, ReqSlot(0));
        for (i, pos) in (cs..n).enumerate() {
            let (b, off) = grp.locate(table, ReqSlot(0), pos).unwrap();
            assert_eq!(
                p.ctx_slots[i] as usize,
                b as usize * grp.block_size + off,
                "pos {pos}"
            );
        }
        // Each block row sees exactly positions P_j - W + 1 .. n - 1 (§5.2).
        for j in 0..8 {
            let vis = visible_context([n as i32, cs as i32, (n - cs) as i32], j, w);
            let first = (n + j + 1).saturating_sub(w).max(cs);
            assert_eq!(vis, first - cs..n - cs, "row {j}");
        }
        let bad = |d: DraftAnchor, max_pos: usize| {
            plan_draft(&cfg, &grp, &kv, &len, &[d], 7, max_pos)
                .unwrap_err()
                .to_string()
        };
        assert!(bad(DraftAnchor { num_tokens: n, ..a }, 4096).contains("anchor must be"));
        assert!(bad(
            DraftAnchor {
                anchor: 1 << 30,
                ..a
            },
            4096
        )
        .contains("vocab_size"));
        assert!(bad(a, n + 7).contains("RoPE table"));
        let none = plan_draft(&cfg, &grp, &kv, &HashMap::new(), &[a], 7, 4096).unwrap_err();
        assert!(none.to_string().contains("no DFlash2 context"));
    }
}
