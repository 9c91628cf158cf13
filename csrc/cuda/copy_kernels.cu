#include "cuda/copy_kernels.h"

#include <cstdint>
#include <cstring>

namespace p2p::cuda {
namespace {

// Copies len bytes with `threads` threads (a block, or a warp), this one being `rank`, 16-byte
// vectors where both ends are aligned. `kInFlight` loads per thread are issued before their
// stores: reads of a peer's memory are slow to return, and a pull reads through the mapping.
template <int kInFlight>
__device__ void copy_bytes(char* dst, const char* src, size_t len, unsigned rank, unsigned threads) {
  size_t head = 0;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const size_t vectors = len / 16;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    size_t i = rank;
    for (; i + (kInFlight - 1) * threads < vectors; i += kInFlight * threads) {
      uint4 v[kInFlight];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) v[j] = s4[i + j * threads];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) d4[i + j * threads] = v[j];
    }
    for (; i < vectors; i += threads) d4[i] = s4[i];
    head = vectors * 16;
  }
  for (size_t i = head + rank; i < len; i += threads) dst[i] = src[i];
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
__global__ void copy_spans_kernel(const core::CopySpan* spans, size_t n, CopyDone done) {
  __shared__ core::CopySpan shared;
  for (size_t s = blockIdx.x; s < n; s += gridDim.x) {
    if (threadIdx.x == 0) shared = spans[s];
    __syncthreads();
    const core::CopySpan span = shared;
    __syncthreads();
    copy_bytes<4>(static_cast<char*>(span.dst), static_cast<const char*>(span.src), span.len, threadIdx.x, blockDim.x);
  }
  signal(done);
}

// Block row y copies the pages of list y, a page per warp and turn: a small page spread over a
// whole block gives each thread one vector, while a warp gives each lane several loads in
// flight. The pairs of a turn's pages lie side by side: one read fetches them for the block
// (from host memory, one read instead of one per page).
__device__ void copy_packed_pages(const char* packed, size_t lists, const CopyDone& done) {
  constexpr unsigned kWarps = 8;  // blockDim.x / 32
  __shared__ PackedPages list;
  __shared__ PagePair turn[kWarps];
  if (threadIdx.x == 0) list = reinterpret_cast<const PackedPages*>(packed + lists)[blockIdx.y];
  __syncthreads();
  const auto* pairs = reinterpret_cast<const PagePair*>(packed + list.pairs);
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (uint64_t first = uint64_t{blockIdx.x} * kWarps; first < list.n; first += uint64_t{gridDim.x} * kWarps) {
    if (threadIdx.x < kWarps && first + threadIdx.x < list.n) turn[threadIdx.x] = pairs[first + threadIdx.x];
    __syncthreads();
    if (first + warp < list.n)
      copy_bytes<8>(static_cast<char*>(list.dst) + turn[warp].dst * list.dst_stride,
                    static_cast<const char*>(list.src) + turn[warp].src * list.src_stride, list.bytes, lane, 32);
    __syncthreads();  // the turn's pairs are read before the next turn's replace them
  }
  signal(done);
}

template <size_t N>
struct PackedParams {
  alignas(16) char bytes[N];
};

template <size_t N>
__global__ void copy_packed_params_kernel(const __grid_constant__ PackedParams<N> packed, size_t lists, CopyDone done) {
  copy_packed_pages(packed.bytes, lists, done);
}

__global__ void copy_packed_mapped_kernel(const char* packed, size_t lists, CopyDone done) {
  copy_packed_pages(packed, lists, done);
}

// The parameter block's size is fixed per kernel and every launch carries all of it: a small
// block takes the smallest kernel that holds it.
template <size_t N>
cudaError_t launch_with_params(const char* host, size_t bytes, size_t lists, dim3 grid, cudaStream_t stream,
                               const CopyDone& done) {
  PackedParams<N> packed;
  memcpy(packed.bytes, host, bytes);
  copy_packed_params_kernel<N><<<grid, 256, 0, stream>>>(packed, lists, done);
  return cudaGetLastError();
}

constexpr unsigned kBlocks = 8192;  // enough to fill any GPU; more blocks take several items

}  // namespace

// A launch that must signal runs even with nothing to copy: its ticket waits for the flag.
cudaError_t launch_copy_spans(const core::CopySpan* spans, size_t n, cudaStream_t stream, CopyDone done) {
  if (n == 0 && !done.flag) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(n == 0 ? 1 : n < kBlocks ? n : kBlocks);
  copy_spans_kernel<<<blocks, 256, 0, stream>>>(spans, n, done);
  return cudaGetLastError();
}

cudaError_t launch_packed_pages(const char* host, const char* device, size_t bytes, size_t lists, size_t count,
                                uint64_t most_pages, cudaStream_t stream, CopyDone done) {
  if (count == 0) return cudaSuccess;
  const uint64_t blocks_needed = (most_pages + 7) / 8;  // 8 warps per block
  uint64_t per_list = (kBlocks + count - 1) / count;
  if (per_list > blocks_needed) per_list = blocks_needed;
  const dim3 grid(static_cast<unsigned>(per_list > 0 ? per_list : 1), static_cast<unsigned>(count));
  if (device) {
    copy_packed_mapped_kernel<<<grid, 256, 0, stream>>>(device, lists, done);
    return cudaGetLastError();
  }
  if (bytes <= 1008) return launch_with_params<1008>(host, bytes, lists, grid, stream, done);
  if (bytes <= 4032) return launch_with_params<4032>(host, bytes, lists, grid, stream, done);
#if CUDART_VERSION >= 12010
  if (bytes <= 12224) return launch_with_params<12224>(host, bytes, lists, grid, stream, done);
  if (bytes <= kPackedParamBytes) return launch_with_params<kPackedParamBytes>(host, bytes, lists, grid, stream, done);
#endif
  return cudaErrorInvalidValue;
}

cudaError_t load_copy_kernels() {
  cudaFuncAttributes attributes;
  const void* kernels[] = {
      reinterpret_cast<const void*>(copy_spans_kernel),
      reinterpret_cast<const void*>(copy_packed_mapped_kernel),
      reinterpret_cast<const void*>(copy_packed_params_kernel<1008>),
      reinterpret_cast<const void*>(copy_packed_params_kernel<4032>),
#if CUDART_VERSION >= 12010
      reinterpret_cast<const void*>(copy_packed_params_kernel<12224>),
      reinterpret_cast<const void*>(copy_packed_params_kernel<kPackedParamBytes>),
#endif
  };
  for (const void* kernel : kernels)
    if (const cudaError_t rc = cudaFuncGetAttributes(&attributes, kernel); rc != cudaSuccess) return rc;
  return cudaSuccess;
}

}  // namespace p2p::cuda
