// CUDA facts and helpers the torch-facing engine needs; no torch here.
#pragma once

#include <cstddef>
#include <cstdint>

// Throws an Error naming the failed CUDA runtime call (with cuda_runtime.h and common/error.h
// included), first clearing CUDA's last error: the exception reports it, and left behind it
// would fail the caller's next torch launch check instead.
#define P2P_CUDA_CHECK(call, ...)                                                         \
  do {                                                                                    \
    const cudaError_t p2p_cuda_rc_ = (call);                                              \
    if (p2p_cuda_rc_ != cudaSuccess) {                                                    \
      cudaGetLastError();                                                                 \
      P2P_THROW(ErrorKind::Generic, __VA_ARGS__, ": ", cudaGetErrorString(p2p_cuda_rc_)); \
    }                                                                                     \
  } while (0)

namespace p2p::cuda {

// A driver API function (`name` as in cuda.h, e.g. "cuMemRelease") looked up through the
// runtime, so that the extension does not link libcuda; null if the driver lacks it.
void* driver_function(const char* name);

// True when ptr lies in memory mapped through the CUDA VMM API (cuMemCreate/cuMemMap), as
// PyTorch's expandable segments are: older providers cannot register it for RDMA.
bool is_vmm_memory(const void* ptr);

// True when every operation queued on `stream` so far has completed.
bool idle(void* stream);
// An event of the pool recorded on `stream` (a cudaStream_t of `device`): the point a transfer
// must wait for, or the end of a batch of IPC copies. Throws if it cannot be had or recorded.
// Whoever takes it hands it back with recycle_event once nothing waits on it.
void* record_event(int device, void* stream);
// An event of `device` (DisableTiming) from the process's pool, to record on a stream of one's
// own; every event of the engine goes back with recycle_event.
void* take_event(int device);
void recycle_event(int device, void* event);
// Makes `stream` wait (on the GPU) for `event`, which goes back to the pool.
void wait_event(int device, void* stream, void* event);

}  // namespace p2p::cuda
