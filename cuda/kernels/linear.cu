// Dense bf16-weight linear layers and the SwiGLU / MoE expert GEMMs (f32 compute).
//
// Source: docs/model.md §1.2-§1.5 (y = x @ W^T, W [N, K], no bias, f32 compute with f32
// inputs: weights widened exactly, W4A16 dequantized to exact f32 products), §5
// (SwiGLU, MoE experts; the router-weighted combine is in moe.cu).
//
// One scheme for every GEMM here, built for decode / verify batches (few rows, weight
// bandwidth bound): a warp owns one output column n and up to ROWS_PER_TILE (8) rows;
// lane l reads 8 consecutive k (one 16-byte bf16 load, or one 32-bit INT4 word) at
// k = 8 * (l + 32 i), so a warp reads 512 B (bf16) / 128 B (INT4) of a weight row per
// step, coalesced; activations are re-read from L1/L2 by the 4 warps of a block.
// Requirements (checked on the host, cuda/src/ops.rs): K % 8 == 0 (INT4: K % 128 == 0),
// row strides of x multiples of 4 floats and every base pointer 16-byte aligned.
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
struct LoadInt4 {
    const u32* q;        // [rows, K / 8] repacked words (cuda/src/repack.rs)
    const bf16_bits* s;  // [rows, K / 128] bf16 scales
    int K;
    __device__ __forceinline__ void load(size_t row, int kw, float out[8]) const {
        const u32 word = q[row * (size_t)(K / 8) + kw];
        const float sc = bf16_to_f32(s[row * (size_t)(K / 128) + (kw >> 4)]);
        dequant8(word, sc, out);
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

// Routed experts gate/up + SiLU, INT4: h[p, n] for every routed pair p = t * topk + slot.
// Shapes: x [T, K] f32 (post-norm f), q13 [E, N, 2, K/8] u32, s13 [E, N, 2, K/128] bf16,
// h [P, N] f32 (N = moe_intermediate_size).  Launch: grid (ceil(N / 4), max_tiles), block 128.
extern "C" __global__ void moe_gate_up_w4(float* __restrict__ h, const float* __restrict__ x,
                                          const u32* __restrict__ q13,
                                          const bf16_bits* __restrict__ s13,
                                          const int* __restrict__ sorted,
                                          const int* __restrict__ tile_expert, int topk, int N,
                                          int K) {
    moe_gate_up(h, x, LoadInt4{q13, s13, K}, sorted, tile_expert, topk, N, K);
}

// The same with bf16 routed experts (the MTP layer's MoE stays bf16, docs/model.md §8).
// Shapes: w13 [E, N, 2, K] bf16.  Launch: as moe_gate_up_w4.
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

// Routed experts down-projection with the router weight applied: y[p, n] = w_p * (h[p] . Wd[n]).
// Shapes: h [P, K] (K = moe_intermediate_size), qd [E, N, K/8] u32, sd [E, N, K/128] bf16,
// topk_w [P], y [P, N] (N = hidden).  Launch: grid (ceil(N / 4), max_tiles), block 128.
extern "C" __global__ void moe_down_w4(float* __restrict__ y, const float* __restrict__ h,
                                       const u32* __restrict__ qd,
                                       const bf16_bits* __restrict__ sd,
                                       const float* __restrict__ topk_w,
                                       const int* __restrict__ sorted,
                                       const int* __restrict__ tile_expert, int N, int K) {
    moe_down(y, h, LoadInt4{qd, sd, K}, topk_w, sorted, tile_expert, N, K);
}

// The same with bf16 routed experts.  Shapes: wd [E, N, K] bf16.  Launch: as moe_down_w4.
extern "C" __global__ void moe_down_bf16(float* __restrict__ y, const float* __restrict__ h,
                                         const bf16_bits* __restrict__ wd,
                                         const float* __restrict__ topk_w,
                                         const int* __restrict__ sorted,
                                         const int* __restrict__ tile_expert, int N, int K) {
    moe_down(y, h, LoadBf16{wd, K}, topk_w, sorted, tile_expert, N, K);
}
