// Launchers for the staging copy kernels: raw pointers and a stream, no torch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/copier.h"

namespace p2p::cuda {

// Copies every span (device memory, mapped peer memory or pinned host memory: anything UVA
// reaches) with one kernel: a block per span (up to 8192 blocks of 256 threads, then blocks
// take several), 16-byte vectors where both ends are aligned. `spans` lies in device memory or
// in pinned host memory.
// When `done.flag` is set, the kernel's last block writes `done.value` to it (pinned host
// memory, mapped) once every block's stores are visible to the system: the host learns of the
// copy by reading memory, without a CUDA call. `arrivals` is a zeroed device counter that the
// kernel leaves zeroed; launches that run at once need their own.
struct CopyDone {
  unsigned* arrivals = nullptr;
  volatile uint64_t* flag = nullptr;
  uint64_t value = 0;
};
cudaError_t launch_copy_spans(const core::CopySpan* spans, size_t n, cudaStream_t stream, CopyDone done = {});

// Small pages packed for the page kernel. A packed block holds each list's page pairs (source
// id, destination id, 32-bit), then the lists; `pairs` is the byte offset of a list's first
// pair from the block's start.
struct PagePair {
  int32_t src, dst;
};
struct PackedPages {
  void* dst;
  const void* src;
  int64_t dst_stride, src_stride;
  uint64_t bytes;
  uint32_t n;      // pages
  uint32_t pairs;  // byte offset of its first pair
};

// Copies the pages of `count` lists (at most kMaxPageLists; `most_pages`: the longest list's
// count) with one kernel, a row of blocks per list and a warp per page, so pages are meant to
// be small (the IPC route sends pages over 64 KiB as spans). The lists start `lists` bytes
// into the packed block. A block of up to kPackedParamBytes goes with the launch itself
// (`host`; the kernel reads it from the constant bank: no read of host memory on the copy's
// critical path); a larger one is read by the kernel from `device` (mapped pinned memory).
constexpr size_t kMaxPageLists = 65535;  // the grid's y dimension
#if CUDART_VERSION >= 12010
// Launch parameters of up to 32764 bytes (Volta on, driver R530 on: what a CUDA 12.1 runtime
// asks for, though minor-version compatibility lets it start on an older one, where such a
// launch fails and the IPC route reports the CUDA error).
constexpr size_t kPackedParamBytes = 32704;
#else
constexpr size_t kPackedParamBytes = 4032;  // launch parameters of up to 4096 bytes
#endif
cudaError_t launch_packed_pages(const char* host, const char* device, size_t bytes, size_t lists, size_t count,
                                uint64_t most_pages, cudaStream_t stream, CopyDone done = {});

// Loads every kernel above onto the current device now. CUDA loads a kernel at its first
// launch (lazy loading, the default since 12.2), so without this the first call of each shape
// (engine.warm() launches only the span kernel; a call of small pages launches a page kernel)
// pays for the load on its request path.
cudaError_t load_copy_kernels();

}  // namespace p2p::cuda
