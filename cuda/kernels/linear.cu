// Dense bf16-weight linear layers and the SwiGLU / MoE expert GEMMs (f32 compute).
//
// Source: docs/model.md §1.2-§1.5 (y = x @ W^T, W [N, K], no bias, f32 compute with f32
// inputs: weights widened exactly, W4A16 dequantized to exact f32 products), §5
// (SwiGLU, MoE experts; the router-weighted combine is in moe.cu).
//
// The bf16 GEMMs share one scheme, built for decode / verify batches (few rows, weight
// bandwidth bound): a warp owns one output column n and up to ROWS_PER_TILE (8) rows;
// lane l reads 8 consecutive k (one 16-byte bf16 load) at k = 8 * (l + 32 i), so a warp
// reads 512 B of a weight row per step, coalesced; activations are re-read from L1/L2 by
// the 4 warps of a block.  The INT4 expert GEMMs (end of file) have their own scheme
// (issue 12): lane groups over 4 weight rows, 16-byte loads, lop3 + FMA dequantization.
// Requirements (checked on the host, cuda/src/ops.rs): K % 8 == 0 (INT4: K % 128 == 0,
// N % 8 == 0), row strides of x multiples of 4 floats and every base pointer 16-byte
// aligned.
//
// The MoE kernels walk the tile list of moe.cu's moe_align: tile i covers sorted
// positions [8 i, 8 i + 8) of `sorted` (pair ids t * topk + slot, -1 = padding), all of
// expert tile_expert[i] (-1 = unused tile: the block exits).

#define LIN_WARPS 4
#define ROWS_PER_TILE 8

// Weight row loaders: 8 consecutive f32 weights of row `row` at word / 8-group `kw`.
struct LoadBf16 {
    const bf16_bits* w;  // [rows, K] bf16
    int K;
    __device__ __forceinline__ void load(size_t row, int kw, float out[8]) const {
        widen8(*reinterpret_cast<const uint4*>(w + row * (size_t)K + (size_t)kw * 8), out);
    }
};
// Body of linear_bf16 / linear_norm_bf16. With NORM, each x row is rmsnorm'ed on the fly
// (docs/model.md §1: x / sqrt(mean(x^2) + eps) * g): the warp accumulates (x * g) . W and
// x . x in the same pass over K, then scales by 1 / sqrt(x.x / K + eps). Called by whole
// warps, one output column n per warp, ROWS_PER_TILE rows per block row.
template <bool NORM>
__device__ __forceinline__ void linear_body(float* __restrict__ y, int y_stride,
                                            const float* __restrict__ x, int x_stride,
                                            const bf16_bits* __restrict__ W, int M, int N,
                                            int K, int accumulate, const float* __restrict__ g,
                                            float eps) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * LIN_WARPS + warp;
    const int m0 = blockIdx.y * ROWS_PER_TILE;
    if (n >= N) return;  // uniform per warp
    const int rows = min(ROWS_PER_TILE, M - m0);
    const LoadBf16 ld{W, K};
    float acc[ROWS_PER_TILE], ss[ROWS_PER_TILE];
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) { acc[r] = 0.0f; ss[r] = 0.0f; }
    for (int kw = lane; kw < K / 8; kw += WARP) {
        float w[8], gv[8];
        ld.load(n, kw, w);
        if (NORM) load8(g + (size_t)kw * 8, gv);
#pragma unroll
        for (int r = 0; r < ROWS_PER_TILE; ++r) {
            if (r < rows) {
                float xv[8];
                load8(x + (size_t)(m0 + r) * x_stride + (size_t)kw * 8, xv);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (NORM) {
                        ss[r] += xv[j] * xv[j];
                        acc[r] += xv[j] * gv[j] * w[j];
                    } else {
                        acc[r] += xv[j] * w[j];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) {
        float s = warp_sum(acc[r]);
        if (NORM) s *= 1.0f / sqrtf(warp_sum(ss[r]) / (float)K + eps);
        if (lane == 0 && r < rows) {
            float* dst = y + (size_t)(m0 + r) * y_stride + n;
            *dst = accumulate ? *dst + s : s;
        }
    }
}

// y[m, n] (+)= sum_k x[m, k] * W[n, k].  Shapes: x [M, x_stride] (first K used),
// W [N, K] bf16, y [M, y_stride] (first N used).  `accumulate` != 0 adds into y (the
// residual add of docs/model.md §2, done as x + (a @ W^T) like the CPU).
// Launch: grid (ceil(N / 4), ceil(M / 8)), block 128.
extern "C" __global__ void linear_bf16(float* __restrict__ y, int y_stride,
                                       const float* __restrict__ x, int x_stride,
                                       const bf16_bits* __restrict__ W, int M, int N, int K,
                                       int accumulate) {
    pdl_enter();
    linear_body<false>(y, y_stride, x, x_stride, W, M, N, K, accumulate, nullptr, 0.0f);
}

// y = rmsnorm(x, g, eps) @ W^T (the decoder layer's input norm fused into the mixer's
// first projection, whose only consumer it is).  Shapes as linear_bf16, g [K] f32.
// Launch: as linear_bf16.
extern "C" __global__ void linear_norm_bf16(float* __restrict__ y, int y_stride,
                                            const float* __restrict__ x, int x_stride,
                                            const bf16_bits* __restrict__ W, int M, int N,
                                            int K, int accumulate, const float* __restrict__ g,
                                            float eps) {
    pdl_enter();
    linear_body<true>(y, y_stride, x, x_stride, W, M, N, K, accumulate, g, eps);
}

// Two GEMMs of the same shape in one launch (blockIdx.z picks the pair): the KDA
// layer's f / g low-rank projections.  Shapes as linear_bf16 for each (y_z, x_z, W_z),
// with shared strides; no accumulate.  Launch: grid (ceil(N / 4), ceil(M / 8), 2), block 128.
extern "C" __global__ void linear_pair_bf16(float* __restrict__ y0, float* __restrict__ y1,
                                            int y_stride, const float* __restrict__ x0,
                                            const float* __restrict__ x1, int x_stride,
                                            const bf16_bits* __restrict__ W0,
                                            const bf16_bits* __restrict__ W1, int M, int N,
                                            int K) {
    pdl_enter();
    if (blockIdx.z == 0)
        linear_body<false>(y0, y_stride, x0, x_stride, W0, M, N, K, 0, nullptr, 0.0f);
    else
        linear_body<false>(y1, y_stride, x1, x_stride, W1, M, N, K, 0, nullptr, 0.0f);
}

// Shared body of the gate/up GEMMs: for tile rows r with in_row[r] >= 0,
// h[out_row[r], n] = silu(x[in_row[r]] . Wg[n]) * (x[in_row[r]] . Wu[n]), where the gate
// and up rows of column n are weight rows `row_g` and `row_g + 1` (fused layout
// [.., N, 2, K]).  Called by whole warps (warp_sum inside).
template <class L>
__device__ __forceinline__ void gate_up_tile(float* __restrict__ h, int N, int n,
                                             const float* __restrict__ x, int x_stride,
                                             const L& ld, size_t row_g, int K,
                                             const int in_row[ROWS_PER_TILE],
                                             const int out_row[ROWS_PER_TILE]) {
    const int lane = threadIdx.x & 31;
    float ag[ROWS_PER_TILE], au[ROWS_PER_TILE];
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) { ag[r] = 0.0f; au[r] = 0.0f; }
    for (int kw = lane; kw < K / 8; kw += WARP) {
        float wg[8], wu[8];
        ld.load(row_g, kw, wg);
        ld.load(row_g + 1, kw, wu);
#pragma unroll
        for (int r = 0; r < ROWS_PER_TILE; ++r) {
            if (in_row[r] >= 0) {
                float xv[8];
                load8(x + (size_t)in_row[r] * x_stride + (size_t)kw * 8, xv);
#pragma unroll
                for (int j = 0; j < 8; ++j) { ag[r] += xv[j] * wg[j]; au[r] += xv[j] * wu[j]; }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) {
        const float g = warp_sum(ag[r]);
        const float u = warp_sum(au[r]);
        if (lane == 0 && out_row[r] >= 0) h[(size_t)out_row[r] * N + n] = silu_f(g) * u;
    }
}

// Dense SwiGLU gate/up (dense-prefix MLP, shared expert): h[m, n] = silu(x Wg^T) * (x Wu^T).
// Shapes: x [M, x_stride], W13 [N, 2, K] bf16 (gate row then up row per n), h [M, N].
// Launch: grid (ceil(N / 4), ceil(M / 8)), block 128.
extern "C" __global__ void swiglu_dense_bf16(float* __restrict__ h, const float* __restrict__ x,
                                             int x_stride, const bf16_bits* __restrict__ W13,
                                             int M, int N, int K) {
    pdl_enter();
    const int warp = threadIdx.x >> 5;
    const int n = blockIdx.x * LIN_WARPS + warp;
    if (n >= N) return;
    int in_row[ROWS_PER_TILE];
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) {
        const int m = blockIdx.y * ROWS_PER_TILE + r;
        in_row[r] = m < M ? m : -1;
    }
    gate_up_tile(h, N, n, x, x_stride, LoadBf16{W13, K}, (size_t)n * 2, K, in_row, in_row);
}

// ---- Register-tiled bf16 GEMMs (the engine's default at every row count) ----
// linear_body re-reads every activation row once per output column (a warp owns one
// column), so at 32-128 rows its time is activation traffic from L1 / L2, not weights,
// and at one row a lane has a single 16-byte weight load in flight.  Here a warp owns
// LT_RM (4) rows x LT_RN (8) weight rows and keeps both in registers over a 16-byte k
// word, so each load feeds 4-8x more FMAs and a lane has 8 weight loads in flight (rows
// past M are clamped: at one row 3 of 4 are redundant, and it is still faster,
// runs/ab-9268bac).  linear_body stays as the reference (SPECLAB_LIN_TILED_MIN=off).
// Numerics are linear_body's bit for bit: lane l still sums k words l, l + 32, ... in
// order, 8 products a word in order, in its own accumulator per output; the 32 lane
// partials of an output are then added in warp_sum's xor-butterfly pairs (16, 8, 4, 2,
// 1), only spread over the lanes (warp_spread) instead of repeated per output.
// gpu_check's `tiled` lines compare the two bit for bit (cuda/src/gemm_check.rs).
#define LT_RM 4
#define LT_RN 8
#define LT_WR 4  // warps along rows: block tile LT_TM = 16 rows
#define LT_WC 2  // warps along weight rows: block tile LT_TN = 16 weight rows
#define LT_TM (LT_RM * LT_WR)
#define LT_TN (LT_RN * LT_WC)

// The warp sums of S (a power of two <= 32) values per lane, spread: lane l returns the
// sum over lanes of v[l >> (5 - log2 S)].  Each step pairs lanes l, l ^ d exactly as
// warp_sum does (own value + partner's), so every sum equals warp_sum's bit for bit;
// a lane only keeps the half of its values whose index bit matches its lane bit d.
template <int S>
__device__ __forceinline__ float warp_spread(float v[S]) {
    const int lane = threadIdx.x & 31;
    int n = S;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        if (n > 1) {
            const bool up = (lane & d) != 0;
            n >>= 1;
#pragma unroll
            for (int i = 0; i < S / 2; ++i) {
                if (i < n) {
                    const float send = up ? v[i] : v[i + n];
                    const float keep = up ? v[i + n] : v[i];
                    v[i] = keep + __shfl_xor_sync(FULL_MASK, send, d);
                }
            }
        } else {
            v[0] += __shfl_xor_sync(FULL_MASK, v[0], d);
        }
    }
    return v[0];
}

// Warp sub-tile: rows m0 .. m0 + 4 of x times weight rows r0 .. r0 + 8 of W (R rows of K).
// Out-of-range rows / weight rows are clamped to the last valid one (computed, never
// stored).  Lane l returns output (row m0 + l / 8, weight row r0 + l % 8); with NORM the
// rmsnorm scale of its row is applied (linear_body<true>'s formula).
// Weight prefetch before the grid-dependency wait (LT_PREWAIT, default on): the lane's
// weight words of its first k word (kw = lane) are loaded before pdl_enter, since the
// weights are constant and only x depends on the previous kernel, so those loads overlap
// the previous kernel's tail (the prologue pattern programmatic dependent launch allows:
// CUDA programming guide, "Programmatic Dependent Launch and Synchronization").  On
// models/tiny it saves 4-17 us a graphed decode step at batch 8-32; at GLM-5.3 shapes it
// costs bench moe's router + shared-expert GEMMs about 19 us a layer at M = 1
// (runs/ab-ac41812/), and a run-time K test was worse on both (runs/ab-ca738eb/).  The
// values and the order of the sums are unchanged.  SPECLAB_KERNEL_DEFINES=LT_PREWAIT=0
// loads them after the wait as before (A/B).
#ifndef LT_PREWAIT
#define LT_PREWAIT 1
#endif
struct TiledPre {
    uint4 w[LT_RN];  // lane's words: weight rows r0 .. r0 + 8 (clamped), k word `lane`
    float g[8];      // NORM: the lane's norm weights of k word `lane` (linear_norm_tiled)
};

__device__ __forceinline__ void tiled_pre(TiledPre& pre, const bf16_bits* __restrict__ W, int R,
                                          int K, int r0) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < LT_RN; ++c) pre.w[c] = make_uint4(0u, 0u, 0u, 0u);
    if (LT_PREWAIT && lane < K / 8) {
#pragma unroll
        for (int c = 0; c < LT_RN; ++c)
            pre.w[c] = *reinterpret_cast<const uint4*>(W + (size_t)min(r0 + c, R - 1) * K +
                                                       (size_t)lane * 8);
    }
}

// tiled_pre plus the lane's first norm-weight word (linear_norm_tiled_bf16's g, constant).
__device__ __forceinline__ void tiled_pre_norm(TiledPre& pre, const bf16_bits* __restrict__ W,
                                               int R, int K, int r0,
                                               const float* __restrict__ g) {
    tiled_pre(pre, W, R, K, r0);
    const int lane = threadIdx.x & 31;
    if (LT_PREWAIT && lane < K / 8) load8(g + (size_t)lane * 8, pre.g);
}

template <bool NORM>
__device__ __forceinline__ float tiled_dot(const float* __restrict__ x, int x_stride,
                                           const bf16_bits* __restrict__ W, int M, int R,
                                           int K, int m0, int r0, const float* __restrict__ g,
                                           float eps, const TiledPre& pre) {
    const int lane = threadIdx.x & 31;
    float acc[LT_RM * LT_RN], ss[LT_RM];
#pragma unroll
    for (int i = 0; i < LT_RM * LT_RN; ++i) acc[i] = 0.0f;
#pragma unroll
    for (int r = 0; r < LT_RM; ++r) ss[r] = 0.0f;
    for (int kw = lane; kw < K / 8; kw += WARP) {
        float xv[LT_RM][8], gv[8];
#pragma unroll
        for (int r = 0; r < LT_RM; ++r)
            load8(x + (size_t)min(m0 + r, M - 1) * x_stride + (size_t)kw * 8, xv[r]);
        if (NORM) {
            if (LT_PREWAIT && kw == lane) {
#pragma unroll
                for (int j = 0; j < 8; ++j) gv[j] = pre.g[j];
            } else {
                load8(g + (size_t)kw * 8, gv);
            }
        }
#pragma unroll
        for (int c = 0; c < LT_RN; ++c) {
            float w[8];
            widen8(LT_PREWAIT && kw == lane
                       ? pre.w[c]
                       : *reinterpret_cast<const uint4*>(W + (size_t)min(r0 + c, R - 1) * K +
                                                         (size_t)kw * 8),
                   w);
#pragma unroll
            for (int r = 0; r < LT_RM; ++r) {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (NORM)
                        acc[r * LT_RN + c] += xv[r][j] * gv[j] * w[j];
                    else
                        acc[r * LT_RN + c] += xv[r][j] * w[j];
                }
            }
        }
        if (NORM) {
#pragma unroll
            for (int r = 0; r < LT_RM; ++r) {
#pragma unroll
                for (int j = 0; j < 8; ++j) ss[r] += xv[r][j] * xv[r][j];
            }
        }
    }
    float s = warp_spread<LT_RM * LT_RN>(acc);
    if (NORM) s *= 1.0f / sqrtf(warp_spread<LT_RM>(ss) / (float)K + eps);
    return s;
}

// The warp sub-tile origin of block (bx, by): (row m0, weight row r0); false when it is
// past M / R.
__device__ __forceinline__ bool tiled_origin_at(int M, int R, int bx, int by, int& m0, int& r0) {
    const int warp = threadIdx.x >> 5;
    m0 = by * LT_TM + (warp / LT_WC) * LT_RM;
    r0 = bx * LT_TN + (warp % LT_WC) * LT_RN;
    return m0 < M && r0 < R;
}

// tiled_origin_at of this block (blockIdx.x, blockIdx.y).
__device__ __forceinline__ bool tiled_origin(int M, int R, int& m0, int& r0) {
    return tiled_origin_at(M, R, blockIdx.x, blockIdx.y, m0, r0);
}

// y[m, n] (+)= s for the lane's output of tiled_dot.
__device__ __forceinline__ void tiled_store(float* __restrict__ y, int y_stride, int M, int N,
                                            int m0, int n0, float s, int accumulate) {
    const int lane = threadIdx.x & 31;
    const int m = m0 + lane / LT_RN, n = n0 + lane % LT_RN;
    if (m < M && n < N) {
        float* dst = y + (size_t)m * y_stride + n;
        *dst = accumulate ? *dst + s : s;
    }
}

// linear_bf16 / linear_norm_bf16 (NORM) register-tiled: the same arguments and results.
// Launch: grid (ceil(N / 16), ceil(M / 16)), block 256 (launch.rs gemm_tiled).
extern "C" __global__ void __launch_bounds__(256) linear_tiled_bf16(
    float* __restrict__ y, int y_stride, const float* __restrict__ x, int x_stride,
    const bf16_bits* __restrict__ W, int M, int N, int K, int accumulate) {
    int m0, n0;
    if (!tiled_origin(M, N, m0, n0)) return;  // whole warp: no barrier below
    TiledPre pre;
    tiled_pre(pre, W, N, K, n0);
    pdl_enter();
    const float s = tiled_dot<false>(x, x_stride, W, M, N, K, m0, n0, nullptr, 0.0f, pre);
    tiled_store(y, y_stride, M, N, m0, n0, s, accumulate);
}

#define COMBINE_K_MAX 8
// x[m, n] += (sum over token m's k slots in ascending expert id of y[m k + slot, n], from
// zero) + s: moe_combine's order with s in place of the stored shared[m, n].
__device__ __forceinline__ void combine_out(float* __restrict__ x, const float* __restrict__ y,
                                            const int* __restrict__ ids, int k, int N, int m,
                                            int n, float s) {
    // Insertion sort of the token's k slots by expert id (moe_combine's order).
    int ord[COMBINE_K_MAX], key[COMBINE_K_MAX];
#pragma unroll
    for (int j = 0; j < COMBINE_K_MAX; ++j) {
        ord[j] = j;
        key[j] = j < k ? ids[(size_t)m * k + j] : 0x7fffffff;
    }
#pragma unroll
    for (int j = 1; j < COMBINE_K_MAX; ++j) {
#pragma unroll
        for (int i = j; i > 0; --i) {
            if (key[i - 1] > key[i]) {
                const int tk = key[i - 1], to = ord[i - 1];
                key[i - 1] = key[i];
                ord[i - 1] = ord[i];
                key[i] = tk;
                ord[i] = to;
            }
        }
    }
    float o = 0.0f;
#pragma unroll
    for (int j = 0; j < COMBINE_K_MAX; ++j)
        if (j < k) o += y[((size_t)m * k + ord[j]) * N + n];
    o += s;
    x[(size_t)m * N + n] += o;
}

// The shared expert's down-projection with the MoE combine as its epilogue (moe.cu
// moe_combine's work): for the lane's output (t, n), s = h[t] . Wd[n] as linear_tiled_bf16
// computes it, then x[t, n] += (sum over the token's slots in ascending expert id of
// y[t k + slot, n], from zero) + s: moe_combine's order with s in place of the stored
// shared[t, n], so the result is bit for bit the unfused pair's.  Shapes: x [M, N]
// (stride N), y [M k, N], ids [M, k] (k <= 8, distinct ids), h [M, h_stride], Wd [N, K].
// settled != 0: h settled two grids back, the dot runs before the grid-dependency wait
// (as linear_skinny_combine_bf16).
// Launch: grid (ceil(N / 16), ceil(M / 16)), block 256 (as linear_tiled_bf16).
extern "C" __global__ void __launch_bounds__(256) linear_tiled_combine_bf16(
    float* __restrict__ x, const float* __restrict__ y, const int* __restrict__ ids, int k,
    const float* __restrict__ h, int h_stride, const bf16_bits* __restrict__ W, int M, int N,
    int K, int settled) {
    int m0, n0;
    if (!tiled_origin(M, N, m0, n0)) return;
    TiledPre pre;
    tiled_pre(pre, W, N, K, n0);
    if (!settled) pdl_enter();
    const float s = tiled_dot<false>(h, h_stride, W, M, N, K, m0, n0, nullptr, 0.0f, pre);
    if (settled) pdl_enter();  // y (the routed outputs) is the previous grid's
    const int lane = threadIdx.x & 31;
    const int m = m0 + lane / LT_RN, n = n0 + lane % LT_RN;
    if (m < M && n < N) combine_out(x, y, ids, k, N, m, n, s);
}

extern "C" __global__ void __launch_bounds__(256) linear_norm_tiled_bf16(
    float* __restrict__ y, int y_stride, const float* __restrict__ x, int x_stride,
    const bf16_bits* __restrict__ W, int M, int N, int K, int accumulate,
    const float* __restrict__ g, float eps) {
    int m0, n0;
    if (!tiled_origin(M, N, m0, n0)) return;
    TiledPre pre;
    tiled_pre_norm(pre, W, N, K, n0, g);
    pdl_enter();
    const float s = tiled_dot<true>(x, x_stride, W, M, N, K, m0, n0, g, eps, pre);
    tiled_store(y, y_stride, M, N, m0, n0, s, accumulate);
}

// linear_pair_bf16 register-tiled.  Launch: grid (ceil(N / 16), ceil(M / 16), 2), block 256.
extern "C" __global__ void __launch_bounds__(256) linear_pair_tiled_bf16(
    float* __restrict__ y0, float* __restrict__ y1, int y_stride, const float* __restrict__ x0,
    const float* __restrict__ x1, int x_stride, const bf16_bits* __restrict__ W0,
    const bf16_bits* __restrict__ W1, int M, int N, int K) {
    int m0, n0;
    if (!tiled_origin(M, N, m0, n0)) return;
    const bool z = blockIdx.z != 0;
    TiledPre pre;
    tiled_pre(pre, z ? W1 : W0, N, K, n0);
    pdl_enter();
    const float s = tiled_dot<false>(z ? x1 : x0, x_stride, z ? W1 : W0, M, N, K, m0, n0,
                                     nullptr, 0.0f, pre);
    tiled_store(z ? y1 : y0, y_stride, M, N, m0, n0, s, 0);
}

// swiglu_dense_bf16 register-tiled: the sub-tile's 8 weight rows are 4 columns' (gate, up)
// pairs of W13 [N, 2, K]; the up sum comes from the neighbour lane (l ^ 1).  h [M, N].
// Launch: grid (ceil(2 N / 16), ceil(M / 16)), block 256.
// Block (bx, by) of that grid; calls pdl_enter (after its weight prologue) unless the
// warp's sub-tile is past the output.
__device__ __forceinline__ void swiglu_tiled_block(float* __restrict__ h,
                                                   const float* __restrict__ x, int x_stride,
                                                   const bf16_bits* __restrict__ W13, int M,
                                                   int N, int K, int bx, int by) {
    int m0, r0;
    if (!tiled_origin_at(M, 2 * N, bx, by, m0, r0)) return;
    TiledPre pre;
    tiled_pre(pre, W13, 2 * N, K, r0);
    pdl_enter();
    const float s = tiled_dot<false>(x, x_stride, W13, M, 2 * N, K, m0, r0, nullptr, 0.0f, pre);
    const float u = __shfl_xor_sync(FULL_MASK, s, 1);
    const int lane = threadIdx.x & 31;
    const int m = m0 + lane / LT_RN, r = r0 + lane % LT_RN;
    if ((r & 1) == 0 && m < M && r < 2 * N) h[(size_t)m * N + r / 2] = silu_f(s) * u;
}

extern "C" __global__ void __launch_bounds__(256) swiglu_tiled_bf16(
    float* __restrict__ h, const float* __restrict__ x, int x_stride,
    const bf16_bits* __restrict__ W13, int M, int N, int K) {
    swiglu_tiled_block(h, x, x_stride, W13, M, N, K, blockIdx.x, blockIdx.y);
}

// ---- Skinny bf16 GEMMs (decode rows: the engine's default up to LS_RM rows) ----
// At one row the register-tiled kernels above keep 2 of a block's 8 warps busy (the warps
// whose 4 rows start past M return at once) and a lane has the 8 weight loads of one k
// word in flight.  A GEMV of GLM-5.3-Flash's size (router 288 x 4096, shared expert
// 4096 x 4096 then 4096 x 2048, bf16; 52.7 MB at M = 1) then streams at a fraction of the
// copy bandwidth (`speclab bench moe`, layer_parts).  Here each of the block's LS_WARPS
// warps owns LS_RN (2) weight rows and the block's rows of x (LS_RM at most), and a lane
// issues the loads of LS_U (8) k words of both weight rows before it multiplies: 16
// 16-byte loads in flight a lane, and a block still covers 16 weight rows, as a tiled
// block does.  The block's row count MR (1, 2 or 4; 3 rows run as 4 with the last row
// repeated, computed and never stored) is a template parameter, so one row loads x once
// a k word, not four times (LS_EXACT_ROWS, default 1; 0 always takes 4, the A/B).
// Numerics are linear_body's bit for bit, as the tiled kernels': lane l sums k words l,
// l + 32, ... in order, 8 products a word in order, one accumulator per output, and the
// lane partials are added in warp_sum's butterfly pairs (warp_spread).  gpu_check's
// `skinny` lines compare them with the warp-per-column kernels bit for bit
// (cuda/src/gemm_check.rs).  LS_PREWAIT (default 1): the first group's weight loads are
// issued before the grid-dependency wait, as LT_PREWAIT does for the tiled kernels.
#define LS_RM 4
#define LS_RN 2
#define LS_U 8
#define LS_WARPS 8
#define LS_TN (LS_RN * LS_WARPS)
#ifndef LS_PREWAIT
#define LS_PREWAIT 1
#endif
#ifndef LS_EXACT_ROWS
#define LS_EXACT_ROWS 1
#endif

// One k word kw of the lane: acc[r LS_RN + c] += x[m0 + r] . W[r0 + c] over its 8
// products (with NORM, (x g) . W, and ss[r] += x . x), as tiled_dot orders them.
template <bool NORM, int MR>
__device__ __forceinline__ void skinny_word(float acc[MR * LS_RN], float ss[MR],
                                            const float* __restrict__ x, int x_stride, int M,
                                            int m0, int kw, const uint4 wv[LS_RN],
                                            const float* __restrict__ g) {
    float xv[MR][8], gv[8];
#pragma unroll
    for (int r = 0; r < MR; ++r)
        load8(x + (size_t)min(m0 + r, M - 1) * x_stride + (size_t)kw * 8, xv[r]);
    if (NORM) load8(g + (size_t)kw * 8, gv);
#pragma unroll
    for (int c = 0; c < LS_RN; ++c) {
        float w[8];
        widen8(wv[c], w);
#pragma unroll
        for (int r = 0; r < MR; ++r) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (NORM)
                    acc[r * LS_RN + c] += xv[r][j] * gv[j] * w[j];
                else
                    acc[r * LS_RN + c] += xv[r][j] * w[j];
            }
        }
    }
    if (NORM) {
#pragma unroll
        for (int r = 0; r < MR; ++r) {
#pragma unroll
            for (int j = 0; j < 8; ++j) ss[r] += xv[r][j] * xv[r][j];
        }
    }
}

// The lane's weight words of the LS_U k words kw, kw + 32, ... (those below nw = K / 8)
// of weight rows r0, r0 + 1 (clamped to R - 1).
__device__ __forceinline__ void skinny_load(uint4 wv[LS_U][LS_RN], const bf16_bits* __restrict__ W,
                                            int R, int K, int r0, int kw) {
#pragma unroll
    for (int u = 0; u < LS_U; ++u) {
        if (kw + WARP * u < K / 8) {
#pragma unroll
            for (int c = 0; c < LS_RN; ++c)
                wv[u][c] = *reinterpret_cast<const uint4*>(
                    W + (size_t)min(r0 + c, R - 1) * K + (size_t)(kw + WARP * u) * 8);
        }
    }
}

// Warp dot of rows m0 .. m0 + MR of x and weight rows r0, r0 + 1 of W (R rows of K): lane
// l returns output i = l / (32 / (MR LS_RN)), row m0 + i / 2, weight row r0 + i % 2
// (skinny_out); with NORM the rmsnorm scale of its row applied.  Calls pdl_enter after
// the first group's weight loads are issued (LS_PREWAIT) or before them; with `wait`
// false not at all: the caller guarantees x settled before this grid (then calls
// pdl_enter itself before it reads what the previous grid wrote).
template <bool NORM, int MR>
__device__ __forceinline__ float skinny_dot(const float* __restrict__ x, int x_stride,
                                            const bf16_bits* __restrict__ W, int M, int R,
                                            int K, int m0, int r0, const float* __restrict__ g,
                                            float eps, bool wait = true) {
    const int lane = threadIdx.x & 31;
    float acc[MR * LS_RN], ss[MR];
#pragma unroll
    for (int i = 0; i < MR * LS_RN; ++i) acc[i] = 0.0f;
#pragma unroll
    for (int r = 0; r < MR; ++r) ss[r] = 0.0f;
    uint4 wv[LS_U][LS_RN];
    if (LS_PREWAIT || !wait) skinny_load(wv, W, R, K, r0, lane);  // constant weights only
    if (wait) pdl_enter();
    if (!LS_PREWAIT && wait) skinny_load(wv, W, R, K, r0, lane);
    for (int kw = lane; kw < K / 8;) {
#pragma unroll
        for (int u = 0; u < LS_U; ++u)
            if (kw + WARP * u < K / 8)
                skinny_word<NORM, MR>(acc, ss, x, x_stride, M, m0, kw + WARP * u, wv[u], g);
        kw += WARP * LS_U;
        if (kw < K / 8) skinny_load(wv, W, R, K, r0, kw);
    }
    float s = warp_spread<MR * LS_RN>(acc);
    if (NORM) s *= 1.0f / sqrtf(warp_spread<MR>(ss) / (float)K + eps);
    return s;
}

// The warp's origin in block (bx, by) of a skinny grid: (row m0, weight row r0) and the
// block's row count MR (skinny_rows); false when it is past M / R (the whole warp
// returns: no barrier follows).
__device__ __forceinline__ bool skinny_origin_at(int M, int R, int bx, int by, int& m0, int& r0) {
    m0 = by * LS_RM;
    r0 = bx * LS_TN + (threadIdx.x >> 5) * LS_RN;
    return m0 < M && r0 < R;
}

// The template row count for rows m0 .. M of a block: 1, 2 or 4 (LS_EXACT_ROWS), else 4.
__device__ __forceinline__ int skinny_rows(int M, int m0) {
    const int rows = min(LS_RM, M - m0);
    return LS_EXACT_ROWS && rows <= 2 ? rows : LS_RM;
}

// skinny_dot's output of this lane: row m, weight row r; whether the lane stores it (the
// first of the lanes holding it).
template <int MR>
__device__ __forceinline__ bool skinny_out(int m0, int r0, int& m, int& r) {
    constexpr int per = 32 / (MR * LS_RN);  // lanes holding one output
    const int lane = threadIdx.x & 31, i = lane / per;
    m = m0 + i / LS_RN;
    r = r0 + i % LS_RN;
    return lane % per == 0;
}

// One warp of linear_skinny at row count MR.
template <bool NORM, int MR>
__device__ __forceinline__ void linear_skinny_rows(float* __restrict__ y, int y_stride,
                                                   const float* __restrict__ x, int x_stride,
                                                   const bf16_bits* __restrict__ W, int M,
                                                   int N, int K, int accumulate,
                                                   const float* __restrict__ g, float eps,
                                                   int m0, int r0) {
    int m, n;
    const float s = skinny_dot<NORM, MR>(x, x_stride, W, M, N, K, m0, r0, g, eps);
    if (skinny_out<MR>(m0, r0, m, n) && m < M && n < N) {
        float* dst = y + (size_t)m * y_stride + n;
        *dst = accumulate ? *dst + s : s;
    }
}

// linear_bf16 / linear_norm_bf16 (NORM) for few rows: the same arguments and results.
// Launch: grid (ceil(N / 16), ceil(M / 4)), block 256 (launch.rs gemm_skinny).
template <bool NORM>
__device__ __forceinline__ void linear_skinny(float* __restrict__ y, int y_stride,
                                              const float* __restrict__ x, int x_stride,
                                              const bf16_bits* __restrict__ W, int M, int N,
                                              int K, int accumulate,
                                              const float* __restrict__ g, float eps) {
    int m0, r0;
    if (!skinny_origin_at(M, N, blockIdx.x, blockIdx.y, m0, r0)) return;
    switch (skinny_rows(M, m0)) {
        case 1:
            linear_skinny_rows<NORM, 1>(y, y_stride, x, x_stride, W, M, N, K, accumulate, g,
                                        eps, m0, r0);
            break;
        case 2:
            linear_skinny_rows<NORM, 2>(y, y_stride, x, x_stride, W, M, N, K, accumulate, g,
                                        eps, m0, r0);
            break;
        default:
            linear_skinny_rows<NORM, LS_RM>(y, y_stride, x, x_stride, W, M, N, K, accumulate,
                                            g, eps, m0, r0);
    }
}

extern "C" __global__ void __launch_bounds__(32 * LS_WARPS) linear_skinny_bf16(
    float* __restrict__ y, int y_stride, const float* __restrict__ x, int x_stride,
    const bf16_bits* __restrict__ W, int M, int N, int K, int accumulate) {
    linear_skinny<false>(y, y_stride, x, x_stride, W, M, N, K, accumulate, nullptr, 0.0f);
}

extern "C" __global__ void __launch_bounds__(32 * LS_WARPS) linear_norm_skinny_bf16(
    float* __restrict__ y, int y_stride, const float* __restrict__ x, int x_stride,
    const bf16_bits* __restrict__ W, int M, int N, int K, int accumulate,
    const float* __restrict__ g, float eps) {
    linear_skinny<true>(y, y_stride, x, x_stride, W, M, N, K, accumulate, g, eps);
}

// linear_pair_bf16 for few rows.  Launch: grid (ceil(N / 16), ceil(M / 4), 2), block 256.
extern "C" __global__ void __launch_bounds__(32 * LS_WARPS) linear_pair_skinny_bf16(
    float* __restrict__ y0, float* __restrict__ y1, int y_stride, const float* __restrict__ x0,
    const float* __restrict__ x1, int x_stride, const bf16_bits* __restrict__ W0,
    const bf16_bits* __restrict__ W1, int M, int N, int K) {
    const bool z = blockIdx.z != 0;
    linear_skinny<false>(z ? y1 : y0, y_stride, z ? x1 : x0, x_stride, z ? W1 : W0, M, N, K, 0,
                         nullptr, 0.0f);
}

// One warp of swiglu_skinny_block at row count MR: its 2 weight rows are one column's
// (gate, up) pair of W13 [N, 2, K]; the up sum comes from the lane holding output i + 1.
template <int MR>
__device__ __forceinline__ void swiglu_skinny_rows(float* __restrict__ h,
                                                   const float* __restrict__ x, int x_stride,
                                                   const bf16_bits* __restrict__ W13, int M,
                                                   int N, int K, int m0, int r0) {
    int m, r;
    const float s = skinny_dot<false, MR>(x, x_stride, W13, M, 2 * N, K, m0, r0, nullptr, 0.0f);
    const float u = __shfl_xor_sync(FULL_MASK, s, 32 / (MR * LS_RN));
    if (skinny_out<MR>(m0, r0, m, r) && (r & 1) == 0 && m < M && r < 2 * N)
        h[(size_t)m * N + r / 2] = silu_f(s) * u;
}

// swiglu_tiled_block for few rows: block (bx, by) of the grid (ceil(2 N / 16), ceil(M /
// 4)), 256 threads.
__device__ __forceinline__ void swiglu_skinny_block(float* __restrict__ h,
                                                    const float* __restrict__ x, int x_stride,
                                                    const bf16_bits* __restrict__ W13, int M,
                                                    int N, int K, int bx, int by) {
    int m0, r0;
    if (!skinny_origin_at(M, 2 * N, bx, by, m0, r0)) return;
    switch (skinny_rows(M, m0)) {
        case 1:
            swiglu_skinny_rows<1>(h, x, x_stride, W13, M, N, K, m0, r0);
            break;
        case 2:
            swiglu_skinny_rows<2>(h, x, x_stride, W13, M, N, K, m0, r0);
            break;
        default:
            swiglu_skinny_rows<LS_RM>(h, x, x_stride, W13, M, N, K, m0, r0);
    }
}

extern "C" __global__ void __launch_bounds__(32 * LS_WARPS) swiglu_skinny_bf16(
    float* __restrict__ h, const float* __restrict__ x, int x_stride,
    const bf16_bits* __restrict__ W13, int M, int N, int K) {
    swiglu_skinny_block(h, x, x_stride, W13, M, N, K, blockIdx.x, blockIdx.y);
}

// One warp of linear_skinny_combine_bf16 at row count MR; `settled`: as there.
template <int MR>
__device__ __forceinline__ void combine_skinny_rows(float* __restrict__ x,
                                                    const float* __restrict__ y,
                                                    const int* __restrict__ ids, int k,
                                                    const float* __restrict__ h, int h_stride,
                                                    const bf16_bits* __restrict__ W, int M,
                                                    int N, int K, int m0, int r0, bool settled) {
    int m, n;
    const float s =
        skinny_dot<false, MR>(h, h_stride, W, M, N, K, m0, r0, nullptr, 0.0f, !settled);
    if (settled) pdl_enter();  // y (the routed outputs) is the previous grid's
    if (skinny_out<MR>(m0, r0, m, n) && m < M && n < N) combine_out(x, y, ids, k, N, m, n, s);
}

// linear_tiled_combine_bf16 for few rows: the same arguments and results.  settled != 0:
// h was written at least two grids back (the shared SwiGLU merged into the routed gate/up
// launch, with the routed down-projection between), so the whole dot runs before the
// grid-dependency wait, overlapping the down-projection's tail; only the combine waits.
// The argument is w4_mma's `pre`: the grid just before this one triggered its dependents
// only after its own wait returned (common.cuh pdl_enter), i.e. after h's grid completed.
// Launch: grid (ceil(N / 16), ceil(M / 4)), block 256 (launch.rs gemm_skinny).
extern "C" __global__ void __launch_bounds__(32 * LS_WARPS) linear_skinny_combine_bf16(
    float* __restrict__ x, const float* __restrict__ y, const int* __restrict__ ids, int k,
    const float* __restrict__ h, int h_stride, const bf16_bits* __restrict__ W, int M, int N,
    int K, int settled) {
    int m0, r0;
    if (!skinny_origin_at(M, N, blockIdx.x, blockIdx.y, m0, r0)) return;
    const bool st = settled != 0;
    switch (skinny_rows(M, m0)) {
        case 1:
            combine_skinny_rows<1>(x, y, ids, k, h, h_stride, W, M, N, K, m0, r0, st);
            break;
        case 2:
            combine_skinny_rows<2>(x, y, ids, k, h, h_stride, W, M, N, K, m0, r0, st);
            break;
        default:
            combine_skinny_rows<LS_RM>(x, y, ids, k, h, h_stride, W, M, N, K, m0, r0, st);
    }
}

// Rows of MoE tile `tile`: pair ids (output rows) and their token rows (p / topk).
__device__ __forceinline__ void tile_rows(const int* __restrict__ sorted, int tile, int topk,
                                          int in_row[ROWS_PER_TILE], int out_row[ROWS_PER_TILE]) {
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) {
        const int p = sorted[tile * ROWS_PER_TILE + r];
        out_row[r] = p;
        in_row[r] = p >= 0 ? p / topk : -1;
    }
}

template <class L>
__device__ __forceinline__ void moe_gate_up(float* h, const float* x, const L& ld,
                                            const int* sorted, const int* tile_expert,
                                            int topk, int N, int K) {
    const int n = blockIdx.x * LIN_WARPS + (threadIdx.x >> 5);
    const int tile = blockIdx.y;
    const int e = tile_expert[tile];
    if (e < 0 || n >= N) return;  // uniform per warp
    int in_row[ROWS_PER_TILE], out_row[ROWS_PER_TILE];
    tile_rows(sorted, tile, topk, in_row, out_row);
    gate_up_tile(h, N, n, x, K, ld, ((size_t)e * N + n) * 2, K, in_row, out_row);
}

// Routed experts gate/up + SiLU, bf16 (the MTP layer's MoE stays bf16, docs/model.md §8):
// h[p, n] = silu(x[p / topk] . Wg[e, n]) * (x[p / topk] . Wu[e, n]).
// Shapes: w13 [E, N, 2, K] bf16, x [T, K], h [P, N].
// Launch: grid (ceil(N / 4), max_tiles), block 128 (launch.rs moe_gemm).
extern "C" __global__ void moe_gate_up_bf16(float* __restrict__ h, const float* __restrict__ x,
                                            const bf16_bits* __restrict__ w13,
                                            const int* __restrict__ sorted,
                                            const int* __restrict__ tile_expert, int topk,
                                            int N, int K) {
    pdl_enter();
    moe_gate_up(h, x, LoadBf16{w13, K}, sorted, tile_expert, topk, N, K);
}

template <class L>
__device__ __forceinline__ void moe_down(float* y, const float* h, const L& ld,
                                         const float* topk_w, const int* sorted,
                                         const int* tile_expert, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * LIN_WARPS + (threadIdx.x >> 5);
    const int tile = blockIdx.y;
    const int e = tile_expert[tile];
    if (e < 0 || n >= N) return;
    int rows[ROWS_PER_TILE];
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) rows[r] = sorted[tile * ROWS_PER_TILE + r];
    float acc[ROWS_PER_TILE];
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) acc[r] = 0.0f;
    const size_t row = (size_t)e * N + n;
    for (int kw = lane; kw < K / 8; kw += WARP) {
        float w[8];
        ld.load(row, kw, w);
#pragma unroll
        for (int r = 0; r < ROWS_PER_TILE; ++r) {
            if (rows[r] >= 0) {
                float xv[8];
                load8(h + (size_t)rows[r] * K + (size_t)kw * 8, xv);
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[r] += xv[j] * w[j];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) {
        const float s = warp_sum(acc[r]);
        if (lane == 0 && rows[r] >= 0) y[(size_t)rows[r] * N + n] = topk_w[rows[r]] * s;
    }
}

// Routed experts down-projection, bf16: y[p, n] = w_p * (h[p] . Wd[e, n]).
// Shapes: wd [E, N, K] bf16, h [P, K], topk_w [P], y [P, N].
// Launch: grid (ceil(N / 4), max_tiles), block 128 (launch.rs moe_gemm).
extern "C" __global__ void moe_down_bf16(float* __restrict__ y, const float* __restrict__ h,
                                         const bf16_bits* __restrict__ wd,
                                         const float* __restrict__ topk_w,
                                         const int* __restrict__ sorted,
                                         const int* __restrict__ tile_expert, int N, int K) {
    pdl_enter();
    moe_down(y, h, LoadBf16{wd, K}, topk_w, sorted, tile_expert, N, K);
}

// ---------------------------------------------------------------------------------------
// INT4 (W4A16) routed experts on tensor cores, issue 12: tuned for decode / verify batches
// at GLM-5.3-Flash shapes (hidden 4096, moe-intermediate 2048, 288 experts top-8), where
// the layer is a stream of expert weights (M = 1: 8 experts x 12.6 MB) and each expert
// sees few tokens.
//
// Scheme (vLLM csrc/moe/marlin_moe_wna16 and gptq_marlin: weights pre-shuffled into mma
// fragment order, a cp.async pipeline, lop3 dequantization to bf16 pairs, mma.sync
// m16n8k16 with f32 accumulation; the arrangement here is the engine's own).  The previous
// f32 CUDA-core split-K GEMV executed 6.4 instructions a weight and was issue-bound at 36%
// of copy bandwidth (runs/ncu-final-m1.txt.xz); this one runs about 65 SASS instructions a
// k16 step of 1024 weights a warp in its packed loop (2 a weight a lane).
// - One moe_align tile (up to 8 pairs of one expert) is the mma's N = 8 columns.
// - A warp owns a row block of 64 weight rows (W4_RT = 4 mma tiles of 16) over a K range
//   of whole half 128-groups; the block's W4_WARPS warps split K ks ways and cover
//   W4_WARPS / ks row blocks.  ks is chosen in the kernel from moe_align's count of real
//   tiles, by segments of tile counts the host computes from its rule (w4_split; by
//   default the wave rule, launch.rs W4Split::waves: a split whose items fill one wave
//   of resident blocks, else the smallest reaching 2.5 waves), at most the host's bound
//   ks_hi; the 1-D grid of (tile, row-block group) items is sized for ks_hi and every
//   tile, and items past the real ones exit.
// - Weights (cuda/src/repack.rs, "the device INT4 layout"): per (expert, row block, k16
//   step) 32 lanes x uint4, word i of lane (g, t) = the A fragment of mma tile i, nibble
//   slot j + 4 e = element e of register j, so (w >> 4 j) & 0x000f000f | 0x43004300 is the
//   bf16 pair 128 + n of register j (Marlin's trick), stored as q + 8.  They stream
//   through a cp.async double buffer of half 128-groups (4 k16 steps, 64 B a lane, plus
//   the group's 8 scales of the lane's rows) in dynamic shared memory, private to each
//   lane (cp.async.wait_group is the only synchronization; 3 and 4 stages measured
//   slower); the activations (the B operand) of the next half group are loaded into
//   registers while the current one is multiplied.
// - Exact numerics: n - 8 is an exact bf16; each f32 activation is split into W4_XS bf16
//   terms (W4_XS 3: hi + mid + lo, which sum to the f32 value exactly; 2: 16 significant
//   bits), products are exact, accumulation is f32, and a 128-group's partial is scaled by
//   its f32 scale on the accumulator.  So the result is the f32 dot product of
//   docs/model.md §1.3 up to summation order.
// - Packed columns: when a tile's pairs times W4_XS fit the 8 columns (1-2 pairs for
//   W4_XS 3, the common case of decode), column g carries term g % W4_XS of pair
//   g / W4_XS, so one mma a k16 step does the work; the terms are summed in the epilogue.
//   3-5 pairs fill 16 columns of two mmas with two accumulator sets (W4_PACK2); more,
//   column g is pair g and each term is one mma (W4M, the column modes).
// - Epilogue: every warp's accumulators (one or two sets) go to shared memory; the
//   block's threads sum the K slices (in warp order: deterministic) and the terms, and
//   write coalesced rows.
// - Both kernels read their B operand pre-split (w4_h_word): gate/up from moe_split_x of
//   the post-norm input, down from gate/up's output h (silu(g) * u split into W4_XS bf16
//   terms, exact for W4_XS 3).
// - K is split between warps in half groups, so small K (models/tiny: 128, 256) still
//   spreads over the block's warps; each half is scaled on the accumulator on its own.
// Requirements (host-checked, cuda/src/launch.rs moe_w4): K % 128 == 0, rows (N * NMAT)
// % 64 == 0, x rows 8-byte aligned; dynamic shared memory W4_SMEM bytes.

#define W4_RT 4
// Warps a block.  SPECLAB_KERNEL_DEFINES=W4_WARPS=4 (with W4_MINB=4 for the same register
// cap) halves a block, so partial waves are finer (launch.rs w4_warps; the host then runs
// the shared expert's SwiGLU in its own launch, its tiled block being 256 threads).
#ifndef W4_WARPS
#define W4_WARPS 8
#endif
#if W4_WARPS != 4 && W4_WARPS != 8
#error "W4_WARPS must be 4 or 8"
#endif
// Weight stages: a double buffer (more stages measured slower, runs/moe-variants/, when they
// cost a resident block).  SPECLAB_KERNEL_DEFINES=W4_STAGES=3 takes the triple-buffered walk
// (w4_walk3; modes 0 and 2 only, W4_PACK2 0): two halves in flight while one is multiplied,
// still 2 blocks an SM (94 KB of shared memory each).  With W4_XS=1 it made the small-M
// rows slower on an H100 (M = 1 51 against 48 us; runs/moe-stages3-a5fabdb/).
#ifndef W4_STAGES
#define W4_STAGES 2
#endif
#if W4_STAGES != 2 && W4_STAGES != 3
#error "W4_STAGES must be 2 or 3"
#endif
#if W4_STAGES == 3 && W4_PACK2
#error "W4_STAGES=3 walks modes 0 and 2 only: W4_PACK2 must be 0"
#endif
// uint4 a lane a stage: 4 k16 steps of weights + the group's scales.
#define W4_SLOT 5
// Bulk-copy walk (SPECLAB_KERNEL_DEFINES=W4_BULK=n, n = 2..6 stages; default 0: off, the
// cp.async walk above): lane 0 of a warp fetches each half group with two bulk copies
// (sm_90 `cp.async.bulk` global -> shared, completing on an mbarrier a stage: PTX ISA,
// "Data movement: cp.async.bulk"; the producer side of CUTLASS's TMA pipelines): the
// half's 2 KB of weights, contiguous in the device layout, and its group's 128 B of scales.
// A stage is then 2,176 B (W4_BSLOT uint4) against the cp.async walk's 2,560 (every lane
// copying its scale uint4), the epilogue's accumulators overlay the stages (so 6 stages
// of 8 warps still leave 2 blocks an SM), the prologue issues n halves before the first wait, and a
// slot is refilled once the warp has multiplied it, so n halves are in flight a warp
// where the double buffer keeps one to two (a lone block streams at about 22 GB/s
// against the H200's 32 GB/s share of an SM, findings/bench-moe.md).  Invariants: a
// warp's n mbarriers are initialised (count 1) by its lane 0 before any copy and each
// completes once a use, so use u of slot j waits for parity u & 1; a slot is refilled
// only after __syncwarp, i.e. after every lane's shared loads of its previous half.
// Modes 0 and 2 only (W4_PACK2 0), and W4_STAGES is then unused.
#ifndef W4_BULK
#define W4_BULK 0
#endif
#if W4_BULK != 0 && (W4_BULK < 2 || W4_BULK > 6)
#error "W4_BULK must be 0 (off) or 2..6 stages"
#endif
#if W4_BULK && (W4_PACK2 || W4_STAGES != 2)
#error "W4_BULK walks modes 0 and 2 with its own stages: W4_PACK2 0 and W4_STAGES 2"
#endif
// uint4 a warp's bulk stage: 4 k16 steps x 32 lanes of weights, then 8 of scales.
#define W4_BSLOT 136
static_assert(W4_BSLOT == 4 * WARP + 8, "W4_BSLOT");
// The accumulators' two sets ([2][W4_WARPS][W4_RT][4][32] f32) fit in two bulk stages.
static_assert(2 * W4_BSLOT * 16 >= 2 * W4_RT * 4 * WARP * 4, "red overlays the stages");
#if W4_BULK
#define W4_NST W4_BULK
#define W4_SLOT_U4 W4_BSLOT
#else
#define W4_NST W4_STAGES
#define W4_SLOT_U4 (W4_SLOT * WARP)
#endif
// Blocks an SM the registers are budgeted for (128 a thread; ptxas: 1 also takes 128, 3
// spills at 80).  A tunable (SPECLAB_KERNEL_DEFINES=W4_MINB=n); 3 with W4_XS=1 (95
// registers at 2) spilled 40-56 bytes and was slower at every row (runs/moe-minb3-ff0865d/).
#ifndef W4_MINB
#define W4_MINB 2
#endif
// Block trace (issue 12 diagnostics; SPECLAB_KERNEL_DEFINES=W4_TRACE=1, off by default and
// then compiled out): thread 0 of every working block of moe_split_x, moe_gate_up_w4 and
// moe_down_w4 appends one record of W4_TRACE_F words to w4_trace: kernel << 48 | SM << 32
// | block, then %globaltimer (ns) at entry, once the grid-dependency wait returned, after
// the block's weight walk (the barrier behind every warp's walk), and at the end of
// thread 0's epilogue.  The host zeroes w4_trace_n before a traced call and reads both
// back (cuda/src/w4trace.rs, which mirrors the constants); records past W4_TRACE_CAP are
// counted, not written.  The timer is the one the CUDA events' clock domain shares (PTX
// ISA, special register %globaltimer).
#ifndef W4_TRACE
#define W4_TRACE 0
#endif
#define W4_TRACE_CAP 16384
#define W4_TRACE_F 5
#if W4_TRACE
__device__ unsigned long long w4_trace[W4_TRACE_CAP * W4_TRACE_F];
__device__ unsigned int w4_trace_n;
#endif
struct W4Clock {
#if W4_TRACE
    unsigned long long t[4];
#endif
    // Time mark I (0 entry, 1 released, 2 walked, 3 done), thread 0 only.
    template <int I>
    __device__ __forceinline__ void mark() {
#if W4_TRACE
        if (threadIdx.x == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t[I]));
#endif
    }
    // Append this block's record as kernel `k` (1 split, 2 gate/up, 3 down).
    __device__ __forceinline__ void put(int k) const {
#if W4_TRACE
        if (threadIdx.x != 0) return;
        u32 sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        const u32 slot = atomicAdd(&w4_trace_n, 1u);
        if (slot >= W4_TRACE_CAP) return;
        unsigned long long* r = w4_trace + (size_t)slot * W4_TRACE_F;
        r[0] = (unsigned long long)k << 48 | (unsigned long long)sm << 32 | blockIdx.x;
        for (int i = 0; i < 4; ++i) r[1 + i] = t[i];
#endif
    }
};

// Asynchronous 16-byte copy global -> shared, L2 only (sm_80+ cp.async, as Marlin's
// multi-stage pipeline: vLLM csrc/quantization/gptq_marlin/marlin.cuh cp_async4).
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
// Wait until at most two committed groups are pending (the triple-buffered walk).
__device__ __forceinline__ void cp_async_wait_two() {
    asm volatile("cp.async.wait_group 2;" ::: "memory");
}
// Wait until at most one committed group is pending.
__device__ __forceinline__ void cp_async_wait_one() {
    asm volatile("cp.async.wait_group 1;" ::: "memory");
}

// mbarriers and bulk copies (sm_90; PTX ISA "Parallel synchronization: mbarrier" and
// "cp.async.bulk"), for W4_BULK.  The barrier at shared address `bar` expects one arrival.
__device__ __forceinline__ void mbar_init(u32 bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
// Makes the initialisations visible to the async proxy (the bulk copies' completions).
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Lane 0's arrival, announcing `bytes` that bulk copies will complete on the barrier.
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}
// Wait until the barrier's phase of parity `phase` completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 phase) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "W4_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra W4_WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(phase)
        : "memory");
}
// `bytes` (a multiple of 16) global -> shared, completing on barrier `bar` (a CTA is a
// cluster of one, so its own shared address is a shared::cluster address).
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}

// The bf16 pair (element 0 low) of register j of an A fragment word, exactly n - 8.
__device__ __forceinline__ u32 w4_frag(u32 w, int j) {
    const u32 p = lop3_and_or(w >> (4 * j), 0x000f000fu, 0x43004300u);  // 128 + n
    u32 d;
    // p * 1.0 - 136.0 in bf16x2 (0x3f80 = 1.0, 0xc308 = -136.0): exact.
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(p), "r"(0x3f803f80u), "r"(0xc308c308u));
    return d;
}

// D = A B + D, m16n8k16, bf16 inputs, f32 accumulators (PTX ISA, "mma.m16n8k16").
__device__ __forceinline__ void mma_bf16(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Split activations x [T, K] f32 -> xs [T, K W4_XS / 2] u32 words (w4_h_word), the B
// operand of moe_gate_up_w4.  Shapes: x [T, K] (K % 16 == 0, rows 8-byte aligned).
// Launch: grid (ceil(T K / 4 / 128)), block 128: one thread per (row, k16 step, t).
extern "C" __global__ void moe_split_x(u32* __restrict__ xs, const float* __restrict__ x, int T,
                                       int K) {
    W4Clock ck;
    ck.mark<0>();
    pdl_enter();
    ck.mark<1>();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * (K / 4)) return;  // thread 0's i is the block's first
    const int row = (int)(i / (K / 4));
    w4_split_item(xs, x + (size_t)row * K, row, K, (int)(i % (K / 4)));
    ck.mark<2>();
    ck.mark<3>();
    ck.put(1);
}

// Column modes of a tile's mma (uniform per block), from its pair count np:
// - 0, packed: np W4_XS <= 8; column g carries term g % W4_XS of pair g / W4_XS, one mma
//   a k16 step (1-2 pairs at W4_XS 3: the common case of decode).
// - 1, two-set packed (W4_PACK2, W4_XS 3 only): np W4_XS <= 16 (3-5 pairs); column c of
//   16 carries term c % W4_XS of pair c / W4_XS, columns 8..15 in a second mma with its
//   own accumulators: 2 mmas and 2 B loads a step instead of 3 (zipf / sequence routing,
//   issue 12; W4_XS=2, which also does 2, measured 8-17% faster on those rows,
//   runs/moe-variants/mma/xs2-dffba58.json).
// - 2, unpacked: column g is pair g, W4_XS mmas a step (one per term) into one set.
// The terms of a packed pair are summed in the epilogue (after the K slices), an unpacked
// pair's inside the accumulator: the same f32 dot product up to summation order.
// Off by default (W4_PACK2=0: 3-5 pairs unpacked): compiled in, mode 1 made models/tiny's
// graphed steps 1.5-3% slower at every concurrency even where no tile takes it (the other
// modes' code around it, runs/ab-74bd963/), against bench moe's GLM-shape sum over M <= 64
// 0.9-1.5% faster (sequence M = 4 8%; runs/ab-ca9cbbf/, runs/ab-74bd963/).
// SPECLAB_KERNEL_DEFINES=W4_PACK2=1 turns it on.  It also needs each warp's K slice to be
// at least W4_PACK2_HALVES half groups: its epilogue reads W4_XS columns a value where
// mode 2 reads one and its walk has a single B buffer, which only a long walk repays.  At
// 8, GLM-5.3-Flash's shapes (K 4096 / 2048, 8-64 halves a warp) take it and models/tiny's
// (K 256 / 128, at most 4) do not (with it, tiny's c8 step was 4 us slower).
#ifndef W4_PACK2
#define W4_PACK2 0
#endif
#ifndef W4_PACK2_HALVES
#define W4_PACK2_HALVES 8
#endif
template <int MODE>
struct W4M {
    static constexpr int NM = MODE == 0 ? 1 : MODE == 1 ? 2 : W4_XS;  // mmas an A fragment
    static constexpr int NA = MODE == 1 ? 2 : 1;                      // accumulator sets
};

// The B operand of half group `hg` (k16 steps 4 hg .. 4 hg + 3) for this lane's columns:
// split words, mma m's pair at (v[u][2 m], v[u][2 m + 1]).  Modes 0 / 2: `b0` = this
// lane's words of k16 step 0 (w4_h_word(row, 2 t, K, xl) as uint2) of its one row, the
// NM terms from xl on consecutive; mode 1: b0 and b1, one term each (the two mmas'
// columns).  A step is 4 W4_XS uint2 further.
template <int MODE>
struct W4B {
    u32 v[4][2 * W4M<MODE>::NM];
};

// CG: the B operand was written earlier in the same launch (the fused kernel's split /
// gate-up items), so it is read through L2 (ld.global.cg), not the read-only path.
template <int MODE, bool CG>
__device__ __forceinline__ void w4_load_b(W4B<MODE>& b, const uint2* __restrict__ b0,
                                          const uint2* __restrict__ b1, int hg) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const size_t off = (size_t)(hg * 4 + u) * (4 * W4_XS);
#pragma unroll
        for (int i = 0; i < W4M<MODE>::NM; ++i) {
            const uint2* p = MODE == 1 ? (i == 0 ? b0 : b1) + off : b0 + off + i;
            const uint2 v = CG ? __ldcg(p) : __ldg(p);
            b.v[u][2 * i] = v.x;
            b.v[u][2 * i + 1] = v.y;
        }
    }
}

// Word i (0..3) of a uint4 (i a compile-time constant after unrolling).
__device__ __forceinline__ u32 w4_word(const uint4& a, int i) {
    return i == 0 ? a.x : i == 1 ? a.y : i == 2 ? a.z : a.w;
}

// part += W x over one half group, modes 0 / 2: 4 k16 steps x W4_RT tiles x NM mmas; the
// weights of step u are this lane's uint4 st[u * 32] of the stage.
template <int MODE>
__device__ __forceinline__ void w4_half(float part[W4_RT][4], const uint4* st,
                                        const W4B<MODE>& b) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const u32* bb = &b.v[u][0];  // mma m: (bb[2 m], bb[2 m + 1])
        const uint4 a = st[u * WARP];
        const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < W4_RT; ++i) {
            const u32 f[4] = {w4_frag(w[i], 0), w4_frag(w[i], 1), w4_frag(w[i], 2),
                              w4_frag(w[i], 3)};
#pragma unroll
            for (int m = 0; m < W4M<MODE>::NM; ++m)
                mma_bf16(part[i], f, bb[2 * m], bb[2 * m + 1]);
        }
    }
}

// Per-lane state of the walk over one row block's K range.
struct W4Lane {
    const uint4* q;   // this lane's weight words of k16 step 0 (step s at + 32 s)
    const uint4* sc;  // this lane's scale uint4 of group 0 (group g at + 8 g)
    uint4* st;        // this lane's slots: stage j at + j W4_SLOT_U4
    u32 st_addr;      // the shared address of st
    int h1;           // the end of the warp's K slice, in half groups
    u32 bar;          // W4_BULK: the shared address of the warp's barrier of slot 0 (+ 8 j)
};

// W4_PF (default 0: compiled out): each half group's copy also asks L2 for the warp's
// half W4_PF further on (`prefetch.global.L2`, one 128-byte line a lane for its 2 KB of
// weights, one for its group's scales), so more of the weight stream is in flight than
// the stages hold.  Traces on an H200 put a lone block an SM at about 22 GB/s against the
// 32 GB/s share of the copy bandwidth (findings/bench-moe.md).
#ifndef W4_PF
#define W4_PF 0
#endif
__device__ __forceinline__ void w4_prefetch(const W4Lane& l, int hg) {
#if W4_PF
    if (hg >= l.h1) return;  // uniform per warp; only the warp's own slice
    const int lane = threadIdx.x & 31;
    const char* p = nullptr;
    if (lane < 16)
        p = reinterpret_cast<const char*>(l.q - lane + (size_t)hg * (4 * WARP)) + 128 * lane;
    else if (lane == 16)
        p = reinterpret_cast<const char*>(l.sc - (lane >> 2) + (size_t)(hg / 2) * 8);
    if (p) asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// Copy half group hg into stage slot j: 4 weight uint4s and the group's scales.  W4_BULK:
// lane 0's two bulk copies, on slot j's barrier (lane 0's q, sc and st_addr are the warp's
// bases).
__device__ __forceinline__ void w4_issue(const W4Lane& l, int hg, int j) {
#if W4_BULK
    if ((threadIdx.x & 31) != 0) return;
    const u32 bar = l.bar + 8 * j, d = l.st_addr + j * (W4_BSLOT * 16);
    mbar_expect(bar, W4_BSLOT * 16);
    bulk_copy(d, l.q + (size_t)hg * (4 * WARP), 4 * WARP * 16, bar);
    bulk_copy(d + 4 * WARP * 16, l.sc + (size_t)(hg / 2) * 8, 8 * 16, bar);
#else
    w4_prefetch(l, hg + W4_PF);
    const u32 d = l.st_addr + j * (W4_SLOT * WARP * 16);
    const uint4* q = l.q + (size_t)hg * (4 * WARP);
#pragma unroll
    for (int u = 0; u < 4; ++u)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d + u * WARP * 16),
                     "l"(q + u * WARP)
                     : "memory");
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d + 4 * WARP * 16),
                 "l"(l.sc + (size_t)(hg / 2) * 8)
                 : "memory");
#endif
}

// acc += scale * W x over the half group in stage slot j with B operand b.  Each half is
// scaled on its own (both halves of a group share its scale).  Mode 1 walks tile-major
// (tile i's 4 steps, then its scale) so one tile's partials are live at a time for both
// sets; every partial still sums steps 0..3 in order, as in modes 0 / 2.
template <int MODE>
__device__ __forceinline__ void w4_take(float acc[][W4_RT][4], const W4Lane& l, int j,
                                        const W4B<MODE>& b) {
    const uint4* st = l.st + j * W4_SLOT_U4;
    // Scale word i: (row g, row g + 8) of tile i = accumulators (0, 1), (2, 3).  The bulk
    // walk's slot holds the group's 8 scale uint4s once (lane (g, t) reads g's).
    const int lane = threadIdx.x & 31;
    const uint4 sv = W4_BULK ? st[4 * WARP - lane + (lane >> 2)] : st[4 * WARP];
    if constexpr (MODE == 1) {
        // Tile i's weight word of step u, a 32-bit shared load each (not the 4 uint4s of
        // the half, whose 16 registers would spill beside the two sets).
        const u32* sw = reinterpret_cast<const u32*>(st);
#pragma unroll
        for (int i = 0; i < W4_RT; ++i) {
            float part[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const u32 w = sw[u * WARP * 4 + i];
                const u32 f[4] = {w4_frag(w, 0), w4_frag(w, 1), w4_frag(w, 2), w4_frag(w, 3)};
                mma_bf16(part[0], f, b.v[u][0], b.v[u][1]);
                mma_bf16(part[1], f, b.v[u][2], b.v[u][3]);
            }
            const u32 si = w4_word(sv, i);
            const float s0 = bf16lo(si), s1 = bf16hi(si);
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                acc[m][i][0] = fmaf(s0, part[m][0], acc[m][i][0]);
                acc[m][i][1] = fmaf(s0, part[m][1], acc[m][i][1]);
                acc[m][i][2] = fmaf(s1, part[m][2], acc[m][i][2]);
                acc[m][i][3] = fmaf(s1, part[m][3], acc[m][i][3]);
            }
        }
    } else {
        float part[W4_RT][4];
#pragma unroll
        for (int i = 0; i < W4_RT; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) part[i][c] = 0.0f;
        w4_half<MODE>(part, st, b);
        const u32 s[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
        for (int i = 0; i < W4_RT; ++i) {
            const float s0 = bf16lo(s[i]), s1 = bf16hi(s[i]);
            acc[0][i][0] = fmaf(s0, part[i][0], acc[0][i][0]);
            acc[0][i][1] = fmaf(s0, part[i][1], acc[0][i][1]);
            acc[0][i][2] = fmaf(s1, part[i][2], acc[0][i][2]);
            acc[0][i][3] = fmaf(s1, part[i][3], acc[0][i][3]);
        }
    }
}

// acc += sum over half groups [h0, h1) of scale * W x, after the copy of half h0 into
// slot 0 was issued and committed.  Double buffer, unrolled by two so the slots and the
// two B operands are fixed registers: while half j is multiplied, half j + 1's weights
// (cp.async) and B operand (registers) are in flight.
template <int MODE, bool CG>
__device__ __forceinline__ void w4_walk(float acc[][W4_RT][4], const W4Lane& l,
                                        const uint2* __restrict__ b0,
                                        const uint2* __restrict__ b1, int h0, int h1) {
    // Mode 1 (two accumulator sets) has one B buffer, loaded just before its half's
    // weights are waited for: a second one spills (ptxas, 128 registers).
    constexpr bool ONE = MODE == 1;
    W4B<MODE> x0, x1;
    w4_load_b<MODE, CG>(x0, b0, b1, h0);
    for (int h = h0; h < h1; h += 2) {
        const bool two = h + 1 < h1;
        if (two) w4_issue(l, h + 1, 1);
        cp_async_commit();
        if (two && !ONE) w4_load_b<MODE, CG>(x1, b0, b1, h + 1);
        cp_async_wait_one();  // half h has landed
        w4_take<MODE>(acc, l, 0, x0);
        if (!two) break;
        if (h + 2 < h1) w4_issue(l, h + 2, 0);
        cp_async_commit();
        if (ONE) {
            w4_load_b<MODE, CG>(x0, b0, b1, h + 1);
        } else if (h + 2 < h1) {
            w4_load_b<MODE, CG>(x0, b0, b1, h + 2);
        }
        cp_async_wait_one();  // half h + 1 has landed
        w4_take<MODE>(acc, l, 1, ONE ? x0 : x1);
        if (ONE && h + 2 < h1) w4_load_b<MODE, CG>(x0, b0, b1, h + 2);
    }
}

// One step of the triple-buffered walk: half `next` (if below h1) into slot (J + 2) % 3 with
// its B operand into `xn`, one group committed either way, then the half in slot J, which
// has landed once at most two groups are pending, multiplied with `xj`.
template <int MODE, bool CG, int J>
__device__ __forceinline__ void w4_step3(float acc[][W4_RT][4], const W4Lane& l,
                                         const uint2* __restrict__ b0,
                                         const uint2* __restrict__ b1, int next, int h1,
                                         W4B<MODE>& xn, const W4B<MODE>& xj) {
    if (next < h1) w4_issue(l, next, (J + 2) % 3);
    cp_async_commit();
    if (next < h1) w4_load_b<MODE, CG>(xn, b0, b1, next);
    cp_async_wait_two();
    w4_take<MODE>(acc, l, J, xj);
}

// w4_walk with three weight stages (W4_STAGES 3; modes 0 and 2): while half h is
// multiplied, halves h + 1 and h + 2 are in flight.  Unrolled by three so the slots and
// the three B operands are fixed registers.  One group is committed per half, empty past
// h1, so `cp.async.wait_group 2` always means "half h has landed".  The sums are those of
// w4_walk, in the same order.
template <int MODE, bool CG>
__device__ __forceinline__ void w4_walk3(float acc[][W4_RT][4], const W4Lane& l,
                                         const uint2* __restrict__ b0,
                                         const uint2* __restrict__ b1, int h0, int h1) {
    if constexpr (MODE == 1) {  // never taken: W4_STAGES 3 requires W4_PACK2 0
        w4_walk<MODE, CG>(acc, l, b0, b1, h0, h1);
        return;
    }
    W4B<MODE> x0, x1, x2;
    // Half h0 is in slot 0, committed by the caller; half h0 + 1 into slot 1.
    if (h0 + 1 < h1) w4_issue(l, h0 + 1, 1);
    cp_async_commit();
    w4_load_b<MODE, CG>(x0, b0, b1, h0);
    if (h0 + 1 < h1) w4_load_b<MODE, CG>(x1, b0, b1, h0 + 1);
    for (int h = h0; h < h1; h += 3) {
        w4_step3<MODE, CG, 0>(acc, l, b0, b1, h + 2, h1, x2, x0);
        if (h + 1 >= h1) break;
        w4_step3<MODE, CG, 1>(acc, l, b0, b1, h + 3, h1, x0, x1);
        if (h + 2 >= h1) break;
        w4_step3<MODE, CG, 2>(acc, l, b0, b1, h + 4, h1, x1, x2);
    }
}

// One step of the bulk walk: wait for the warp's i-th half (slot i % W4_BULK, use
// i / W4_BULK), multiply it with `x`, then refill the slot with half `next` if below h1.
template <int MODE>
__device__ __forceinline__ void w4_bstep(float acc[][W4_RT][4], const W4Lane& l, int i,
                                         int next, const W4B<MODE>& x) {
#if W4_BULK
    const int j = i % W4_BULK;
    mbar_wait(l.bar + 8 * j, (i / W4_BULK) & 1);
    w4_take<MODE>(acc, l, j, x);
    if (next < l.h1) {
        __syncwarp();  // every lane's loads of slot j are done
        w4_issue(l, next, j);
    }
#endif
}

// w4_walk by bulk copies (W4_BULK; modes 0 and 2): halves h0 .. h0 + W4_BULK - 1 were
// issued into slots 0 .. by the caller (w4_start).  The B operand is double-buffered
// in registers as in w4_walk, so the sums are those of w4_walk, in the same order.
template <int MODE, bool CG>
__device__ __forceinline__ void w4_walk_bulk(float acc[][W4_RT][4], const W4Lane& l,
                                             const uint2* __restrict__ b0,
                                             const uint2* __restrict__ b1, int h0, int h1) {
    W4B<MODE> x0, x1;
    w4_load_b<MODE, CG>(x0, b0, b1, h0);
    for (int h = h0; h < h1; h += 2) {
        const bool two = h + 1 < h1;
        if (two) w4_load_b<MODE, CG>(x1, b0, b1, h + 1);
        w4_bstep<MODE>(acc, l, h - h0, h + W4_NST, x0);
        if (!two) break;
        if (h + 2 < h1) w4_load_b<MODE, CG>(x0, b0, b1, h + 2);
        w4_bstep<MODE>(acc, l, h + 1 - h0, h + 1 + W4_NST, x1);
    }
}

// The bulk walk's prologue (W4_BULK): lane 0 initialises the warp's barriers and, for a
// live warp, issues its first W4_BULK halves.  Without W4_BULK: the first half's cp.async
// copy into slot 0, committed.
__device__ __forceinline__ void w4_start(const W4Lane& l, int h0, bool live) {
#if W4_BULK
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int j = 0; j < W4_BULK; ++j) mbar_init(l.bar + 8 * j);
        mbar_fence_init();
    }
    __syncwarp();
    if (live)
#pragma unroll
        for (int j = 0; j < W4_BULK; ++j)
            if (h0 + j < l.h1) w4_issue(l, h0 + j, j);
#else
    if (live && h0 < l.h1) w4_issue(l, h0, 0);
    cp_async_commit();
#endif
}

// Floats of one accumulator set of the block in `red`: [W4_WARPS][W4_RT 4][32].
#define W4_RED_SET (W4_WARPS * W4_RT * 4 * WARP)

// The warp's walk in mode MODE, then its accumulator sets (NA) into red (set m at
// m W4_RED_SET).  A warp past the row blocks (`live` false) stores zeros.
template <int MODE, bool CG>
__device__ __forceinline__ void w4_run(float* red, const W4Lane& l, const uint2* b0,
                                       const uint2* b1, int h0, int h1, bool live) {
    constexpr int NA = W4M<MODE>::NA;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float acc[NA][W4_RT][4];
#pragma unroll
    for (int m = 0; m < NA; ++m)
#pragma unroll
        for (int i = 0; i < W4_RT; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[m][i][c] = 0.0f;
#if W4_BULK
    if (live) w4_walk_bulk<MODE, CG>(acc, l, b0, b1, h0, h1);
    __syncthreads();  // `red` overlays the stages: every warp's walk is done (every thread)
#elif W4_STAGES == 3
    if (live) w4_walk3<MODE, CG>(acc, l, b0, b1, h0, h1);
#else
    if (live) w4_walk<MODE, CG>(acc, l, b0, b1, h0, h1);
#endif
#pragma unroll
    for (int m = 0; m < NA; ++m)
#pragma unroll
        for (int i = 0; i < W4_RT; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                red[m * W4_RED_SET + (warp * W4_RT * 4 + i * 4 + c) * WARP + lane] = acc[m][i][c];
}

// Accumulator (row r of tile i, column v) of warp w from red [W4_WARPS][W4_RT 4][32]: lane
// 4 (r % 8) + v / 2, accumulator (v & 1) + 2 (r / 8) (the PTX C-fragment table).
__device__ __forceinline__ float w4_red(const float* red, int w, int i, int r, int v) {
    return red[(w * W4_RT * 4 + i * 4 + (v & 1) + 2 * (r / 8)) * WARP + (r % 8) * 4 + v / 2];
}

// Value of (row r of tile i, pair slot q) of the block's row block rbl: the sum over its
// W4_XS term columns (modes 0 / 1; column c in set c / 8) or its one column (mode 2) of
// the sum over its ks K-slice warps (in order).
template <int KS>
__device__ __forceinline__ float w4_value(const float* red, int rbl, int ks_rt, int i, int r,
                                          int q, int mode) {
    const int ks = KS ? KS : ks_rt;
    float v = 0.0f;
    for (int x = 0; x < (mode == 2 ? 1 : W4_XS); ++x) {
        const int col = mode == 2 ? q : q * W4_XS + x;
        const float* set = red + (col / ROWS_PER_TILE) * W4_RED_SET;
        for (int w = 0; w < ks; ++w) v += w4_red(set, rbl * ks + w, i, r, col % ROWS_PER_TILE);
    }
    return v;
}

// The block's outputs.  NMAT 2: tile i of row block rb holds gate (row g) and up (row g + 8)
// of output column n = 32 rb + 8 i + g; h[p, n] = silu(gate) * up, split.  NMAT 1: row
// 64 rb + 16 i + r is output column n; y[p, n] = topk_w[p] * value.  KS > 0: the K split
// as a constant (W4_EPI), so the item's indices are shifts and the K slices' loads of
// w4_value unroll; KS 0 takes it from `ks` at run time.  The same sums in the same order.
template <int NMAT, int KS>
__device__ __forceinline__ void w4_epilogue_ks(const float* red, float* __restrict__ y,
                                               u32* __restrict__ hs,
                                               const float* __restrict__ topk_w,
                                               const int* tp, int np, int mode, int ks_rt,
                                               int nrb, int N, int bx) {
    const int ks = KS ? KS : ks_rt;
    const int per = W4_WARPS / ks, cols = NMAT == 2 ? 32 : 64;
    for (int it = threadIdx.x; it < per * cols * np; it += blockDim.x) {
        const int q = it / (per * cols), rbl = it / cols % per, j = it % cols;
        const int rb = bx * per + rbl;
        if (rb >= nrb) continue;
        const int p = tp[q];
        if (NMAT == 2) {
            const int i = j / 8, g = j % 8, n = 32 * rb + j;
            float v = silu_f(w4_value<KS>(red, rbl, ks, i, g, q, mode)) *
                      w4_value<KS>(red, rbl, ks, i, g + 8, q, mode);
            unsigned short* h16 = reinterpret_cast<unsigned short*>(hs);
#pragma unroll
            for (int xi = 0; xi < W4_XS; ++xi) {
                const u32 b = pack_bf2(v, 0.0f);
                h16[2 * w4_h_word(p, n, N, xi) + (n & 1)] = (unsigned short)(b & 0xffffu);
                v -= bf16lo(b);
            }
        } else {
            const float v = w4_value<KS>(red, rbl, ks, j / 16, j % 16, q, mode);
            y[(size_t)p * N + 64 * rb + j] = topk_w[p] * v;
        }
    }
}

// W4_EPI (default 1): the epilogue specialized by the K split (1, 2, 4, 8; any other takes
// the run-time one, as SPECLAB_KERNEL_DEFINES=W4_EPI=0 does for all).  Block traces put thread
// 0's epilogue at 0.6 us at least and 1.3-1.5 us (median) at M = 1: a dependent chain of
// run-time divisions and ks serial shared loads.  Specialized, bench moe was faster on 41 of
// 42 (routing, M <= 64, activations) rows on an H100, 0.7 us at M = 1
// (runs/moe-epi-8d188c5/).
#ifndef W4_EPI
#define W4_EPI 1
#endif
template <int NMAT>
__device__ __forceinline__ void w4_epilogue(const float* red, float* __restrict__ y,
                                            u32* __restrict__ hs,
                                            const float* __restrict__ topk_w, const int* tp,
                                            int np, int mode, int ks, int nrb, int N, int bx) {
#if W4_EPI
    switch (ks) {
        case 1: return w4_epilogue_ks<NMAT, 1>(red, y, hs, topk_w, tp, np, mode, 1, nrb, N, bx);
        case 2: return w4_epilogue_ks<NMAT, 2>(red, y, hs, topk_w, tp, np, mode, 2, nrb, N, bx);
        case 4: return w4_epilogue_ks<NMAT, 4>(red, y, hs, topk_w, tp, np, mode, 4, nrb, N, bx);
#if W4_WARPS >= 8
        case 8: return w4_epilogue_ks<NMAT, 8>(red, y, hs, topk_w, tp, np, mode, 8, nrb, N, bx);
#endif
        default: break;
    }
#endif
    w4_epilogue_ks<NMAT, 0>(red, y, hs, topk_w, tp, np, mode, ks, nrb, N, bx);
}

// Items a tile of `nrb` row blocks takes at K split ks: groups of W4_WARPS / ks row blocks.
__device__ __forceinline__ int w4_groups(int nrb, int ks) {
    return (nrb + W4_WARPS / ks - 1) / (W4_WARPS / ks);
}

// Warps splitting K for `ntiles` real tiles (mirrored by cuda/src/launch.rs w4_ks): the
// smallest power of two <= ks_hi whose blocks reach `target`.
__device__ __forceinline__ int w4_ks(int nrb, int ntiles, int ks_hi, int target) {
    int ks = 1;
    while (ks < ks_hi && w4_groups(nrb, ks) * ntiles < target) ks *= 2;
    return ks;
}

// The separate INT4 kernels' K split for `ntiles` real tiles from the host's segments
// (cuda/src/launch.rs W4Split): segment i = (bound << 3) | log2(ks), bounds ascending; the
// first segment whose bound exceeds ntiles gives ks, past the last 1 way, at most ks_hi.
// The host derives them from its rule (by default the wave rule, W4Split::waves), so the
// kernel's start-up has eight compares and no division ahead of its first weight copy.
#define W4_SEGS 8
#define W4_SEG_PARAMS int s0, int s1, int s2, int s3, int s4, int s5, int s6, int s7
#define W4_SEG_ARGS s0, s1, s2, s3, s4, s5, s6, s7
__device__ __forceinline__ int w4_split(int ntiles, int ks_hi, W4_SEG_PARAMS) {
    const int seg[W4_SEGS] = {W4_SEG_ARGS};
    int ks = 1;
#pragma unroll
    for (int i = W4_SEGS - 1; i >= 0; --i)
        if (ntiles < (seg[i] >> 3)) ks = 1 << (seg[i] & 7);
    return ks < ks_hi ? ks : ks_hi;
}

// The acquire side of the fused kernel's counters: thread 0 polls *ctr until it reaches
// `need`, then the block goes on.  Bounded: past 2^26 polls (seconds) the kernel traps, an
// error instead of a hang should the invariant (counters zero between launches) break.
__device__ __forceinline__ void w4_wait(const int* ctr, int need) {
    if (threadIdx.x == 0) {
        unsigned int polls = 0;
        while (true) {
            int v;
            asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(ctr) : "memory");
            if (v >= need) break;
            if (++polls > (1u << 26)) __trap();
            __nanosleep(64);
        }
    }
    __syncthreads();
}

// The release side: after the block's barrier, one fenced increment (the pattern of
// CUTLASS's semaphore, include/cutlass/semaphore.h).  Returns the old value (thread 0).
__device__ __forceinline__ int w4_signal(int* ctr) {
    __syncthreads();
    int old = 0;
    if (threadIdx.x == 0) {
        __threadfence();
        old = atomicAdd(ctr, 1);
    }
    return old;
}

// One item: (tile, group bx of W4_WARPS / ks row blocks).  R = N * NMAT weight rows of K;
// q [E, R / 64, K / 16, 32, 4] words, sc [E, R / 64, K / 128, 8, 8] bf16.  With `wait`
// (the fused kernel) the B operand is read only once *wait >= need; the weights' first
// copy is in flight by then.  With `pre` the grid-dependency wait (pdl_enter) comes here,
// after the routing is read (through L2) and the weights' first copy issued: the caller
// guarantees the routing was written at least two grids back (see w4_mma).
template <int NMAT, bool CG>
__device__ __forceinline__ void w4_item(float* __restrict__ y, u32* __restrict__ hs,
                                        const u32* __restrict__ xs,
                                        const uint4* __restrict__ qw,
                                        const uint4* __restrict__ scw,
                                        const float* __restrict__ topk_w,
                                        const int* __restrict__ sorted,
                                        const int* __restrict__ tile_expert, int div, int N,
                                        int K, int ks, int tile, int bx,
                                        const int* wait, int need, bool pre,
                                        W4Clock& ck) {
    const int nrb = N * NMAT / 64, per = W4_WARPS / ks;
    const int e = pre ? __ldcg(tile_expert + tile) : tile_expert[tile];
    extern __shared__ uint4 w4_smem[];
#if W4_BULK
    // The bulk walk's accumulators overlay its stages (stored after a block barrier behind
    // every walk, w4_run); its barriers, [W4_WARPS][W4_BULK] u64, follow the stages.
    float* red = reinterpret_cast<float*>(w4_smem);
    const u32 bar = smem_addr(w4_smem + W4_WARPS * W4_NST * W4_SLOT_U4) +
                    8 * (threadIdx.x >> 5) * W4_NST;
#else
    float* red = reinterpret_cast<float*>(w4_smem + W4_WARPS * W4_NST * W4_SLOT_U4);
    const u32 bar = 0;
#endif
    __shared__ int tp[ROWS_PER_TILE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int halves = K / 64;
    const int kw = warp % ks, rb = bx * per + warp / ks;
    const bool live = rb < nrb;  // uniform per warp
    const size_t blk = (size_t)e * nrb + (live ? rb : 0);
    uint4* st = w4_smem + warp * W4_NST * W4_SLOT_U4 + lane;
    const int h0 = kw * halves / ks, h1 = (kw + 1) * halves / ks;
    const W4Lane l{qw + blk * (K / 16) * WARP + lane, scw + blk * (K / 128) * 8 + g, st,
                   smem_addr(st), h1, bar};
    // The weights depend only on the expert: their first copy starts before the tile's
    // pairs are read.
    w4_start(l, h0, live);
    if (threadIdx.x < ROWS_PER_TILE) {
        const int* sp = sorted + (size_t)tile * ROWS_PER_TILE + threadIdx.x;
        tp[threadIdx.x] = pre ? __ldcg(sp) : *sp;
    }
    if (pre) {
        pdl_enter();  // every thread: the B operand below is the previous grid's output
        ck.mark<1>();
    }
    if (wait) {
        w4_wait(wait, need);  // includes the barrier
    } else {
        __syncthreads();
    }
    // moe_align fills a tile front to back, so the real pairs are the first np.
    int np = 0;
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) np += tp[r] >= 0;
    // The tile's column mode (uniform per block; W4M above).
    const bool pack2 = W4_PACK2 && W4_XS == 3 && halves / ks >= W4_PACK2_HALVES;
    // With one term (W4_XS 1) every tile packs (np <= ROWS_PER_TILE): mode 0 as a constant,
    // so the other modes' code, and the registers it would claim, is compiled out.
    const int mode = W4_XS == 1 || np * W4_XS <= ROWS_PER_TILE    ? 0
                     : pack2 && np * W4_XS <= 2 * ROWS_PER_TILE ? 1
                                                                  : 2;
    // This lane's B columns g (and, mode 1, g + 8): pair slot q of term xl (mode 2: pair g,
    // every term); the B rows are tokens (gate/up: xs) or pairs (down: h).  A column past
    // the tile's pairs reads pair 0's row: column n of an mma only feeds column n of its
    // result, which the epilogue never reads for such a column.
    const int c0 = g, c1 = g + ROWS_PER_TILE;
    const int q0 = mode == 2 ? g : c0 / W4_XS, x0 = mode == 2 ? 0 : c0 % W4_XS;
    const int q1 = c1 / W4_XS, x1 = c1 % W4_XS;
    const int p0 = tp[q0 < np ? q0 : 0], p1 = tp[mode == 1 && q1 < np ? q1 : 0];
    const uint2* b0 = reinterpret_cast<const uint2*>(
        xs + w4_h_word(NMAT == 2 ? p0 / div : p0, 2 * t, K, x0));
    const uint2* b1 = reinterpret_cast<const uint2*>(
        xs + w4_h_word(NMAT == 2 ? p1 / div : p1, 2 * t, K, x1));
    if (mode == 0) {
        w4_run<0, CG>(red, l, b0, b1, h0, h1, live);
    } else if (W4_PACK2 && mode == 1) {  // compiled out by default
        w4_run<1, CG>(red, l, b0, b1, h0, h1, live);
    } else {
        w4_run<2, CG>(red, l, b0, b1, h0, h1, live);
    }
    __syncthreads();  // every thread reaches it
    ck.mark<2>();
    w4_epilogue<NMAT>(red, y, hs, topk_w, tp, np, mode, ks, nrb, N, bx);
    ck.mark<3>();
}

// One block: item `bid` of (real tile, group of W4_WARPS / ks row blocks), tile-major;
// items past the real tiles exit at once (the grid is sized for ks_hi and every tile).
// pdl_enter first, or with `pre` (weight prologue) inside w4_item once the first weight
// copy is in flight.  `pre` reads the routing (tile_expert, sorted) before the wait, so
// the host sets it only when the routing is at least two grids back: the grid just
// before this one then triggered its dependents (this grid's launch) only after its own
// wait returned, i.e. after the routing's grid completed and its writes became visible
// (CUDA programming guide, "Programmatic Dependent Launch and Synchronization"; every
// kernel here waits before it triggers, common.cuh pdl_enter).  Always true of the down
// projection (gate/up runs between), and of gate/up when moe_split_x ran after the
// routing.  Unset, the kernel reads nothing before the wait.  The K split: w4_split of
// the host's segments s0 .. s7, at most ks_hi.
template <int NMAT>
__device__ __forceinline__ void w4_mma(float* __restrict__ y, u32* __restrict__ hs,
                                       const u32* __restrict__ xs,
                                       const uint4* __restrict__ qw,
                                       const uint4* __restrict__ scw,
                                       const float* __restrict__ topk_w,
                                       const int* __restrict__ sorted,
                                       const int* __restrict__ tile_expert, int div, int N,
                                       int K, int max_tiles, int ks_hi, W4_SEG_PARAMS,
                                       bool pre, int bid) {
    W4Clock ck;
    ck.mark<0>();
    if (!pre) {
        pdl_enter();
        ck.mark<1>();
    }
    const int nrb = N * NMAT / 64;
    const int ntiles = pre ? __ldcg(tile_expert + max_tiles) : tile_expert[max_tiles];
    const int ks = w4_split(ntiles, ks_hi, W4_SEG_ARGS);
    const int xneed = w4_groups(nrb, ks);
    if (bid >= ntiles * xneed) return;  // uniform per block
    w4_item<NMAT, false>(y, hs, xs, qw, scw, topk_w, sorted, tile_expert, div, N, K, ks,
                         bid / xneed, bid % xneed, nullptr, 0, pre, ck);
    ck.put(NMAT == 2 ? 2 : 3);
}

// Routed experts gate/up + SiLU, INT4: h[p, n] = silu(x[p / topk] . Wg[e, n]) *
// (x[p / topk] . Wu[e, n]) for every pair p of every real tile (expert e), written split
// (w4_h_word, K = N).  Shapes: xs [T, K W4_XS / 2] u32 words (moe_split_x of the
// post-norm input), q13 [E, 2N / 64, K / 16, 32, 4]
// u32, s13 [E, 2N / 64, K / 128, 8, 8] bf16 (cuda/src/repack.rs), h [P, N W4_XS / 2] u32
// words (N = moe_intermediate_size).
// tile_expert [max_tiles + 1] (moe_align: experts, then the count used).  s0 .. s7:
// the K split's tile-count segments (w4_split).  pre: the weight prologue before the
// grid-dependency wait (w4_mma; only when a grid runs between the routing and this one).
// Launch: grid (max_tiles ceil(2N / 64 / (W4_WARPS / ks_hi))), block 32 W4_WARPS, dynamic
// shared memory W4_SMEM (launch.rs moe_w4).
extern "C" __global__ void __launch_bounds__(32 * W4_WARPS, W4_MINB) moe_gate_up_w4(
    u32* __restrict__ h, const u32* __restrict__ xs, const u32* __restrict__ q13,
    const bf16_bits* __restrict__ s13, const int* __restrict__ sorted,
    const int* __restrict__ tile_expert, int topk, int N, int K, int max_tiles, int ks_hi,
    W4_SEG_PARAMS, int pre) {
    w4_mma<2>(nullptr, h, xs, reinterpret_cast<const uint4*>(q13),
              reinterpret_cast<const uint4*>(s13), nullptr, sorted, tile_expert, topk, N, K,
              max_tiles, ks_hi, W4_SEG_ARGS, pre != 0, blockIdx.x);
}

// moe_gate_up_w4 and the shared expert's SwiGLU hidden (swiglu_tiled_bf16) in one launch:
// blocks [0, sh_blocks) are swiglu_tiled_bf16's grid (swiglu_skinny_bf16's when
// sh_skinny; sh_gx x sh_blocks / sh_gx, x fastest), the rest moe_gate_up_w4's grid in order.  The two read only the router's
// output (the post-norm input and its split) and write disjoint buffers, so the shared
// expert's first GEMM leaves the MoE layer's serial chain; each block computes what its
// kernel's block computes, bit for bit.  Shapes: as moe_gate_up_w4, plus sh_h [sh_m,
// sh_n], sh_x [sh_m, sh_x_stride] (first sh_k used), sh_w13 [sh_n, 2, sh_k] bf16.
// Launch: grid (sh_blocks + moe_gate_up_w4's), block 32 W4_WARPS (= swiglu_tiled_bf16's
// 256), dynamic shared memory W4_SMEM.
extern "C" __global__ void __launch_bounds__(32 * W4_WARPS, W4_MINB) moe_gate_up_shared_w4(
    u32* __restrict__ h, const u32* __restrict__ xs, const u32* __restrict__ q13,
    const bf16_bits* __restrict__ s13, const int* __restrict__ sorted,
    const int* __restrict__ tile_expert, int topk, int N, int K, int max_tiles, int ks_hi,
    W4_SEG_PARAMS, int pre, float* __restrict__ sh_h, const float* __restrict__ sh_x,
    int sh_x_stride, const bf16_bits* __restrict__ sh_w13, int sh_m, int sh_n, int sh_k,
    int sh_gx, int sh_blocks, int sh_skinny) {
    const int b = blockIdx.x;
    if (b < sh_blocks) {
        if (sh_skinny)
            swiglu_skinny_block(sh_h, sh_x, sh_x_stride, sh_w13, sh_m, sh_n, sh_k, b % sh_gx,
                                b / sh_gx);
        else
            swiglu_tiled_block(sh_h, sh_x, sh_x_stride, sh_w13, sh_m, sh_n, sh_k, b % sh_gx,
                               b / sh_gx);
        return;
    }
    w4_mma<2>(nullptr, h, xs, reinterpret_cast<const uint4*>(q13),
              reinterpret_cast<const uint4*>(s13), nullptr, sorted, tile_expert, topk, N, K,
              max_tiles, ks_hi, W4_SEG_ARGS, pre != 0, b - sh_blocks);
}

// Routed experts down-projection with the router weight applied: y[p, n] = w_p *
// (h[p] . Wd[e, n]).  Shapes: h [P, K W4_XS / 2] u32 words (gate/up's split output, K =
// moe_intermediate_size), qd [E, N / 64, K / 16, 32, 4] u32, sd [E, N / 64, K / 128, 8, 8]
// bf16, topk_w [P], y [P, N] f32 (N = hidden).  pre: as moe_gate_up_w4 (the routing is
// always two grids back here, gate/up ran between).
// Launch: as moe_gate_up_w4 with N rows.
extern "C" __global__ void __launch_bounds__(32 * W4_WARPS, W4_MINB) moe_down_w4(
    float* __restrict__ y, const u32* __restrict__ h, const u32* __restrict__ qd,
    const bf16_bits* __restrict__ sd, const float* __restrict__ topk_w,
    const int* __restrict__ sorted, const int* __restrict__ tile_expert, int N, int K,
    int max_tiles, int ks_hi, W4_SEG_PARAMS, int pre) {
    w4_mma<1>(y, nullptr, h, reinterpret_cast<const uint4*>(qd),
              reinterpret_cast<const uint4*>(sd), topk_w, sorted, tile_expert, 1, N, K, max_tiles,
              ks_hi, W4_SEG_ARGS, pre != 0, blockIdx.x);
}

// The routed experts in one launch (issue 12): the split of x (when x is not null),
// gate/up + SiLU, then the down projection with the router weight, as moe_split_x +
// moe_gate_up_w4 + moe_down_w4 compute them (the same items, K splits and summation
// order, so the same bits), one kernel boundary instead of three.
// Each block takes a ticket (sync[0]) and runs item `ticket` of one list: split chunks of
// 256 (row, k16 step, lane-in-group) items, then gate/up items, then down items.  A gate/up
// item waits until every split chunk is done (sync[2]), a down item of tile i until every
// gate/up item of tile i is (sync[3 + i]).  Tickets follow the order blocks start in, so a
// block only ever waits on items already taken by running blocks (CUB's decoupled
// look-back uses the same dynamic index): no assumption on residency.  The last block to
// finish (sync[1]) resets the counters: sync is zero between launches (allocated zeroed).
// Shapes: as moe_split_x / moe_gate_up_w4 / moe_down_w4 (H hidden, Im moe-intermediate;
// x [T, H] f32 or null when xs already holds the split), sync [3 + max_tiles] i32.
// Launch: grid = the split chunks + both kernels' grids (launch.rs moe_w4), block 32
// W4_WARPS, dynamic shared memory W4_SMEM.
extern "C" __global__ void __launch_bounds__(32 * W4_WARPS, W4_MINB) moe_experts_w4(
    float* __restrict__ y, u32* __restrict__ h, u32* __restrict__ xs,
    const float* __restrict__ x, int T, const u32* __restrict__ q13,
    const bf16_bits* __restrict__ s13, const u32* __restrict__ qd,
    const bf16_bits* __restrict__ sd, const float* __restrict__ topk_w,
    const int* __restrict__ sorted, const int* __restrict__ tile_expert, int* __restrict__ sync,
    int topk, int H, int Im, int max_tiles, int ks_hi_gu, int ks_hi_dn, int target) {
    pdl_enter();
    __shared__ int ticket;
    if (threadIdx.x == 0) ticket = atomicAdd(sync, 1);
    __syncthreads();
    const int item = ticket;
    W4Clock ck;  // the fused kernel is not traced (its marks are never put)
    const int ntiles = tile_expert[max_tiles];
    const int nrb_gu = 2 * Im / 64, nrb_dn = H / 64;
    const int ks_gu = w4_ks(nrb_gu, ntiles, ks_hi_gu, target);
    const int ks_dn = w4_ks(nrb_dn, ntiles, ks_hi_dn, target);
    const int xgu = w4_groups(nrb_gu, ks_gu), xdn = w4_groups(nrb_dn, ks_dn);
    const int split_items = T * (H / 4);
    const int nsplit = x ? (split_items + blockDim.x - 1) / blockDim.x : 0;
    const int ngu = ntiles * xgu, ndn = ntiles * xdn;
    int* gu_done = sync + 3;
    if (item < nsplit) {
        const int i = item * blockDim.x + threadIdx.x;
        if (i < split_items) {
            const int row = i / (H / 4);
            w4_split_item(xs, x + (size_t)row * H, row, H, i % (H / 4));
        }
        w4_signal(sync + 2);
    } else if (item < nsplit + ngu) {
        const int j = item - nsplit, tile = j / xgu, bx = j % xgu;
        const uint4* q = reinterpret_cast<const uint4*>(q13);
        const uint4* sc = reinterpret_cast<const uint4*>(s13);
        if (nsplit) {
            w4_item<2, true>(nullptr, h, xs, q, sc, nullptr, sorted, tile_expert, topk, Im, H,
                             ks_gu, tile, bx, sync + 2, nsplit, false, ck);
        } else {
            w4_item<2, false>(nullptr, h, xs, q, sc, nullptr, sorted, tile_expert, topk, Im, H,
                              ks_gu, tile, bx, nullptr, 0, false, ck);
        }
        w4_signal(gu_done + tile);
    } else if (item < nsplit + ngu + ndn) {
        const int j = item - nsplit - ngu, tile = j / xdn;
        w4_item<1, true>(y, nullptr, h, reinterpret_cast<const uint4*>(qd),
                         reinterpret_cast<const uint4*>(sd), topk_w, sorted, tile_expert, 1, H, Im,
                         ks_dn, tile, j % xdn, gu_done + tile, xgu, false, ck);
    }
    // Every block, item or not, counts out; the last one resets what this launch touched.
    const int out = w4_signal(sync + 1);
    if (threadIdx.x == 0 && out == (int)gridDim.x - 1) {
        sync[0] = 0;
        sync[1] = 0;
        sync[2] = 0;
        for (int t = 0; t < ntiles; ++t) gu_done[t] = 0;
    }
}
