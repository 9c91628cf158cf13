// Process-wide counts of the paths work took, for tests (_C._counters()): what a setting
// changes where the outcome alone (the bytes that land) cannot tell. Any thread may count;
// relaxed increments, one per call or decision, never per span or byte (the hot loops count
// locally and add once).
#pragma once

#include <atomic>
#include <cstdint>

namespace p2p {

enum class Counter : int {
  IpcCopyEngineSpans,  // IPC copy spans given to the copy engines (cudaMemcpyAsync)
  IpcKernelSpans,      // IPC copy spans given to the gather kernel
  Fences,              // Fences sent to confirm a shm CUDA IPC RMA (routes/fabric)
  Count
};

inline std::atomic<uint64_t> counters[static_cast<int>(Counter::Count)];

inline void count(Counter c, uint64_t n = 1) {
  if (n) counters[static_cast<int>(c)].fetch_add(n, std::memory_order_relaxed);
}
inline uint64_t counted(Counter c) { return counters[static_cast<int>(c)].load(std::memory_order_relaxed); }

}  // namespace p2p
