// TEMPORARY profiling counters (not for commit).
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
namespace p2p::prof {
enum Slot : int { Submit, Build, Event, Post, WStart, WCopy, WWaitEvent, WLaunch, WReport, DComplete, LoopIter,
                  LQueue, LLaunch, LCopy, LReport, LDone, Busy, Parse, kSlots };
inline std::atomic<uint64_t> total[kSlots];
inline std::atomic<uint64_t> calls[kSlots];
inline uint64_t now() { return std::chrono::steady_clock::now().time_since_epoch().count(); }
inline void add(int s, uint64_t t0) {
  total[s].fetch_add(now() - t0, std::memory_order_relaxed);
  calls[s].fetch_add(1, std::memory_order_relaxed);
}
inline void span(int s, uint64_t a, uint64_t b) {
  if (!a || !b) return;
  total[s].fetch_add(b - a, std::memory_order_relaxed);
  calls[s].fetch_add(1, std::memory_order_relaxed);
}
struct Scope {
  int s;
  uint64_t t0 = now();
  ~Scope() { add(s, t0); }
};
}  // namespace p2p::prof
