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


// out[t, i * H + c] = per_layer[layers[i] * layer_stride + rows[t] * H + c].
// Shapes: per_layer [(L + 1), t_cap, H] (layer_stride = t_cap * H), rows [T] forward rows,
// layers [m] per-layer slots (target_layer_ids + 1), out [T, m * H].
// Launch: grid (T), block 256.
extern "C" __global__ void df2_features(float* __restrict__ out, const float* __restrict__ per_layer,
                                        long long layer_stride, const int* __restrict__ rows,
                                        const int* __restrict__ layers, int T, int m, int H) {
    pdl_enter();
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
// place.  d even, d <= 128 (checked on the host).
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
// at pos[t] (in place), and both are written to slot[t] of layer l's pages; rows with
// slot -1 (the padding of a decode step's append, cuda/src/dflash.rs pad_append) are skipped.
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
    pdl_enter();
    const int t = blockIdx.x, l = blockIdx.y, hh = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (t >= T || l >= Ld || hh >= nkv || slot[t] < 0) return;  // slot -1: a padded row
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
    pdl_enter();
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
    pdl_enter();
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

// Non-causal sliding-window attention of one drafter layer (§5.2). One block per (block
// row r, KV head g), one warp per query head of the group (h = g * gq + warp): the keys
// and values row r sees (context rows from P_r - W + 1, then the request's Q block rows)
// stream through shared memory in tiles of T keys (T / 32 per lane for the scores), then
// an online softmax (running max / sum per warp) and the value sum with each lane owning
// D / 32 dims.  The tiles are software-pipelined: the next tile's loads (all in flight,
// float4) are issued before the current tile is computed.  info[b] = (p0, ctx_start, S):
// the anchor's position, the first context position in ctx_slots[b], and how many
// (positions ctx_start .. p0 - 1, S <= s_max).  D is a template parameter (32, 64 or 128,
// checked on the host) so the staging and the dot products compile to shifts and unrolled
// code (a runtime head_dim cost 85 us a launch in integer division and loop overhead, ncu
// 2026-12-02); T = 64 for D <= 64, else 32.
// Shapes: qkv [R, qkv_stride] (q [nh, D] at 0, k [nkv, D] at nh * D, v at (nh + nkv) * D),
// pages: this layer's K at 0 and V at v_off, rows [*, nkv * D]; ctx_slots [B, s_max];
// info [B, 3]; o [R, nh * D].  Row starts 16-byte aligned (checked on the host).
// Launch: grid (R, nkv), block 32 * max(nh / nkv, 2) (nh / nkv <= 8), dynamic smem
// 4 * (2 * T * (D + 1) + (nh / nkv) * D) bytes.
template <int D>
struct Df2Tile {
    static constexpr int T = D <= 64 ? 64 : 32;  // keys per tile
    static constexpr int D4 = D / 4, IT = T * D4 / 64;  // float4 per stager and operand
    float4 k[IT], v[IT];
    // Issue every load of the tile at `base` (64 stagers, threads 0..63).
    __device__ __forceinline__ void load(int base, int nctx, int total, const int* slots,
                                         const float* pages, long long v_off, int row, int g,
                                         const float* blk, int qkv_stride, int nh, int nkv) {
#pragma unroll
        for (int it = 0; it < IT; ++it) {
            const int idx = threadIdx.x + it * 64, u = base + idx / D4, i = 4 * (idx % D4);
            k[it] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            v[it] = k[it];
            if (u < nctx) {
                const float* p = pages + (long long)slots[u] * row + (size_t)g * D + i;
                k[it] = *reinterpret_cast<const float4*>(p);
                v[it] = *reinterpret_cast<const float4*>(p + v_off);
            } else if (u < total) {
                const float* p = blk + (size_t)(u - nctx) * qkv_stride + (size_t)g * D + i;
                k[it] = *reinterpret_cast<const float4*>(p + (size_t)nh * D);
                v[it] = *reinterpret_cast<const float4*>(p + (size_t)(nh + nkv) * D);
            }
        }
    }
    __device__ __forceinline__ void store(float* ks, float* vs) const {
#pragma unroll
        for (int it = 0; it < IT; ++it) {
            const int idx = threadIdx.x + it * 64;
            float* kd = ks + (idx / D4) * (D + 1) + 4 * (idx % D4);
            float* vd = vs + (idx / D4) * (D + 1) + 4 * (idx % D4);
            kd[0] = k[it].x; kd[1] = k[it].y; kd[2] = k[it].z; kd[3] = k[it].w;
            vd[0] = v[it].x; vd[1] = v[it].y; vd[2] = v[it].z; vd[3] = v[it].w;
        }
    }
};

template <int D>
__device__ __forceinline__ void df2_attention_body(
    float* __restrict__ o, const float* __restrict__ qkv, int qkv_stride,
    const float* __restrict__ pages, long long v_off, const int* __restrict__ ctx_slots,
    int s_max, const int* __restrict__ info, int Q, int nh, int nkv, int W, float scale, int R) {
    using Tile = Df2Tile<D>;
    constexpr int T = Tile::T, KPL = T / WARP, DS = D + 1, DPL = (D + WARP - 1) / WARP;
    extern __shared__ float sm[];
    const int r = blockIdx.x, g = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gq = nh / nkv;
    if (r >= R || g >= nkv) return;
    float* ks = sm;           // [T, D + 1]: padded rows, no bank conflicts
    float* vs = ks + T * DS;  // [T, D + 1]
    float* qs = vs + T * DS;  // [gq, D]
    const int b = r / Q, j = r % Q, hh = g * gq + min(warp, gq - 1), row = nkv * D;
    const int p0 = info[b * 3], cs = info[b * 3 + 1], S = info[b * 3 + 2];
    const int lo = min(max(p0 + j + 1 - W, cs) - cs, S);  // first visible context index
    const int nctx = S - lo, total = nctx + Q;
    for (int i = threadIdx.x; i < gq * D; i += blockDim.x)
        qs[i] = qkv[(size_t)r * qkv_stride + (size_t)g * gq * D + i];
    const float* blk = qkv + (size_t)b * Q * qkv_stride;
    const int* slots = ctx_slots + (size_t)b * s_max + lo;
    const bool stager = threadIdx.x < 64;
    Tile tile;
    if (stager) tile.load(0, nctx, total, slots, pages, v_off, row, g, blk, qkv_stride, nh, nkv);
    float acc[DPL];
#pragma unroll
    for (int t = 0; t < DPL; ++t) acc[t] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int base = 0; base < total; base += T) {
        __syncthreads();  // the previous tile's readers are done (and qs is written)
        if (stager) tile.store(ks, vs);
        __syncthreads();
        if (stager && base + T < total)  // the next tile's loads fly during this compute
            tile.load(base + T, nctx, total, slots, pages, v_off, row, g, blk, qkv_stride, nh, nkv);
        if (warp < gq) {  // a group of one query head leaves the block's second warp idle
            const float* qr = qs + warp * D;
            float sc[KPL];
            float tmax = -INFINITY;
#pragma unroll
            for (int kp = 0; kp < KPL; ++kp) {
                const float* kr = ks + (kp * WARP + lane) * DS;
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < D; ++i) dot += qr[i] * kr[i];
                sc[kp] = base + kp * WARP + lane < total ? dot * scale : -INFINITY;
                tmax = fmaxf(tmax, sc[kp]);
            }
            const float mn = fmaxf(m, warp_max(tmax));  // finite: every tile holds a valid key
            const float corr = expf(m - mn);             // 0 on the first tile (m = -inf)
            float p[KPL], ps = 0.0f;
#pragma unroll
            for (int kp = 0; kp < KPL; ++kp) {
                p[kp] = sc[kp] == -INFINITY ? 0.0f : expf(sc[kp] - mn);
                ps += p[kp];
            }
            l = l * corr + warp_sum(ps);
#pragma unroll
            for (int t = 0; t < DPL; ++t) acc[t] *= corr;
#pragma unroll
            for (int kk = 0; kk < T; ++kk) {
                const float pk = __shfl_sync(FULL_MASK, p[kk / WARP], kk % WARP);  // 0 past the end
#pragma unroll
                for (int t = 0; t < DPL; ++t)
                    if (lane + t * WARP < D) acc[t] += pk * vs[kk * DS + lane + t * WARP];
            }
            m = mn;
        }
    }
    if (warp >= gq) return;
    float* orow = o + (size_t)r * nh * D + (size_t)hh * D;
#pragma unroll
    for (int t = 0; t < DPL; ++t)
        if (lane + t * WARP < D) orow[lane + t * WARP] = acc[t] / l;
}

extern "C" __global__ void __launch_bounds__(256) df2_attention(float* __restrict__ o, const float* __restrict__ qkv,
                                         int qkv_stride, const float* __restrict__ pages,
                                         long long v_off, const int* __restrict__ ctx_slots,
                                         int s_max, const int* __restrict__ info, int Q, int nh,
                                         int nkv, int d, int W, float scale, int R) {
    pdl_enter();
    if (d == 64)
        df2_attention_body<64>(o, qkv, qkv_stride, pages, v_off, ctx_slots, s_max, info, Q, nh, nkv, W, scale, R);
    else if (d == 128)
        df2_attention_body<128>(o, qkv, qkv_stride, pages, v_off, ctx_slots, s_max, info, Q, nh, nkv, W, scale, R);
    else if (d == 32)
        df2_attention_body<32>(o, qkv, qkv_stride, pages, v_off, ctx_slots, s_max, info, Q, nh, nkv, W, scale, R);
}

// The top-k candidates of each logits row (§6.2: value descending, equal values to the
// lower id; NaN is never picked). Each thread keeps the best KM of its strided elements
// in registers (insertion, one pass over the row, four loads in flight), then k rounds
// merge the threads' lists: the block's best head is the next candidate (one shuffle
// reduction per warp, one across the warps) and its thread pops it.  KM (1, 8 or 16) is
// the smallest list that holds k.  out[r, i] = float(id_i) (exact: V < 2^24, checked on
// the host), out[r, k + i] = logits[r, id_i].  Shapes: logits [R, V], out [R, out_stride].
// Launch: grid (R), block 512.
__device__ __forceinline__ bool df2_better(float av, int ai, float bv, int bi) {
    return av > bv || (av == bv && ai < bi);
}
__device__ __forceinline__ void df2_best(float& v, int& i) {  // warp-wide best (v, i)
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, off);
        const int oi = __shfl_xor_sync(FULL_MASK, i, off);
        if (df2_better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}
template <int KM>
__device__ __forceinline__ void df2_topk_body(float* __restrict__ out, int out_stride,
                                              const float* __restrict__ logits, int V, int k,
                                              int R) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int r = blockIdx.x;
    if (r >= R) return;
    const float* row = logits + (size_t)r * V;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float tv[KM];
    int ti[KM];
#pragma unroll
    for (int s = 0; s < KM; ++s) { tv[s] = -INFINITY; ti[s] = V; }
    const int bd = blockDim.x;
    for (int i0 = threadIdx.x; i0 < V; i0 += 4 * bd) {
        float xs[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) xs[u] = i0 + u * bd < V ? row[i0 + u * bd] : -INFINITY;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            float x = xs[u];
            int xi = i0 + u * bd;
            if (xi >= V || x != x || !df2_better(x, xi, tv[KM - 1], ti[KM - 1])) continue;
#pragma unroll
            for (int s = 0; s < KM; ++s) {  // insert, keeping the list sorted
                if (df2_better(x, xi, tv[s], ti[s])) {
                    const float t = tv[s];
                    const int w = ti[s];
                    tv[s] = x; ti[s] = xi; x = t; xi = w;
                }
            }
        }
    }
    for (int round = 0; round < k; ++round) {
        float bv = tv[0];
        int bi = ti[0];
        df2_best(bv, bi);
        __syncthreads();  // the previous round's readers are done with sv / si
        if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
        __syncthreads();
        bv = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : V;
        df2_best(bv, bi);
        if (threadIdx.x == 0) {
            out[(size_t)r * out_stride + round] = (float)(bi < V ? bi : 0);
            out[(size_t)r * out_stride + k + round] = bi < V ? bv : -INFINITY;
        }
        if (ti[0] == bi && bi < V) {  // ids are unique: exactly one thread pops
#pragma unroll
            for (int s = 0; s + 1 < KM; ++s) { tv[s] = tv[s + 1]; ti[s] = ti[s + 1]; }
            tv[KM - 1] = -INFINITY;
            ti[KM - 1] = V;
        }
    }
}

extern "C" __global__ void df2_topk(float* __restrict__ out, int out_stride,
                                    const float* __restrict__ logits, int V, int k, int R) {
    pdl_enter();
    if (k <= 1)
        df2_topk_body<1>(out, out_stride, logits, V, k, R);
    else if (k <= 8)
        df2_topk_body<8>(out, out_stride, logits, V, k, R);
    else
        df2_topk_body<16>(out, out_stride, logits, V, k, R);
}
