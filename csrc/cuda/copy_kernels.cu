#include "cuda/copy_kernels.h"

#include <cstdint>

namespace p2p::cuda {
namespace {

__global__ void copy_spans_kernel(const engine::CopySpan* spans, size_t n) {
  for (size_t s = blockIdx.x; s < n; s += gridDim.x) {
    const engine::CopySpan span = spans[s];
    const char* src = static_cast<const char*>(span.src);
    char* dst = static_cast<char*>(span.dst);
    size_t head = 0;
    if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
      const size_t vectors = span.len / 16;
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* d4 = reinterpret_cast<uint4*>(dst);
      for (size_t i = threadIdx.x; i < vectors; i += blockDim.x) d4[i] = s4[i];
      head = vectors * 16;
    }
    for (size_t i = head + threadIdx.x; i < span.len; i += blockDim.x) dst[i] = src[i];
  }
}

}  // namespace

cudaError_t launch_copy_spans(const engine::CopySpan* spans, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(n < 1024 ? n : 1024);
  copy_spans_kernel<<<blocks, 256, 0, stream>>>(spans, n);
  return cudaGetLastError();
}

}  // namespace p2p::cuda
