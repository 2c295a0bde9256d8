// The DFlash2 drafter's own kernels (issue 11): target features, context K/V into the
// drafter's sliding-window pages, per-head norm + RoPE, the grouped dynamic conv, the
// non-causal sliding-window attention over context + block, and the top-k candidates.
//
// Source: docs/dflash2.md §3 (features: the residual stream after each of
// target_layer_ids, concatenated), §4 (context K/V: k_norm per head, RoPE at the row's
// position, V as projected), §5 (the block forward), §5.1 (conv), §5.2 (attention: query
// row j sees context positions P_j - W + 1 .. P_0 - 1 and every block row), §6.2 (top-k:
// value descending, ties to the lower id); drafters/src/dflash2/ (the CPU reference these
// kernels port, f32 throughout).  The dense projections are linear.cu's bf16 GEMMs.
//
// Page layout (drafters/src/dflash2/kv.rs, reproduced on the device): per drafter layer l,
// K then V, each [num_blocks * bs, nkv * d] f32; layer l starts at l * layer_stride, V at
// + v_off; a position-p row lives at slot table[p / bs (mod ring)] * bs + p % bs, which
// the host resolves (DraftGroup::locate, never a null or unallocated block) and uploads.
//
// Rows of a draft batch are request-major: request b's block rows j = 0 .. Q-1 are rows
// b * Q + j (row 0 = the anchor).

#define DF2_HEAD_DIM_MAX 128

// out[t, i * H + c] = per_layer[layers[i] * layer_stride + rows[t] * H + c].
// Shapes: per_layer [(L + 1), t_cap, H] (layer_stride = t_cap * H), rows [T] forward rows,
// layers [m] per-layer slots (target_layer_ids + 1), out [T, m * H].
// Launch: grid (T), block 256.
extern "C" __global__ void df2_features(float* __restrict__ out, const float* __restrict__ per_layer,
                                        long long layer_stride, const int* __restrict__ rows,
                                        const int* __restrict__ layers, int T, int m, int H) {
    const int t = blockIdx.x;
    if (t >= T) return;
    const long long src_row = (long long)rows[t] * H;
    for (int idx = threadIdx.x; idx < m * H; idx += blockDim.x) {
        const int li = idx / H, c = idx % H;
        out[(size_t)t * m * H + idx] = per_layer[(long long)layers[li] * layer_stride + src_row + c];
    }
}

// One warp: rmsnorm of a head vector x[0 .. d) with weight w (docs/dflash2.md §1:
// x / sqrt(mean(x^2) + eps) * w), then rotate-half RoPE with the tables' row (c, s), in
// place.  d even, d <= DF2_HEAD_DIM_MAX.
__device__ __forceinline__ void df2_norm_rope_head(float* x, const float* w, const float* c,
                                                   const float* s, int d, float eps) {
    const int lane = threadIdx.x & 31, half = d / 2;
    float ss = 0.0f;
    for (int i = lane; i < d; i += WARP) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)d + eps);
    for (int i = lane; i < half; i += WARP) {
        const float a = x[i] * inv * w[i], b = x[i + half] * inv * w[i + half];
        x[i] = a * c[i] + (-b) * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
    }
}

// Context K/V (§4) of T rows for every drafter layer: kv[t] holds, per layer l, the k
// projection ([nkv, d]) then the v projection; k is normed per head with knorm[l], roped
// at pos[t] (in place), and both are written to slot[t] of layer l's pages.
// Shapes: kv [T, Ld * 2 * nkv * d], pos [T], slot [T], knorm [Ld, d], cos/sin [max_pos, d],
// pages [Ld * layer_stride].  Launch: grid (T, Ld), block 32 * nkv.
extern "C" __global__ void df2_ctx_write(float* __restrict__ kv, const int* __restrict__ pos,
                                         const int* __restrict__ slot,
                                         const float* __restrict__ knorm,
                                         const float* __restrict__ cos_tab,
                                         const float* __restrict__ sin_tab,
                                         float* __restrict__ pages, long long layer_stride,
                                         long long v_off, int Ld, int nkv, int d, float eps,
                                         int T) {
    const int t = blockIdx.x, l = blockIdx.y, hh = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (t >= T || l >= Ld || hh >= nkv) return;
    const int row = nkv * d;
    float* k = kv + (size_t)t * Ld * 2 * row + (size_t)l * 2 * row + (size_t)hh * d;
    const float* v = k + row;
    const size_t p = (size_t)pos[t] * d;
    df2_norm_rope_head(k, knorm + (size_t)l * d, cos_tab + p, sin_tab + p, d, eps);
    __syncwarp();
    float* dst = pages + (long long)l * layer_stride + (long long)slot[t] * row + (size_t)hh * d;
    for (int i = lane; i < d; i += WARP) {
        dst[i] = k[i];
        dst[v_off + i] = v[i];
    }
}

// q_norm / k_norm + RoPE of the block's q and k heads in place (§5.2): x[r] holds q
// ([nh, d]) then k ([nkv, d]) then v; head hh < nh uses qnorm, else knorm.
// Shapes: x [R, stride], pos [R], qnorm / knorm [d], cos/sin [max_pos, d].
// Launch: grid (R, nh + nkv), block 32.
extern "C" __global__ void df2_head_norm_rope(float* __restrict__ x, int stride,
                                              const int* __restrict__ pos,
                                              const float* __restrict__ qnorm,
                                              const float* __restrict__ knorm,
                                              const float* __restrict__ cos_tab,
                                              const float* __restrict__ sin_tab, int nh, int nkv,
                                              int d, float eps, int R) {
    const int r = blockIdx.x, hh = blockIdx.y;
    if (r >= R || hh >= nh + nkv) return;
    const size_t p = (size_t)pos[r] * d;
    df2_norm_rope_head(x + (size_t)r * stride + (size_t)hh * d, hh < nh ? qnorm : knorm,
                       cos_tab + p, sin_tab + p, d, eps);
}

// The grouped dynamic depthwise conv of §5.1 over blocks of Q rows:
// conv[r, c] = sum_{tau < K, tau <= j} (base[side, tau, c] + proj[r, side, tau, c / gs]) * y[r - tau, c]
// with j = r % Q (taps never cross a block start), summed in tap order; out = conv, or
// out += conv (accumulate: the residual add x + conv(..), as the CPU adds the finished
// conv).  Shapes: y, out [R, H], proj [R, 2, K, H / gs], base [2, K, H].
// Launch: grid (R), block 256.
extern "C" __global__ void df2_conv(float* __restrict__ out, const float* __restrict__ y,
                                    const float* __restrict__ proj, const float* __restrict__ base,
                                    int side, int K, int gs, int H, int Q, int R, int accumulate) {
    const int r = blockIdx.x;
    if (r >= R) return;
    const int j = r % Q, G = H / gs;
    const float* dl = proj + (size_t)r * 2 * K * G + (size_t)side * K * G;
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
        float acc = 0.0f;
        for (int tau = 0; tau < K && tau <= j; ++tau)
            acc += (base[(size_t)(side * K + tau) * H + c] + dl[tau * G + c / gs]) *
                   y[(size_t)(r - tau) * H + c];
        float* o = out + (size_t)r * H + c;
        *o = accumulate ? *o + acc : acc;
    }
}

// Non-causal sliding-window attention of one drafter layer (§5.2), one warp per
// (block row, head), online softmax over chunks of 32 keys: context rows first (the
// visible ones: positions >= P_j - W + 1), then the request's Q block rows.
// info[b] = (p0, ctx_start, S): the anchor's position, the first context position held in
// ctx_slots[b], and how many (positions ctx_start .. p0 - 1, S <= s_max).
// Shapes: qkv [R, qkv_stride] (q [nh, d] at 0, k [nkv, d] at nh * d, v at (nh + nkv) * d),
// pages: this layer's K at 0 and V at v_off, rows [*, nkv * d]; ctx_slots [B, s_max];
// info [B, 3]; o [R, nh * d].  Launch: grid (R, nh), block 32.
extern "C" __global__ void df2_attention(float* __restrict__ o, const float* __restrict__ qkv,
                                         int qkv_stride, const float* __restrict__ pages,
                                         long long v_off, const int* __restrict__ ctx_slots,
                                         int s_max, const int* __restrict__ info, int Q, int nh,
                                         int nkv, int d, int W, float scale, int R) {
    __shared__ float qs[DF2_HEAD_DIM_MAX];
    const int r = blockIdx.x, hh = blockIdx.y, lane = threadIdx.x & 31;
    if (r >= R || hh >= nh) return;
    const int b = r / Q, j = r % Q, g = hh / (nh / nkv), row = nkv * d;
    const int p0 = info[b * 3], cs = info[b * 3 + 1], S = info[b * 3 + 2];
    const int lo = max(p0 + j + 1 - W, cs) - cs;  // first visible context index
    const int nctx = max(S - lo, 0), total = nctx + Q;
    const float* qv = qkv + (size_t)r * qkv_stride + (size_t)hh * d;
    for (int i = lane; i < d; i += WARP) qs[i] = qv[i];
    __syncwarp();
    const int nd = (d + WARP - 1) / WARP;  // <= 4 dims per lane
    float acc[DF2_HEAD_DIM_MAX / WARP];
#pragma unroll
    for (int t = 0; t < DF2_HEAD_DIM_MAX / WARP; ++t) acc[t] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const float* blk = qkv + (size_t)b * Q * qkv_stride;
    for (int base = 0; base < total; base += WARP) {
        const int u = base + lane;
        const float* key = nullptr;
        if (u < nctx)
            key = pages + (long long)ctx_slots[(size_t)b * s_max + lo + u] * row + (size_t)g * d;
        else if (u < total)
            key = blk + (size_t)(u - nctx) * qkv_stride + (size_t)(nh + g) * d;
        float sc = -INFINITY;
        if (key) {
            float dot = 0.0f;
            for (int i = 0; i < d; ++i) dot += qs[i] * key[i];
            sc = dot * scale;
        }
        const float mn = fmaxf(m, warp_max(sc));
        const float corr = expf(m - mn);  // 0 on the first chunk (m = -inf)
        const float p = key ? expf(sc - mn) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int t = 0; t < DF2_HEAD_DIM_MAX / WARP; ++t) acc[t] *= corr;
        const int nk = min(WARP, total - base);
        for (int kk = 0; kk < nk; ++kk) {
            const float pk = __shfl_sync(FULL_MASK, p, kk);
            const int uk = base + kk;
            const float* val =
                uk < nctx ? pages + v_off +
                                (long long)ctx_slots[(size_t)b * s_max + lo + uk] * row +
                                (size_t)g * d
                          : blk + (size_t)(uk - nctx) * qkv_stride + (size_t)(nh + nkv + g) * d;
#pragma unroll
            for (int t = 0; t < DF2_HEAD_DIM_MAX / WARP; ++t)
                if (t < nd && lane + t * WARP < d) acc[t] += pk * val[lane + t * WARP];
        }
        m = mn;
    }
    float* orow = o + (size_t)r * nh * d + (size_t)hh * d;
#pragma unroll
    for (int t = 0; t < DF2_HEAD_DIM_MAX / WARP; ++t)
        if (t < nd && lane + t * WARP < d) orow[lane + t * WARP] = acc[t] / l;
}

// The top-k candidates of each logits row (§6.2: value descending, equal values to the
// lower id; NaN is never picked): k rounds, each the best element strictly after the
// previous pick in that order.  out[r, i] = float(id_i) (exact: V < 2^24, checked on the
// host), out[r, k + i] = logits[r, id_i].  Shapes: logits [R, V], out [R, out_stride].
// Launch: grid (R), block 256.
extern "C" __global__ void df2_topk(float* __restrict__ out, int out_stride,
                                    const float* __restrict__ logits, int V, int k, int R) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int r = blockIdx.x;
    if (r >= R) return;
    const float* row = logits + (size_t)r * V;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float pv = INFINITY;
    int pi = -1;
    for (int round = 0; round < k; ++round) {
        float bv = -INFINITY;
        int bi = V;  // "none": loses to any real element (argmax_merge prefers lower ids)
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float x = row[i];
            if (x < pv || (x == pv && i > pi)) argmax_merge(bv, bi, x, i);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, bv, off);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, off);
            argmax_merge(bv, bi, ov, oi);
        }
        __syncthreads();  // the previous round's readers are done with sv / si
        if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
        __syncthreads();
        bv = sv[0];
        bi = si[0];
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) argmax_merge(bv, bi, sv[w], si[w]);
        if (threadIdx.x == 0) {
            out[(size_t)r * out_stride + round] = (float)(bi < V ? bi : 0);
            out[(size_t)r * out_stride + k + round] = bi < V ? bv : -INFINITY;
        }
        pv = bv;
        pi = bi;
    }
}
