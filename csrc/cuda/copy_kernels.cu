#include "cuda/copy_kernels.h"

#include <cstdint>

namespace p2p::cuda {
namespace {

// NOTE: one thread reads a span's descriptor and the block shares it: with every warp reading
// it, 4096 spans of 4 KiB whose descriptors lie in pinned host memory cost eight PCIe reads per
// span instead of one.
__global__ void copy_spans_kernel(const engine::CopySpan* spans, size_t n, CopyDone done) {
  __shared__ engine::CopySpan shared;
  for (size_t s = blockIdx.x; s < n; s += gridDim.x) {
    if (threadIdx.x == 0) shared = spans[s];
    __syncthreads();
    const engine::CopySpan span = shared;
    __syncthreads();
    const char* src = static_cast<const char*>(span.src);
    char* dst = static_cast<char*>(span.dst);
    size_t head = 0;
    if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
      const size_t vectors = span.len / 16;
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* d4 = reinterpret_cast<uint4*>(dst);
      size_t i = threadIdx.x;
      // Two loads in flight per thread before the stores: remote reads are slow to return.
      for (; i + blockDim.x < vectors; i += 2 * blockDim.x) {
        const uint4 a = s4[i], b = s4[i + blockDim.x];
        d4[i] = a;
        d4[i + blockDim.x] = b;
      }
      if (i < vectors) d4[i] = s4[i];
      head = vectors * 16;
    }
    for (size_t i = head + threadIdx.x; i < span.len; i += blockDim.x) dst[i] = src[i];
  }
  if (!done.flag) return;
  // The last block to finish tells the host: each block makes its stores (local and peer)
  // visible to the system before it counts itself, and the last one resets the counter for the
  // next launch before it writes the flag.
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence_system();
  if (atomicAdd(done.arrivals, 1u) != gridDim.x - 1) return;
  *done.arrivals = 0;
  __threadfence_system();
  *done.flag = done.value;
}

}  // namespace

cudaError_t launch_copy_spans(const engine::CopySpan* spans, size_t n, cudaStream_t stream, CopyDone done) {
  if (n == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(n < 8192 ? n : 8192);
  copy_spans_kernel<<<blocks, 256, 0, stream>>>(spans, n, done);
  return cudaGetLastError();
}

}  // namespace p2p::cuda
