// Rejection sampling of speculative verify chunks on the device (issue 11: "lm_head with
// argmax and sampling on the device"): the target's logits stay where the forward wrote
// them; only each chunk's verdict (accepted drafts, emitted token, uniforms consumed)
// crosses to the host.
//
// Source: engine/src/spec/verify.rs `rejection_sample` / `verify_with_uniforms` and
// engine/src/spec/sampling.rs `target_probs` / `sample_index_with` (vLLM 0.33.0
// rejection_sampler.py semantics, with the deviations documented there): the same
// decisions in the same order, probabilities in f64. The uniforms are the ones the
// request's host RNG would draw next, in order (the host draws k + 1 ahead from a clone
// of its RNG and advances the RNG by `consumed`), so tokens and RNG streams are those of
// the host path on the same logits. Sums are block reductions, not the CPU's sequential
// sums: a result can differ only where a uniform lands within f64 rounding of a CDF
// boundary (cuda/src/check.rs compares every verdict with the host reference).
//
// Invariants: every row of a chunk is checked before any draw, as `check_shapes` does; a
// row the host would refuse (NaN, +inf, all -inf) or a distribution without mass ends the
// chunk with status != 0 and the host re-runs that chunk on its logits, which gives the
// host's exact error. Draft ids, q rows and uniforms were checked on the host.

#define SAMPLE_THREADS 1024
// Largest vocabulary the top-k / top-p sort takes (shared memory keys, cuda/src/launch.rs
// SAMPLE_SORT_CAP); larger vocabularies sort on the host.
#define SORT_CAP 16384

typedef unsigned long long u64;

// Float -> key whose unsigned order is the float's order (-inf first; -0 before +0, as
// f64::total_cmp orders them).
__device__ __forceinline__ u32 f32_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_f32(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Sum of one double per thread; every thread gets the total. scratch: >= 32 doubles.
__device__ double block_sum_d(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t += scratch[w];
    return t;
}

__device__ double block_max_d(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(FULL_MASK, v, o));
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = -INFINITY;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t = fmax(t, scratch[w]);
    return t;
}

// Min (is_min) or max of one int per thread; every thread gets it. scratch: >= 32 ints.
__device__ int block_minmax_i(int v, bool is_min, int* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const int w = __shfl_xor_sync(FULL_MASK, v, o);
        v = is_min ? min(v, w) : max(v, w);
    }
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int t = scratch[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) t = is_min ? min(t, scratch[w]) : max(t, scratch[w]);
    return t;
}

// Exclusive prefix sum of one double per thread in thread order; `total` gets the sum of
// all (a walk that adds each thread's own terms to its offset ends at `total` up to
// rounding). scratch: >= 33 doubles.
__device__ double block_scan_d(double v, double* scratch, double& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    double inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double n = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane >= o) inc += n;
    }
    // The exclusive value is the previous lane's inclusive one (not inc - v, which rounds
    // differently), so each thread's offset continues its neighbour's sum.
    double ex = __shfl_up_sync(FULL_MASK, inc, 1);
    if (lane == 0) ex = 0.0;
    __syncthreads();
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double run = 0.0;
        for (int w = 0; w < nw; ++w) {
            const double t = scratch[w];
            scratch[w] = run;
            run += t;
        }
        scratch[32] = run;
    }
    __syncthreads();
    const double excl = scratch[warp] + ex;
    total = scratch[32];
    return excl;
}

// The rows a chunk's verdict reads must be rows `check_logits` accepts: no NaN, no +inf,
// not every entry -inf. Every thread gets the answer.
__device__ bool row_ok(const float* __restrict__ l, int V) {
    int bad = 0, finite = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float x = l[j];
        bad |= (x != x) || (x == INFINITY);
        finite |= (x != -INFINITY);
    }
    return !__syncthreads_or(bad) && __syncthreads_or(finite);
}

// Ascending bitonic sort of n (a power of two) keys in shared memory.
__device__ void bitonic_sort(u64* keys, int n) {
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const u64 a = keys[i], b = keys[j];
                    const bool asc = (i & size) == 0;
                    if ((a > b) == asc) {
                        keys[i] = b;
                        keys[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

struct SampleParams {
    double t;       // temperature (> 0)
    int top_k;      // 0 = off
    double cut;     // 1 - top_p (top-p off when top_p >= 1)
    bool top_p_on;
    int sort_n;     // power of two >= V when sorting, else 0
};

// top-p (sampling.rs target_probs): the ascending prefix whose cumulative mass is <= cut is
// masked, never the largest entry. P holds x = l / t with top-k's -inf; keys are sorted.
__device__ void top_p_mask(double* P, const u64* keys, int V, const SampleParams& sp,
                           double* dscr) {
    // sort_n is a power of two in [blockDim.x, SORT_CAP] (sample.rs sort_keys), so each
    // thread walks 1..16 consecutive sorted keys.
    const int per = sp.sort_n / (int)blockDim.x;
    const int j0 = threadIdx.x * per;
    const double m = P[(int)(keys[V - 1] & 0xffffffffu)];
    double e[16];
    double local = 0.0;
    for (int a = 0; a < per; ++a) {
        const int j = j0 + a;
        const double x = j < V ? P[(int)(keys[j] & 0xffffffffu)] : -INFINITY;
        e[a] = x == -INFINITY ? 0.0 : exp(x - m);
        local += e[a];
    }
    const double s = block_sum_d(local, dscr);
    double psum = 0.0;
    for (int a = 0; a < per; ++a) psum += e[a] / s;
    double total;
    double cum = block_scan_d(psum, dscr, total);
    for (int a = 0; a < per; ++a) {
        const int j = j0 + a;
        if (j >= V) break;
        cum += e[a] / s;
        if (cum <= sp.cut && j + 1 < V) P[(int)(keys[j] & 0xffffffffu)] = -INFINITY;
    }
    __syncthreads();
}

// P = target_probs(l) (temperature, top-k, top-p, softmax), f64, in index order.
__device__ void target_probs_dev(double* P, const float* __restrict__ l, int V,
                                 const SampleParams& sp, u64* keys, double* dscr) {
    float thr = -INFINITY;
    if (sp.sort_n > 0) {
        for (int i = threadIdx.x; i < sp.sort_n; i += blockDim.x)
            keys[i] = i < V ? (((u64)f32_key(l[i]) << 32) | (u64)i) : ~0ull;
        __syncthreads();
        bitonic_sort(keys, sp.sort_n);
        if (sp.top_k > 0 && sp.top_k < V) thr = key_f32((u32)(keys[V - sp.top_k] >> 32));
    }
    // top-k: x < the k-th largest is masked (x = l / t is strictly increasing in l).
    for (int j = threadIdx.x; j < V; j += blockDim.x)
        P[j] = l[j] < thr ? -INFINITY : (double)l[j] / sp.t;
    __syncthreads();
    if (sp.top_p_on) top_p_mask(P, keys, V, sp, dscr);
    double mx = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmax(mx, P[j]);
    mx = block_max_d(mx, dscr);
    double local = 0.0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const double e = P[j] == -INFINITY ? 0.0 : exp(P[j] - mx);
        P[j] = e;
        local += e;
    }
    const double s = block_sum_d(local, dscr);
    for (int j = threadIdx.x; j < V; j += blockDim.x) P[j] /= s;
    __syncthreads();
}

// Weight j of a draw: p (mode 0), max(0, p - q) (mode 1), p with the draft x zeroed
// (mode 2, one-hot q).
__device__ __forceinline__ double weight(int mode, const double* P, const float* q, int x, int j) {
    const double p = P[j];
    if (mode == 1) return fmax(p - (double)q[j], 0.0);
    if (mode == 2) return j == x ? 0.0 : p;
    return p;
}

// sample_index_with: the first index (in index order) whose cumulative positive weight
// exceeds u * total, else the last positive one; -1 (and no uniform drawn) when the
// weights have no positive finite mass. Each thread walks a contiguous index range.
__device__ int sample_w(int mode, const double* P, const float* q, int x, int V, double u,
                        int& used, double* dscr, int* iscr) {
    const int per = (V + (int)blockDim.x - 1) / (int)blockDim.x;
    const int j0 = threadIdx.x * per, j1 = min(V, j0 + per);
    double local = 0.0;
    for (int j = j0; j < j1; ++j) {
        const double w = weight(mode, P, q, x, j);
        if (w > 0.0) local += w;
    }
    double total;
    double cum = block_scan_d(local, dscr, total);
    if (!(total > 0.0 && isfinite(total))) return -1;
    ++used;
    const double target = u * total;
    int found = 0x7fffffff, last = -1;
    for (int j = j0; j < j1; ++j) {
        const double w = weight(mode, P, q, x, j);
        if (w > 0.0) {
            cum += w;
            last = j;
            if (target < cum) {
                found = j;
                break;
            }
        }
    }
    found = block_minmax_i(found, true, iscr);
    if (found != 0x7fffffff) return found;
    // (A thread that broke early has a lower `last` than a later thread's: max is right.)
    return block_minmax_i(last, false, iscr);
}

// The residual draw of a sparse q row (kq entries, ids distinct), then the fallback to p
// when it has no mass: sample_w's result for the dense row (mode 1, then mode 0), the same
// uniforms consumed.  P is restored before returning.
__device__ int sample_sparse(double* P, const float* qrow, const int* irow, int kq, int V,
                             double u, int& used, double* dscr, int* iscr) {
    const int e = threadIdx.x;
    double saved = 0.0;
    __syncthreads();  // every thread has read P[x] for the accept test
    if (e < kq) {
        saved = P[irow[e]];
        P[irow[e]] = fmax(saved - (double)qrow[e], 0.0);
    }
    __syncthreads();
    int token = sample_w(0, P, nullptr, -1, V, u, used, dscr, iscr);
    __syncthreads();  // the draw's reads of P are done
    if (e < kq) P[irow[e]] = saved;
    __syncthreads();
    if (token < 0) token = sample_w(0, P, nullptr, -1, V, u, used, dscr, iscr);
    return token;
}

// One block per chunk c: meta[7c .. 7c + 7) = (first logits row, k drafts, offset of its
// drafts in `drafts`, offset of its q rows in `q` in floats or -1 for one-hot q, offset of
// its k + 1 uniforms, kq, offset of its q ids in `qid`); out[4c .. 4c + 4) = (status: 0 ok,
// 1 a row check_logits refuses, 2 no probability mass; accepted; emitted token; uniforms
// consumed).  kq = 0: dense q rows of V floats.  kq > 0 (<= SAMPLE_THREADS): sparse rows
// (engine/src/spec/probs.rs), kq probabilities a row in `q` and their distinct token ids in
// `qid`, every other token at 0.  A sparse row's residual max(0, p - q) is p with its kq
// entries lowered in place (P[id] = fmax(P[id] - q, 0), the dense mode 1 weight there; at
// every other j the dense weight fmax(p - 0, 0) is p itself), drawn as mode 0; the entries
// are restored before the fallback draw from p.
// Shapes: logits [R, V] f32, probs [C, V] f64 scratch, q [..] f32, qid [..] i32,
// uniforms [..] f64.
// Launch: grid (C), block SAMPLE_THREADS, dynamic shared sort_n * 8 bytes.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_verify(int* __restrict__ out, double* __restrict__ probs,
              const float* __restrict__ logits, const int* __restrict__ meta,
              const int* __restrict__ drafts, const float* __restrict__ q,
              const int* __restrict__ qid, const double* __restrict__ uniforms, int V, float temperature, int top_k,
              float top_p, int sort_n) {
    pdl_enter();
    extern __shared__ u64 keys[];
    __shared__ double dscr[33];
    __shared__ int iscr[32];
    const int c = blockIdx.x;
    const int* m = meta + 7 * c;
    const int row = m[0], k = m[1], doff = m[2], qoff = m[3], uoff = m[4], kq = m[5];
    const int* ids = qid + m[6];
    double* P = probs + (size_t)c * V;
    const float* L = logits + (size_t)row * V;
    int* o = out + 4 * c;
    SampleParams sp;
    sp.t = (double)temperature;
    sp.top_k = top_k;
    sp.top_p_on = top_p < 1.0f;
    sp.cut = 1.0 - (double)top_p;
    sp.sort_n = sort_n;
    for (int r = 0; r <= k; ++r) {
        if (!row_ok(L + (size_t)r * V, V)) {
            if (threadIdx.x == 0) { o[0] = 1; o[1] = 0; o[2] = 0; o[3] = 0; }
            return;
        }
    }
    int used = 0, accepted = k, token = -1;
    for (int i = 0; i < k && token < 0; ++i) {
        target_probs_dev(P, L + (size_t)i * V, V, sp, keys, dscr);
        const int x = drafts[doff + i];
        const float* qrow =
            qoff < 0 ? nullptr : q + (size_t)qoff + (size_t)i * (kq > 0 ? kq : V);
        const int* irow = ids + (size_t)i * kq;
        double qx = qrow ? 0.0 : 1.0;
        if (qrow && kq == 0) qx = (double)qrow[x];
        for (int e = 0; qrow && e < kq; ++e)
            if (irow[e] == x) qx = (double)qrow[e];
        const double u = uniforms[uoff + used];
        ++used;
        if (qx > 0.0 && u < P[x] / qx) continue;
        accepted = i;
        if (qrow && kq > 0) {
            token = sample_sparse(P, qrow, irow, kq, V, uniforms[uoff + used], used, dscr, iscr);
        } else {
            token = sample_w(qrow ? 1 : 2, P, qrow, x, V, uniforms[uoff + used], used, dscr, iscr);
            if (token < 0)
                token = sample_w(0, P, qrow, x, V, uniforms[uoff + used], used, dscr, iscr);
        }
        if (token < 0) break;
    }
    if (accepted == k && token < 0) {
        target_probs_dev(P, L + (size_t)k * V, V, sp, keys, dscr);
        token = sample_w(0, P, nullptr, -1, V, uniforms[uoff + used], used, dscr, iscr);
    }
    if (threadIdx.x == 0) {
        o[0] = token < 0 ? 2 : 0;
        o[1] = accepted;
        o[2] = token < 0 ? 0 : token;
        o[3] = used;
    }
}
