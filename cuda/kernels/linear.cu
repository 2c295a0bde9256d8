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
    moe_down(y, h, LoadBf16{wd, K}, topk_w, sorted, tile_expert, N, K);
}

// ---------------------------------------------------------------------------------------
// INT4 (W4A16) routed experts, issue 12: tuned for decode / verify batches at GLM-5.3-Flash
// shapes (hidden 4096, moe-intermediate 2048, 288 experts top-8), where the layer is a
// stream of expert weights (M = 1: 8 experts x 12.6 MB) and each expert sees few tokens.
//
// Scheme (a split-K GEMV after vLLM csrc/moe/marlin_moe_wna16's weight streaming and
// gptq_marlin's lop3 dequantization, kept on f32 CUDA cores for the engine's f32
// numerics, docs/model.md §1).  The previous cp.async version was bound by the L1 /
// shared-memory path (runs/ncu-moe-w4-m1.txt): each 16 B of weights needed 128 B of f32
// activations per token from L1.  Here the activations live in registers:
// - A "lane group" of L lanes (L = the largest power of two <= min(128, K / 32)) spans a
//   whole weight row: lane g owns the 16-byte chunks c = g, g + L, ... (one uint4 = 4
//   words = 32 weights of one 128-group, so one scale).  At GLM shapes CH = K / 32 / L = 1,
//   so a lane holds the 32 activations of its chunk for W4_TS tokens in registers for the
//   whole block and reuses them for every weight row it streams (models/tiny: L = 8 / 4,
//   16 / 32 groups a block; CH > 1 reloads the activations per chunk, from L1).
// - A block (128 threads = 128 / L groups) walks batches of W4_U rows per group through a
//   W4_STAGES-deep cp.async pipeline in shared memory (W4_STAGES - 1 batches = 192 B a
//   lane in flight without holding registers; a lane reads back only its own copies, so
//   cp.async.wait_group is the only synchronization).  The previous version of this
//   kernel (registers only, one batch ahead) reached 29% of the copy bandwidth at M = 1
//   (runs/bench-moe-regx.json).
// - Dequantization: common.cuh dequant8 (1 LOP3 + 1 FFMA per weight, exact q * scale).
// - Reduction of the W4_U x W4_TS partial sums over the group: xor shuffles when L <= 32;
//   for L = 64 / 128 a transposing warp reduction (9 shuffles for 8 values) into a shared
//   array of every batch's warp partials, summed by the block's threads after one barrier
//   a pass (w4_finish).
// - The tile's token rows (up to 8, moe.cu moe_align) are taken W4_TS at a time, token
//   group z in block z of the grid (W4_ZSPLIT; the groups past the tile's rows exit), so a
//   tile's passes run in parallel blocks; each pass streams the tile's weights (the
//   repeats from L2).  A pass's token count is a template parameter (w4_fma_n).
// - Where the time goes (runs/ncu-final-m1.txt): instruction issue, 6.4 instructions a
//   weight at M = 1, not DRAM bandwidth (35% of peak).
// Requirements (host-checked, cuda/src/ops.rs + launch.rs): K % 128 == 0, N % 8 == 0,
// x rows 16-byte aligned (x stride = K).

#define W4_U 4
#define W4_BLOCK 128
// Tunable at NVRTC time (SPECLAB_KERNEL_DEFINES, cuda/README.md); the host's launch
// shapes do not depend on them.
#ifndef W4_TS
#define W4_TS 2
#endif
#ifndef W4_STAGES
#define W4_STAGES 4
#endif
#ifndef W4_MINB
#define W4_MINB 4
#endif
// 1: the folded dequantization (w4_fma_fold below); 0: exact q * scale per weight.
#ifndef W4_FOLD
#define W4_FOLD 0
#endif
// 1: block z of the grid takes the tile's token group z (passes run in parallel blocks);
// 0: block z = 0 walks every pass of the tile, the others exit.
// Independent accumulator chains a row and token (2: odd words into a second chain).
#ifndef W4_ILP
#define W4_ILP 1
#endif
#ifndef W4_ZSPLIT
#define W4_ZSPLIT 1
#endif
// Most batches a lane group walks (launch.rs W4_MAX_BATCHES bounds the grid's nb).
#define W4_MAX_BATCHES 16

// Lanes per group for a row of K weights (mirrored by cuda/src/launch.rs w4_lanes).
__device__ __forceinline__ int w4_lanes(int K) {
    const int chunks = K / 32;
    int l = 1;
    while (l < W4_BLOCK && 2 * l <= chunks) l *= 2;
    return l;
}

// One 16-byte streaming load of weights (read once: no L1 allocation).
__device__ __forceinline__ uint4 ld_stream16(const u32* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// Sum of v over the L lanes of this lane's group (L a power of two <= 32, groups aligned).
__device__ __forceinline__ float group_sum(float v, int L) {
    for (int o = L >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Transposing warp reduction of V values (V a power of two <= 32): each halving step
// swaps half the values with the partner lane, so V = 8 costs 4 + 2 + 1 + 2 = 9 shuffles,
// not 40.  Afterwards every lane holds the warp's sum of value `idx`; the lanes with
// lane % (32 / V) == 0 hold the V values once each.
template <int V>
__device__ __forceinline__ float warp_sum_t(float v[V], int& idx) {
    const int lane = threadIdx.x & 31;
    idx = 0;
    int o = 16;
#pragma unroll
    for (int n = V; n > 1; n >>= 1) {
        const bool hi = lane & o;
#pragma unroll
        for (int i = 0; i < n / 2; ++i) {
            const float send = hi ? v[i] : v[i + n / 2];
            v[i] = (hi ? v[i + n / 2] : v[i]) + __shfl_xor_sync(FULL_MASK, send, o);
        }
        idx += hi ? n / 2 : 0;
        o >>= 1;
    }
    float r = v[0];
    for (; o > 0; o >>= 1) r += __shfl_xor_sync(FULL_MASK, r, o);
    return r;
}

// The W4_U weight chunks (and their scales) of one batch for one lane.
struct W4Batch {
    uint4 q[W4_U];
    bf16_bits s[W4_U];
};

// Load chunk c of rows row0 .. row0 + W4_U - 1 (K weights a row; s: K / 128 scales a row).
__device__ __forceinline__ void w4_load(W4Batch& b, const u32* __restrict__ qw,
                                        const bf16_bits* __restrict__ s, size_t row0, int K,
                                        int c) {
#pragma unroll
    for (int i = 0; i < W4_U; ++i) {
        const size_t row = row0 + i;
        b.q[i] = ld_stream16(qw + row * (size_t)(K / 8) + (size_t)c * 4);
        b.s[i] = __ldg(s + row * (size_t)(K / 128) + (c >> 2));
    }
}

// Asynchronous 16- / 4-byte copies global -> shared (sm_80+ cp.async, as Marlin's
// multi-stage pipeline: vLLM csrc/quantization/gptq_marlin/marlin.cuh cp_async4).
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem)), "l"(gmem)
                 : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(smem)), "l"(gmem)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
// Wait until at most W4_STAGES - 1 committed groups are pending.
__device__ __forceinline__ void cp_async_wait_stages() {
    asm volatile("cp.async.wait_group %0;" ::"n"(W4_STAGES - 1) : "memory");
}

// The weight pipeline: W4_STAGES batches of this lane's W4_U chunks and the aligned
// 32-bit pair holding each chunk's bf16 scale.  Each thread reads back only what it copied
// itself, so cp.async.wait_group is the only synchronization.  The bytes in flight live
// here, not in registers (W4_STAGES 4: 40 KB a block, 3 batches = 192 B a lane in flight).
struct W4Stages {
    uint4 q[W4_STAGES][W4_U][W4_BLOCK];
    u32 s[W4_STAGES][W4_U][W4_BLOCK];
};

// Issue the copies of chunk c of rows row0 .. row0 + W4_U - 1 into stage `st`.  Scale
// buffers have an even length (N % 8 == 0), so the aligned pair never leaves them.
__device__ __forceinline__ void w4_issue(W4Stages& sm, int st, const u32* __restrict__ qw,
                                         const bf16_bits* __restrict__ s, size_t row0, int K,
                                         int c) {
    const int t = threadIdx.x;
#pragma unroll
    for (int i = 0; i < W4_U; ++i) {
        const size_t row = row0 + i;
        cp_async16(&sm.q[st][i][t], qw + row * (size_t)(K / 8) + (size_t)c * 4);
        const size_t si = row * (size_t)(K / 128) + (c >> 2);
        cp_async4(&sm.s[st][i][t], s + (si & ~(size_t)1));
    }
}

// Stage `st` (copied by this thread for rows row0 ..) as a batch.
__device__ __forceinline__ void w4_take(W4Batch& b, const W4Stages& sm, int st, size_t row0,
                                        int K, int c) {
    const int t = threadIdx.x;
#pragma unroll
    for (int i = 0; i < W4_U; ++i) {
        b.q[i] = sm.q[st][i][t];
        const size_t si = (row0 + i) * (size_t)(K / 128) + (c >> 2);
        const u32 pair = sm.s[st][i][t];
        b.s[i] = (bf16_bits)(si & 1 ? pair >> 16 : pair & 0xffffu);
    }
}

#if W4_FOLD
// Folded dequantization (2 instructions a weight instead of 3, not exact): the views
// r << 15, r << 7, r >> 1, r >> 9 put nibble slots (2m, 2m + 1) at bits 15 and 19, one lop3
// into the mantissa of 128.0 gives v = 128 + n / 2 or 128 + 8 n (n = q + 8), and the dot
// product accumulates x v directly: sum x w = s (2 A15 + A19 / 8 - (264 X15 + 24 X19))
// with X15 / X19 the activation sums of the two slot classes (per lane and pass).  The
// rounding of x v costs up to 2^-16 / n relative to x n (bf16 weights: 2^-9).
__device__ __forceinline__ float w4_fold_c(const float x[32]) {
    float a = 0.0f, b = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        a += x[j * 8 + 0] + x[j * 8 + 4] + x[j * 8 + 1] + x[j * 8 + 5];
        b += x[j * 8 + 2] + x[j * 8 + 6] + x[j * 8 + 3] + x[j * 8 + 7];
    }
    return 264.0f * a + 24.0f * b;
}
__device__ __forceinline__ float w4_v(u32 a, u32 mask) {
    return __uint_as_float(lop3_and_or(a, mask, 0x43000000u));
}
#endif

// acc[i][t] += x_t[chunk] . W[row i, chunk] for the nt <= W4_TS tokens held in xr.
// NT (compile time) tokens: a tile pass with fewer tokens than W4_TS runs the NT = 1
// instantiation, so no predicated-off FMAs take issue slots (ncu: 6.4 instructions a weight
// at M = 1 with the token count tested at run time).
template <int NT>
__device__ __forceinline__ void w4_fma_n(float acc[W4_U][W4_TS], const W4Batch& b,
                                         const float xr[W4_TS][32]) {
#if W4_FOLD
    float cx[W4_TS];
#pragma unroll
    for (int t = 0; t < W4_TS; ++t) cx[t] = w4_fold_c(xr[t]);
#pragma unroll
    for (int i = 0; i < W4_U; ++i) {
        const float sc = bf16_to_f32(b.s[i]);
        float a15[W4_TS], a19[W4_TS];
#pragma unroll
        for (int t = 0; t < W4_TS; ++t) a15[t] = a19[t] = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 r = j == 0 ? b.q[i].x : j == 1 ? b.q[i].y : j == 2 ? b.q[i].z : b.q[i].w;
            // (element at bit 15, element at bit 19) of each view (repack.rs INTERLEAVE).
            const u32 v0 = r << 15, v1 = r << 7, v2 = r >> 1, v3 = r >> 9;
            const float f[8] = {w4_v(v0, 0x00078000u), w4_v(v2, 0x00078000u),
                                w4_v(v0, 0x00780000u), w4_v(v2, 0x00780000u),
                                w4_v(v1, 0x00078000u), w4_v(v3, 0x00078000u),
                                w4_v(v1, 0x00780000u), w4_v(v3, 0x00780000u)};
#pragma unroll
            for (int t = 0; t < W4_TS; ++t) {
                if (t < NT) {
                    const float* xv = &xr[t][j * 8];
                    a15[t] = fmaf(xv[0], f[0], a15[t]);
                    a15[t] = fmaf(xv[1], f[1], a15[t]);
                    a19[t] = fmaf(xv[2], f[2], a19[t]);
                    a19[t] = fmaf(xv[3], f[3], a19[t]);
                    a15[t] = fmaf(xv[4], f[4], a15[t]);
                    a15[t] = fmaf(xv[5], f[5], a15[t]);
                    a19[t] = fmaf(xv[6], f[6], a19[t]);
                    a19[t] = fmaf(xv[7], f[7], a19[t]);
                }
            }
        }
#pragma unroll
        for (int t = 0; t < W4_TS; ++t)
            acc[i][t] = fmaf(sc, fmaf(2.0f, a15[t], fmaf(0.125f, a19[t], -cx[t])), acc[i][t]);
    }
#else
#pragma unroll
    for (int i = 0; i < W4_U; ++i) {
        const W4Scale sc = w4_scale(bf16_to_f32(b.s[i]));
        float part[W4_ILP][W4_TS];
#pragma unroll
        for (int c = 0; c < W4_ILP; ++c)
#pragma unroll
            for (int t = 0; t < W4_TS; ++t) part[c][t] = c == 0 ? acc[i][t] : 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 word = j == 0 ? b.q[i].x : j == 1 ? b.q[i].y : j == 2 ? b.q[i].z : b.q[i].w;
            float w[8];
            dequant8(word, sc, w);
#pragma unroll
            for (int t = 0; t < W4_TS; ++t) {
                if (t < NT) {
#pragma unroll
                    for (int u = 0; u < 8; ++u)
                        part[j % W4_ILP][t] = fmaf(xr[t][j * 8 + u], w[u], part[j % W4_ILP][t]);
                }
            }
        }
#pragma unroll
        for (int t = 0; t < W4_TS; ++t) {
            float a = part[0][t];
#pragma unroll
            for (int c = 1; c < W4_ILP; ++c) a += part[c][t];
            acc[i][t] = a;
        }
    }
#endif
}

__device__ __forceinline__ void w4_fma(float acc[W4_U][W4_TS], const W4Batch& b,
                                       const float xr[W4_TS][32], int nt) {
    if (nt >= W4_TS) {
        w4_fma_n<W4_TS>(acc, b, xr);
    } else {
        w4_fma_n<1>(acc, b, xr);  // W4_TS <= 2 (kernels.rs TUNABLES)
    }
}

// The 32 activations of chunk c for tokens xrow[0 .. nt) (rows of K floats), 0 beyond nt.
__device__ __forceinline__ void w4_load_x(float xr[W4_TS][32], const float* __restrict__ x,
                                          const int xrow[W4_TS], int nt, int K, int c) {
#pragma unroll
    for (int t = 0; t < W4_TS; ++t) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            if (t < nt) {
                load8(x + (size_t)xrow[t] * K + (size_t)c * 32 + v * 8, &xr[t][v * 8]);
            } else {
#pragma unroll
                for (int u = 0; u < 8; ++u) xr[t][v * 8 + u] = 0.0f;
            }
        }
    }
}

// Where a reduced value goes: NMAT = 2: h[p, n] = silu(gate) * up for output column n =
// row0 / 2 + j (rows 2n, 2n + 1); NMAT = 1: y[p, n] = w_p * v for n = row0 + j.
struct W4Out {
    float* out;
    const float* topk_w;  // NMAT = 1 only
    int prow[W4_TS];      // pair ids of the tokens (by value: stays in registers)
    int nt, N;
};

template <int NMAT>
__device__ __forceinline__ void w4_store(const W4Out& o, const float red[W4_U * W4_TS],
                                         size_t row0) {
#pragma unroll
    for (int j = 0; j < W4_U / NMAT; ++j) {
#pragma unroll
        for (int t = 0; t < W4_TS; ++t) {
            if (t >= o.nt) continue;
            const int p = o.prow[t];
            if (NMAT == 2) {
                const float g = red[(2 * j) * W4_TS + t], u = red[(2 * j + 1) * W4_TS + t];
                o.out[(size_t)p * o.N + row0 / 2 + j] = silu_f(g) * u;
            } else {
                o.out[(size_t)p * o.N + row0 + j] = o.topk_w[p] * red[j * W4_TS + t];
            }
        }
    }
}

// The outputs of a pass for L > 32: red [W4_MAX_BATCHES][W4_BLOCK / 32][W4_U * W4_TS]
// holds every warp's reduced partials of batch b; a group's value is the sum over its W
// warps.  The block's threads share the (batch, group, column, token) outputs.
template <int NMAT>
__device__ __forceinline__ void w4_finish(const W4Out& o, const float* red, int b0, int nb,
                                          int G, int W, int slots) {
    constexpr int V = W4_U * W4_TS, PER = (W4_U / NMAT) * W4_TS;
    for (int q = threadIdx.x; q < nb * G * PER; q += W4_BLOCK) {
        const int b = q / (G * PER), g = q / PER % G, j = q % PER / W4_TS, t = q % W4_TS;
        const int slot = (b0 + b) * G + g;
        if (t >= o.nt || slot >= slots) continue;
        int p = o.prow[0];
#pragma unroll
        for (int u = 1; u < W4_TS; ++u) p = u == t ? o.prow[u] : p;
        const float* rb = red + (b * (W4_BLOCK / 32) + g * W) * V;
        const size_t row0 = (size_t)slot * W4_U;
        float a0 = 0.0f, a1 = 0.0f;
        for (int w = 0; w < W; ++w) {
            a0 += rb[w * V + (NMAT * j) * W4_TS + t];
            if (NMAT == 2) a1 += rb[w * V + (2 * j + 1) * W4_TS + t];
        }
        if (NMAT == 2) {
            o.out[(size_t)p * o.N + row0 / 2 + j] = silu_f(a0) * a1;
        } else {
            o.out[(size_t)p * o.N + row0 + j] = o.topk_w[p] * a0;
        }
    }
}

// One block's rows of one tile (expert e): weight rows [R_e) = N * NMAT rows of K weights.
// Grid (ceil(R / (G W4_U nb)), max_tiles) with nb = batches a group walks (from gridDim).
template <int NMAT>
__device__ __forceinline__ void w4_gemv(float* __restrict__ out, const float* __restrict__ x,
                                        const u32* __restrict__ qw,
                                        const bf16_bits* __restrict__ s,
                                        const float* __restrict__ topk_w,
                                        const int* __restrict__ sorted,
                                        const int* __restrict__ tile_expert, int div, int N,
                                        int K) {
    const int tile = blockIdx.y;
    const int e = tile_expert[tile];
    if (e < 0) return;  // uniform per block
    const int L = w4_lanes(K), G = W4_BLOCK / L, chunks = K / 32;
    const int CH = (chunks + L - 1) / L;
    const int g = threadIdx.x / L, lane = threadIdx.x % L, warp = threadIdx.x >> 5;
    const int R = N * NMAT, slots = R / W4_U;  // R % 8 == 0
    const int nb = (slots + G * gridDim.x - 1) / (G * gridDim.x);
    // Each warp's reduced partials of every batch; summed over the group's warps once a
    // pass, after one barrier (no barrier a batch).
    __shared__ float red[W4_MAX_BATCHES][W4_BLOCK / 32][W4_U * W4_TS];
    __shared__ W4Stages sm;
    // The tile's pairs: moe_align fills a tile front to back (its expert's segment is
    // padded at the end), so the real pairs are the first nr (uniform per block).
    const int* tp = sorted + (size_t)tile * ROWS_PER_TILE;
    int nr = 0;
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) nr += tp[r] >= 0;
#if W4_ZSPLIT
    const int t_begin = blockIdx.z * W4_TS, t_end = min(nr, t_begin + W4_TS);
#else
    const int t_begin = 0, t_end = blockIdx.z == 0 ? nr : 0;
#endif
    if (t_begin >= t_end) return;  // uniform per block, before any barrier
    const size_t ebase = (size_t)e * R;
    // One batch a group (models/tiny's small experts): its weights stay in registers for
    // every pass over the tile's tokens instead of streaming again each pass.
    const bool hold = CH == 1 && nb == 1 && !W4_ZSPLIT;
    W4Batch held;
    if (hold) {
        const int slot = blockIdx.x * G + g;
        w4_load(held, qw, s, ebase + (slot < slots ? slot * W4_U : 0), K, lane);
    }
    for (int t0 = t_begin; t0 < t_end; t0 += W4_TS) {
        const int nt = min(W4_TS, t_end - t0);
        W4Out o{out, topk_w, {}, nt, N};
        int xrow[W4_TS];
#pragma unroll
        for (int t = 0; t < W4_TS; ++t) {
            o.prow[t] = t < nt ? tp[t0 + t] : 0;
            xrow[t] = o.prow[t] / div;
        }
        float xr[W4_TS][32];
        if (CH == 1) w4_load_x(xr, x, xrow, nt, K, lane);
        // Batch b of group g: rows (blockIdx.x * nb + b) * G * W4_U + g * W4_U + i.
        auto row_of = [&](int b) -> int {
            const int slot = (blockIdx.x * nb + b) * G + g;
            return slot < slots ? slot * W4_U : 0;
        };
        // CH == 1: rows of batch nx into stage nx % W4_STAGES, W4_STAGES - 1 batches ahead.
        if (CH == 1 && !hold) {
#pragma unroll
            for (int st = 0; st < W4_STAGES - 1; ++st) {
                if (st < nb) w4_issue(sm, st, qw, s, ebase + row_of(st), K, lane);
                cp_async_commit();
            }
        }
        for (int b = 0; b < nb; ++b) {
            const int slot = (blockIdx.x * nb + b) * G + g;
            const bool real = slot < slots;  // uniform per group
            const size_t row0 = (size_t)row_of(b);
            float acc[W4_U][W4_TS];
#pragma unroll
            for (int i = 0; i < W4_U; ++i)
#pragma unroll
                for (int t = 0; t < W4_TS; ++t) acc[i][t] = 0.0f;
            W4Batch cur;
            if (hold) {
                w4_fma(acc, held, xr, nt);
            } else if (CH == 1) {
                const int nx = b + W4_STAGES - 1;
                if (nx < nb) w4_issue(sm, nx % W4_STAGES, qw, s, ebase + row_of(nx), K, lane);
                cp_async_commit();
                cp_async_wait_stages();  // batch b has landed
                w4_take(cur, sm, b % W4_STAGES, ebase + row0, K, lane);
                w4_fma(acc, cur, xr, nt);
            } else {
                for (int c = lane; c < chunks; c += L) {
                    w4_load_x(xr, x, xrow, nt, K, c);
                    w4_load(cur, qw, s, ebase + row0, K, c);
                    w4_fma(acc, cur, xr, nt);
                }
            }
            float v[W4_U * W4_TS];
#pragma unroll
            for (int i = 0; i < W4_U; ++i)
#pragma unroll
                for (int t = 0; t < W4_TS; ++t) v[i * W4_TS + t] = acc[i][t];
            if (L <= 32) {
#pragma unroll
                for (int k = 0; k < W4_U * W4_TS; ++k) v[k] = group_sum(v[k], L);
                if (real && lane == 0) w4_store<NMAT>(o, v, row0);
            } else {
                // L = 64 or 128: the warp's partials of batch b into red[b].
                int idx;
                const float r = warp_sum_t<W4_U * W4_TS>(v, idx);
                if ((threadIdx.x & 31) % (32 / (W4_U * W4_TS)) == 0) red[b][warp][idx] = r;
            }
        }
        if (L > 32) {
            // Every lane reaches both barriers (L, nb and the pass count are uniform).
            __syncthreads();
            w4_finish<NMAT>(o, &red[0][0][0], blockIdx.x * nb, nb, G, L / 32, slots);
            __syncthreads();  // red is rewritten by the next pass
        }
    }
}

// Routed experts gate/up + SiLU, INT4: h[p, n] = silu(x[p / topk] . Wg[e, n]) *
// (x[p / topk] . Wu[e, n]) for every pair p of tile blockIdx.y (expert e).
// Shapes: x [T, K] f32 (post-norm), q13 [E, N, 2, K/8] u32, s13 [E, N, 2, K/128] bf16,
// h [P, N] f32 (N = moe_intermediate_size).
// Launch: grid (blocks over 2N rows, max_tiles), block 128 (launch.rs moe_w4).
extern "C" __global__ void __launch_bounds__(W4_BLOCK, W4_MINB) moe_gate_up_w4(
    float* __restrict__ h, const float* __restrict__ x, const u32* __restrict__ q13,
    const bf16_bits* __restrict__ s13, const int* __restrict__ sorted,
    const int* __restrict__ tile_expert, int topk, int N, int K) {
    w4_gemv<2>(h, x, q13, s13, nullptr, sorted, tile_expert, topk, N, K);
}

// Routed experts down-projection with the router weight applied: y[p, n] = w_p *
// (h[p] . Wd[e, n]).  Shapes: h [P, K] (K = moe_intermediate_size), qd [E, N, K/8] u32,
// sd [E, N, K/128] bf16, topk_w [P], y [P, N] (N = hidden).
// Launch: grid (blocks over N rows, max_tiles), block 128 (launch.rs moe_w4).
extern "C" __global__ void __launch_bounds__(W4_BLOCK, W4_MINB) moe_down_w4(
    float* __restrict__ y, const float* __restrict__ h, const u32* __restrict__ qd,
    const bf16_bits* __restrict__ sd, const float* __restrict__ topk_w,
    const int* __restrict__ sorted, const int* __restrict__ tile_expert, int N, int K) {
    w4_gemv<1>(y, h, qd, sd, topk_w, sorted, tile_expert, 1, N, K);
}
