// KDA (Kimi Delta Attention): short conv + SiLU, the gated delta rule, the gated output norm.
//
// Source: docs/model.md §4 (vLLM / fla `fused_recurrent_kda` with
// use_qk_l2norm_in_kernel, the fused gate, sigmoid beta), engine/src/model/kda.rs (the
// CPU reference: same per-token order of operations, same state passes).
// State pages (engine/src/model/kv_store.rs layout, reproduced on the device): KDA
// layer l of pool block b starts at float b * fpb + l * state_page: conv windows
// [3 (q, k, v), kc - 1, C] (pre-conv inputs, oldest first) then S [nl, dl (key), dl
// (value)].  A chunk at start_pos 0 starts from zeros, otherwise from its state block
// table[0]; the state after its last token goes to table[0]; with `snapshot` the
// state after token t < len - 1 also goes to table[t + 1] (one snapshot per speculative
// position; rollback = cuda/src/backend.rs commit_state copying table[accepted + 1]).
// Tokens of a chunk are sequential (the recurrence); chunks run in parallel.
//
// Step metadata (cuda/src/meta.rs): per chunk s: row0[s] (first row in the batch),
// len[s], pos0[s] (start position), snap[s] (0/1); state_tables [S, max_state].

#define KC_MAX 8

// Causal depthwise conv + SiLU of the q, k, v projections with conv-state update.
// Shapes: xin [T, xin_stride] (columns [0, 3C): pre-conv q | k | v), taps [3C, kc] f32,
// y [T, 3C] (post-SiLU).  kc <= 8 (host-checked).
// Launch: grid (ceil(3C / 128), S), block 128.
// Block (bx, s) of kda_conv's grid (calls pdl_enter).
__device__ __forceinline__ void kda_conv_block(float* __restrict__ y, const float* __restrict__ xin,
                                               int xin_stride, const float* __restrict__ taps,
                                               float* __restrict__ pool, long long layer_off,
                                               long long fpb, int C, int kc,
                                               const int* __restrict__ row0,
                                               const int* __restrict__ len,
                                               const int* __restrict__ pos0,
                                               const int* __restrict__ snap,
                                               const int* __restrict__ state_tables,
                                               int max_state, int bx, int s) {
    pdl_enter();
    const int c3 = bx * blockDim.x + threadIdx.x;
    if (c3 >= 3 * C) return;
    const int which = c3 / C, c = c3 % C;
    const int* table = state_tables + (size_t)s * max_state;
    // conv element (which, j, c) of a page: (which * (kc - 1) + j) * C + c.
    const long long elem0 = (long long)which * (kc - 1) * C + c;
    float win[KC_MAX - 1];
    float* page0 = pool + (long long)table[0] * fpb + layer_off;
#pragma unroll
    for (int j = 0; j < KC_MAX - 1; ++j)
        win[j] = (j < kc - 1 && pos0[s] > 0) ? page0[elem0 + (long long)j * C] : 0.0f;
    const float* w = taps + (size_t)c3 * kc;
    const int n = len[s];
    for (int t = 0; t < n; ++t) {
        const size_t row = (size_t)(row0[s] + t);
        const float xt = xin[row * xin_stride + c3];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < KC_MAX - 1; ++j)
            if (j < kc - 1) acc += w[j] * win[j];
        acc += w[kc - 1] * xt;
        y[row * 3 * C + c3] = silu_f(acc);
#pragma unroll
        for (int j = 0; j < KC_MAX - 2; ++j)
            if (j < kc - 2) win[j] = win[j + 1];
#pragma unroll
        for (int j = 0; j < KC_MAX - 1; ++j)
            if (j == kc - 2) win[j] = xt;
        if (snap[s] && t + 1 < n) {
            float* pg = pool + (long long)table[t + 1] * fpb + layer_off;
#pragma unroll
            for (int j = 0; j < KC_MAX - 1; ++j)
                if (j < kc - 1) pg[elem0 + (long long)j * C] = win[j];
        }
    }
#pragma unroll
    for (int j = 0; j < KC_MAX - 1; ++j)
        if (j < kc - 1) page0[elem0 + (long long)j * C] = win[j];
}

extern "C" __global__ void kda_conv(float* __restrict__ y, const float* __restrict__ xin,
                                    int xin_stride, const float* __restrict__ taps,
                                    float* __restrict__ pool, long long layer_off,
                                    long long fpb, int C, int kc,
                                    const int* __restrict__ row0, const int* __restrict__ len,
                                    const int* __restrict__ pos0, const int* __restrict__ snap,
                                    const int* __restrict__ state_tables, int max_state) {
    kda_conv_block(y, xin, xin_stride, taps, pool, layer_off, fpb, C, kc, row0, len, pos0,
                   snap, state_tables, max_state, blockIdx.x, blockIdx.y);
}

// Gated delta rule for one (head, chunk): thread j owns column j (value index) of
// S [dl (key i), dl (value j)] in registers.  Per token (docs/model.md §4, the CPU's two
// fused passes, each sum ascending in i from 0):
//   pass 1: S[i, j] *= alpha_i;  acc += S[i, j] * k_i;       u_j = v_j - acc
//   pass 2: S[i, j] += beta * (k_i * u_j);  o_j += S[i, j] * q_i
// with q = l2norm(q) * dl^-0.5, k = l2norm(k), alpha_i = exp(-exp(A_log[h]) *
// softplus(f_i + dt_bias_i)), beta = sigmoid(b[h]).
// Shapes: y [T, 3C] (post-conv q | k | v), fg [T, 2C] (f at column 0), xin [T, xin_stride]
// (b at column b_col, [nl]), A_log [nl], dt_bias [C], o [T, C].
//
// FUSED (kernel kda_fused_{DL}): the layer's three launches in one. Thread j also runs
// kda_conv for its channels of head h (q, k, v at column h * DL + j of each third), from
// the pre-conv xin, its windows in registers (same taps order, same page layout, the
// same snapshots), so y is neither written nor read; and each token's output gets
// kda_gate_norm right after the token (the head's DL outputs through shared memory, every
// warp taking the same lane-strided sums and warp_sum as kda_gate_norm's one warp), so o
// is not written either.  Every value is computed by the same operations in the same
// order as the three kernels.
// Extra shapes: taps [3C, kc] f32, o_norm [DL], out [T, C].
// FUSED with wf / wg not null: the f / g low-rank up-projections too (linear_pair's work:
// f = xin[:, fcol .. fcol + DL) Wf^T, g = xin[:, fcol + DL .. fcol + 2 DL) Wg^T, Wf / Wg
// [C, DL] bf16): thread j computes column h DL + j of both for each token, bit for bit
// linear_pair_tiled_bf16 (lowrank_dot), in place of the fg reads; fg is neither read nor
// written.  The weight rows are prefetched into L2 before the grid-dependency wait
// (constant), and later tokens find them in L1.
// Lane l of linear_pair_tiled_bf16 sums k word l (8 products, in order, from zero) and
// the 32 lane partials meet in warp_sum's xor butterfly (16, 8, 4, 2, 1): lane 0's value
// of that tree, with the lanes past K / 8 contributing +0 as there.
template <int DL>
__device__ __forceinline__ float lowrank_dot(const float* x, const uint4* __restrict__ w) {
    static_assert(DL / 8 <= WARP && WARP == 32, "one k word a lane, a 32-lane butterfly");
    float v[WARP];
#pragma unroll
    for (int l = 0; l < WARP; ++l) v[l] = 0.0f;
#pragma unroll
    for (int kw = 0; kw < DL / 8; ++kw) {
        float wv[8];
        widen8(__ldg(w + kw), wv);
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc += x[8 * kw + i] * wv[i];
        v[kw] = acc;
    }
#pragma unroll
    for (int l = 0; l < 16; ++l) v[l] = v[l] + v[l + 16];
#pragma unroll
    for (int l = 0; l < 8; ++l) v[l] = v[l] + v[l + 8];
#pragma unroll
    for (int l = 0; l < 4; ++l) v[l] = v[l] + v[l + 4];
#pragma unroll
    for (int l = 0; l < 2; ++l) v[l] = v[l] + v[l + 2];
    return v[0] + v[1];
}

// Item `it` of the f / g up-projections (linear_pair's work, for the verify pair): row
// it / 2, f (it even, xin columns fcol ..) or g (odd, fcol + DL ..) into fg's half of that
// row, every column c < C by its own thread (block-strided) with lowrank_dot's sums.
template <int DL>
__device__ __forceinline__ void lowrank_block(float* __restrict__ fg, const float* __restrict__ xin,
                                              int xin_stride, int fcol,
                                              const bf16_bits* __restrict__ wf,
                                              const bf16_bits* __restrict__ wg, int C, int it) {
    __shared__ float lx[DL];
    const int row = it / 2, which = it % 2;
    pdl_enter();
    for (int i = threadIdx.x; i < DL; i += blockDim.x)
        lx[i] = xin[(size_t)row * xin_stride + fcol + which * DL + i];
    __syncthreads();
    const bf16_bits* w = which ? wg : wf;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        fg[(size_t)row * 2 * C + (size_t)which * C + c] =
            lowrank_dot<DL>(lx, reinterpret_cast<const uint4*>(w + (size_t)c * DL));
}

// NORM (implied by FUSED; kernel kda_recurrent_norm_{DL} without FUSED): the per-token
// gated norm above, from the post-conv y and fg's g; o is not written.
template <int DL, bool FUSED, bool NORM = FUSED>
__device__ __forceinline__ void kda_recurrent_impl(
    float* __restrict__ o, const float* __restrict__ y, float* __restrict__ fg,
    const float* __restrict__ xin, int xin_stride, int b_col, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ pool, long long layer_off,
    long long fpb, int conv_len, int nl, float qscale, const int* __restrict__ row0,
    const int* __restrict__ len, const int* __restrict__ pos0, const int* __restrict__ snap,
    const int* __restrict__ state_tables, int max_state, const float* __restrict__ taps,
    int kc, float* __restrict__ gated, const float* __restrict__ o_norm, float eps,
    const bf16_bits* __restrict__ wf, const bf16_bits* __restrict__ wg, int fcol, int pre) {
    __shared__ float qs[DL], ks[DL], al[DL];
    __shared__ float scratch[32];
    __shared__ float lr[2][DL];  // the token's f / g low-rank inputs (lowrank)
    __shared__ float os[DL];     // the token's outputs of this head (FUSED: the gated norm)
    const int h = blockIdx.x, s = blockIdx.y, j = threadIdx.x;
    const int C = nl * DL;
    const bool lowrank = FUSED && wf != nullptr;
    const size_t wrow = (size_t)(h * DL + j) * DL;  // this thread's row of Wf / Wg
    const uint4* wfp = lowrank ? reinterpret_cast<const uint4*>(wf + wrow) : nullptr;
    const uint4* wgp = lowrank ? reinterpret_cast<const uint4*>(wg + wrow) : nullptr;
    // The thread's f and g weight rows (DL bf16 each) are fetched into L2 before the wait
    // (held in registers they spilled the recurrence's state); read at use.
    if (lowrank) {
#pragma unroll
        for (int b = 0; b < DL * 2; b += 128) {
            asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(wfp) + b));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(wgp) + b));
        }
    }
    if (!pre) pdl_enter();
    // With `pre` the state, conv windows and chunk metadata are read before the
    // grid-dependency wait: the host wrote the metadata before the step, and this layer's
    // state pages were last written by an earlier step's kernels (or the rollback copies
    // between steps), which completed before the grid before this one passed its own wait
    // and triggered this launch (common.cuh pdl_enter: every kernel waits, then triggers).
    // Only the projections (xin, fg, y) are the previous grids' outputs: read after it.
    const int* table = state_tables + (size_t)s * max_state;
    const long long head_off = layer_off + conv_len + (long long)h * DL * DL + j;
    float st[DL];
    const float* page0 = pool + (long long)table[0] * fpb + head_off;
    const bool fresh = pos0[s] == 0;
#pragma unroll
    for (int i = 0; i < DL; ++i) st[i] = fresh ? 0.0f : page0[(long long)i * DL];
    const float neg_a = -expf(a_log[h]);
    const float dtb = dt_bias[h * DL + j];
    const int n = len[s];
    // FUSED: the conv windows and taps of the thread's q, k, v channels (kda_conv's).
    float win[3][KC_MAX - 1], tap[3][KC_MAX];
    float* conv0 = pool + (long long)table[0] * fpb + layer_off;
    if (FUSED) {
#pragma unroll
        for (int w = 0; w < 3; ++w) {
            const long long elem0 = (long long)w * (kc - 1) * C + h * DL + j;
#pragma unroll
            for (int q = 0; q < KC_MAX - 1; ++q)
                win[w][q] = (q < kc - 1 && !fresh) ? conv0[elem0 + (long long)q * C] : 0.0f;
#pragma unroll
            for (int q = 0; q < KC_MAX; ++q)
                tap[w][q] = q < kc ? taps[(size_t)(w * C + h * DL + j) * kc + q] : 0.0f;
        }
    }
    // kda_conv's step for window w: the output for input xt, then the window shifted.
    auto conv = [&](int w, float xt) {
        float acc = 0.0f;
#pragma unroll
        for (int q = 0; q < KC_MAX - 1; ++q)
            if (q < kc - 1) acc += tap[w][q] * win[w][q];
#pragma unroll
        for (int q = 0; q < KC_MAX; ++q)
            if (q == kc - 1) acc += tap[w][q] * xt;
#pragma unroll
        for (int q = 0; q < KC_MAX - 2; ++q)
            if (q < kc - 2) win[w][q] = win[w][q + 1];
#pragma unroll
        for (int q = 0; q < KC_MAX - 1; ++q)
            if (q == kc - 2) win[w][q] = xt;
        return silu_f(acc);
    };
    auto conv_store = [&](float* page) {
#pragma unroll
        for (int w = 0; w < 3; ++w) {
            const long long elem0 = (long long)w * (kc - 1) * C + h * DL + j;
#pragma unroll
            for (int q = 0; q < KC_MAX - 1; ++q)
                if (q < kc - 1) page[elem0 + (long long)q * C] = win[w][q];
        }
    };
    // Token t + 1's inputs are loaded while token t computes (a verify chunk's tokens
    // otherwise each wait out the loads' latency); the two norms share one reduction
    // (block_sum2: the same partial sums in the same order as two block_sums).
    float nq = 0.0f, nk = 0.0f, nv = 0.0f, nf = 0.0f, nb = 0.0f, ng = 0.0f;
    auto load = [&](int t) {
        const size_t row = (size_t)(row0[s] + t);
        const float* yr = FUSED ? xin + row * xin_stride + h * DL + j : y + row * 3 * C + h * DL + j;
        nq = yr[0];
        nk = yr[C];
        nv = yr[2 * C];
        nf = lowrank ? 0.0f : fg[row * 2 * C + h * DL + j];  // lowrank: computed below
        if (NORM) ng = lowrank ? 0.0f : fg[row * 2 * C + C + h * DL + j];
        nb = xin[row * xin_stride + b_col + h];
    };
    if (pre) pdl_enter();
    if (n > 0) load(0);
    for (int t = 0; t < n; ++t) {
        const size_t row = (size_t)(row0[s] + t);
        float qv = nq, kv = nk, vv = nv;
        float fv = nf, gv = ng;
        const float bv = nb;
        if (t + 1 < n) load(t + 1);
        if (lowrank) {
            const float* xr = xin + row * xin_stride + fcol;
            lr[0][j] = xr[j];
            lr[1][j] = xr[DL + j];
            __syncthreads();
            fv = lowrank_dot<DL>(lr[0], wfp);
            gv = lowrank_dot<DL>(lr[1], wgp);
        }
        if (FUSED) {
            qv = conv(0, qv);
            kv = conv(1, kv);
            vv = conv(2, vv);
            if (snap[s] && t + 1 < n) conv_store(pool + (long long)table[t + 1] * fpb + layer_off);
        }
        float ssq, ssk;
        block_sum2(qv * qv, kv * kv, scratch, ssq, ssk);
        qs[j] = qv / sqrtf(ssq + 1e-6f) * qscale;
        ks[j] = kv / sqrtf(ssk + 1e-6f);
        al[j] = expf(neg_a * softplus_f(fv + dtb));
        const float beta = sigmoid_f(bv);
        __syncthreads();
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < DL; ++i) {
            st[i] *= al[i];
            acc += st[i] * ks[i];
        }
        const float u = vv - acc;
        float out = 0.0f;
#pragma unroll
        for (int i = 0; i < DL; ++i) {
            st[i] += beta * (ks[i] * u);
            out += st[i] * qs[i];
        }
        if (NORM) {
            os[j] = out;  // read after the barrier below
        } else {
            o[row * C + h * DL + j] = out;
        }
        if (snap[s] && t + 1 < n) {
            float* pg = pool + (long long)table[t + 1] * fpb + head_off;
#pragma unroll
            for (int i = 0; i < DL; ++i) pg[(long long)i * DL] = st[i];
        }
        __syncthreads();  // qs / ks / al are rewritten by the next token
        if (NORM) {
            // kda_gate_norm of row `row`, head h: os is rewritten only after the next
            // token's first barrier, which every thread reaches after these reads.
            const int lane = j & 31;
            float ss = 0.0f;
            for (int i = lane; i < DL; i += WARP) ss += os[i] * os[i];
            ss = warp_sum(ss);
            const float inv = 1.0f / sqrtf(ss / (float)DL + eps);
            gated[row * C + (size_t)h * DL + j] = out * inv * o_norm[j] * sigmoid_f(gv);
        }
    }
    float* out0 = pool + (long long)table[0] * fpb + head_off;
#pragma unroll
    for (int i = 0; i < DL; ++i) out0[(long long)i * DL] = st[i];
    if (FUSED) conv_store(conv0);
}

#define KDA_RECURRENT(DL)                                                                   \
    extern "C" __global__ void kda_recurrent_##DL(                                           \
        float* o, const float* y, float* fg, const float* xin, int xin_stride,           \
        int b_col, const float* a_log, const float* dt_bias, float* pool,                   \
        long long layer_off, long long fpb, int conv_len, int nl, float qscale,             \
        const int* row0, const int* len, const int* pos0, const int* snap,                  \
        const int* state_tables, int max_state, int pre) {                                 \
        kda_recurrent_impl<DL, false>(o, y, fg, xin, xin_stride, b_col, a_log, dt_bias,     \
                                      pool, layer_off, fpb, conv_len, nl, qscale, row0, len, \
                                      pos0, snap, state_tables, max_state, nullptr, 0,       \
                                      nullptr, nullptr, 0.0f, nullptr, nullptr, 0, pre);     \
    }                                                                                       \
    extern "C" __global__ void kda_fused_##DL(                                               \
        float* gated, float* fg, const float* xin, int xin_stride,                          \
        int b_col, const float* a_log, const float* dt_bias, float* pool,                   \
        long long layer_off, long long fpb, int conv_len, int nl, float qscale,             \
        const int* row0, const int* len, const int* pos0, const int* snap,                  \
        const int* state_tables, int max_state, const float* taps, int kc,                  \
        const float* o_norm, float eps, const bf16_bits* wf, const bf16_bits* wg,         \
        int fcol, int pre) {                                                                \
        kda_recurrent_impl<DL, true>(nullptr, nullptr, fg, xin, xin_stride, b_col, a_log, dt_bias, \
                                     pool, layer_off, fpb, conv_len, nl, qscale, row0, len,  \
                                     pos0, snap, state_tables, max_state, taps, kc, gated,   \
                                     o_norm, eps, wf, wg, fcol, pre);                       \
    }                                                                                       \
    extern "C" __global__ void kda_recurrent_norm_##DL(                                      \
        float* gated, const float* y, float* fg, const float* xin, int xin_stride,          \
        int b_col, const float* a_log, const float* dt_bias, float* pool,                   \
        long long layer_off, long long fpb, int conv_len, int nl, float qscale,             \
        const int* row0, const int* len, const int* pos0, const int* snap,                  \
        const int* state_tables, int max_state, const float* o_norm, float eps, int pre) {  \
        kda_recurrent_impl<DL, false, true>(nullptr, y, fg, xin, xin_stride, b_col, a_log,  \
                                            dt_bias, pool, layer_off, fpb, conv_len, nl,     \
                                            qscale, row0, len, pos0, snap, state_tables,     \
                                            max_state, nullptr, 0, gated, o_norm, eps,       \
                                            nullptr, nullptr, 0, pre);                      \
    }                                                                                       \
    extern "C" __global__ void kda_conv_lowrank_##DL(                                        \
        float* y, const float* xin, int xin_stride, const float* taps, float* pool,         \
        long long layer_off, long long fpb, int C, int kc, const int* row0, const int* len,  \
        const int* pos0, const int* snap, const int* state_tables, int max_state,          \
        int conv_gx, int conv_blocks, float* fg, const bf16_bits* wf, const bf16_bits* wg,  \
        int fcol) {                                                                         \
        const int b = blockIdx.x;                                                           \
        if (b < conv_blocks) {                                                              \
            kda_conv_block(y, xin, xin_stride, taps, pool, layer_off, fpb, C, kc, row0, len, \
                           pos0, snap, state_tables, max_state, b % conv_gx, b / conv_gx);  \
            return;                                                                         \
        }                                                                                   \
        lowrank_block<DL>(fg, xin, xin_stride, fcol, wf, wg, C, b - conv_blocks);           \
    }

// kda_recurrent_{DL} and kda_fused_{DL} (conv + recurrence + gated norm, FUSED above; with
// wf / wg the f / g up-projections too).  Both wait for the previous grid in the impl
// (pdl_enter), kda_fused after its weight prologue.
// Launch: grid (nl, S), block DL (linear_head_dim: 32, 64 or 128).
// The verify pair (multi-row chunks in two launches instead of four): kda_conv_lowrank_{DL}
// = kda_conv's blocks (x fastest, conv_gx x S of them, any block size) then lowrank_block's
// (2 T of them: f and g of each row, the linear_pair launch's values); then
// kda_recurrent_norm_{DL} = kda_recurrent_{DL} with kda_gate_norm inside its token loop.
// Launch of kda_conv_lowrank: grid (conv_blocks + 2 T), block 256.
KDA_RECURRENT(32)
KDA_RECURRENT(64)
KDA_RECURRENT(128)

// out[t, h, :] = rmsnorm(o[t, h, :], o_norm, eps) * sigmoid(g[t, h, :]) (o_norm shared by heads).
// Shapes: o [T, nl * dl], fg [T, 2C] (g at column C = nl * dl), o_norm [dl], out [T, nl * dl].
// One warp per (t, h).  Launch: grid (ceil(T * nl / 4)), block 128.
extern "C" __global__ void kda_gate_norm(float* __restrict__ out, const float* __restrict__ o,
                                         const float* __restrict__ fg,
                                         const float* __restrict__ o_norm, int T, int nl, int dl,
                                         float eps) {
    pdl_enter();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int th = blockIdx.x * 4 + warp;
    if (th >= T * nl) return;
    const int t = th / nl, h = th % nl;
    const int C = nl * dl;
    const float* orow = o + (size_t)t * C + (size_t)h * dl;
    float ss = 0.0f;
    for (int i = lane; i < dl; i += WARP) ss += orow[i] * orow[i];
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)dl + eps);
    const float* g = fg + (size_t)t * 2 * C + C + (size_t)h * dl;
    float* dst = out + (size_t)t * C + (size_t)h * dl;
    for (int i = lane; i < dl; i += WARP) dst[i] = orow[i] * inv * o_norm[i] * sigmoid_f(g[i]);
}

// ---- Chunked prefill: kda_chunk_prep_{DL}, kda_chunk_scan_{DL} ----
// The chunkwise gated delta rule (cuda/src/kda_chunk.rs: the derivation and the host
// reference these kernels follow, sum for sum), for steps whose spans take no snapshots
// (prefill): chunks of BT tokens; the prep runs every (chunk, head) at once (the conv of
// its rows, the norms and gates, A, B and the triangular solve), the scan walks each
// sequence's chunks in order with the state's value columns spread over blocks.
// Chunk c of span s (first row r = row0[s] + c BT) owns slot s + r / BT of ck, nl heads
// a slot, CK floats a head: W [BT, DL], U~ [BT, DL], Q~ [BT, DL], K- [BT, DL],
// B [BT, BT], gamma [DL] (rows past the chunk's L tokens unused; B zero past them).
// Value columns of the state a kda_chunk_scan block owns (grid z = DL / KDA_SCAN_JB; the
// host's cuda/src/kda_chunk.rs SCAN_COLUMNS).
#define KDA_SCAN_JB 16

template <int DL>
struct KdaChunk {
    static constexpr int BT = DL >= 128 ? 16 : 32;
    static constexpr int CK = 4 * BT * DL + BT * BT + DL;
};

// Block (c, s, h): chunk c of span s, head h.  Block 256 threads.
// Shapes: ck [slots, nl, CK], xin [T, xin_stride] (pre-conv q | k | v at 0, b at b_col),
// fg [T, 2C] (f at 0), taps [3C, kc], A_log [nl], dt_bias [C].
// Conv: kda_conv's sums bit for bit (taps j < kc - 1 over the kc - 1 earlier inputs from
// the span's rows or, before its first row, the page's conv window; then the current
// input).  Chunk 0's block alone reads the old window (later chunks start >= BT > kc - 1
// rows in) and, after its reads, writes the span's new window (the last kc - 1 inputs).
template <int DL>
__device__ __forceinline__ void kda_chunk_prep_impl(
    float* __restrict__ ck, const float* __restrict__ xin, int xin_stride, int b_col,
    const float* __restrict__ fg, const float* __restrict__ taps, int kc,
    const float* __restrict__ a_log, const float* __restrict__ dt_bias, float* __restrict__ pool,
    long long layer_off, long long fpb, int nl, float qscale, const int* __restrict__ row0,
    const int* __restrict__ len, const int* __restrict__ pos0,
    const int* __restrict__ state_tables, int max_state) {
    pdl_enter();
    constexpr int BT = KdaChunk<DL>::BT, CK = KdaChunk<DL>::CK, P = DL + 1;
    __shared__ float sq[BT][P], sk[BT][P], sv[BT][P], sg[BT][P];
    __shared__ float sa[BT][BT];
    __shared__ float sb[BT];
    const int ci = blockIdx.x, s = blockIdx.y, h = blockIdx.z;
    const int tid = threadIdx.x, nt = blockDim.x;
    const int C = nl * DL;
    const int n = len[s], t0 = ci * BT;
    if (t0 >= n) return;
    const int L = min(BT, n - t0);
    const int base = row0[s], r0 = base + t0;
    float* out = ck + ((size_t)(s + r0 / BT) * nl + h) * CK;
    const bool fresh = pos0[s] == 0;
    float* conv0 = pool + (long long)state_tables[(size_t)s * max_state] * fpb + layer_off;
    // 1. Conv + SiLU of the chunk's q, k, v channels of head h.
    for (int e = tid; e < L * 3 * DL; e += nt) {
        const int t = e / (3 * DL), w = (e / DL) % 3, i = e % DL;
        const int c3 = w * C + h * DL + i;
        const float* tp = taps + (size_t)c3 * kc;
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < KC_MAX - 1; ++j) {
            if (j >= kc - 1) break;
            const int m = t0 + t - (kc - 1) + j;  // position in the span
            float x = 0.0f;
            if (m >= 0)
                x = xin[(size_t)(base + m) * xin_stride + c3];
            else if (!fresh)
                x = conv0[((long long)w * (kc - 1) + (kc - 1 + m)) * C + h * DL + i];
            acc += tp[j] * x;
        }
        acc += tp[kc - 1] * xin[(size_t)(r0 + t) * xin_stride + c3];
        const float y = silu_f(acc);
        if (w == 0) sq[t][i] = y;
        else if (w == 1) sk[t][i] = y;
        else sv[t][i] = y;
    }
    const float neg_a = -expf(a_log[h]);
    for (int e = tid; e < L * DL; e += nt) {
        const int t = e / DL, i = e % DL;
        sg[t][i] = neg_a * softplus_f(fg[(size_t)(r0 + t) * 2 * C + h * DL + i] + dt_bias[h * DL + i]);
    }
    if (tid < L) sb[tid] = sigmoid_f(xin[(size_t)(r0 + tid) * xin_stride + b_col + h]);
    __syncthreads();
    for (int ch = tid; ci == 0 && ch < 3 * DL; ch += nt) {
        // The span's new window (one thread a channel: its reads precede its writes).
        const int w = ch / DL, i = ch % DL;
        const int c3 = w * C + h * DL + i;
        float nw[KC_MAX - 1];
#pragma unroll
        for (int q = 0; q < KC_MAX - 1; ++q) {
            const int m = n - (kc - 1) + q;
            float x = 0.0f;  // slots q >= kc - 1 stay zero (not stored)
            if (q < kc - 1 && m >= 0)
                x = xin[(size_t)(base + m) * xin_stride + c3];
            else if (q < kc - 1 && !fresh)
                x = conv0[((long long)w * (kc - 1) + (kc - 1 + m)) * C + h * DL + i];
            nw[q] = x;
        }
#pragma unroll
        for (int q = 0; q < KC_MAX - 1; ++q)
            if (q < kc - 1) conv0[((long long)w * (kc - 1) + q) * C + h * DL + i] = nw[q];
    }
    // 2. q, k l2 norms (a warp a token) and the inclusive cumulative log-decay.
    const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
    for (int t = warp; t < L; t += nw) {
        float a = 0.0f, b = 0.0f;
        for (int i = lane; i < DL; i += WARP) {
            a += sq[t][i] * sq[t][i];
            b += sk[t][i] * sk[t][i];
        }
        a = warp_sum(a);
        b = warp_sum(b);
        const float ra = sqrtf(a + 1e-6f), rb = sqrtf(b + 1e-6f);
        for (int i = lane; i < DL; i += WARP) {
            sq[t][i] = sq[t][i] / ra * qscale;
            sk[t][i] = sk[t][i] / rb;
        }
    }
    if (tid < DL)
        for (int t = 1; t < L; ++t) sg[t][tid] = sg[t - 1][tid] + sg[t][tid];
    __syncthreads();
    // 3. A (strictly lower, into shared) and B (lower with the diagonal, out).
    float* ob = out + 4 * BT * DL;
    for (int e = tid; e < BT * BT; e += nt) {
        const int t = e / BT, q = e % BT;
        float da = 0.0f, db = 0.0f;
        if (t < L && q <= t) {
#pragma unroll 8
            for (int i = 0; i < DL; ++i) {
                const float kk = sk[q][i] * expf(sg[t][i] - sg[q][i]);
                da += sk[t][i] * kk;
                db += sq[t][i] * kk;
            }
        }
        const bool in = t < L && q <= t;
        sa[t][q] = in && q < t ? sb[q] * da : 0.0f;
        ob[e] = in ? sb[q] * db : 0.0f;
    }
    // Q~, K- and gamma (before the solve overwrites sk).
    for (int e = tid; e < L * DL; e += nt) {
        const int t = e / DL, i = e % DL;
        out[2 * BT * DL + e] = expf(sg[t][i]) * sq[t][i];
        out[3 * BT * DL + e] = sb[t] * expf(sg[L - 1][i] - sg[t][i]) * sk[t][i];
    }
    if (tid < DL) out[4 * BT * DL + BT * BT + tid] = expf(sg[L - 1][tid]);
    __syncthreads();
    // 4. (I + A) [W | U~] = [K~ | V], forward substitution, one thread a column, in place.
    for (int col = tid; col < 2 * DL; col += nt) {
        const bool kcol = col < DL;
        const int i = kcol ? col : col - DL;
        for (int t = 0; t < L; ++t) {
            float r = kcol ? expf(sg[t][i]) * sk[t][i] : sv[t][i];
            for (int q = 0; q < t; ++q) r -= sa[t][q] * (kcol ? sk[q][i] : sv[q][i]);
            if (kcol) sk[t][i] = r;
            else sv[t][i] = r;
        }
    }
    __syncthreads();
    for (int e = tid; e < L * DL; e += nt) {
        const int t = e / DL, i = e % DL;
        out[e] = sk[t][i];
        out[BT * DL + e] = sv[t][i];
    }
}

// acc[k] = sum_i m[(r + k NR) P + i] ss[i][j], ascending i from zero: rows r + k NR of a
// staged [BT, DL] chunk matrix (row stride P) times state column j (kda_chunk_scan's W S
// and Q~ S).
template <int DL, int JB, int KT, int NR, int P>
__device__ __forceinline__ void chunk_rows_dot_state(const float* m, const float (*ss)[JB], int r,
                                                     int j, float (&acc)[KT]) {
#pragma unroll
    for (int k = 0; k < KT; ++k) acc[k] = 0.0f;
#pragma unroll 8
    for (int i = 0; i < DL; ++i) {
        const float sv = ss[i][j];
#pragma unroll
        for (int k = 0; k < KT; ++k) acc[k] += m[(r + k * NR) * P + i] * sv;
    }
}

// Block (h, s, jg): head h of span s, value columns jg * JB .. + JB (JB = 16: DL / 16
// blocks a head).  Block 256 threads: j = tid % JB a column, r = tid / JB (NR = 16 of them)
// every NR-th token / key row.  The state's columns live in shared memory from table[0]'s
// page (zeros at position 0) and go back there after the last chunk.  Per chunk, W, Q~,
// K-, B and gamma are first copied to shared memory (every load in flight at once; read
// inside the loops, each load waited out its L2 latency in turn), rows padded by one
// float (a warp's two row groups read two rows of a matrix: other banks), then:
// u = U~ - W S; o = Q~ S + B u; S = diag(gamma) S + K-^T u.
// Shapes: o [T, C], ck as kda_chunk_prep's.  Shared at DL 64: about 35 KiB.
template <int DL>
__device__ __forceinline__ void kda_chunk_scan_impl(
    float* __restrict__ o, const float* __restrict__ ck, float* __restrict__ pool,
    long long layer_off, long long fpb, int conv_len, int nl, const int* __restrict__ row0,
    const int* __restrict__ len, const int* __restrict__ pos0,
    const int* __restrict__ state_tables, int max_state) {
    pdl_enter();
    constexpr int BT = KdaChunk<DL>::BT, CK = KdaChunk<DL>::CK, JB = KDA_SCAN_JB;
    constexpr int NR = 256 / JB, P = DL + 1, PB = BT + 1;
    __shared__ float ss[DL][JB];
    __shared__ float su[BT][JB];
    __shared__ float cw[3][BT * P];       // W, Q~, K- of the chunk, rows padded
    __shared__ float cb[BT * PB + DL];    // B (rows padded), then gamma
    const int h = blockIdx.x, s = blockIdx.y, jg = blockIdx.z;
    const int tid = threadIdx.x, j = tid % JB, r = tid / JB;
    const int C = nl * DL, J = jg * JB + j;
    float* page = pool + (long long)state_tables[(size_t)s * max_state] * fpb + layer_off +
                  conv_len + (long long)h * DL * DL + J;
    const bool fresh = pos0[s] == 0;
    for (int i = r; i < DL; i += NR) ss[i][j] = fresh ? 0.0f : page[(long long)i * DL];
    const int n = len[s], base = row0[s];
    // Rows t = r + k NR (k < KT) of this thread; key rows i = r + m NR (m < KI).
    constexpr int KT = (BT + NR - 1) / NR, KI = DL / NR;
    for (int t0 = 0; t0 < n; t0 += BT) {
        const int L = min(BT, n - t0);
        const float* c = ck + ((size_t)(s + (base + t0) / BT) * nl + h) * CK;
        // Stage the chunk: W at 0, Q~ at 2 BT DL, K- at 3 BT DL, B and gamma at 4 BT DL.
        constexpr int Q4 = BT * DL / 4;
        for (int e = tid; e < 3 * Q4; e += 256) {
            const int m = e / Q4, k = e % Q4;
            const int src = (m == 0 ? 0 : (m + 1) * BT * DL) / 4 + k;
            const float4 v = reinterpret_cast<const float4*>(c)[src];
            const int row = 4 * k / DL, col = 4 * k % DL;
            float* d = cw[m] + row * P + col;
            d[0] = v.x;
            d[1] = v.y;
            d[2] = v.z;
            d[3] = v.w;
        }
        for (int e = tid; e < (BT * BT + DL) / 4; e += 256) {
            const float4 v = reinterpret_cast<const float4*>(c + 4 * BT * DL)[e];
            const float w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int x = 4 * e + u;
                cb[x < BT * BT ? (x / BT) * PB + x % BT : BT * PB + x - BT * BT] = w4[u];
            }
        }
        float uu[KT];
#pragma unroll
        for (int k = 0; k < KT; ++k) {
            const int t = r + k * NR;
            uu[k] = t < L ? c[BT * DL + t * DL + J] : 0.0f;
        }
        __syncthreads();  // the stage, and (first chunk) the state's columns
        // Each sum ascends in i (then q) from zero, as kda_chunk.rs; a loaded state or u
        // value feeds every row of the thread.
        float acc[KT];
        chunk_rows_dot_state<DL, JB, KT, NR, P>(cw[0], ss, r, j, acc);
#pragma unroll
        for (int k = 0; k < KT; ++k)
            if (r + k * NR < L) su[r + k * NR][j] = uu[k] - acc[k];
        __syncthreads();
        chunk_rows_dot_state<DL, JB, KT, NR, P>(cw[1], ss, r, j, acc);
        for (int q = 0; q < L; ++q) {
            const float uv = su[q][j];
#pragma unroll
            for (int k = 0; k < KT; ++k)
                if (q <= r + k * NR) acc[k] += cb[(r + k * NR) * PB + q] * uv;
        }
#pragma unroll
        for (int k = 0; k < KT; ++k)
            if (r + k * NR < L) o[(size_t)(base + t0 + r + k * NR) * C + h * DL + J] = acc[k];
        __syncthreads();  // every read of ss above precedes its update
        float sn[KI];
#pragma unroll
        for (int m = 0; m < KI; ++m) sn[m] = cb[BT * PB + r + m * NR] * ss[r + m * NR][j];
        for (int q = 0; q < L; ++q) {
            const float uv = su[q][j];
#pragma unroll
            for (int m = 0; m < KI; ++m) sn[m] += cw[2][q * P + r + m * NR] * uv;
        }
#pragma unroll
        for (int m = 0; m < KI; ++m) ss[r + m * NR][j] = sn[m];
        __syncthreads();  // ss updated, and the stage free for the next chunk
    }
    for (int i = r; i < DL; i += NR) page[(long long)i * DL] = ss[i][j];
}

#define KDA_CHUNKED(DL)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) kda_chunk_prep_##DL(                   \
        float* ck, const float* xin, int xin_stride, int b_col, const float* fg,              \
        const float* taps, int kc, const float* a_log, const float* dt_bias, float* pool,     \
        long long layer_off, long long fpb, int nl, float qscale, const int* row0,            \
        const int* len, const int* pos0, const int* state_tables, int max_state) {            \
        kda_chunk_prep_impl<DL>(ck, xin, xin_stride, b_col, fg, taps, kc, a_log, dt_bias,     \
                                pool, layer_off, fpb, nl, qscale, row0, len, pos0,            \
                                state_tables, max_state);                                     \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) kda_chunk_scan_##DL(                   \
        float* o, const float* ck, float* pool, long long layer_off, long long fpb,          \
        int conv_len, int nl, const int* row0, const int* len, const int* pos0,               \
        const int* state_tables, int max_state) {                                             \
        kda_chunk_scan_impl<DL>(o, ck, pool, layer_off, fpb, conv_len, nl, row0, len, pos0,   \
                                state_tables, max_state);                                     \
    }

// Launch: prep grid (ceil(max span len / BT), S, nl), block 256; scan grid (nl, S,
// DL / KDA_SCAN_JB), block 256.
KDA_CHUNKED(32)
KDA_CHUNKED(64)
KDA_CHUNKED(128)
