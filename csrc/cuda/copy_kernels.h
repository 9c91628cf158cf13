// Launchers for the staging copy kernels: raw pointers and a stream, no torch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "engine/copier.h"

namespace p2p::cuda {

// Copies every span (GPU memory <-> pinned host memory, both reachable through UVA) with one
// kernel: a block per span, 16-byte vectors where both ends are aligned. `spans` itself lies
// in pinned host memory.
cudaError_t launch_copy_spans(const engine::CopySpan* spans, size_t n, cudaStream_t stream);

}  // namespace p2p::cuda
