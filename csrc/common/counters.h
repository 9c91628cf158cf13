// Process-wide counts of the paths work took, for tests (_C._counters()): what a setting
// changes where the outcome alone (the bytes that land) cannot tell. Any thread may count;
// relaxed increments, one per call or decision, never per span or byte (the hot loops count
// locally and add once).
#pragma once

#include <atomic>
#include <cstdint>

namespace p2p {

// Every counter: its enum name and the key _C._counters() gives it.
#define P2P_COUNTERS(X)                                                                          \
  X(IpcCopyEngineSpans, ipc_copy_engine_spans) /* IPC copy spans given to the copy engines */    \
  X(IpcKernelSpans, ipc_kernel_spans)          /* IPC copy spans given to the gather kernel */   \
  X(Fences, fences)                            /* fences confirming a shm CUDA IPC RMA */        \
  X(CallerCopies, caller_copies)               /* calls copied by the calling thread */

enum class Counter : int {
#define P2P_COUNTER_ENUM(name, key) name,
  P2P_COUNTERS(P2P_COUNTER_ENUM)
#undef P2P_COUNTER_ENUM
  Count
};

inline std::atomic<uint64_t> counters[static_cast<int>(Counter::Count)];

inline void count(Counter c, uint64_t n = 1) {
  if (n) counters[static_cast<int>(c)].fetch_add(n, std::memory_order_relaxed);
}
inline uint64_t counted(Counter c) { return counters[static_cast<int>(c)].load(std::memory_order_relaxed); }

}  // namespace p2p
