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

// Per-group constants of the INT4 dequantization (issue 12), from the bf16 group scale s:
// c_b = s * 2^(16 - b) and k_b = 128 c_b + 8 s for nibble bit positions b = 16, 12, 8.
// Every product is exact in f32: s has 8 significant bits and 136, 2056, 32776 span 5,
// 9 and 13 bits (so no constant needs more than 21 bits).
struct W4Scale {
    float c16, c12, c8, k16, k12, k8;
};
__device__ __forceinline__ W4Scale w4_scale(float s) {
    return W4Scale{s, s * 16.0f, s * 256.0f, s * 136.0f, s * 2056.0f, s * 32776.0f};
}

// One nibble at bits [b, b + 4) of `a` placed in the mantissa of f32 128.0 (0x43000000) by
// one lop3 gives v = 128 + n 2^(b - 16) exactly; fma(v, c_b, -k_b) is then exactly
// (n - 8) s = q s (the fused product is exact and the result is representable), so one
// LOP3 + one FFMA per weight, versus shift + lop3 + widen + sub + mul before.
__device__ __forceinline__ float w4_at(u32 a, u32 mask, float c, float k) {
    return fmaf(__uint_as_float(lop3_and_or(a, mask, 0x43000000u)), c, -k);
}

// Dequantize one repacked INT4 word (cuda/src/repack.rs: nibble slot s holds element
// INTERLEAVE[s] = [0,2,4,6,1,3,5,7][s], stored as q + 8) into 8 f32 weights q * scale in
// natural element order, exactly (docs/model.md §1.3). The three views r << 8, r, r >> 12
// put every slot at bit 8, 12 or 16, the positions whose constants are exact (w4_scale).
// Host model: repack::dequant8_model (tested bit for bit against the CPU's unpack_nibble).
__device__ __forceinline__ void dequant8(u32 r, const W4Scale& s, float out[8]) {
    const u32 a = r << 8, c = r >> 12;
    out[0] = w4_at(a, 0x00000f00u, s.c8, s.k8);   // slot 0
    out[2] = w4_at(a, 0x0000f000u, s.c12, s.k12); // slot 1
    out[4] = w4_at(r, 0x00000f00u, s.c8, s.k8);   // slot 2
    out[6] = w4_at(r, 0x0000f000u, s.c12, s.k12); // slot 3
    out[1] = w4_at(r, 0x000f0000u, s.c16, s.k16); // slot 4
    out[3] = w4_at(c, 0x00000f00u, s.c8, s.k8);   // slot 5
    out[5] = w4_at(c, 0x0000f000u, s.c12, s.k12); // slot 6
    out[7] = w4_at(c, 0x000f0000u, s.c16, s.k16); // slot 7
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
