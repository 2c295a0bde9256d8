// Full attention over the paged KV cache: RoPE + K/V write, then GQA attention.
//
// Source: docs/model.md §3 / §3.1 (Llama GQA, query head h uses KV head h / (nh / nkv);
// rotate-half RoPE over the whole head_dim with f64-built tables rounded to f32;
// scores (q . k) * d^-0.5, causal by absolute position), engine/src/model/attention.rs
// (the CPU reference), engine/src/model/kv_store.rs (the page layout, reproduced
// exactly on the device: block b of the pool starts at float b * fpb; attention layer a
// at + a * 2 * bs * nkv * d: K [bs, nkv, d] then V [bs, nkv, d]; position p of a request
// lives in block table[p / bs] at offset p % bs).  Prefill, decode and verify are the
// same kernels: a chunk's K/V are written first, then each token attends over
// positions 0 ..= pos[t] of its own sequence (rejected drafts' K/V are overwritten).
//
// Step metadata (cuda/src/meta.rs, uploaded once per step): pos [T], tok_seq [T]
// (the chunk of each token), block_tables [S, max_blocks] (the `full` group's tables,
// checked on the host to cover positions 0 ..= pos with real blocks).

#define ATT_WARPS 16
#define HEAD_DIM_MAX 128
// Positions a warp loads per pass of paged_attention (their table entries, keys and
// values all in flight before the first is folded).  8 since 2026-12-03 (4 before,
// SPECLAB_KERNEL_DEFINES=ATT_INFLIGHT=4 restores it): a decode row's context is walked
// by 16 serial strands, so at 256-384 positions each strand waited on 4-6 rounds of
// loads; the fold (and so every value) is the same at any setting.
#ifndef ATT_INFLIGHT
#define ATT_INFLIGHT 8
#endif

// Rotate q in place and write rotated k and v into the cache.
// Shapes: qkv [T, qkv_stride] f32 with q at column 0 ([nh, d]), k at nh * d ([nkv, d]),
// v at (nh + nkv) * d; cos_tab, sin_tab [max_pos, d] f32; kv the device pool (f32).
// Launch: grid (T), block 128.
extern "C" __global__ void rope_kv_write(float* __restrict__ qkv, int qkv_stride,
                                         const float* __restrict__ cos_tab,
                                         const float* __restrict__ sin_tab,
                                         const int* __restrict__ pos,
                                         const int* __restrict__ tok_seq,
                                         const int* __restrict__ block_tables, int max_blocks,
                                         float* __restrict__ kv, long long layer_off,
                                         long long fpb, int bs, int nh, int nkv, int d, int T) {
    pdl_enter();
    const int t = blockIdx.x;
    if (t >= T) return;
    const int half = d / 2;
    const int p = pos[t];
    const float* c = cos_tab + (size_t)p * d;
    const float* s = sin_tab + (size_t)p * d;
    float* row = qkv + (size_t)t * qkv_stride;
    const int blk = block_tables[(size_t)tok_seq[t] * max_blocks + p / bs];
    float* kdst = kv + (long long)blk * fpb + layer_off + (long long)(p % bs) * nkv * d;
    float* vdst = kdst + (long long)bs * nkv * d;
    // (head, i) pairs of q heads then k heads; element i and i + half of a head together.
    for (int idx = threadIdx.x; idx < (nh + nkv) * half; idx += blockDim.x) {
        const int hh = idx / half, i = idx % half;
        float* x = row + (size_t)hh * d;  // k heads follow the q heads in the row
        const float a = x[i], b = x[i + half];
        const float ra = a * c[i] + (-b) * s[i];
        const float rb = b * c[i + half] + a * s[i + half];
        if (hh < nh) {
            x[i] = ra;
            x[i + half] = rb;
        } else {
            float* kd = kdst + (size_t)(hh - nh) * d;
            kd[i] = ra;
            kd[i + half] = rb;
        }
    }
    const float* v = row + (size_t)(nh + nkv) * d;
    for (int i = threadIdx.x; i < nkv * d; i += blockDim.x) vdst[i] = v[i];
}

// o[t, h, :] = softmax_j((q[t,h] . K[j, h/G]) * scale) V[j, h/G] over j = 0 ..= pos[t].
// Shapes: q rows of qkv [T, qkv_stride] (columns [nh, d] at 0), o [T, nh * d].
// d % 32 == 0, d <= 128 (host-checked).  Online softmax per warp over positions
// j = warp, warp + 16, ..., merged across the 16 warps at the end (16 warps: a decode
// row walks its context in 16 interleaved strands, each a serial chain of loads).
// Launch: grid (T, nh), block 512 (ATT_WARPS warps).
extern "C" __global__ void paged_attention(float* __restrict__ o, const float* __restrict__ qkv,
                                           int qkv_stride, const float* __restrict__ kv,
                                           long long layer_off, long long fpb, int bs,
                                           const int* __restrict__ block_tables, int max_blocks,
                                           const int* __restrict__ pos,
                                           const int* __restrict__ tok_seq, int nh, int nkv,
                                           int d, float scale, int T) {
    pdl_enter();
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS];
    __shared__ float sm_acc[ATT_WARPS][HEAD_DIM_MAX];
    const int t = blockIdx.x, h = blockIdx.y;
    if (t >= T) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kvh = h / (nh / nkv);
    const int nc = d / 32;  // values per lane, <= 4
    const float* qrow = qkv + (size_t)t * qkv_stride + (size_t)h * d;
    float q[4], acc[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        q[c] = c < nc ? qrow[lane + 32 * c] : 0.0f;
        acc[c] = 0.0f;
    }
    const int* table = block_tables + (size_t)tok_seq[t] * max_blocks;
    const int n_ctx = pos[t] + 1;
    const long long half_page = (long long)bs * nkv * d;
    float m = -INFINITY, l = 0.0f;
    // ATT_INFLIGHT positions per warp per pass: their table entries, keys and values are
    // loaded first (all in flight), then folded into the online softmax one by one in
    // position order, so the arithmetic is exactly that of one position per pass.
    for (int j0 = warp; j0 < n_ctx; j0 += ATT_INFLIGHT * ATT_WARPS) {
        float kx[ATT_INFLIGHT][4], vx[ATT_INFLIGHT][4];
#pragma unroll
        for (int u = 0; u < ATT_INFLIGHT; ++u) {
            const int j = j0 + u * ATT_WARPS;
            if (j < n_ctx) {
                const float* kr = kv + (long long)table[j / bs] * fpb + layer_off +
                                  ((long long)(j % bs) * nkv + kvh) * d;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    kx[u][c] = c < nc ? kr[lane + 32 * c] : 0.0f;
                    vx[u][c] = c < nc ? kr[half_page + lane + 32 * c] : 0.0f;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < ATT_INFLIGHT; ++u) {
            if (j0 + u * ATT_WARPS >= n_ctx) break;  // warp-uniform
            float dot = 0.0f;
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (c < nc) dot += q[c] * kx[u][c];
            const float sc = warp_sum(dot) * scale;
            const float m_new = fmaxf(m, sc);
            const float corr = expf(m - m_new);
            const float pj = expf(sc - m_new);
            l = l * corr + pj;
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (c < nc) acc[c] = acc[c] * corr + pj * vx[u][c];
            m = m_new;
        }
    }
    if (lane == 0) { sm_m[warp] = m; sm_l[warp] = l; }
#pragma unroll
    for (int c = 0; c < 4; ++c)
        if (c < nc) sm_acc[warp][lane + 32 * c] = acc[c];
    __syncthreads();
    float mx = -INFINITY;
    for (int w = 0; w < ATT_WARPS; ++w) mx = fmaxf(mx, sm_m[w]);
    float denom = 0.0f;
    for (int w = 0; w < ATT_WARPS; ++w) denom += sm_l[w] * expf(sm_m[w] - mx);
    float* orow = o + ((size_t)t * nh + h) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float num = 0.0f;
        for (int w = 0; w < ATT_WARPS; ++w) num += sm_acc[w][i] * expf(sm_m[w] - mx);
        orow[i] = num / denom;
    }
}

// Prefill attention (chunks longer than a graph's, cuda/src/ops.rs `attention`): the same
// o[t, h, :] as paged_attention, a block for ATT_QB consecutive query rows of one chunk
// and one head, so each K/V position is loaded once for the tile (paged_attention loads it
// once a row).  Warp w owns query row w of the tile; the tile walks keys 0 ..= the pos of
// its last row in tiles of ATT_KB positions staged in shared memory (K rows padded to
// d + 1 floats: lane j reads key j's row without bank conflicts).  Per key tile a warp
// takes lane j's score for key j (masked past its row's pos), the tile's max, and folds
// the tile into its online softmax (FlashAttention's rescaling, Dao et al. 2022, in f32:
// m, l, and lane c's accumulators of output elements c, c + 32, ..).  The sums run in
// another order than paged_attention's 16 strands: equal within rounding, not bit for bit.
// Shapes as paged_attention's; row0 [S], len [S] (meta).
// Launch: grid (ceil(max chunk len / ATT_QB), S, nh), block 32 * ATT_QB.
#define ATT_QB 16
#define ATT_KB 32
extern "C" __global__ void __launch_bounds__(32 * ATT_QB) prefill_attention(
    float* __restrict__ o, const float* __restrict__ qkv, int qkv_stride,
    const float* __restrict__ kv, long long layer_off, long long fpb, int bs,
    const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ pos,
    const int* __restrict__ row0, const int* __restrict__ len, int nh, int nkv, int d,
    float scale) {
    pdl_enter();
    __shared__ float sk[ATT_KB][HEAD_DIM_MAX + 1];
    __shared__ float sv[ATT_KB][HEAD_DIM_MAX];
    __shared__ float sq[ATT_QB][HEAD_DIM_MAX];
    const int s = blockIdx.y, h = blockIdx.z;
    const int n = len[s], r0 = blockIdx.x * ATT_QB;
    if (r0 >= n) return;
    const int nr = min(ATT_QB, n - r0), base = row0[s] + r0;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kvh = h / (nh / nkv), nc = d / 32;
    const bool live = warp < nr;
    const int t = base + warp;
    const int p = live ? pos[t] : -1;
    const int p_last = pos[base + nr - 1];
    for (int i = lane; i < d; i += WARP)
        sq[warp][i] = live ? qkv[(size_t)t * qkv_stride + (size_t)h * d + i] : 0.0f;
    const int* table = block_tables + (size_t)s * max_blocks;
    const long long half_page = (long long)bs * nkv * d;
    float m = -INFINITY, l = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int j0 = 0; j0 <= p_last; j0 += ATT_KB) {
        __syncthreads();  // the last tile read (and, the first time, sq written)
        for (int e = threadIdx.x; e < ATT_KB * d; e += blockDim.x) {
            const int jj = e / d, i = e % d, j = j0 + jj;
            float kx = 0.0f, vx = 0.0f;
            if (j <= p_last) {
                const float* kr = kv + (long long)table[j / bs] * fpb + layer_off +
                                  ((long long)(j % bs) * nkv + kvh) * d;
                kx = kr[i];
                vx = kr[half_page + i];
            }
            sk[jj][i] = kx;
            sv[jj][i] = vx;
        }
        __syncthreads();
        if (!live || j0 > p) continue;  // warp-uniform; every warp still meets each barrier
        const int j = j0 + lane;
        float sc = -INFINITY;
        if (j <= p) {
            float dot = 0.0f;
            for (int i = 0; i < d; ++i) dot += sq[warp][i] * sk[lane][i];
            sc = dot * scale;
        }
        const float m_new = fmaxf(m, warp_max(sc));
        const float corr = expf(m - m_new);
        const float pj = j <= p ? expf(sc - m_new) : 0.0f;
        l = l * corr + warp_sum(pj);
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[c] *= corr;
        const int kn = min(ATT_KB, p - j0 + 1);
        for (int jj = 0; jj < kn; ++jj) {
            const float pv = __shfl_sync(FULL_MASK, pj, jj);
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (c < nc) acc[c] += pv * sv[jj][lane + 32 * c];
        }
        m = m_new;
    }
    if (!live) return;
    float* orow = o + ((size_t)t * nh + h) * d;
#pragma unroll
    for (int c = 0; c < 4; ++c)
        if (c < nc) orow[lane + 32 * c] = acc[c] / l;
}
