#include "cuda/copy_kernels.h"

#include <cstdint>

namespace p2p::cuda {
namespace {

// Copies len bytes with the threads of one block, 16-byte vectors where both ends are aligned.
__device__ void copy_bytes(char* dst, const char* src, size_t len) {
  size_t head = 0;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const size_t vectors = len / 16;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    const size_t step = blockDim.x;
    size_t i = threadIdx.x;
    // Four loads in flight per thread before the stores: reads of a peer's memory are slow to
    // return, and a pull (reads through the mapping) waited on them.
    for (; i + 3 * step < vectors; i += 4 * step) {
      const uint4 a = s4[i], b = s4[i + step], c = s4[i + 2 * step], d = s4[i + 3 * step];
      d4[i] = a;
      d4[i + step] = b;
      d4[i + 2 * step] = c;
      d4[i + 3 * step] = d;
    }
    for (; i < vectors; i += step) d4[i] = s4[i];
    head = vectors * 16;
  }
  for (size_t i = head + threadIdx.x; i < len; i += blockDim.x) dst[i] = src[i];
}

// The last block to finish tells the host: each block makes its stores (local and peer)
// visible to the system before it counts itself, and the last one resets the counter for the
// next launch before it writes the flag.
__device__ void signal(const CopyDone& done) {
  if (!done.flag) return;
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence_system();
  if (atomicAdd(done.arrivals, 1u) != gridDim.x * gridDim.y - 1) return;
  *done.arrivals = 0;
  __threadfence_system();
  *done.flag = done.value;
}

// NOTE: one thread reads a descriptor and the block shares it: with every warp reading it,
// 4096 spans of 4 KiB whose descriptors lie in pinned host memory cost eight PCIe reads per
// span instead of one.
__global__ void copy_spans_kernel(const engine::CopySpan* spans, size_t n, CopyDone done) {
  __shared__ engine::CopySpan shared;
  for (size_t s = blockIdx.x; s < n; s += gridDim.x) {
    if (threadIdx.x == 0) shared = spans[s];
    __syncthreads();
    const engine::CopySpan span = shared;
    __syncthreads();
    copy_bytes(static_cast<char*>(span.dst), static_cast<const char*>(span.src), span.len);
  }
  signal(done);
}

// Block row y copies the pages of list y, a page per block and turn.
__global__ void copy_pages_kernel(const engine::CopyPages* lists, CopyDone done) {
  __shared__ engine::CopyPages list;
  __shared__ int64_t ids[2];
  if (threadIdx.x == 0) list = lists[blockIdx.y];
  __syncthreads();
  for (uint64_t k = blockIdx.x; k < list.n; k += gridDim.x) {
    if (threadIdx.x == 0) {
      ids[0] = list.src_ids[k];
      ids[1] = list.dst_ids[k];
    }
    __syncthreads();
    const char* src = static_cast<const char*>(list.src) + ids[0] * list.src_stride;
    char* dst = static_cast<char*>(list.dst) + ids[1] * list.dst_stride;
    __syncthreads();
    copy_bytes(dst, src, list.bytes);
  }
  signal(done);
}

constexpr unsigned kBlocks = 8192;  // enough to fill any GPU; more blocks take several items

}  // namespace

cudaError_t launch_copy_spans(const engine::CopySpan* spans, size_t n, cudaStream_t stream, CopyDone done) {
  if (n == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(n < kBlocks ? n : kBlocks);
  copy_spans_kernel<<<blocks, 256, 0, stream>>>(spans, n, done);
  return cudaGetLastError();
}

cudaError_t launch_copy_pages(const engine::CopyPages* lists, size_t count, uint64_t most_pages, cudaStream_t stream,
                              CopyDone done) {
  if (count == 0 || most_pages == 0) return cudaSuccess;
  uint64_t per_list = (kBlocks + count - 1) / count;
  if (per_list > most_pages) per_list = most_pages;
  copy_pages_kernel<<<dim3(static_cast<unsigned>(per_list), static_cast<unsigned>(count)), 256, 0, stream>>>(lists,
                                                                                                           done);
  return cudaGetLastError();
}

}  // namespace p2p::cuda
