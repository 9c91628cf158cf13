// Page copy variants between two GPUs (peer access in one process), write (gpu0 -> gpu1) and
// read (gpu1 -> gpu0), kernel or copies queued on gpu0. Prints GB/s and us per call.
// Build from the repository root: nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc -o sweep <this file>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#include <algorithm>
#include <string>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

// The route's own copy loop (p2p::cuda::copy_bytes), so every variant below copies as it does.
#include "cuda/copy_kernels.cu"
using p2p::cuda::copy_bytes;

struct Job { char* dst; const char* src; const long* sids; const long* dids; size_t bytes; size_t n; };

template <int K>
__global__ void warp_kernel(Job j) {  // a page per warp
  const unsigned lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (size_t k = blockIdx.x * warps + threadIdx.x / 32; k < j.n; k += size_t(gridDim.x) * warps) {
    long id = 0;
    if (lane < 2) id = (lane == 0 ? j.sids : j.dids)[k];
    const long s = __shfl_sync(~0u, id, 0), d = __shfl_sync(~0u, id, 1);
    copy_bytes<K>(j.dst + d * j.bytes, j.src + s * j.bytes, j.bytes, lane, 32);
  }
}

template <int K, unsigned kChunk>
__global__ void chunk_kernel(Job j) {  // a kChunk-byte piece of a page per warp
  const unsigned lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const size_t per = (j.bytes + kChunk - 1) / kChunk, units = j.n * per;
  for (size_t u = blockIdx.x * warps + threadIdx.x / 32; u < units; u += size_t(gridDim.x) * warps) {
    const size_t k = u / per, off = (u % per) * kChunk;
    long id = 0;
    if (lane < 2) id = (lane == 0 ? j.sids : j.dids)[k];
    const long s = __shfl_sync(~0u, id, 0), d = __shfl_sync(~0u, id, 1);
    copy_bytes<K>(j.dst + d * j.bytes + off, j.src + s * j.bytes + off, (j.bytes - off < kChunk ? j.bytes - off : size_t(kChunk)), lane, 32);
  }
}

template <int K>
__global__ void block_kernel(Job j) {  // a page per block
  for (size_t k = blockIdx.x; k < j.n; k += gridDim.x)
    copy_bytes<K>(j.dst + j.dids[k] * j.bytes, j.src + j.sids[k] * j.bytes, j.bytes, threadIdx.x, blockDim.x);
}

int main(int argc, char** argv) {
  CK(cudaSetDevice(1)); CK(cudaDeviceEnablePeerAccess(0, 0));
  CK(cudaSetDevice(0)); CK(cudaDeviceEnablePeerAccess(1, 0));
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const size_t pool = 1ull << 30;
  char *a, *b; CK(cudaSetDevice(1)); CK(cudaMalloc(&b, pool)); CK(cudaMemset(b, 1, pool));
  CK(cudaSetDevice(0)); CK(cudaMalloc(&a, pool)); CK(cudaMemset(a, 2, pool));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  long *hids, *dids_mem; CK(cudaHostAlloc(&hids, 2 * 65536 * 8, cudaHostAllocMapped)); CK(cudaMalloc(&dids_mem, 2 * 65536 * 8));
  long* zeros; CK(cudaMalloc(&zeros, 16)); CK(cudaMemset(zeros, 0, 16));
  long* hdev; CK(cudaHostGetDevicePointer((void**)&hdev, hids, 0));
  std::mt19937 rng(1);
  struct Case { size_t bytes, n; };
  std::vector<Case> cases = {{4096, 256}, {4096, 4096}, {32768, 16384}, {65536, 256}, {65536, 4096}};
  std::vector<void*> dv; std::vector<const void*> sv; std::vector<size_t> szv;
  printf("sms %d\n", sms);
  for (Case c : cases) {
    const size_t slots = pool / c.bytes;
    std::vector<long> ids(slots); for (size_t i = 0; i < slots; ++i) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), rng); std::copy(ids.begin(), ids.begin() + c.n, hids);
    std::shuffle(ids.begin(), ids.end(), rng); std::copy(ids.begin(), ids.begin() + c.n, hids + 65536);
    CK(cudaMemcpy(dids_mem, hids, 2 * 65536 * 8, cudaMemcpyHostToDevice));
    const double total = double(c.bytes) * c.n;
    const int reps = c.n * c.bytes < (64 << 20) ? 400 : 20;
    for (int dir = 0; dir < 2; ++dir) {
      char* src = dir == 0 ? a : b; char* dst = dir == 0 ? b : a;
      auto run = [&](const char* name, auto&& launch) {
        for (int w = 0; w < 3; ++w) launch();
        CK(cudaStreamSynchronize(st));
        cudaEventRecord(e0, st);
        for (int r = 0; r < reps; ++r) launch();
        cudaEventRecord(e1, st); CK(cudaEventSynchronize(e1)); CK(cudaGetLastError());
        float ms; cudaEventElapsedTime(&ms, e0, e1);
        const double per = ms * 1e3 / reps;
        printf("%-6s %5zuK x%-6zu %-14s %8.1f GB/s %8.2f us/call\n", dir ? "read" : "write", c.bytes >> 10, c.n, name, total / per / 1e3, per);
      };
      Job host{dst, src, hdev, hdev + 65536, c.bytes, c.n}, dev{dst, src, dids_mem, dids_mem + 65536, c.bytes, c.n};
      auto grid = [&](size_t units, size_t per_block) { return unsigned(std::min<size_t>((units + per_block - 1) / per_block, 8192)); };
      run("warp8/hostids", [&] { warp_kernel<8><<<grid(c.n, 8), 256, 0, st>>>(host); });
      run("warp8/devids", [&] { warp_kernel<8><<<grid(c.n, 8), 256, 0, st>>>(dev); });
      run("warp16", [&] { warp_kernel<16><<<grid(c.n, 8), 256, 0, st>>>(dev); });
      run("warp4", [&] { warp_kernel<4><<<grid(c.n, 8), 256, 0, st>>>(dev); });
      if (c.bytes > 4096) {
        run("chunk4K", [&] { chunk_kernel<8, 4096><<<grid(c.n * (c.bytes / 4096), 8), 256, 0, st>>>(dev); });
        run("chunk8K/16", [&] { chunk_kernel<16, 8192><<<grid(c.n * (c.bytes / 8192), 8), 256, 0, st>>>(dev); });
        run("chunk2K/4", [&] { chunk_kernel<4, 2048><<<grid(c.n * (c.bytes / 2048), 8), 256, 0, st>>>(dev); });
        run("block8", [&] { block_kernel<8><<<grid(c.n, 1), 256, 0, st>>>(dev); });
        run("block4/512", [&] { block_kernel<4><<<grid(c.n, 1), 512, 0, st>>>(dev); });
      }
      dv.clear(); sv.clear(); szv.clear();
      for (size_t k = 0; k < c.n; ++k) { dv.push_back(dst + hids[65536 + k] * c.bytes); sv.push_back(src + hids[k] * c.bytes); szv.push_back(c.bytes); }
      cudaMemcpyAttributes attr{}; attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attr.srcLocHint.type = cudaMemLocationTypeDevice; attr.srcLocHint.id = dir ? 1 : 0;
      attr.dstLocHint.type = cudaMemLocationTypeDevice; attr.dstLocHint.id = dir ? 0 : 1;
      size_t idx = 0;
      run("ce-batch", [&] { CK(cudaMemcpyBatchAsync(dv.data(), sv.data(), szv.data(), c.n, &attr, &idx, 1, st)); });
      cudaMemcpyAttributes attr2 = attr; attr2.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      run("ce-batch/ovl", [&] { CK(cudaMemcpyBatchAsync(dv.data(), sv.data(), szv.data(), c.n, &attr2, &idx, 1, st)); });
      if (c.n <= 4096) run("ce-loop", [&] { for (size_t k = 0; k < c.n; ++k) cudaMemcpyAsync(dv[k], sv[k], c.bytes, cudaMemcpyDefault, st); });
      run("contig-ce", [&] { CK(cudaMemcpyAsync(dst, src, c.n * c.bytes, cudaMemcpyDefault, st)); });
      Job contig{dst, src, zeros, zeros, c.n * c.bytes, 1};
      // contiguous as 64 KiB pieces, one block each (the route's span kernel)
      run("contig-kern", [&] { chunk_kernel<4, 65536><<<grid(c.n * c.bytes / 2048, 8), 256, 0, st>>>(contig); });
    }
  }
  // launch overhead alone: host-side cost per call of an empty-ish kernel and of a batch
  return 0;
}
