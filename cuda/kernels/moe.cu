// MoE routing on the device: sigmoid router top-k, token sorting per expert, combine.
//
// Source: docs/model.md §5 (DeepSeek-V3 `noaux_tc`: s = sigmoid(r); top-k of
// s + e_score_correction_bias, ties to the lower expert index; weights s[sel] without
// the bias, / (sum + 1e-20) when norm_topk_prob, * routed_scaling_factor always);
// vLLM csrc/moe/moe_align_sum_kernels.cu `moe_align_block_size` (tokens sorted per
// expert, each expert's segment padded to the GEMM tile of 8 rows).  The expert GEMMs
// are in linear.cu.  The combine adds the routed outputs in ascending expert order from
// zero, then the shared expert, then into the residual: the CPU engine's order
// (engine/src/model/moe.rs), so the result does not depend on the sorting order.

#define MOE_TILE 8
#define TOPK_MAX 8
#define TOPK_WARPS 4
#define EXPERTS_MAX 1024

// The top-k pick of one token by one warp: b [E] holds sigmoid(logit) + bias (taken
// entries are overwritten), lr [E] the logits. Writes ids[t, :k], wts[t, :k], and the ids
// to sids[:k] too when sids (shared memory) is not null.
__device__ __forceinline__ void topk_pick(int* __restrict__ ids, float* __restrict__ wts,
                                          int t, const float* lr, float* b, int E, int k,
                                          int norm_topk, float rsf, int* sids = nullptr) {
    const int lane = threadIdx.x & 31;
    int sel[TOPK_MAX];
    float w[TOPK_MAX];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < TOPK_MAX; ++j) {
        sel[j] = 0;
        w[j] = 0.0f;
        if (j < k) {
            float bv = -INFINITY;
            int bi = 0x7fffffff;
            for (int e = lane; e < E; e += WARP) argmax_merge(bv, bi, b[e], e);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
                const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
                argmax_merge(bv, bi, ov, oi);
            }
            // Every lane holds the same winner; a taken expert can no longer win.
            __syncwarp();
            if (lane == (bi & 31)) b[bi] = -INFINITY;
            __syncwarp();
            sel[j] = bi;
            w[j] = sigmoid_f(lr[bi]);
            sum += w[j];
        }
    }
    sum += 1e-20f;
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < TOPK_MAX; ++j) {
            if (j < k) {
                float v = norm_topk ? w[j] / sum : w[j];
                ids[(size_t)t * k + j] = sel[j];
                wts[(size_t)t * k + j] = v * rsf;
                if (sids) sids[j] = sel[j];
            }
        }
    }
}

// ids[t, j], wts[t, j] for j < k: the selected experts in descending biased score.
// Shapes: logits [T, E] f32, bias [E] f32, ids [T, k] i32, wts [T, k] f32;
// E <= 1024, k <= 8, k <= E (host-checked).  Launch: grid (ceil(T / 4)), block 128.
extern "C" __global__ void moe_topk(int* __restrict__ ids, float* __restrict__ wts,
                                    const float* __restrict__ logits,
                                    const float* __restrict__ bias, int T, int E, int k,
                                    int norm_topk, float rsf) {
    pdl_enter();
    __shared__ float biased[TOPK_WARPS][EXPERTS_MAX];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * TOPK_WARPS + warp;
    if (t >= T) return;  // uniform per warp
    const float* lr = logits + (size_t)t * E;
    float* b = biased[warp];
    for (int e = lane; e < E; e += WARP) b[e] = sigmoid_f(lr[e]) + bias[e];
    __syncwarp();
    topk_pick(ids, wts, t, lr, b, E, k, norm_topk, rsf);
}

// MOE_ALIGN_FAST (default 1): align_tiles counts the pairs with shared atomics (one pass
// over the P ids instead of one ballot pass per expert), scans the padded counts in
// parallel (align_scan) instead of thread 0's loop over E, and skips experts without pairs
// in the scatter.  Integer counts and sums, and the scatter unchanged: the same sorted /
// tile_expert as 0 (the previous kernel, the A/B reference).  gpu_check compares
// moe_align with the host model launch::moe_align_model (gemm_check.rs align_parity) and
// the fused router's sort with moe_align's (router_norm_parity).
#ifndef MOE_ALIGN_FAST
#define MOE_ALIGN_FAST 1
#endif

// offset[e] = the exclusive prefix sum over experts of count rounded up to MOE_TILE,
// offset[E] and *ntiles (= offset[E] / MOE_TILE) the total; by the whole block (a
// multiple of 32 threads, at most 1024), in chunks of blockDim.x experts: warp shuffles,
// then the warp totals, carried across chunks.  count must be visible to the block.
__device__ __forceinline__ void align_scan(const int* count, int* offset, int E, int* ntiles) {
    __shared__ int wtot[32];
    __shared__ int carry;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    if (tid == 0) carry = 0;
    for (int base = 0; base < E; base += blockDim.x) {
        const int e = base + tid;
        const int c = e < E ? (count[e] + MOE_TILE - 1) / MOE_TILE * MOE_TILE : 0;
        int v = c;
#pragma unroll
        for (int o = 1; o < WARP; o <<= 1) {
            const int n = __shfl_up_sync(FULL_MASK, v, o);
            if (lane >= o) v += n;
        }
        if (lane == WARP - 1) wtot[warp] = v;
        __syncthreads();  // the warp totals (and carry) written
        if (warp == 0) {
            int w = lane < nwarps ? wtot[lane] : 0;
#pragma unroll
            for (int o = 1; o < WARP; o <<= 1) {
                const int n = __shfl_up_sync(FULL_MASK, w, o);
                if (lane >= o) w += n;
            }
            if (lane < nwarps) wtot[lane] = w;  // inclusive over warps
        }
        __syncthreads();
        const int before = carry, chunk = wtot[nwarps - 1];
        if (e < E) offset[e] = before + (warp > 0 ? wtot[warp - 1] : 0) + v - c;
        __syncthreads();  // every thread read carry and wtot (the next chunk rewrites wtot)
        if (tid == 0) carry = before + chunk;
    }
    __syncthreads();
    if (tid == 0) {
        offset[E] = carry;
        *ntiles = carry / MOE_TILE;
    }
}

// Sort the P = T * k routed pairs by expert.  sorted[0 .. P_pad) receives the pair ids
// p = t * k + slot of expert 0, then expert 1, ..., each expert's segment padded with -1
// to a multiple of 8 and in ascending p; tile_expert[i] = the expert of sorted positions
// [8 i, 8 i + 8), -1 past the last tile, and tile_expert[max_tiles] = the number of tiles
// used (the INT4 GEMMs size their work by it).  P_pad <= p_pad_max = 8 * max_tiles with
// max_tiles = ceil((P + min(E, P) * 7) / 8) (cuda/src/launch.rs::moe_max_tiles).
// Shapes: ids [P] i32 (< E), sorted [p_pad_max] i32, tile_expert [max_tiles + 1] i32;
// count [E], offset [E + 1] are the caller's shared arrays.  Run by a whole block (any
// size that is a multiple of 32); ids are read through L2 (ld.global.cg), so the router's
// last block (moe_router_topk) sees the ids the other blocks wrote; SMEM: ids is this
// block's shared copy (a one-block router grid), read directly.  stage (shared, stage_cap
// ints, or null): with MOE_ALIGN_FAST and P <= stage_cap the counting pass copies the ids
// there and the scatter reads the copy instead of L2.  The scatter reads every id once for
// each expert that has pairs, so from L2 it grew with M (a dependent L2 round trip per 32
// pairs and expert: 19 / 33 / 60 us at M = 32 / 64 / 128 on an H100, runs/layer-align-f4065ac/).
// The same ids in the same order either way.
template <bool SMEM = false>
__device__ __forceinline__ void align_tiles(int* __restrict__ sorted, int* __restrict__ tile_expert,
                                            const int* __restrict__ ids, int P, int E,
                                            int max_tiles, int* count, int* offset,
                                            int* stage = nullptr, int stage_cap = 0) {
    const bool staged = MOE_ALIGN_FAST && !SMEM && stage != nullptr && P <= stage_cap;
    auto id = [&](int p) { return SMEM ? ids[p] : staged ? stage[p] : __ldcg(ids + p); };
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nwarps = blockDim.x >> 5;
    for (int i = tid; i < max_tiles * MOE_TILE; i += blockDim.x) sorted[i] = -1;
    for (int i = tid; i < max_tiles; i += blockDim.x) tile_expert[i] = -1;
#if MOE_ALIGN_FAST
    for (int e = tid; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = tid; p < P; p += blockDim.x) {
        const int v = SMEM ? ids[p] : __ldcg(ids + p);
        if (staged) stage[p] = v;
        atomicAdd(count + v, 1);
    }
    __syncthreads();  // also orders the -1 fills (and the staged ids) before the scatter
    align_scan(count, offset, E, tile_expert + max_tiles);
#else
    for (int e = warp; e < E; e += nwarps) {
        int c = 0;
        for (int base = 0; base < P; base += WARP) {
            const int p = base + lane;
            c += __popc(__ballot_sync(FULL_MASK, p < P && id(p) == e));
        }
        if (lane == 0) count[e] = c;
    }
    __syncthreads();  // also orders the -1 fills before the scatter below
    if (tid == 0) {
        int acc = 0;
        for (int e = 0; e < E; ++e) {
            offset[e] = acc;
            acc += (count[e] + MOE_TILE - 1) / MOE_TILE * MOE_TILE;
        }
        offset[E] = acc;
        tile_expert[max_tiles] = acc / MOE_TILE;
    }
#endif
    __syncthreads();
    for (int e = warp; e < E; e += nwarps) {
        if (MOE_ALIGN_FAST && count[e] == 0) continue;  // uniform per warp: nothing to place
        int run = 0;
        const int base_pos = offset[e];
        for (int base = 0; base < P; base += WARP) {
            const int p = base + lane;
            const bool m = p < P && id(p) == e;
            const u32 mask = __ballot_sync(FULL_MASK, m);
            if (m) sorted[base_pos + run + __popc(mask & ((1u << lane) - 1u))] = p;
            run += __popc(mask);
        }
        for (int t = offset[e] / MOE_TILE + lane; t < offset[e + 1] / MOE_TILE; t += WARP)
            tile_expert[t] = e;
    }
}

// Pairs moe_align stages in shared memory (align_tiles): 32 KB, 64 sequences of a
// 16-token verify at top-8; past it the scatter reads L2 (prefill).  The router's last
// block stages at most min(ALIGN_STAGE, ROUTER_NORM_K_MAX).  0 turns staging off (A/B).
#ifndef ALIGN_STAGE
#define ALIGN_STAGE 8192
#endif

#define ROUTER_E_MAX 256
// Largest hidden size whose post-attention rmsnorm the router kernel fuses (its shared row).
#define ROUTER_NORM_K_MAX 4096

// rmsnorm of one row into shared memory and out (both [D]), bit for bit basic.cu's
// rmsnorm as ops.rs launches it (128 threads): the same per-thread partials (stride 128),
// warp sums, and the 4 warp totals added in order from zero; then x * inv * w.
// Called by the whole block (blockDim.x >= 128); returns the shared row.
// nw0: this thread's nw[threadIdx.x] when `pre` (loaded before the grid-dependency wait).
__device__ __forceinline__ const float* router_norm_row(float* s_row, float* __restrict__ out,
                                                        const float* __restrict__ xr,
                                                        const float* __restrict__ nw, int D,
                                                        float eps, float* scratch, bool pre,
                                                        float nw0) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float ss = 0.0f;
    if (tid < 128)
        for (int i = tid; i < D; i += 128) ss += xr[i] * xr[i];
    ss = warp_sum(ss);
    if (lane == 0 && warp < 4) scratch[warp] = ss;
    __syncthreads();
    float tot = 0.0f;
    for (int w = 0; w < 4; ++w) tot += scratch[w];
    const float inv = 1.0f / sqrtf(tot / (float)D + eps);
    for (int i = tid; i < D; i += blockDim.x) {
        const float v = xr[i] * inv * (pre && i == tid ? nw0 : nw[i]);
        s_row[i] = v;
        out[i] = v;
    }
    __syncthreads();
    return s_row;
}

// The router GEMM fused with moe_topk for small routers (E <= 256): block t, warp w
// computes logits[t, e] = x[t] . W[e] for e = w, w + 16, ... in linear_bf16's summation
// order (lane-strided 8-wide words, then the xor warp sum), so the logits are
// bit-identical to the unfused path's; then warp 0 picks as moe_topk.  When xs is not
// null the block also writes its row's split activations for the INT4 experts (common.cuh
// w4_split_item, as linear.cu moe_split_x would; requires x_stride == K).  Shapes: x
// [T, x_stride] f32 (first K used), W [E, K] bf16, bias [E], logits [T, E] (written),
// ids / wts [T, k], xs [T, K W4_XS / 2] u32 or null; K % 16 == 0.
// When norm_w is not null the layer's post-attention rmsnorm is fused in: x is the raw
// residual row, xn [T, K] receives rmsnorm(x, norm_w, eps) (router_norm_row, the shared
// expert's input) and the router and split read that; K <= ROUTER_NORM_K_MAX.
// When ticket is not null the block that finishes last also sorts the pairs (align_tiles,
// moe_align's work and result) into sorted / tile_expert: each block fences its ids and
// takes a ticket; the one drawing T - 1 aligns and resets *ticket to 0 (it is zero
// between launches: allocated zeroed). The pattern of the CUDA threadFenceReduction
// sample; it saves the moe_align launch.  E <= ROUTER_E_MAX here, so the shared count /
// offset arrays are sized by it.
// With `pre` two latency cuts, the values unchanged: each warp's first router-weight word
// (expert e = warp, k word = lane), its expert's bias and each thread's first norm weight
// are loaded before the grid-dependency wait (constants; the prologue programmatic
// dependent launch allows, as linear.cu LT_PREWAIT); and a one-block grid (T = 1, a
// decode step of one sequence) aligns straight after its barrier from a shared copy of
// its ids, without the fence, ticket and L2 round trips (the ticket stays 0).
// Launch: grid (T), block 512.
extern "C" __global__ void moe_router_topk(int* __restrict__ ids, float* __restrict__ wts,
                                           float* __restrict__ logits, u32* __restrict__ xs,
                                           const float* __restrict__ x, int x_stride,
                                           const bf16_bits* __restrict__ W,
                                           const float* __restrict__ bias, int T, int E, int K,
                                           int k, int norm_topk, float rsf,
                                           const float* __restrict__ norm_w, float eps,
                                           float* __restrict__ xn, int* __restrict__ ticket,
                                           int* __restrict__ sorted, int* __restrict__ tile_expert,
                                           int max_tiles, int pre) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // warp < E: a real expert row; lane < K / 8: its first k word (kw = lane).
    const bool pw = pre && warp < E && lane < K / 8;
    uint4 w0 = make_uint4(0u, 0u, 0u, 0u);
    if (pw) w0 = *reinterpret_cast<const uint4*>(W + (size_t)warp * K + (size_t)lane * 8);
    float nw0 = 0.0f, b0 = 0.0f;  // the norm weight and router bias this thread reads first
    if (pre && norm_w != nullptr && threadIdx.x < K) nw0 = norm_w[threadIdx.x];
    if (pre && warp < E) b0 = bias[warp];
    pdl_enter();
    __shared__ float lg[ROUTER_E_MAX];
    __shared__ float biased[ROUTER_E_MAX];
    __shared__ __align__(16) float row[ROUTER_NORM_K_MAX];
    __shared__ float scratch[32];
    const int nwarps = blockDim.x >> 5;
    const int t = blockIdx.x;
    if (t >= T) return;  // uniform per block
    const float* xr = x + (size_t)t * x_stride;
    if (norm_w != nullptr)
        xr = router_norm_row(row, xn + (size_t)t * K, xr, norm_w, K, eps, scratch, pre, nw0);
    if (xs != nullptr)
        for (int i = threadIdx.x; i < K / 4; i += blockDim.x) w4_split_item(xs, xr, t, K, i);
    for (int e = warp; e < E; e += nwarps) {
        float acc = 0.0f;
        for (int kw = lane; kw < K / 8; kw += WARP) {
            float w[8], xv[8];
            widen8(pw && e == warp && kw == lane
                       ? w0
                       : *reinterpret_cast<const uint4*>(W + (size_t)e * K + (size_t)kw * 8),
                   w);
            load8(xr + (size_t)kw * 8, xv);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc += xv[j] * w[j];
        }
        const float s = warp_sum(acc);
        if (lane == 0) {
            lg[e] = s;
            biased[e] = sigmoid_f(s) + (pre && e == warp ? b0 : bias[e]);
            logits[(size_t)t * E + e] = s;
        }
    }
    __syncthreads();
    __shared__ int sids[TOPK_MAX];
    const bool one = pre && ticket != nullptr && gridDim.x == 1;  // uniform
    if (warp == 0) topk_pick(ids, wts, t, lg, biased, E, k, norm_topk, rsf, one ? sids : nullptr);
    if (ticket == nullptr) return;  // uniform
    __shared__ int count[ROUTER_E_MAX];
    __shared__ int offset[ROUTER_E_MAX + 1];
    __shared__ int last;
    if (one) {
        __syncthreads();  // warp 0's shared ids, visible to the block
        align_tiles<true>(sorted, tile_expert, sids, T * k, E, max_tiles, count, offset);
        return;
    }
    __threadfence();  // this block's ids before its ticket
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == T - 1;
    __syncthreads();
    if (!last) return;  // uniform per block
    __threadfence();
    // The normalized row is no longer read (every warp passed the barrier after its GEMV):
    // its shared array stages the ids.
    align_tiles(sorted, tile_expert, ids, T * k, E, max_tiles, count, offset,
                reinterpret_cast<int*>(row), min(ALIGN_STAGE, ROUTER_NORM_K_MAX));
    if (threadIdx.x == 0) *ticket = 0;
}

// align_tiles as its own launch.  Launch: grid (1), block 1024; E <= 1024.
extern "C" __global__ void __launch_bounds__(1024) moe_align(int* __restrict__ sorted, int* __restrict__ tile_expert,
                                     const int* __restrict__ ids, int P, int E,
                                     int max_tiles) {
    pdl_enter();
    __shared__ int count[EXPERTS_MAX];
    __shared__ int offset[EXPERTS_MAX + 1];
    __shared__ int stage[ALIGN_STAGE > 0 ? ALIGN_STAGE : 1];
    align_tiles(sorted, tile_expert, ids, P, E, max_tiles, count, offset, stage, ALIGN_STAGE);
}

// x[t, n] += (sum over the token's experts in ascending id of y[t*k + slot, n]) + shared[t, n].
// Shapes: x [T, H], y [T * k, H] (router-weighted expert outputs, linear.cu moe_down_*),
// shared [T, H], ids [T, k].  Launch: grid (T), block 128.
extern "C" __global__ void moe_combine(float* __restrict__ x, const float* __restrict__ y,
                                       const float* __restrict__ shared,
                                       const int* __restrict__ ids, int T, int H, int k) {
    pdl_enter();
    __shared__ int order[TOPK_MAX];
    const int t = blockIdx.x;
    if (t >= T) return;
    if (threadIdx.x == 0) {
        // Insertion sort of the k <= 8 slots by expert id (distinct ids).
        for (int j = 0; j < k; ++j) order[j] = j;
        for (int j = 1; j < k; ++j) {
            const int s = order[j];
            int i = j - 1;
            while (i >= 0 && ids[(size_t)t * k + order[i]] > ids[(size_t)t * k + s]) {
                order[i + 1] = order[i];
                --i;
            }
            order[i + 1] = s;
        }
    }
    __syncthreads();
    for (int n = threadIdx.x; n < H; n += blockDim.x) {
        float o = 0.0f;
        for (int j = 0; j < k; ++j) o += y[((size_t)t * k + order[j]) * H + n];
        o += shared[(size_t)t * H + n];
        x[(size_t)t * H + n] += o;
    }
}
