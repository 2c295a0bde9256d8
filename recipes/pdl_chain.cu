// The floor of a chain of dependent kernels inside one CUDA graph (issue 11, "what holds
// it back"): each kernel waits for its predecessor (programmatic dependent launch,
// Hopper griddepcontrol, or a plain stream order), reads the value the predecessor wrote
// and writes the next, so the chain's time per kernel is the boundary cost alone, with
// no weights and no arithmetic. The engine's decode step is such a chain of 61 kernels.
//
//   device:  nvcc -O3 -arch=sm_90a -o /tmp/pdl_chain recipes/pdl_chain.cu && /tmp/pdl_chain
//
// Prints one row per (blocks a kernel, PDL on/off): µs per kernel of a 61-kernel chain
// replayed from one graph (median of 50 replays after 5), and the chain's check value.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CK(x)                                                                          \
    do {                                                                               \
        cudaError_t e_ = (x);                                                          \
        if (e_ != cudaSuccess) {                                                       \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

// buf[i + 1] = buf[i] + 1 by block 0's thread 0; every other block reads buf[i] (a
// dependent load on every SM the kernel spans, as a real kernel reads its input).
__global__ void link(float* buf, int i, int pdl, float* sink) {
    if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
    const float v = *(volatile float*)(buf + i);
    if (blockIdx.x == 0 && threadIdx.x == 0) buf[i + 1] = v + 1.0f;
    if (v < -1.0f) sink[blockIdx.x] = v;  // never true: keeps the load
    if (pdl) asm volatile("griddepcontrol.launch_dependents;");
}

static float chain_us(int blocks, int pdl, int n, float* buf, float* sink, cudaStream_t s,
                      float* check) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaMemsetAsync(buf, 0, (n + 1) * sizeof(float), s));
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n; ++i) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(blocks);
        cfg.blockDim = dim3(256);
        cfg.stream = s;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = pdl ? 1 : 0;
        CK(cudaLaunchKernelEx(&cfg, link, buf, i, pdl, sink));
    }
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int r = 0; r < 55; ++r) {
        CK(cudaMemsetAsync(buf, 0, sizeof(float), s));
        CK(cudaEventRecord(a, s));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(b, s));
        CK(cudaStreamSynchronize(s));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (r >= 5) t.push_back(ms * 1e3f / n);
    }
    CK(cudaMemcpy(check, buf + n, sizeof(float), cudaMemcpyDeviceToHost));
    std::sort(t.begin(), t.end());
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return t[t.size() / 2];
}

int main() {
    const int n = 61;
    float *buf, *sink;
    CK(cudaMalloc(&buf, (n + 1) * sizeof(float)));
    CK(cudaMalloc(&sink, 4096 * sizeof(float)));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    printf("pdl_chain on %s (%d SMs): %d dependent kernels in one graph\n", p.name,
           p.multiProcessorCount, n);
    printf("%8s %5s %14s %8s\n", "blocks", "pdl", "us_per_kernel", "check");
    const int sizes[] = {1, 16, p.multiProcessorCount, 2 * p.multiProcessorCount};
    for (int blocks : sizes)
        for (int pdl = 0; pdl < 2; ++pdl) {
            float check = 0.0f;
            const float us = chain_us(blocks, pdl, n, buf, sink, s, &check);
            printf("%8d %5d %14.3f %8.0f%s\n", blocks, pdl, us, check,
                   check == (float)n ? "" : "  WRONG");
        }
    return 0;
}
