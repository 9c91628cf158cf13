// CUDA facts and helpers the torch-facing engine needs; no torch here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace p2p::cuda {

// True when ptr lies in memory mapped through the CUDA VMM API (cuMemCreate/cuMemMap), as
// PyTorch's expandable segments are: older providers cannot register it for RDMA.
bool is_vmm_memory(const void* ptr);

// Creates an event recorded on `stream` (a cudaStream_t of `device`): the point a transfer
// must wait for. The worker hands it back with recycle_event once nothing waits on it.
void* record_event(int device, void* stream);
// An event of `device` (DisableTiming) from the process's pool, to record on a stream of one's
// own; every event of the engine goes back with recycle_event.
void* take_event(int device);
void recycle_event(int device, void* event);

// Pinned host flags that CUDA streams can wait on (cuStreamWaitValue32): a receiver orders its
// stream after an arrival without blocking a host thread. A flag only grows, so a slot can be
// reused once its value is written: earlier waits on it stay released.
class StreamFlags {
 public:
  explicit StreamFlags(int device, size_t count = 4096);
  ~StreamFlags();
  // Enqueues on `stream` a wait for a fresh flag; returns the token to release it with.
  uint64_t wait(void* stream);
  void release(uint64_t token);

 private:
  std::mutex mu_;
  uint32_t* host_ = nullptr;
  uint64_t device_ptr_ = 0;
  std::vector<uint32_t> generation_;
  std::vector<size_t> free_;
};

}  // namespace p2p::cuda
