// speclab CUDA prelude: prepended to every kernel source by cuda/src/kernels.rs.
//
// Self-contained on purpose: no include directive at all, so NVRTC needs no CUDA headers (no
// cuda_bf16.h / cuda_fp16.h): bf16 values travel as their 16-bit patterns and are
// widened by a shift, which is exact (docs/model.md §1.1: bf16 -> f32 is exact).
// Numerics (docs/model.md §1): all arithmetic is f32; no fast-math intrinsics
// (expf/logf/sqrtf are the IEEE-accurate library versions).

typedef unsigned short bf16_bits;
typedef unsigned int u32;

#define WARP 32
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float bf16_to_f32(bf16_bits b) {
    return __uint_as_float(((u32)b) << 16);
}

// The low (element 0) and high (element 1) bf16 of a 32-bit word, widened.
__device__ __forceinline__ float bf16lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// docs/model.md §1 elementwise functions.
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu_f(float x) { return x * sigmoid_f(x); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : logf(1.0f + expf(x)); }

// Sum of one value per thread over a block of `nthreads` (a multiple of 32, <= 1024).
// `scratch` holds >= 32 floats of shared memory. Every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = 0.0f;
    for (int w = 0; w < nwarps; ++w) t += scratch[w];
    return t;
}

// Two block sums in one exchange: ta = block_sum(a), tb = block_sum(b) bit for bit (the
// same warp partials added in the same order), with two barriers instead of four.
// `scratch` holds >= 32 floats; blockDim.x <= 512.
__device__ __forceinline__ void block_sum2(float a, float b, float* scratch, float& ta,
                                           float& tb) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) {
        scratch[warp] = a;
        scratch[16 + warp] = b;
    }
    __syncthreads();
    ta = 0.0f;
    tb = 0.0f;
    for (int w = 0; w < nwarps; ++w) {
        ta += scratch[w];
        tb += scratch[16 + w];
    }
}

// (value, index) arg-max step: larger value wins, equal values go to the lower index,
// NaN never wins (every comparison with NaN is false). docs/model.md §1.7.
__device__ __forceinline__ void argmax_merge(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

// lop3.b32 with an immediate truth table (Marlin's `lop3<lut>`, vLLM
// csrc/quantization/gptq_marlin/dequant.h): (a & b) | c is lut 0xEA.
__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 b, u32 c) {
    u32 r;
    // Not volatile: a pure function of its inputs, so the compiler may schedule it freely.
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}


// ---------------------------------------------------------------------------------------
// Split activations, the B operand of the INT4 expert GEMMs (linear.cu, issue 12): each f32
// value as W4_XS bf16 terms in mma B-fragment order.  Here because moe.cu's fused router
// writes them too (models/tiny: no separate launch).
// bf16 terms an activation is split into: 3 exact, 2 = 16 significant bits, 1 = the
// activation rounded to bf16, the A16 of W4A16 as vLLM's Marlin MoE takes it (bf16 / fp16
// activations, csrc/moe/marlin_moe_wna16/; the intermediate h rounded to bf16 too).
// Tunable at NVRTC time: SPECLAB_KERNEL_DEFINES, cuda/README.md.
#ifndef W4_XS
#define W4_XS 3
#endif


// bf16x2 {lo, hi} (round to nearest even).
__device__ __forceinline__ u32 pack_bf2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// The W4_XS bf16x2 terms of the f32 pair (a, b): t[0] + t[1] (+ t[2]) = (a, b).
__device__ __forceinline__ void split_bf2(float a, float b, u32 t[W4_XS]) {
#pragma unroll
    for (int i = 0; i < W4_XS; ++i) {
        t[i] = pack_bf2(a, b);
        a -= bf16lo(t[i]);
        b -= bf16hi(t[i]);
    }
}

// An activation as the INT4 expert GEMMs see it: exact for W4_XS >= 2 up to the dropped
// terms, rounded to bf16 (nearest even) for W4_XS 1.  The f64 references (bench.cu) apply
// it so they compute the kernels' function.
__device__ __forceinline__ float w4_act(float v) {
#if W4_XS == 1
    return bf16lo(pack_bf2(v, 0.0f));
#else
    return v;
#endif
}

// u32 index of the split activations of element k of row p (rows of K elements): per
// (row, k16 step, lane-in-group t) 2 W4_XS words, term x's pair at 2 x + (k % 16 >= 8),
// element k % 2 in the pair's half.  The h buffer of P rows holds P K W4_XS / 2 words.
__device__ __forceinline__ size_t w4_h_word(int p, int k, int K, int x) {
    const int kk = k & 15;
    return (((size_t)p * (K / 16) + k / 16) * 4 + (kk & 7) / 2) * (2 * W4_XS) + 2 * x + kk / 8;
}

// Item i = (k16 step i / 4, lane-in-group i % 4) of row `row` (f32 values xr, K of them,
// 8-byte aligned): its four values (2t, 2t + 1, 2t + 8, 2t + 9) split into xs.
__device__ __forceinline__ void w4_split_item(u32* __restrict__ xs, const float* __restrict__ xr,
                                              int row, int K, int i) {
    const int s = i / 4, t = i % 4;
    const float2 lo = *reinterpret_cast<const float2*>(xr + s * 16 + 2 * t);
    const float2 hi = *reinterpret_cast<const float2*>(xr + s * 16 + 2 * t + 8);
    u32 a[W4_XS], c[W4_XS];
    split_bf2(lo.x, lo.y, a);
    split_bf2(hi.x, hi.y, c);
    u32* d = xs + w4_h_word(row, s * 16 + 2 * t, K, 0);
#pragma unroll
    for (int j = 0; j < W4_XS; ++j) {
        d[2 * j] = a[j];
        d[2 * j + 1] = c[j];
    }
}

// 8 consecutive bf16 weights (one 16-byte load) widened to f32.
__device__ __forceinline__ void widen8(uint4 v, float out[8]) {
    out[0] = bf16lo(v.x); out[1] = bf16hi(v.x);
    out[2] = bf16lo(v.y); out[3] = bf16hi(v.y);
    out[4] = bf16lo(v.z); out[5] = bf16hi(v.z);
    out[6] = bf16lo(v.w); out[7] = bf16hi(v.w);
}

// 8 consecutive f32 activations (two 16-byte loads; the address is 16-byte aligned).
__device__ __forceinline__ void load8(const float* p, float out[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

// Programmatic dependent launch (Hopper, sm_90+; CUDA C++ Programming Guide, "Programmatic
// Dependent Launch and Synchronization"; PTX ISA `griddepcontrol`): every entry point
// first waits until the grid before it in the stream has completed and its writes are
// visible, then lets the next grid launch, so that grid's launch and block dispatch
// overlap this one's run instead of following its completion. Nothing is read or written
// before the wait, so a kernel launched this way sees exactly what a plainly launched one
// sees (and the wait is transitive: the grid before completed only after its own wait).
// Both instructions are no-ops for a launch without the attribute (cuda/src/ops.rs
// `launch`).
__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
