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
// Scheme (after vLLM csrc/moe/marlin_moe_wna16 and gptq_marlin's lop3 dequantization,
// kept on f32 CUDA cores for the engine's f32 numerics, docs/model.md §1):
// - A "lane group" of L lanes (L = the largest power of two <= min(32, K / 32)) owns
//   W4_ROWS = 4 consecutive weight rows of one expert: gate/up of 2 output columns
//   ([E, N, 2, K/8] fused layout) or down rows of 4 columns ([E, N, K/8]).  A warp holds
//   32 / L groups (one at GLM shapes; 8 / 4 for models/tiny's K = 256 / 128), so every
//   lane works at every shape.
// - Lane g of a group reads 16-byte chunks c = g, g + L, ... of each of its 4 rows (one
//   uint4 = 4 words = 32 weights, all of one 128-group, so one scale), L consecutive
//   lanes reading 16 L contiguous bytes of a row, through a W4_STAGES-deep cp.async
//   pipeline in shared memory (3 chunks = 192 B per lane in flight, no registers held:
//   at ~3 blocks an SM that is ~70 KB in flight per SM, ~2.5x the ~25 KB Little's law
//   asks for at 4.2 TB/s and ~0.8 us loaded latency).
// - Dequantization: common.cuh dequant8 (1 LOP3 + 1 FFMA per weight, exact q * scale).
// - Each activation float4 (L1 / L2) is reused for 4 weight rows; the token rows of the
//   tile (up to 8, moe.cu moe_align) accumulate in registers, acc[4][8]; the group's
//   partial sums are reduced with xor shuffles of width L.
// Requirements (host-checked, cuda/src/ops.rs + launch.rs): K % 128 == 0, N % 8 == 0,
// x rows 16-byte aligned (x stride = K).

#define W4_ROWS 4
#define W4_WARPS 4
#define W4_STAGES 4

// Lanes per group for a row of K weights (mirrored by cuda/src/launch.rs w4_lanes).
__device__ __forceinline__ int w4_lanes(int K) {
    const int chunks = K / 32;
    int l = 1;
    while (l < 32 && 2 * l <= chunks) l *= 2;
    return l;
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

// Per-thread pipeline stages: the 4 chunks (uint4) of the thread's weight rows and the
// 32-bit word holding each chunk's bf16 scale.  Each thread reads back only what it copied
// itself, so cp.async.wait_group is the only synchronization.  40 KB a block.
struct W4Smem {
    uint4 q[W4_STAGES][W4_ROWS][128];
    u32 s[W4_STAGES][W4_ROWS][128];
};

// Issue the copies of chunk c of rows row0 .. row0 + 3 into stage `st`.  The scale word is
// the aligned pair holding scale (row, c / 4); scale buffers have an even length (N % 8
// == 0), so the pair never leaves the buffer.
__device__ __forceinline__ void w4_issue(W4Smem& sm, int st, const u32* __restrict__ qw,
                                         const bf16_bits* __restrict__ s, size_t row0, int K,
                                         int c) {
    const int t = threadIdx.x;
#pragma unroll
    for (int i = 0; i < W4_ROWS; ++i) {
        const size_t row = row0 + i;
        cp_async16(&sm.q[st][i][t], qw + row * (size_t)(K / 8) + (size_t)c * 4);
        const size_t si = row * (size_t)(K / 128) + (c >> 2);
        cp_async4(&sm.s[st][i][t], s + (si & ~(size_t)1));
    }
}

// acc[i][r] = sum_k x[in_row[r], k] * W[row0 + i, k] over this lane's chunks (partial: the
// caller reduces over the group's L lanes).  Rows with in_row[r] < 0 are skipped
// (uniform per tile).  x: [rows, K] f32.  The lane's chunks c = g, g + L, ... stream
// through W4_STAGES shared-memory stages, W4_STAGES - 1 chunks in flight.
__device__ __forceinline__ void w4_dot(W4Smem& sm, float acc[W4_ROWS][ROWS_PER_TILE],
                                       const u32* __restrict__ qw,
                                       const bf16_bits* __restrict__ s, size_t row0, int K,
                                       const float* __restrict__ x,
                                       const int in_row[ROWS_PER_TILE], int g, int L) {
#pragma unroll
    for (int i = 0; i < W4_ROWS; ++i)
#pragma unroll
        for (int r = 0; r < ROWS_PER_TILE; ++r) acc[i][r] = 0.0f;
    const int t = threadIdx.x;
    const int mine = (K / 32 - g + L - 1) / L;  // chunks of this lane (>= 1: g < L <= K / 32)
#pragma unroll
    for (int st = 0; st < W4_STAGES - 1; ++st) {
        if (st < mine) w4_issue(sm, st, qw, s, row0, K, g + st * L);
        cp_async_commit();
    }
    for (int it = 0; it < mine; ++it) {
        const int nx = it + W4_STAGES - 1;
        if (nx < mine) w4_issue(sm, nx % W4_STAGES, qw, s, row0, K, g + nx * L);
        cp_async_commit();
        cp_async_wait_stages();  // chunk `it` has landed
        const int st = it % W4_STAGES, c = g + it * L;
        uint4 q[W4_ROWS];
        W4Scale sp[W4_ROWS];
#pragma unroll
        for (int i = 0; i < W4_ROWS; ++i) {
            q[i] = sm.q[st][i][t];
            const size_t si = (row0 + i) * (size_t)(K / 128) + (c >> 2);
            const u32 pair = sm.s[st][i][t];
            sp[i] = w4_scale(bf16_to_f32((bf16_bits)(si & 1 ? pair >> 16 : pair & 0xffffu)));
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float w[W4_ROWS][8];
#pragma unroll
            for (int i = 0; i < W4_ROWS; ++i) {
                const u32 word = j == 0 ? q[i].x : j == 1 ? q[i].y : j == 2 ? q[i].z : q[i].w;
                dequant8(word, sp[i], w[i]);
            }
#pragma unroll
            for (int r = 0; r < ROWS_PER_TILE; ++r) {
                if (in_row[r] >= 0) {
                    float xv[8];
                    load8(x + (size_t)in_row[r] * K + (size_t)c * 32 + j * 8, xv);
#pragma unroll
                    for (int i = 0; i < W4_ROWS; ++i)
#pragma unroll
                        for (int u = 0; u < 8; ++u) acc[i][r] += xv[u] * w[i][u];
                }
            }
        }
    }
}

// Sum of v over the L lanes of this lane's group (L a power of two <= 32, groups aligned).
__device__ __forceinline__ float group_sum(float v, int L) {
    for (int o = L >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// This group's first output column (cols_per_group columns each) and whether it is real.
__device__ __forceinline__ int w4_col0(int L, int cols_per_group) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = (blockIdx.x * W4_WARPS + warp) * (WARP / L) + lane / L;
    return group * cols_per_group;
}

// Routed experts gate/up + SiLU, INT4: h[p, n] = silu(x[p / topk] . Wg[e, n]) *
// (x[p / topk] . Wu[e, n]) for every pair p of tile blockIdx.y (expert e).
// Shapes: x [T, K] f32 (post-norm), q13 [E, N, 2, K/8] u32, s13 [E, N, 2, K/128] bf16,
// h [P, N] f32 (N = moe_intermediate_size).
// Launch: grid (ceil(N / (2 * W4_WARPS * 32 / L)), max_tiles), block 128 (launch.rs moe_w4).
extern "C" __global__ void __launch_bounds__(128, 4) moe_gate_up_w4(
    float* __restrict__ h, const float* __restrict__ x, const u32* __restrict__ q13,
    const bf16_bits* __restrict__ s13, const int* __restrict__ sorted,
    const int* __restrict__ tile_expert, int topk, int N, int K) {
    const int tile = blockIdx.y;
    const int e = tile_expert[tile];
    if (e < 0) return;  // uniform per block
    const int L = w4_lanes(K);
    const int n0 = w4_col0(L, 2);
    const bool real = n0 < N;  // uniform per group; N % 8 == 0, so both columns are real
    int in_row[ROWS_PER_TILE];
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) {
        const int p = sorted[tile * ROWS_PER_TILE + r];
        in_row[r] = p >= 0 ? p / topk : -1;
    }
    __shared__ W4Smem sm;
    float acc[W4_ROWS][ROWS_PER_TILE];
    // A group past N reads column 0 (valid memory) and writes nothing: every lane of the
    // warp must take part in the shuffles.
    w4_dot(sm, acc, q13, s13, ((size_t)e * N + (real ? n0 : 0)) * 2, K, x, in_row,
           (threadIdx.x & 31) % L, L);
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) {
        if (in_row[r] < 0) continue;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float gv = group_sum(acc[2 * c][r], L);
            const float uv = group_sum(acc[2 * c + 1][r], L);
            if (real && (threadIdx.x & 31) % L == 0)
                h[(size_t)sorted[tile * ROWS_PER_TILE + r] * N + n0 + c] = silu_f(gv) * uv;
        }
    }
}

// Routed experts down-projection with the router weight applied: y[p, n] = w_p *
// (h[p] . Wd[e, n]).  Shapes: h [P, K] (K = moe_intermediate_size), qd [E, N, K/8] u32,
// sd [E, N, K/128] bf16, topk_w [P], y [P, N] (N = hidden).
// Launch: grid (ceil(N / (4 * W4_WARPS * 32 / L)), max_tiles), block 128 (launch.rs moe_w4).
extern "C" __global__ void __launch_bounds__(128, 4) moe_down_w4(
    float* __restrict__ y, const float* __restrict__ h, const u32* __restrict__ qd,
    const bf16_bits* __restrict__ sd, const float* __restrict__ topk_w,
    const int* __restrict__ sorted, const int* __restrict__ tile_expert, int N, int K) {
    const int tile = blockIdx.y;
    const int e = tile_expert[tile];
    if (e < 0) return;
    const int L = w4_lanes(K);
    const int n0 = w4_col0(L, 4);
    const bool real = n0 < N;
    int rows[ROWS_PER_TILE];
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) rows[r] = sorted[tile * ROWS_PER_TILE + r];
    __shared__ W4Smem sm;
    float acc[W4_ROWS][ROWS_PER_TILE];
    w4_dot(sm, acc, qd, sd, (size_t)e * N + (real ? n0 : 0), K, h, rows, (threadIdx.x & 31) % L, L);
#pragma unroll
    for (int r = 0; r < ROWS_PER_TILE; ++r) {
        if (rows[r] < 0) continue;
        const float wp = topk_w[rows[r]];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float v = group_sum(acc[c][r], L);
            if (real && (threadIdx.x & 31) % L == 0) y[(size_t)rows[r] * N + n0 + c] = wp * v;
        }
    }
}
