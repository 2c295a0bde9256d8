// Row-wise and gather kernels: embedding, RMSNorm, row gather, greedy arg-max.
// Source: docs/model.md §1 (rmsnorm: x / sqrt(mean(x^2) + eps) * w, the weight
// multiplies), §2 (embedding lookup, final norm), §1.7 (arg-max ties: lowest index).
// Host wrappers and launch shapes: cuda/src/ops.rs.

// out[t, :] = f32(table[tokens[t], :]).  Shapes: out [T, H] f32, table [V, H] bf16,
// tokens [T] u32 (checked < V on the host).  Launch: grid (T), block 128.
extern "C" __global__ void embed_gather(float* __restrict__ out,
                                        const bf16_bits* __restrict__ table,
                                        const u32* __restrict__ tokens, int T, int H) {
    pdl_enter();
    const int t = blockIdx.x;
    if (t >= T) return;
    const bf16_bits* row = table + (size_t)tokens[t] * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) out[(size_t)t * H + i] = bf16_to_f32(row[i]);
}

// out[r, :] = rmsnorm(x[r, :], w, eps), rows of length D with their own strides; also
// into out2 (same stride) when it is not null.
__device__ __forceinline__ void rmsnorm_row(float* __restrict__ out, float* __restrict__ out2,
                                            int out_stride, const float* __restrict__ x,
                                            int x_stride, const float* __restrict__ w, int R,
                                            int D, float eps) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= R) return;
    const float* xr = x + (size_t)r * x_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)D + eps);
    float* orow = out + (size_t)r * out_stride;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = xr[i] * inv * w[i];
        orow[i] = v;
        if (out2) out2[(size_t)r * out_stride + i] = v;
    }
}

// Shapes: x [R, x_stride] f32, out [R, out_stride] f32, w [D] f32.
// Launch: grid (R), block 128 (any multiple of 32 <= 1024).
extern "C" __global__ void rmsnorm(float* __restrict__ out, int out_stride,
                                   const float* __restrict__ x, int x_stride,
                                   const float* __restrict__ w, int R, int D, float eps) {
    pdl_enter();
    rmsnorm_row(out, nullptr, out_stride, x, x_stride, w, R, D, eps);
}

// rmsnorm written twice, to out and out2 (the final norm of a step whose chunks are one
// row each: its row gather would copy out to out2 unchanged).  Launch: as rmsnorm.
extern "C" __global__ void rmsnorm_dup(float* __restrict__ out, float* __restrict__ out2,
                                       int out_stride, const float* __restrict__ x,
                                       int x_stride, const float* __restrict__ w, int R, int D,
                                       float eps) {
    pdl_enter();
    rmsnorm_row(out, out2, out_stride, x, x_stride, w, R, D, eps);
}

// The MTP layer's two input norms in one launch (docs/model.md §8): block (t, 0) writes
// out[t, 0 .. D) = rmsnorm(f32(table[tokens[t], :]), we, eps) (embed_gather then rmsnorm),
// block (t, 1) out[t, D .. 2D) = rmsnorm(h[t, :], wh, eps); each bit for bit the kernels it
// replaces (the same values, per-thread strides and block_sum).  Shapes: out [T,
// out_stride >= 2D], table [V, D] bf16, tokens [T] (< V, host-checked), h [T, h_stride],
// we / wh [D].  Launch: grid (T, 2), block 128.
extern "C" __global__ void mtp_in_norm(float* __restrict__ out, int out_stride,
                                       const bf16_bits* __restrict__ table,
                                       const u32* __restrict__ tokens,
                                       const float* __restrict__ h, int h_stride,
                                       const float* __restrict__ we,
                                       const float* __restrict__ wh, int T, int D, float eps) {
    pdl_enter();
    __shared__ float scratch[32];
    const int t = blockIdx.x;
    if (t >= T) return;
    const bool emb = blockIdx.y == 0;
    const bf16_bits* er = emb ? table + (size_t)tokens[t] * D : nullptr;
    const float* hr = h + (size_t)t * h_stride;
    auto val = [&](int i) { return emb ? bf16_to_f32(er[i]) : hr[i]; };
    float ss = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) ss += val(i) * val(i);
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)D + eps);
    const float* w = emb ? we : wh;
    float* orow = out + (size_t)t * out_stride + (emb ? 0 : D);
    for (int i = threadIdx.x; i < D; i += blockDim.x) orow[i] = val(i) * inv * w[i];
}

// out[i, :] = x[rows[i], :].  Shapes: out [R, D], x [*, D], rows [R] (in range, host-built).
// Launch: grid (R), block 128.
extern "C" __global__ void gather_rows(float* __restrict__ out, const float* __restrict__ x,
                                       const int* __restrict__ rows, int R, int D) {
    pdl_enter();
    const int i = blockIdx.x;
    if (i >= R) return;
    const float* src = x + (size_t)rows[i] * D;
    for (int j = threadIdx.x; j < D; j += blockDim.x) out[(size_t)i * D + j] = src[j];
}

// out[r] = argmax_j logits[r, j] (lowest index among equal maxima).
// Shapes: logits [R, V] f32, out [R] u32.  Launch: grid (R), block 1024 (any multiple of 32).
extern "C" __global__ void argmax_rows(u32* __restrict__ out, const float* __restrict__ logits,
                                       int R, int V) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int r = blockIdx.x;
    if (r >= R) return;
    const float* row = logits + (size_t)r * V;
    float bv = -INFINITY;
    int bi = 0;
    // Four independent loads in flight per thread (a dependent load-merge chain made this
    // kernel latency-bound: 15.6 us for 8 rows of 8,200 at block 256, ncu 2026-12-02).
    const int bd = blockDim.x;
    int j = threadIdx.x;
    for (; j + 3 * bd < V; j += 4 * bd) {
        const float a0 = row[j], a1 = row[j + bd], a2 = row[j + 2 * bd], a3 = row[j + 3 * bd];
        argmax_merge(bv, bi, a0, j);
        argmax_merge(bv, bi, a1, j + bd);
        argmax_merge(bv, bi, a2, j + 2 * bd);
        argmax_merge(bv, bi, a3, j + 3 * bd);
    }
    for (; j < V; j += bd) argmax_merge(bv, bi, row[j], j);
    // A thread that saw nothing keeps (-inf, 0): it cannot beat a real -inf at index 0.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        argmax_merge(bv, bi, ov, oi);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) argmax_merge(bv, bi, sv[w], si[w]);
        out[r] = (u32)bi;
    }
}

// Copy `n` floats (a KDA state page range, a hidden snapshot): dst[i] = src[i].
// Launch: grid (ceil(n / 256)), block 256.
extern "C" __global__ void copy_f32(float* __restrict__ dst, const float* __restrict__ src,
                                    long long n) {
    pdl_enter();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

// Between two passes of the on-device MTP chain (cuda/src/mtp.rs): keep pass p's drafts
// (`keep[i] = argmax[i]`, i < S) and feed pass p + 1, whose chunk j continues chunk src[j]
// of pass p: `tokens[j] = argmax[src[j]]` (the next pass's input token, into its step
// metadata) and `hidden[j, :] = x[rows[j], :]` (the MTP layer's pre-norm hidden of that
// chunk's last row, EAGLE style). n = 0 only keeps. Shapes: argmax [S] u32, keep [S] u32,
// tokens [n] u32, idx [2n] i32 (rows then src, in range, host-built), x [*, D], hidden [n, D].
// Launch: grid (max(n, 1)), block 128.
extern "C" __global__ void mtp_feed(u32* __restrict__ keep, const u32* __restrict__ argmax,
                                    int S, u32* __restrict__ tokens, float* __restrict__ hidden,
                                    const float* __restrict__ x, const int* __restrict__ idx,
                                    int n, int D) {
    pdl_enter();
    const int j = blockIdx.x;
    if (j == 0)
        for (int i = threadIdx.x; i < S; i += blockDim.x) keep[i] = argmax[i];
    if (j >= n) return;
    if (threadIdx.x == 0) tokens[j] = argmax[idx[n + j]];
    const float* src = x + (size_t)idx[j] * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) hidden[(size_t)j * D + i] = src[i];
}

// The same copy in 16-byte words (`n4` float4s; both pointers 16-byte aligned), grid-stride
// so a bounded grid streams any size at full bandwidth. Launch: grid (<= 4 * SMs), block 256.
extern "C" __global__ void copy_f32x4(float4* __restrict__ dst, const float4* __restrict__ src,
                                      long long n4) {
    pdl_enter();
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride)
        dst[i] = src[i];
}

// Busy-wait `cycles` SM clock cycles (one thread). The profiler launches it first so the
// host enqueues a whole step behind it and the events between kernels time the GPU
// alone, not the host's launch gaps. Launch: grid 1, block 1.
extern "C" __global__ void spin_wait(long long cycles) {
    pdl_enter();
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
