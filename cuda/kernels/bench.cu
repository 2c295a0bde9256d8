// Benchmark support for `speclab bench moe` (issue 12, cuda/src/moebench.rs): seeded
// dummy weights generated on the device, and a naive reference of the INT4 routed experts.
//
// Weights: a counter-based hash (lowbias32, Chris Wellons' hash-prospector) of (seed,
// element index), so several GB of a GLM-5.3-Flash layer appear in milliseconds instead of
// a host upload, and the same seed gives the same layer on every run.  Any 32-bit word is a
// valid repacked INT4 word (8 nibbles q + 8), so words are raw hashes.
//
// Reference: one warp per (checked pair, output column), the most literal reading of the
// layout (cuda/src/repack.rs; ref_w4 below), sums in f64 of f64 activations.  Independent
// of moe_align's tiles, of the tuned kernels' mma fragments, split activations and
// dequantization trick.

__device__ __forceinline__ u32 lowbias32(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

__device__ __forceinline__ u32 hash2(u32 seed, unsigned long long i) {
    return lowbias32((u32)i ^ lowbias32((u32)(i >> 32) ^ lowbias32(seed)));
}

// Uniform in [0, 1) from the top 24 bits.
__device__ __forceinline__ float unit_f(u32 h) { return (float)(h >> 8) * (1.0f / 16777216.0f); }

// out[i] = hash(seed, i).  Shapes: out [n].  Launch: grid-stride, any grid, block 256.
extern "C" __global__ void bench_fill_u32(u32* __restrict__ out, long long n, u32 seed) {
    pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = hash2(seed, (unsigned long long)i);
}

// bf16 bits of base * (1 + u) (positive: INT4 group scales) when `positive`, else of
// base * (2u - 1) (dense bf16 weights), truncated to bf16.  Shapes: out [n].
// Launch: grid-stride, block 256.
extern "C" __global__ void bench_fill_bf16(bf16_bits* __restrict__ out, long long n, u32 seed,
                                           float base, int positive) {
    pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float u = unit_f(hash2(seed, (unsigned long long)i));
        const float v = positive ? base * (1.0f + u) : base * (2.0f * u - 1.0f);
        out[i] = (bf16_bits)(__float_as_uint(v) >> 16);
    }
}

// out[i] = lo + (hi - lo) * u.  Shapes: out [n].  Launch: grid-stride, block 256.
extern "C" __global__ void bench_fill_f32(float* __restrict__ out, long long n, u32 seed,
                                          float lo, float hi) {
    pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = lo + (hi - lo) * unit_f(hash2(seed, (unsigned long long)i));
}

// Weight k of row `row` of expert e's repacked INT4 matrix (R rows of K), literally
// (cuda/src/repack.rs, "the device INT4 layout"): row block row / 64, mma tile i = row % 64
// / 16, fragment row g = row % 8 (h = row % 16 / 8 picks g or g + 8); k16 step k / 16,
// lane-in-group t = k % 8 / 2, register j = h + 2 (k % 16 / 8), half e = k % 2; the word of
// lane 4 g + t and tile i, nibble slot j + 4 e, minus 8, times the bf16 scale of group
// k / 128 at [e, row block, group, g, 2 i + h].
__device__ __forceinline__ double ref_w4(const u32* __restrict__ q, const bf16_bits* __restrict__ s,
                                         size_t e, int R, int row, int K, int k) {
    const size_t rb = e * (size_t)(R / 64) + row / 64;
    const int i = row % 64 / 16, h = row % 16 / 8, g = row % 8;
    const int kk = k % 16, t = kk % 8 / 2, j = h + 2 * (kk / 8), el = kk % 2;
    const u32 word = q[((rb * (K / 16) + k / 16) * 32 + 4 * g + t) * 4 + i];
    const int qv = (int)((word >> (4 * (j + 4 * el))) & 0xFu) - 8;
    const bf16_bits sc = s[((rb * (K / 128) + k / 128) * 8 + g) * 8 + 2 * i + h];
    return (double)qv * (double)bf16_to_f32(sc);
}

// Row of the fused gate/up matrix holding matrix m (0 gate, 1 up) of output column n: tile
// rows g hold gates, g + 8 ups of columns 32 (row / 64) + 8 (row % 64 / 16) + g.
__device__ __forceinline__ int ref_gate_up_row(int n, int m) {
    return n / 32 * 64 + n % 32 / 8 * 16 + m * 8 + n % 8;
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// h_ref[i, n] = silu(g) * u for checked pair p = pairs[i] (expert ids[p], token p / topk),
// g / u = x[token] . Wg / Wu of column n, in f64.  act 1: x and h as the kernels see them
// (w4_act: rounded to bf16 at W4_XS 1), the kernels' function; act 0: the exact f32 model.
// Shapes: h_ref [npairs, N] f32, x [T, K], q13 / s13 in the device INT4 layout (2N rows),
// ids [P], pairs [npairs].
// Launch: grid (ceil(N / 4), npairs), block 128.
extern "C" __global__ void moe_ref_gate_up_w4(float* __restrict__ h_ref,
                                              const float* __restrict__ x,
                                              const u32* __restrict__ q13,
                                              const bf16_bits* __restrict__ s13,
                                              const int* __restrict__ ids,
                                              const int* __restrict__ pairs, int topk, int N,
                                              int K, int act) {
    pdl_enter();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * 4 + warp;
    if (n >= N) return;
    const int i = blockIdx.y;
    const int p = pairs[i];
    const size_t e = (size_t)ids[p];
    const float* xr = x + (size_t)(p / topk) * K;
    double g = 0.0, u = 0.0;
    for (int k = lane; k < K; k += WARP) {
        const double xv = act ? w4_act(xr[k]) : xr[k];
        g += xv * ref_w4(q13, s13, e, 2 * N, ref_gate_up_row(n, 0), K, k);
        u += xv * ref_w4(q13, s13, e, 2 * N, ref_gate_up_row(n, 1), K, k);
    }
    g = warp_sum_d(g);
    u = warp_sum_d(u);
    const float h = (float)(g / (1.0 + exp(-g)) * u);
    if (lane == 0) h_ref[(size_t)i * N + n] = act ? w4_act(h) : h;
}

// y_ref[i, n] = wts[p] * (h_ref[i] . Wd[ids[p], n]) in f64.  Shapes: y_ref [npairs, N],
// h_ref [npairs, K], qd / sd in the device INT4 layout (N rows), wts / ids [P], pairs [npairs].
// Launch: grid (ceil(N / 4), npairs), block 128.
extern "C" __global__ void moe_ref_down_w4(float* __restrict__ y_ref,
                                           const float* __restrict__ h_ref,
                                           const u32* __restrict__ qd,
                                           const bf16_bits* __restrict__ sd,
                                           const float* __restrict__ wts,
                                           const int* __restrict__ ids,
                                           const int* __restrict__ pairs, int N, int K) {
    pdl_enter();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * 4 + warp;
    if (n >= N) return;
    const int i = blockIdx.y;
    const int p = pairs[i];
    const float* hr = h_ref + (size_t)i * K;
    double acc = 0.0;
    for (int k = lane; k < K; k += WARP)
        acc += (double)hr[k] * ref_w4(qd, sd, (size_t)ids[p], N, n, K, k);
    acc = warp_sum_d(acc);
    if (lane == 0) y_ref[(size_t)i * N + n] = (float)((double)wts[p] * acc);
}
