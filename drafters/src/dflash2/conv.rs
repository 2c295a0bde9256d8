//! Grouped dynamic depthwise convolution over the rows of one draft block.
//!
//! Source: docs/dflash2.md §5.1 (vLLM `qwen3_dflash2.py` `DFlashGroupedConv.prepare` /
//! `finish` / `_grouped_conv`):
//!
//! ```text
//! conv(y, delta, base)[j, c] = sum_{tau=0}^{K-1} [j >= tau] * (base[tau, c] + delta[j, tau, c / gs]) * y[j - tau, c]
//! ```
//!
//! Tap 0 multiplies the row itself, tap `tau` the row `tau` earlier in the same block;
//! nothing crosses the block start; the coefficient row is the output row's; the sum runs
//! in tap order. `delta` comes from the module's `kernel_projection` of the sublayer's
//! normalised input, viewed `(Q, 2, K, G)`: side 0 before the sublayer, side 1 after.
//!
//! Invariant: `y` is `[Q, H]` with the block's rows in block order (row 0 = anchor).

/// `conv(y, delta[:, side], base[side])` for one block.
///
/// Shapes: `y` [Q, H]; `proj` [Q, 2 * K * G] (the `kernel_projection` output);
/// `base` [2, K, H]; `gs` channels per group (`G = H / gs`). Returns [Q, H].
pub fn grouped_conv(
    y: &[f32],
    h: usize,
    proj: &[f32],
    base: &[f32],
    side: usize,
    k: usize,
    gs: usize,
) -> Vec<f32> {
    let q = y.len() / h;
    let g = h / gs;
    let mut out = vec![0.0f32; q * h];
    for j in 0..q {
        let delta = &proj[j * 2 * k * g + side * k * g..j * 2 * k * g + (side + 1) * k * g]; // [K, G]
        let orow = &mut out[j * h..(j + 1) * h];
        for tau in 0..k.min(j + 1) {
            let yrow = &y[(j - tau) * h..(j - tau + 1) * h];
            let b = &base[(side * k + tau) * h..(side * k + tau + 1) * h];
            let dt = &delta[tau * g..(tau + 1) * g];
            for (c, o) in orow.iter_mut().enumerate() {
                *o += (b[c] + dt[c / gs]) * yrow[c];
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_taps_and_block_start() {
        // H = 2, gs = 1 (G = 2), K = 2; base tap 0 = 1, tap 1 = 0.5, no dynamic part.
        let (h, k, gs) = (2, 2, 1);
        let y = vec![1.0, 2.0, 3.0, 4.0]; // Q = 2
        let base = vec![1.0, 1.0, 0.5, 0.5, /* side 1 */ 0.0, 0.0, 0.0, 0.0];
        let proj = vec![0.0; 2 * 2 * k * 2];
        let out = grouped_conv(&y, h, &proj, &base, 0, k, gs);
        assert_eq!(out, vec![1.0, 2.0, 3.0 + 0.5, 4.0 + 1.0]);
        // A dynamic tap-0 coefficient of the output row applies to its group only.
        let mut proj = vec![0.0; 2 * 2 * k * 2];
        proj[2 * k * 2 + 1] = 1.0; // row 1, side 0, tau 0, group 1
        let out = grouped_conv(&y, h, &proj, &base, 0, k, gs);
        assert_eq!(out, vec![1.0, 2.0, 3.5, 8.0 + 1.0]);
    }
}
