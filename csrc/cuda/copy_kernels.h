// Launchers for the staging copy kernels: raw pointers and a stream, no torch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "engine/copier.h"

namespace p2p::cuda {

// Copies every span (device memory, mapped peer memory or pinned host memory: anything UVA
// reaches) with one kernel: a block per span (up to 8192 blocks of 256 threads, then blocks
// take several), 16-byte vectors where both ends are aligned. `spans` lies in device memory or
// in pinned host memory.
cudaError_t launch_copy_spans(const engine::CopySpan* spans, size_t n, cudaStream_t stream);

}  // namespace p2p::cuda
